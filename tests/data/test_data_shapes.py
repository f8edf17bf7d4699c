"""The estimate sized at the micro-batches the run's data forms (rm.data.shapes), not at the worst case the config allows."""

import json
import random
import time

import numpy as np
import pytest

import rm.train as rm_train
from rm.foundations.config import compose
from rm.data.batching import StepBatches
from rm.data.shapes import BatchShape, data_shapes, largest, largest_eval_batch, row_tokens
from rm.memory.terms import GIB, estimate_run
from rm.memory.preflight import PreflightRefusal
from rm.settings.validate import validate
from tests.conftest import FAST_TINY


def test_largest_micro_batch_by_hand():
    """6 pairs, one step of all 6 on one process, sorted by length, micro-batches of 3: the shuffle cannot matter.

    Longer sides 6 2 4 8 3 4 sort to 2 3 4 | 4 6 8 (pairs 1 4 2|5, 5|2 0 3): padded, 3 pairs x 2 rows padded to 8.
    Chosen + rejected 11 4 7 15 5 7: packed rows 4 + 5 + 7 = 16 and 7 + 11 + 15 = 33 (pairs 2 and 5 tie at 7 both
    ways). Shared rows 10 4 7 12 5 6 sort to 4 5 6 | 7 10 12: one row per pair, 3 x 12; packed, 15 and 29.
    A 20-token budget cuts 4 5 7 | 7 11 | 15: the longest row 18, three micro-batches (accumulating).
    """
    chosen, rejected, shared = [5, 2, 4, 8, 3, 3], [6, 2, 3, 7, 2, 4], [10, 4, 7, 12, 5, 6]
    longer = [max(c, r) for c, r in zip(chosen, rejected)]
    plain = StepBatches(6, global_batch_size=6, micro_batch_size=3, world_size=1, rank=0, seed=3, sort_lengths=longer)
    by_shared = StepBatches(6, 6, 3, 1, 0, seed=3, sort_lengths=shared)
    budget = StepBatches(6, 6, 3, 1, 0, seed=3, sort_lengths=longer, pair_tokens=[c + r for c, r in zip(chosen, rejected)],
                         max_tokens=20)

    def largest(batches, layout, shared_tokens=None):
        [shapes] = data_shapes(batches, 2, layout, chosen, rejected, shared_tokens, [], 1)
        return shapes.train.rows, shapes.train.length, shapes.accumulating

    assert largest(plain, "padded") == (6, 8, True)
    assert largest(plain, "packed") == (1, 33, True)
    assert largest(by_shared, "shared", shared) == (3, 12, True)
    assert largest(by_shared, "packed+shared", shared) == (1, 29, True)
    assert largest(budget, "packed") == (1, 18, True)
    one_step = StepBatches(6, 6, 6, 1, 0, seed=3, sort_lengths=longer)  # one micro-batch a step: no accumulation
    assert largest(one_step, "padded") == (12, 8, False)
    # Eval: 3 pairs (longer sides 5 9 4), each rank a strided share: over 2 ranks with batches of 2, rank 0 scores
    # pairs 0 and 2 (2 x 2 rows, longest 5), rank 1 pair 1 (2 rows of 9). In batches of 1, rank 1 runs out after one
    # batch and scores pair 0 alone in the second, as rm.evaluation.metrics.evaluate does: its longest is still 9.
    sets = [([3, 9, 4], [5, 2, 2])]
    assert largest_eval_batch(sets, batch_size=2, world_size=2, rank=0) == BatchShape(4, 5)
    assert largest_eval_batch(sets, batch_size=2, world_size=2, rank=1) == BatchShape(2, 9)
    assert largest_eval_batch(sets, batch_size=1, world_size=1, rank=0) == BatchShape(2, 9)
    assert largest_eval_batch([([9, 3, 4], [5, 2, 2])], batch_size=1, world_size=2, rank=1) == BatchShape(2, 9)
    assert largest_eval_batch([([], [])], batch_size=1, world_size=1, rank=0) is None


def brute_force(batches_per_rank, steps, layout, tokens):
    """Per rank, the largest micro-batch over what StepBatches.for_step gives it at each step; and whether any
    rank runs several micro-batches in a step."""
    packed, shapes, later, accumulating = layout.startswith("packed"), [], [], False
    for batches in batches_per_rank:
        rows, length, length_later = 0, 0, 0
        for step in range(steps):
            micro_batches = batches.for_step(step)
            accumulating |= len(micro_batches) > 1
            for mb in micro_batches:
                rows = max(rows, 1 if packed else (1 if layout == "shared" else 2) * len(mb))
                n = int(tokens[mb].sum() if packed else tokens[mb].max())
                length = max(length, n)
                if step > 0:
                    length_later = max(length_later, n)
        shapes.append(BatchShape(rows, length))
        later.append(BatchShape(rows, length_later))
    return shapes, later, accumulating


def eval_brute_force(lengths, batch_size, world, rank):
    """rm.evaluation.metrics.evaluate's batches for one rank, written out: its strided share in batches, pair 0 alone where
    its share has run out before the longest share's."""
    chosen, rejected = lengths
    share, per_rank = list(range(rank, len(chosen), world)), -(-len(chosen) // world)
    batches = [share[start:start + batch_size] or [0] for start in range(0, per_rank, batch_size)]
    return BatchShape(max(2 * len(b) for b in batches), max(max(chosen[i], rejected[i]) for b in batches for i in b))


@pytest.mark.parametrize("layout", ["padded", "packed", "shared", "packed+shared"])
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("budget", [0, 60])
@pytest.mark.parametrize("group", [True, False])
def test_shapes_are_those_of_every_micro_batch_of_every_rank(layout, world, budget, group):
    """Against StepBatches.for_step itself, over 3 epochs, with ties in the lengths (the sort keeps their order)."""
    if budget and not layout.startswith("packed"):
        pytest.skip("rm.settings.validate allows a token budget only with packing")
    rng = np.random.default_rng(world + budget)
    n = 150
    chosen, rejected = rng.integers(1, 20, n), rng.integers(1, 20, n)
    shared = chosen + rejected - rng.integers(0, np.minimum(chosen, rejected) + 1)
    sharing = "shared" in layout
    keys = (shared if sharing else np.maximum(chosen, rejected)).tolist()
    budget_tokens = (shared if sharing else chosen + rejected).tolist()

    def of(rank):
        return StepBatches(n, 24, 4, world, rank, seed=5, sort_lengths=keys if group else None,
                           pair_tokens=budget_tokens if budget else None, max_tokens=budget or None)

    steps = 16  # 6 steps an epoch
    eval_lengths = (rng.integers(1, 30, 7), rng.integers(1, 30, 7))
    got = data_shapes(of(0), steps, layout, chosen, rejected, shared if sharing else None, [eval_lengths], 2)
    want, later, accumulating = brute_force([of(rank) for rank in range(world)], steps, layout,
                                            row_tokens(layout, chosen, rejected, shared))
    assert [s.train for s in got] == want and {s.accumulating for s in got} == {accumulating}
    assert [s.after_first_step for s in got] == later
    # Each step's first micro-batch apart from the others (which run beside that step's gradients): under a token
    # budget the steps' micro-batches differ in number and length, and a rank may run none after its first.
    tokens = row_tokens(layout, chosen, rejected, shared)

    def longest(b, which):
        found = [int(tokens[mb].sum() if layout.startswith("packed") else tokens[mb].max())
                 for step in range(steps) for k, mb in enumerate(b.for_step(step)) if which(step, k)]
        return max(found, default=None)

    phases = {"first_micro_batch": lambda s, k: (s, k) == (0, 0), "first_step_rest": lambda s, k: s == 0 and k > 0,
              "after_first_step_rest": lambda s, k: s > 0 and k > 0}
    for name, which in phases.items():
        assert [getattr(getattr(s, name), "length", None) for s in got] == [longest(of(r), which) for r in range(world)], name
    assert [s.eval for s in got] == [eval_brute_force(eval_lengths, 2, world, rank) for rank in range(world)]
    both = largest(got)
    assert both.train == BatchShape(max(s.rows for s in want), max(s.length for s in want))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("short_rows", [0, 1, 6])
def test_a_rank_whose_micro_batches_are_all_full_is_not_padded(world, short_rows):
    """Rows cut to max_length are all as long: a micro-batch of them needs no mask (SDPA is_causal), which keeps
    less than a padded one. Against StepBatches.for_step, with a few shorter sides placed at random."""
    rng = np.random.default_rng(short_rows + world)
    n, full = 96, 32
    chosen, rejected = np.full(n, full), np.full(n, full)
    rejected[rng.choice(n, short_rows, replace=False)] = full - 5
    keys = np.maximum(chosen, rejected).tolist()
    of = [StepBatches(n, 24, 4, world, rank, seed=7, sort_lengths=keys) for rank in range(world)]
    got = data_shapes(of[0], 8, "padded", chosen, rejected, None, [], 2)
    want = [any(min(min(chosen[i], rejected[i]) for i in mb) < full for step in range(8) for mb in b.for_step(step))
            for b in of]
    assert [s.train.padded for s in got] == want and largest(got).train.padded == any(want)
    assert all(s.train.padded for s in data_shapes(of[0], 8, "packed", chosen, rejected, None, [], 2))  # no mask to drop
    if short_rows == 0:
        assert not any(want)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_phase_is_its_longest_micro_batch_and_its_longest_padded_one(world, seed):
    """The first micro-batch (ZeRO-3 records its trace there), the rest of the first step, the later steps and the
    whole run: each as its longest micro-batch and the longest of its padded ones, against StepBatches.for_step.
    Sides drawn from three lengths, the longest pairs cut to the full 32 on both sides (no mask) and the others
    mostly equal within a pair, so that grouped micro-batches are padded or not at every length."""
    rng = np.random.default_rng(seed)
    n, steps = 96, 8
    chosen = rng.choice([8, 16, 32], n, p=[0.25, 0.25, 0.5])
    rejected = np.where((chosen == 32) | (rng.random(n) < 0.7), chosen, rng.choice([8, 16], n))
    keys = np.maximum(chosen, rejected).tolist()
    of = [StepBatches(n, 24, 4, world, rank, seed=seed, sort_lengths=keys) for rank in range(world)]
    got = data_shapes(of[0], steps, "padded", chosen, rejected, None, [], 2)

    def brute(b, which):
        longest, padded = 0, 0
        for step in range(steps):
            for k, mb in enumerate(b.for_step(step)):
                if which(step, k):
                    length = max(max(chosen[i], rejected[i]) for i in mb)
                    longest = max(longest, length)
                    if min(min(chosen[i], rejected[i]) for i in mb) < length:
                        padded = max(padded, length)
        return longest, padded

    def seen(shape):
        return shape.length, shape.length if shape.padded_length is None else shape.padded_length

    phases = {"train": lambda s, k: True, "after_first_step": lambda s, k: s > 0,
              "first_micro_batch": lambda s, k: (s, k) == (0, 0), "first_step_rest": lambda s, k: s == 0 and k > 0}
    for name, which in phases.items():
        assert [seen(getattr(s, name)) for s in got] == [brute(b, which) for b in of], name


def test_a_longer_unpadded_micro_batch_keeps_the_shorter_padded_one():
    """Four pairs cut to 32 tokens on both sides and four of 16 and 8, grouped: the first micro-batch is padded at
    16, the second unpadded at 32; the run's shape keeps both, and the estimate weighs both (BatchShape.variants)."""
    chosen, rejected = [32, 16, 32, 16, 32, 16, 32, 16], [32, 8, 32, 8, 32, 8, 32, 8]
    keys = np.maximum(chosen, rejected).tolist()
    (got,) = data_shapes(StepBatches(8, 8, 4, 1, 0, seed=0, sort_lengths=keys), 1, "padded", chosen, rejected, None, [], 2)
    assert (got.first_micro_batch.length, got.first_micro_batch.padded) == (16, True)
    assert (got.first_step_rest.length, got.first_step_rest.padded_length) == (32, 0)
    assert (got.train.length, got.train.padded_length) == (32, 16)
    assert [(v.length, v.padded) for v in got.train.variants()] == [(32, False), (16, True)]


@pytest.mark.parametrize("budget", [0, 4096])
def test_a_large_run_is_sized_in_a_second_or_two(budget):
    """160k HH-sized pairs, 5000 steps of 64 pairs over 8 processes (0.2 s padded, 0.7 s with a budget, at load 14)."""
    rng = np.random.default_rng(0)
    n = 160_000
    chosen, rejected = rng.integers(10, 512, n), rng.integers(10, 512, n)
    batches = StepBatches(n, 64, 4, 8, 0, seed=1, sort_lengths=np.maximum(chosen, rejected).tolist(),
                          pair_tokens=(chosen + rejected).tolist() if budget else None, max_tokens=budget or None)
    start = time.perf_counter()
    shapes = largest(data_shapes(batches, 5000, "packed" if budget else "padded", chosen, rejected, None,
                                 [(chosen[:8000], rejected[:8000])], 8))
    assert time.perf_counter() - start < 3.0
    assert shapes.train == (BatchShape(1, 4096) if budget else BatchShape(8, 511))


def short_pairs(path, n, seed):
    """Prompt-format pairs of about 20 tokens a side: far below data.max_length=256."""
    words = "the cat sat on a mat and dog ran to park with ball red blue green big small happy sad fast slow".split()
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choices(words, k=rng.randint(5, 10))) + "."
            chosen, rejected = (" " + " ".join(rng.choices(words, k=rng.randint(2, 8))) for _ in range(2))
            f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return path


