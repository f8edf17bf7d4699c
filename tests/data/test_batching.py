"""Which pairs each process sees: a pure function of (seed, step)."""

import random

import datasets
import pytest

from rm.data.batching import StepBatches, even_out, micro_batches_for_step, split_by_tokens, steps_per_epoch
from rm.data.collator import common_prefix_length


def flatten(batches):
    return [i for b in batches for i in b]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_partition_each_global_batch_and_epochs_cover_the_data(world):
    n, global_batch, micro = 40, 8, 2
    seen = []
    for step in range(steps_per_epoch(n, global_batch)):
        per_rank = [flatten(micro_batches_for_step(step, n, global_batch, micro, world, r, seed=3)) for r in range(world)]
        assert all(len(p) == global_batch // world for p in per_rank)
        step_pairs = [i for p in per_rank for i in p]
        assert len(set(step_pairs)) == global_batch
        seen += step_pairs
    assert sorted(seen) == list(range(n))  # one epoch sees every pair once


def test_order_depends_on_seed_and_epoch_only():
    a = micro_batches_for_step(7, 100, 10, 5, 1, 0, seed=1)
    assert a == micro_batches_for_step(7, 100, 10, 5, 1, 0, seed=1)
    assert a != micro_batches_for_step(7, 100, 10, 5, 1, 0, seed=2)
    # step 10 is the first step of epoch 1: a fresh shuffle, not a repeat of step 0
    assert micro_batches_for_step(10, 100, 10, 10, 1, 0, seed=1) != micro_batches_for_step(0, 100, 10, 10, 1, 0, seed=1)


def test_group_by_length_keeps_the_pairs_and_sorts_them():
    lengths = [(i * 37) % 101 for i in range(64)]
    plain = micro_batches_for_step(3, 64, 16, 4, 1, 0, seed=0)
    grouped = micro_batches_for_step(3, 64, 16, 4, 1, 0, seed=0, lengths=lengths)
    assert sorted(flatten(plain)) == sorted(flatten(grouped))  # same pairs, so the same gradient
    order = [lengths[i] for i in flatten(grouped)]
    assert order == sorted(order)


def test_too_few_pairs_for_one_step():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        micro_batches_for_step(0, 5, 8, 1, 1, 0, seed=0)


def tokenised_set(n, seed=0):
    """Pairs of random lengths (1 to 60 tokens a side) sharing a random prompt, as tokenize_pairs writes them."""
    rng = random.Random(seed)
    rows = {"chosen_input_ids": [], "rejected_input_ids": [], "margin": []}
    for _ in range(n):
        prompt = [rng.randrange(5, 100) for _ in range(rng.randrange(0, 30))]
        for side in ("chosen_input_ids", "rejected_input_ids"):
            rows[side].append(prompt + [rng.randrange(5, 100) for _ in range(rng.randrange(1, 31))])
        rows["margin"].append(0.0)
    return datasets.Dataset.from_dict(rows)


def selection_before_step_batches(ds, step, global_batch, micro, world, rank, seed, group_by_length, max_tokens, share_prefix):
    """The selection rm.train made itself before StepBatches, every id list copied into Python, kept to compare with."""
    chosen, rejected = ds["chosen_input_ids"], ds["rejected_input_ids"]
    lengths = [max(len(c), len(r)) for c, r in zip(chosen, rejected)] if group_by_length else None
    pair_tokens, per_rank = None, global_batch // world
    if max_tokens:
        pair_tokens = [len(c) + len(r) for c, r in zip(chosen, rejected)]
    if share_prefix:
        shared = [len(c) + len(r) - common_prefix_length(c, r) for c, r in zip(chosen, rejected)]
        pair_tokens = shared if max_tokens else None
        lengths = shared if group_by_length else None
    batches = micro_batches_for_step(step, len(ds), global_batch, per_rank if pair_tokens else micro, world, rank, seed, lengths)
    if pair_tokens:
        batches = split_by_tokens(batches[0], pair_tokens, max_tokens)
        if world > 1:
            most = max(len(split_by_tokens(micro_batches_for_step(step, len(ds), global_batch, per_rank, world, r, seed, lengths)[0],
                                           pair_tokens, max_tokens)) for r in range(world))
            batches = even_out(batches, most)
    return batches


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("group_by_length", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 200])
@pytest.mark.parametrize("share_prefix", [False, True])
def test_step_batches_are_the_batches_rm_train_selected_before(world, group_by_length, max_tokens, share_prefix):
    ds = tokenised_set(96)
    chosen, rejected = ds["chosen_input_ids"], ds["rejected_input_ids"]
    shared = [len(c) + len(r) - common_prefix_length(c, r) for c, r in zip(chosen, rejected)] if share_prefix else None
    settings = dict(global_batch=16, micro=4, world=world, seed=7, group_by_length=group_by_length, max_tokens=max_tokens)
    for rank in range(world):
        batches = StepBatches.of(ds, global_batch_size=16, micro_batch_size=4, world_size=world, rank=rank, seed=7,
                                 group_by_length=group_by_length, max_tokens=max_tokens, shared_tokens=shared)
        for step in range(14):  # two epochs and a bit: the second epoch's shuffle too
            expected = selection_before_step_batches(ds, step, rank=rank, share_prefix=share_prefix, **settings)
            assert batches.for_step(step) == expected, (rank, step)


def test_step_batches_read_lengths_from_the_arrow_offsets_of_a_selection():
    ds = tokenised_set(40).select(range(39, -1, -1))  # an indices mapping over the table: lengths must follow it
    batches = StepBatches.of(ds, global_batch_size=8, micro_batch_size=2, world_size=1, rank=0, seed=1,
                             group_by_length=True, max_tokens=120)
    assert batches.sort_lengths == [max(len(c), len(r)) for c, r in zip(ds["chosen_input_ids"], ds["rejected_input_ids"])]
    assert batches.pair_tokens == [len(c) + len(r) for c, r in zip(ds["chosen_input_ids"], ds["rejected_input_ids"])]
