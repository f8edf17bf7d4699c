"""DDP under gradient accumulation, through rm's engine on two real processes (gloo): one all-reduce per step (and
the process's first micro-batch), the step's average gradient, and gradients that live in DDP's buckets."""

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import CONF_DIR

STEPS, ACCUMULATION = 3, 4

# Each rank: AccelerateEngine around two linears, STEPS steps of ACCUMULATION micro-batches, a comm hook counting the
# buckets all-reduced. Every rank draws every rank's data (seeded by step, micro-batch and rank), so it can compute
# the gradient the step should have, the mean over both ranks' micro-batches, without DDP.
WORKER = r"""
import torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from rm.distributed.engine import AccelerateEngine

STEPS, ACCUMULATION = {steps}, {accumulation}
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
reference.load_state_dict(net.state_dict())
engine = AccelerateEngine(cpu=True, precision="32-true", gradient_accumulation_steps=ACCUMULATION, max_grad_norm=0.0)
model = engine.prepare(net, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                       lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0))
assert engine.num_processes == 2 and isinstance(model, torch.nn.parallel.DistributedDataParallel)
calls = [0]
def counting(state, bucket):
    calls[0] += 1
    return allreduce_hook(state, bucket)
model.register_comm_hook(None, counting)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

def batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 8, generator=g)

for step in range(STEPS):
    views_at_start = [p.grad is not None and p.grad._base is not None for p in model.parameters()]
    before = calls[0]
    for micro in range(ACCUMULATION):
        with engine.micro_batch(last=micro == ACCUMULATION - 1):
            loss = model(batch(step, micro, engine.process_index)).pow(2).mean()
            engine.backward(loss, share=1 / ACCUMULATION)
    reference_optimizer.zero_grad()
    for rank in range(2):
        for micro in range(ACCUMULATION):
            (reference(batch(step, micro, rank)).pow(2).mean() / (2 * ACCUMULATION)).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-7)
    engine.clip_gradients()
    engine.step()
    reference_optimizer.step()
    views = [p.grad is not None and p.grad._base is not None and not p.grad.any() for p in model.parameters()]
    if engine.process_index == 0:
        print(f"step {{step + 1}}: all-reduces {{calls[0] - before}}, views at start {{all(views_at_start)}}, "
              f"zeroed views after {{all(views)}}", flush=True)
engine.end()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_ddp_all_reduces_once_a_step_and_averages_the_step(tmp_path):
    """Before, the forward ran outside ``no_sync``, and DDP all-reduced every micro-batch: 4 a step. Now: the
    process's first micro-batch and each step's last (one bucket here: 2, then 1, then 1), the gradients equal
    the mean over both ranks' micro-batches, and from the end of step 1 on ``.grad`` are zeroed views of the
    buckets between steps, where the next step's no_sync backwards add in place."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(steps=STEPS, accumulation=ACCUMULATION))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(CONF_DIR.parent)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert lines == [
        "step 1: all-reduces 2, views at start False, zeroed views after True",
        "step 2: all-reduces 1, views at start True, zeroed views after True",
        "step 3: all-reduces 1, views at start True, zeroed views after True",
    ], proc.stdout[-3000:] + proc.stderr[-3000:]
