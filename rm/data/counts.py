"""The one record of what became of each row of a split: kept, or dropped for a :class:`Drop` reason.

:func:`rm.data.normalise.normalise_pairs` starts a :class:`PairCounts`, :func:`rm.data.tokenise.tokenize_pairs`
goes on with it, :func:`rm.data.audit.audit_split` reads it, and :meth:`PairCounts.format` is the line a
run logs. Every row read is kept or dropped for exactly one reason, so the pairs kept are the rows read
minus the drops.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

SIDES = ("chosen", "rejected")


class Drop(str, Enum):
    """Why a row was dropped; the value is its key in ``data_audit.json`` (``dropped``)."""

    MALFORMED = "malformed"
    EMPTY = "empty"
    NO_ANSWER = "no_answer"  # a conversation that does not end on an assistant message: nothing to judge
    OTHER_FORMAT = "other_format"  # a valid row of another layout than its split's (data.on_malformed=skip)
    TOO_LONG = "too_long"
    PAD_IN_TEXT = "pad_in_text"
    IDENTICAL = "identical"
    DUPLICATE = "duplicate"


# The order and words of the log line, which docs/data.md quotes.
_DROP_WORDS = (
    (Drop.TOO_LONG, "{} dropped (too long)"),
    (Drop.IDENTICAL, "{} identical"),
    (Drop.PAD_IN_TEXT, "{} with pad token in text skipped"),
    (Drop.MALFORMED, "{} malformed skipped"),
    (Drop.EMPTY, "{} empty skipped"),
    (Drop.NO_ANSWER, "{} without a final assistant answer skipped"),
    (Drop.OTHER_FORMAT, "{} of another format skipped"),
    (Drop.DUPLICATE, "{} duplicates dropped"),
)


@dataclass
class PairCounts:
    """What became of the rows of one split.

    Attributes:
        rows: Rows read.
        dropped: Rows dropped, by reason.
        truncated: Pairs kept with either side cut to ``max_length``.
        identical_text: Pairs whose two texts are equal, dropped or kept.
        identical_before_truncation: Pairs whose two sides tokenise alike (texts equal or not).
        identical_after_truncation: Pairs whose two sides are equal as the ids trained on, dropped or kept
            (pairs dropped before the identity check, too long or with a pad id, are not among them).
        duplicates: Pairs repeating an earlier pair's ids, dropped or kept.
        empty_sides: Rows whose side is empty, by side (a row with both sides empty counts under both,
            and once in ``dropped[Drop.EMPTY]``).
        tokens: Tokens of every side tokenised, before truncation.
        unk_tokens: How many of ``tokens`` are the unknown token.
        drop_reasons: Each distinct reason a malformed or empty row was dropped for
            (``"malformed: 'chosen' is int, expected a string"``) with its ``count`` and ``first_row``.
        lengths_before_truncation: ``{side: rm.data.audit.length_stats(...)}`` of every pair tokenised;
            empty until the pairs are tokenised.
        capped: Pairs with a side longer than ``max_chars`` characters (``rm.data.normalise``), cut to its last
            ``max_chars`` before tokenizing (``truncate``); ``capped_first_row`` and ``capped_longest`` (characters) name
            the first and the longest.
    """

    rows: int = 0
    dropped: Counter = field(default_factory=Counter)
    truncated: int = 0
    identical_text: int = 0
    identical_before_truncation: int = 0
    identical_after_truncation: int = 0
    duplicates: int = 0
    empty_sides: Counter = field(default_factory=Counter)
    tokens: int = 0
    unk_tokens: int = 0
    drop_reasons: dict[str, dict[str, int]] = field(default_factory=dict)
    lengths_before_truncation: dict[str, dict[str, Any]] = field(default_factory=dict)
    capped: int = 0
    capped_first_row: int | None = None
    capped_longest: int = 0

    @property
    def pairs_out(self) -> int:
        """Pairs kept: the rows read less every drop."""
        return self.rows - sum(self.dropped.values())

    def drop(self, reason: Drop) -> None:
        self.dropped[reason] += 1

    def copy(self) -> PairCounts:
        return copy.deepcopy(self)

    def absorb(self, part: PairCounts, first_row: int) -> None:
        """Add the normalisation counts of the next part of a split (its next file), whose row 0 is row
        ``first_row`` of the split, so that the split's counts name rows of the split as one part's would.

        >>> a, b = PairCounts(rows=2), PairCounts(rows=3, drop_reasons={"empty: x": {"count": 1, "first_row": 1}})
        >>> b.drop(Drop.EMPTY)
        >>> a.absorb(b, first_row=2)
        >>> a.rows, a.pairs_out, a.drop_reasons
        (5, 4, {'empty: x': {'count': 1, 'first_row': 3}})
        """
        if part.lengths_before_truncation or self.lengths_before_truncation:
            raise ValueError("absorb adds the counts of normalised parts, before any is tokenised")
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(part, f.name)
            if f.name == "drop_reasons":
                for why, r in theirs.items():
                    kept = mine.setdefault(why, {"count": 0, "first_row": r["first_row"] + first_row})
                    kept["count"] += r["count"]
            elif f.name == "capped_first_row":
                if mine is None and theirs is not None:
                    self.capped_first_row = theirs + first_row
            elif f.name == "capped_longest":
                self.capped_longest = max(mine, theirs)
            elif isinstance(mine, Counter):
                mine.update(theirs)
            elif f.name != "lengths_before_truncation":
                setattr(self, f.name, mine + theirs)

    def to_json(self) -> dict[str, Any]:
        """The counts as JSON values (what the tokenised-data cache keeps beside the pairs, ``rm.data.build``).

        >>> counts = PairCounts(rows=3, truncated=1)
        >>> counts.drop(Drop.TOO_LONG)
        >>> PairCounts.from_json(counts.to_json()) == counts
        True
        """
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "dropped": {reason.value: n for reason, n in self.dropped.items()}, "empty_sides": dict(self.empty_sides)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> PairCounts:
        """The counts :meth:`to_json` gave. Raises (KeyError, TypeError, ValueError) where ``value`` is not such counts."""
        return cls(**{**value, "dropped": Counter({Drop(reason): n for reason, n in value["dropped"].items()}),
                      "empty_sides": Counter(value["empty_sides"])})

    def format(self) -> str:
        """The counts in one line, what a run logs per split and ``rm.score`` prints.

        Only non-zero reasons are listed; identical pairs and duplicates that were kept are listed as such.

        >>> counts = PairCounts(rows=1000, truncated=5, identical_after_truncation=2)
        >>> counts.dropped.update({Drop.MALFORMED: 3, Drop.TOO_LONG: 3, Drop.IDENTICAL: 2})
        >>> counts.format()
        'pairs 1000 -> 992 used: 5 truncated, 3 dropped (too long), 2 identical, 3 malformed skipped'
        """
        items = [(self.truncated, "{} truncated"), (self.capped, "{} cut before tokenizing (far over max_length)")]
        items += [(self.dropped[reason], words) for reason, words in _DROP_WORDS]
        items += [
            (self.identical_after_truncation - self.dropped[Drop.IDENTICAL], "{} identical kept"),
            (self.duplicates - self.dropped[Drop.DUPLICATE], "{} duplicates kept"),
        ]
        parts = [words.format(n) for n, words in items if n]
        line = f"pairs {self.rows} -> {self.pairs_out} used"
        if parts:
            line += ": " + ", ".join(parts)
        if self.lengths_before_truncation:
            line += " (tokens before truncation: " + ", ".join(
                f"{side} mean {stats['mean']:.1f} median {stats['median']:g} p95 {stats['p95']} max {stats['max']}"
                for side, stats in self.lengths_before_truncation.items()
            ) + ")"
        return line
