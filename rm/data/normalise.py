"""Raw preference rows to ``chosen`` / ``rejected`` texts and a margin, any accepted layout alike.

The layouts and the policies that drop rows are documented once, in :mod:`rm.data`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import datasets

from rm.foundations.config import FORMATS, IDENTICAL_PAIRS, ON_MALFORMED
from rm.data.counts import SIDES, Drop, PairCounts
from rm.data.load import FORMAT_HELP, check_choice, detect_format, map_counting, row_layout
from rm.foundations.errors import DataError

logger = logging.getLogger(__name__)


def _required_columns(fmt: str) -> tuple[str, ...]:
    return ("prompt", "chosen", "rejected") if fmt == "prompt" else ("chosen", "rejected")


class _RowProblem(Exception):
    """A row-level problem; ``kind`` is the reason the row is dropped for."""

    def __init__(self, kind: Drop, message: str):
        super().__init__(message)
        self.kind = kind


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


def _check_text(column: str, value: Any, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _RowProblem(Drop.MALFORMED, f"'{column}' is {_type_name(value)}, expected a string")
    if not allow_empty and not value.strip():
        raise _RowProblem(Drop.EMPTY, f"'{column}' is empty" if not value else f"'{column}' is whitespace only")
    return value


def _check_messages(column: str, value: Any, allow_empty: bool = False) -> list[dict]:
    if not isinstance(value, (list, tuple)):
        raise _RowProblem(Drop.MALFORMED, f"'{column}' is {_type_name(value)}, expected a list of messages")
    messages = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise _RowProblem(
                Drop.MALFORMED, f"'{column}' message {j} is {_type_name(msg)}, expected a {{'role', 'content'}} dict"
            )
        for field in ("role", "content"):
            if not isinstance(msg.get(field), str):
                raise _RowProblem(
                    Drop.MALFORMED,
                    f"'{column}' message {j} has {field}={msg.get(field)!r}, expected a string",
                )
        # Arrow gives every message every key seen in the column (missing ones as
        # None); a chat template would render those Nones literally.
        messages.append({k: v for k, v in msg.items() if v is not None})
    if not allow_empty:
        if not messages:
            raise _RowProblem(Drop.EMPTY, f"'{column}' is an empty list of messages")
        # The last message is the response being judged, whether or not the prompt
        # is repeated inside the side.
        if not messages[-1]["content"].strip():
            raise _RowProblem(Drop.EMPTY, f"'{column}' ends with an empty message")
    return messages


def _empty_sides(row: dict, fmt: str) -> list[str]:
    """The sides of a row that are empty (a row with an empty side is dropped whole)."""
    check = _check_messages if fmt == "messages" else _check_text
    sides = []
    for side in SIDES:
        try:
            check(side, row[side])
        except _RowProblem as problem:
            if problem.kind is Drop.EMPTY:
                sides.append(side)
    return sides


def _check_margin(column: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _RowProblem(Drop.MALFORMED, f"'{column}' is {_type_name(value)}, expected a number")
    if not math.isfinite(value):
        raise _RowProblem(Drop.MALFORMED, f"'{column}' is {value!r}, expected a finite number")
    return float(value)


def _render(tokenizer: Any, messages: list[dict], column: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # template errors are data errors for this row
        raise _RowProblem(Drop.MALFORMED, f"'{column}' could not be rendered by the chat template: {err}") from err
    if not isinstance(text, str):
        raise _RowProblem(Drop.MALFORMED, f"'{column}' chat template returned {_type_name(text)}, expected a string")
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
    # The prompt list is optional row by row: where some rows carry one, Arrow gives the others None.
    prompt_msgs = _check_messages("prompt", row["prompt"], allow_empty=True) if row.get("prompt") is not None else []
    chosen_msgs = _check_messages("chosen", row["chosen"])
    rejected_msgs = _check_messages("rejected", row["rejected"])
    for side, msgs in (("chosen", chosen_msgs), ("rejected", rejected_msgs)):
        _check_ends_on_an_answer(side, prompt_msgs + msgs)
    return (
        _render(tokenizer, prompt_msgs + chosen_msgs, "chosen"),
        _render(tokenizer, prompt_msgs + rejected_msgs, "rejected"),
    )


def conversation_text(messages: Any, tokenizer: Any) -> str:
    """One conversation (a chat rollout) rendered by the chat template, checked as a pair's side is.

    Raises:
        ValueError: the messages are malformed, empty or do not end on an assistant answer, or the template fails.
    """
    try:
        conversation = _check_messages("messages", messages)
        _check_ends_on_an_answer("messages", conversation)
        return _render(tokenizer, conversation, "messages")
    except _RowProblem as problem:
        raise ValueError(str(problem)) from None


def _check_ends_on_an_answer(side: str, conversation: list[dict]) -> None:
    """A preference judges an answer: the conversation of each side must end on an assistant message (not a system
    prompt alone, not a user's turn waiting for one)."""
    roles = [m["role"] for m in conversation]
    if "assistant" not in roles:
        raise _RowProblem(Drop.NO_ANSWER, f"'{side}' has no assistant message (roles {roles})")
    if roles[-1] != "assistant":
        raise _RowProblem(Drop.NO_ANSWER, f"'{side}' ends on a {roles[-1]!r} message, not an assistant answer")


# templated: the sides were rendered by the chat template, which wrote their special tokens (rm.data.tokenizer.encode_sides).
_NORMALISED_FEATURES = datasets.Features(
    {"chosen": datasets.Value("string"), "rejected": datasets.Value("string"), "margin": datasets.Value("float32"),
     "templated": datasets.Value("bool")}
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
    max_chars: int | None = None,
    truncation: str = "truncate",
) -> tuple[datasets.Dataset, PairCounts]:
    """Converts raw preference rows to ``chosen``/``rejected`` texts and a margin.

    Each row is checked: a missing/None/non-string field (or, for ``messages``,
    anything but a list of ``{"role": str, "content": str}`` dicts) is
    *malformed*; an empty or whitespace-only ``chosen``/``rejected`` (for
    ``messages``: an empty list, or a last message with blank content) is
    *empty*; a pair whose two texts are equal is *identical*. Identical pairs
    are dropped or kept per ``identical`` (see :mod:`rm.data`); the
    others are dropped or raise per ``on_malformed``. An empty ``prompt`` is
    allowed.

    Args:
        ds: Raw dataset (from :func:`rm.data.load.load_preference_split` or
            ``datasets.Dataset.from_list``).
        fmt: One of :data:`rm.foundations.config.FORMATS`; ``"auto"`` uses :func:`rm.data.load.detect_format`.
        tokenizer: Needed only for ``"messages"`` (its chat template renders the
            conversation); may be None otherwise.
        margin_column: Column holding a numeric margin per pair, copied to
            ``margin``. None: every margin is 0.0 (any ``margin`` column in the
            data is then ignored).
        on_malformed: ``"skip"`` drops and counts bad rows, ``"error"`` raises on
            the first one.
        identical: ``"drop"`` or ``"keep"`` pairs whose two texts are equal (see
            :data:`rm.foundations.config.IDENTICAL_PAIRS`).
        row_index: Also return a ``row`` column with each pair's index in ``ds``,
            which :func:`rm.data.tokenise.tokenize_pairs` names in its errors.
        max_chars: A side longer than this many characters is far longer than any ``max_length`` it was derived
            from (:func:`max_chars_for`): under ``truncation="truncate"`` it is cut to its last ``max_chars``
            characters before anything tokenises it (what truncation keeps is the end: the same ids, without
            tokenizing megabytes), counted in ``capped``; under ``"drop"`` the pair is dropped as too long, under
            ``"error"`` this raises naming the row. None: no cap.
        truncation: ``data.truncation`` (see ``max_chars``).

    Returns:
        ``(dataset, counts)``. The dataset has exactly the columns ``chosen``
        (str), ``rejected`` (str), ``margin`` (float32) and ``templated`` (bool: rendered by
        the chat template, :func:`rm.data.tokenizer.encode_sides`), in input order (and
        ``row``, int64, with ``row_index``). ``counts`` is the split's
        :class:`~rm.data.counts.PairCounts` so far: ``rows``, the drops
        ``malformed``, ``empty`` and ``identical`` (equal texts; a pair dropped
        for them counts as identical as text and as ids), ``empty_sides`` and
        ``drop_reasons``.

    Raises:
        ValueError: Unknown ``fmt``/``on_malformed``; undetectable layout; a
            required column or the requested ``margin_column`` is missing; no
            tokenizer chat template for ``"messages"``; or, with
            ``on_malformed="error"``, a bad row (message like
            ``"row 17: 'rejected' is empty"``, row = index in ``ds``).
    """
    check_choice("format", fmt, FORMATS)
    check_choice("on_malformed", on_malformed, ON_MALFORMED)
    check_choice("identical", identical, IDENTICAL_PAIRS)
    if fmt == "auto":
        fmt = detect_format(ds, on_malformed)
        logger.info("preference data: detected format %r", fmt)
    partial_prompt = _some_rows_lack("prompt", ds)
    _check_columns(ds.column_names, fmt, tokenizer, margin_column, partial_prompt)
    counts = PairCounts(rows=len(ds))
    read = _columns_read(ds.column_names, fmt, margin_column)
    if fmt == "hh" and partial_prompt:
        # Only some rows carry a prompt: those are prompt rows, not transcripts; each row's own layout is checked
        # (other_format). A prompt on every row is a column hh ignores (_check_columns warns).
        read.insert(0, "prompt")
    prompts = "prompt" in read

    def convert(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"chosen": [], "rejected": [], "margin": [], "templated": [], "row": []}
        for k, idx in enumerate(indices):
            row = {c: batch[c][k] for c in read}
            try:
                layout = row_layout(row, prompts)
                if layout not in (None, fmt):  # a valid row, of another layout: not "malformed" under this one
                    raise _RowProblem(Drop.OTHER_FORMAT, f"a {layout!r} row in a split of format {fmt!r}")
                chosen, rejected = _pair_texts(row, fmt, tokenizer)
                margin = 0.0 if margin_column is None else _check_margin(margin_column, row[margin_column])
            except _RowProblem as problem:
                if on_malformed == "error":
                    raise DataError(f"row {idx}: {problem} (format {fmt!r})", row=idx) from None
                _count_problem(counts, problem, idx, row, fmt)
                continue
            longest = max(len(chosen), len(rejected))
            if max_chars is not None and longest > max_chars:
                if truncation == "error":
                    raise DataError(f"row {idx}: a side is {longest:,} characters, far more than data.max_length tokens "
                                    f"(over {max_chars:,} characters; data.truncation=error)", row=idx)
                if truncation == "drop":
                    counts.drop(Drop.TOO_LONG)
                    continue
                chosen, rejected = chosen[-max_chars:], rejected[-max_chars:]
                counts.capped += 1
                counts.capped_longest = max(counts.capped_longest, longest)
                if counts.capped_first_row is None:
                    counts.capped_first_row = idx
            if chosen == rejected and identical == "drop":
                _count_identical_texts_dropped(counts)
                continue
            out["chosen"].append(chosen)
            out["rejected"].append(rejected)
            out["margin"].append(margin)
            out["templated"].append(fmt == "messages")
            out["row"].append(idx)
        if not row_index:
            del out["row"]
        return out

    result = map_counting(ds, convert, _ROW_FEATURES if row_index else _NORMALISED_FEATURES, "normalising preference pairs")
    # Other columns (including ones read above) are gone; make the order fixed.
    return result.select_columns(["chosen", "rejected", "margin", "templated"] + (["row"] if row_index else [])), counts


# The most characters one token of a real tokenizer covers (byte-level BPEs rarely pass 16): a side this many times
# longer than max_length tokens is longer than max_length whatever tokenizes it.
CHARS_PER_TOKEN_BOUND = 64


def max_chars_for(max_length: int) -> int:
    """The characters a side may have before it is cut (or dropped) unread by the tokenizer: a row of tens of
    megabytes would otherwise cost gigabytes to tokenize, all of it thrown away by truncation."""
    return CHARS_PER_TOKEN_BOUND * max_length


def _check_columns(columns: list[str], fmt: str, tokenizer: Any, margin_column: str | None,
                   partial_prompt: bool = False) -> None:
    """Refuse, before any row is read, data that lacks what ``fmt`` and ``margin_column`` need."""
    missing = [c for c in _required_columns(fmt) if c not in columns]
    if missing:
        raise DataError(
            f"format {fmt!r} needs column(s) {missing}, but the data has {columns}; accepted formats: {FORMAT_HELP}"
        )
    if margin_column is not None and margin_column not in columns:
        raise DataError(f"margin_column {margin_column!r} is not a column of the data (columns: {columns})")
    if fmt == "messages" and getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "format 'messages' renders conversations with tokenizer.apply_chat_template, "
            "but the tokenizer has no chat_template"
        )
    if fmt == "hh" and "prompt" in columns and not partial_prompt:
        logger.warning("format 'hh' ignores the 'prompt' column; use format 'prompt' if chosen/rejected lack it")


def _some_rows_lack(column: str, ds: datasets.Dataset) -> bool:
    """Some rows of ``ds`` hold ``column`` and some do not (null)."""
    if column not in ds.column_names:
        return False
    nulls = ds.data.column(column).null_count
    return 0 < nulls < len(ds)


def _columns_read(columns: list[str], fmt: str, margin_column: str | None) -> list[str]:
    read = [c for c in ("prompt", "chosen", "rejected") if c in columns and (c != "prompt" or fmt != "hh")]
    if margin_column is not None and margin_column not in read:
        read.append(margin_column)
    return read


def _count_problem(counts: PairCounts, problem: _RowProblem, idx: int, row: dict, fmt: str) -> None:
    """Count a malformed or empty row under its reason, so that every drop has its reason in data_audit.json."""
    counts.drop(problem.kind)
    reason = counts.drop_reasons.setdefault(f"{problem.kind.value}: {problem}", {"count": 0, "first_row": idx})
    reason["count"] += 1
    if problem.kind is Drop.EMPTY:
        counts.empty_sides.update(_empty_sides(row, fmt))


def _count_identical_texts_dropped(counts: PairCounts) -> None:
    # Equal texts tokenise alike, before and after truncation: the pair counts as identical in all three senses.
    counts.drop(Drop.IDENTICAL)
    counts.identical_text += 1
    counts.identical_before_truncation += 1
    counts.identical_after_truncation += 1
