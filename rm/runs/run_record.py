"""Hydra's record of a job (``.hydra/``) and its log file, written only once the run directory is this run's.

Hydra writes ``.hydra/config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` into the run directory, and
opens ``<job name>.log`` there, before the task function starts. A run that rm then refuses for its
directory (it holds an earlier run, or another run holds its lock) would already have rewritten the
earlier run's record. So ``conf/config.yaml`` turns Hydra's copy off (``hydra.output_subdir: null``)
and opens the log file lazily (``conf/hydra/job_logging/rm.yaml``: ``delay: true``); :func:`hold_log`
keeps the job's log records in memory from the first line of the job, and :class:`rm.runs.run_dir.RunDir`
writes the same three files with Hydra's own content (:func:`write_record`) and releases the held log
(:func:`release_log`) once the directory is this run's (its lock is held and the run was accepted
there). A refused run leaves no file of the directory changed; its message goes to the console only.

``hydra.output_subdir`` given on the command line is Hydra's own behaviour again: ``null`` writes no
record, a name has Hydra write it there before the job starts.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rm.foundations.errors import COMPOSITION_CLEANUPS, ConfigError, StorageError, report

RECORD_DIR = ".hydra"  # Hydra's default hydra.output_subdir
# What a resume command sets itself, in place of the run's own values.
RESUME_SETS = ("train.checkpoint.resume", "train.checkpoint.overwrite", "hydra.run.dir")


class RunLog(logging.FileHandler):
    """The run's ``train.log`` (conf/hydra/job_logging/rm.yaml). A write that fails (a full disk, a quota) is a
    :class:`~rm.foundations.errors.StorageError` naming the file, raised once from the logging call (exit 5 at the
    boundary); later records are dropped, so that the boundary's message still reaches the console, where logging's
    default would print "--- Logging error ---" with a traceback and go on."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            return super().handleError(record)
        self.failed = True
        raise StorageError(f"could not write the run's log {self.baseFilename}: {err.strerror or err}") from err


class HeldLog(logging.Handler):
    """Stands in for a log file's handler: keeps its records until :meth:`hand_over` gives them to it.

    (Not ``release``: that is ``logging.Handler``'s lock method, called after every record.)
    """

    def __init__(self, target: logging.FileHandler):
        super().__init__(target.level)
        self.target = target
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def hand_over(self) -> logging.FileHandler:
        for record in self.records:
            self.target.handle(record)
        self.records.clear()
        return self.target


def hold_log(run_dir: Path) -> None:
    """Swap each root handler that writes a file under ``run_dir`` for a :class:`HeldLog`."""
    run_dir = Path(run_dir).resolve()
    root = logging.getLogger()
    for i, handler in enumerate(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).resolve().is_relative_to(run_dir):
            root.handlers[i] = HeldLog(handler)


def release_log() -> None:
    """Put the held log files back in place, with what was logged so far (the first line included)."""
    root = logging.getLogger()
    for i, handler in enumerate(root.handlers):
        if isinstance(handler, HeldLog):
            root.handlers[i] = handler.hand_over()


