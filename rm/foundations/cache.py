"""rm's disk cache, under ``$RM_CACHE`` (default ``~/.cache/rm``): what a run computes again and again from the same
inputs, kept between processes so that short runs and sweep jobs do not pay for it each time.

Every entry is named by a digest of everything its value depends on (:func:`key`), the source of the rm modules that
compute it among them (:func:`source_digest`), so a changed input or a changed line of that code is a miss, never a
stale hit. Entries are written under a temporary name and renamed (a reader sees a whole entry or none), and the
cache only ever speeds a run up: an entry that cannot be read or parsed is computed again, and one that cannot be
written (a read-only or full disk) is skipped; neither is reported above DEBUG.

What is cached, and where (each user names its own folder): the memory estimate's traces (``trace/``,
:mod:`rm.memory.trace`), the byte-level BPE tokenizer trained on a run's texts (``tokenizer/``, :mod:`rm.data.tokenizer`),
the tokenised splits with their counts (``data/``, :mod:`rm.data.build`), and the random init of a shape saved to
load it quantised (``random_init/``, :mod:`rm.modelling.model`). ``rm.plan`` keeps its measured CPU rates in ``speed/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``$RM_CACHE``, else ``~/.cache/rm``."""
    return Path(os.environ.get("RM_CACHE") or Path.home() / ".cache" / "rm")


def source_digest(modules: Iterable[str]) -> str:
    """sha256 of the source files of these rm modules (found without importing them): a changed line is a miss."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        digest.update(name.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return digest.hexdigest()


def versions(*packages: str) -> Dict[str, Optional[str]]:
    """The installed version of each package (None where it is not installed)."""
    found = {}
    for package in packages:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def key(fields: Dict[str, Any]) -> str:
    """The entry's name: sha256 of ``fields`` as canonical JSON (sorted keys; tuples as lists)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def read_json(path: Path) -> Optional[Any]:
    """The JSON value stored at ``path`` by :func:`write_json`, or None when it is absent, unreadable, not JSON, or
    not the value written (its checksum differs: a corrupt entry is computed again, never used)."""
    try:
        stored = json.loads(path.read_text())
        if isinstance(stored, dict) and stored.get("sha256") == _checksum(stored.get("value")):
            return stored["value"]
        log.debug("cache entry %s fails its checksum: computed again", path)
    except (OSError, ValueError) as err:
        if not isinstance(err, FileNotFoundError):
            log.debug("cache entry %s unreadable (%s): computed again", path, err)
    return None


def write_json(path: Path, value: Any) -> bool:
    """Store ``value`` at ``path`` as JSON with its checksum, atomically; a failed write leaves nothing and raises
    nothing (returns False)."""
    text = json.dumps({"value": value, "sha256": _checksum(value)})
    return _atomic(path, lambda tmp: Path(tmp, "value").write_text(text), lambda tmp: Path(tmp, "value"))


def _checksum(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def write_dir(path: Path, fill: Callable[[Path], None]) -> bool:
    """Make the directory ``path`` by ``fill(tmp)`` in a temporary directory beside it, then rename it into place.
    A directory already there (an entry found corrupt, or one another process has just written from the same
    inputs) is moved aside first and removed.

    Returns:
        Whether ``path`` now holds this process's entry (False: the write failed).
    """
    return _atomic(path, fill, lambda tmp: tmp)


def _atomic(path: Path, fill: Callable[[Path], None], result: Callable[[Path], Path]) -> bool:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        fill(tmp)
        try:
            os.replace(result(tmp), path)  # a file over any old one; a directory where none is, or an empty one
        except OSError:
            if not path.is_dir():
                raise
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, aside / "entry")
            os.replace(result(tmp), path)
            shutil.rmtree(aside, ignore_errors=True)
        return True
    except Exception as err:  # noqa: BLE001  (the cache never fails a run: it is only a shortcut)
        log.debug("cache entry %s not written (%s)", path, err)
        return False
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
