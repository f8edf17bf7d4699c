"""A training run's directory: one object decides what may change in it, and when.

:class:`RunDir` owns, for one run:

- the lock (:class:`RunLock`): a second live run in the same directory is refused;
- the decision about an earlier run there (:func:`check_run_dir`): continue it (``train.checkpoint.resume``), replace
  it (``train.checkpoint.overwrite``, done only by :meth:`RunDir.claim`, once the settings and the data are
  known to be usable), or refuse. It is taken before anything is written, so a refused run changes no file;
- the claim (:meth:`RunDir.claim`): once everything that can refuse the run has passed (the settings, the data, the
  memory verdict, a resume's comparison with its checkpoint: :meth:`RunDir.check_resume`), the held log file opens,
  Hydra's record is written (:mod:`rm.runs.run_record`) and ``train.checkpoint.overwrite`` replaces the earlier run. Before it,
  nothing under the directory changes but this run's own lock file;
- the checkpoints: which one a resume loads (:meth:`RunDir.restore`, naming each it passes over), where the
  next is saved (:meth:`RunDir.save_checkpoint`), which is newest, and which is the last good one (:attr:`RunDir.checked`:
  only one this run wrote or loaded and found finite);
- what an abandoned write left (a killed run's ``.tmp-*`` directories): removed once the run goes ahead
  (:meth:`RunDir.remove_abandoned`);
- ``metrics.jsonl`` (:meth:`RunDir.metrics`), cut back to the resumed step (:meth:`RunDir.resume_metrics`), so
  each step appears once.

The checkpoint format itself (atomic writes, manifests, checksums) is :mod:`rm.runs.checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig

from rm.runs.checkpoint import (
    CheckpointError, checkpoint_root, checkpoint_state, latest_checkpoint, list_checkpoints, load_checkpoint,
    resume_candidates, save_checkpoint, weights_are_finite,
)
from rm.foundations.config import CheckpointConfig, TrainConfig
from rm.foundations.errors import ConfigError, Refused
from rm.evaluation.metrics import MetricsLog
from rm.runs.resume import apply_changes, check_resume, stored_fingerprint
from rm.runs.run_record import release_log, write_record

log = logging.getLogger("rm.train")  # these lines belong to the training command's log

LOCK_FILE = ".lock"
TOKENIZER_DIR = "tokenizer"  # the tokenizer model.tokenizer=bpe trained, read back on resume
# Where a write in progress lives until it is whole and renamed into place (checkpoints, final/, what
# train.checkpoint.overwrite=true replaces): nothing with this prefix is ever read as a result.
TMP_PREFIX = ".tmp-"


class RunDir:
    """The directory of one training run; a context manager that holds its lock on the main process.

    Entering it takes the lock and the decision on the main process; every process claims the directory with
    :meth:`claim` once the run has passed every check that can refuse it (the other processes reach that point
    only with the engine up, so the main process has accepted the directory, or torchrun has stopped them).

    Args:
        path: the run directory (Hydra's ``hydra.run.dir``).
        resume, overwrite: ``train.checkpoint.resume`` and ``train.checkpoint.overwrite``.
        is_main: this process decides and writes the shared files (rank 0).
        record: the Hydra task config, written to ``.hydra/`` when the directory is claimed; ``None`` outside Hydra.
    """

    def __init__(self, path: Path, resume: bool, overwrite: bool, is_main: bool, record: Optional[DictConfig] = None):
        self.path = Path(path)
        self.resume, self.overwrite, self.is_main, self.record = resume, overwrite, is_main, record
        self.claimed = False  # the directory is this run's: files in it may change
        self.checked: Optional[Path] = None  # the newest checkpoint this run wrote, or loaded and found finite
        self._replaces: List[str] = []
        self._candidates: Optional[Tuple[List[Path], List[str]]] = None  # resume_candidates(), hashed once
        self._lock = RunLock(self.path) if is_main else None

    @classmethod
    def of(cls, path: Path, checkpoint: CheckpointConfig, is_main: bool, record: Optional[DictConfig] = None) -> "RunDir":
        return cls(path, checkpoint.resume, checkpoint.overwrite, is_main, record)

    def __enter__(self) -> "RunDir":
        if self._lock is not None:
            self._lock.__enter__()
            try:
                self._replaces = check_run_dir(self.path, self.resume, self.overwrite)
            except BaseException:
                self._lock.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.__exit__(*exc)

    def claim(self) -> None:
        """The directory becomes this run's (every process calls it, once every check that can refuse the run has
        passed): the held log is written, then Hydra's record, and ``train.checkpoint.overwrite=true`` deletes the earlier run."""
        release_log()
        if self.is_main and self.record is not None:
            write_record(self.path, self.record)
        if self.is_main:
            replace_earlier_run(self.path, self._replaces)
        self._replaces = []
        self.claimed = True

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    @property
    def resuming(self) -> bool:
        """``train.checkpoint.resume`` with any checkpoint directory there, whole or not: a resume that is then refused must
        not have replaced the saved tokenizer first."""
        return self.resume and bool(list_checkpoints(self.path, complete=False))

    def latest_checkpoint(self) -> Optional[Path]:
        return latest_checkpoint(self.path)

    def save_checkpoint(self, engine, step: int, keep: int, fingerprint: Optional[Dict],
                        train_state: Optional[Dict]) -> Path:
        """:func:`rm.runs.checkpoint.save_checkpoint` into this directory (every process calls it); it becomes
        :attr:`checked`, the last good one (its weights were found finite before it was written)."""
        self.checked = save_checkpoint(engine, self.path, step, keep, fingerprint, train_state, last_good=self.checked)
        return self.checked

    def remove_abandoned(self) -> None:
        """Remove what a run stopped in the middle of a write left (``.tmp-final``, ``checkpoints/.tmp-checkpoint-N``,
        an earlier run that ``train.checkpoint.overwrite=true`` was replacing): never read, and it would stay forever (a new
        checkpoint replaces only its own step's). On the main process, once the run goes ahead."""
        if not self.is_main:
            return
        for parent in (self.path, checkpoint_root(self.path)):
            for path in parent.glob(f"{TMP_PREFIX}*") if parent.is_dir() else ():
                log.info("removing %s, left by a write that was abandoned (a run stopped while writing it)", path)
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def saved_fingerprint(self) -> Optional[Dict]:
        """The settings fingerprint (:func:`rm.runs.resume.fingerprint`) of the newest checkpoint that has one, unverified:
        what a resumed ``train.layout=auto`` run takes its layout from (every checkpoint of a run has the same)."""
        for _, path in reversed(list_checkpoints(self.path, complete=False)):
            found = checkpoint_state(path).get("fingerprint")
            if found:
                return stored_fingerprint(found)
        return None

    def check_resume(self, train_cfg: TrainConfig, current: Dict, total_steps: int) -> None:
        """``train.checkpoint.resume=true``: the refusals of :meth:`restore`, taken before the directory is claimed, so that a
        refused resume changes no file of the run it would continue. The newest intact checkpoint (the one
        :meth:`restore` loads unless it fails to load) must be before ``total_steps`` and, without
        ``train.checkpoint.resume_allow_changes``, have been written with the same settings and data.

        Raises:
            ConfigError, CheckpointError: as :meth:`restore`.
        """
        if not self.resume:
            return
        self._candidates = candidates, passed_over = resume_candidates(self.path)
        if candidates:
            self._check_candidate(candidates[0], checkpoint_state(candidates[0]), train_cfg, current, total_steps,
                                  compare=not train_cfg.checkpoint.resume_allow_changes)  # allowed changes are logged on restore
        elif passed_over:
            raise self._none_intact(passed_over)

    def _check_candidate(self, checkpoint: Path, state: Dict, train_cfg: TrainConfig, current: Dict, total_steps: int,
                         compare: bool = True) -> List[str]:
        if state["step"] >= total_steps:
            raise ConfigError(
                f"{checkpoint} is at step {state['step']}, but this run ends at step {total_steps} "
                f"(train.max_steps={train_cfg.max_steps}, train.num_train_epochs={train_cfg.num_train_epochs}): "
                "raise train.max_steps with train.checkpoint.resume_allow_changes=true to train further"
            )
        return (check_resume(stored_fingerprint(state.get("fingerprint")), current, checkpoint,
                             train_cfg.checkpoint.resume_allow_changes) if compare else [])

    def _none_intact(self, passed_over: List[str]) -> CheckpointError:
        return CheckpointError(
            f"train.checkpoint.resume=true but no checkpoint in {checkpoint_root(self.path)} is intact: {'; '.join(passed_over)}. "
            "Nothing was changed: restore one from a copy, or start afresh with train.checkpoint.overwrite=true (which deletes them)"
        )

    def restore(self, engine, train_cfg: TrainConfig, current: Dict, total_steps: int) -> Tuple[int, Optional[Dict]]:
        """Restore the newest intact checkpoint whose settings match; return its step (0: none yet) and the
        loop's state it holds (``None``: none yet, or a checkpoint written before the state was saved).

        Checkpoints that fail their checksums, or whose states do not load, are passed over for the previous one,
        each named with why, as DeepSpeed falls back from a bad ``latest`` tag by hand.

        Args:
            current: this run's :func:`rm.runs.resume.fingerprint`, compared with the checkpoint's.

        Raises:
            ConfigError: settings that shape training changed (without ``train.checkpoint.resume_allow_changes``),
                or the checkpoint is past ``train.max_steps``.
            CheckpointError: checkpoints exist but none is intact; nothing is changed.
        """
        candidates, passed_over = self._candidates or resume_candidates(self.path)
        passed_over = list(passed_over)
        if not candidates and not passed_over:
            log.warning("train.checkpoint.resume=true but %s holds no checkpoint yet: starting from step 0", self.path)
            return 0, None
        for checkpoint in candidates:
            state = checkpoint_state(checkpoint)
            changes = self._check_candidate(checkpoint, state, train_cfg, current, total_steps)
            try:
                step = load_checkpoint(engine, checkpoint)
            except Exception as err:  # noqa: BLE001  (passed its checksums but does not load: try the previous)
                log.warning("checkpoint %s does not load (%s: %s): falling back to an earlier one", checkpoint,
                            type(err).__name__, err)
                passed_over.append(f"{checkpoint.name}: does not load ({type(err).__name__})")
                continue
            # A sha256 says the files are as written, not that what was written is sound: a checkpoint written
            # before rm checked weights, or by other tools, may hold NaN. The next one loaded overwrites every state.
            if not weights_are_finite(engine):
                log.warning("checkpoint %s matches its sha256 but its weights are not finite: falling back to an "
                            "earlier one", checkpoint)
                passed_over.append(f"{checkpoint.name}: its weights are not finite (loaded and checked)")
                continue
            apply_changes(engine.optimizer, engine.scheduler, train_cfg.optim, changes)
            log.info("resumed from %s at step %d", checkpoint, step)
            self.checked = checkpoint
            return step, state.get("train_state")
        raise self._none_intact(passed_over)

    def metrics(self, tensorboard: bool) -> MetricsLog:
        """The run's one ``metrics.jsonl`` (and TensorBoard), written by the main process."""
        return MetricsLog(self.path, self.is_main, tensorboard=tensorboard)

    def resume_metrics(self, metrics: MetricsLog, start_step: int) -> None:
        """A resumed run's ``metrics.jsonl`` without the records of steps after ``start_step``: the resumed run writes
        those steps again, and each step appears once."""
        if not self.resume:
            return
        dropped = metrics.resume_at(start_step)
        if dropped:
            log.info("metrics.jsonl: %d record(s) of steps after %d dropped: the resumed run writes those steps again",
                     dropped, start_step)


