"""Pre-flight memory estimate: what one device will hold at the peak of a training step.

    python -m rm.estimate [the same overrides as rm.train]       # a table
    python -m rm.estimate estimate.json=true ...                 # JSON on stdout

Weights, gradients and optimizer states are arithmetic on exact parameter counts
(from the model's shape numbers; no weights are read). Activations come from
tracing one real decoder layer with fake tensors (``rm.activations``), which
follows the transformers implementation exactly. Terms not yet calibrated on a
GPU (the CUDA context) or at all (DeepSpeed ZeRO-3 buffers) are reported as such.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

from rm.config import LoraConfig, ModelConfig, RunConfig
from rm.engine import DEEPSPEED_BUCKET
from rm.validate import Plan

GIB = 1024**3
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Not yet measured on a GPU (no GPU was available): the CUDA context and cuBLAS workspaces.
CUDA_CONTEXT_BYTES = 1 * GIB


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter the training process holds (LoRA: base + adapters + head copy)
    trainable: int
    base: int  # the plain model
    largest_layer: int  # one decoder layer: what ZeRO-3 gathers at once
    trainable_tensors: List[int] = field(default_factory=list)  # numel of each trainable tensor


def _linear_shapes(m: ModelConfig) -> Dict[str, tuple]:
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * head_dim, m.num_key_value_heads * head_dim
    bias = m.model_type == "qwen2"  # Qwen2 has biases on q/k/v
    h, i = m.hidden_size, m.intermediate_size
    return {
        "q_proj": (h, q, bias), "k_proj": (h, kv, bias), "v_proj": (h, kv, bias), "o_proj": (q, h, False),
        "gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False),
    }


def parameter_counts(m: ModelConfig, lora: Optional[LoraConfig]) -> ParameterCounts:
    """Exact parameter counts of ``AutoModelForSequenceClassification`` (one label) for Mistral/Llama/Qwen2.

    Example (the tiny model: embedding 512x128, two layers of 147,712, final norm, score head):
        >>> from rm.config import ModelConfig
        >>> m = ModelConfig(name="t", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
        >>> parameter_counts(m, None).total
        361216
    """
    shapes = _linear_shapes(m)
    h = m.hidden_size
    layer_tensors = [i * o for i, o, _ in shapes.values()] + [o for _, o, b in shapes.values() if b] + [h, h]
    layer = sum(layer_tensors)
    base = m.vocab_size * h + m.num_hidden_layers * layer + h + h  # embedding, layers, final norm, score (h x 1)
    if lora is None:
        tensors = [m.vocab_size * h] + layer_tensors * m.num_hidden_layers + [h, h]
        return ParameterCounts(base, base, base, layer, tensors)
    adapter = [lora.r * n for name in lora.target_modules if name in shapes for n in shapes[name][:2]]
    adapters = m.num_hidden_layers * sum(adapter)
    # PEFT's modules_to_save keeps the original head and trains a copy of it.
    tensors = adapter * m.num_hidden_layers + [h]
    return ParameterCounts(base + adapters + h, adapters + h, base, layer, tensors)


def adamw_state_bytes(tensor_numels: List[int], state_bytes: int, eight_bit: bool) -> int:
    """Bytes of AdamW's two moment buffers for these tensors.

    bitsandbytes' 8-bit AdamW keeps uint8 moments with one fp32 scale per 256-element block
    for each, plus two 256-entry fp32 code maps per tensor; tensors under 4096 elements keep
    fp32 moments.

    >>> adamw_state_bytes([1024 * 1024], state_bytes=4, eight_bit=False)
    8388608
    >>> adamw_state_bytes([1024 * 1024, 128], state_bytes=4, eight_bit=True)   # 2 MiB + scales + maps; 128 fp32
    2132992
    """
    if not eight_bit:
        return 2 * state_bytes * sum(tensor_numels)
    total = 0
    for n in tensor_numels:
        total += 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4 if n >= 4096 else 8 * n
    return total


@dataclass
class Estimate:
    """Per-device bytes at the peak, and the verdict."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    evaluation: int  # the peak of one scoring forward at train.eval_batch_size, above the weights
    temporaries: int
    overhead: int
    peak_bytes: int
    peak_phase: str
    usable_bytes: int
    fits: bool
    host_ram_bytes_per_node: int
    params_total: int
    params_trainable: int
    uncalibrated: List[str]

    def to_dict(self) -> Dict:
        return asdict(self)


def estimate_run(cfg: RunConfig, plan: Plan) -> Estimate:
    """The estimate for a validated config (``cfg.hardware`` already resolved)."""
    from rm.activations import estimate_activations, inference_peak_bytes, shape_from_model_config
    from rm.model import DTYPES, weight_dtype

    m, t, profile = cfg.model, cfg.train, cfg.memory_profile
    lora = cfg.lora if profile.use_lora else None
    counts = parameter_counts(m, lora)
    n, stage = plan.world_size, plan.zero_stage
    wbytes = 2 if weight_dtype(plan.precision) != DTYPES["fp32"] else 4
    uncalibrated: List[str] = []

    # Weights: the base in the weight dtype (4-bit NF4 for linear layers under QLoRA), adapters in fp32.
    if lora is None:
        weights = counts.base * wbytes
        trained_bytes = wbytes
    else:
        base_bytes = counts.base * wbytes
        if profile.quantize_base == "nf4":
            linear = m.num_hidden_layers * sum(i * o for i, o, _ in _linear_shapes(m).values())
            # 4 bits per weight plus double-quantised block scales (about 0.127 bits per weight).
            base_bytes = (counts.base - linear) * wbytes + math.ceil(linear * 4.127 / 8)
            uncalibrated.append("4-bit NF4 weights")
        weights = base_bytes + (counts.trainable - m.hidden_size) * 4 + m.hidden_size * wbytes
        trained_bytes = 4
    if stage == 3:
        weights = weights // n
    gradients = counts.trainable * trained_bytes
    temporaries = 0
    overhead_buffers = 0  # communication and staging buffers that live as long as the engine

    # Optimizer states, where they live, and what the host keeps.
    host = 0
    if plan.strategy == "deepspeed":
        if stage == 3:
            uncalibrated.append("DeepSpeed ZeRO-3 buffers")
        shard = math.ceil(counts.trainable / n)
        states = shard * (4 + 8)  # fp32 master copy + fp32 moments, sharded from ZeRO-1 on
        bucket = min(DEEPSPEED_BUCKET, counts.trainable)  # as rm.engine.deepspeed_config sets it
        if stage >= 2:
            gradients = shard * trained_bytes
            # Two contiguous gradient buckets (overlap_comm), each allocated at full size during backward.
            temporaries += 2 * bucket * trained_bytes
        if stage == 3:
            temporaries += counts.largest_layer * wbytes  # one layer gathered at a time
        if profile.offload_optimizer:
            # ZeRO-Offload: gradients leave the device through the buckets. The host keeps, next to
            # master weights and moments, the fp32 gradient partition, a weight-dtype copy of the
            # partition for the upload, per-parameter accumulation buffers when accumulating, and a
            # staging buffer the size of the largest parameter; the device keeps its twin.
            largest = max(counts.trainable_tensors) * trained_bytes
            gradients = 0
            states += shard * (4 + trained_bytes) + largest
            if plan.gradient_accumulation_steps > 1:
                states += shard * trained_bytes
            overhead_buffers = largest
            if plan.device == "cuda":
                host = plan_procs_per_node(cfg, plan) * states
                states = 0
    else:
        states = adamw_state_bytes(counts.trainable_tensors, trained_bytes, profile.optimizer == "adamw_8bit")

    # Activations of one micro-batch (2 sequences per pair), padded to max_length as the worst case.
    # Packed (train.packing): one row of at most the token budget, or of micro-batch x 2 x max_length.
    batch, seq_len = 2 * t.micro_batch_size, cfg.data.max_length
    accumulating = plan.gradient_accumulation_steps > 1
    if t.packing:
        batch, seq_len = 1, t.max_tokens_per_micro_batch or 2 * t.micro_batch_size * cfg.data.max_length
        # A budget smaller than the step's pairs at max_length may cut the step into several micro-batches.
        accumulating = accumulating or seq_len < 2 * (t.global_batch_size // n) * cfg.data.max_length
    if t.share_prefix:
        batch, seq_len = shared_prefix_rows(t.micro_batch_size, cfg.data.max_length, t.max_tokens_per_micro_batch, t.packing)
    act = estimate_activations(
        shape_from_model_config(m),
        m.num_hidden_layers,
        batch=batch,
        seq_len=seq_len,
        dtype=weight_dtype(plan.precision),
        gradient_checkpointing=t.gradient_checkpointing,
        # Neither can be traced on the CPU; SDPA's footprint bounds flex-attention's (a BlockMask, not T x T).
        attn_implementation=m.attn_implementation if m.attn_implementation not in ("flash_attention_2", "flex_attention") else "sdpa",
        lora_r=lora.r if lora else 0,
        lora_targets=tuple(lora.target_modules) if lora else (),
        lora_alpha=lora.alpha if lora else 32,
        lora_dropout=lora.dropout if lora else 0.05,
        padded=True,
        accumulating=accumulating,
        packed=t.packing,
        shared_prefix=t.share_prefix,
    )
    activations = act["peak_bytes"]
    # The token ids and mask of the micro-batch (int64) stay alive through forward and backward.
    temporaries += shared_prefix_input_bytes(batch, seq_len) if t.share_prefix else 2 * batch * seq_len * 8  # packed: the ids and position ids
    evaluation = inference_peak_bytes(
        shape_from_model_config(m), 2 * t.eval_batch_size, cfg.data.max_length, weight_dtype(plan.precision),
        lora_r=lora.r if lora else 0, lora_targets=tuple(lora.target_modules) if lora else (),
        lora_alpha=lora.alpha if lora else 32, lora_dropout=lora.dropout if lora else 0.05,
    ) + 2 * (2 * t.eval_batch_size) * cfg.data.max_length * 8

    if m.pretrained:
        # from_pretrained reads the checkpoint into host memory in every process before moving it.
        host += plan_procs_per_node(cfg, plan) * counts.base * wbytes
    overhead = overhead_buffers
    usable = int(cfg.hardware.device_memory_gib * GIB)
    if plan.device == "cuda":
        overhead += CUDA_CONTEXT_BYTES
        uncalibrated.append("CUDA context")

    # The step's peak: during backward (states exist from the first step; gradients are fully
    # allocated while accumulating, and are being created while activations are freed otherwise),
    # or at the optimizer step (weights + gradients + states, activations gone).
    if accumulating:
        backward = weights + states + gradients + activations
    else:
        backward = weights + states + max(activations, gradients)
    step = weights + gradients + states
    # Evaluation runs after an optimizer step has freed the gradients (DeepSpeed keeps its partitions).
    kept_gradients = gradients if plan.strategy == "deepspeed" else 0
    phases = {
        "forward/backward": backward + temporaries,
        "optimizer step": step + temporaries,
        # DeepSpeed ZeRO-1/2 (no offload) while accumulating: at the end of a backward, a fresh gradient
        # partition is filled while the previous micro-batch's is still held (measured on CPU).
        "gradient reduction": (weights + states + 2 * gradients + temporaries
                               if plan.strategy == "deepspeed" and not profile.offload_optimizer
                               and plan.gradient_accumulation_steps > 1 else 0),
        "evaluation": weights + states + kept_gradients + evaluation,
        "load": weights,
    }
    phase = max(phases, key=phases.get)
    peak = phases[phase] + overhead
    return Estimate(
        weights=weights, gradients=gradients, optimizer_states=states, activations=activations,
        evaluation=evaluation, temporaries=temporaries, overhead=overhead, peak_bytes=peak, peak_phase=phase, usable_bytes=usable,
        fits=peak <= usable, host_ram_bytes_per_node=host, params_total=counts.total,
        params_trainable=counts.trainable, uncalibrated=uncalibrated,
    )


def shared_prefix_rows(micro_batch_size: int, max_length: int, max_tokens: int, packing: bool) -> Tuple[int, int]:
    """Rows x length of the largest prefix-shared micro-batch (``train.share_prefix``), which activations follow.

    A pair takes prefix + two suffixes, at most chosen + rejected = ``2 x max_length`` tokens (no common
    prefix), the worst case the estimate must hold. Packed: one row of the token budget, or of every pair
    of the micro-batch; otherwise one row per pair.

    >>> shared_prefix_rows(4, 512, 0, packing=False), shared_prefix_rows(4, 512, 2048, packing=True)
    ((4, 1024), (1, 2048))
    """
    if packing:
        return 1, max_tokens or 2 * micro_batch_size * max_length
    return micro_batch_size, 2 * max_length


def shared_prefix_input_bytes(rows: int, seq_len: int) -> int:
    """The int64 token ids, position ids, pair ids and roles of a prefix-shared micro-batch, alive through the step.

    The 4D mask built from them is in the activations: the trace builds it as ``rm.model`` does.
    """
    return 4 * rows * seq_len * 8


def plan_procs_per_node(cfg: RunConfig, plan: Plan) -> int:
    return min(plan.world_size, cfg.hardware.gpus_per_node)


def format_table(est: Estimate, label: str) -> str:
    """The estimate as a table for people."""
    rows = [
        ("weights", est.weights), ("gradients", est.gradients), ("optimizer states", est.optimizer_states),
        ("activations (peak)", est.activations), ("temporaries", est.temporaries),
        ("evaluation forward", est.evaluation), ("overhead", est.overhead),
    ]
    unit, scale = ("GiB", GIB) if max(est.usable_bytes, est.peak_bytes) >= 4 * GIB else ("MiB", 1024**2)
    lines = [f"memory estimate per device: {label}", f"  {'component':<26}{unit:>10}"]
    lines += [f"  {name:<26}{value / scale:>10.2f}" for name, value in rows]
    lines.append(f"  {'peak (' + est.peak_phase + ')':<26}{est.peak_bytes / scale:>10.2f}")
    lines.append(f"  {'usable':<26}{est.usable_bytes / scale:>10.2f}")
    if est.host_ram_bytes_per_node:
        lines.append(f"  {'host RAM per node':<26}{est.host_ram_bytes_per_node / scale:>10.2f}")
    lines.append(f"  parameters: {est.params_total:,} total, {est.params_trainable:,} trainable")
    lines.append(f"  verdict: {'fits' if est.fits else 'DOES NOT FIT'}")
    if est.uncalibrated:
        lines.append(f"  not yet calibrated: {', '.join(est.uncalibrated)}")
    return "\n".join(lines)


CONF_DIR = __import__("pathlib").Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: List[str]) -> RunConfig:
    """Compose ``conf/`` with overrides into typed objects, inside or outside a running Hydra app."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rm.config import to_run_config

    if GlobalHydra.instance().is_initialized():
        return to_run_config(hydra_compose(config_name="config", overrides=list(overrides)))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(hydra_compose(config_name="config", overrides=list(overrides)))


def candidate_overrides(cfg: RunConfig, plan: Plan) -> List[List[str]]:
    """Changes that may fit, cheapest first (least slowdown, model unchanged, before other trade-offs)."""
    t, world = cfg.train, plan.world_size
    out: List[List[str]] = []
    evals = t.eval_batch_size // 2
    while evals >= 1:  # costs nothing but a little evaluation speed
        out.append([f"train.eval_batch_size={evals}"])
        evals //= 4
    if not t.gradient_checkpointing:
        out.append(["train.gradient_checkpointing=true"])
    micro = t.micro_batch_size // 2
    while micro >= 1:
        if t.global_batch_size % (micro * world) == 0:
            # Evaluation forwards no larger than the training ones, or they become the peak.
            cap = [f"train.eval_batch_size={micro}"] if t.eval_batch_size > micro else []
            out.append([f"train.micro_batch_size={micro}", *cap])
        micro //= 2
    if world > 1 and plan.strategy != "deepspeed" and cfg.memory_profile.optimizer != "adamw_8bit":
        out += [["distributed=zero2"], ["distributed=zero3"]]
    elif plan.strategy == "deepspeed" and plan.zero_stage < 3:
        out.append(["distributed=zero3"])
    for profile in ("8bit", "lora", "offload", "qlora"):
        if profile != cfg.memory_profile.name:
            out.append([f"memory_profile={profile}"])
    if not t.gradient_checkpointing:  # combined with the cheapest memory-saving profile
        out.append(["memory_profile=lora", "train.gradient_checkpointing=true"])
    return out


def suggestions(base_overrides: List[str], cfg: RunConfig, plan: Plan, limit: int = 5):
    """Up to ``limit`` override sets that pass validation and fit, each with its estimate."""
    from rm.hardware import resolve_hardware
    from rm.validate import ConfigError, validate

    found = []
    for extra in candidate_overrides(cfg, plan):
        try:
            candidate = compose([*base_overrides, *extra])
            candidate.hardware = cfg.hardware if candidate.hardware.name == cfg.hardware.name else resolve_hardware(candidate.hardware)
            est = estimate_run(candidate, validate(candidate, plan.world_size))
        except (ConfigError, ValueError):
            continue
        if est.fits:
            found.append((extra, est))
        if len(found) == limit:
            break
    return found


def best_micro_batch(base_overrides: List[str], cfg: RunConfig, plan: Plan) -> Optional[int]:
    """The largest micro-batch (dividing the global batch per process) whose estimate fits."""
    from rm.validate import validate

    per_process = cfg.train.global_batch_size // plan.world_size
    for micro in sorted((d for d in range(1, per_process + 1) if per_process % d == 0), reverse=True):
        candidate = compose([*base_overrides, f"train.micro_batch_size={micro}"])
        candidate.train.eval_batch_size = cfg.train.eval_batch_size
        candidate.hardware = cfg.hardware
        if estimate_run(candidate, validate(candidate, plan.world_size)).fits:
            return micro
    return None


def main() -> None:
    import json
    import os
    import sys

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from rm.config import to_run_config
    from rm.hardware import resolve_hardware
    from rm.validate import ConfigError, validate

    @hydra.main(config_path="../conf", config_name="config", version_base="1.3")
    def run(raw) -> None:
        cfg = to_run_config(raw)
        cfg.hardware = resolve_hardware(cfg.hardware)
        try:
            plan = validate(cfg, int(os.environ.get("WORLD_SIZE", cfg.hardware.gpus_per_node if cfg.hardware.accelerator == "cuda" else 1)))
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
        est = estimate_run(cfg, plan)
        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("estimate.")]
        if cfg.estimate.json:
            print(json.dumps({**est.to_dict(), "world_size": plan.world_size}, indent=2))
        else:
            print(format_table(est, f"{cfg.model.name}, memory_profile={cfg.memory_profile.name}, "
                                    f"{plan.world_size} process(es), hardware={cfg.hardware.name}"))
            if not est.fits:
                print(format_suggestions(suggestions(overrides, cfg, plan)))
        sys.exit(0 if est.fits else 3)

    run()


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
