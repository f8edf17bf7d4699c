"""Wall-clock seconds of one tiny-model training step per torch thread count, at idle and beside busy processes.

    python benchmarks/threads_under_load.py                       # threads 1 and all cores; 0 and 8 busy processes
    python benchmarks/threads_under_load.py --threads 1 2 --busy 0 4 8 --steps 5

The question behind ``train.threads`` (rm.foundations.threads): on a shared CPU, does torch's default of one
thread per core spin against the other jobs? Each row is a fresh process (torch's threads are set before its first
op) that builds ``experiment=tiny``'s model from its config and times forward + backward + AdamW step of one step of
32 pairs of 128 tokens (4 micro-batches of 8, as the demo runs), ``--steps`` times after one warm-up step, while
``--busy`` processes spin on the CPU (``while True: pass``). The table gives the median and the range of the
steps, and the one-minute load average at the start and end of each row: the machine may hold other work than ours.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def spin() -> None:
    while True:
        pass


def one_row(threads: int, steps: int) -> dict:
    """Runs in its own process: time ``steps`` steps at ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    sys.path.insert(0, str(ROOT))
    from rm.foundations.config import compose
    from rm.modelling.model import build_model

    cfg = compose(["experiment=tiny"])
    torch.manual_seed(0)
    model = build_model(cfg.model, 0, "float32", False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, cfg.model.vocab_size, (4, 16, 128))  # 4 micro-batches of 8 pairs (16 sequences)

    def step() -> float:
        start = time.perf_counter()
        for micro in ids:
            rewards = model(input_ids=micro).logits.squeeze(-1)
            loss = -torch.nn.functional.logsigmoid(rewards[0::2] - rewards[1::2]).mean() / len(ids)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()  # warm-up: allocator, kernels
    times = [step() for _ in range(steps)]
    return {"threads": torch.get_num_threads(), "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}))
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 8], help="busy processes beside the timed one")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # internal: time one row in this process
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(one_row(args.row, args.steps)))
        return
    print(f"# {os.uname().nodename}: {cores} cores available, torch default threads = physical cores; "
          f"python {sys.version.split()[0]}")
    print(f"{'busy':>4} {'threads':>7} {'median s':>9} {'min s':>7} {'max s':>7}  load avg start -> end")
    for busy in args.busy:
        spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(busy)]
        for p in spinners:
            p.start()
        try:
            time.sleep(2 if busy else 0)  # let the spinners take their cores
            for threads in args.threads:
                before = os.getloadavg()[0]
                env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
                out = subprocess.run([sys.executable, __file__, "--row", str(threads), "--steps", str(args.steps)],
                                     env=env, capture_output=True, text=True, check=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                print(f"{busy:>4} {row['threads']:>7} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f}"
                      f"  {before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
        finally:
            for p in spinners:
                p.terminate()
                p.join()


if __name__ == "__main__":
    main()
