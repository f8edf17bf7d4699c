"""Checkpoints that are either complete or absent.

A checkpoint is written into a hidden temporary directory and renamed into
place only after every file is on disk, so a crash mid-write leaves the previous
checkpoint as the newest complete one. ``trainer_state.json`` is written last
and marks a checkpoint as complete; it lists every file with its size, so a
checkpoint whose files were cut short afterwards (a full disk on a network file
system, a copy that stopped) is recognised and passed over for the previous one.
A save that fails (e.g. no space left) removes its temporary directory and
raises :class:`CheckpointError`; the previous checkpoint is untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


def _manifest(directory: Path) -> Dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()}


def is_complete(path: Path) -> bool:
    """The state file exists and every file it lists is there with its recorded size."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    for name, size in state.get("files", {}).items():
        file = Path(path) / name
        if not file.is_file() or file.stat().st_size != size:
            log.warning("checkpoint %s is damaged (%s is missing or cut short): using an earlier one", path, name)
            return False
    return True


def list_checkpoints(run_dir: Path):
    """Complete checkpoints of a run, oldest first, as ``(step, path)``."""
    root = checkpoint_root(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.match(path.name)
            if match and is_complete(path):
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run over an earlier one: a finished run is never overwritten silently.

    Raises:
        FileExistsError: ``run_dir`` holds a final model, checkpoints or metrics of an earlier run and
            neither ``train.resume`` nor ``train.overwrite`` was given.
    """
    run_dir = Path(run_dir)
    earlier = [name for name in ("final", "checkpoints", "metrics.jsonl") if (run_dir / name).exists()]
    if not earlier or resume:
        return
    if overwrite:
        log.warning("train.overwrite=true: replacing the earlier run in %s (%s)", run_dir, ", ".join(earlier))
        for name in earlier:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    finished = "a finished run (final/)" if "final" in earlier else "an earlier run (" + ", ".join(earlier) + ")"
    raise FileExistsError(
        f"{run_dir} already holds {finished}. Continue it with train.resume=true, replace it with "
        "train.overwrite=true, or choose another hydra.run.dir"
    )


def save_checkpoint(engine, run_dir: Path, step: int, keep: int) -> Path:
    """Save model, optimizer, scheduler and RNG states for ``step``; keep the newest ``keep``.

    Every process takes part (each writes its own shards under ZeRO); the main
    process alone renames and prunes.
    """
    root = checkpoint_root(run_dir)
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}"
    if engine.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    engine.wait_for_everyone()
    try:
        engine.save_state(tmp)
        engine.wait_for_everyone()
        if engine.is_main_process:
            state = {"step": step, "files": _manifest(tmp)}
            with open(tmp / STATE_FILE, "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        raise CheckpointError(
            f"could not write checkpoint-{step} in {root}: {err.strerror or err}. "
            f"The previous checkpoint, {previous or 'none'}, is intact; free space and resume with train.resume=true"
        ) from err
    if engine.is_main_process:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    engine.wait_for_everyone()
    return final


def load_checkpoint(engine, path: Path) -> int:
    """Restore the states saved by :func:`save_checkpoint`; return the step to continue from."""
    engine.load_state(path)
    with open(Path(path) / STATE_FILE) as f:
        return int(json.load(f)["step"])
