"""Does ``train.layout=auto``'s search slow the training that follows it in the same process?

    python benchmarks/bench_cli_vs_trl.py --data single-turn --keep /tmp/bench        # makes the data, model, runs
    python benchmarks/auto_layout_aftereffect.py /tmp/bench/single-turn --turns 6 --clock cpu
    python benchmarks/auto_layout_aftereffect.py /tmp/bench/single-turn --turns 6 --clock wall

Why: with no layout flags, rm searches the layouts in the training process (it traces candidates with fake tensors)
and then trains the one it chose. A run given that same layout explicitly (``train.layout=given``) computes the
same micro-batches but skips the search. If the search left something behind (a dispatch mode, patched functions,
a fragmented heap, a thread), every step after it would pay, and no flags would trail the explicit layout.

Both arms run ``rm.train`` with ``train.layout=given`` and the layout that the no-flags run of the bench directory
chose; the ``search`` arm first runs ``train.layout=auto``'s search on the schema's default layout in the same
process and throws its answer away. Arms alternate within each turn, the order reversed every other turn. Every
step is logged; each turn is reported by its median step (steps 3 onwards), and the arms are compared step by step
(the same micro-batches at the same step). ``--clock cpu`` times steps in process CPU seconds (both threads), which
a VM's neighbours disturb less than the wall clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ARMS = ("search", "given")


def child(arm: str, clock: str) -> None:
    """One ``rm.train`` process of an arm; the rest of ``sys.argv`` is its command line."""
    import rm.training.run_setup
    import rm.runs.train_state
    import rm.training.trainer

    if clock == "cpu":  # the loop's step timer, in this process's CPU seconds
        rm.training.trainer.time = rm.runs.train_state.time = types.SimpleNamespace(perf_counter=time.process_time)
    choose = rm.training.run_setup.choose_layout

    def search_first(cfg, plan, overrides, lengths, pinned=None):
        if arm == "search":
            from rm.foundations.config import TrainConfig
            from rm.plan.search import KNOBS
            from rm.settings.validate import validate

            defaults = TrainConfig()
            knobs = {k.split(".")[1]: getattr(defaults, k.split(".")[1]) for k in KNOBS}
            auto = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, layout="auto", **knobs))
            auto_plan = validate(auto, plan.world_size, plan.world_size_source, plan.launcher)
            bare = [o for o in overrides if not o.startswith(KNOBS + ("train.layout",))]
            _, _, chosen = choose(auto, auto_plan, bare, lengths, pinned)
            print(f"search (thrown away): {chosen.describe()}", file=sys.stderr)
        return choose(cfg, plan, overrides, lengths, pinned)

    rm.training.run_setup.choose_layout = search_first
    sys.argv[0] = "rm.train"
    runpy.run_module("rm.train", run_name="__main__", alter_sys=True)


def bench_command(bench: Path) -> tuple[list[str], list[str]]:
    """The no-flags run's overrides and the layout it chose, from a ``bench_cli_vs_trl.py --keep`` directory."""
    run = bench / "rm_no_layout_flags-0"
    lines = (run / ".hydra" / "overrides.yaml").read_text().splitlines()
    overrides = [line[2:] for line in lines if line.startswith("- ")]
    chose = re.search(r"train\.layout=auto: (.*?) \(", (run / "train.log").read_text())
    if not chose:
        sys.exit(f"{run / 'train.log'}: no 'train.layout=auto: ...' line; was this the no-flags run?")
    keep = [o for o in overrides if not o.startswith(("hydra.", "train.logging.logging_steps", "train.layout"))]
    return keep, chose.group(1).split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("bench", type=Path, help="a data set's directory of bench_cli_vs_trl.py --keep DIR")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("ARM", "CLOCK"), help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        sys.argv = [sys.argv[0], *rest]
        return child(*args.child)
    base, layout = bench_command(args.bench)
    print(f"layout: {' '.join(layout)}; clock: {args.clock}; 1-minute load {os.getloadavg()[0]:.2f}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    steps: dict[str, list[dict[int, float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.turns):
            for arm in ARMS[:: 1 if turn % 2 == 0 else -1]:
                run_dir = Path(tmp) / arm
                shutil.rmtree(run_dir, ignore_errors=True)
                command = [sys.executable, __file__, str(args.bench), "--child", arm, args.clock, *base, *layout,
                           "train.layout=given", "train.logging.logging_steps=1", f"hydra.run.dir={run_dir}"]
                load = os.getloadavg()[0]
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode:
                    sys.exit(f"{arm} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                times = {r["step"]: r["step_time_s"] for r in records if r["event"] == "train" and r["step"] > 2}
                steps[arm].append(times)
                searched = [line for line in done.stderr.splitlines() if line.startswith("search (thrown away)")]
                if (arm == "search") != bool(searched):
                    sys.exit(f"{arm}: the search {'did not run' if arm == 'search' else 'ran'}")
                if searched and turn == 0:
                    print(f"  {searched[0]}")
                print(f"  turn {turn + 1} {arm:6s}: median step {statistics.median(times.values()):.4f} s "
                      f"(load {load:.2f})", flush=True)
    print(f"\n{args.clock} seconds per step, median of steps 3-{max(steps['given'][0])}:")
    for arm in ARMS:
        medians = [statistics.median(t.values()) for t in steps[arm]]
        print(f"  {arm:6s}: {statistics.median(medians):.4f} (turns: {', '.join(f'{m:.4f}' for m in medians)})")
    ratios = [statistics.median(s[k] / g[k] for k in g) for s, g in zip(steps["search"], steps["given"])]
    print(f"  search / given, step by step, median per turn: {statistics.median(ratios):.3f} "
          f"(turns: {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"1-minute load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
