"""Which pairs each process sees at each optimizer step.

The order is a pure function of (seed, step): epoch ``e`` shuffles the pairs with
a generator seeded ``seed + e``, optimizer step ``s`` takes the ``s``-th block of
``global_batch_size`` pairs of its epoch, and rank ``r`` of ``world_size`` takes
the ``r``-th slice of that block. A resumed run therefore sees exactly the
batches an uninterrupted one would, with no sampler state to checkpoint. The
last incomplete block of an epoch is dropped so every step has the same size.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence

import torch


def steps_per_epoch(num_pairs: int, global_batch_size: int) -> int:
    """Whole optimizer steps one pass over ``num_pairs`` pairs gives."""
    return num_pairs // global_batch_size


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
    (``rm.validate`` rules it out by asking for a budget of at least two
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
