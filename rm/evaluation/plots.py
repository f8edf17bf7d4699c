"""The end-of-run pictures: ``eval_plots.png`` (the final evaluation) and ``train_plot.png`` (the losses)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from rm.evaluation.diagnostics import PairScores, accuracy_by_length_bucket, pairwise_accuracy


def write_eval_plots(scores: Mapping[str, PairScores], path: Path) -> Path:
    """One row per eval set: chosen vs rejected reward histograms, and accuracy by length-difference bucket.

    The bucket panel draws the model's accuracy as bars (pair count under each), the longer-wins
    baseline as markers, and chance as a dashed line, so a model that only learned length shows
    bars that follow the markers. Drawn with matplotlib's Agg canvas directly, without pyplot,
    so no display is needed and no global backend is switched in the caller's process.

    Args:
        scores: ``{name: PairScores}``, e.g. :func:`rm.evaluation.metrics.evaluate_sets`'s second value.
        path: where the PNG goes.

    Returns:
        ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8 * len(scores)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(scores), 2, squeeze=False)
    for (name, s), (hist_ax, bucket_ax) in zip(scores.items(), axes):
        chosen, rejected = s.chosen.numpy(), s.rejected.numpy()
        # Edges from the finite rewards only: a diverged run's NaN/inf must not cost it the rest of the plot.
        finite = np.concatenate([chosen, rejected])
        finite = finite[np.isfinite(finite)]
        low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        edges = np.linspace(low, high if high > low else low + 1.0, 41)
        hist_ax.hist(chosen, bins=edges, alpha=0.55, label=f"chosen (mean {chosen.mean():.3g})", color="tab:green")
        hist_ax.hist(rejected, bins=edges, alpha=0.55, label=f"rejected (mean {rejected.mean():.3g})", color="tab:red")
        hist_ax.set_title(f"{name}: rewards of {len(s)} pairs, accuracy {pairwise_accuracy(s.chosen, s.rejected):.3f}")
        hist_ax.set_xlabel("reward")
        hist_ax.set_ylabel("sequences")
        hist_ax.legend(fontsize=8)

        buckets = accuracy_by_length_bucket(s.chosen, s.rejected, s.chosen_lengths, s.rejected_lengths)
        x = np.arange(len(buckets))
        model_acc = np.array([b.accuracy for b in buckets], dtype=float)
        bucket_ax.bar(x, np.nan_to_num(model_acc), color="tab:blue", alpha=0.8, label="model")
        bucket_ax.plot(x, [b.longer_wins_accuracy for b in buckets], "k_", markersize=18, mew=2, label="longer wins")
        bucket_ax.axhline(0.5, color="grey", linestyle="--", linewidth=0.8, label="chance")
        bucket_ax.set_xticks(x, [f"{b.label}\nn={b.pairs}" for b in buckets], fontsize=8)
        bucket_ax.set_ylim(0, 1.22)  # headroom for the legend above the 1.0 markers
        bucket_ax.set_title(f"{name}: accuracy by length difference")
        bucket_ax.set_xlabel("len(chosen) - len(rejected), tokens (n: pairs)")
        bucket_ax.set_ylabel("pairwise accuracy")
        bucket_ax.legend(fontsize=8, loc="upper center", ncol=3)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, renamed into place: a run stopped while drawing leaves no PNG cut short."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_train_plot(metrics_path: Path, path: Path) -> Optional[Path]:
    """Training loss (and eval loss, where evaluated) against step, from ``metrics.jsonl``: ``train_plot.png``.

    The dashed line is ln 2, the loss of a model that cannot tell chosen from rejected.

    Returns:
        ``path``, or None when the file holds no training event.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    events = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(e["step"], e["loss"]) for e in events if e.get("event") == "train" and e.get("loss") is not None]
    if not train:
        return None
    evals = [(e["step"], e["eval_loss"]) for e in events if e.get("event") == "eval" and e.get("eval_loss") is not None]
    fig = Figure(figsize=(8, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", color="tab:orange")
    ax.axhline(math.log(2), color="grey", linestyle="--", linewidth=0.8, label="ln 2 (chance)")
    ax.set_xlabel("step")
    ax.set_ylabel("Bradley-Terry loss")
    ax.legend()
    return _save(fig, path)
