"""Pairwise preference data: load, normalise, tokenise.

The pipeline has three steps, each usable on its own:

1. :func:`load_preference_split` reads one split from the Hugging Face Hub
   (optionally several ``data_dir`` subsets, concatenated) or from local
   jsonl / json / parquet files.
2. :func:`normalise_pairs` turns any accepted layout (``hh``, ``prompt``,
   ``messages``, or ``auto``-detected) into exactly three columns:
   ``chosen`` and ``rejected`` (the full text to score) and ``margin``.
   Bad rows are skipped and counted, or raise, per ``on_malformed``.
3. :func:`tokenize_pairs` turns those texts into token ids the reward model
   scores, applying the truncation policy below.

Accepted layouts (``format``):

* ``hh``: ``chosen`` and ``rejected`` are complete transcripts, as in
  Anthropic HH-RLHF (``"\\n\\nHuman: ...\\n\\nAssistant: ..."``).
* ``prompt``: ``prompt``, ``chosen`` and ``rejected`` strings; each scored text
  is ``prompt + chosen`` / ``prompt + rejected`` (plain concatenation, so put
  any separator you want in the data itself).
* ``messages``: ``chosen`` and ``rejected`` are lists of
  ``{"role": ..., "content": ...}`` messages, optionally with a ``prompt`` list
  of messages prepended to both; rendered with the tokenizer's chat template
  (``tokenizer.apply_chat_template(messages, tokenize=False)``).
* ``auto``: picked from the column names and types (the dataset schema).

Policies: truncation, identical pairs, duplicates
-------------------------------------------------
Each side is tokenised as ``tokenizer(text)``, nothing appended: the reward is
read at the last token of the text, the convention every client of an exported
model can follow (README, "Use your reward model"). The tokenizers rm builds add
no special tokens (:func:`rm.tokenizer.text_only`), so these are the ids TRL's
GRPO reward path (``add_special_tokens=False``) and ``tokenizer(text)`` in plain
transformers or RewardBench give; a tokenizer passed in by hand that prepends
tokens (e.g. BOS) keeps them, and truncation keeps them too.

A side longer than ``max_length`` tokens is handled per ``truncation``
(``data.truncation``):

* ``"truncate"`` (default): keep the special tokens the tokenizer prepends
  (e.g. BOS) and cut tokens from the *left* of the body, i.e. from the
  start of the prompt, until the side is exactly ``max_length`` tokens.
  The end of the response (where the reward is read) always survives;
  what is lost is the oldest context.
* ``"drop"``: drop the whole pair.
* ``"error"``: stop at the first such pair, naming its row (0-based index in
  the split as read, files concatenated in order), the side and its length.

Chosen and rejected are truncated independently (the shared prompt may lose
a different number of tokens on each side); both keep their own ending.

Identical pairs (``identical_pairs``, ``data.identical_pairs``): a pair whose
chosen and rejected token ids are equal *after truncation* trains nothing
(the loss sits at ln 2 with zero gradient). ``"drop"`` (default) removes it
(pairs with equal texts as soon as they are read, in :func:`normalise_pairs`);
``"keep"`` leaves it in. Three counts describe them: equal texts
(``identical_text``), equal ids before truncation (texts that tokenise alike,
e.g. words unknown to a word-level tokenizer) and equal ids after truncation
(responses that differ only in the part that was cut).

Duplicates (``duplicates``, ``data.duplicates``): a pair whose chosen and
rejected ids (after truncation) both equal those of an earlier pair of the
same split is a duplicate. ``"keep"`` (default) keeps and counts it;
``"drop"`` keeps only the first occurrence.

Other rows dropped and counted, never silently altered:

* malformed rows and rows with an empty ``chosen`` or ``rejected``, per
  ``on_malformed`` (``"skip"`` counts them, ``"error"`` raises), see
  :func:`normalise_pairs`;
* a side containing the pad id anywhere (``pad_in_text``): at the end it moves
  the token the reward is read from, and collators that derive the attention
  mask from pad ids would mask it anywhere. With ``on_malformed="error"``
  this raises instead.

The checks run in this order, each on the pairs the previous ones kept:
malformed/empty, length, pad id, identical, duplicate. Every row read is
accounted for in the counts (``rm.data.audit`` checks that they add up and
``rm.train`` writes them to ``data_audit.json``).
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import math
import os
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import datasets

from rm.data.audit import length_stats
from rm.data.policies import DUPLICATES, FORMATS, IDENTICAL_PAIRS, ON_MALFORMED, TRUNCATION  # noqa: F401  (documented here)
from rm.errors import ConfigError, DataError, DataFileNotFound

logger = logging.getLogger(__name__)

SOURCES = ("hub", "local")

_EXTENSION_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}

_FORMAT_HELP = (
    "hh (columns 'chosen', 'rejected': full transcript strings), "
    "prompt (columns 'prompt', 'chosen', 'rejected': strings), "
    "messages (columns 'chosen', 'rejected': lists of {'role', 'content'} "
    "messages, optional 'prompt' list of messages)"
)

# map() batch size: large enough to amortise Python overhead, small enough that
# one batch of long transcripts stays a few MB.
_BATCH_SIZE = 1000


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def _expand_files(files: Iterable[str], key: str) -> list[str]:
    """Expands globs; every entry must match at least one file."""
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
    if missing:
        shown = ", ".join(repr(m) for m in missing)
        raise DataFileNotFound(
            f"{key}: no file matches {shown} (relative paths are resolved against {os.getcwd()!r})"
        )
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
    _check_choice("source", source, SOURCES)
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
        resolved = _expand_files(files, key)
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

    if max_samples is not None and len(ds) > max_samples:
        ds = ds.select(range(int(max_samples)))
    return ds


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


# --------------------------------------------------------------------------- #
# Normalising
# --------------------------------------------------------------------------- #


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


def detect_format(ds: datasets.Dataset) -> str:
    """Detects the preference layout of a dataset from its columns and types.

    Args:
        ds: Raw dataset (e.g. from :func:`load_preference_split`).

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
        return _detect_by_rows(ds, kinds)
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
        f"accepted formats: {_FORMAT_HELP}. Set the format explicitly or rename the columns."
    )