class RunDirError(ConfigError, FileExistsError):
    """The run directory holds something that the settings do not say what to do with."""



def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> List[str]:
    """Refuse to start a fresh run over an earlier one, or to resume a finished one: a model is never
    overwritten silently. Nothing is changed here: it runs before the settings are validated, so that a
    refused run touches nothing of the directory, and an invalid one replaces nothing.

    Returns:
        What ``train.checkpoint.overwrite=true`` replaces (names under ``run_dir``), for :func:`replace_earlier_run`
        once the settings are known to be valid; ``[]`` otherwise.

    Raises:
        RunDirError: ``run_dir`` holds a final model, checkpoints or metrics of an earlier run and
            neither ``train.checkpoint.resume`` nor ``train.checkpoint.overwrite`` was given; or ``train.checkpoint.resume`` was given
            for a run that finished (``final/`` exists), which would train again over its model.
    """
    run_dir = Path(run_dir)
    earlier = [name for name in ("final", "checkpoints", "metrics.jsonl") if (run_dir / name).exists()]
    if resume and (run_dir / "final").exists() and not overwrite:
        raise RunDirError(
            f"train.checkpoint.resume=true but {run_dir} holds a finished run (final/): there is nothing to resume, and "
            "training again would replace its model. Keep it and choose another hydra.run.dir, or replace it "
            "with train.checkpoint.overwrite=true (without train.checkpoint.resume)"
        )
    if not earlier or (resume and not overwrite):
        return []
    if resume and overwrite:
        raise RunDirError("train.checkpoint.resume=true and train.checkpoint.overwrite=true contradict each other: continue the run or replace it")
    if overwrite:
        return earlier
    if "final" in earlier:  # nothing to continue: train.checkpoint.resume=true is refused for a finished run (above)
        raise RunDirError(f"{run_dir} already holds a finished run (final/). Keep it and choose another hydra.run.dir, "
                          "or replace it with train.checkpoint.overwrite=true")
    raise RunDirError(
        f"{run_dir} already holds an earlier run ({', '.join(earlier)}). Continue it with train.checkpoint.resume=true, replace it "
        "with train.checkpoint.overwrite=true, or choose another hydra.run.dir"
    )