def write_record(run_dir: Path, task_cfg: DictConfig) -> None:
    """``run_dir/.hydra/{config,hydra,overrides}.yaml`` as Hydra's ``run_job`` writes them, unless the
    command line set ``hydra.output_subdir`` (then Hydra wrote its own, or was asked for none)."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}, what Hydra saves as hydra.yaml
    if any(o.lstrip("+~").split("=", 1)[0] == "hydra.output_subdir" for o in hydra_cfg.hydra.overrides.hydra):
        return
    out = Path(run_dir) / RECORD_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", task_cfg), ("hydra.yaml", hydra_cfg), ("overrides.yaml", hydra_cfg.hydra.overrides.task)):
        (out / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")


def resume_command(run_dir: Path, overrides: Sequence[str] = ()) -> str:
    """The command that continues the run in ``run_dir`` as it was, to copy and paste: ``python -m rm.train``, the
    run's own overrides (``.hydra/overrides.yaml``; ``overrides`` where there is none), then ``train.checkpoint.resume=true`` and
    ``hydra.run.dir``, each quoted for the shell. Without its overrides a resume composes the defaults (another
    model) and is refused.

    >>> resume_command(Path("/nonexistent/run 1"), ["experiment=tiny", "data.train_files=[a b.jsonl]", "train.checkpoint.resume=true"])
    "python -m rm.train experiment=tiny 'data.train_files=[a b.jsonl]' train.checkpoint.resume=true 'hydra.run.dir=/nonexistent/run 1'"
    """
    saved = Path(run_dir) / RECORD_DIR / "overrides.yaml"
    if saved.is_file():
        overrides = [str(o) for o in OmegaConf.load(saved)]
    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in RESUME_SETS]
    return shlex.join(["python", "-m", "rm.train", *kept, "train.checkpoint.resume=true", f"hydra.run.dir={run_dir}"])


# Made by Hydra before the job: kept in this light module so that a run refused for its settings (exit 2) answers
# before torch is imported (rm.train validates first).
class RunDirCallback(Callback):
    """Hydra callback (``conf/config.yaml``): makes the run directory before Hydra does, noting which of its folders
    this start creates.

    Hydra makes ``hydra.run.dir`` (``outputs/<date>/<time>/``) before the job starts; where it cannot (a read-only
    parent), its own traceback and exit 1 would follow. Made here first, a failure is the storage error it is: exit 5
    naming the path. The folders that did not exist are what a start refused before it claims its directory
    removes again (:func:`remove_made`), so that a refused or invalid run leaves no empty folder behind; a folder
    that existed before, empty or not, is never removed.
    """

    made: List[Path] = []  # this process's single run: the new folders, deepest first
    sweep_made: List[Path] = []  # a multirun's: the sweep folder's new folders, deepest first
    sweep_record: Optional[Path] = None  # the multirun.yaml Hydra writes there, where none was before

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        path = Path(os.path.abspath(str(config.hydra.run.dir)))  # as Hydra's run_job resolves it (${now:} is cached)
        RunDirCallback.made = [d for d in [path, *path.parents] if not d.exists()]
        # Hydra writes its record there itself when hydra.output_subdir is set (rm.estimate with a hydra.run.dir); with
        # null (rm.train, whose first write is its lock: exit 5 at rm's boundary) the folder may be read-only.
        _make(path, writes=config.hydra.output_subdir is not None, key="hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        path = Path(os.path.abspath(str(config.hydra.sweep.dir)))
        RunDirCallback.sweep_made = [d for d in [path, *path.parents] if not d.exists()]
        record = path / "multirun.yaml"
        RunDirCallback.sweep_record = None if record.exists() else record
        _make(path, writes=True, key="hydra.sweep.dir")  # Hydra writes multirun.yaml there


def _make(path: Path, writes: bool, key: str) -> None:
    if path.exists() and not path.is_dir():  # a mistyped path, not a storage fault: mkdir's "File exists" says neither
        raise SystemExit(report(ConfigError(f"{key}={path} is a file, not a directory: give the run a directory (a new "
                                            "one, or the run's own to resume it)")))
    try:
        path.mkdir(parents=True, exist_ok=True)
        if writes and not os.access(path, os.W_OK | os.X_OK):  # an existing folder Hydra would fail to write in
            raise PermissionError(errno.EACCES, "the folder is not writable (permissions, or a read-only file system)",
                                  str(path))
    except OSError as err:
        # Hydra turns an exception in a callback into a warning and goes on to fail at its own mkdir; an exit
        # passes through it.
        raise SystemExit(report(err)) from None


def undo_sweep_start() -> None:
    """A multirun whose job Hydra could not compose ran nothing: remove the multirun.yaml Hydra wrote before composing
    the jobs (where there was none before) and the sweep folders this start made, while each is empty."""
    if RunDirCallback.sweep_record is not None:
        RunDirCallback.sweep_record.unlink(missing_ok=True)
    _remove_empty(RunDirCallback.sweep_made)


COMPOSITION_CLEANUPS.append(undo_sweep_start)  # run_hydra_app calls it when Hydra fails to compose


def _remove_empty(made: List[Path]) -> None:
    """``os.rmdir`` each folder, deepest first, while each is empty: whatever was written there stays, with its folder."""
    for directory in made:
        try:
            os.rmdir(directory)
        except OSError:
            return


def remove_made(path: Path) -> None:
    """Remove the folders of ``path`` that this start made (:class:`RunDirCallback`), deepest first, while each is
    empty (``os.rmdir`` removes no file: whatever was written there stays, with its folder)."""
    made = RunDirCallback.made
    if not made or made[0] != Path(os.path.abspath(path)):
        return
    _remove_empty(made)
