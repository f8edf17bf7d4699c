"""Which changes would make a refused run fit: candidate overrides, cheapest first, each validated and estimated
again (:mod:`rm.memory.terms`), two at a time where a second core and ``fork`` allow.

:func:`suggestions` is what ``rm.estimate`` and the pre-flight refusal print (:func:`format_suggestions`);
:func:`best_micro_batch` is what ``train.micro_batch_size=auto`` resolves to.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from rm.foundations.config import MemoryProfileConfig, RunConfig, TrainConfig, memory_profiles
from rm.memory.terms import GIB, Estimate, cannot_fit, estimate_run

if TYPE_CHECKING:
    from rm.settings.validate import Plan


def candidate_overrides(train_cfg: TrainConfig, profile: MemoryProfileConfig, plan: Plan, peak_phase: str,
                        base_overrides: Sequence[str] = ()) -> List[List[str]]:
    """Changes that may fit, cheapest first (least slowdown, model unchanged, before other trade-offs).

    Args:
        train_cfg, profile: the run's ``train`` and ``memory_profile`` groups.
        base_overrides: the command line the config came from; its ``hydra.searchpath`` finds the memory profiles.
    """
    t, world = train_cfg, plan.world_size
    out: List[List[str]] = []
    # A smaller evaluation batch changes the evaluation phase alone: it helps only a run that peaks there.
    evals = t.eval_batch_size // 2 if peak_phase == "evaluation" else 0
    while evals >= 1:  # costs nothing but a little evaluation speed
        out.append([f"train.eval_batch_size={evals}"])
        evals //= 4
    if not t.gradient_checkpointing:
        out.append(["train.gradient_checkpointing=true"])
    micro = plan.micro_batch_size // 2
    while micro >= 1:
        if t.global_batch_size % (micro * world) == 0:
            # Evaluation forwards no larger than the training ones, or they become the peak.
            cap = [f"train.eval_batch_size={micro}"] if t.eval_batch_size > micro else []
            out.append([f"train.micro_batch_size={micro}", *cap])
        micro //= 2
    if world > 1 and plan.strategy != "deepspeed" and profile.optimizer != "adamw_8bit":
        out += [["distributed=zero2"], ["distributed=zero3"]]
    elif plan.strategy == "deepspeed" and plan.zero_stage < 3:
        out.append(["distributed=zero3"])
    for other in memory_profiles(base_overrides):  # in their order, the cheapest trade first
        if other.name != profile.name and trades_memory(other):
            out.append([f"memory_profile={other.name}"])
    if not t.gradient_checkpointing and profile.name != "lora":  # with the cheapest memory-saving profile
        out.append(["memory_profile=lora", "train.gradient_checkpointing=true"])
    return out


def trades_memory(profile: MemoryProfileConfig) -> bool:
    """Whether a profile gives up anything for memory: one that keeps every default of the schema (``full``) holds
    the most a run can, so it never makes a refused run fit."""
    return replace(profile, order=0) != MemoryProfileConfig(name=profile.name, order=0)


def with_overrides(cfg: RunConfig, base_overrides: List[str], extra: List[str]) -> RunConfig:
    """``cfg`` changed by ``extra``: merged into the typed config when every override sets a key (a
    fraction of a millisecond), composed again from ``conf/`` when one picks a group's option (Hydra's
    defaults list, about 0.2 s)."""
    if all("." in override.split("=", 1)[0] for override in extra):
        from omegaconf import OmegaConf

        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(extra))))
    from rm.foundations.config import compose

    return compose([*base_overrides, *extra])


def suggestions(base_overrides: List[str], cfg: RunConfig, plan: Plan, limit: int = 5):
    """Up to ``limit`` override sets that pass validation and fit, each with its estimate."""
    from rm.settings.validate import ConfigError, validate

    peak_phase = estimate_run(cfg, plan).peak_phase  # its traces are cached: arithmetic only
    jobs = []
    for extra in candidate_overrides(cfg.train, cfg.memory_profile, plan, peak_phase, base_overrides):
        try:
            candidate = with_overrides(cfg, base_overrides, extra)
            candidate_plan = validate(candidate, plan.world_size, plan.world_size_source, plan.launcher)
        except ConfigError:
            continue
        if not cannot_fit(candidate, candidate_plan):  # refused whatever its activations: no trace needed
            jobs.append((extra, candidate, candidate_plan))
    estimates = estimate_each([(candidate, candidate_plan) for _, candidate, candidate_plan in jobs])
    return [(extra, est) for (extra, _, _), est in zip(jobs, estimates) if est is not None and est.fits][:limit]


_JOBS: List[Tuple[RunConfig, Plan]] = []  # what forked workers of estimate_each read (inherited, not pickled)


def _estimate_job(index: int) -> Optional[Estimate]:
    try:
        return estimate_run(*_JOBS[index])
    except ValueError:  # e.g. an attention implementation the trace cannot run
        return None


def estimate_each(jobs: List[Tuple[RunConfig, Plan]]) -> List[Optional[Estimate]]:
    """The estimate of each (config, plan), ``None`` where it cannot be traced.

    A trace is single-threaded Python (fake tensors dispatch op by op), so with several candidates and a
    second core the work is shared by two forked processes, which inherit the imports and the traces
    already cached. Not where fork is unsafe: without it (macOS, Windows), or once CUDA is initialised.
    """
    global _JOBS
    import multiprocessing
    import os

    import torch

    forkable = "fork" in multiprocessing.get_all_start_methods() and not torch.cuda.is_initialized()
    if len(jobs) < 2 or (os.cpu_count() or 1) < 2 or not forkable:
        _JOBS = jobs
        try:
            return [_estimate_job(i) for i in range(len(jobs))]
        finally:
            _JOBS = []
    _JOBS = jobs
    try:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            return pool.map(_estimate_job, range(len(jobs)), chunksize=1)
    finally:
        _JOBS = []


def best_micro_batch(base_overrides: List[str], cfg: RunConfig, plan: Plan) -> Optional[int]:
    """The largest micro-batch (dividing the global batch per process) whose estimate fits."""
    from rm.settings.validate import validate

    per_process = cfg.train.global_batch_size // plan.world_size
    for micro in sorted((d for d in range(1, per_process + 1) if per_process % d == 0), reverse=True):
        candidate = with_overrides(cfg, base_overrides, [f"train.micro_batch_size={micro}"])
        candidate.train.eval_batch_size = cfg.train.eval_batch_size
        if estimate_run(candidate, validate(candidate, plan.world_size, plan.world_size_source, plan.launcher)).fits:
            return micro
    return None


def format_suggestions(found) -> str:
    if not found:
        return "no single change found that fits; try a larger device (hardware=...) or more GPUs"
    lines = ["changes that fit (cheapest first):"]
    for extra, est in found:
        unit, scale = ("GiB", GIB) if est.usable_bytes >= 4 * GIB else ("MiB", 1024**2)
        lines.append(f"  {' '.join(extra):<58} peak {est.peak_bytes / scale:8.2f} {unit} of {est.usable_bytes / scale:.2f}")
    return "\n".join(lines)
