"""Reading one split of raw preference rows, and telling which layout they follow.

:func:`load_preference_split` reads a split from the Hugging Face Hub or from local jsonl / json / parquet
files, checking each file before ``datasets`` reads it so that an error names the file and line;
:func:`detect_format` tells the layout (``hh``, ``prompt``, ``messages``; :mod:`rm.data`) from the schema,
or from the rows where the schema cannot tell.
"""

from __future__ import annotations

import codecs
import glob
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import datasets

from rm.foundations.errors import ConfigError, DataError, DataFileNotFound

logger = logging.getLogger(__name__)

SOURCES = ("hub", "local")

_EXTENSION_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

FORMAT_HELP = (
    "hh (columns 'chosen', 'rejected': full transcript strings), "
    "prompt (columns 'prompt', 'chosen', 'rejected': strings), "
    "messages (columns 'chosen', 'rejected': lists of {'role', 'content'} "
    "messages, optional 'prompt' list of messages)"
)

# map() batch size of the later stages: large enough to amortise Python overhead, small enough that
# one batch of long transcripts stays a few MB.
_MAP_BATCH_SIZE = 1000


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def map_counting(
    ds: datasets.Dataset, function: Callable[[dict, list[int]], dict], features: datasets.Features, desc: str
) -> datasets.Dataset:
    """``function(batch, indices)``'s rows in place of ``ds``'s, as the later stages (normalise, tokenise) map them.

    Never read from the ``datasets`` cache: those stages count drops while the function runs, and a
    cache hit would skip it and report zeros.
    """
    return ds.map(
        function,
        with_indices=True,
        batched=True,
        batch_size=_MAP_BATCH_SIZE,
        remove_columns=ds.column_names,
        features=features,
        load_from_cache_file=False,
        desc=desc,
    )


def _matches(files: Iterable[str]) -> tuple[list[str], list[str]]:
    """The files the entries (paths or globs) match, and the entries that match none."""
    resolved: list[str] = []
    missing: list[str] = []
    for entry in files:
        pattern = os.path.expanduser(str(entry))
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        else:
            matches = [pattern] if os.path.isfile(pattern) else []
        if not matches:
            missing.append(str(entry))
        resolved.extend(matches)
    return resolved, missing


def missing_files_error(missing: dict[str, list[str]]) -> DataFileNotFound:
    """One error naming every entry that matches no file, under its config key; a directory is said to be one, with
    the pattern of its files to give instead (rm reads files, never a directory's)."""
    shown = []
    for key, entries in missing.items():
        folders = [m for m in entries if os.path.isdir(os.path.expanduser(m))]
        gone = [m for m in entries if m not in folders]
        said = [f"no file matches {', '.join(repr(m) for m in gone)}"] if gone else []
        said += [f"{m!r} is a directory: name the files in it ({os.path.join(m, '*.jsonl')!r})" for m in folders]
        shown.append(f"{key}: {'; '.join(said)}")
    return DataFileNotFound(f"{'; '.join(shown)} (relative paths are resolved against {os.getcwd()!r})")


def check_files_exist(files_by_key: dict[str, Iterable[str]]) -> None:
    """Every entry of every key matches a file, else one error naming each that does not (not only the first)."""
    missing = {key: gone for key, files in files_by_key.items() if (gone := _matches(files)[1])}
    if missing:
        raise missing_files_error(missing)


def expand_files(files: Iterable[str], key: str) -> list[str]:
    """Expands globs; every entry must match at least one file."""
    resolved, missing = _matches(files)
    if missing:
        raise missing_files_error({key: missing})
    # A glob and an explicit path may name the same file; loading it twice would
    # silently duplicate pairs.
    return list(dict.fromkeys(resolved))


def _builder_for(paths: Sequence[str], key: str) -> str:
    builders: dict[str, list[str]] = {}
    for p in paths:
        ext = os.path.splitext(p)[1].lower()
        if ext not in _EXTENSION_BUILDERS:
            raise DataError(
                f"{key}: unsupported file extension {ext or '(none)'!r} for {p!r}; "
                f"accepted: {sorted(_EXTENSION_BUILDERS)}"
            )
        builders.setdefault(_EXTENSION_BUILDERS[ext], []).append(p)
    if len(builders) > 1:
        detail = "; ".join(f"{b}: {ps}" for b, ps in sorted(builders.items()))
        raise DataError(
            f"{key}: files of one split must all be json/jsonl or all parquet, got a mix ({detail})"
        )
    return next(iter(builders))


