"""The largest micro-batch a run will form, read from the data's lengths before any weight loads.

The pre-flight estimate from the config alone sizes every micro-batch at the worst case the config allows
(every sequence ``data.max_length`` tokens; under ``train.share_prefix`` a pair with no common prompt). Which
pairs each rank runs at each step is a pure function of the step (:mod:`rm.data.batching`), so the shapes the
run will really form can be computed from the token lengths alone, for every step on every rank; each rank
gets its own, as each rank's peak is its own. Activations
grow with both the rows and the padded length of a micro-batch, so the largest rows and the largest length,
even where two different micro-batches reach them, bound every micro-batch's activations.

Layouts (what the training collator pads to, :mod:`rm.data.collator`):

* ``padded`` (``PairCollator``): 2 rows per pair, padded to the longest sequence of the micro-batch;
* ``packed`` (``PackedPairCollator``): one row of all chosen and rejected tokens;
* ``shared`` (``PrefixSharedCollator``, one row per pair): rows of prompt + both answers, padded to the longest;
* ``packed+shared``: one row of every pair's prompt + both answers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # torch and datasets are imported where used: the estimate's command line reads BatchShapes
    from rm.data.batching import StepBatches

LAYOUTS = ("padded", "packed", "shared", "packed+shared")


@dataclass(frozen=True)
class BatchShape:
    """Rows x padded length of the forwards it bounds; ``padded_length``: the longest of those that are padded.

    A row-per-pair micro-batch is padded where one of its sequences is shorter than its longest. transformers then
    builds a 4D mask and SDPA repeats K/V to every query head, which keeps more for the backward (14% more on a
    4-layer GQA model at 256 tokens) than a micro-batch whose sequences are all as long, where SDPA runs
    ``is_causal`` without a mask. So a shorter padded micro-batch can outweigh a longer unpadded one, and both
    bound the peak (:meth:`variants`).

    Attributes:
        padded_length: ``None``: every micro-batch counts as padded (every layout but the padded one, and the
            config's worst case); ``0``: none is. Not compared or shown: the shape is its rows and length.
    """

    rows: int
    length: int
    padded_length: Optional[int] = field(default=None, compare=False, repr=False)

    @property
    def padded(self) -> bool:
        """The longest micro-batch is (or counts as) padded."""
        return self.padded_length is None or self.padded_length >= self.length

    def variants(self) -> List["BatchShape"]:
        """The shapes whose activations bound every micro-batch this one bounds: the longest, and the longest
        padded one where that is shorter.

        >>> [(v.length, v.padded) for v in BatchShape(4, 192, padded_length=146).variants()]
        [(192, False), (146, True)]
        >>> [(v.length, v.padded) for v in BatchShape(4, 192).variants()]
        [(192, True)]
        """
        if self.padded:
            return [BatchShape(self.rows, self.length)]
        longest = [BatchShape(self.rows, self.length, padded_length=0)]
        return longest + ([BatchShape(self.rows, self.padded_length)] if self.padded_length else [])


@dataclass(frozen=True)
class BatchShapes:
    """The shapes the activation trace is sized at.

    Attributes:
        train: the most rows and the longest row of any training micro-batch (possibly of two micro-batches).
        eval: the same for an evaluation forward; ``None``: the run evaluates nothing.
        accumulating: some rank runs more than one micro-batch in some step (gradients then stay alive
            through the later micro-batches' backward).
        sized_by: ``"data"`` (the run's own micro-batches) or ``"config"`` (the worst case the config allows).
        after_first_step: sized by the data, the same as ``train`` over the steps after the first (``None``: the run
            has one step). Optimizers that make their states at their first step (torch's, bitsandbytes') have
            none during the first step's backward: its micro-batches are weighed without them.
        first_micro_batch: sized by the data, the run's first micro-batch on this rank. DeepSpeed ZeRO-3 records
            its trace of modules there and, with no trace to look ahead in, releases each module's gathered
            parameters as soon as it has run; from the second micro-batch on it keeps them (``None``: sized by
            the config, every micro-batch counts as a later one).
        first_step_rest: the most rows and the longest row of the first step's other micro-batches (``None``:
            the first step has one micro-batch, or the shapes are the config's).
        after_first_step_rest: sized by the data, the same over the micro-batches after the first of each step after
            the first (``None``: none, or the shapes are the config's). Gradients accumulate from a step's first
            micro-batch on: these and ``first_step_rest`` alone run beside them (rm.memory.terms.micro_batch_phases).
        segment: packed layouts, the longest sequence (packed) or pair (packed+shared) a row holds: SDPA
            takes a packed row one of those at a time (``rm.modelling.attention``), and the longest bounds its transients.
            ``None``: not packed.
    """

    train: BatchShape
    eval: Optional[BatchShape]
    accumulating: bool
    sized_by: str
    after_first_step: Optional[BatchShape] = None
    first_micro_batch: Optional[BatchShape] = None
    first_step_rest: Optional[BatchShape] = None
    segment: Optional[int] = None
    after_first_step_rest: Optional[BatchShape] = None

    def to_dict(self) -> Dict:
        return asdict(self)


def layout_of(packing: bool, share_prefix: bool) -> str:
    """The training layout's name (:data:`LAYOUTS`) for ``train.packing`` and ``train.share_prefix``."""
    return ("packed+shared" if share_prefix else "packed") if packing else ("shared" if share_prefix else "padded")


def row_tokens(layout: str, chosen: Sequence[int], rejected: Sequence[int],
               shared: Optional[Sequence[int]]) -> np.ndarray:
    """Per pair, what its micro-batch's length is made of: the longer side (padded), chosen + rejected
    (packed), or prompt + both answers (shared layouts; ``shared`` as :func:`rm.training.run_setup.log_prefix_sharing`)."""
    if layout in ("shared", "packed+shared"):
        return np.asarray(shared, dtype=np.int64)
    c, r = np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64)
    return c + r if layout == "packed" else np.maximum(c, r)


def rank_orders(batches: StepBatches, steps: int) -> np.ndarray:
    """Dataset indices each rank runs at each of the first ``steps`` steps, in the order it cuts them into
    micro-batches: shape ``(steps, world_size, per_rank)``.

    The same permutations as :func:`rm.data.batching.micro_batches_for_step` (``torch.randperm`` seeded
    ``seed + epoch``), drawn once per epoch instead of once per step; ``group_by_length`` sorts each rank's
    pairs stably, as Python's ``sorted`` does, so ties keep their order.
    """
    import torch

    from rm.data.batching import steps_per_epoch

    per_epoch = steps_per_epoch(batches.num_pairs, batches.global_batch_size)
    out = np.empty((steps, batches.global_batch_size), dtype=np.int64)
    for epoch in range(math.ceil(steps / per_epoch)):
        first, last = epoch * per_epoch, min(steps, (epoch + 1) * per_epoch)
        order = torch.randperm(batches.num_pairs, generator=torch.Generator().manual_seed(batches.seed + epoch)).numpy()
        out[first:last] = order[: (last - first) * batches.global_batch_size].reshape(last - first, -1)
    out = out.reshape(steps, batches.world_size, batches.per_rank)
    if batches.sort_lengths is not None:
        keys = np.asarray(batches.sort_lengths, dtype=np.int64)[out]
        out = np.take_along_axis(out, np.argsort(keys, axis=-1, kind="stable"), axis=-1)
    return out


def greedy_cuts(tokens: np.ndarray, max_tokens: int) -> np.ndarray:
    """Per row of pairs, the micro-batch each pair lands in: :func:`rm.data.batching.split_by_tokens`,
    vectorised over the rows (a loop over the pairs of one row, not over the run's steps).

    Example:
        >>> greedy_cuts(np.array([[6, 3, 4, 9], [2, 2, 2, 2]]), max_tokens=10).tolist()
        [[0, 0, 1, 2], [0, 0, 0, 0]]
    """
    cuts = np.empty(tokens.shape, dtype=np.int64)
    used = np.full(tokens.shape[0], max_tokens, dtype=np.int64)  # forces a first micro-batch, as split_by_tokens
    current = np.full(tokens.shape[0], -1, dtype=np.int64)
    for j in range(tokens.shape[1]):
        opens = used + tokens[:, j] > max_tokens
        current += opens
        used = np.where(opens, tokens[:, j], used + tokens[:, j])
        cuts[:, j] = current
    return cuts


def evened_sums(row_tokens_: np.ndarray, sizes: list, count: int) -> list:
    """Token sums of one rank's micro-batches once :func:`rm.data.batching.even_out` has halved the largest
    until there are ``count``; the halving depends only on the pair counts ``sizes``, so it runs on those."""
    segments, start = [], 0
    for size in sizes:
        segments.append((start, size))
        start += size
    while len(segments) < count:
        i = max(range(len(segments)), key=lambda k: segments[k][1])  # the first largest, as even_out picks
        begin, size = segments[i]
        segments[i:i + 1] = [(begin, size // 2), (begin + size // 2, size - size // 2)]
    ends = np.concatenate([[0], np.cumsum(row_tokens_)])
    return [int(ends[b + n] - ends[b]) for b, n in segments]


def budget_micro_batches(batches: StepBatches, orders: np.ndarray) -> np.ndarray:
    """Per step, rank and micro-batch in the order it runs, the tokens of each packed micro-batch a token budget
    (``train.max_tokens_per_micro_batch``) cuts, as :meth:`StepBatches.for_step` cuts them (greedy, then evened out
    across ranks for DDP): shape ``(steps, world_size, most micro-batches a rank runs in a step)``, 0 past a rank's
    last micro-batch of a step.

    Example: one rank, one step of pairs of 6, 3, 4 and 9 tokens under a budget of 10 (:func:`greedy_cuts`):
        >>> from rm.data.batching import StepBatches
        >>> b = StepBatches(4, 4, 1, 1, 0, seed=0, pair_tokens=[6, 3, 4, 9], max_tokens=10)
        >>> budget_micro_batches(b, np.array([[[0, 1, 2, 3]]])).tolist()
        [[[9, 4, 9]]]
    """
    steps, world, per_rank = orders.shape
    tokens = np.asarray(batches.pair_tokens, dtype=np.int64)[orders].reshape(steps * world, per_rank)
    cuts = greedy_cuts(tokens, batches.max_tokens)
    counts = cuts[:, -1] + 1
    flat = np.arange(steps * world)[:, None] * per_rank + cuts  # one id per (row, micro-batch)
    sums = np.bincount(flat.ravel(), weights=tokens.ravel(), minlength=steps * world * per_rank).reshape(-1, per_rank)
    sums = sums.astype(np.int64)
    most = np.repeat(counts.reshape(steps, world).max(axis=1), world)  # DDP: every rank runs as many as the most
    for row in np.flatnonzero(counts < most):  # halving only shortens; these rows are the ones it changes
        sizes = np.bincount(cuts[row], minlength=counts[row]).tolist()
        evened = evened_sums(tokens[row], sizes, int(most[row]))
        sums[row] = 0
        sums[row, :len(evened)] = evened
    return sums[:, :int(most.max())].reshape(steps, world, -1)


def largest_train_batches(batches: StepBatches, steps: int, layout: str, tokens: np.ndarray,
                          shortest: Optional[np.ndarray] = None) -> tuple:
    """Per rank, the most rows and the longest row of any of its training micro-batches, over every step and over
    the steps after the first; whether any rank runs several micro-batches in a step (under DDP every rank
    runs as many as the most); and per rank its first micro-batch and the rest of its first step.

    Args:
        batches: the run's :class:`StepBatches` (any rank's: all ranks are computed).
        steps: the optimizer steps the run takes.
        layout: one of :data:`LAYOUTS`.
        tokens: per pair, :func:`row_tokens` for this layout.
        shortest: per pair, its shorter side (the padded layout); ``None``: every micro-batch counts as padded.

    Returns:
        ``([BatchShape per rank], [BatchShape per rank after the first step, or None], accumulating,
        [the first micro-batch per rank], [the first step's other micro-batches per rank, or None],
        [the other micro-batches than each step's first, after the first step, per rank, or None])``, each with the
        longest of its padded micro-batches (:attr:`BatchShape.padded_length`).
    """
    orders = rank_orders(batches, steps)
    packed = layout.startswith("packed")
    per_pair_rows = 1 if layout == "shared" else 2
    if batches.pair_tokens is not None:  # a token budget: micro-batches of varying sizes, cut greedily
        if not packed:  # rm.settings.validate allows a budget only with packing: one row of the tokens the budget counts
            raise ValueError(f"a token budget needs a packed layout, not {layout!r}")
        per_micro = np.moveaxis(budget_micro_batches(batches, orders), -1, 0)  # (micro-batches, steps, world)
        rows, accumulating = 1, len(per_micro) > 1
        uneven = np.ones(per_micro.shape, dtype=bool)
    else:
        values = tokens[orders]  # (steps, world, per_rank)
        micro = batches.micro_batch_size
        starts = range(0, batches.per_rank, micro)
        reduce = np.sum if packed else np.max
        per_micro = np.stack([reduce(values[..., i:i + micro], axis=-1) for i in starts])  # (micro-batches, steps, world)
        rows = 1 if packed else per_pair_rows * min(micro, batches.per_rank)
        accumulating = len(starts) > 1
        uneven = np.ones(per_micro.shape, dtype=bool)
        if layout == "padded" and shortest is not None:  # a micro-batch is unpadded where its shortest side is its longest
            low = shortest[orders]
            uneven = np.stack([np.min(low[..., i:i + micro], axis=-1) < np.max(values[..., i:i + micro], axis=-1)
                               for i in starts])
    padded_lengths = np.where(uneven, per_micro, 0)

    def shapes(micro_batches, steps_):
        """Per rank, the shape bounding these micro-batches of these steps (``None`` where it runs none: under a
        token budget a step's micro-batches are as many as its tokens need, 0 tokens past the last)."""
        lengths, padded = per_micro[micro_batches, steps_], padded_lengths[micro_batches, steps_]
        axes = tuple(range(lengths.ndim - 1))  # all but the ranks'
        return [BatchShape(rows, int(n), int(p)) if n else None for n, p in zip(lengths.max(axis=axes), padded.max(axis=axes))]

    everything = slice(None)
    overall = shapes(everything, everything)
    later = shapes(everything, slice(1, None)) if steps > 1 else [None] * len(overall)
    firsts = shapes(0, 0)
    rests = shapes(slice(1, None), 0) if len(per_micro) > 1 else [None] * len(overall)
    later_rests = shapes(slice(1, None), slice(1, None)) if len(per_micro) > 1 and steps > 1 else [None] * len(overall)
    return overall, later, accumulating, firsts, rests, later_rests


def largest_eval_batch(lengths: Sequence[tuple], batch_size: int, world_size: int, rank: int) -> Optional[BatchShape]:
    """The largest evaluation forward of one rank over the eval sets (:func:`rm.evaluation.metrics.evaluate`: rank ``r``
    scores pairs ``r, r + world_size, ...``, ``batch_size`` pairs a forward, both sides padded to the batch's
    longest sequence; a rank whose share runs out before the others' scores pair 0 alone in each batch it lacks,
    to keep the collectives in step).

    Args:
        lengths: per eval set, ``(chosen, rejected)`` token lengths (:func:`rm.data.tokenise.pair_lengths`).
        batch_size: ``train.eval_batch_size``.
        world_size: processes.
        rank: the process.

    Returns:
        The shape, or ``None`` without a non-empty eval set.

    Example: rank 0 scores pairs 0 and 2 (longest 5), rank 1 pair 1 (9); the second set's one pair is rank 0's,
    and rank 1 scores it too, its share being empty:
        >>> sets = [([3, 9, 4], [5, 2, 2]), ([7], [8])]
        >>> [largest_eval_batch(sets, batch_size=2, world_size=2, rank=r) for r in (0, 1)]
        [BatchShape(rows=4, length=8), BatchShape(rows=2, length=9)]
    """
    shapes = []
    for chosen, rejected in lengths:
        if not len(chosen):
            continue
        share = list(range(rank, len(chosen), world_size))
        last_start = (-(-len(chosen) // world_size) - 1) // batch_size * batch_size
        if len(share) <= last_start:  # a batch past the end of its share: pair 0 alone, as evaluate scores it
            shapes.append((2, max(chosen[0], rejected[0])))
        if share:
            shapes.append((2 * min(batch_size, len(share)), max(max(chosen[i], rejected[i]) for i in share)))
    if not shapes:
        return None
    return BatchShape(max(s[0] for s in shapes), int(max(s[1] for s in shapes)))


def data_shapes(batches: StepBatches, steps: int, layout: str, chosen: Sequence[int], rejected: Sequence[int],
                shared: Optional[Sequence[int]], eval_lengths: Sequence[tuple], eval_batch_size: int) -> List[BatchShapes]:
    """Per rank, the largest training micro-batch and evaluation forward it will form, from token lengths alone.

    Ranks run different pairs, so their peaks differ: each rank's estimate is sized at its own micro-batches,
    and the verdict at the largest of those estimates (:func:`rm.memory.preflight.data_preflight`).

    Args:
        batches: the run's :class:`StepBatches`.
        steps: the optimizer steps the run takes.
        layout: one of :data:`LAYOUTS` (:func:`layout_of`).
        chosen, rejected: per training pair, its token lengths (:func:`rm.data.tokenise.pair_lengths`).
        shared: per training pair, prompt + both answers (the shared layouts; the tokens ``StepBatches.of``
            receives under ``train.share_prefix``); ``None`` otherwise.
        eval_lengths: per eval set, ``(chosen, rejected)`` lengths.
        eval_batch_size: pairs per evaluation forward.

    Returns:
        One :class:`BatchShapes` per rank, in rank order.

    Example: 8 pairs, one step of 4 pairs per rank over 2 ranks, micro-batches of 2 sorted by the longer side.
    Seed 0 gives rank 0 pairs 4, 0, 7, 3 (longer sides 9, 3, 4, 4: sorted 0, 7 | 3, 4) and rank 1 pairs 2, 5, 1,
    6 (sides 2, 3, 5, 6). Padded, rank 0's largest is 2 pairs x 2 sides padded to pair 4's 9 tokens, rank 1's to
    pair 6's 6; packed, rank 0's longest row is pairs 3 and 4, (3 + 4) + (9 + 3) = 19 tokens (0, 7: 13), rank 1's
    pairs 1 and 6, (5 + 2) + (6 + 1) = 14 (2, 5: 10):

        >>> from rm.data.batching import StepBatches
        >>> chosen, rejected = [3, 5, 2, 3, 9, 3, 6, 4], [2, 2, 2, 4, 3, 3, 1, 4]
        >>> longer = [max(c, r) for c, r in zip(chosen, rejected)]
        >>> batches = StepBatches(8, global_batch_size=8, micro_batch_size=2, world_size=2, rank=0, seed=0,
        ...                       sort_lengths=longer)
        >>> batches.for_step(0), StepBatches(8, 8, 2, 2, 1, 0, sort_lengths=longer).for_step(0)
        ([[0, 7], [3, 4]], [[2, 5], [1, 6]])
        >>> [s.train for s in data_shapes(batches, 1, "padded", chosen, rejected, None, [], 4)]
        [BatchShape(rows=4, length=9), BatchShape(rows=4, length=6)]
        >>> [s.train for s in data_shapes(batches, 1, "packed", chosen, rejected, None, [], 4)]
        [BatchShape(rows=1, length=19), BatchShape(rows=1, length=14)]
    """
    tokens = row_tokens(layout, chosen, rejected, shared)
    shortest = np.minimum(np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64))
    train, later, accumulating, first, first_rest, later_rest = largest_train_batches(batches, steps, layout, tokens,
                                                                                      shortest)
    segment = None
    if layout.startswith("packed"):  # its sequences (packed) or its pairs' shared rows (packed+shared)
        segment = int(max(tokens.max(initial=0), 1)) if layout == "packed+shared" else \
            int(max(np.max(chosen, initial=0), np.max(rejected, initial=0), 1))
    return [BatchShapes(train=shape, eval=largest_eval_batch(eval_lengths, eval_batch_size, batches.world_size, rank),
                        accumulating=accumulating, sized_by="data", after_first_step=after,
                        first_micro_batch=one, first_step_rest=rest, segment=segment, after_first_step_rest=after_rest)
            for rank, (shape, after, one, rest, after_rest) in enumerate(zip(train, later, first, first_rest, later_rest))]


def largest_shape(found: Iterable[Optional[BatchShape]]) -> Optional[BatchShape]:
    """The most rows, the longest row and the longest padded row of several shapes (``None`` among them passed over;
    ``None`` where there are none).

    >>> largest_shape([BatchShape(4, 9, padded_length=0), BatchShape(2, 7), None])
    BatchShape(rows=4, length=9)
    >>> largest_shape([BatchShape(4, 9, padded_length=0), BatchShape(2, 7)]).padded_length
    7
    """
    found = [b for b in found if b is not None]
    if not found:
        return None
    length = max(b.length for b in found)
    padded = max(b.length if b.padded_length is None else b.padded_length for b in found)
    return BatchShape(max(b.rows for b in found), length, None if padded >= length else padded)


def largest(shapes: Sequence[BatchShapes]) -> BatchShapes:
    """The most rows and the longest row over several ranks' shapes (each possibly of a different rank).

    Example:
        >>> a = BatchShapes(BatchShape(4, 9, padded_length=0), BatchShape(2, 3), False, "data")
        >>> both = largest([a, BatchShapes(BatchShape(2, 12), None, True, "data")])
        >>> both  # doctest: +NORMALIZE_WHITESPACE
        BatchShapes(train=BatchShape(rows=4, length=12), eval=BatchShape(rows=2, length=3), accumulating=True,
                    sized_by='data', after_first_step=None, first_micro_batch=None, first_step_rest=None, segment=None,
                    after_first_step_rest=None)
        >>> both.train.padded
        True
    """
    return BatchShapes(train=largest_shape(s.train for s in shapes), eval=largest_shape(s.eval for s in shapes),
                       accumulating=any(s.accumulating for s in shapes), sized_by=shapes[0].sized_by,
                       after_first_step=largest_shape(s.after_first_step for s in shapes),
                       first_micro_batch=largest_shape(s.first_micro_batch for s in shapes),
                       first_step_rest=largest_shape(s.first_step_rest for s in shapes),
                       segment=max((s.segment for s in shapes if s.segment is not None), default=None),
                       after_first_step_rest=largest_shape(s.after_first_step_rest for s in shapes))
