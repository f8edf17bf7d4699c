"""Train a pairwise (Bradley-Terry) reward model: ``python -m rm.train [hydra overrides]``.

The Hydra entry: one job, its outcome mapped to an exit code. The training itself reads top to
bottom in :mod:`rm.training.trainer` (setup in :mod:`rm.training.run_setup`, the memory check in :mod:`rm.memory.preflight`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

# Only what composes the config is imported here: `--help` and a misspelt key answer without torch, transformers or
# datasets (their import takes seconds idle, a minute under load); the trainer comes in _job.
from rm.foundations.config import RunConfig, to_run_config
from rm.foundations.launch_env import join_submitit_tasks
from rm.foundations.errors import NonFiniteError, boundary, report, run_hydra_app, task_started
from rm.foundations.quiet import quiet_progress_bars
from rm.memory.preflight import PreflightRefusal
from rm.runs.run_record import hold_log, remove_made, write_record
from rm.runs.sweep import job_failed, job_record, write_job_record
from rm.settings.validate import launched_as_main, resolve_world_size, unused_overrides, validate

if TYPE_CHECKING:
    from rm.runs.run_dir import RunDir

log = logging.getLogger("rm.train")


def __getattr__(name: str):
    """``rm.train.train`` and ``rm.train.Status``, the trainer's (tests and docs/gpu.md call ``rm.train.train``),
    imported on first use (PEP 562) so that importing this module stays light."""
    if name in ("train", "Status"):
        from rm.training import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quiet_other_ranks() -> None:
    """Only rank 0 speaks: other ranks keep warnings and errors."""
    if not launched_as_main():
        import datasets

        logging.getLogger().setLevel(logging.WARNING)
        datasets.disable_progress_bars()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    """One job. Every failure ends at the error boundary of ``rm.foundations.errors``: a message and the documented
    exit code (2 config or data, 3 refused, 4 non-finite, 5 storage, 6 a lost peer), or a traceback for a bug. In a
    multirun (``-m``) a refusal is recorded in ``job_result.json`` and the sweep goes on (``rm.runs.sweep``);
    other failures follow ``sweep.on_failure``: under ``raise`` the job prints its message as a single run would, and
    the multirun exits with its code, not Hydra's traceback and 1 (``rm.runs.sweep.JobFailed``).
    Returns the final eval accuracy, the objective of ``hydra/sweeper=optuna``; None for a job that did not train, which
    the Optuna sweeper records as a failed (infeasible) trial rather than a value to learn from."""
    task_started()  # from here on, an exit 1 is a bug (a multirun job does not pass through boundary())
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return _job(cfg)  # a failed job goes to Hydra's sweeper, which goes on or stops per sweep.on_failure
    with boundary(log):
        return _job(cfg)


def _job(cfg: DictConfig) -> Optional[float]:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir, overrides = Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)
    # Until train() has the directory (locked, no earlier run in the way, every check passed), the log stays in
    # memory and .hydra/ unwritten: a refused run changes no file of an earlier one (rm.runs.run_record).
    hold_log(run_dir)
    fresh = not any(run_dir.iterdir())  # a new directory, or an empty one: no earlier job's record in it
    directory = None
    try:
        join_submitit_tasks()
        _quiet_other_ranks()
        quiet_progress_bars()  # the first screen: the run summary, then progress (rm.foundations.quiet)
        run_cfg = to_run_config(cfg)
        for warning in unused_overrides(run_cfg.memory_profile, overrides):
            log.warning("%s", warning)
        if not multirun:  # a sweep's job records its own failure (rm.runs.sweep), after the imports its process shares
            # The settings' own refusals (exit 2) before the run directory's and the trainer's imports (torch,
            # transformers: seconds idle, a minute under load); setup validates again, with nothing between to change it.
            validate(run_cfg, *resolve_world_size(run_cfg.distributed, launched=True))
        from rm.runs.run_dir import RunDir

        directory = RunDir.of(run_dir, run_cfg.train.checkpoint, launched_as_main(), record=cfg)
        if multirun and fresh and directory.is_main:  # nothing earlier to keep: a job killed before it claims its
            write_record(run_dir, cfg)                # folder still shows in the sweep's summary (rm.runs.sweep.collect)
        return _train(run_cfg, directory, overrides, multirun, fresh)
    except BaseException:
        if not multirun and not (directory and directory.claimed):
            remove_made(run_dir)  # a refused or invalid start leaves no empty outputs/<date>/<time>/ behind
        raise


def _train(run_cfg: RunConfig, directory: "RunDir", overrides: List[str], multirun: bool, fresh: bool) -> Optional[float]:
    """The training of one job, its outcome recorded in ``job_result.json`` in a multirun (``rm.runs.sweep``)."""
    from rm.training.trainer import Status, train

    hydra_cfg = HydraConfig.get()
    job = hydra_cfg.job.num if multirun else None
    run_dir = directory.path

    def record(status, **fields):
        if not (multirun and directory.is_main):
            return
        if not directory.claimed:
            if not fresh:
                return  # a refused directory keeps the earlier job's record
            directory.claim()  # the job's own new directory: its .hydra/ and log name the sweep's refused job
        write_job_record(run_dir, job_record(overrides, status, job=job, **fields))

    try:
        result = train(run_cfg, directory, overrides)
    except PreflightRefusal as err:
        record("refused", estimate=err.estimate,
               error=f"would fit with: {err.fits[0]}" if err.fits else "no single change found that fits")
        if not multirun:
            raise  # to the boundary in main: the breakdown once (rank 0 under the launcher), exit 3
        log.error("%s", err)
        return None
    except Exception as err:
        record("failed", error=err)
        if not multirun:
            raise  # to the boundary in main: message and exit code
        code = report(err, log)
        if run_cfg.sweep.on_failure == "continue":
            log.error("job failed; sweep.on_failure=continue: the sweep goes on")
            return None
        raise job_failed(hydra_cfg.job.num, code, Path(hydra_cfg.sweep.dir)) from None
    if result["status"] is Status.INTERRUPTED:
        record("failed", result=result, error=f"interrupted by signal {result['signal']} at step {result['step']}; "
                                              "a checkpoint was written, resume with train.checkpoint.resume=true")
        sys.exit(128 + result["signal"])
    if result["status"] is Status.STOPPED_NONFINITE:
        error = NonFiniteError(f"stopped before step {result['step'] + 1}: {result['reason']}; no checkpoint was written after it")
        record("failed", result=result, error=error)
        if multirun and run_cfg.sweep.on_failure == "continue":
            return None
        if multirun:
            raise job_failed(hydra_cfg.job.num, report(error, log), Path(hydra_cfg.sweep.dir))
        raise error  # exit 4 at the boundary
    record("ok", result=result)
    return result.get("eval_accuracy", float("nan"))


if __name__ == "__main__":
    run_hydra_app(main)