def load_preference_split(
    source: str,
    *,
    path: str | None = None,
    subsets: Sequence[str] = (),
    split: str = "train",
    files: Sequence[str] | str = (),
    max_samples: int | None = None,
    files_key: str | None = None,
) -> datasets.Dataset:
    """Loads one split of raw preference data, without interpreting its columns.

    Args:
        source: ``"hub"`` (a Hugging Face Hub dataset) or ``"local"`` (files).
        path: Hub dataset id, e.g. ``"Anthropic/hh-rlhf"``. Required for ``"hub"``.
        subsets: Hub ``data_dir`` values (e.g. ``["helpful-base", "helpful-online"]``),
            each loaded and then concatenated in order. Empty: the whole dataset.
        split: Split name (Hub split, and used in the default ``files_key``).
        files: Local files for this split: paths or glob patterns, ``.jsonl`` /
            ``.json`` (json builder) or ``.parquet``; one split may not mix the two
            kinds. A single string is accepted as a one-element list.
        max_samples: If given, keep only the first ``max_samples`` rows (after
            concatenating subsets/files).
        files_key: Config key named in error messages about ``files``; defaults
            to ``f"data.{split}_files"``.

    Returns:
        The raw ``datasets.Dataset`` with the source's own columns.

    Raises:
        FileNotFoundError: A local path or glob matches no file; the message names
            the pattern(s) and ``files_key``.
        ValueError: Unknown ``source``, missing ``path``/``files``, an unsupported
            or mixed file extension, or a non-positive ``max_samples``.
    """
    check_choice("source", source, SOURCES)
    if max_samples is not None and (isinstance(max_samples, bool) or int(max_samples) < 1):
        raise DataError(f"max_samples must be a positive integer or None, got {max_samples!r}")

    if source == "hub":
        if not path:
            raise DataError("source='hub' needs a dataset path, e.g. 'Anthropic/hh-rlhf'")
        if isinstance(subsets, str):
            subsets = [subsets]
        if subsets:
            parts = [datasets.load_dataset(path, data_dir=d, split=split) for d in subsets]
            ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        else:
            ds = datasets.load_dataset(path, split=split)
    else:
        key = files_key or f"data.{split}_files"
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        files = list(files or ())
        if not files:
            raise DataError(f"{key}: source='local' needs at least one file for split {split!r}")
        resolved = expand_files(files, key)
        builder = _builder_for(resolved, key)
        for file in resolved:
            _check_content(file, key, builder)
            if builder == "json":
                _check_utf8(file, key)
        # Local files always land in the builder's single "train" split, whatever
        # split they stand for.
        try:
            ds = datasets.load_dataset(builder, data_files=resolved, split="train")
        except datasets.exceptions.DatasetGenerationError as err:
            raise DataError(_unreadable(resolved, key, builder, err)) from err
        if builder == "json" and len(resolved) == 1:
            _check_rows_not_columns(ds, resolved[0], key)

    if max_samples is not None and len(ds) > max_samples:
        ds = ds.select(range(int(max_samples)))
    return ds


def _check_rows_not_columns(ds, file: str, key: str) -> None:
    """A ``.json`` file that is one object of columns (``{"chosen": [...], "rejected": [...]}``, or pandas' ``to_json``
    without ``orient="records"``: ``{"chosen": {"0": ...}}``) reads as a single row whose every cell holds a column:
    named as what it is, where its cells would be taken for conversations (``'chosen' message 0 is str``) or for
    columns of no known layout."""
    if len(ds) != 1 or not {"chosen", "rejected"} <= set(ds.column_names):
        return
    row = ds[0]

    def values(cell):  # a column as a list ({"chosen": [...]}) or by row index (pandas' default, {"chosen": {"0": ...}})
        if isinstance(cell, dict) and cell and all(str(k).isdigit() for k in cell):
            return list(cell.values())
        return cell if isinstance(cell, list) and all(not isinstance(x, dict) for x in cell) else None

    columns = [values(cell) for cell in row.values()]
    sizes = {-1 if c is None else len(c) for c in columns}
    if len(sizes) == 1 and sizes.pop() > 1:
        raise DataError(f"{key}: {file} is one JSON object of columns ({', '.join(ds.column_names)}: "
                        f"{len(columns[0])} values each), not rows: write one object per pair, as a JSON array "
                        "([{\"chosen\": ..., \"rejected\": ...}, ...]) or one per line in a .jsonl file "
                        "(pandas: df.to_json(path, orient='records', lines=True))")


