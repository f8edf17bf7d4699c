"""How many gradient all-reduces DDP makes over 2 steps of 4 micro-batches, with the forward outside ``no_sync`` (as
rm's engine had it until 2026-12-07: only the backward was wrapped) and inside it (as PyTorch documents, and as
``rm.distributed.engine.AccelerateEngine.micro_batch`` now does; tests/distributed/test_ddp_accumulation.py counts
rm's own: one a step, and one more at the process's first micro-batch).

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 benchmarks/ddp_no_sync_allreduces.py

DDP reads ``no_sync`` in the forward (``_post_forward`` prepares the reducer for the backward), so a backward under
``no_sync`` whose forward ran outside it still all-reduces. Measured 2026-12-07 on 2 CPU cores (gloo): 8 and 2. A comm
hook counts each bucket's all-reduce; the model is two small linears, one bucket. Only the counts are printed: the
time this costs depends on the interconnect and is not measured here.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, ACCUMULATION = 2, 4


def count(forward_inside: bool) -> int:
    calls = [0]

    def hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), gradient_as_bucket_view=True)
    model.register_comm_hook(None, hook)
    for _ in range(STEPS):
        for micro in range(ACCUMULATION):
            context = torch.enable_grad() if micro == ACCUMULATION - 1 else model.no_sync()
            x = torch.randn(4, 8)
            if forward_inside:
                with context:
                    model(x).sum().backward()
            else:
                loss = model(x).sum()
                with context:
                    loss.backward()
        for p in model.parameters():
            p.grad = None
    return calls[0]


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    outside, inside = count(False), count(True)
    if dist.get_rank() == 0:
        print(f"all-reduces over {STEPS} steps x {ACCUMULATION} micro-batches: forward outside no_sync {outside}, "
              f"inside {inside} (once a step: {STEPS})")
    dist.destroy_process_group()
