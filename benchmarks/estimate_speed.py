"""How long the pre-flight estimate takes: the CLI as a user runs it, and the estimate alone.

    python benchmarks/estimate_speed.py            # prints a table; about a minute on an idle 2-core CPU

Targets (issue 13): the Mistral-7B estimate under 2 s after imports, the `rm.estimate` CLI under 8 s
wall on an idle 2-core machine. The 1-minute load average is printed beside each figure: timings
taken on a busy machine are not comparable.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
MISTRAL = ["model=mistral_7b", "memory_profile=lora", "hardware=h100_80g", "train.micro_batch_size=4",
           "data.max_length=512", "train.gradient_checkpointing=true"]
# Refused on a 24 GB card: the table, then the search for changes that fit (each traced afresh).
REFUSED = ["model=mistral_7b", "memory_profile=lora", "hardware=rtx4090_24g", "train.micro_batch_size=4",
           "data.max_length=512", "train.gradient_checkpointing=false"]


def wall(argv, repeats: int, cache: Optional[str] = None) -> tuple:
    """Median and spread of the wall time of a fresh process, its median CPU time (user + system: less
    sensitive to other jobs than wall time), and the load average before it. Each process traces afresh (an
    empty ``RM_CACHE``), unless ``cache`` names the directory of traces to read (rm.memory.trace's disk cache)."""
    times, cpu, load = [], [], os.getloadavg()[0]
    for _ in range(repeats):
        env = {**os.environ, "RM_CACHE": cache or tempfile.mkdtemp(prefix="rm-cache-")}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        if proc.returncode not in (0, 3):
            sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return statistics.median(times), min(times), max(times), statistics.median(cpu), load


def in_process(repeats: int) -> list:
    """The estimate after imports: compose, validate, estimate (first call traces, later calls hit the in-memory cache)."""
    code = f"""
import time, json
t0 = time.perf_counter()
from rm.foundations.cli import without_bitsandbytes
without_bitsandbytes()  # as the CLI does
from rm.foundations.config import compose
from rm.memory.terms import estimate_run
from rm.foundations.hardware import resolve_hardware
from rm.settings.validate import resolve_world_size, validate
import transformers.models.mistral.modeling_mistral
import peft  # the LoRA trace wraps the model with it
imports = time.perf_counter() - t0
out = []
for i in range({repeats}):
    t0 = time.perf_counter()
    cfg = compose({MISTRAL!r})
    cfg.hardware = resolve_hardware(cfg.hardware)
    plan = validate(cfg, *resolve_world_size(cfg.distributed, launched=False))
    estimate_run(cfg, plan)
    out.append(time.perf_counter() - t0)
print(json.dumps([imports] + out))
"""
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={**os.environ, "RM_CACHE": tempfile.mkdtemp(prefix="rm-cache-")})
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1]) + [load]


def main() -> None:
    repeats = 3
    rows = []
    for label, argv in [
        ("`python -m rm.estimate --help`", [sys.executable, "-m", "rm.estimate", "--help"]),
        ("`python -m rm.estimate` (Mistral-7B LoRA, H100)", [sys.executable, "-m", "rm.estimate", *MISTRAL]),
        ("`python -m rm.estimate estimate.json=true` (same)", [sys.executable, "-m", "rm.estimate", *MISTRAL, "estimate.json=true"]),
        ("`python -m rm.estimate` refused, with the changes that fit (24 GB, no checkpointing)",
         [sys.executable, "-m", "rm.estimate", *REFUSED]),
    ]:
        median, lo, hi, cpu, load = wall(argv, repeats)
        rows.append((label, f"{median:.2f} s (min {lo:.2f}, max {hi:.2f}, {repeats} runs)", f"{cpu:.2f} s", f"{load:.2f}"))
    warm = tempfile.mkdtemp(prefix="rm-cache-")
    subprocess.run([sys.executable, "-m", "rm.estimate", *MISTRAL], cwd=ROOT, capture_output=True, check=True,
                   env={**os.environ, "RM_CACHE": warm})
    median, lo, hi, cpu, load = wall([sys.executable, "-m", "rm.estimate", *MISTRAL], repeats, cache=warm)
    rows.append(("the same, its traces read from `$RM_CACHE/trace`", f"{median:.2f} s (min {lo:.2f}, max {hi:.2f}, "
                 f"{repeats} runs)", f"{cpu:.2f} s", f"{load:.2f}"))
    imports, first, *cached, load = in_process(3)
    rows.append(("imports (rm.estimate, transformers' Mistral)", f"{imports:.2f} s", f"{load:.2f}"))
    rows.append(("Mistral-7B estimate after imports, first call", f"{first:.2f} s", f"{load:.2f}"))
    rows.append(("the same, later calls (traces cached)", f"{statistics.median(cached):.3f} s", f"{load:.2f}"))
    print(f"{os.cpu_count()} CPUs; overrides: {' '.join(MISTRAL)}; refused: {' '.join(REFUSED)}\n")
    print("| what | wall time | CPU time | 1-min load before |\n| --- | ---: | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