def _check_content(file: str, key: str, builder: str) -> None:
    """An empty or whitespace-only file, or a ``.parquet`` that is not Parquet, named before ``datasets``
    reads it (it would end in a bare ``StopIteration`` or an Arrow error that names no file)."""
    with open(file, "rb") as f:
        if builder == "parquet":
            head = f.read(4)
            f.seek(max(0, os.path.getsize(file) - 4))
            if head != b"PAR1" or f.read(4) != b"PAR1":
                raise DataError(
                    f"{key}: {file} is not a Parquet file (no PAR1 magic bytes at its start and end): "
                    "convert it, or give a .jsonl / .json file its own extension"
                )
            return
        for chunk in iter(lambda: f.read(1 << 16), b""):
            if chunk.strip():
                return
    what = "empty (0 bytes)" if os.path.getsize(file) == 0 else "whitespace only"
    raise DataError(f"{key}: {file} is {what}: it holds no rows. Remove it from {key} or fill it")


def locate_row(files: Sequence[str], row: int) -> tuple[str, int]:
    """The file and 0-based row within it of row ``row`` of the split read from ``files`` in order.

    Reads each file again (from the ``datasets`` cache), so it is for error messages only.
    """
    builder = _EXTENSION_BUILDERS[os.path.splitext(files[0])[1].lower()]
    for file in files:
        n = len(datasets.load_dataset(builder, data_files=[file], split="train"))
        if row < n:
            return file, row
        row -= n
    return files[-1], row


