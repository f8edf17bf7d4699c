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
def evaluate(model, eval_set, collator: PairCollator, batch_size: int, engine) -> Dict[str, float]:
    """Pairwise accuracy, mean reward margin and loss over ``eval_set``.

    Each process scores a strided share of the pairs; sums are reduced across
    processes, so the result covers every pair exactly once. A tie counts as wrong.
    Every process runs the same number of forward passes (one with nothing left
    scores pair 0 and discards it), because under ZeRO-3 each forward gathers
    the weights collectively.
    """
    was_training = model.training
    model.eval()
    indices = list(range(engine.process_index, len(eval_set), engine.num_processes))
    per_rank = -(-len(eval_set) // engine.num_processes)
    sums = torch.zeros(4, dtype=torch.float64, device=engine.device)  # pairs, correct, margin, loss
    for start in range(0, per_rank, batch_size):
        chunk = indices[start : start + batch_size]
        if not chunk:
            with engine.autocast():
                pair_rewards(model, *(collator(eval_set.select([0]))[k].to(engine.device) for k in ("input_ids", "attention_mask")))
            continue
        batch = collator(eval_set.select(chunk))
        with engine.autocast():
            chosen, rejected = pair_rewards(
                model, batch["input_ids"].to(engine.device), batch["attention_mask"].to(engine.device)
            )
        diff = (chosen - rejected).float()
        n = diff.numel()
        sums += torch.tensor(
            [n, (diff > 0).sum().item(), diff.sum().item(), bradley_terry_loss(chosen, rejected).item() * n],
            dtype=torch.float64,
            device=engine.device,
        )
    sums = engine.reduce(sums, reduction="sum")
    model.train(was_training)
    pairs = max(sums[0].item(), 1.0)
    return {
        "eval_accuracy": sums[1].item() / pairs,
        "eval_margin": sums[2].item() / pairs,
        "eval_loss": sums[3].item() / pairs,
        "eval_pairs": int(sums[0].item()),
    }


class MetricsLog:
    """One JSON object per event in ``metrics.jsonl``, and tensorboard scalars when asked; rank 0 only."""

    def __init__(self, run_dir: Path, is_main_process: bool, tensorboard: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = is_main_process
        self.writer = None
        if self.enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, event: str, step: int, values: Dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"event": event, "step": step, **{k: _finite_or_none(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{event}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _finite_or_none(value) -> Optional[float]:
    # JSON has no NaN/inf; null keeps the file parseable by every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
