"""How long ``python -m rm.plan`` takes as a whole command, with its traces cached and without (issue 29 item 2).

    python benchmarks/plan_speed.py                                  # the 7B space: model=mistral_7b hardware=h100_80g
    python benchmarks/plan_speed.py --runs 7 model=llama3_8b hardware=a100_80g
    python benchmarks/plan_speed.py --neighbours --out benchmarks/results/plan_speed.md    # the 7B space and its neighbours

Each run is a fresh process. "cold": an empty trace cache (a first plan of this shape on a machine; the CPU rates
stay measured, as after any first run); "warm": the traces cached by the run before. Cold and warm runs alternate,
two seconds apart. Prints each run's seconds with the 1-minute load average before it, then the median, minimum and
maximum of each kind. The cache is a temporary directory, never the user's.

``--neighbours`` times, the same way, the listed command's neighbours: other models and cards, more processes, a
longer ``data.max_length``, a larger global batch, another memory profile. A card with less memory takes longer:
its fastest layouts do not fit, and each of those is a verdict (a trace or more) before five that fit are found.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
LISTED = ["model=mistral_7b", "hardware=h100_80g"]
NEIGHBOURS = [
    LISTED,
    ["model=llama3_8b", "hardware=a100_80g"],
    ["model=qwen2_7b", "hardware=h200_141g"],
    ["model=mistral_7b", "hardware=h100_80g", "distributed.num_processes=2"],
    ["model=mistral_7b", "hardware=h100_80g", "distributed.num_processes=8"],
    ["model=llama3_8b", "hardware=a100_40g", "distributed.num_processes=8"],
    ["model=mistral_7b", "hardware=h100_80g", "distributed.num_processes=16", "hardware.gpus_per_node=8"],
    ["model=mistral_7b", "hardware=gpu_64g", "distributed.num_processes=8", "memory_profile=full"],
    ["model=qwen2_7b", "hardware=l40s_48g", "distributed.num_processes=4", "memory_profile=qlora"],
    ["model=mistral_7b", "hardware=h100_80g", "data.max_length=2048"],
    ["model=mistral_7b", "hardware=h100_80g", "train.global_batch_size=128"],
    ["model=mistral_7b", "hardware=h100_80g", "memory_profile=full"],
    ["model=mistral_7b", "hardware=a100_40g"],
    ["model=mistral_7b", "hardware=rtx4090_24g"],
]


def run_once(overrides, cache: Path) -> Dict:
    """One ``rm.plan`` process as a user runs it (the table): its seconds, exit code and verdict counts (read off the
    table's last lines: ``580 layouts (84 more refused by validation): 5 fits, 571 unchecked, 4 does not fit.``)."""
    env = {**os.environ, "RM_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rm.plan", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        sys.exit(f"rm.plan failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    counts = re.search(r"refused by validation\): (.*?)\. Checked", proc.stdout)
    verdicts = {}
    for part in counts.group(1).split(", ") if counts else []:
        n, verdict = part.split(" ", 1)
        if verdict != "unchecked":
            verdicts[verdict] = int(n)
    return {"seconds": seconds, "rc": proc.returncode, "verdicts": verdicts}


def measure(overrides: List[str], runs: int, quiet: bool = False) -> Dict:
    """``runs`` cold and ``runs`` warm runs, alternating; their seconds and the last run's verdict counts."""
    times = {"cold": [], "warm": []}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        real = Path(os.environ.get("RM_CACHE") or Path.home() / ".cache" / "rm") / "speed"
        if real.is_dir():  # the machine's measured CPU rates, as any run after the first has them
            shutil.copytree(real, cache / "speed")
        for i in range(runs):
            for kind in ("cold", "warm"):
                if kind == "cold":
                    shutil.rmtree(cache / "trace", ignore_errors=True)
                time.sleep(2)
                load = os.getloadavg()[0]
                loads.append(load)
                found = run_once(overrides, cache)
                times[kind].append(found["seconds"])
                if not quiet:
                    print(f"  run {i + 1} {kind}: {found['seconds']:6.2f} s  (load {load:.2f} before)", flush=True)
    return {"overrides": overrides, **times, "loads": loads, "rc": found["rc"], "verdicts": found["verdicts"]}


def summary(values: List[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def write_doc(rows: List[Dict], out: Path, runs: int, started: str) -> None:
    where = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    lines = ["# How long `python -m rm.plan` takes", "", "```",
             f"python benchmarks/plan_speed.py --neighbours --runs {runs} --out {where}", "```", "",
             f"Measured {started} on this {os.cpu_count()}-core CPU, each command a fresh process, {runs} cold runs (no "
             "trace cached) and as many warm ones (the traces of the run before cached), alternating; seconds as "
             "median (minimum-maximum). Load: the 1-minute load average before the runs, lowest-highest (the runs' "
             "own processes included). Verdicts: what the last run checked (`does not fit` counts layouts refused "
             "on their traces; `(inferred)` ones cost nothing). The issue's goal is the first row under 10 s.", "",
             "| command (`python -m rm.plan ...`) | cold s | warm s | load | verdicts | exit |", "|---|---|---|---|---|---|"]
    for r in rows:
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(r["verdicts"].items()))
        lines.append(f"| `{' '.join(r['overrides'])}` | {summary(r['cold'])} | {summary(r['warm'])} | "
                     f"{min(r['loads']):.2f}-{max(r['loads']):.2f} | {verdicts} | {r['rc']} |")
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None, help="cold and warm runs each (default 5; 3 with --neighbours)")
    parser.add_argument("--neighbours", action="store_true", help="the listed 7B command and its neighbours")
    parser.add_argument("--out", type=Path, help="with --neighbours: write the table there (markdown)")
    args, overrides = parser.parse_known_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.neighbours:
        runs = args.runs or 3
        rows = []
        for overrides in NEIGHBOURS:
            row = measure(overrides, runs, quiet=True)
            rows.append(row)
            print(f"{' '.join(overrides)}: cold {summary(row['cold'])} s, warm {summary(row['warm'])} s, "
                  f"verdicts {row['verdicts']}", flush=True)
        if args.out:
            write_doc(rows, args.out.resolve(), runs, started)
        return
    overrides = overrides or LISTED
    print(f"python -m rm.plan {' '.join(overrides)}: {os.cpu_count()} cores, {started}")
    row = measure(overrides, args.runs or 5)
    for kind in ("cold", "warm"):
        values = row[kind]
        print(f"{kind}: median {statistics.median(values):.2f} s, min {min(values):.2f}, max {max(values):.2f} "
              f"over {len(values)} runs")


if __name__ == "__main__":
    main()
