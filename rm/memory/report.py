"""The estimate for people: the table ``rm.estimate`` prints and the pre-flight check logs or refuses with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rm.foundations.config import MemoryProfileConfig, ModelConfig
from rm.memory.terms import GIB, Estimate
from rm.foundations.precision import SHORT

if TYPE_CHECKING:
    from rm.settings.validate import Plan


def estimate_label(model_cfg: ModelConfig, profile: MemoryProfileConfig, plan: Plan) -> str:
    """What the estimate is of, for its table's first line."""
    return (f"{model_cfg.name}, memory_profile={profile.name}, train.precision={plan.precision}, "
            f"{plan.world_size} process(es), hardware={plan.hardware.name}")


def format_table(est: Estimate, label: str) -> str:
    """The estimate as a table for people: tensors, then what the device adds, then the verdict."""
    rows = [
        ("weights", est.weights), ("gradients", est.gradients), ("optimizer states", est.optimizer_states),
        ("activations (peak)", est.activations), ("temporaries", est.temporaries),
        ("evaluation forward", est.evaluation), ("overhead", est.overhead),
    ]
    if est.random_init_build:  # a phase of its own, before the rest: the first run of a QLoRA shape without weights
        rows.append(("random init built first (fp32)", est.random_init_build))
    # The device terms, marked where no GPU measurement backs them (benchmarks/results/memory_calibration_gpu.md).
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
                 + (f"   headroom {est.headroom_bytes / scale:.2f} (hardware.headroom_gib)" if unit == "GiB" else
                    # the key is in GiB, the table in MiB: both, so that neither is read as the other
                    f"   headroom {est.headroom_bytes / scale:.2f} MiB (hardware.headroom_gib="
                    f"{est.headroom_bytes / GIB:.3g})"))
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
    short = {**SHORT, "nf4": "4-bit NF4"}
    master = f" + {short[numerics['master']]} master copy" if numerics["master"] else ""
    compute = short[numerics["compute"]] + (" (autocast)" if numerics["autocast"] else "")
    return (f"{precision}: trained weights {short[numerics['weights']]}{master}, optimizer states "
            f"{short[numerics['states']]}, frozen weights {short[numerics['frozen']]}, compute {compute}")
