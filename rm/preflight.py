"""Before anything loads: the settings validated into a plan, and the estimated peak checked against the device.

What this resolves (the hardware of ``hardware=auto``, the micro-batch ``preflight.auto_micro_batch`` picks)
goes into the :class:`~rm.validate.Plan`; the config stays as composed.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

from rm.config import RunConfig
from rm.errors import Refused
from rm.estimate import estimate_label, format_suggestions, format_table
from rm.memory.estimate import Estimate, best_micro_batch, estimate_run, suggestions
from rm.validate import Plan, resolve_world_size, validate

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
        ConfigError: the settings do not make a run.
        PreflightRefusal: the estimate does not fit, with ``preflight=error``.
    """
    plan = validate(cfg, *resolve_world_size(cfg, launched=True))
    return preflight(cfg, plan, overrides)


def preflight(cfg: RunConfig, plan: Plan, overrides: Sequence[str]) -> Tuple[Plan, Optional[Estimate]]:
    """Estimate the peak before anything loads; refuse, warn, or pick the micro-batch, as configured.

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
            plan = validate(cfg, plan.world_size, plan.world_size_source, micro_batch_size=micro)
    est = estimate_run(cfg, plan)
    table = format_table(est, estimate_label(cfg, plan))
    if est.fits:
        log.info("%s", table)
        return plan, est
    found = suggestions(list(overrides), cfg, plan)
    advice = format_suggestions(found)
    if cfg.preflight.mode == "error":
        raise PreflightRefusal(f"{table}\n{advice}\n(preflight=warn trains anyway; preflight=off skips the check)", est,
                               [" ".join(extra) for extra, _ in found])
    log.warning("%s\n%s\npreflight=warn: training anyway", table, advice)
    return plan, est
