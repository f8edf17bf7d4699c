"""What a reward model's eval scores say beyond accuracy: pure functions over plain tensors.

Every function takes the per-pair vectors that :func:`rm.evaluation.metrics.evaluate` gathers: the chosen
and rejected rewards and the chosen and rejected lengths in real tokens (the attention mask's
sum, padding excluded), one entry per pair, in the same order. Definitions, decided once here:

* **Accuracy** counts a pair as right when ``r_chosen > r_rejected``; a tie counts as wrong, as in
  ``eval_accuracy``, so the bucket accuracies weighted by their pair counts give ``eval_accuracy``.
* **Tie**: ``r_chosen == r_rejected`` exactly, as returned by the model. No tolerance, because a
  tolerance would call pairs ties that accuracy counts as right; exact equality is what a bf16
  model produces when it cannot tell two answers apart. So accuracy + tie rate + the share of
  pairs ranked the wrong way round = 1.
* **Length-difference buckets** of ``d = len_chosen - len_rejected`` in tokens, edges inclusive:
  ``-inf..-65``, ``-64..-17``, ``-16..-1``, ``0``, ``1..16``, ``17..64``, ``65..inf``
  (:data:`LENGTH_DIFF_BUCKETS`). Symmetric around 0, so a length bias shows as a slope.
  An empty bucket's accuracy is NaN (written as null to ``metrics.jsonl``).
* **Longer-wins baseline**: predicts that the longer side is the chosen one; pairs of equal length
  count 1/2, the expected accuracy of a coin flip, so the baseline is not flattered or punished
  by the tie-break rule.
* **Reward/length correlation**: Pearson's r over all 2N sequences (chosen and rejected pooled);
  NaN when rewards or lengths are constant.
* **Means and standard deviations** are population ones (divide by n, not n - 1): they describe
  the eval set itself, and ``eval_reward_mean`` / ``eval_reward_std`` over all 2N rewards are what
  the exported model's reward normalisation reads.
* **Expected calibration error** of ``p = sigmoid(r_chosen - r_rejected)``, the Bradley-Terry
  probability that the chosen side wins, in 10 equal-width bins, on the *symmetrised* set (see
  :func:`expected_calibration_error` for why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

# (low, high) of len_chosen - len_rejected in tokens, both inclusive.
LENGTH_DIFF_BUCKETS: Tuple[Tuple[float, float], ...] = (
    (-math.inf, -65), (-64, -17), (-16, -1), (0, 0), (1, 16), (17, 64), (65, math.inf),
)
ECE_BINS = 10
# What rm.evaluation.metrics.evaluate reports besides the diagnostics; the keys that sweeps and Optuna read.
SUMMARY_KEYS = ("accuracy", "margin", "loss", "pairs")


def bucket_label(low: float, high: float) -> str:
    """``"-64..-17"``, ``"0"``, ``"65..inf"``: the name a bucket has in metric keys and plots.

    >>> [bucket_label(*b) for b in LENGTH_DIFF_BUCKETS]
    ['-inf..-65', '-64..-17', '-16..-1', '0', '1..16', '17..64', '65..inf']
    """
    def text(x: float) -> str:
        return ("-inf" if x < 0 else "inf") if math.isinf(x) else str(int(x))

    return text(low) if low == high else f"{text(low)}..{text(high)}"


@dataclass(frozen=True)
class PairScores:
    """Per-pair rewards and lengths of one eval set, float64 on the CPU, all of shape ``(N,)``."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor

    def __len__(self) -> int:
        return self.chosen.numel()


@dataclass(frozen=True)
class BucketAccuracy:
    """One length-difference bucket: its label, pair count, the model's and the longer-wins accuracy."""

    label: str
    pairs: int
    accuracy: float  # NaN when the bucket is empty
    longer_wins_accuracy: float  # NaN when the bucket is empty


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64).flatten()


def pairwise_accuracy(chosen, rejected) -> float:
    """Share of pairs with ``chosen > rejected`` (a tie is wrong); NaN for no pairs."""
    chosen, rejected = _f64(chosen), _f64(rejected)
    return (chosen > rejected).double().mean().item() if chosen.numel() else math.nan


def tie_rate(chosen, rejected) -> float:
    """Share of pairs whose two rewards are exactly equal; NaN for no pairs."""
    chosen, rejected = _f64(chosen), _f64(rejected)
    return (chosen == rejected).double().mean().item() if chosen.numel() else math.nan


def longer_wins_accuracy(chosen_lengths, rejected_lengths) -> float:
    """Accuracy of "the longer side is the chosen one"; equal lengths count 1/2. NaN for no pairs."""
    chosen_lengths, rejected_lengths = _f64(chosen_lengths), _f64(rejected_lengths)
    if not chosen_lengths.numel():
        return math.nan
    score = (chosen_lengths > rejected_lengths).double() + 0.5 * (chosen_lengths == rejected_lengths).double()
    return score.mean().item()


def accuracy_by_length_bucket(chosen, rejected, chosen_lengths, rejected_lengths) -> List[BucketAccuracy]:
    """Accuracy and longer-wins accuracy per bucket of :data:`LENGTH_DIFF_BUCKETS`, in order.

    Returns:
        One :class:`BucketAccuracy` per bucket, empty buckets included (0 pairs, NaN accuracies).
    """
    chosen, rejected = _f64(chosen), _f64(rejected)
    chosen_lengths, rejected_lengths = _f64(chosen_lengths), _f64(rejected_lengths)
    diff = chosen_lengths - rejected_lengths
    buckets = []
    for low, high in LENGTH_DIFF_BUCKETS:
        inside = (diff >= low) & (diff <= high)
        buckets.append(BucketAccuracy(
            label=bucket_label(low, high),
            pairs=int(inside.sum().item()),
            accuracy=pairwise_accuracy(chosen[inside], rejected[inside]),
            longer_wins_accuracy=longer_wins_accuracy(chosen_lengths[inside], rejected_lengths[inside]),
        ))
    return buckets


