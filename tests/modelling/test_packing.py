"""Padding-free batching (``train.packing``): the same rewards, the same gradient, the same trained weights.

Speed is not tested here: ``benchmarks/bench_vs_trl.py`` measures it (benchmarks/results/throughput.md).
"""

import json

import pytest
import torch
from accelerate.utils import set_seed

import rm.train as rm_train
from rm.data.batching import split_by_tokens
from rm.data.collator import PackedPairCollator, PairCollator
from rm.modelling.loss import bradley_terry_loss
from rm.modelling.model import build_model, pair_rewards
from rm.settings.validate import ConfigError, validate
from tests.conftest import FAST_TINY

# Lengths 1..9 mixed, so padded rows carry many pad tokens and packed sequences of length 1
# sit next to each other (position ids 0, 0: the boundary the packing detection must see).
PAIRS = [
    {"chosen_input_ids": [2, 10, 11, 12, 13, 3], "rejected_input_ids": [2, 14, 3], "margin": 0.0},
    {"chosen_input_ids": [7], "rejected_input_ids": [2, 15, 16, 17, 18, 19, 20, 21, 3], "margin": 0.5},
    {"chosen_input_ids": [2, 22, 23, 3], "rejected_input_ids": [9], "margin": 0.0},
]


def tiny_model(tiny_cfg, attn):
    cfg = tiny_cfg(f"model.attn_implementation={attn}")
    set_seed(0)
    return build_model(cfg.model, pad_token_id=0, dtype="float32", gradient_checkpointing=False)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rewards_equal_padded_rewards(tiny_cfg, attn):
    """Each sequence of the packed row sees only itself: its reward equals the padded batch's (rtol 1e-5, fp32).

    A packed row without block-diagonal attention would let the second sequence attend to the
    first and change every reward after the first sequence, far beyond the tolerance.
    """
    model = tiny_model(tiny_cfg, attn).eval()
    padded, packed = PairCollator(pad_token_id=0)(PAIRS), PackedPairCollator()(PAIRS)
    with torch.no_grad():
        want = pair_rewards(model, padded["input_ids"], padded["attention_mask"])
        got = pair_rewards(model, packed["input_ids"], position_ids=packed["position_ids"], ends=packed["ends"])
        # The control: the same packed row with positions counted straight through, so no boundary is seen.
        leaky = pair_rewards(model, packed["input_ids"], position_ids=torch.arange(packed["input_ids"].shape[1])[None],
                             ends=packed["ends"])
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(torch.cat(leaky)[1:], torch.cat(want)[1:], rtol=1e-3, atol=1e-4)


def test_packed_gradient_equals_padded_gradient(tiny_cfg):
    """Micro-batches of 2 and 1 pairs weighted by their share (2/3, 1/3) give the gradient of the 3-pair mean."""
    model = tiny_model(tiny_cfg, "sdpa")
    padded = PairCollator(pad_token_id=0)(PAIRS)
    bradley_terry_loss(*pair_rewards(model, padded["input_ids"], padded["attention_mask"]), padded["margin"]).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for part in (PAIRS[:2], PAIRS[2:]):
        batch = PackedPairCollator()(part)
        chosen, rejected = pair_rewards(model, batch["input_ids"], position_ids=batch["position_ids"], ends=batch["ends"])
        (bradley_terry_loss(chosen, rejected, batch["margin"]) * len(part) / len(PAIRS)).backward()
    for w, p in zip(want, model.parameters()):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_split_by_tokens_keeps_pairs_whole_and_within_budget():
    """Pair tokens 6, 3, 4, 9, 12 with budget 10: [6+3], [4], [9], [12 alone, over budget]; order kept."""
    assert split_by_tokens([0, 1, 2, 3, 4], [6, 3, 4, 9, 12], 10) == [[0, 1], [2], [3], [4]]
    assert split_by_tokens([], [], 10) == []


def test_packing_options_are_validated(tiny_cfg):
    with pytest.raises(ConfigError, match="train.max_tokens_per_micro_batch=200 needs train.packing=true"):
        validate(tiny_cfg("train.max_tokens_per_micro_batch=200"), 1)
    # data.max_length=64 in FAST_TINY: a budget must hold one pair of two 64-token sequences.
    with pytest.raises(ConfigError, match=r"must be 0 or >= 2 x data.max_length = 128"):
        validate(tiny_cfg("train.packing=true", "train.max_tokens_per_micro_batch=100"), 1)
    validate(tiny_cfg("train.packing=true", "train.max_tokens_per_micro_batch=128"), 1)


# Adam with epsilon 1 and learning rate 1 steps by about the gradient itself: a gradient-level
# comparison. With the default epsilon, Adam's update is nearly the gradient's sign, and float
# noise in gradients near 0 flips it; that is not a difference between the two batchings.
STEPS = ["train.max_steps=3", "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", "train.optim.warmup_ratio=0",
         "train.optim.lr_scheduler_type=constant_with_warmup", "train.optim.max_grad_norm=0", "preflight.mode=off",
         "train.optim.learning_rate=1", "train.optim.adam_epsilon=1"]


def final_weights(tiny_cfg, tmp_path, name, *overrides):
    from safetensors.torch import load_file

    rm_train.train(tiny_cfg(*STEPS, *overrides), tmp_path / name)
    return load_file(tmp_path / name / "final" / "model.safetensors")


def test_packed_training_gives_the_padded_weights(tiny_cfg, tmp_path):
    """Three steps padded (2 micro-batches of 8 pairs) and packed by a 300-token budget (micro-batches
    of unequal pair counts) end at the same weights to float tolerance: same pairs, same gradient.
    A run at learning rate 1e-30 gives the initial weights, to show that every tensor moved."""
    initial = final_weights(tiny_cfg, tmp_path, "initial", "train.optim.learning_rate=1e-30")
    padded = final_weights(tiny_cfg, tmp_path, "padded")
    packed = final_weights(tiny_cfg, tmp_path, "packed", "train.packing=true", "train.max_tokens_per_micro_batch=300")
    assert padded.keys() == packed.keys()
    for key in padded:
        assert (padded[key] - initial[key]).abs().max() > 1e-3, key
        torch.testing.assert_close(packed[key], padded[key], rtol=1e-4, atol=1e-5, msg=key)
    lines = [json.loads(x) for x in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("tokens_per_s") for x in lines)


@pytest.mark.parametrize("budget", [0, 128])
def test_packed_estimate_matches_measured_peak(tmp_path, budget):
    """The estimate follows the packed row (1 x budget tokens, or micro-batch x 2 x max_length), not a padded batch.

    data.max_length=16 truncates every synthetic sequence to 16 tokens, so each pair is 32 tokens and
    each micro-batch fills its row exactly: 128 tokens = 4 pairs for the budget; 8 x 2 x 16 = 256
    tokens without one. The live-tensor count (train.logging.track_memory) is then exactly what is estimated.
    """
    from rm.foundations.config import compose

    overrides = [*FAST_TINY, "data.max_length=16", "train.max_steps=2", "train.logging.eval_steps=0", "train.eval_batch_size=1",
                 "train.logging.track_memory=true", "train.packing=true", f"train.max_tokens_per_micro_batch={budget}"]
    rm_train.train(compose(overrides), tmp_path, overrides)
    memory = json.loads((tmp_path / "memory.json").read_text())
    estimate, measured = memory["estimate"]["peak_bytes"], memory["measured"]["peak_allocated_bytes"]
    assert memory["estimate"]["peak_phase"] == "forward/backward"
    assert estimate == pytest.approx(measured, rel=0.01), (estimate, measured)
