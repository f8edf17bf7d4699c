"""Bradley-Terry loss against values worked by hand."""

import math

import pytest
import torch

from rm.loss import bradley_terry_loss


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
