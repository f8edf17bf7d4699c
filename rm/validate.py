"""The one check of a run's settings before anything heavy, and the values it derives."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import List

from rm.config import ALL_LINEAR, RunConfig
from rm.data.preference import DUPLICATES, FORMATS, IDENTICAL_PAIRS, ON_MALFORMED, TRUNCATION
from rm.diagnostics import eval_keys

CHOICES = {
    "model.model_type": ("mistral", "llama", "qwen2"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flex_attention"),
    "memory_profile.optimizer": ("adamw", "adamw_8bit"),
    "memory_profile.quantize_base": ("none", "nf4"),
    "distributed.strategy": ("auto", "ddp", "deepspeed"),
    "hardware.accelerator": ("cuda", "cpu", "auto"),
    "data.source": ("hub", "local", "synthetic"),
    # The data policies are defined (and documented) once, in rm.data.preference.
    "data.format": FORMATS,
    "data.truncation": TRUNCATION,
    "data.identical_pairs": IDENTICAL_PAIRS,
    "data.duplicates": DUPLICATES,
    "data.on_malformed": ON_MALFORMED,
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.lr_scheduler_type": ("linear", "cosine", "constant_with_warmup"),
    "preflight.mode": ("error", "warn", "off"),
    "sweep.on_failure": ("raise", "continue"),
    "health.on_nonfinite": ("stop", "skip"),
}


class ConfigError(ValueError):
    """Settings that cannot work together; the message names every offending key."""


@dataclass(frozen=True)
class Plan:
    """Values derived from the config, computed once and logged at start."""

    world_size: int
    gradient_accumulation_steps: int
    precision: str  # bf16 | fp16 | fp32, after resolving "auto"
    device: str  # cuda | cpu
    strategy: str  # ddp | deepspeed, after resolving "auto" (ddp also covers a single process)
    zero_stage: int  # 0 unless strategy is deepspeed
    max_tokens_per_step: int  # global batch x 2 sequences x max_length


def _lookup(cfg: RunConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig, world_size: int) -> Plan:
    """Reject inconsistent settings and derive what the run needs.

    ``cfg.hardware`` must already be resolved (``rm.hardware.resolve_hardware``).

    Args:
        cfg: the typed run config.
        world_size: number of training processes.

    Returns:
        The derived :class:`Plan`.

    Raises:
        ConfigError: listing every problem found, one per line, each naming its keys.
    """
    errors: List[str] = []
    for key, allowed in CHOICES.items():
        value = _lookup(cfg, key)
        if value not in allowed:
            errors.append(f"{key}={value!r} is not one of {', '.join(allowed)}")

    t, d, hw = cfg.train, cfg.data, cfg.hardware
    positive = {
        "train.micro_batch_size": t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "train.eval_batch_size": t.eval_batch_size,
        "train.learning_rate": t.learning_rate,
        "data.max_length": d.max_length,
        "hardware.nodes": hw.nodes,
        "hardware.time_limit_min": hw.time_limit_min,
    }
    if cfg.memory_profile.use_lora:
        positive["lora.r"] = cfg.lora.r
        positive["lora.alpha"] = cfg.lora.alpha
    for key, value in positive.items():
        if not value > 0:
            errors.append(f"{key}={value} must be > 0")
    for key in ("logging_steps", "eval_steps", "save_steps", "save_total_limit", "dataloader_num_workers"):
        if getattr(t, key) < 0:
            errors.append(f"train.{key}={getattr(t, key)} must be >= 0")
    if t.max_steps <= 0 and not t.num_train_epochs > 0:
        errors.append(f"train.max_steps={t.max_steps} and train.num_train_epochs={t.num_train_epochs}: set one > 0")
    h = cfg.health
    for key in ("ln2_steps", "ln2_tolerance", "chance_after_steps", "chance_tolerance", "max_abs_reward"):
        if getattr(h, key) < 0:
            errors.append(f"health.{key}={getattr(h, key)} must be >= 0")
    if h.max_consecutive_skips < 1:
        errors.append(f"health.max_consecutive_skips={h.max_consecutive_skips} must be >= 1")
    if not 0 <= t.warmup_ratio < 1:
        errors.append(f"train.warmup_ratio={t.warmup_ratio} must be in [0, 1)")
    if t.max_tokens_per_micro_batch and not t.packing:
        errors.append(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} needs train.packing=true")
    # A budget below one pair of max_length would let a pair exceed it: then the estimate, which follows the budget, is no bound.
    if t.max_tokens_per_micro_batch and t.max_tokens_per_micro_batch < 2 * d.max_length:
        errors.append(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} must be 0 or >= 2 x data.max_length"
                      f" = {2 * d.max_length}, so that every pair fits in one micro-batch")
    if t.share_prefix and cfg.model.attn_implementation == "flash_attention_2":  # its kernel takes no custom mask
        errors.append("train.share_prefix=true needs a custom attention mask, which model.attn_implementation="
                      "flash_attention_2 cannot take: use sdpa (CPU), flex_attention (GPU) or eager")
    if cfg.memory_profile.use_lora and not cfg.lora.target_modules:
        errors.append("lora.target_modules is empty: name at least one module, e.g. [q_proj, v_proj]")
    unknown = [m for m in cfg.lora.target_modules if m not in ALL_LINEAR] if cfg.memory_profile.use_lora else []
    if unknown:
        errors.append(
            f"lora.target_modules: {', '.join(unknown)} is not a linear layer of model_type={cfg.model.model_type}; "
            f"accepted: {', '.join(ALL_LINEAR)}"
        )

    accumulation = 0
    per_step = t.micro_batch_size * world_size
    if per_step > 0 and t.global_batch_size > 0:
        if t.global_batch_size % per_step:
            errors.append(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={t.micro_batch_size} x world size {world_size} = {per_step}"
            )
        accumulation = t.global_batch_size // per_step

    if d.max_length > cfg.model.max_position_embeddings:
        errors.append(
            f"data.max_length={d.max_length} exceeds model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings} of model={cfg.model.name}"
        )
    if d.source == "local" and not d.train_files:
        errors.append("data.source=local needs data.train_files, e.g. data.train_files=[pairs.jsonl]")
    if d.source == "hub" and not d.path:
        errors.append("data.source=hub needs data.path, e.g. data.path=Anthropic/hh-rlhf")
    _check_extra_eval_files(d.extra_eval_files, errors)
    if cfg.model.pretrained is None and cfg.model.tokenizer is None:
        errors.append(f"model={cfg.model.name} has neither model.pretrained nor model.tokenizer: name a tokenizer")

    device = "cpu" if hw.accelerator == "cpu" else "cuda"
    precision = t.precision
    if precision == "auto":
        precision = "bf16" if (device == "cuda" and hw.bf16) else "fp32"
    if precision == "bf16" and not hw.bf16:
        errors.append(f"train.precision=bf16 but hardware={hw.name} has no bf16 (hardware.bf16=false): use fp32 or fp16")
    if precision == "fp16" and device == "cpu":
        errors.append(f"train.precision=fp16 needs a GPU; hardware={hw.name} is a CPU: use fp32")

    strategy, zero_stage = _check_profile_and_distribution(cfg, device, errors)
    if t.packing and strategy == "deepspeed":  # DeepSpeed fixes the micro-batches per step; packed steps vary
        errors.append("train.packing=true does not work with distributed.strategy=deepspeed: use ddp, or train.packing=false")

    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
    return Plan(
        world_size=world_size,
        gradient_accumulation_steps=accumulation,
        precision=precision,
        device=device,
        strategy=strategy,
        zero_stage=zero_stage,
        max_tokens_per_step=t.global_batch_size * 2 * d.max_length,
    )


def _check_extra_eval_files(extra_eval_files, errors: List[str]) -> None:
    """Each name must make metric keys of its own: ``eval_<name>_...`` may not collide with another set's keys."""
    owners = {key: "the main eval set" for key in eval_keys("eval_")}
    for name, files in extra_eval_files.items():
        key = f"data.extra_eval_files.{name}"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name):
            errors.append(f"{key}: a name is letters, digits, '_' and '-', starting with a letter or digit")
        if not files:
            errors.append(f"{key} lists no file: give at least one jsonl / json / parquet path")
        keys = eval_keys(f"eval_{name}_")
        clash = next((k for k in keys if k in owners), None)
        if clash:
            errors.append(f"{key}: its metric {clash} is also a metric of {owners[clash]}; pick another name")
        owners.update({k: key for k in keys})


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _check_profile_and_distribution(cfg: RunConfig, device: str, errors: List[str]):
    """Resolve ``distributed.strategy=auto`` and reject profile/strategy pairs that cannot work."""
    profile, dist, hw = cfg.memory_profile, cfg.distributed, cfg.hardware
    strategy = dist.strategy
    if strategy == "auto":
        strategy = "deepspeed" if profile.offload_optimizer else "ddp"
    zero_stage = dist.zero_stage if strategy == "deepspeed" else 0

    if strategy == "deepspeed":
        if zero_stage not in (1, 2, 3):
            errors.append(f"distributed.zero_stage={dist.zero_stage} must be 1, 2 or 3 with distributed.strategy=deepspeed")
        if not _installed("deepspeed"):
            errors.append(f"distributed={dist.name} needs DeepSpeed: pip install 'rm-reward[deepspeed]'")
    if profile.offload_optimizer and strategy != "deepspeed":
        errors.append(
            f"memory_profile={profile.name} offloads the optimizer through DeepSpeed ZeRO-Offload, but "
            f"distributed={dist.name} uses {strategy}: use distributed=zero2 (or zero3, or auto)"
        )
    if dist.offload_params and not (strategy == "deepspeed" and zero_stage == 3):
        errors.append(f"distributed.offload_params=true needs ZeRO-3 (distributed=zero3_offload), got distributed={dist.name}")
    if profile.optimizer == "adamw_8bit":
        if not _installed("bitsandbytes"):
            errors.append(f"memory_profile={profile.name} needs bitsandbytes: pip install 'rm-reward[bnb]'")
        if strategy == "deepspeed":
            errors.append(
                f"memory_profile={profile.name} (bitsandbytes 8-bit AdamW) with distributed={dist.name}: ZeRO does not "
                "shard bitsandbytes' quantised states; use distributed=ddp, or memory_profile=offload / full with ZeRO"
            )
    if profile.quantize_base != "none":
        if device != "cuda":
            errors.append(
                f"memory_profile={profile.name} loads the base in 4-bit through bitsandbytes, which needs a CUDA GPU; "
                f"hardware={hw.name} is a CPU: use memory_profile=lora"
            )
        if not profile.use_lora:
            errors.append(f"memory_profile.quantize_base={profile.quantize_base} needs memory_profile.use_lora=true (a 4-bit base cannot train)")
        if cfg.model.pretrained is None:
            errors.append(f"memory_profile={profile.name} quantises pretrained weights; model={cfg.model.name} has none")
        if strategy == "deepspeed" and zero_stage == 3:
            errors.append(f"memory_profile={profile.name} with distributed={dist.name}: ZeRO-3 cannot shard 4-bit weights")
        if not _installed("bitsandbytes"):
            errors.append(f"memory_profile={profile.name} needs bitsandbytes: pip install 'rm-reward[bnb]'")
    return strategy, zero_stage
