"""Normalised pairs to the token ids the reward model scores, applying the policies of :mod:`rm.data`.

Per side: the ids of the reward convention (:func:`rm.data.tokenizer.encode_sides`: a plain-text side with the EOS
appended and the tokenizer's special tokens, a templated conversation as rendered). The checks run in the order
:mod:`rm.data` documents (length, pad id, identical, duplicate), each on the pairs the previous ones kept.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import datasets
import pyarrow.compute as pc

from rm.foundations.config import DUPLICATES, IDENTICAL_PAIRS, ON_MALFORMED, TRUNCATION
from rm.data.audit import length_stats
from rm.data.counts import SIDES, Drop, PairCounts
from rm.data.load import check_choice, map_counting
from rm.foundations.errors import DataError
from rm.data.tokenizer import encode_sides

_TOKENIZED_FEATURES = datasets.Features(
    {
        "chosen_input_ids": datasets.List(datasets.Value("int32")),
        "rejected_input_ids": datasets.List(datasets.Value("int32")),
        "margin": datasets.Value("float32"),
    }
)


def leading_special_ids(tokenizer: Any) -> list[int]:
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


def encode_texts(tokenizer: Any, texts: Sequence[str], templated: Sequence[bool] | None = None,
                 append_eos: bool = True) -> list[list[int]]:
    """Token ids of each text, in order, by the reward convention (:func:`rm.data.tokenizer.encode_sides`);
    ``templated[i]``: text ``i`` was rendered by the chat template (None: none was)."""
    flags = [False] * len(texts) if templated is None else [bool(t) for t in templated]
    out: list[list[int]] = [[] for _ in texts]
    for flag in (False, True):
        rows = [i for i, f in enumerate(flags) if f == flag]
        if rows:
            for i, ids in zip(rows, encode_sides(tokenizer, [texts[i] for i in rows], templated=flag, append_eos=append_eos)):
                out[i] = ids
    return out


def truncate_left(ids: list[int], lead: Sequence[int], max_length: int) -> list[int]:
    """Cut ``ids`` to ``max_length`` from the left, keeping the leading special ids ``lead``.

    >>> truncate_left([2, 10, 11, 12, 13, 3], lead=[2], max_length=4)
    [2, 12, 13, 3]
    """
    if len(ids) <= max_length:
        return ids
    n_lead = len(lead) if lead and ids[: len(lead)] == list(lead) else 0
    return ids[:n_lead] + ids[len(ids) - (max_length - n_lead) :]


def pair_lengths(ds: datasets.Dataset) -> tuple[list[int], list[int]]:
    """Token lengths of the chosen and rejected sides of a tokenised split, in order.

    Read from the Arrow list offsets, so no token id is copied into Python.
    """
    arrow = ds.with_format("arrow")
    return tuple(pc.list_value_length(arrow[f"{side}_input_ids"]).to_pylist() for side in SIDES)


def _pair_key(chosen: list[int], rejected: list[int]) -> bytes:
    """A 16-byte digest of a pair's ids: remembering every pair of a large split costs little.

    ``-1`` separates the sides (no token id is negative). A collision between two
    different pairs has probability ~2**-128 per pair compared.
    """
    return hashlib.blake2b(array("q", [*chosen, -1, *rejected]).tobytes(), digest_size=16).digest()


@dataclass
class _PairChecks:
    """The checks after tokenising, in their order: length, pad id, identical, duplicate.

    Each check either passes the pair on or drops it and counts the drop; the policies that
    stop at a pair raise naming ``row``.
    """

    counts: PairCounts
    tokenizer: Any
    max_length: int
    truncation: str
    on_malformed: str
    identical: str
    duplicates: str
    lead: list[int]
    seen: set[bytes] = field(default_factory=set)

    def keep(self, row: int, chosen: list[int], rejected: list[int]) -> dict[str, list[int]] | None:
        """The pair as trained on, or None when a check dropped it."""
        self.counts.identical_before_truncation += chosen == rejected
        pair = {"chosen": chosen, "rejected": rejected}
        cut = self._cut_to_length(row, pair)
        if cut is None or self._pad_in_text(row, cut) or self._identical(cut) or self._duplicate(cut):
            return None
        self.counts.truncated += cut is not pair
        return cut

    def _cut_to_length(self, row: int, pair: dict[str, list[int]]) -> dict[str, list[int]] | None:
        """The pair itself when it fits, else truncated, or None when dropped (``truncation``)."""
        long_sides = [s for s, ids in pair.items() if len(ids) > self.max_length]
        if not long_sides:
            return pair
        if self.truncation == "error":
            side = long_sides[0]
            raise DataError(
                row=row, message=f"row {row}: '{side}' is {len(pair[side])} tokens (special tokens included), more than "
                f"max_length={self.max_length}; truncation='error' stops at over-length pairs "
                "('truncate' cuts the start of the prompt, 'drop' skips the pair)"
            )
        if self.truncation == "drop":
            self.counts.drop(Drop.TOO_LONG)
            return None
        return {s: truncate_left(ids, self.lead, self.max_length) for s, ids in pair.items()}

    def _pad_in_text(self, row: int, pair: dict[str, list[int]]) -> bool:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        bad = [s for s, ids in pair.items() if pad is not None and pad in ids]
        if not bad:
            return False
        if self.on_malformed == "error":
            raise DataError(
                row=row, message=f"row {row}: '{bad[0]}' contains the pad token id {pad} "
                f"({getattr(self.tokenizer, 'pad_token', None)!r}) in its text; the reward "
                "model would read the reward at the wrong token"
            )
        self.counts.drop(Drop.PAD_IN_TEXT)
        return True

    def _identical(self, pair: dict[str, list[int]]) -> bool:
        if pair["chosen"] != pair["rejected"]:
            return False
        self.counts.identical_after_truncation += 1
        return self._dropped(Drop.IDENTICAL, self.identical)

    def _duplicate(self, pair: dict[str, list[int]]) -> bool:
        key = _pair_key(pair["chosen"], pair["rejected"])
        if key not in self.seen:
            self.seen.add(key)
            return False
        self.counts.duplicates += 1
        return self._dropped(Drop.DUPLICATE, self.duplicates)

    def _dropped(self, reason: Drop, policy: str) -> bool:
        """Whether ``policy`` (``"drop"`` or ``"keep"``) drops the pair; a drop is counted under ``reason``."""
        if policy == "drop":
            self.counts.drop(reason)
        return policy == "drop"


def tokenize_pairs(
    ds: datasets.Dataset,
    tokenizer: Any,
    max_length: int,
    truncation: str = "truncate",
    on_malformed: str = "skip",
    identical: str = "drop",
    duplicates: str = "keep",
    counts: PairCounts | None = None,
    append_eos: bool = True,
) -> tuple[datasets.Dataset, PairCounts]:
    """Tokenises normalised pairs and applies the policies of :mod:`rm.data`.

    Per side: the ids of :func:`rm.data.tokenizer.encode_sides` (``append_eos``: ``data.append_eos``). A side longer than
    ``max_length`` keeps the tokens the tokenizer prepends (e.g. BOS) and loses
    tokens from the left of the rest (``"truncate"``), or the pair is dropped
    (``"drop"``), or this raises (``"error"``). A side that contains the pad id
    is dropped (``on_malformed="skip"``) or raises. Pairs whose ids end up
    identical, then pairs repeating an earlier pair's ids, are dropped or kept
    per ``identical`` and ``duplicates``.

    Args:
        ds: Dataset with columns ``chosen``, ``rejected`` (str) and ``margin``, as
            returned by :func:`rm.data.normalise.normalise_pairs`; with its ``templated`` column, rows rendered
            by the chat template are tokenised as rendered (without it: none was); with its ``row`` column,
            errors name that row instead of the index in ``ds``.
        tokenizer: A transformers tokenizer.
        max_length: Maximum tokens per side, special tokens included.
        truncation: One of :data:`rm.foundations.config.TRUNCATION`.
        on_malformed: What to do with a side containing the pad id: ``"skip"``
            (drop, count as ``pad_in_text``) or ``"error"`` (raise).
        identical: One of :data:`rm.foundations.config.IDENTICAL_PAIRS`.
        duplicates: One of :data:`rm.foundations.config.DUPLICATES`.
        counts: The counts :func:`~rm.data.normalise.normalise_pairs` returned with ``ds``, to go on
            with (left unchanged); None starts new ones whose rows are the pairs of ``ds``.

    Returns:
        ``(dataset, counts)``. The dataset has the columns ``chosen_input_ids``
        and ``rejected_input_ids`` (lists of int, unpadded) and ``margin``
        (float32). ``counts`` (:class:`~rm.data.counts.PairCounts`) adds the drops
        ``too_long``, ``pad_in_text``, ``identical`` and ``duplicate``; ``truncated``;
        the identical and duplicate pairs seen, kept or not; ``tokens`` and ``unk_tokens``
        (all sides before truncation); and ``lengths_before_truncation``: token lengths of
        all input pairs before truncation (:func:`rm.data.audit.length_stats`; all 0 on empty input).

    Raises:
        ValueError: Unknown ``truncation``/``on_malformed``/``identical``/``duplicates``;
            missing columns; ``counts`` that do not end with the pairs of ``ds``;
            ``max_length`` too small to keep the prepended special tokens and one more token;
            with ``truncation="error"``, a side longer than ``max_length``; or, with
            ``on_malformed="error"``, a side containing the pad id (messages name the row,
            the side and, for length, its tokens).
    """
    _check_arguments(ds, truncation, on_malformed, identical, duplicates)
    lead = leading_special_ids(tokenizer)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= len(lead):
        raise DataError(
            f"max_length must be an integer greater than the {len(lead)} special token(s) the "
            f"tokenizer prepends, got {max_length!r}"
        )
    pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
    if append_eos and pad is not None and pad == eos:
        raise DataError(f"the tokenizer's pad token {tokenizer.pad_token!r} is the EOS that ends every plain-text side: "
                        "every side would be dropped as holding the pad id. Give the tokenizer another pad token "
                        "(rm.data.tokenizer.build_tokenizer picks one), or set data.append_eos=false")
    counts = PairCounts(rows=len(ds)) if counts is None else counts.copy()
    if counts.pairs_out != len(ds):
        raise ValueError(f"the counts end with {counts.pairs_out} pairs, the dataset has {len(ds)}")
    checks = _PairChecks(counts, tokenizer, max_length, truncation, on_malformed, identical, duplicates, lead)
    histograms = {side: Counter() for side in SIDES}
    has_row = "row" in ds.column_names

    def encode(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"chosen_input_ids": [], "rejected_input_ids": [], "margin": []}
        sides = {side: encode_texts(tokenizer, batch[side], batch.get("templated"), append_eos) for side in SIDES}
        _count_tokens(counts, histograms, sides, getattr(tokenizer, "unk_token_id", None))
        for k, idx in enumerate(indices):
            counts.identical_text += batch["chosen"][k] == batch["rejected"][k]
            pair = checks.keep(batch["row"][k] if has_row else idx, sides["chosen"][k], sides["rejected"][k])
            if pair is not None:
                out["chosen_input_ids"].append(pair["chosen"])
                out["rejected_input_ids"].append(pair["rejected"])
                out["margin"].append(batch["margin"][k])
        return out

    result = map_counting(ds, encode, _TOKENIZED_FEATURES, "tokenising preference pairs")
    if len(result) == 0:  # datasets skips the map on empty input and keeps no columns: give the schema back
        result = datasets.Dataset.from_dict({name: [] for name in _TOKENIZED_FEATURES}, features=_TOKENIZED_FEATURES)
    counts.lengths_before_truncation = {side: length_stats(histogram) for side, histogram in histograms.items()}
    return result, counts


def _check_arguments(ds: datasets.Dataset, truncation: str, on_malformed: str, identical: str, duplicates: str) -> None:
    check_choice("truncation", truncation, TRUNCATION)
    check_choice("on_malformed", on_malformed, ON_MALFORMED)
    check_choice("identical", identical, IDENTICAL_PAIRS)
    check_choice("duplicates", duplicates, DUPLICATES)
    missing = [c for c in ("chosen", "rejected", "margin") if c not in ds.column_names]
    if missing:
        raise DataError(
            f"tokenize_pairs needs the columns of normalise_pairs (chosen, rejected, margin); "
            f"missing {missing} in {ds.column_names}"
        )


def _count_tokens(counts: PairCounts, histograms: dict[str, Counter], sides: dict[str, list[list[int]]], unk: int | None) -> None:
    """Lengths and unknown tokens of every side before any check: what the tokenizer made of the text."""
    for side, encoded in sides.items():
        histograms[side].update(len(ids) for ids in encoded)
        counts.tokens += sum(len(ids) for ids in encoded)
        if unk is not None:
            counts.unk_tokens += sum(ids.count(unk) for ids in encoded)
