"""Hydra multirun sweeps: one record per job, and a summary of the whole sweep.

    python -m rm.train -m memory_profile=full,lora,8bit,offload lora.r=8,16

Each job writes ``job_result.json`` in its own directory, whatever its outcome: ``ok``,
``refused`` (the pre-flight estimate did not fit: the sweep goes on) or ``failed`` (any other
error, with its message). The ``SweepSummary`` callback (registered in ``conf/config.yaml``)
gathers the records into ``summary.csv`` and ``summary.json`` in the sweep directory after every
job, so a sweep that stops half-way still leaves its summary, and prints the table at the end.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback

log = logging.getLogger("rm.runs.sweep")

RESULT_FILE = "job_result.json"
COLUMNS = [
    "job", "overrides", "status", "estimated_peak_bytes", "usable_bytes", "measured_peak_bytes",
    "tokens_per_s", "eval_accuracy", "eval_loss", "error",
]


def job_record(overrides: Sequence[str], status: str, *, job: Optional[int] = None, estimate=None,
               result: Optional[Dict] = None, error=None) -> Dict:
    """What a sweep needs to know of one job.

    Args:
        overrides: the job's own Hydra overrides (what distinguishes it in the sweep).
        status: ``ok``, ``refused`` or ``failed``.
        estimate: the pre-flight ``rm.estimate.Estimate``, when one was made.
        result: what ``rm.training.trainer.train`` returned (eval metrics, throughput, measured peak).
        error: why a job failed, its whole message (a ConfigError names each key on a line of its own), or for a
            refusal the change that would fit (one line; the full breakdown is in the job's log).
    """
    result = result or {}
    if isinstance(error, BaseException):
        from rm.foundations.errors import message

        error = f"{type(error).__name__}: {message(error).strip()}"
    return {
        "job": job,
        "overrides": " ".join(overrides),
        "status": status,
        "estimated_peak_bytes": estimate.peak_bytes if estimate is not None else result.get("estimated_peak_bytes"),
        "usable_bytes": estimate.usable_bytes if estimate is not None else result.get("usable_bytes"),
        "measured_peak_bytes": result.get("measured_peak_bytes"),
        "tokens_per_s": result.get("tokens_per_s"),
        "eval_accuracy": result.get("eval_accuracy"),
        "eval_loss": result.get("eval_loss"),
        "error": error,
    }


def write_job_record(run_dir: Path, record: Dict) -> None:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RESULT_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, run_dir / RESULT_FILE)


def collect(sweep_dir: Path) -> List[Dict]:
    """Every job of the sweep, in job order. A job directory without a record (the process was
    killed before it could write one) shows up as ``failed``."""
    records = []
    for overrides_file in sorted(Path(sweep_dir).rglob(".hydra/overrides.yaml")):
        job_dir = overrides_file.parent.parent
        result = job_dir / RESULT_FILE
        if result.exists():
            records.append(json.loads(result.read_text()))
        else:
            from omegaconf import OmegaConf

            records.append({**dict.fromkeys(COLUMNS), "overrides": " ".join(OmegaConf.load(overrides_file)),
                            "status": "failed", "error": "no job_result.json: the job is running or was killed"})
        records[-1].setdefault("job", None)
        records[-1]["job_dir"] = str(job_dir.relative_to(sweep_dir))
    return sorted(records, key=lambda r: (r["job"] is None, r["job"] if r["job"] is not None else 0, r["job_dir"]))


def write_summary(sweep_dir: Path, records: List[Dict]) -> None:
    """``summary.csv`` and ``summary.json`` in the sweep directory (replaced atomically)."""
    sweep_dir = Path(sweep_dir)
    tmp = sweep_dir / ".summary.csv.tmp"
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*COLUMNS, "job_dir"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)
    os.replace(tmp, sweep_dir / "summary.csv")
    tmp = sweep_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(records, indent=2))
    os.replace(tmp, sweep_dir / "summary.json")


def one_line(text: str, width: int = 160) -> str:
    """A message on one line of the table (``summary.json`` keeps it whole).

        >>> one_line("ConfigError: invalid configuration:\\n  - train.optim.adam_beta1=1.5 must be in [0, 1)")
        'ConfigError: invalid configuration: - train.optim.adam_beta1=1.5 must be in [0, 1)'
    """
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


class JobFailed(CompactHydraException):
    """A failed job of a multirun under ``sweep.on_failure=raise``, its message already printed (``report``): Hydra's
    sweeper raises it when it reads the job's result (the basic sweeper after the remaining jobs; Optuna at once)
    and, a compact Hydra error, prints this one line instead of a traceback. ``rm.foundations.errors.run_hydra_app``
    then exits with the job's code (:data:`first_failure`) instead of Hydra's 1."""

    def __init__(self, job: Optional[int], code: int, sweep_dir: Path):
        super().__init__(f"error: the sweep failed: job {job} exited {code} (its message is above; every job's "
                         f"outcome is in {Path(sweep_dir) / 'summary.csv'})")
        self.code = code


def job_failed(job: Optional[int], code: int, sweep_dir: Path) -> JobFailed:
    """The exception a failed job raises under ``sweep.on_failure=raise``; the first one's code is the multirun's."""
    from rm.foundations import errors

    if errors.sweep_exit_code is None:
        errors.sweep_exit_code = code
    return JobFailed(job, code, sweep_dir)


def format_summary(records: List[Dict]) -> str:
    """The sweep as a table for people: one row per job, showing the overrides that differ between jobs."""
    split = [r["overrides"].split() for r in records]
    common = set.intersection(*map(set, split)) if split else set()
    scale, unit = (1024**3, "GiB") if max((r["usable_bytes"] or 0 for r in records), default=0) >= 4 * 1024**3 else (1024**2, "MiB")

    def cell(value, fmt="{:.3f}"):
        return "-" if value is None else fmt.format(value)

    def mem(value):
        return cell(None if value is None else value / scale, "{:.1f}")

    header = (f"{'job':>3}  {'status':<8} {'est. peak':>9} {'usable':>8} {'measured':>9} {'tok/s':>8} {'acc':>6} {'loss':>7}"
              f"  overrides")
    lines = [header, "-" * (len(header) + 20)]
    for r, own in zip(records, split):
        lines.append(
            f"{cell(r['job'], '{}'):>3}  {r['status']:<8} {mem(r['estimated_peak_bytes']):>9} {mem(r['usable_bytes']):>8} "
            f"{mem(r['measured_peak_bytes']):>9} {cell(r['tokens_per_s'], '{:.0f}'):>8} {cell(r['eval_accuracy']):>6} "
            f"{cell(r['eval_loss'], '{:.4f}'):>7}  {' '.join(o for o in own if o not in common)}"
        )
        if r["status"] != "ok" and r.get("error"):
            lines.append(f"{'':>15}{one_line(r['error'])}")
    counts = {s: sum(r["status"] == s for r in records) for s in ("ok", "refused", "failed")}
    lines.append(f"{len(records)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; memory in {unit}")
    if common:
        lines.append(f"common to every job: {' '.join(o for o in split[0] if o in common)}")
    return "\n".join(lines)


class SweepSummary(Callback):
    """Keeps ``summary.csv``/``summary.json`` of a multirun up to date and prints the table at the end."""

    def on_job_end(self, config, job_return, **kwargs) -> None:
        sweep_dir = self._sweep_dir(config)
        if sweep_dir is not None:
            write_summary(sweep_dir, collect(sweep_dir))

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = collect(sweep_dir)
        write_summary(sweep_dir, records)
        log.info("sweep summary (%s):\n%s", sweep_dir / "summary.csv", format_summary(records))

    @staticmethod
    def _sweep_dir(config) -> Optional[Path]:
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return None
        return Path(config.hydra.sweep.dir)
