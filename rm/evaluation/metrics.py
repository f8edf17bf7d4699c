"""Evaluation of a reward model on pairs, and the run's metrics log."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

from rm.data.batching import rows_at
from rm.data.collator import PairCollator
from rm.data.tokenise import pair_lengths
from rm.evaluation.diagnostics import PairScores, pair_diagnostics
from rm.modelling.loss import PairLoss
from rm.modelling.model import pair_rewards


@torch.no_grad()
def evaluate(
    model, eval_set, collator: PairCollator, batch_size: int, engine, loss: PairLoss, prefix: str = "eval_",
    stopping: Optional[Callable[[], bool]] = None,
) -> Optional[Tuple[Dict[str, float], PairScores]]:
    """Pairwise accuracy, mean reward margin, loss and the diagnostics of :mod:`rm.evaluation.diagnostics` over ``eval_set``.

    Each process scores a strided share of the pairs, shortest first; sums are reduced across
    processes, so the result covers every pair exactly once. A tie counts as wrong.
    Every process runs the same number of forward passes (one with nothing left
    scores pair 0 and discards it), because under ZeRO-3 each forward gathers
    the weights collectively.

    Args:
        loss: the run's loss (:func:`rm.modelling.loss.build_loss`), the training step's, so that ``{prefix}loss`` is the
            training loss on these pairs.
        prefix: put before every key: ``eval_`` for the main eval set, ``eval_<name>_`` for the
            extra sets of ``data.extra_eval_files``.
        stopping: whether this process was asked to stop (a signal: :class:`rm.training.trainer.StopRequest`),
            asked before each batch; the processes agree on it, as the training loop does before each step.

    Returns:
        ``(metrics, scores)``: ``{prefix}accuracy``, ``{prefix}margin``, ``{prefix}loss``,
        ``{prefix}pairs`` and the diagnostics' keys, prefixed; and every pair's rewards and
        lengths (the same on every process), which the end-of-run plot draws. None when ``stopping`` said so
        (on any process) before the last batch: nothing of a part-done evaluation is returned.
    """
    was_training = model.training
    model.eval()
    # Each process scores its share shortest pair first, so that a batch pads to lengths like its own: in data order
    # most batches hold one pair near max_length (the demo's eval forwards: 57% padding in data order, 11% sorted). Every
    # pair's rewards go to its own index, so the result is the same up to float rounding (a row padded to another
    # length rounds differently in its last bits, as in rm.score's batches).
    longer = [max(c, r) for c, r in zip(*pair_lengths(eval_set))]
    indices = sorted(range(engine.process_index, len(eval_set), engine.num_processes), key=lambda i: longer[i])
    per_rank = -(-len(eval_set) // engine.num_processes)
    sums = torch.zeros(4, dtype=torch.float64, device=engine.device)  # pairs, correct, margin, loss
    # Rows: chosen reward, rejected reward, chosen length, rejected length. The strided shares are
    # disjoint, so a sum over processes of these zero-filled rows is a gather that every backend
    # (gloo, NCCL, DeepSpeed) already supports through ``engine.reduce``.
    per_pair = torch.zeros(len(eval_set), 4, dtype=torch.float64, device=engine.device)
    for start in range(0, per_rank, batch_size):
        # A long evaluation would hold a signal's checkpoint (and a pre-empted job's last seconds) until its end. Every
        # process runs the same batches, so all of them meet this reduce before each one and stop at the same batch
        # (under ZeRO-3 a forward gathers the weights collectively: one that went on alone would hang).
        # One process asks its flag on the host: a device round trip a batch would wait for the batch before.
        if stopping is not None and (stopping() if engine.num_processes == 1 else
                                     engine.reduce(torch.tensor(float(stopping()), device=engine.device)).item()):
            model.train(was_training)
            return None
        chunk = indices[start : start + batch_size]
        if not chunk:
            with engine.autocast():
                pair_rewards(model, *(collator(rows_at(eval_set, [0]))[k].to(engine.device) for k in ("input_ids", "attention_mask")))
            continue
        batch = collator(rows_at(eval_set, chunk))
        with engine.autocast():
            chosen, rejected = pair_rewards(
                model, batch["input_ids"].to(engine.device), batch["attention_mask"].to(engine.device)
            )
        diff = (chosen - rejected).float()
        n = diff.numel()
        mean_loss = loss(chosen, rejected, batch["margin"].to(engine.device))
        # Summed on the device: reading each batch's numbers (.item()) would wait for its forward before the host
        # collates the next batch, three waits a batch on a GPU
        sums += torch.stack([diff.new_tensor(n), (diff > 0).sum(), diff.sum(), mean_loss.detach() * n]).double()
        lengths = batch["attention_mask"].sum(dim=1).to(engine.device, torch.float64)
        per_pair[torch.tensor(chunk, device=engine.device)] = torch.stack(
            [chosen.double(), rejected.double(), lengths[:n], lengths[n:]], dim=1
        )
    sums = engine.reduce(sums, reduction="sum")
    per_pair = engine.reduce(per_pair, reduction="sum").cpu()
    model.train(was_training)
    pairs = max(sums[0].item(), 1.0)
    scores = PairScores(*per_pair.unbind(dim=1))
    metrics = {
        f"{prefix}accuracy": sums[1].item() / pairs,
        f"{prefix}margin": sums[2].item() / pairs,
        f"{prefix}loss": sums[3].item() / pairs,
        f"{prefix}pairs": int(sums[0].item()),
    }
    metrics.update({f"{prefix}{key}": value for key, value in pair_diagnostics(scores).items()})
    return metrics, scores


def evaluate_sets(
    model, eval_set, extra_eval_sets: Mapping[str, object], collator: PairCollator, batch_size: int, engine,
    loss: PairLoss, stopping: Optional[Callable[[], bool]] = None,
) -> Optional[Tuple[Dict[str, float], Dict[str, PairScores]]]:
    """:func:`evaluate` on the main eval set (``eval_`` keys; skipped when ``None``) and on each
    named extra set (``eval_<name>_`` keys), merged into one dict.

    Returns:
        ``(metrics, scores)``, ``scores`` keyed by prefix without its trailing ``_``
        (``"eval"``, ``"eval_<name>"``), the names the metric keys carry; None when :func:`evaluate` was stopped
        (``stopping``) in any of the sets.
    """
    named = ({"eval": eval_set} if eval_set is not None else {}) | {f"eval_{n}": s for n, s in extra_eval_sets.items()}
    metrics: Dict[str, float] = {}
    scores: Dict[str, PairScores] = {}
    for name, dataset in named.items():
        done = evaluate(model, dataset, collator, batch_size, engine, loss, prefix=f"{name}_", stopping=stopping)
        if done is None:
            return None
        values, scores[name] = done
        metrics.update(values)
    return metrics, scores


def format_eval(metrics: Mapping[str, float]) -> str:
    """One log line of eval metrics; the per-bucket keys stay in ``metrics.jsonl`` and the plot. Counts are integers.

    Example:
        >>> format_eval({"eval_accuracy": 0.93, "eval_pairs": 1000, "eval_acc_len_diff_0..0": 1.0, "eval_hard_pairs": 8})
        'eval_accuracy 0.9300  eval_pairs 1000  eval_hard_pairs 8'
    """
    def value(key, v):
        return f"{v:.0f}" if key.endswith("_pairs") else f"{v:.4f}"

    return "  ".join(f"{k} {value(k, v)}" for k, v in metrics.items() if "_len_diff_" not in k)


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
        # Wall-clock seconds since the epoch: throughput between any two records, without polling the file.
        record = {"event": event, "step": step, "time": round(time.time(), 3),
                  **{k: _finite_or_none(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{event}/{key}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def resume_at(self, step: int) -> int:
        """Drop the records of steps after ``step``, the step a resumed run goes on from: they were written by the run
        that stopped after its checkpoint (a kill, a fall back to an earlier checkpoint, a failed export), and the
        resumed run writes those steps again. Every step then appears once. Returns how many records were dropped.
        Rewritten whole and renamed, so a crash here leaves the old file."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _before_or_at(line, step)]
        if len(kept) == len(lines):
            return 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)
        return len(lines) - len(kept)


def _before_or_at(line: str, step: int) -> bool:
    """A record the resumed run keeps: one of a step up to ``step``, or one of no step; not a line cut short by a
    kill while it was written."""
    try:
        record_step = json.loads(line).get("step")
    except ValueError:
        return False
    return not isinstance(record_step, int) or record_step <= step


def _finite_or_none(value) -> Optional[float]:
    # JSON has no NaN/inf; null keeps the file parseable by every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class LineProgressFile:
    """A file for tqdm when the output is not a terminal (a SLURM or CI log): every redraw becomes a line.

    On a terminal tqdm redraws its bar in place with ``\\r`` and no newline; in a log file that leaves the
    bar without an end, and the next log line (an eval result) is glued to it. Here each redraw's
    ``\\r`` is dropped and the bar ends with a newline.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> f = LineProgressFile(out)
        >>> _ = f.write("\\rtrain:  25%| 200/800"); _ = f.write("\\r"); f.flush()
        >>> out.getvalue()
        'train:  25%| 200/800\\n'
    """

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        text = text.replace("\r", "")
        if text.strip():
            self.stream.write(text if text.endswith("\n") else text + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