def short_run(tmp_path, *extra):
    overrides = [*FAST_TINY, "data=local", f"data.train_files=[{short_pairs(tmp_path / 'train.jsonl', 256, 0)}]",
                 f"data.eval_files=[{short_pairs(tmp_path / 'eval.jsonl', 64, 1)}]", "data.max_length=256",
                 "train.max_steps=2", "train.logging.eval_steps=0", "train.logging.track_memory=true", *extra]
    return overrides, compose(overrides)


@pytest.mark.parametrize("extra", [
    ["train.eval_batch_size=64"],  # evaluation peaks
    ["train.eval_batch_size=1", "train.share_prefix=true"],  # forward/backward of rows of prompt + both answers
], ids=["padded-eval-peak", "shared-train-peak"])
def test_run_estimate_is_sized_by_the_data(tmp_path, caplog, extra):
    """memory.json holds the estimate at the data's longest micro-batch: within 5% above the measured peak
    (never 2% under), where the config's worst case (every side 256 tokens) is several times above. The
    device is smaller than that worst case: the config-only estimate does not refuse the run, the data's fits."""
    overrides, cfg = short_run(tmp_path, *extra)
    worst = estimate_run(cfg, validate(cfg, 1))
    device = [f"hardware.device_memory_gib={worst.peak_bytes / 3 / GIB}"]
    with caplog.at_level("INFO", logger="rm.train"):
        assert rm_train.train(compose([*overrides, *device]), tmp_path / "run", [*overrides, *device])["status"] == "ok"
    memory = json.loads((tmp_path / "run" / "memory.json").read_text())
    estimate, measured = memory["estimate"]["peak_bytes"], memory["measured"]["peak_allocated_bytes"]
    print(f"\n{extra}: data-aware {estimate} ({(estimate - measured) / measured:+.2%}), "
          f"config-only {worst.peak_bytes} ({(worst.peak_bytes - measured) / measured:+.2%}), measured {measured}")
    assert memory["estimate"]["sized_by"] == "data" and worst.sized_by == "config"
    assert memory["estimate"]["shapes"]["train"]["length"] < 60  # the data's, not max_length's
    assert 0.98 * measured <= estimate <= 1.05 * measured, (estimate, measured)
    assert worst.peak_bytes > 3 * measured
    assert "memory estimate sized by the data: longest micro-batch" in caplog.text


