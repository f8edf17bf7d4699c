"""The verdict of several ranks from fewer traces (rm.memory.terms.worst_rank_estimate): the largest rank's estimate,
the same as estimating every rank, on random data, layouts, profiles and process counts.

Its bound rests on the estimate growing with a micro-batch's length within a regime, and on a padded micro-batch
weighing at least an unpadded one as long; the growth is checked here on random lengths too, together with the one
known exception (a packed row no longer than its longest sequence, traced as one call)."""

import random

import numpy as np
import pytest

from rm.foundations.config import compose
from rm.data.shapes import BatchShape, BatchShapes
from rm.foundations.hardware import attention_kernel, resolve_hardware
from rm.memory import terms
from rm.memory.terms import estimate_run, traced_model, worst_rank_estimate
from rm.memory.trace import estimate_activations, inference_peak_bytes
from rm.plan.lengths import PairLengths, memory_shapes
from rm.settings.validate import validate

BASE = ["experiment=tiny", "data.max_length=64", "train.eval_batch_size=4"]
LAYOUTS = [
    [],  # padded
    ["train.packing=true"],
    ["train.packing=true", "train.max_tokens_per_micro_batch=256"],
    ["train.share_prefix=true"],
    ["train.packing=true", "train.share_prefix=true"],
]


def random_lengths(rng: random.Random, pairs: int, max_length: int) -> PairLengths:
    """Chosen and rejected lengths from a long tail, with a shared prompt, and a small eval set."""
    chosen = [min(max_length, int(rng.paretovariate(1.5) * 8)) for _ in range(pairs)]
    rejected = [min(max_length, max(2, c + rng.randint(-8, 8))) for c in chosen]
    prefix = [rng.randint(0, min(c, r) - 1) for c, r in zip(chosen, rejected)]
    evals = [min(max_length, int(rng.paretovariate(1.5) * 8)) for _ in range(2 * rng.randint(3, 9))]
    return PairLengths.of(chosen, rejected, prefix, eval=((evals[::2], evals[1::2]),))


def random_case(rng: random.Random):
    world = rng.choice([2, 3, 4, 8])
    micro = rng.choice([1, 2, 4])
    overrides = [*BASE, *rng.choice(LAYOUTS), f"distributed.num_processes={world}",
                 f"train.micro_batch_size={micro}", f"train.global_batch_size={world * micro * rng.choice([1, 2])}",
                 f"train.gradient_checkpointing={rng.choice(['true', 'false'])}",
                 f"memory_profile={rng.choice(['full', 'lora'])}",
                 f"distributed={rng.choice(['ddp', 'ddp', 'zero2', 'zero3'])}",
                 f"hardware={rng.choice(['cpu', 'a100_80g'])}", f"train.max_steps={rng.choice([1, 3])}"]
    if "train.packing=true" in overrides:  # rm.settings.validate refuses packing under DeepSpeed
        overrides = [o for o in overrides if not o.startswith("distributed=")]
    cfg = compose(overrides)
    cfg.hardware = resolve_hardware(cfg.hardware)
    plan = validate(cfg, world)
    return cfg, plan, memory_shapes(cfg.train, plan, random_lengths(rng, 16 * world, cfg.data.max_length)), overrides


@pytest.mark.parametrize("seed", [0] + [pytest.param(s, marks=pytest.mark.slow) for s in range(1, 24)])
def test_the_worst_rank_is_the_largest_of_every_ranks_estimate_on_random_cases(seed):
    rng = random.Random(seed)
    for _ in range(3):
        cfg, plan, shapes, overrides = random_case(rng)
        every = [estimate_run(cfg, plan, s, rank=r) for r, s in enumerate(shapes)]
        worst = worst_rank_estimate(cfg, plan, shapes)
        assert worst.peak_bytes == max(e.peak_bytes for e in every), overrides
        assert worst.fits == all(e.fits for e in every), overrides
        assert every[worst.rank].peak_bytes == worst.peak_bytes, overrides


def test_ranks_whose_bound_the_largest_already_reaches_are_not_estimated(monkeypatch):
    """Eight ranks under DDP whose micro-batches all differ, the last the longest of all in every shape: it reaches
    its bound, which is every rank's, so no other rank is estimated."""
    cfg = compose([*BASE, "distributed.num_processes=8", "train.micro_batch_size=2", "train.global_batch_size=16"])
    plan = validate(cfg, 8)
    shapes = [BatchShapes(BatchShape(4, 20 + r), BatchShape(4, 30 + r), False, "data",
                          after_first_step=BatchShape(4, 20 + r), first_micro_batch=BatchShape(4, 10 + r))
              for r in range(8)]
    estimated = []
    real = terms.estimate_run

    def counting(cfg, plan, shapes, rank=None, **kw):
        if shapes.sized_by == "data":
            estimated.append(rank)
        return real(cfg, plan, shapes, rank=rank, **kw)

    monkeypatch.setattr(terms, "estimate_run", counting)
    worst = worst_rank_estimate(cfg, plan, shapes)
    assert estimated == [7]
    assert worst.peak_bytes == max(real(cfg, plan, s, rank=r).peak_bytes for r, s in enumerate(shapes))


@pytest.mark.parametrize("overrides", [
    ["memory_profile=full"], ["memory_profile=lora", "train.packing=true"],
    pytest.param(["memory_profile=lora", "train.gradient_checkpointing=true"], marks=pytest.mark.slow),
    pytest.param(["memory_profile=full", "train.share_prefix=true"], marks=pytest.mark.slow),
])
def test_the_estimate_grows_with_the_length_and_padding_weighs_more(overrides):
    """On random lengths: each traced term the estimate reads grows with the length; a padded micro-batch weighs at
    least an unpadded one as long; packed rows grow on each side of their longest sequence."""
    cfg = compose([*BASE, *overrides])
    plan = validate(cfg, 1)
    traced = traced_model(cfg, plan)
    layers, t = cfg.model.num_hidden_layers, cfg.train
    rng = np.random.default_rng(len(overrides) + 7 * t.packing)
    segment = 40 if t.packing and attention_kernel(cfg.model.attn_implementation) == "segments" else 0
    lengths = sorted({int(n) for n in rng.integers(8, 96, size=6)} | ({segment, segment + 1} if segment else set()))
    rows = 1 if t.packing else 4
    keys = ("peak_bytes", "backward_with_gradients_bytes", "embedding_backward_bytes")

    def terms_at(n, padded=True):
        seg = segment if 0 < segment < n else 0
        act = estimate_activations(traced, layers, rows, n, packed=t.packing, shared_prefix=t.share_prefix,
                                   padded=padded, segment=seg)
        return [act[k] for k in keys]

    regimes = [[n for n in lengths if n <= segment], [n for n in lengths if n > segment]] if segment else [lengths]
    for regime in regimes:
        values = [terms_at(n) for n in regime]
        for shorter, longer, a, b in zip(regime, regime[1:], values, values[1:]):
            assert all(x <= y for x, y in zip(a, b)), (shorter, longer, a, b)
    if not (t.packing or t.share_prefix):
        for n in lengths:
            assert all(u <= p for u, p in zip(terms_at(n, padded=False), terms_at(n))), n
    evals = [inference_peak_bytes(traced, 2 * r, n) for r, n in ((1, 16), (2, 16), (2, 40), (4, 40), (4, 72))]
    assert evals == sorted(evals)
