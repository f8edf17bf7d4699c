"""The pairwise Bradley-Terry loss, as a pure function of rewards, and the run's loss built from config.

:func:`build_loss` is the one place the loss's config keys are read; the :class:`PairLoss` it returns is what
training (``rm.training.trainer``), evaluation (``rm.evaluation.metrics``) and the memory trace (``rm.memory.trace``) call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from rm.foundations.config import DataConfig, TrainConfig


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


@dataclass(frozen=True)
class PairLoss:
    """:func:`bradley_terry_loss` with a run's settings, as :func:`build_loss` makes it. Plain values and frozen:
    the memory trace keys its cache by it (``rm.memory.trace.TracedModel``).

    Attributes:
        center_rewards_coefficient: as :func:`bradley_terry_loss` takes it.
        uses_margin: the pairs carry margins (``data.margin_column``). Without, every margin is 0 and none is
            subtracted: the same numbers, one tensor fewer kept for the backward.
    """

    center_rewards_coefficient: float
    uses_margin: bool

    def __call__(self, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                 margin: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The loss of a micro-batch; ``margin``: the batch's ``(B,)`` margins, read where :attr:`uses_margin`."""
        return bradley_terry_loss(chosen_rewards, rejected_rewards, margin if self.uses_margin else None,
                                  self.center_rewards_coefficient)


def build_loss(train_cfg: TrainConfig, data_cfg: DataConfig) -> PairLoss:
    """The run's loss, from the keys that select it: ``train.center_rewards_coefficient`` and ``data.margin_column``."""
    return PairLoss(center_rewards_coefficient=train_cfg.center_rewards_coefficient,
                    uses_margin=data_cfg.margin_column is not None)
