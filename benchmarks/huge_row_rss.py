"""What one huge row costs a run: peak resident memory of ``python -m rm.train`` with and without it.

    python benchmarks/huge_row_rss.py                 # 200 synthetic pairs, and the same with one 50 MB row
    python benchmarks/huge_row_rss.py --mb 20 --pairs 400

Writes the pairs to a jsonl file twice, the second time with one extra row whose chosen side is ``--mb``
megabytes of words, trains 2 steps of ``experiment=tiny`` on each (a fresh run directory each), and prints
the peak RSS of each process (``resource.getrusage`` of the children) and the wall time, with the 1-minute
load average before and after. The row is cut to its last ``64 x data.max_length`` characters before it
tokenizes (``rm.data.normalise.max_chars_for``): the two peaks should differ by a small constant. Nothing is
asserted: a measurement on a shared machine is not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(data: Path, run_dir: Path) -> tuple:
    """Peak RSS (MiB) and wall seconds of one 2-step run; the process runs alone, so the children's maximum is its."""
    args = [sys.executable, "-m", "rm.train", "experiment=tiny", "hardware=cpu", "data=local", f"data.train_files=[{data}]",
            "train.max_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", f"hydra.run.dir={run_dir}"]
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode); "
            "sys.stderr.write(p.stderr[-3000:] if p.returncode else '')")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    maxrss_kib, rc = proc.stdout.split()
    if rc != "0":
        raise SystemExit(f"rm.train failed (exit {rc}):\n{proc.stderr}")
    return int(maxrss_kib) / 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--mb", type=float, default=50.0, help="size of the huge row's chosen side")
    args = parser.parse_args()
    from rm.data.synthetic import generate_pairs

    pairs = generate_pairs(args.pairs, seed=0, split="train")
    huge = dict(pairs[0], chosen=pairs[0]["chosen"] + " word" * int(args.mb * 2**20 / 5))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = {}
        for name, rows in (("without", pairs), ("with", [*pairs[:100], huge, *pairs[100:]])):
            path = tmp / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
            results[name] = run(path, tmp / f"run_{name}")
            size = path.stat().st_size / 2**20
            print(f"{name:>7} the huge row: {len(rows)} rows, {size:6.1f} MB file: peak RSS {results[name][0]:7.0f} MiB, "
                  f"wall {results[name][1]:5.1f} s", flush=True)
    extra = results["with"][0] - results["without"][0]
    print(f"the {args.mb:g} MB row adds {extra:.0f} MiB to the peak RSS "
          f"(load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after)")


if __name__ == "__main__":
    main()
