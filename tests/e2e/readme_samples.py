"""Write the sample outputs of the README and the guides from what the code prints.

    python -m tests.e2e.readme_samples                  # rewrite the sample regions of README.md and docs/*.md
    python -m tests.e2e.readme_samples --check          # exit 1 if one is out of date (tests/e2e/test_readme_samples.py)
    python -m tests.e2e.readme_samples --run-demo DIR   # run the demo into DIR, record it, rewrite
    python -m tests.e2e.readme_samples --run-sweep DIR  # run the sweep of tests/runs/test_sweep.py into DIR, record it, rewrite

Each region of README.md or a page of docs/ between ``<!-- sample NAME: ... -->`` and ``<!-- /sample -->`` is
rendered here, never edited by hand; each name appears once, on whichever page it now lives:

* ``estimate``: ``python -m rm.estimate`` run for real, its stdout as it is (docs/estimate.md);
* ``estimate-verdict``: the same run, its first line and its verdict with the changes that fit (README.md);
* ``profiles``: one line per memory profile (README.md), what it trains and its optimizer read off the profile's
  config, and the estimate's device peak and host RAM for the flagship under it on one H100;
* ``demo`` and ``demo-figures``: the demo's final eval line, rendered by ``rm.evaluation.metrics.format_eval``
  from the metrics the recorded run wrote, and the figures of that run (accuracy, wall time, the
  machine's 1-minute load average before and after);
* ``sweep``: the table ``rm.runs.sweep.format_summary`` prints for the recorded sweep.

Measurements (a run's metrics, seconds, load) cannot be recomputed by a test, so ``--run-demo`` and
``--run-sweep`` run the command and keep what it wrote in ``benchmarks/results/readme_samples.json``; the README is
then rendered from that record with the code's own formatters, so a change of format shows up as a
stale page. ``tests/runs/test_sweep.py`` checks the recorded sweep's statuses and estimates against a
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
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # where sample regions may live
RECORD = ROOT / "benchmarks" / "results" / "readme_samples.json"

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


def run_estimate() -> str:
    proc = subprocess.run([sys.executable, "-m", "rm.estimate", *ESTIMATE_ARGS], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 3:  # 3: does not fit, which is what the samples show
        raise RuntimeError(f"rm.estimate exited {proc.returncode}, not 3:\n{proc.stderr[-3000:]}")
    return proc.stdout.rstrip()


def render_estimate(stdout: str) -> str:
    return f"```\n$ python -m rm.estimate {' '.join(ESTIMATE_ARGS)}\n{stdout}\n```\n"


def render_estimate_verdict(stdout: str) -> str:
    """The estimate's first line, its totals and verdict, and the changes that fit: the table's rows left out."""
    lines = stdout.splitlines()
    keep = [lines[0]] + [line for line in lines if line.lstrip().startswith(("device total", "usable", "verdict"))]
    keep += lines[next(i for i, line in enumerate(lines) if line.startswith("changes that fit")):]
    return "```\n$ python -m rm.estimate " + " ".join(ESTIMATE_ARGS) + "\n" + "\n".join(keep) + "\n```\n"


PROFILE_ARGS = ["hardware=h100_80g"]  # the flagship's model, data and batch, one process on one H100


def render_profiles() -> str:
    """The README's profile table: every profile of ``conf/memory_profile/`` in its order, described from its config,
    with the pre-flight estimate of the flagship under it on one H100 (``rm.memory.terms.estimate_run``, as
    ``python -m rm.estimate memory_profile=NAME hardware=h100_80g`` prints it)."""
    from rm.foundations.config import compose, memory_profiles
    from rm.memory.terms import estimate_run
    from rm.settings.validate import validate

    default = compose([]).memory_profile.name
    rows, caption = [], ""
    for profile in memory_profiles():
        cfg = compose([f"memory_profile={profile.name}", *PROFILE_ARGS])
        plan = validate(cfg, 1)
        est = estimate_run(cfg, plan)
        caption = caption or (
            f"{cfg.model.name}, micro-batches of {plan.micro_batch_size} pairs x {cfg.data.max_length} tokens, gradient "
            f"checkpointing {'on' if cfg.train.gradient_checkpointing else 'off'}, `{plan.precision}`, on one "
            f"`hardware={cfg.hardware.name}` ({est.usable_bytes / 2**30:.1f} GiB usable):\n\n")
        trains = "every weight" if not profile.use_lora else (
            "LoRA adapters on a 4-bit NF4 base" if profile.quantize_base == "nf4" else "LoRA adapters, base frozen")
        optimizer = ("DeepSpeed CPU Adam: states and step on the CPU" if profile.offload_optimizer else
                     {"adamw": "torch AdamW", "adamw_8bit": "bitsandbytes 8-bit AdamW"}[profile.optimizer])
        verdict = "fits" if est.fits else "does not fit"
        rows.append(f"| `{profile.name}`{' (default)' if profile.name == default else ''} | {trains} | {optimizer} | "
                    f"{est.peak_bytes / 2**30:.1f} ({verdict}) | {est.host_ram_bytes_per_node / 2**30:.0f} |")
    return (caption + "| `memory_profile=` | trains | optimizer | device peak, GiB | host RAM, GiB |\n"
            "| --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n")


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
    estimate = run_estimate()
    return {
        "estimate": render_estimate(estimate),
        "estimate-verdict": render_estimate_verdict(estimate),
        "profiles": render_profiles(),
        "demo": render_demo(record["demo"]),
        "demo-figures": render_demo_figures(record["demo"]),
        "sweep": render_sweep(record["sweep"]),
    }


def rewrite(text: str, bodies: Dict[str, str]) -> str:
    """``text`` with each sample region it holds rendered anew."""
    unknown = sorted({m.group("name") for m in REGION.finditer(text)} - set(bodies))
    if unknown:
        raise ValueError(f"sample regions {unknown} have no renderer here (generated: {sorted(bodies)})")
    return REGION.sub(lambda m: m.group(1) + bodies[m.group("name")] + m.group(4), text)


def rewrite_pages(bodies: Dict[str, str]) -> Dict[Path, str]:
    """Every page that holds a sample region, rendered anew; each sample must live on exactly one page."""
    texts = {page: page.read_text() for page in PAGES}
    found = sorted(m.group("name") for text in texts.values() for m in REGION.finditer(text))
    if found != sorted(bodies):
        raise ValueError(f"sample regions on the pages {found} != generated {sorted(bodies)}, each once")
    return {page: rewrite(text, bodies) for page, text in texts.items() if REGION.search(text)}


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
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    record = load_record()
    if "--run-demo" in argv:
        record["demo"] = run_demo(Path(argv[argv.index("--run-demo") + 1]))
        save_record(record)
    if "--run-sweep" in argv:
        record["sweep"] = run_sweep(Path(argv[argv.index("--run-sweep") + 1]))
        save_record(record)
    pages = rewrite_pages(render_all(record))
    stale = [page for page, new in pages.items() if new != page.read_text()]
    if "--check" in argv:
        if stale:
            print(f"sample outputs out of date in {', '.join(str(p.relative_to(ROOT)) for p in stale)}: "
                  "run python -m tests.e2e.readme_samples", file=sys.stderr)
            return 1
        return 0
    for page in stale:
        page.write_text(pages[page])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
