"""Before anything loads: the settings validated into a plan, and the estimated peak checked against the device.

What this resolves (the hardware of ``hardware=auto``, the micro-batch ``preflight.auto_micro_batch`` picks)
goes into the :class:`~rm.settings.validate.Plan`; the config stays as composed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from rm.foundations.config import RunConfig
from rm.foundations.errors import Refused
from rm.foundations.cli import DETAIL
from rm.memory.terms import Estimate, cannot_fit, estimate_run, worst_case_shapes
from rm.memory.report import estimate_label, format_table
from rm.memory.suggest import best_micro_batch, format_suggestions, suggestions
from rm.foundations.threads import apply_threads
from rm.settings.validate import ConfigError, Plan, resolve_world_size, validate

if TYPE_CHECKING:
    from rm.data.shapes import BatchShapes

log = logging.getLogger("rm.train")  # these lines belong to the training command's log


class PreflightRefusal(Refused):
    """The estimated peak exceeds device memory; the message holds the breakdown and what would fit."""

    def __init__(self, message: str, estimate, fits=()):
        super().__init__(message)
        self.estimate = estimate
        self.fits = list(fits)  # override sets that would fit, cheapest first


def plan_run(cfg: RunConfig, overrides: Sequence[str]) -> Tuple[Plan, Optional[Estimate]]:
    """Validate ``cfg`` for the processes this launch started, then run :func:`preflight`.

    Raises:
        ConfigError: the settings do not make a run, or name a CUDA profile on a machine without CUDA.
        PreflightRefusal: the run cannot fit whatever its data, with ``preflight=error``.
    """
    plan = validate(cfg, *resolve_world_size(cfg.distributed, launched=True))
    apply_threads(plan.threads)  # before torch's first op: the estimate traces the model
    check_device_present(plan)
    return preflight(cfg, plan, overrides)


def check_device_present(plan: Plan) -> None:
    """A run trains on the device its hardware profile names. A CUDA profile where torch sees no CUDA device would
    otherwise train on the CPU under the profile's name, capacity and precision (``rm.estimate`` may still ask about
    it: it only estimates)."""
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"hardware={plan.hardware.name} is a CUDA profile, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): train with hardware=auto or hardware=cpu; "
            f"python -m rm.estimate hardware={plan.hardware.name} ... estimates the CUDA run from here")


def preflight(cfg: RunConfig, plan: Plan, overrides: Sequence[str]) -> Tuple[Plan, Optional[Estimate]]:
    """Estimate the peak before anything loads, at the worst case the config allows; pick the micro-batch with
    ``preflight.auto_micro_batch``; refuse or warn only where no data could fit (:func:`cannot_fit`). The
    run's verdict is :func:`data_preflight`'s, once the data is built.

    ``overrides`` are the Hydra overrides the config came from: candidate changes are composed
    with them to say which would fit.

    Returns:
        ``(plan, estimate)``; the plan is re-derived with the micro-batch ``preflight.auto_micro_batch``
        picked. ``estimate`` is ``None`` with ``preflight=off``.
    """
    for warning in plan.warnings:
        log.warning("%s", warning)
    if cfg.preflight.mode == "off":
        return plan, None
    if cfg.preflight.auto_micro_batch:
        micro = best_micro_batch(list(overrides), cfg, plan)
        if micro is not None and micro != plan.micro_batch_size:
            log.info("preflight.auto_micro_batch: train.micro_batch_size %d -> %d (the global batch stays %d)",
                     plan.micro_batch_size, micro, cfg.train.global_batch_size)
            overrides = [*overrides, f"train.micro_batch_size={micro}"]
            plan = validate(cfg, plan.world_size, plan.world_size_source, plan.launcher, micro_batch_size=micro)
    est = estimate_run(cfg, plan)
    table = format_table(est, estimate_label(cfg.model, cfg.memory_profile, plan))
    if est.fits:
        log.info("%s", table, extra=DETAIL)  # for the log file: the run summary gives the data-sized peak
        return plan, est
    if not cannot_fit(cfg, plan):
        # The worst case the config allows bounds the data's largest micro-batch from above, so refusing (or
        # warning) here could refuse a run that fits; the verdict waits for the data (data_preflight), unless
        # the step's weights, gradients and states alone exceed the device, which no data can change.
        log.info("%s\nthe worst case the config allows does not fit: the data's own micro-batches decide, "
                 "once the data is built", table, extra=DETAIL)
        return plan, est
    return plan, refuse_or_warn(cfg, plan, overrides, est, table)


def data_preflight(cfg: RunConfig, plan: Plan, overrides: Sequence[str], shapes: Sequence["BatchShapes"],
                   random_init_cached: bool = False) -> Optional[Estimate]:
    """The run's verdict: each rank's estimate sized at the largest micro-batch and evaluation forward its data
    forms (:func:`rm.data.shapes.data_shapes`), and the largest of them; refuses, warns or passes as
    :func:`preflight` does. Every rank computes every rank's estimate, so all reach the same verdict.

    Args:
        shapes: per rank, in rank order.
        random_init_cached: QLoRA from a shape: every process found its random init saved, so none builds it
            (:func:`rm.memory.terms.estimate_run`).

    Returns:
        The largest rank's data-aware estimate, with every rank's peak in ``rank_peak_bytes`` (``memory.json``'s),
        or ``None`` with ``preflight=off``.

    Raises:
        PreflightRefusal: it does not fit, with ``preflight=error``.
    """
    if cfg.preflight.mode == "off":
        return None
    ranks = [estimate_run(cfg, plan, s, rank=r if len(shapes) > 1 else None, random_init_cached=random_init_cached)
             for r, s in enumerate(shapes)]
    est = dataclasses.replace(max(ranks, key=lambda e: e.peak_bytes), rank_peak_bytes=[e.peak_bytes for e in ranks])
    worst = worst_case_shapes(cfg.train, cfg.data, plan).train
    train = est.shapes["train"]  # BatchShapes.to_dict
    log.info("memory estimate sized by the data: longest micro-batch %d rows x %d tokens on rank %d (max_length allows "
             "%d x %d): peak %.1f MiB of %.1f usable%s", train["rows"], train["length"], est.rank or 0, worst.rows, worst.length,
             est.peak_bytes / 2**20, est.usable_bytes / 2**20,
             "" if len(ranks) == 1 else " (ranks: " + ", ".join(f"{e.peak_bytes / 2**20:.1f}" for e in ranks) + " MiB)",
             extra=DETAIL)
    if est.fits:
        return est
    table = format_table(est, estimate_label(cfg.model, cfg.memory_profile, plan) + ", sized by the data's longest micro-batch")
    return refuse_or_warn(cfg, plan, overrides, est, table)


def refuse_or_warn(cfg: RunConfig, plan: Plan, overrides: Sequence[str], est: Estimate, table: str) -> Estimate:
    """An estimate that does not fit: :class:`PreflightRefusal` with ``preflight=error``, else a warning.

    The changes offered are sized at the worst case the config allows: each fits whatever the data.
    """
    found = suggestions(list(overrides), cfg, plan)
    advice = format_suggestions(found)
    if cfg.preflight.mode == "error":
        raise PreflightRefusal(f"refusing to start: the estimated peak does not fit in device memory\n{table}\n{advice}\n"
                               "(preflight=warn trains anyway; preflight=off skips the check)", est,
                               [" ".join(extra) for extra, _ in found])
    log.warning("%s\n%s\npreflight=warn: training anyway", table, advice)
    return est