def mean_std(values) -> Tuple[float, float]:
    """Mean and population standard deviation (divide by n); NaNs for an empty input."""
    values = _f64(values)
    if not values.numel():
        return math.nan, math.nan
    return values.mean().item(), values.std(correction=0).item()


def reward_length_correlation(chosen, rejected, chosen_lengths, rejected_lengths) -> float:
    """Pearson's r between reward and length over all 2N sequences; NaN when either is constant."""
    rewards = torch.cat([_f64(chosen), _f64(rejected)])
    lengths = torch.cat([_f64(chosen_lengths), _f64(rejected_lengths)])
    dr, dl = rewards - rewards.mean(), lengths - lengths.mean()
    denominator = math.sqrt((dr * dr).sum().item() * (dl * dl).sum().item())
    return (dr * dl).sum().item() / denominator if denominator > 0 else math.nan


def expected_calibration_error(chosen, rejected, bins: int = ECE_BINS) -> float:
    """ECE of ``p = sigmoid(r_chosen - r_rejected)`` on the symmetrised pairs, ``bins`` equal-width bins.

    Ordered as (chosen, rejected), every pair's outcome "the first side wins" is 1, so plain ECE
    would be ``1 - mean(p)``: it rewards confidence and cannot tell a calibrated model from an
    under-confident one (a model right 75% of the time that says 0.75 would score 0.25). The
    order of the two sides is an artefact of the file; the probability the model states is about
    an unordered pair. So each pair enters twice, as ``(p, label 1)`` and as ``(1 - p, label 0)``,
    the two ways it could have been presented. Bin ``b`` holds the probabilities in
    ``[b / bins, (b + 1) / bins)`` (1.0 falls in the last bin), and
    ``ECE = sum_b (n_b / 2N) * |mean label_b - mean probability_b|``. NaN for no pairs.
    """
    diff = _f64(chosen) - _f64(rejected)
    if not diff.numel():
        return math.nan
    p = torch.sigmoid(diff)
    probs = torch.cat([p, 1 - p])
    labels = torch.cat([torch.ones_like(p), torch.zeros_like(p)])
    index = (probs * bins).floor().long().clamp(0, bins - 1)
    # n_b * |mean label - mean prob| = |sum labels - sum probs| within the bin.
    gap = torch.zeros(bins, dtype=torch.float64).index_add_(0, index, labels - probs)
    return gap.abs().sum().item() / probs.numel()


def pair_diagnostics(scores: PairScores) -> Dict[str, float]:
    """All diagnostics of one eval set as flat keys without the ``eval_`` prefix.

    Keys: ``acc_len_diff_<bucket>`` and ``pairs_len_diff_<bucket>`` per bucket,
    ``longer_wins_accuracy``, ``reward_length_corr``, ``tie_rate``, ``ece``,
    ``chosen_reward_mean`` / ``_std``, ``rejected_reward_mean`` / ``_std``, and
    ``reward_mean`` / ``reward_std`` over all 2N rewards (see :func:`diagnostic_keys`).
    """
    c, r, lc, lr = scores.chosen, scores.rejected, scores.chosen_lengths, scores.rejected_lengths
    out: Dict[str, float] = {}
    for bucket in accuracy_by_length_bucket(c, r, lc, lr):
        out[f"acc_len_diff_{bucket.label}"] = bucket.accuracy
        out[f"pairs_len_diff_{bucket.label}"] = bucket.pairs
    out["longer_wins_accuracy"] = longer_wins_accuracy(lc, lr)
    out["reward_length_corr"] = reward_length_correlation(c, r, lc, lr)
    out["tie_rate"] = tie_rate(c, r)
    out["ece"] = expected_calibration_error(c, r)
    for name, values in (("chosen_reward", c), ("rejected_reward", r), ("reward", torch.cat([_f64(c), _f64(r)]))):
        out[f"{name}_mean"], out[f"{name}_std"] = mean_std(values)
    return out


def eval_keys(prefix: str = "eval_") -> List[str]:
    """Every key :func:`rm.evaluation.metrics.evaluate` returns for one eval set, with ``prefix`` in front.

    >>> eval_keys("eval_hard_")[:5]
    ['eval_hard_accuracy', 'eval_hard_margin', 'eval_hard_loss', 'eval_hard_pairs', 'eval_hard_acc_len_diff_-inf..-65']
    """
    return [f"{prefix}{key}" for key in (*SUMMARY_KEYS, *diagnostic_keys())]


def diagnostic_keys() -> List[str]:
    """The keys :func:`pair_diagnostics` returns, in order, without computing anything."""
    keys = []
    for low, high in LENGTH_DIFF_BUCKETS:
        keys += [f"acc_len_diff_{bucket_label(low, high)}", f"pairs_len_diff_{bucket_label(low, high)}"]
    keys += ["longer_wins_accuracy", "reward_length_corr", "tie_rate", "ece"]
    for name in ("chosen_reward", "rejected_reward", "reward"):
        keys += [f"{name}_mean", f"{name}_std"]
    return keys
