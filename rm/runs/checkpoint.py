"""Checkpoints that are either complete and intact or passed over, and the run directory's lock.

A checkpoint is written into a hidden temporary directory and renamed into
place only after every file is on disk, so a crash mid-write leaves the previous
checkpoint as the newest complete one (DeepSpeed's ``latest`` tag file and HF
Trainer's ``checkpoint-N`` directories give the same guarantee). ``trainer_state.json``
is written last and marks a checkpoint as complete; it lists every file with its
size and sha256, the step, the fingerprint of the settings that shape the
trajectory (:mod:`rm.runs.resume`) and the training loop's state (:mod:`rm.runs.train_state`). A checkpoint whose files were cut short or changed
afterwards (a full disk on a network file system, a copy that stopped, flipped
bytes) is recognised before anything of it is loaded and passed over for the
previous one, with a warning. Weights that are not finite are never saved as a
checkpoint (:class:`~rm.foundations.errors.NonFiniteError`). A save that fails (no space left,
a safetensors error) removes its temporary directory and raises
:class:`CheckpointError` (exit 5); the previous checkpoint is untouched.

Which checkpoint a resumed run loads, and what the run directory may hold, is :mod:`rm.runs.run_dir`'s to decide.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from rm.foundations.cache import file_digest
from rm.foundations.errors import NonFiniteError, StorageError, exit_code

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


class CheckpointError(StorageError):
    """A checkpoint could not be written; the previous one is intact."""


def _manifest(directory: Path) -> Dict[str, Dict]:
    return {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_digest(p)}
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _read_state(path: Path) -> Optional[Dict]:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path) -> bool:
    """The state file exists and every file it lists is there with its recorded size (cheap: no reading)."""
    state = _read_state(path)
    if state is None:
        return False
    for name, entry in state.get("files", {}).items():
        size = entry["size"] if isinstance(entry, dict) else entry  # older checkpoints list sizes only
        file = Path(path) / name
        if not file.is_file() or file.stat().st_size != size:
            log.warning("checkpoint %s is damaged (%s is missing or cut short): using an earlier one", path, name)
            return False
    return True


def damage(path: Path) -> Optional[str]:
    """Why ``path`` may not be loaded, or None when every file matches its recorded size and sha256.

    Reads every byte, so it runs once, before a checkpoint is loaded.
    """
    state = _read_state(path)
    if state is None:
        return f"{STATE_FILE} is missing or unreadable"
    if not state.get("finite", True):
        return "its weights are not finite"
    for name, entry in state.get("files", {}).items():
        file = Path(path) / name
        if not isinstance(entry, dict):
            continue  # written before checksums: sizes were checked by is_complete
        if not file.is_file() or file.stat().st_size != entry["size"]:
            return f"{name} is missing or cut short"
        if file_digest(file) != entry["sha256"]:
            return f"{name} does not match its sha256 (changed or corrupted after it was written)"
    return None


def list_checkpoints(run_dir: Path, complete: bool = True):
    """Checkpoints of a run, oldest first, as ``(step, path)``: the complete ones, or with ``complete=False`` every
    ``checkpoint-N`` directory (a written one is renamed to that name only once whole: an incomplete one was damaged
    since, e.g. by a deleted state file)."""
    root = checkpoint_root(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.match(path.name)
            if match and (not complete or is_complete(path)):
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def weights_are_finite(engine) -> bool:
    """Whether every weight of the model is finite, on every process (under ZeRO-3 each checks its shard)."""
    finite = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.unwrapped_model().parameters())
    device = engine.device
    return engine.reduce(torch.tensor(float(not finite), device=device)).item() == 0


def failed_ranks(engine, failed: bool) -> List[int]:
    """Which processes say they failed; every process gets the same answer.

    A collective: every process must call it, failed or not. A process that raised out of a save on its own
    would leave the others waiting at the next barrier; agreeing first lets every process end the same way.
    """
    flags = torch.zeros(engine.num_processes, device=engine.device)
    flags[engine.process_index] = float(failed)
    return [rank for rank, flag in enumerate(engine.reduce(flags).tolist()) if flag]


def raise_save_failure(err: Optional[BaseException], failed: List[int], what: str, where: Path, after: str,
                       kind: type = CheckpointError) -> None:
    """Raise, on one process, the error for writing ``what`` having failed on the processes ``failed``.

    Its own failure when it had one: one of our storage errors as it is, any other storage error
    (``OSError``, a safetensors error) as ``kind`` (default :class:`CheckpointError`, exit 5) naming
    ``what`` and the free space at ``where``, anything else (a bug) as it was. A process that did not
    fail raises ``kind`` naming the processes whose message says why.
    """
    if err is not None and (isinstance(err, StorageError) or exit_code(err) != StorageError.exit_code):
        raise err
    if err is None:
        why = f"process(es) {', '.join(map(str, failed))} of this run could not write their part (their message says why)"
    else:
        why = write_failure(err, where)
    raise kind(f"could not write {what}: {why}. {after}") from err


def save_checkpoint(engine, run_dir: Path, step: int, keep: int, fingerprint: Optional[Dict] = None,
                    train_state: Optional[Dict] = None, last_good: Optional[Path] = None) -> Path:
    """Save model, optimizer, scheduler and RNG states for ``step``; keep the newest ``keep``.

    ``fingerprint`` and ``train_state`` (``TrainState.record``) go into ``trainer_state.json``. ``last_good``: the
    newest checkpoint this run checked (wrote, or loaded and found finite); a failed save names it as the one to
    continue from, never merely the newest on disk, which nothing here has checked.

    Every process takes part (each writes its own shards under ZeRO); the main
    process alone checksums, renames and prunes. The processes agree on the outcome
    (:func:`failed_ranks`), so a write that fails on one of them fails the save on all.

    Raises:
        NonFiniteError: a weight is NaN or infinite; nothing is written, the previous checkpoint stays newest.
        CheckpointError: a file could not be written (``OSError``, a safetensors error) on any process;
            the temporary directory is removed.
    """
    root = checkpoint_root(run_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}"
    if not weights_are_finite(engine):
        raise NonFiniteError(
            f"the weights at step {step} are not finite: no checkpoint was written. The newest good one, "
            f"{last_good or 'none (this run has checked none)'}, stays; lower train.optim.learning_rate or check the data"
        )
    if engine.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    engine.wait_for_everyone()
    error: Optional[BaseException] = None
    try:
        engine.save_state(tmp)
    except Exception as err:  # noqa: BLE001  (kept until every process has said how its save went)
        error = err
    if not failed_ranks(engine, error is not None) and engine.is_main_process:  # every state file is written
        try:
            state = {"step": step, "finite": True, "files": _manifest(tmp), "fingerprint": fingerprint,
                     "train_state": train_state}
            with open(tmp / STATE_FILE, "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except Exception as err:  # noqa: BLE001
            error = err
    failed = failed_ranks(engine, error is not None)  # the main process's manifest and rename included
    if failed:
        if engine.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise_save_failure(
            error, failed, f"checkpoint-{step} in {root}", root,
            f"The previous checkpoint, {last_good or 'none'}, is intact; free space and resume with train.checkpoint.resume=true",
        )
    if engine.is_main_process:
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_failure(err: BaseException, where: Path) -> str:
    """Why a write failed, in words, with the free space left where it was writing."""
    why = getattr(err, "strerror", None) or str(err).strip().splitlines()[0]
    try:
        free = shutil.disk_usage(next(p for p in (where, *where.parents) if p.exists())).free
        return f"{why} ({free / 2**20:.1f} MiB free there)"
    except (OSError, StopIteration):
        return why


def load_checkpoint(engine, path: Path) -> int:
    """Restore the states saved by :func:`save_checkpoint`; return the step to continue from."""
    engine.load_state(path)
    with open(Path(path) / STATE_FILE) as f:
        return int(json.load(f)["step"])


def checkpoint_state(path: Path) -> Dict:
    """``trainer_state.json`` of a checkpoint: step, files, fingerprint, train_state."""
    return _read_state(path) or {}


def resume_candidates(run_dir: Path) -> Tuple[List[Path], List[str]]:
    """Checkpoints that pass their checksums, newest first, and why each of the others was passed over: an incomplete
    one is named too, never skipped in silence."""
    good, passed_over = [], []
    for _, path in reversed(list_checkpoints(run_dir, complete=False)):
        why = damage(path)
        if why is None:
            good.append(path)
        else:
            passed_over.append(f"{path.name}: {why}")
            log.warning("checkpoint %s cannot be used (%s): falling back to an earlier one", path, why)
    return good, passed_over
