"""rm.plan's verdicts without a trace (rm.plan.search._Search): on random data, devices, profiles and process counts,
a layout whose micro-batches outweigh another's (rm.memory.terms.outweighs) never has a smaller estimate, every
verdict inferred is the traced one, and the search picks what checking every candidate in turn picks."""

import random
from dataclasses import replace
from typing import Optional

import pytest

from rm.foundations.config import compose
from rm.memory.terms import GIB
from rm.plan.lengths import PairLengths
from rm.plan.search import Checker, _Search, _Timer, candidates, check_fastest, verdict
from rm.settings.validate import resolve_world_size
from tests.conftest import FAST_TINY
from tests.plan.test_plan import _rates


def random_lengths(rng: random.Random, pairs: int, max_length: int) -> PairLengths:
    """Chosen and rejected lengths from a long tail, a shared prompt, and a small eval set."""
    chosen = [min(max_length, max(4, int(rng.paretovariate(1.3) * 10))) for _ in range(pairs)]
    rejected = [min(max_length, max(2, c + rng.randint(-10, 10))) for c in chosen]
    prefix = [rng.randint(0, min(c, r) - 1) for c, r in zip(chosen, rejected)]
    evals = [min(max_length, int(rng.paretovariate(1.3) * 10) + 1) for _ in range(2 * rng.randint(3, 9))]
    return PairLengths.of(chosen, rejected, prefix, eval=((evals[::2], evals[1::2]),))


def space(rng: random.Random, device_gib: float = 64.0, keep: Optional[int] = None):
    """A random run's config (its profile fixed, the layout knobs free) and every candidate of its layout space, or
    its first ``keep`` (the space lists the unshared layouts first: padded, then packed)."""
    fixed = [f"memory_profile={rng.choice(['full', 'lora'])}", f"distributed.num_processes={rng.choice([1, 2])}",
             "distributed=ddp", f"train.gradient_checkpointing={rng.choice(['true', 'false'])}"]
    cfg = compose([*FAST_TINY, *fixed, "train.global_batch_size=16", "train.max_steps=4",
                                 f"hardware.device_memory_gib={device_gib}", "hardware.headroom_gib=0"])
    found, _ = candidates(cfg, fixed, resolve_world_size(cfg.distributed, launched=False))
    found = [c for c in found if not c.changes_math]
    return cfg, fixed, found[:keep]


# The default suite checks seed 0's 20 unshared candidates of 40 (each verdict is a trace: the 40 took 40-60 s under
# load); -m slow checks every candidate of eight seeds.
CASES = [(0, 20)] + [pytest.param(s, None, marks=pytest.mark.slow) for s in range(8)]


@pytest.mark.parametrize("seed,keep", CASES)
def test_a_layout_never_weighs_less_than_one_it_outweighs(seed, keep):
    rng = random.Random(seed)
    _, _, found = space(rng, keep=keep)
    lengths = random_lengths(rng, 128, 64)
    search = _Search(lengths)
    for c in found:
        verdict(c, lengths)
    compared = 0
    for heavier in found:
        for lighter in found:
            if heavier is not lighter and search.outweighs(heavier, lighter):
                compared += 1
                assert heavier.peak_bytes >= lighter.peak_bytes, (heavier.overrides, lighter.overrides)
    assert compared > len(found)  # the relation is not empty: the search has something to infer from


@pytest.mark.parametrize("seed,keep", CASES)
def test_the_search_with_inferred_verdicts_picks_what_checking_every_candidate_picks(seed, keep):
    """A device sized so that some layouts fit and some do not: each verdict the search infers is the traced one,
    and its five picks are the first five of the queue that fit."""
    rng = random.Random(100 + seed)
    _, _, roomy = space(random.Random(seed), keep=keep)
    lengths = random_lengths(rng, 128, 64)
    for c in roomy:
        verdict(c, lengths)
    peaks = sorted(c.peak_bytes for c in roomy)
    device = peaks[rng.randint(len(peaks) // 5, len(peaks) // 2)] / GIB
    cfg, _, found = space(random.Random(seed), device_gib=device, keep=keep)
    timer = _Timer(lengths, _rates(), 4)
    for c in found:
        c.step = timer(c)
    found.sort(key=lambda c: (c.step.seconds, len(c.overrides)))
    truth = {}
    for c in found:
        verdict(c, lengths)
        truth[id(c)] = c.verdict
    given = replace(next(c for c in found if not c.overrides))
    for c in found:
        c.verdict, c.peak_bytes = "unchecked", None
    picked = check_fastest(found, 5, lengths, given, Checker(workers=1))
    assert [c.overrides for c in picked] == [c.overrides for c in found if truth[id(c)] == "fits"][:5]
    inferred = [c for c in found if c.verdict == "does not fit (inferred)"]
    assert inferred and all(truth[id(c)] == "does not fit" for c in inferred), [c.overrides for c in inferred]
    assert all(c.verdict == truth[id(c)] for c in found if c.verdict in ("fits", "does not fit"))
