"""How long ``python -m rm.plan`` takes as a whole command, with its traces cached and without (issue 29 item 2).

    python benchmarks/plan_speed.py                                  # the 7B space: model=mistral_7b hardware=h100_80g
    python benchmarks/plan_speed.py --runs 7 model=llama3_8b hardware=a100_80g

Each run is a fresh process. "cold": an empty trace cache (a first plan of this shape on a machine; the CPU rates
stay measured, as after any first run); "warm": the traces cached by the run before. Cold and warm runs alternate,
two seconds apart. Prints each run's seconds with the 1-minute load average before it, then the median, minimum and
maximum of each kind. The cache is a temporary directory, never the user's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(overrides, cache: Path) -> float:
    env = {**os.environ, "RM_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rm.plan", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        sys.exit(f"rm.plan failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="cold and warm runs each (default 5)")
    args, overrides = parser.parse_known_args()
    overrides = overrides or ["model=mistral_7b", "hardware=h100_80g"]
    times = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        real = Path(os.environ.get("RM_CACHE") or Path.home() / ".cache" / "rm") / "speed"
        if real.is_dir():  # the machine's measured CPU rates, as any run after the first has them
            shutil.copytree(real, cache / "speed")
        print(f"python -m rm.plan {' '.join(overrides)}: {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        for i in range(args.runs):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    shutil.rmtree(cache / "trace", ignore_errors=True)
                time.sleep(2)
                load = os.getloadavg()[0]
                seconds = run_once(overrides, cache)
                times[kind].append(seconds)
                print(f"  run {i + 1} {kind}: {seconds:6.2f} s  (load {load:.2f} before)", flush=True)
    for kind, values in times.items():
        print(f"{kind}: median {statistics.median(values):.2f} s, min {min(values):.2f}, max {max(values):.2f} "
              f"over {len(values)} runs")


if __name__ == "__main__":
    main()