def test_refused_when_the_data_does_not_fit(tmp_path):
    """A device that holds the weights, gradients and states but not the data's micro-batches: refused after the
    data is built, before the model is, with the table sized by the data."""
    overrides, cfg = short_run(tmp_path, "hardware.device_memory_gib=0.01")
    with pytest.raises(PreflightRefusal) as refused:
        rm_train.train(cfg, tmp_path / "run", overrides)
    message = str(refused.value)
    assert "sized by the data's longest micro-batch" in message and "DOES NOT FIT" in message
    # The changes offered are sized at the worst case (each fits whatever the data): at max_length 256 none does here.
    assert "no single change found that fits" in message and "preflight=warn trains anyway" in message
    assert refused.value.estimate.sized_by == "data"
    assert not (tmp_path / "run" / "final").exists()


def test_the_estimate_counts_the_bos_and_the_appended_eos(tmp_path):
    """The estimate is sized by the lengths the run trains on: each side's BOS and the EOS appended to it
    (data.append_eos, rm.data.tokenizer.encode_sides), one token more a side than without the EOS, and a larger estimate."""
    from rm.data.build import build_datasets, train_pairs
    from rm.training.run_setup import run_shapes
    from rm.data.tokenizer import run_tokenizer

    found = {}
    for append_eos in (True, False):
        overrides, cfg = short_run(tmp_path, "train.eval_batch_size=64", f"data.append_eos={str(append_eos).lower()}")
        plan = validate(cfg, 1)
        tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
        train_set, eval_set, _ = build_datasets(cfg.data, tokenizer)
        batches = StepBatches.of(train_set, global_batch_size=cfg.train.global_batch_size,
                                 micro_batch_size=plan.micro_batch_size, world_size=1, rank=0, seed=cfg.train.seed,
                                 group_by_length=cfg.train.group_by_length)
        [shapes] = run_shapes(cfg.train, batches, 2, train_set, None, [eval_set])
        ends = {ids[-1] for ids in train_set["chosen_input_ids"]}
        found[append_eos] = (shapes, estimate_run(cfg, plan, shapes).peak_bytes, ends, tokenizer.eos_token_id)
    (with_eos, peak, ends, eos), (without, peak_without, ends_without, _) = found[True], found[False]
    assert ends == {eos} and eos not in ends_without
    assert with_eos.train.length == without.train.length + 1 and with_eos.eval.length == without.eval.length + 1
    assert peak > peak_without