def _row_layout(row: dict, prompts: bool) -> str | None:
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


def _detect_by_rows(ds: datasets.Dataset, kinds: dict) -> str:
    """The one layout the rows follow; rows that follow none are left for :func:`normalise_pairs` to
    report (malformed). Several layouts in one split are an error that names them."""
    present = [c for c in ("prompt", "chosen", "rejected") if c in ds.column_names]
    layouts: Counter = Counter()
    first: dict[str, int] = {}
    for i, row in enumerate(ds.select_columns(present)):
        layout = _row_layout(row, "prompt" in present) or "none"
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
                        f"accepted formats: {_FORMAT_HELP}", row=first["none"])
    raise DataError(
        f"the rows mix preference formats: {described}. One split must use one format: "
        "convert the rows to one format, or split them into separate datasets", row=min(first[k] for k in found[1:]))

def _required_columns(fmt: str) -> tuple[str, ...]:
    return ("prompt", "chosen", "rejected") if fmt == "prompt" else ("chosen", "rejected")


class _RowProblem(Exception):
    """A row-level problem; ``kind`` is the counts key it is filed under."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _check_text(column: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _RowProblem("malformed", f"'{column}' is {_type_name(value)}, expected a string")
    if not allow_empty and not value.strip():
        raise _RowProblem("empty", f"'{column}' is empty" if not value else f"'{column}' is whitespace only")
    return value


def _check_messages(column: str, value: Any, allow_empty: bool = False) -> list[dict]:
    if not isinstance(value, (list, tuple)):
        raise _RowProblem("malformed", f"'{column}' is {_type_name(value)}, expected a list of messages")
    messages = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _RowProblem(
                "malformed", f"'{column}' message {j} is {_type_name(msg)}, expected a {{'role', 'content'}} dict"
            )
        for field in ("role", "content"):
            if not isinstance(msg.get(field), str):
                raise _RowProblem(
                    "malformed",
                    f"'{column}' message {j} has {field}={msg.get(field)!r}, expected a string",
                )
        # Arrow gives every message every key seen in the column (missing ones as
        # None); a chat template would render those Nones literally.
        messages.append({k: v for k, v in msg.items() if v is not None})
    if not allow_empty:
        if not messages:
            raise _RowProblem("empty", f"'{column}' is an empty list of messages")
        # The last message is the response being judged, whether or not the prompt
        # is repeated inside the side.
        if not messages[-1]["content"].strip():
            raise _RowProblem("empty", f"'{column}' ends with an empty message")
    return messages


def _empty_sides(row: dict, fmt: str) -> list[str]:
    """The sides of a row that are empty (a row with an empty side is dropped whole)."""
    check = _check_messages if fmt == "messages" else _check_text
    sides = []
    for side in ("chosen", "rejected"):
        try:
            check(side, row[side])
        except _RowProblem as problem:
            if problem.kind == "empty":
                sides.append(side)
    return sides


def _check_margin(column: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _RowProblem("malformed", f"'{column}' is {_type_name(value)}, expected a number")
    if not math.isfinite(value):
        raise _RowProblem("malformed", f"'{column}' is {value!r}, expected a finite number")
    return float(value)


def _render(tokenizer: Any, messages: list[dict], column: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # template errors are data errors for this row
        raise _RowProblem("malformed", f"'{column}' could not be rendered by the chat template: {err}") from err
    if not isinstance(text, str):
        raise _RowProblem("malformed", f"'{column}' chat template returned {_type_name(text)}, expected a string")
    return text


def _pair_texts(row: dict, fmt: str, tokenizer: Any) -> tuple[str, str]:
    if fmt == "hh":
        return _check_text("chosen", row["chosen"]), _check_text("rejected", row["rejected"])
    if fmt == "prompt":
        # An empty prompt is legal (the responses carry the whole context).
        prompt = _check_text("prompt", row["prompt"], allow_empty=True)
        chosen = _check_text("chosen", row["chosen"])
        rejected = _check_text("rejected", row["rejected"])
        return prompt + chosen, prompt + rejected
    prompt_msgs = _check_messages("prompt", row["prompt"], allow_empty=True) if "prompt" in row else []
    chosen_msgs = _check_messages("chosen", row["chosen"])
    rejected_msgs = _check_messages("rejected", row["rejected"])
    return (
        _render(tokenizer, prompt_msgs + chosen_msgs, "chosen"),
        _render(tokenizer, prompt_msgs + rejected_msgs, "rejected"),
    )


_NORMALISED_FEATURES = datasets.Features(
    {"chosen": datasets.Value("string"), "rejected": datasets.Value("string"), "margin": datasets.Value("float32")}
)
_ROW_FEATURES = datasets.Features({**_NORMALISED_FEATURES, "row": datasets.Value("int64")})


def normalise_pairs(
    ds: datasets.Dataset,
    fmt: str,
    tokenizer: Any = None,
    margin_column: str | None = None,
    on_malformed: str = "skip",
    identical: str = "drop",
    row_index: bool = False,
) -> tuple[datasets.Dataset, dict[str, int]]:
    """Converts raw preference rows to ``chosen``/``rejected`` texts and a margin.

    Each row is checked: a missing/None/non-string field (or, for ``messages``,
    anything but a list of ``{"role": str, "content": str}`` dicts) is
    *malformed*; an empty or whitespace-only ``chosen``/``rejected`` (for
    ``messages``: an empty list, or a last message with blank content) is
    *empty*; a pair whose two texts are equal is *identical*. Identical pairs
    are dropped or kept per ``identical`` (see the module docstring); the
    others are dropped or raise per ``on_malformed``. An empty ``prompt`` is
    allowed.

    Args:
        ds: Raw dataset (from :func:`load_preference_split` or
            ``datasets.Dataset.from_list``).
        fmt: One of :data:`FORMATS`; ``"auto"`` uses :func:`detect_format`.
        tokenizer: Needed only for ``"messages"`` (its chat template renders the
            conversation); may be None otherwise.
        margin_column: Column holding a numeric margin per pair, copied to
            ``margin``. None: every margin is 0.0 (any ``margin`` column in the
            data is then ignored).
        on_malformed: ``"skip"`` drops and counts bad rows, ``"error"`` raises on
            the first one.
        identical: ``"drop"`` or ``"keep"`` pairs whose two texts are equal (see
            :data:`IDENTICAL_PAIRS`).
        row_index: Also return a ``row`` column with each pair's index in ``ds``,
            which :func:`tokenize_pairs` names in its errors.

    Returns:
        ``(dataset, counts)``. The dataset has exactly the columns ``chosen``
        (str), ``rejected`` (str) and ``margin`` (float32), in input order (and
        ``row``, int64, with ``row_index``). ``counts`` has the int keys ``rows``
        (input rows), ``malformed``, ``empty``, ``identical`` (dropped because
        the texts are equal; 0 with ``identical="keep"``) and ``kept`` (= rows
        minus the other three), and ``empty_chosen`` / ``empty_rejected``: rows
        whose chosen / rejected side is empty (a row with both empty counts in
        both; the row is counted once in ``empty``). ``drop_reasons`` maps each
        distinct reason a malformed or empty row was dropped for
        (``"malformed: 'chosen' is int, expected a string"``) to its ``count``
        and ``first_row``.

    Raises:
        ValueError: Unknown ``fmt``/``on_malformed``; undetectable layout; a
            required column or the requested ``margin_column`` is missing; no
            tokenizer chat template for ``"messages"``; or, with
            ``on_malformed="error"``, a bad row (message like
            ``"row 17: 'rejected' is empty"``, row = index in ``ds``).
    """
    _check_choice("format", fmt, FORMATS)
    _check_choice("on_malformed", on_malformed, ON_MALFORMED)
    _check_choice("identical", identical, IDENTICAL_PAIRS)
    if fmt == "auto":
        fmt = detect_format(ds)
        logger.info("preference data: detected format %r", fmt)

    columns = list(ds.column_names)
    missing = [c for c in _required_columns(fmt) if c not in columns]
    if missing:
        raise DataError(
            f"format {fmt!r} needs column(s) {missing}, but the data has {columns}; accepted formats: {_FORMAT_HELP}"
        )
    if margin_column is not None and margin_column not in columns:
        raise DataError(f"margin_column {margin_column!r} is not a column of the data (columns: {columns})")
    if fmt == "messages" and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "format 'messages' renders conversations with tokenizer.apply_chat_template, "
            "but the tokenizer has no chat_template"
        )
    if fmt == "hh" and "prompt" in columns:
        logger.warning("format 'hh' ignores the 'prompt' column; use format 'prompt' if chosen/rejected lack it")

    counts = {"rows": len(ds), "malformed": 0, "empty": 0, "identical": 0, "kept": 0, "empty_chosen": 0, "empty_rejected": 0}
    reasons: dict[str, dict] = {}  # "kind: why" -> {"count", "first_row"}: every drop has its reason in data_audit.json
    read = [c for c in ("prompt", "chosen", "rejected") if c in columns and (c != "prompt" or fmt != "hh")]
    if margin_column is not None and margin_column not in read:
        read.append(margin_column)

    def convert(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"chosen": [], "rejected": [], "margin": [], "row": []}
        for k, idx in enumerate(indices):
            row = {c: batch[c][k] for c in read}
            try:
                chosen, rejected = _pair_texts(row, fmt, tokenizer)
                margin = 0.0 if margin_column is None else _check_margin(margin_column, row[margin_column])
            except _RowProblem as problem:
                if on_malformed == "error":
                    raise DataError(f"row {idx}: {problem} (format {fmt!r})", row=idx) from None
                counts[problem.kind] += 1
                reason = reasons.setdefault(f"{problem.kind}: {problem}", {"count": 0, "first_row": idx})
                reason["count"] += 1
                if problem.kind == "empty":
                    for side in _empty_sides(row, fmt):
                        counts[f"empty_{side}"] += 1
                continue
            if chosen == rejected and identical == "drop":
                counts["identical"] += 1
                continue
            out["chosen"].append(chosen)
            out["rejected"].append(rejected)
            out["margin"].append(margin)
            out["row"].append(idx)
        counts["kept"] += len(out["chosen"])
        if not row_index:
            del out["row"]
        return out

    result = ds.map(
        convert,
        with_indices=True,
        batched=True,
        batch_size=_BATCH_SIZE,
        remove_columns=columns,
        features=_ROW_FEATURES if row_index else _NORMALISED_FEATURES,
        # The counts are gathered while map runs; a cache hit would skip the
        # function and report zeros.
        load_from_cache_file=False,
        desc="normalising preference pairs",
    )
    # Other columns (including ones read above) are gone; make the order fixed.
    result = result.select_columns(["chosen", "rejected", "margin"] + (["row"] if row_index else []))
    counts["drop_reasons"] = reasons
    return result, counts


# --------------------------------------------------------------------------- #
# Tokenising
# --------------------------------------------------------------------------- #


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """Ids the tokenizer prepends to any text (e.g. ``[BOS]``); truncation keeps them."""
    # Compare a probe with and without special tokens rather than trusting
    # bos_token_id alone: some tokenizers prepend other tokens (e.g. [CLS]),
    # and some declare a BOS they never add.
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    if plain:
        for k in range(len(with_special) - len(plain) + 1):
            if with_special[k : k + len(plain)] == plain:
                return list(with_special[:k])
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and with_special[:1] == [bos] else []


_TOKENIZED_FEATURES = datasets.Features(
    {
        "chosen_input_ids": datasets.List(datasets.Value("int32")),
        "rejected_input_ids": datasets.List(datasets.Value("int32")),
        "margin": datasets.Value("float32"),
    }
)


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as ``tokenizer(text)`` gives them (see the module docstring)."""
    return tokenizer(list(texts))["input_ids"]


