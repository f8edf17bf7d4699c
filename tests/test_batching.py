"""Which pairs each process sees: a pure function of (seed, step)."""

import pytest

from rm.data.batching import micro_batches_for_step, steps_per_epoch


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
