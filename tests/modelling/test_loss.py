"""Bradley-Terry loss against values worked by hand; the run's loss, built from config, in evaluation and the trace."""

import math

import pytest
import torch

from rm.foundations.config import compose
from rm.modelling.loss import PairLoss, bradley_terry_loss, build_loss

# The loss's keys, off and on: the default, pairs with margins, centred rewards.
LOSS_OVERRIDES = {"default": [], "margin": ["data.margin_column=score"],
                  "centred": ["train.center_rewards_coefficient=0.1"]}


def test_hand_computed_mean():
    """Pairs with differences 1 and 0.

    -log sigmoid(1) = log(1 + e^-1) = 0.3132617
    -log sigmoid(0) = log 2          = 0.6931472
    mean                             = 0.5032044
    """
    loss = bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
    assert loss.item() == pytest.approx(0.5032044, abs=1e-6)


def test_margin_shifts_the_difference():
    """r_c - r_r = 3 - 1 = 2 and margin 2 leave a difference of 0: loss log 2."""
    loss = bradley_terry_loss(torch.tensor([3.0]), torch.tensor([1.0]), margin=torch.tensor([2.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_center_term():
    """r = (1, 0): BT part log(1 + e^-1) = 0.3132617; centring 0.1 * (1 + 0)^2 = 0.1; total 0.4132617."""
    loss = bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), center_rewards_coefficient=0.1)
    assert loss.item() == pytest.approx(0.4132617, abs=1e-6)


def test_gradient_at_a_tie():
    """d/dr_c of -log sigmoid(r_c - r_r) = -sigmoid(r_r - r_c) = -0.5 at a tie, and +0.5 for r_r."""
    chosen = torch.zeros(1, requires_grad=True)
    rejected = torch.zeros(1, requires_grad=True)
    bradley_terry_loss(chosen, rejected).backward()
    assert chosen.grad.item() == pytest.approx(-0.5)
    assert rejected.grad.item() == pytest.approx(0.5)


def test_bf16_rewards_give_a_float32_loss():
    """A difference of 20 in bf16: -log sigmoid(20) = 2.06e-9, which bf16 arithmetic would round badly."""
    loss = bradley_terry_loss(torch.tensor([20.0], dtype=torch.bfloat16), torch.tensor([0.0], dtype=torch.bfloat16))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(2.0611537e-9, rel=1e-3)


def test_the_loss_is_built_from_its_config_keys():
    built = {name: build_loss(compose(["experiment=tiny", *extra]).train, compose(["experiment=tiny", *extra]).data)
             for name, extra in LOSS_OVERRIDES.items()}
    assert built == {"default": PairLoss(0.0, uses_margin=False), "margin": PairLoss(0.0, uses_margin=True),
                     "centred": PairLoss(0.1, uses_margin=False)}
    # Without margins a batch's margins (all 0) are not subtracted: the same number as subtracting them
    chosen, rejected, zeros = torch.tensor([1.5, -2.0]), torch.tensor([0.25, 3.0]), torch.zeros(2)
    assert built["default"](chosen, rejected, zeros) == bradley_terry_loss(chosen, rejected, zeros)
    assert built["margin"](chosen, rejected, torch.tensor([2.0, 0.0])) != built["default"](chosen, rejected, zeros)


def test_the_trace_keeps_what_the_configured_loss_keeps():
    """The memory trace runs the run's loss. 8 sequences = 4 pairs, fp32 rewards (the fp32 head). Centring adds
    coef * mean((r_c + r_r)^2), whose square keeps its base r_c + r_r for the backward: 4 pairs x 4 bytes = 16 bytes
    more kept by the head and loss from the end of the forward to their backward. A margin is subtracted from the
    difference, and logsigmoid keeps that instead of the difference: the same bytes."""
    from rm.memory.terms import traced_model
    from rm.memory.trace import measure_layer
    from rm.settings.validate import validate

    kept = {}
    for name, extra in LOSS_OVERRIDES.items():
        cfg = compose(["experiment=tiny", "hardware=cpu", "memory_profile=full", *extra])
        traced = traced_model(cfg, validate(cfg, 1))
        assert traced.loss == build_loss(cfg.train, cfg.data)
        kept[name] = measure_layer(traced, 8, 32).head_saved_bytes
    assert kept["centred"] - kept["default"] == 4 * 4
    assert kept["margin"] == kept["default"]


def test_the_eval_loss_is_the_configured_loss():
    """Evaluation reports the training loss of its pairs, margins and centring included: over every pair,
    mean(-log sigmoid(r_c - r_r - m)) + coef * mean((r_c + r_r)^2), from the rewards it returns."""
    from datasets import Dataset

    from rm.data.collator import PairCollator
    from rm.distributed.engine import AccelerateEngine
    from rm.evaluation.metrics import evaluate
    from rm.modelling.model import build_model

    torch.manual_seed(0)
    cfg = compose(["experiment=tiny", "hardware=cpu"])
    model = build_model(cfg.model, 0, "float32", gradient_checkpointing=False)
    ids = torch.randint(1, cfg.model.vocab_size, (12, 9)).tolist()
    pairs = Dataset.from_dict({"chosen_input_ids": [row[: 3 + i % 6] for i, row in enumerate(ids[:6])],
                               "rejected_input_ids": [row[: 9 - i % 4] for i, row in enumerate(ids[6:])],
                               "margin": [0.0, 0.5, 1.0, 1.5, 2.0, 3.0]})
    engine = AccelerateEngine(cpu=True, precision="32-true", gradient_accumulation_steps=1, max_grad_norm=1.0)
    margins = torch.tensor(pairs["margin"])
    losses = {}
    for name, extra in LOSS_OVERRIDES.items():
        run = compose(["experiment=tiny", "hardware=cpu", *extra])
        metrics, scores = evaluate(model, pairs, PairCollator(0), 4, engine, build_loss(run.train, run.data))
        chosen, rejected = scores.chosen.float(), scores.rejected.float()
        by_hand = -torch.nn.functional.logsigmoid(chosen - rejected - (margins if name == "margin" else 0)).mean()
        by_hand += run.train.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
        assert metrics["eval_loss"] == pytest.approx(by_hand.item(), rel=1e-6), name
        losses[name] = metrics["eval_loss"]
    assert losses["margin"] > losses["default"] < losses["centred"]
