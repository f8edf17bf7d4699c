"""How long a command takes to answer when it runs nothing: ``--help`` and a misspelt key (issue 50 item 5).

    python benchmarks/cli_startup.py                                   # this checkout, 5 runs of each command
    python benchmarks/cli_startup.py --runs 7 --checkout /tmp/before --checkout .   # two checkouts, interleaved

Each command runs as its own process (interpreter start, imports, Hydra's composition, the answer, exit), timed from
outside; the runs of several checkouts alternate, so that a change of load falls on both. Prints, per checkout and
command, the median, min and max wall seconds over ``--runs`` and the median CPU seconds (user + system, which
depend little on the load where wall seconds do), the exit code, whether torch was imported (one more
run under ``python -X importtime``), and the 1-minute load average before and after. ``startup_phases.py`` times the
phases of a run that trains; this one times what answers before training.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

COMMANDS = {
    "rm.train --help": ["-m", "rm.train", "--help"],
    "rm.train typo": ["-m", "rm.train", "experiment=tiny", "train.learnin_rate=1"],
    "rm.estimate --help": ["-m", "rm.estimate", "--help"],
    "rm.plan --help": ["-m", "rm.plan", "--help"],
}
HEAVY = ("torch", "transformers", "datasets", "peft", "accelerate")


def load() -> float:
    return os.getloadavg()[0]


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(checkout: Path, args: list) -> tuple:
    """Wall seconds, CPU seconds (of the command and every process it started and waited for) and the exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0, cpu0 = time.perf_counter(), cpu_of_children()
    done = subprocess.run([sys.executable, *args], cwd=checkout, env=env, capture_output=True, text=True)
    return time.perf_counter() - t0, cpu_of_children() - cpu0, done.returncode


def heavy_imports(checkout: Path, args: list) -> str:
    done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=checkout, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    names = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return ",".join(m for m in HEAVY if m in names) or "none"


def commit(checkout: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return done.stdout.strip() or "(not a git checkout)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkout", action="append", type=Path, help="a checkout of rm to run in (repeatable)")
    parser.add_argument("--label", action="append", help="a name per --checkout, in the same order")
    opts = parser.parse_args()
    checkouts = [c.resolve() for c in (opts.checkout or [Path(__file__).resolve().parent.parent])]
    labels = opts.label or [f"{c} @ {commit(c)}" for c in checkouts]
    times = {(c, name): [] for c in checkouts for name in COMMANDS}
    cpu = {(c, name): [] for c in checkouts for name in COMMANDS}
    codes = {}
    load_before, started = load(), datetime.now(timezone.utc)
    for _ in range(opts.runs):
        for name, args in COMMANDS.items():
            for c in checkouts:  # alternating: a change of load falls on every checkout alike
                seconds, cpu_seconds, codes[c, name] = run(c, args)
                times[c, name].append(seconds)
                cpu[c, name].append(cpu_seconds)
    load_after = load()
    print(f"{started:%Y-%m-%d %H:%M} UTC, {opts.runs} runs each, {platform.node()}: {os.cpu_count()} CPUs, "
          f"{platform.python_implementation()} {platform.python_version()}, OMP_NUM_THREADS=1; "
          f"1-min load {load_before:.2f} before, {load_after:.2f} after")
    print(f"{'checkout':<30} {'command':<20} {'median s':>9} {'min':>6} {'max':>6} {'cpu s':>6} {'exit':>5}  heavy imports")
    for c, label in zip(checkouts, labels):
        for name, args in COMMANDS.items():
            t = times[c, name]
            print(f"{label:<30} {name:<20} {statistics.median(t):9.2f} {min(t):6.2f} {max(t):6.2f} "
                  f"{statistics.median(cpu[c, name]):6.2f} {codes[c, name]:>5}  "
                  f"{heavy_imports(c, args)}")


if __name__ == "__main__":
    main()