def replace_earlier_run(run_dir: Path, names: List[str]) -> None:
    """Delete what :func:`check_run_dir` said ``train.checkpoint.overwrite=true`` replaces."""
    if not names:
        return
    log.warning("train.checkpoint.overwrite=true: replacing the earlier run in %s (%s)", run_dir, ", ".join(names))
    for name in names:
        path = Path(run_dir) / name
        # Renamed first: a run stopped while deleting (a signal during set-up) must not leave a final/ that is
        # half gone and still reads as a finished run. The next start removes the rest (RunDir.remove_abandoned).
        doomed = path.with_name(f"{TMP_PREFIX}replaced-{name}")
        shutil.rmtree(doomed, ignore_errors=True)  # left by an earlier replacement that was stopped
        os.replace(path, doomed)
        shutil.rmtree(doomed) if doomed.is_dir() else doomed.unlink()



class RunLock:
    """``<run_dir>/.lock`` holds the pid and host of the run using the directory.

    A second run is refused (:class:`~rm.foundations.errors.Refused`, exit 3) naming the holder. A lock whose
    process no longer exists on this host (a killed job, a pre-empted SLURM task being requeued)
    is stale and taken over with a warning. On another host liveness cannot be checked, so the
    message says which file to delete once that run is known to be gone.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def _holder(self) -> Optional[Dict]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written this instant, or garbage: treated as held by an unknown run

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released between our two calls
                if holder and holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1))):
                    log.warning("taking over the stale lock of %s: process %s is gone", self.path.parent, holder.get("pid"))
                    self.path.unlink(missing_ok=True)
                    continue
                raise Refused(
                    f"{self.path.parent} is in use by another run (pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, since {holder.get('since', '?')}): wait for it to end or choose "
                    f"another hydra.run.dir. If that run no longer exists, delete {self.path}"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise Refused(f"{self.path.parent}: could not take the run lock {self.path}; another run is starting there")

    def __exit__(self, *exc):
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True
