"""Which pairs each process sees at each optimizer step.

The order is a pure function of (seed, step): epoch ``e`` shuffles the pairs with
a generator seeded ``seed + e``, optimizer step ``s`` takes the ``s``-th block of
``global_batch_size`` pairs of its epoch, and rank ``r`` of ``world_size`` takes
the ``r``-th slice of that block. A resumed run therefore sees exactly the
batches an uninterrupted one would, with no sampler state to checkpoint. The
last incomplete block of an epoch is dropped so every step has the same size.

:class:`StepBatches` cuts a rank's pairs of a step into micro-batches: a fixed number of pairs each,
sorted by length first with ``train.group_by_length``, or by a token budget
(``train.max_tokens_per_micro_batch``). It reads the pairs' token lengths from the Arrow offsets of
the tokenised dataset, never its token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

if TYPE_CHECKING:  # the planner cuts micro-batches from token lengths alone: datasets takes seconds to import
    import datasets

    from rm.foundations.config import TrainConfig


def rows_at(dataset: "datasets.Dataset", indices: Sequence[int]) -> List[dict]:
    """The pairs at ``indices``, in that order, as the collators take them (one dict a pair).

    One Arrow take of the rows, where ``dataset.select(indices)`` builds a new dataset (an indices mapping and
    its fingerprint) first: measured 1.8 ms against 0.09 ms for 4 pairs, a fixed cost every micro-batch paid.

    Example:
        >>> from datasets import Dataset
        >>> rows_at(Dataset.from_dict({"chosen_input_ids": [[1], [2, 3], [4]], "margin": [0.0, 1.0, 2.0]}), [2, 0])
        [{'chosen_input_ids': [4], 'margin': 2.0}, {'chosen_input_ids': [1], 'margin': 0.0}]
    """
    columns = dataset[list(indices)]
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


def steps_per_epoch(num_pairs: int, global_batch_size: int) -> int:
    """Whole optimizer steps one pass over ``num_pairs`` pairs gives."""
    return num_pairs // global_batch_size


def total_training_steps(train_cfg: "TrainConfig", num_pairs: int) -> int:
    """The optimizer steps a run takes over ``num_pairs`` training pairs:
    ``train.max_steps``, else ``train.num_train_epochs`` epochs, at least one.

    Raises:
        ConfigError: the global batch is larger than the training set.
    """
    from rm.foundations.config import MAX_PAIRS_TRAINED
    from rm.foundations.errors import ConfigError

    per_epoch = steps_per_epoch(num_pairs, train_cfg.global_batch_size)
    if per_epoch == 0:
        raise ConfigError(
            f"train.global_batch_size={train_cfg.global_batch_size} is larger than the {num_pairs} usable training pairs"
        )
    if train_cfg.max_steps > 0:
        return train_cfg.max_steps
    steps = max(1, math.ceil(train_cfg.num_train_epochs * per_epoch))
    if steps * train_cfg.global_batch_size > MAX_PAIRS_TRAINED:  # train.max_steps is checked in rm.settings.validate
        raise ConfigError(
            f"train.num_train_epochs={train_cfg.num_train_epochs:g} of {num_pairs:,} pairs = {steps:,} steps of "
            f"train.global_batch_size={train_cfg.global_batch_size}: more than {MAX_PAIRS_TRAINED:,} pairs trained; lower it"
        )
    return steps


@lru_cache(maxsize=2)
def _epoch_order(num_pairs: int, seed: int, epoch: int) -> List[int]:
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_pairs, generator=generator).tolist()


def micro_batches_for_step(
    step: int,
    num_pairs: int,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    lengths: Optional[Sequence[int]] = None,
) -> List[List[int]]:
    """Indices of this rank's micro-batches for optimizer step ``step`` (0-based).

    Args:
        step: optimizer step counted from the start of training.
        num_pairs: size of the training set.
        global_batch_size: pairs per optimizer step over all ranks.
        micro_batch_size: pairs per forward pass on one rank.
        world_size: number of processes.
        rank: this process's index.
        seed: training seed.
        lengths: per-pair token length; when given, this rank's pairs are sorted
            by it before being cut into micro-batches, so each micro-batch pads
            to a similar length. The optimizer step sees the same pairs, hence
            the same gradient, with far fewer pad tokens.

    Returns:
        ``global_batch_size // (micro_batch_size * world_size)`` lists of
        ``micro_batch_size`` dataset indices each.

    Example:
        >>> micro_batches_for_step(0, 8, global_batch_size=4, micro_batch_size=1,
        ...                        world_size=2, rank=1, seed=0)
        [[7], [3]]
        >>> micro_batches_for_step(0, 8, global_batch_size=4, micro_batch_size=1,
        ...                        world_size=2, rank=1, seed=0, lengths=[9, 9, 9, 5, 9, 9, 9, 7])
        [[3], [7]]
    """
    per_epoch = steps_per_epoch(num_pairs, global_batch_size)
    if per_epoch == 0:
        raise ValueError(f"{num_pairs} pairs cannot fill one global batch of {global_batch_size}")
    epoch, offset = divmod(step, per_epoch)
    block = _epoch_order(num_pairs, seed, epoch)[offset * global_batch_size : (offset + 1) * global_batch_size]
    per_rank = global_batch_size // world_size
    mine = block[rank * per_rank : (rank + 1) * per_rank]
    if lengths is not None:
        mine = sorted(mine, key=lambda i: lengths[i])
    return [mine[i : i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)]


def split_by_tokens(indices: Sequence[int], pair_tokens: Sequence[int], max_tokens: int) -> List[List[int]]:
    """Cut one step's pairs, in order, into micro-batches of at most ``max_tokens`` tokens (``train.packing``).

    Greedy: a pair joins the current micro-batch while the total stays within the
    budget, else it opens the next one. Both sequences of a pair count and always
    stay together. A pair larger than the budget gets a micro-batch of its own
    (``rm.settings.validate`` rules it out by asking for a budget of at least two
    ``max_length`` sequences).

    Args:
        indices: this rank's dataset indices for the step.
        pair_tokens: per dataset index, chosen plus rejected length.
        max_tokens: token budget of one micro-batch.

    Returns:
        Lists of dataset indices, covering ``indices`` once each, in order.

    Example:
        >>> split_by_tokens([0, 1, 2, 3], pair_tokens=[6, 3, 4, 9], max_tokens=10)
        [[0, 1], [2], [3]]
    """
    batches: List[List[int]] = []
    used = max_tokens  # forces a first micro-batch
    for i in indices:
        if used + pair_tokens[i] > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += pair_tokens[i]
    return batches


def even_out(batches: List[List[int]], count: int) -> List[List[int]]:
    """Split the largest micro-batches in two until there are ``count`` of them (DDP with ``train.packing``).

    DDP runs collectives inside forward passes (its bucket rebuild after the first synchronised
    backward), so every rank must run the same number of micro-batches per step; a token budget
    gives ranks different numbers. Halving keeps every micro-batch within the budget and the
    weights by share keep the gradient unchanged.

    Example:
        >>> even_out([[0, 1, 2, 3], [4]], 3)
        [[0, 1], [2, 3], [4]]
    """
    batches = [list(b) for b in batches]
    while len(batches) < count:
        i = max(range(len(batches)), key=lambda j: len(batches[j]))
        if len(batches[i]) < 2:
            raise ValueError(f"cannot cut {sum(map(len, batches))} pairs into {count} micro-batches")
        half = len(batches[i]) // 2
        batches[i:i + 1] = [batches[i][:half], batches[i][half:]]
    return batches


@dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches at each optimizer step; build it with :meth:`of`.

    Attributes:
        num_pairs: Size of the training set.
        global_batch_size: Pairs per optimizer step over all ranks.
        micro_batch_size: Pairs per forward pass on one rank, without a token budget.
        world_size: Number of processes.
        rank: This process's index.
        seed: Training seed.
        sort_lengths: Per pair, the length micro-batches are grouped by; None keeps the shuffled order.
        pair_tokens: Per pair, the tokens the budget counts; None: micro-batches of ``micro_batch_size`` pairs.
        max_tokens: Token budget of one micro-batch, with ``pair_tokens``.
    """

    num_pairs: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int
    seed: int
    sort_lengths: Optional[Sequence[int]] = None
    pair_tokens: Optional[Sequence[int]] = None
    max_tokens: Optional[int] = None

    @property
    def per_rank(self) -> int:
        """Pairs of a step on one process."""
        return self.global_batch_size // self.world_size

    @classmethod
    def of(
        cls,
        ds: datasets.Dataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        group_by_length: bool,
        max_tokens: Optional[int] = None,
        shared_tokens: Optional[Sequence[int]] = None,
    ) -> StepBatches:
        """The micro-batches of a tokenised training set (``chosen_input_ids``, ``rejected_input_ids``).

        Args:
            ds: The training set.
            global_batch_size: Pairs per optimizer step over all ranks.
            micro_batch_size: Pairs per forward pass on one rank, when ``max_tokens`` is not set.
            world_size: Number of processes.
            rank: This process's index.
            seed: Training seed.
            group_by_length: Sort each step's pairs by length before cutting them into micro-batches
                (the longer side's tokens).
            max_tokens: Cut each step's pairs by this token budget (chosen + rejected tokens) instead of
                by ``micro_batch_size``; 0 or None: no budget.
            shared_tokens: Per pair, the tokens of its row once the prompt is shared (``train.share_prefix``):
                then both the grouping and the budget count these.
        """
        from rm.data.tokenise import pair_lengths

        sort_lengths = pair_tokens = None
        if shared_tokens is not None:
            sort_lengths, pair_tokens = shared_tokens, shared_tokens
        elif group_by_length or max_tokens:
            chosen, rejected = pair_lengths(ds)
            sort_lengths = [max(c, r) for c, r in zip(chosen, rejected)]
            pair_tokens = [c + r for c, r in zip(chosen, rejected)]
        return cls(
            num_pairs=len(ds),
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            world_size=world_size,
            rank=rank,
            seed=seed,
            sort_lengths=sort_lengths if group_by_length else None,
            pair_tokens=pair_tokens if max_tokens else None,
            max_tokens=max_tokens or None,
        )

    def for_step(self, step: int) -> List[List[int]]:
        """Dataset indices of this rank's micro-batches at optimizer step ``step`` (0-based).

        A pure function of the step, so that a resumed run sees the batches an uninterrupted one would.

        Example:
            >>> batches = StepBatches(8, global_batch_size=4, micro_batch_size=1, world_size=2, rank=1, seed=0,
            ...                       sort_lengths=[9, 9, 9, 5, 9, 9, 9, 7])
            >>> batches.for_step(0)
            [[3], [7]]
            >>> budget = StepBatches(8, global_batch_size=4, micro_batch_size=1, world_size=1, rank=0, seed=0,
            ...                      pair_tokens=[3] * 8, max_tokens=6)
            >>> budget.for_step(0)
            [[4, 0], [7, 3]]
        """
        if self.pair_tokens is None:
            return self._pairs_of(step, self.rank, self.micro_batch_size)
        batches = self._by_budget(step, self.rank)
        if self.world_size > 1:  # DDP needs as many forwards on every rank; all ranks' pairs are known here
            most = max(len(self._by_budget(step, r)) for r in range(self.world_size))
            batches = even_out(batches, most)
        return batches

    def _pairs_of(self, step: int, rank: int, micro_batch_size: int) -> List[List[int]]:
        return micro_batches_for_step(
            step, self.num_pairs, self.global_batch_size, micro_batch_size, self.world_size, rank, self.seed,
            self.sort_lengths,
        )

    def _by_budget(self, step: int, rank: int) -> List[List[int]]:
        (pairs,) = self._pairs_of(step, rank, self.global_batch_size // self.world_size)
        return split_by_tokens(pairs, self.pair_tokens, self.max_tokens)
