"""The pair audit: what each split's pairs look like before the first step.

:func:`rm.data.build.build_datasets` gathers one audit per split from the
:class:`~rm.data.counts.PairCounts` of the split and from the token lengths of the
pairs kept; ``rm.training.run_setup`` writes it to ``data_audit.json`` in the run directory
and logs :func:`format_audit`. The policies it reports (``data.truncation``,
``data.identical_pairs``, ``data.duplicates``, ``data.on_malformed``) are
documented once, in :mod:`rm.data`.

Every input row is accounted for: ``pairs_in`` minus the sum of ``dropped``
(by reason) is ``pairs_out``, and :func:`audit_split` refuses counts whose
``pairs_out`` is not the number of pairs kept.

Lengths are in tokens, any special tokens the tokenizer adds included. ``p95`` is the nearest-rank
percentile (the smallest length that at least 95% of the pairs do not exceed)
and ``median`` the usual one (the mean of the two middle values for an even
count), so both can be checked by hand.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rm.data.counts import SIDES, Drop, PairCounts

STATS = ("min", "mean", "median", "p95", "max")


def length_stats(histogram: Mapping[int, int]) -> dict[str, float]:
    """Min, mean, median, p95 and max of lengths given as ``{length: number of sequences}``.

    A histogram rather than a list: it is what the tokeniser can gather batch by
    batch, and it stays small (one entry per distinct length).

    Args:
        histogram: Number of sequences of each length; zero counts are ignored.

    Returns:
        ``{"min", "mean", "median", "p95", "max"}``; all 0 when the histogram is
        empty. ``min``, ``p95`` and ``max`` are ints.

    >>> length_stats({3: 1, 5: 2, 10: 1})  # lengths 3, 5, 5, 10
    {'min': 3, 'mean': 5.75, 'median': 5.0, 'p95': 10, 'max': 10}
    """
    items = sorted((length, n) for length, n in histogram.items() if n > 0)
    total = sum(n for _, n in items)
    if not total:
        return {"min": 0, "mean": 0.0, "median": 0.0, "p95": 0, "max": 0}

    def at(rank: int) -> int:  # the value at 0-based position `rank` of the sorted lengths
        seen = 0
        for length, n in items:
            seen += n
            if rank < seen:
                return length
        raise AssertionError("rank beyond the histogram")

    return {
        "min": items[0][0],
        "mean": sum(length * n for length, n in items) / total,
        "median": (at((total - 1) // 2) + at(total // 2)) / 2,
        "p95": at(math.ceil(0.95 * total) - 1),
        "max": items[-1][0],
    }


def audit_split(counts: PairCounts, chosen_lengths: Iterable[int], rejected_lengths: Iterable[int]) -> dict:
    """The audit of one split, JSON-able.

    Args:
        counts: The split's counts, as :func:`~rm.data.tokenise.tokenize_pairs` returns them.
        chosen_lengths: Token length of each kept pair's chosen side, as trained
            (after truncation); :func:`rm.data.tokenise.pair_lengths` reads them.
        rejected_lengths: The same for the rejected side.

    Returns:
        ``pairs_in`` (rows read), ``pairs_out`` (pairs kept), ``dropped`` (one count
        per :class:`~rm.data.counts.Drop` reason), ``truncated`` (kept pairs that lost
        tokens), ``identical_text`` / ``identical_before_truncation`` /
        ``identical_after_truncation`` (pairs whose two sides are equal as texts /
        as token ids / as the ids trained on; dropped or kept, see ``dropped``),
        ``duplicates`` (pairs repeating an earlier pair's ids, dropped or kept),
        ``unk_rate`` (share of the unknown token among the tokenised sides' tokens),
        ``empty_sides`` (``{"chosen", "rejected"}``: rows whose side is empty; a row
        with both empty counts in both), ``drop_reasons`` (each reason a malformed or
        empty row was dropped for, with its ``count`` and ``first_row``), ``lengths`` (``{side: {"kept": stats,
        "before_truncation": stats}}`` with :data:`STATS`; "before truncation"
        covers every pair that was tokenised) and ``longer`` (share of kept pairs
        where ``chosen`` is longer, the sides ``tie`` or ``rejected`` is longer;
        None without pairs).

    Raises:
        ValueError: The lengths do not match the pairs the counts keep.
    """
    chosen, rejected = list(chosen_lengths), list(rejected_lengths)
    dropped = {reason.value: counts.dropped[reason] for reason in Drop}
    if len(chosen) != counts.pairs_out or len(rejected) != counts.pairs_out:
        raise ValueError(
            f"the counts do not account for every pair: {counts.rows} in, dropped {dropped}, {counts.pairs_out} out, "
            f"{len(chosen)} chosen and {len(rejected)} rejected lengths"
        )
    n = len(chosen)
    chosen_longer = sum(c > r for c, r in zip(chosen, rejected))
    ties = sum(c == r for c, r in zip(chosen, rejected))
    return {
        "pairs_in": counts.rows,
        "pairs_out": counts.pairs_out,
        "dropped": dropped,
        "truncated": counts.truncated,
        "identical_text": counts.identical_text,
        "identical_before_truncation": counts.identical_before_truncation,
        "identical_after_truncation": counts.identical_after_truncation,
        "duplicates": counts.duplicates,
        # Unknown tokens among all tokenised sides: a tokenizer that does not know the text (rm.training.health alarm).
        "unk_rate": counts.unk_tokens / counts.tokens if counts.tokens else 0.0,
        "empty_sides": {side: counts.empty_sides[side] for side in SIDES},
        "drop_reasons": dict(counts.drop_reasons),  # malformed/empty rows: {reason: {count, first_row}}
        # Sides far over max_length, cut to their end before tokenizing (rm.data.normalise.max_chars_for).
        "capped_before_tokenizing": {"count": counts.capped, "first_row": counts.capped_first_row,
                                     "longest_chars": counts.capped_longest},
        "lengths": {
            side: {"kept": length_stats(Counter(kept)), "before_truncation": counts.lengths_before_truncation[side]}
            for side, kept in zip(SIDES, (chosen, rejected))
        },
        "longer": {
            "chosen": chosen_longer / n if n else None,
            "tie": ties / n if n else None,
            "rejected": (n - chosen_longer - ties) / n if n else None,
        },
    }


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _format_split(name: str, a: Mapping[str, Any]) -> str:
    dropped = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in a["dropped"].items() if n) or "none"
    dup_kept = a["duplicates"] - a["dropped"]["duplicate"]
    identical_kept = a["identical_after_truncation"] - a["dropped"]["identical"]
    lengths = []
    for side in ("chosen", "rejected"):
        kept, before = a["lengths"][side]["kept"], a["lengths"][side]["before_truncation"]
        lengths.append(
            f"{side} {kept['min']}/{kept['median']:g}/{kept['p95']}/{kept['max']} (before truncation max {before['max']})"
        )
    return (
        f"{name}: {a['pairs_in']} pairs -> {a['pairs_out']} kept (dropped: {dropped}); {a['truncated']} truncated; "
        f"identical sides: {a['identical_text']} as text, {a['identical_before_truncation']} as ids before "
        f"truncation, {a['identical_after_truncation']} after ({identical_kept} kept); "
        f"{a['duplicates']} duplicates ({dup_kept} kept); "
        f"empty sides: chosen {a['empty_sides']['chosen']}, rejected {a['empty_sides']['rejected']}; "
        f"tokens min/median/p95/max of kept pairs: {', '.join(lengths)}; "
        f"chosen longer in {_share(a['longer']['chosen'])} of kept pairs, ties {_share(a['longer']['tie'])}"
        + (f"; unknown tokens {_share(a['unk_rate'])}" if a.get("unk_rate") else "")
    )


def format_audit(audit: Mapping[str, Any]) -> str:
    """The audit as one paragraph for the log.

    Args:
        audit: ``{"data": name, "policies": {key: value}, "splits": {split: audit_split(...)}}``,
            as :func:`rm.data.build.build_datasets` returns it.

    Returns:
        ``"data audit (<name>; data.truncation=truncate, ...): train: 8 pairs -> 5 kept
        (dropped: 1 empty, ...); ... eval: ..."``.
    """
    policies = ", ".join(f"data.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in audit["policies"].items())
    splits = "; ".join(_format_split(name, a) for name, a in audit["splits"].items())
    return f"data audit ({audit['data']}; {policies}): {splits}"


def write_audit(path: str | os.PathLike, audit: Mapping[str, Any]) -> None:
    """Writes the audit as JSON, whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(audit, indent=2) + "\n")
    os.replace(tmp, path)
