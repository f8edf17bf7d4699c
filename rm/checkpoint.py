"""Checkpoints that are either complete or absent.

A checkpoint is written into a hidden temporary directory and renamed into
place only after every file is on disk, so a crash mid-write leaves the previous
checkpoint as the newest complete one. ``trainer_state.json`` is written last
and marks a checkpoint as complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path):
    """Complete checkpoints of a run, oldest first, as ``(step, path)``."""
    root = checkpoint_root(run_dir)
    found = []
    if root.is_dir():
        for path in root.iterdir():
            match = _NAME.match(path.name)
            if match and (path / STATE_FILE).is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


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
    engine.save_state(tmp)
    engine.wait_for_everyone()
    if engine.is_main_process:
        with open(tmp / STATE_FILE, "w") as f:
            json.dump({"step": step}, f)
            f.flush()
            os.fsync(f.fileno())
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