def truncate_left(ids: list[int], lead: Sequence[int], max_length: int) -> list[int]:
    """Cut ``ids`` to ``max_length`` from the left, keeping the leading special ids ``lead``.

    >>> truncate_left([2, 10, 11, 12, 13, 3], lead=[2], max_length=4)
    [2, 12, 13, 3]
    """
    if len(ids) <= max_length:
        return ids
    n_lead = len(lead) if lead and ids[: len(lead)] == list(lead) else 0
    return ids[:n_lead] + ids[len(ids) - (max_length - n_lead) :]


def leading_special_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer prepends to every text (e.g. BOS)."""
    return _leading_special_ids(tokenizer)


def _pair_key(chosen: list[int], rejected: list[int]) -> bytes:
    """A 16-byte digest of a pair's ids: remembering every pair of a large split costs little.

    ``-1`` separates the sides (no token id is negative). A collision between two
    different pairs has probability ~2**-128 per pair compared.
    """
    return hashlib.blake2b(array("q", [*chosen, -1, *rejected]).tobytes(), digest_size=16).digest()


def tokenize_pairs(
    ds: datasets.Dataset,
    tokenizer: Any,
    max_length: int,
    truncation: str = "truncate",
    on_malformed: str = "skip",
    identical: str = "drop",
    duplicates: str = "keep",
) -> tuple[datasets.Dataset, dict[str, float]]:
    """Tokenises normalised pairs and applies the policies of the module docstring.

    Per side: ``ids = tokenizer(text)["input_ids"]``. A side longer than
    ``max_length`` keeps the tokens the tokenizer prepends (e.g. BOS) and loses
    tokens from the left of the rest (``"truncate"``), or the pair is dropped
    (``"drop"``), or this raises (``"error"``). A side that contains the pad id
    is dropped (``on_malformed="skip"``) or raises. Pairs whose ids end up
    identical, then pairs repeating an earlier pair's ids, are dropped or kept
    per ``identical`` and ``duplicates``.

    Args:
        ds: Dataset with columns ``chosen``, ``rejected`` (str) and ``margin``, as
            returned by :func:`normalise_pairs`; with its ``row`` column, errors
            name that row instead of the index in ``ds``.
        tokenizer: A transformers tokenizer.
        max_length: Maximum tokens per side, special tokens included.
        truncation: One of :data:`TRUNCATION`.
        on_malformed: What to do with a side containing the pad id: ``"skip"``
            (drop, count as ``pad_in_text``) or ``"error"`` (raise).
        identical: One of :data:`IDENTICAL_PAIRS`.
        duplicates: One of :data:`DUPLICATES`.

    Returns:
        ``(dataset, counts)``. The dataset has the columns ``chosen_input_ids``
        and ``rejected_input_ids`` (lists of int, unpadded) and ``margin``
        (float32). ``counts`` has the ints ``pairs_in``; ``truncated`` (output
        pairs where either side was cut); the drops ``dropped_too_long``,
        ``pad_in_text``, ``dropped_identical``, ``dropped_duplicate``;
        ``pairs_out``; ``identical_text`` and ``identical_before_truncation``
        (input pairs whose texts / full ids are equal), ``identical_after_truncation``
        (pairs past the length and pad checks whose ids are equal, kept or not)
        and ``duplicates`` (pairs past the identical check that repeat an earlier
        one, kept or not); ``tokens`` and ``unk_tokens`` (all sides before truncation,
        and how many of them are the unknown token). Then ``{side}_len_{stat}`` for side ``chosen`` /
        ``rejected`` and stat ``min``, ``mean``, ``median``, ``p95``, ``max``:
        token lengths of all input pairs before truncation
        (:func:`rm.data.audit.length_stats`; all 0 on empty input).

    Raises:
        ValueError: Unknown ``truncation``/``on_malformed``/``identical``/``duplicates``;
            missing columns; ``max_length`` too small to keep the prepended
            special tokens and one more token; with ``truncation="error"``, a side
            longer than ``max_length``; or, with ``on_malformed="error"``, a side
            containing the pad id (messages name the row, the side and, for
            length, its tokens).
    """
    _check_choice("truncation", truncation, TRUNCATION)
    _check_choice("on_malformed", on_malformed, ON_MALFORMED)
    _check_choice("identical", identical, IDENTICAL_PAIRS)
    _check_choice("duplicates", duplicates, DUPLICATES)
    missing = [c for c in ("chosen", "rejected", "margin") if c not in ds.column_names]
    if missing:
        raise DataError(
            f"tokenize_pairs needs the columns of normalise_pairs (chosen, rejected, margin); "
            f"missing {missing} in {ds.column_names}"
        )
    lead = _leading_special_ids(tokenizer)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= len(lead):
        raise DataError(
            f"max_length must be an integer greater than the {len(lead)} special token(s) the "
            f"tokenizer prepends, got {max_length!r}"
        )

    pad = getattr(tokenizer, "pad_token_id", None)
    has_row = "row" in ds.column_names

    counts: dict[str, float] = {
        "pairs_in": len(ds),
        "truncated": 0,
        "dropped_too_long": 0,
        "pad_in_text": 0,
        "dropped_identical": 0,
        "dropped_duplicate": 0,
        "pairs_out": 0,
        "identical_text": 0,
        "identical_before_truncation": 0,
        "identical_after_truncation": 0,
        "duplicates": 0,
        "tokens": 0,
        "unk_tokens": 0,
    }
    unk = getattr(tokenizer, "unk_token_id", None)
    histograms: dict[str, Counter] = {"chosen": Counter(), "rejected": Counter()}
    seen: set[bytes] = set()

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"chosen_input_ids": [], "rejected_input_ids": [], "margin": []}
        sides = {side: encode_texts(tokenizer, batch[side]) for side in ("chosen", "rejected")}
        for side, encoded in sides.items():
            histograms[side].update(len(ids) for ids in encoded)
            counts["tokens"] += sum(len(ids) for ids in encoded)
            if unk is not None:
                counts["unk_tokens"] += sum(ids.count(unk) for ids in encoded)
        for k, idx in enumerate(indices):
            row = batch["row"][k] if has_row else idx
            pair = {"chosen": sides["chosen"][k], "rejected": sides["rejected"][k]}
            counts["identical_text"] += batch["chosen"][k] == batch["rejected"][k]
            counts["identical_before_truncation"] += pair["chosen"] == pair["rejected"]
            long_sides = [s for s, ids in pair.items() if len(ids) > max_length]
            if long_sides:
                if truncation == "error":
                    side = long_sides[0]
                    raise DataError(
                        row=row, message=f"row {row}: '{side}' is {len(pair[side])} tokens (special tokens included), more than "
                        f"max_length={max_length}; truncation='error' stops at over-length pairs "
                        "('truncate' cuts the start of the prompt, 'drop' skips the pair)"
                    )
                if truncation == "drop":
                    counts["dropped_too_long"] += 1
                    continue
                pair = {s: truncate_left(ids, lead, max_length) for s, ids in pair.items()}
            if pad is not None:
                bad = [s for s, ids in pair.items() if pad in ids]
                if bad:
                    if on_malformed == "error":
                        raise DataError(
                            row=row, message=f"row {row}: '{bad[0]}' contains the pad token id {pad} "
                            f"({getattr(tokenizer, 'pad_token', None)!r}) in its text; the reward "
                            "model would read the reward at the wrong token"
                        )
                    counts["pad_in_text"] += 1
                    continue
            if pair["chosen"] == pair["rejected"]:
                counts["identical_after_truncation"] += 1
                if identical == "drop":
                    counts["dropped_identical"] += 1
                    continue
            key = _pair_key(pair["chosen"], pair["rejected"])
            if key in seen:
                counts["duplicates"] += 1
                if duplicates == "drop":
                    counts["dropped_duplicate"] += 1
                    continue
            seen.add(key)
            counts["truncated"] += bool(long_sides)
            out["chosen_input_ids"].append(pair["chosen"])
            out["rejected_input_ids"].append(pair["rejected"])
            out["margin"].append(batch["margin"][k])
        counts["pairs_out"] += len(out["margin"])
        return out

    result = ds.map(
        encode,
        with_indices=True,
        batched=True,
        batch_size=_BATCH_SIZE,
        remove_columns=ds.column_names,
        features=_TOKENIZED_FEATURES,
        # Counts and length statistics are gathered while map runs; a cache hit
        # would skip the function and report zeros.
        load_from_cache_file=False,
        desc="tokenising preference pairs",
    )
    if len(result) == 0:  # datasets skips the map on empty input and keeps no columns: give the schema back
        result = datasets.Dataset.from_dict({name: [] for name in _TOKENIZED_FEATURES}, features=_TOKENIZED_FEATURES)
    for side, histogram in histograms.items():
        for stat, value in length_stats(histogram).items():
            counts[f"{side}_len_{stat}"] = value
    return result, counts


# --------------------------------------------------------------------------- #
# Reporting
# --------------------------------------------------------------------------- #


def format_counts(counts: dict) -> str:
    """Summarises the counts of :func:`normalise_pairs` and/or :func:`tokenize_pairs` in one line.

    Args:
        counts: One counts dict, or both merged (``{**norm_counts, **tok_counts}``;
            their keys do not overlap).

    Returns:
        E.g. ``"pairs 1000 -> 987 used: 5 truncated, 3 dropped (too long),
        2 identical, 3 malformed skipped"``; only non-zero reasons are listed,
        and identical pairs or duplicates that were kept are listed as such
        (``"4 identical kept"``).
    """
    pairs_in = counts.get("rows", counts.get("pairs_in", 0))
    pairs_out = counts.get("pairs_out", counts.get("kept", pairs_in))
    dropped_identical = counts.get("identical", 0) + counts.get("dropped_identical", 0)
    items = [
        (counts.get("truncated", 0), "{} truncated"),
        (counts.get("dropped_too_long", 0), "{} dropped (too long)"),
        (dropped_identical, "{} identical"),
        (counts.get("pad_in_text", 0), "{} with pad token in text skipped"),
        (counts.get("malformed", 0), "{} malformed skipped"),
        (counts.get("empty", 0), "{} empty skipped"),
        (counts.get("dropped_duplicate", 0), "{} duplicates dropped"),
        (counts.get("identical_after_truncation", 0) - counts.get("dropped_identical", 0), "{} identical kept"),
        (counts.get("duplicates", 0) - counts.get("dropped_duplicate", 0), "{} duplicates kept"),
    ]
    parts = [template.format(n) for n, template in items if n]
    line = f"pairs {pairs_in} -> {pairs_out} used"
    if parts:
        line += ": " + ", ".join(parts)
    if "chosen_len_mean" in counts:
        line += " (tokens before truncation: " + ", ".join(
            f"{side} mean {counts[f'{side}_len_mean']:.1f} median {counts[f'{side}_len_median']:g} "
            f"p95 {counts[f'{side}_len_p95']} max {counts[f'{side}_len_max']}"
            for side in ("chosen", "rejected")
        ) + ")"
    return line
