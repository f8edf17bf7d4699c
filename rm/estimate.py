"""The pre-flight memory estimate on the command line: what one device will hold at the peak of a step.

    python -m rm.estimate [the same overrides as rm.train]       # a table; exit 3 when it does not fit
    python -m rm.estimate estimate.json=true ...                 # JSON on stdout

The numbers come from :mod:`rm.memory.estimate`; this module composes the config, prints the table and,
when the run does not fit, the changes that would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rm.config import RunConfig
from rm.memory.estimate import GIB, Estimate, estimate_run, suggestions
from rm.precision import SHORT

if TYPE_CHECKING:  # imported where used: `--help` and config errors need no torch
    from rm.validate import Plan


def estimate_label(cfg: RunConfig, plan: Plan) -> str:
    """What the estimate is of, for its table's first line."""
    return (f"{cfg.model.name}, memory_profile={cfg.memory_profile.name}, train.precision={plan.precision}, "
            f"{plan.world_size} process(es), hardware={plan.hardware.name}")


def format_table(est: Estimate, label: str) -> str:
    """The estimate as a table for people: tensors, then what the device adds, then the verdict."""
    rows = [
        ("weights", est.weights), ("gradients", est.gradients), ("optimizer states", est.optimizer_states),
        ("activations (peak)", est.activations), ("temporaries", est.temporaries),
        ("evaluation forward", est.evaluation), ("overhead", est.overhead),
    ]
    # The device terms, marked where no GPU measurement backs them (docs/memory_calibration_gpu.md).
    mark = lambda name: " (assumed)" if any(u.startswith(name) for u in est.uncalibrated) else ""  # noqa: E731
    device_rows = [("allocator reserve" + mark("allocator reserve"), est.allocator_reserve),
                   ("CUDA context (1 GiB bound)", est.cuda_context),
                   ("NCCL process group" + mark("NCCL"), est.communication),
                   ("paged optimizer states", est.outside_allocator)]
    unit, scale = ("GiB", GIB) if max(est.usable_bytes, est.peak_bytes) >= 4 * GIB else ("MiB", 1024**2)
    lines = [f"memory estimate per device: {label}",
             f"  processes: {est.world_size} ({est.world_size_source})",
             *([f"  precision: {format_numerics(est.precision, est.numerics)}"] if est.numerics else []),
             *([format_shapes(est)] if est.shapes else []),
             f"  {'component':<36}{unit:>10}"]
    lines += [f"  {name:<36}{value / scale:>10.2f}" for name, value in rows]
    lines.append(f"  {'tensors at peak (' + est.peak_phase + ')':<36}{est.allocated_bytes / scale:>10.2f}")
    if any(value for _, value in device_rows):
        lines += [f"  {name:<36}{value / scale:>10.2f}" for name, value in device_rows if value]
    lines.append(f"  {'device total at peak':<36}{est.peak_bytes / scale:>10.2f}")
    lines.append(f"  {'usable (capacity - headroom)':<36}{est.usable_bytes / scale:>10.2f}"
                 f"   headroom {est.headroom_bytes / scale:.2f} (hardware.headroom_gib)")
    if est.host_ram_bytes_per_node:
        lines.append(f"  {'host RAM per node':<36}{est.host_ram_bytes_per_node / scale:>10.2f}")
    lines.append(f"  parameters: {est.params_total:,} total, {est.params_trainable:,} trainable")
    lines.append(f"  verdict: {'fits' if est.fits else 'DOES NOT FIT'}")
    if est.uncalibrated:
        lines.append(f"  not yet calibrated: {', '.join(est.uncalibrated)}")
    lines += [f"  warning: {warning}" for warning in est.warnings]
    return "\n".join(lines)


def format_shapes(est: Estimate) -> str:
    """What activations were sized at: the worst case the config allows, or the data's largest micro-batch."""
    train, evaluation = est.shapes["train"], est.shapes["eval"]
    source = "the data's longest" if est.sized_by == "data" else "the worst case the config allows"
    scored = f", evaluation {evaluation['rows']} x {evaluation['length']}" if evaluation else ", no evaluation"
    return f"  sized at: micro-batch {train['rows']} rows x {train['length']} tokens{scored} ({source})"


def format_numerics(precision: str, numerics: dict) -> str:
    """``bf16-mixed: trained weights fp32, AdamW states fp32, compute bf16 (autocast)``, from ``Plan.numerics``."""
    short = SHORT
    master = f" + {short[numerics['master']]} master copy" if numerics["master"] else ""
    compute = short[numerics["compute"]] + (" (autocast)" if numerics["autocast"] else "")
    return (f"{precision}: trained weights {short[numerics['weights']]}{master}, optimizer states "
            f"{short[numerics['states']]}, frozen weights {short[numerics['frozen']]}, compute {compute}")




def main() -> None:
    import contextlib
    import json
    import logging
    import sys

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from rm.cli import without_bitsandbytes, without_run_dir
    from rm.config import to_run_config
    from rm.errors import boundary, run_hydra_app

    without_run_dir()  # it only prints: no outputs/<date>/<time>/ unless hydra.run.dir is given
    without_bitsandbytes()

    @hydra.main(config_path="../conf", config_name="config", version_base="1.3")
    def run(raw) -> None:
        # stdout carries the answer alone (a table, or JSON for `| python -m json.tool`): logs and library
        # warnings (bitsandbytes, DeepSpeed, Hydra's console handler writes to stdout) go to stderr.
        answer = sys.stdout
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
                handler.setStream(sys.stderr)
        with boundary(), contextlib.redirect_stdout(sys.stderr):
            from rm.validate import resolve_world_size, validate  # here, not above: `--help` needs no torch

            cfg = to_run_config(raw)
            plan = validate(cfg, *resolve_world_size(cfg, launched=False))
            est = estimate_run(cfg, plan)
            overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("estimate.")]
            if cfg.estimate.json:
                text = json.dumps(est.to_dict(), indent=2)
            else:
                text = format_table(est, estimate_label(cfg, plan))
                if not est.fits:
                    text += "\n" + format_suggestions(suggestions(overrides, cfg, plan))
        print(text, file=answer)
        sys.exit(0 if est.fits else 3)

    run_hydra_app(run)


def format_suggestions(found) -> str:
    if not found:
        return "no single change found that fits; try a larger device (hardware=...) or more GPUs"
    lines = ["changes that fit (cheapest first):"]
    for extra, est in found:
        unit, scale = ("GiB", GIB) if est.usable_bytes >= 4 * GIB else ("MiB", 1024**2)
        lines.append(f"  {' '.join(extra):<58} peak {est.peak_bytes / scale:8.2f} {unit} of {est.usable_bytes / scale:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
