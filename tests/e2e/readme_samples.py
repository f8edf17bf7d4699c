"""Write the README's sample outputs from what the code prints.

    python -m tests.e2e.readme_samples                  # rewrite README.md's sample regions
    python -m tests.e2e.readme_samples --check          # exit 1 if one is out of date (tests/e2e/test_readme_samples.py)
    python -m tests.e2e.readme_samples --run-demo DIR   # run the demo into DIR, record it, rewrite
    python -m tests.e2e.readme_samples --run-sweep DIR  # run the sweep of tests/runs/test_sweep.py into DIR, record it, rewrite

Each region of README.md between ``<!-- sample NAME: ... -->`` and ``<!-- /sample -->`` is
rendered here, never edited by hand:

* ``estimate``: ``python -m rm.estimate`` run for real, its stdout as it is;
* ``demo`` and ``demo-figures``: the demo's final eval line, rendered by ``rm.evaluation.metrics.format_eval``
  from the metrics the recorded run wrote, and the figures of that run (accuracy, wall time, the
  machine's 1-minute load average before and after);
* ``sweep``: the table ``rm.runs.sweep.format_summary`` prints for the recorded sweep.

Measurements (a run's metrics, seconds, load) cannot be recomputed by a test, so ``--run-demo`` and
``--run-sweep`` run the command and keep what it wrote in ``docs/readme_samples.json``; the README is
then rendered from that record with the code's own formatters, so a change of format shows up as a
stale README. ``tests/runs/test_sweep.py`` checks the recorded sweep's statuses and estimates against a
fresh run, and the slow demo test checks the recorded accuracy against its run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RECORD = ROOT / "docs" / "readme_samples.json"

ESTIMATE_ARGS = ["memory_profile=full", "hardware=a100_40g", "distributed.num_processes=8"]
DEMO_ARGS = ["experiment=tiny"]
SWEEP_ARGS = ["hardware.device_memory_gib=0.032", "hardware.headroom_gib=0", "train.logging.track_memory=true",
              "memory_profile=full,lora,8bit,offload", "lora.r=8,16"]
REGION = re.compile(r"(<!-- sample (?P<name>[\w-]+): [^>]*-->\n)(?P<body>.*?)(<!-- /sample -->)", re.S)


def load_record() -> Dict:
    return json.loads(RECORD.read_text()) if RECORD.is_file() else {}


def save_record(record: Dict) -> None:
    RECORD.write_text(json.dumps(record, indent=2) + "\n")  # key order kept: format_eval prints in the run's order


def _env() -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def render_estimate() -> str:
    proc = subprocess.run([sys.executable, "-m", "rm.estimate", *ESTIMATE_ARGS], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, 3):  # 3: does not fit, which is what the sample shows
        raise RuntimeError(f"rm.estimate failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return f"```\n$ python -m rm.estimate {' '.join(ESTIMATE_ARGS)}\n{proc.stdout.rstrip()}\n```\n"


def render_demo(demo: Dict) -> str:
    from rm.evaluation.metrics import format_eval

    metrics = {k: float("nan") if v is None else v for k, v in demo["eval"].items()}  # metrics.jsonl writes NaN as null
    return (f"```\nstep {demo['step']}: {format_eval(metrics)}\n"
            "saved the reward model to outputs/<date>/<time>/final\n```\n")


def render_demo_figures(demo: Dict) -> str:
    return (
        f"Measured on a 2-core CPU {'shared with other work' if demo['load_before'] > 1.0 else 'otherwise idle'} "
        f"({demo['machine']}), the whole command including "
        f"start-up: **{demo['eval']['eval_accuracy']:.3f} pairwise accuracy on the "
        f"{int(demo['eval']['eval_pairs']):,} synthetic test pairs in {demo['wall_s']:.0f} s** (`train.seed=42`, the "
        f"default; 1-minute load average {demo['load_before']:.2f} before the run and {demo['load_after']:.2f} after "
        f"it, the run's own two threads included), measured on {demo['date']} with `python -m tests.e2e.readme_samples "
        f"--run-demo DIR`, which runs `python -m rm.train {' '.join(demo['args'])} hydra.run.dir=DIR`. The slow test "
        "`tests/training/test_train.py::test_demo_reaches_90_percent` runs the same command and asserts at least 0.90."
        + (f" {demo['note']}" if demo.get("note") else "") + "\n"
    )


def render_sweep(sweep: Dict) -> str:
    from rm.runs.sweep import format_summary

    return f"```\n{format_summary(sweep['records'])}\n```\n"


def render_all(record: Dict) -> Dict[str, str]:
    return {
        "estimate": render_estimate(),
        "demo": render_demo(record["demo"]),
        "demo-figures": render_demo_figures(record["demo"]),
        "sweep": render_sweep(record["sweep"]),
    }


def rewrite(text: str, bodies: Dict[str, str]) -> str:
    found = [m.group("name") for m in REGION.finditer(text)]
    if sorted(found) != sorted(bodies):
        raise ValueError(f"README sample regions {sorted(found)} != generated {sorted(bodies)}")
    return REGION.sub(lambda m: m.group(1) + bodies[m.group("name")] + m.group(4), text)


def load_average() -> float:
    return os.getloadavg()[0]


def run_demo(run_dir: Path) -> Dict:
    """The README's demo command, timed from the outside like ``/usr/bin/time``."""
    before = load_average()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rm.train", *DEMO_ARGS, f"hydra.run.dir={run_dir}"], cwd=ROOT, env=_env())
    wall = time.perf_counter() - start
    after = load_average()
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed with exit code {proc.returncode}")
    evals = [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if m["event"] == "eval"]
    final = evals[-1]
    return {"args": DEMO_ARGS, "step": final.pop("step"), "eval": {k: v for k, v in final.items() if k not in ("event", "time")},
            "wall_s": round(wall, 1), "load_before": before, "load_after": after,
            "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs visible, torch threads default"}


def run_sweep(sweep_dir: Path) -> Dict:
    from tests.runs.test_sweep import SMALL_RUN

    proc = subprocess.run([sys.executable, "-m", "rm.train", "-m", *SMALL_RUN, *SWEEP_ARGS, f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"the sweep failed with exit code {proc.returncode}")
    return {"args": SMALL_RUN + SWEEP_ARGS, "records": json.loads((sweep_dir / "summary.json").read_text())}


def main(argv: List[str]) -> int:
    record = load_record()
    if "--run-demo" in argv:
        record["demo"] = run_demo(Path(argv[argv.index("--run-demo") + 1]))
        save_record(record)
    if "--run-sweep" in argv:
        record["sweep"] = run_sweep(Path(argv[argv.index("--run-sweep") + 1]))
        save_record(record)
    text = README.read_text()
    new = rewrite(text, render_all(record))
    if "--check" in argv:
        if new != text:
            print("README.md sample outputs are out of date: run python -m tests.e2e.readme_samples", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
