"""Evaluation of a reward model on pairs, and the run's metrics log."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Optional

import torch

from rm.data.collator import PairCollator
from rm.loss import bradley_terry_loss
from rm.model import pair_rewards


@torch.no_grad()
def evaluate(model, eval_set, collator: PairCollator, batch_size: int, accelerator) -> Dict[str, float]:
    """Pairwise accuracy, mean reward margin and loss over ``eval_set``.

    Each process scores a strided share of the pairs; sums are reduced across
    processes, so the result covers every pair exactly once. A tie counts as wrong.
    """
    was_training = model.training
    model.eval()
    indices = list(range(accelerator.process_index, len(eval_set), accelerator.num_processes))
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # pairs, correct, margin, loss
    for start in range(0, len(indices), batch_size):
        batch = collator(eval_set.select(indices[start : start + batch_size]))
        with accelerator.autocast():
            chosen, rejected = pair_rewards(
                model, batch["input_ids"].to(accelerator.device), batch["attention_mask"].to(accelerator.device)
            )
        diff = (chosen - rejected).float()
        n = diff.numel()
        sums += torch.tensor(
            [n, (diff > 0).sum().item(), diff.sum().item(), bradley_terry_loss(chosen, rejected).item() * n],
            dtype=torch.float64,
            device=accelerator.device,
        )
    sums = accelerator.reduce(sums, reduction="sum")
    model.train(was_training)
    pairs = max(sums[0].item(), 1.0)
    return {
        "eval_accuracy": sums[1].item() / pairs,
        "eval_margin": sums[2].item() / pairs,
        "eval_loss": sums[3].item() / pairs,
        "eval_pairs": int(sums[0].item()),
    }


class MetricsLog:
    """Appends one JSON object per event to ``metrics.jsonl`` (main process only), and to trackers."""

    def __init__(self, run_dir: Path, accelerator):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.accelerator = accelerator

    def write(self, event: str, step: int, values: Dict[str, float]) -> None:
        if not self.accelerator.is_main_process:
            return
        record = {"event": event, "step": step, **{k: _finite_or_none(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.accelerator.log({f"{event}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)


def _finite_or_none(value) -> Optional[float]:
    # JSON has no NaN/inf; null keeps the file parseable by every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