def _check_utf8(file: str, key: str) -> None:
    """Raise naming the line and byte of the first byte sequence that is not UTF-8.

    JSON text must be UTF-8; a file in another encoding would otherwise fail half-way
    through normalisation with a decoder error that names neither file nor row.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                at = offset + err.start
                line += chunk[: err.start].count(b"\n")
                raise DataError(
                    f"{key}: {file} line {line} (byte {at}) is not UTF-8 ({err.reason}); "
                    "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            line += chunk.count(b"\n")
            offset += len(chunk)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise DataError(f"{key}: {file} ends inside a UTF-8 character ({err.reason}): the file is cut short") from None


def _unreadable(files: Sequence[str], key: str, builder: str, err: Exception) -> str:
    """Why ``datasets`` could not read local files, naming the file and line where JSON is invalid.

    A line that does not parse always stops the run: skipping part of a file that does not
    parse would lose rows without a count of how many.
    """
    if builder == "json":
        for file in files:
            with open(file, encoding="utf-8") as f:
                text = f.read()
            if file.endswith(".json") and text.lstrip().startswith("["):
                try:
                    json.loads(text)
                except json.JSONDecodeError as bad:
                    return f"{key}: {file} line {bad.lineno}: invalid JSON ({bad.msg})"
                continue
            for number, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as bad:
                    return f"{key}: {file} line {number}: invalid JSON ({bad.msg} at column {bad.colno})"
                if not isinstance(row, dict):
                    return f"{key}: {file} line {number}: expected a JSON object per line, got {type(row).__name__}"
    cause = err.__cause__ or err.__context__ or err
    return f"{key}: could not read {', '.join(files)}: {type(cause).__name__}: {cause}"


def _feature_kind(feature: Any) -> str:
    if isinstance(feature, datasets.Value):
        if feature.dtype in ("string", "large_string"):
            return "string"
        return feature.dtype
    list_types = tuple(
        t for t in (getattr(datasets, n, None) for n in ("List", "LargeList", "Sequence")) if isinstance(t, type)
    )
    if isinstance(feature, (list,) + list_types):
        return "list"
    return type(feature).__name__


def detect_format(ds: datasets.Dataset, on_malformed: str = "error") -> str:
    """Detects the preference layout of a dataset from its columns and types.

    Args:
        ds: Raw dataset (e.g. from :func:`load_preference_split`).
        on_malformed: rows of several layouts in one split raise under ``"error"``; under ``"skip"`` the layout
            most rows follow is the split's, and :func:`rm.data.normalise.normalise_pairs` drops the others
            (``other_format``).

    Returns:
        ``"hh"``, ``"prompt"`` or ``"messages"``.

    Raises:
        ValueError: The layout matches none of them; the message names the columns
            (with types) found and the accepted formats.
    """
    feats = ds.features
    kinds = {name: _feature_kind(f) for name, f in feats.items()}
    chosen, rejected, prompt = kinds.get("chosen"), kinds.get("rejected"), kinds.get("prompt")
    # A column whose rows hold different types (datasets reads it as Json), or a prompt some rows
    # lack, hides the layout of each row from the schema: look at the rows.
    mixed_types = "Json" in (chosen, rejected, prompt)
    partial_prompt = prompt == "string" and 0 < ds.data.column("prompt").null_count < len(ds)
    if mixed_types or partial_prompt:
        return _detect_by_rows(ds, kinds, on_malformed)
    if chosen == rejected == "string":
        if prompt is None:
            return "hh"
        if prompt == "string":
            return "prompt"
    elif chosen == rejected == "list" and prompt in (None, "list"):
        return "messages"
    found = ", ".join(f"{n} ({k})" for n, k in kinds.items()) or "(none)"
    raise DataError(
        f"cannot detect the preference format: columns found: {found}; "
        f"accepted formats: {FORMAT_HELP}. Set the format explicitly or rename the columns."
    )


def row_layout(row: dict, prompts: bool) -> str | None:
    """The layout one row follows, or None when it follows none (a malformed row).

    Where other rows have a prompt (``prompts``), a row without one is an HH row only if it holds a
    transcript (``Human:``); otherwise it is a prompt row that lacks its prompt, dropped as malformed.
    """
    chosen, rejected, prompt = row.get("chosen"), row.get("rejected"), row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if isinstance(prompt, str):
            return "prompt"
        return "hh" if prompt is None and (not prompts or "Human:" in chosen) else None
    if isinstance(chosen, list) and isinstance(rejected, list) and (prompt is None or isinstance(prompt, list)):
        return "messages"
    return None


def _detect_by_rows(ds: datasets.Dataset, kinds: dict, on_malformed: str) -> str:
    """The one layout the rows follow; rows that follow none are left for
    :func:`rm.data.normalise.normalise_pairs` to report (malformed). Several layouts in one split are an
    error that names them with their counts, or under ``on_malformed="skip"`` the layout of most rows (a tie
    is still an error: nothing says which the user meant)."""
    present = [c for c in ("prompt", "chosen", "rejected") if c in ds.column_names]
    layouts: Counter = Counter()
    first: dict[str, int] = {}
    for i, row in enumerate(ds.select_columns(present)):
        layout = row_layout(row, "prompt" in present) or "none"
        layouts[layout] += 1
        first.setdefault(layout, i)
    found = [k for k in layouts if k != "none"]
    if len(found) == 1:
        return found[0]
    described = ", ".join(
        f"{layouts[k]} row(s) {k if k != 'none' else 'of no format'} (first: row {first[k]})" for k in sorted(layouts)
    )
    if not found:
        columns = ", ".join(f"{n} ({k})" for n, k in kinds.items())
        raise DataError(f"cannot detect the preference format: no row follows one ({described}); columns: {columns}; "
                        f"accepted formats: {FORMAT_HELP}", row=first["none"])
    (most, n), *rest = sorted(((k, layouts[k]) for k in found), key=lambda kn: (-kn[1], first[kn[0]]))
    if on_malformed == "skip" and n > rest[0][1]:
        logger.warning("the rows mix preference formats: %s. data.on_malformed=skip: the split is %r, the %d row(s) of "
                       "other formats are dropped (other_format in data_audit.json; data.on_malformed=error refuses "
                       "the file)", described, most, sum(c for _, c in rest))
        return most
    raise DataError(
        f"the rows mix preference formats: {described}. One split must use one format: "
        "convert the rows to one format, or split them into separate datasets"
        + ("" if on_malformed == "error" else f" (no format has most rows, so data.on_malformed={on_malformed} cannot "
                                              "choose one)"),
        row=min(first[k] for k in found[1:]))
