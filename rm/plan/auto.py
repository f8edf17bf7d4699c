"""``train.layout=auto``: the run takes the fastest layout :mod:`rm.plan` predicts for its own data that fits.

Why: the layout knobs decide whether the same training takes one hour or two, and no single default is right for
every data set and device (the schema's defaults ran at 1.4-1.5x TRL on HH-like data where the best exact layout
ran at 1.85-2.7x). So the run asks the plan, once its data is tokenised and before the engine or the model exist.

What is the user's: a knob set on the command line, or set by a config file to something other than its schema
default (``experiment=tiny`` sets ``train.share_prefix: true``). Those stay; ``train.layout=given`` keeps every
knob as configured. Only the knobs of :data:`rm.plan.search.KNOBS` vary; the memory profile, the precision, the
global batch, the learning rate and the distribution never do. A resumed run takes its checkpoint's layout, so
that it goes on exactly as it started. It never turns on a feature whose step time was never measured on the run's
device (:func:`rm.plan.features.unmeasured`; on a GPU today: packing, token budgets, prefix sharing, checkpointing):
the predicted gain hangs on a rate, such as the masked-attention kernels', that the datasheet figures do not give.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from rm.foundations.config import RunConfig, TrainConfig
from rm.plan.features import unmeasured
from rm.plan.lengths import PairLengths
from rm.plan.search import KNOBS, Candidate, _Timer, candidates, check_fastest, set_keys

log = logging.getLogger("rm.train")

# A layout has to be predicted this much faster than the one configured to replace it: the model's errors between
# close layouts are larger than what so small a gain would bring.
MIN_GAIN = 0.03


@dataclass(frozen=True)
class LayoutChoice:
    """What ``train.layout=auto`` decided, for the run's log and summary.

    Attributes:
        changed: the overrides it applied (``train.packing=true``), empty where it kept the layout as configured.
        kept: the knobs that are the user's, as ``key=value``.
        seconds, given_seconds: predicted seconds per optimizer step of the layout chosen and of the one configured.
        reason: why, in words.
        rates: the rates the prediction came from (None: no prediction was made).
    """

    changed: Tuple[str, ...]
    kept: Tuple[str, ...]
    seconds: Optional[float]
    given_seconds: Optional[float]
    reason: str
    rates: Optional[object] = None

    def against_run(self, measured_s: float) -> Optional[str]:
        """Where the run's measured seconds a step disagree with :attr:`seconds` (more than
        ``rm.plan.constants.DISAGREEMENT`` times): why, with the cached CPU rates dropped (``check_prediction``)."""
        from rm.plan.constants import check_prediction

        return None if self.rates is None else check_prediction(self.seconds, measured_s, self.rates)

    def describe(self) -> str:
        what = " ".join(self.changed) if self.changed else "the layout as configured"
        kept = f"; kept as set: {' '.join(self.kept)}" if self.kept else ""
        return f"train.layout=auto: {what} ({self.reason}){kept}"


def user_knobs(train_cfg: TrainConfig, overrides: Sequence[str]) -> set:
    """The layout knobs that are the user's: on the command line, or not at the schema's default."""
    defaults = TrainConfig()
    given = set_keys(overrides)
    return {key for key in KNOBS
            if key in given or getattr(train_cfg, key.split(".")[1]) != getattr(defaults, key.split(".")[1])}


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def choose_layout(cfg: RunConfig, plan, overrides: Sequence[str], lengths: PairLengths,
                  pinned: Optional[Dict] = None) -> Tuple[RunConfig, object, Optional[LayoutChoice]]:
    """The config and plan the run trains with under ``train.layout=auto``, and what was chosen.

    Args:
        cfg, plan: the config as composed and its validated :class:`rm.settings.validate.Plan` (after the pre-flight).
        overrides: the command line ``cfg`` came from.
        lengths: the run's own training pairs (:func:`rm.plan.lengths.lengths_of`).
        pinned: a resumed run's checkpoint fingerprint (:func:`rm.runs.resume.fingerprint`): its layout is taken as is.

    Returns:
        ``(cfg, plan, choice)``; ``cfg`` and ``plan`` unchanged and ``choice`` ``None`` with ``train.layout=given``.
    """
    from rm.foundations.errors import ConfigError
    from rm.plan.constants import rates_for
    from rm.settings.validate import validate

    if cfg.train.layout != "auto":
        return cfg, plan, None
    world = (plan.world_size, plan.world_size_source, plan.launcher)
    fixed = user_knobs(cfg.train, overrides)
    kept = tuple(f"{key}={_value(getattr(cfg.train, key.split('.')[1]))}" for key in KNOBS if key in fixed)
    if pinned:
        saved = {key.split(".")[1]: pinned[key] for key in KNOBS if key in pinned}
        changed = tuple(f"{k}={_value(v)}" for k, v in (("train." + k, v) for k, v in saved.items())
                        if getattr(cfg.train, k.split(".")[1]) != v)
        if not changed:
            return cfg, plan, LayoutChoice((), kept, None, None, "the checkpoint's layout, resumed")
        c_cfg = replace(cfg, train=replace(cfg.train, **saved))
        return c_cfg, validate(c_cfg, *world), LayoutChoice(changed, kept, None, None, "the checkpoint's layout, resumed")
    base = cfg
    if cfg.preflight.auto_micro_batch:  # the pre-flight already picked the micro-batch: it stays
        fixed.add("train.micro_batch_size")
        base = replace(cfg, train=replace(cfg.train, micro_batch_size=plan.micro_batch_size))
    # The memory profile and the distribution stay as they are: they change what trains, or how the ranks share it.
    try:
        rates = rates_for(plan.hardware, plan.device)
    except ConfigError as err:  # a CUDA profile that states no rates: nothing to rank layouts by
        return cfg, plan, LayoutChoice((), kept, None, None, f"the layout as configured: {err}")
    found, _ = candidates(base, (), world, fixed=fixed | {"memory_profile", "distributed"})
    # What the registry says no run on this device timed is not turned on for the user; what they configured may go.
    already = set(unmeasured(cfg.train, plan.device))
    found = [c for c in found if set(unmeasured(c.cfg.train, plan.device)) <= already]
    timer = _Timer(lengths, rates, cfg.plan.steps)
    given = Candidate([], cfg=base, plan=plan)
    given.step = timer(given)
    for c in found:
        c.step = timer(c)
    faster = sorted((c for c in found if c.step.seconds < (1 - MIN_GAIN) * given.step.seconds),
                    key=lambda c: (c.step.seconds, len(c.overrides)))
    best = check_fastest(faster, 1, lengths, given)  # in this process: a training process forks nothing
    if not best:
        why = "no layout predicted at least 3% faster fits" if faster else "no layout is predicted at least 3% faster"
        why += f" (predicted {given.step.seconds:.3g} s/step" + (f"; CPU rates {rates.measured})" if rates.measured else ")")
        return cfg, plan, LayoutChoice((), kept, given.step.seconds, given.step.seconds, why, rates)
    c = best[0]
    changed = tuple(c.overrides)
    reason = (f"predicted {c.step.seconds:.3g} s/step against {given.step.seconds:.3g} as configured, "
              f"{given.step.seconds / c.step.seconds:.2f}x; peak {c.peak_bytes / 2**20:,.0f} of "
              f"{c.usable_bytes / 2**20:,.0f} MiB usable" + (f"; CPU rates {rates.measured}" if rates.measured else ""))
    return c.cfg, c.plan, LayoutChoice(changed, kept, c.step.seconds, given.step.seconds, reason, rates)


def layout_overrides(choice: Optional[LayoutChoice]) -> List[str]:
    """The overrides a choice applied: what the pre-flight composes its candidate changes with."""
    return list(choice.changed) if choice else []
