"""The pairwise Bradley-Terry loss, as a pure function of rewards."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
    center_rewards_coefficient: float = 0.0,
) -> torch.Tensor:
    """Mean of ``-log sigmoid(r_chosen - r_rejected - margin)`` over the pairs.

    Computed in float32 whatever the rewards' dtype: ``logsigmoid`` of a bf16
    difference loses most of its precision near the ln 2 plateau.

    Args:
        chosen_rewards: ``(B,)`` rewards of the preferred sequences.
        rejected_rewards: ``(B,)`` rewards of the other sequences.
        margin: optional ``(B,)`` per-pair margin the chosen reward must exceed the
            rejected one by (Llama 2's margin loss); ``None`` means 0.
        center_rewards_coefficient: adds ``coef * mean((r_chosen + r_rejected)**2)``
            (Eisenstein et al., 2023; TRL's ``center_rewards_coefficient``), which
            keeps rewards centred on zero so they compare across models.

    Returns:
        A scalar tensor.
    """
    chosen = chosen_rewards.float()
    rejected = rejected_rewards.float()
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.float()
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss
