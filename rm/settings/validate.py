"""The one check of a run's settings before anything heavy, and the values it derives."""

from __future__ import annotations

import importlib.machinery
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import List, NamedTuple, Sequence, Tuple

from typing import Optional

from rm.foundations.config import ALL_LINEAR, DUPLICATES, MAX_PAIRS_TRAINED, FORMATS, IDENTICAL_PAIRS, ON_MALFORMED, TRUNCATION, DistributedConfig, HardwareConfig, MemoryProfileConfig, ModelConfig, RunConfig, TrainConfig
from rm.foundations.errors import ConfigError  # noqa: F401  (raised here; imported from here by callers)
from rm.foundations.hardware import resolve_hardware
from rm.foundations.launch_env import launch_env
from rm.foundations.threads import Threads, choose_threads
from rm.foundations.precision import ALIASES as PRECISION_ALIASES
from rm.foundations.precision import NAMES as PRECISION_NAMES
from rm.foundations.precision import Precision, bf16_lost_update_fraction
from rm.data.tokenizer import config_errors as tokenizer_config_errors

CHOICES = {
    "model.model_type": ("mistral", "llama", "qwen2"),
    "model.attn_implementation": ("sdpa", "eager", "flash_attention_2", "flex_attention"),
    "memory_profile.optimizer": ("adamw", "adamw_8bit"),
    "memory_profile.quantize_base": ("none", "nf4"),
    "distributed.strategy": ("auto", "ddp", "deepspeed"),
    "hardware.accelerator": ("cuda", "cpu", "auto"),
    "data.source": ("hub", "local", "synthetic"),
    # The data policies are defined once, in rm.foundations.config (documented in rm.data).
    "data.format": FORMATS,
    "data.truncation": TRUNCATION,
    "data.identical_pairs": IDENTICAL_PAIRS,
    "data.duplicates": DUPLICATES,
    "data.on_malformed": ON_MALFORMED,
    "train.precision": ("auto", *PRECISION_NAMES, *PRECISION_ALIASES),
    "train.optim.lr_scheduler_type": ("linear", "cosine", "constant_with_warmup"),
    "train.layout": ("auto", "given"),
    "preflight.mode": ("error", "warn", "off"),
    "sweep.on_failure": ("raise", "continue"),
    "health.on_nonfinite": ("stop", "skip"),
}


class Range(NamedTuple):
    """The values a numeric key may take: ``[low, high]`` (each end open where said), or one of ``also``; null too where
    the schema's type is Optional. Every bound is finite: a size with no upper bound reaches an allocation, a search
    or a data pass that scales with it (``train.max_steps=1e12``: a 233 TiB array) before anything refuses it."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    also: Tuple = ()  # special values besides the range, e.g. -1: derive
    why: str = ""  # what the range or the special values mean, said after it

    def holds(self, value) -> bool:
        if value in self.also and not isinstance(value, bool):
            return True
        # NaN fails both comparisons; a bool is no number here (Hydra would not give one to an int key anyway)
        return (not isinstance(value, bool) and (value > self.low if self.low_open else value >= self.low)
                and (value < self.high if self.high_open else value <= self.high))

    def describe(self) -> str:
        """``in [1, 65536]``, ``-1 or in [1, 100000000]``: what a refusal names."""
        number = lambda x: str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"  # noqa: E731
        interval = f"in {'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}{')' if self.high_open else ']'}"
        return " or ".join([*map(str, self.also), interval]) + (f" ({self.why})" if self.why else "")


_STEPS = MAX_PAIRS_TRAINED  # a count of optimizer steps: at most one per pair trained
_GIB = 1 << 20  # GiB of memory: a node of a petabyte
_RATE = 1e9  # a throughput or bandwidth (TFLOP/s, GB/s): beyond any device

# Every numeric key of rm.foundations.config's schemas and its range, in one place: validate() checks each before
# anything that scales with it, and tests/settings/test_ranges.py fails for a numeric key that has none here.
RANGES = {
    "model.vocab_size": Range(1, 1 << 21),
    "model.hidden_size": Range(1, 1 << 17),
    "model.intermediate_size": Range(1, 1 << 19),
    "model.num_hidden_layers": Range(1, 1024),
    "model.num_attention_heads": Range(1, 1024),
    "model.num_key_value_heads": Range(1, 1024),
    "model.head_dim": Range(1, 4096, why="null: hidden_size / num_attention_heads"),
    "model.max_position_embeddings": Range(1, 1 << 24),
    "model.rope_theta": Range(0, 1e12, low_open=True),
    "model.rms_norm_eps": Range(0, 1, low_open=True, high_open=True),
    "lora.r": Range(1, 1 << 16),
    "lora.alpha": Range(1, 1 << 20),
    "lora.dropout": Range(0, 1, high_open=True),
    "memory_profile.order": Range(-(10**6), 10**6),
    # Hardware "auto" holds placeholders until resolved: checked as detected.
    "hardware.device_memory_gib": Range(0, _GIB, low_open=True, why="the memory of one device in GiB"),
    "hardware.headroom_gib": Range(0, _GIB, why="null: 2% of hardware.device_memory_gib"),
    "hardware.gpus_per_node": Range(1, 1024),
    "hardware.host_ram_gib": Range(0, _GIB, low_open=True, why="the RAM of one node in GiB"),
    "hardware.peak_bf16_tflops": Range(0, _RATE, low_open=True, why="null: measured on a CPU"),
    "hardware.peak_fp32_tflops": Range(0, _RATE, low_open=True, why="null: measured on a CPU"),
    "hardware.memory_gbps": Range(0, _RATE, low_open=True, why="null: measured on a CPU"),
    "hardware.link_gbps": Range(0, _RATE, low_open=True),
    "hardware.inter_node_gbps": Range(0, _RATE, low_open=True, why="null: hardware.link_gbps"),
    "hardware.host_link_gbps": Range(0, _RATE, low_open=True),
    "hardware.host_memory_gbps": Range(0, _RATE, low_open=True),
    "hardware.kernel_us": Range(0, 1e6, low_open=True, why="null: measured on a CPU"),
    "hardware.nodes": Range(1, 1 << 16),
    "hardware.time_limit_min": Range(1, 10**6),
    "distributed.zero_stage": Range(0, 3),
    "distributed.num_processes": Range(0, 1 << 20, why="0: as launched"),
    "data.max_length": Range(1, 1 << 24),
    "data.max_train_samples": Range(1, 1 << 40, why="null: all rows"),
    "data.max_eval_samples": Range(1, 1 << 40, why="null: all rows"),
    # Generated in memory before the first step, about 10^4 pairs a second
    "data.synthetic_train_size": Range(1, 10**7),
    "data.synthetic_test_size": Range(1, 10**7),
    "data.synthetic_seed": Range(0, 2**32 - 1),
    "train.seed": Range(0, 2**32 - 1, why="numpy and torch seeds are unsigned 32-bit"),
    "train.max_steps": Range(1, _STEPS, also=(-1,), why="-1: derive from train.num_train_epochs"),
    "train.num_train_epochs": Range(0, 10**4),
    "train.micro_batch_size": Range(1, 1 << 20),
    "train.global_batch_size": Range(1, 1 << 24),
    "train.eval_batch_size": Range(1, 1 << 20),
    "train.max_tokens_per_micro_batch": Range(0, 1 << 34, why="0: micro_batch_size pairs each"),
    "train.optim.learning_rate": Range(0, 1, low_open=True),
    "train.optim.weight_decay": Range(0, 1e3),
    "train.optim.adam_beta1": Range(0, 1, high_open=True),
    "train.optim.adam_beta2": Range(0, 1, high_open=True),
    "train.optim.adam_epsilon": Range(0, 1, low_open=True),
    "train.optim.warmup_ratio": Range(0, 1, high_open=True),
    "train.optim.max_grad_norm": Range(0, 1e12, why="0 disables clipping"),
    "train.center_rewards_coefficient": Range(0, 1e6),
    "train.logging.logging_steps": Range(0, _STEPS),
    "train.logging.eval_steps": Range(0, _STEPS, why="0: evaluate only at the end"),
    "train.checkpoint.save_steps": Range(0, _STEPS, why="0: save only at the end"),
    "train.checkpoint.save_total_limit": Range(0, 10**6),
    "train.dataloader_num_workers": Range(0, 1024),
    "train.threads": Range(0, 4096, why="0: auto"),
    "plan.top": Range(1, 10**4),
    "plan.steps": Range(1, 10**5),  # steps whose micro-batches rm.plan times
    "plan.stand_in_pairs": Range(1, 10**7),
    "health.ln2_steps": Range(0, _STEPS, why="0: off"),
    "health.ln2_tolerance": Range(0, 1),
    "health.chance_after_steps": Range(0, _STEPS),
    "health.chance_tolerance": Range(0, 0.5),
    "health.max_abs_reward": Range(0, 1e30, why="0: off"),
    "health.lost_updates_threshold": Range(0, 1, why="a fraction; 0: off"),
    "health.max_consecutive_skips": Range(1, _STEPS),
}


@dataclass(frozen=True)
class Plan:
    """Values derived from the config, computed once and logged at start.

    The run reads what it resolves from here, never from the config, which stays as composed.
    """

    world_size: int
    micro_batch_size: int  # train.micro_batch_size, or the one preflight.auto_micro_batch picked
    hardware: HardwareConfig  # the hardware group, with hardware=auto resolved to the detected machine
    gradient_accumulation_steps: int
    precision: str  # 32-true | bf16-mixed | bf16-true | 16-mixed, after resolving "auto" and legacy aliases
    device: str  # cuda | cpu
    strategy: str  # ddp | deepspeed, after resolving "auto" (ddp also covers a single process)
    zero_stage: int  # 0 unless strategy is deepspeed
    max_tokens_per_step: int  # global batch x 2 sequences x max_length
    world_size_source: str = "given"  # where world_size came from, in words (rm.settings.validate.resolve_world_size)
    launcher: bool = False  # a launcher (torchrun) started the processes, even one: DDP then wraps the model
    warnings: Tuple[str, ...] = ()  # settings that run but that a user should hear about, logged at start
    threads: Threads = Threads(1, "")  # CPU threads torch computes with (train.threads resolved), and why

    @property
    def numerics(self):
        """The dtypes of weights, compute and optimizer states for this precision under this engine."""
        return Precision.of(self.precision).numerics(deepspeed=self.strategy == "deepspeed")


def _lookup(cfg: RunConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def launched_as_main() -> bool:
    """Whether this process is the launch's rank 0 (or was started alone), before the engine exists; afterwards
    ask ``engine.is_main_process``."""
    return launch_env().is_main


class WorldSize(NamedTuple):
    """How many processes a run has, where that number came from (in words), and whether a launcher started them:
    what :func:`validate` takes after the config (``validate(cfg, *resolve_world_size(...))``)."""

    processes: int
    source: str
    launcher: bool


def resolve_world_size(distributed_cfg: DistributedConfig, launched: bool) -> WorldSize:
    """How many processes the run has, and where that number came from (the launcher's ``WORLD_SIZE``,
    :mod:`rm.foundations.launch_env`, or ``distributed.num_processes``).

    Args:
        distributed_cfg: the run's ``distributed`` group (``distributed.num_processes``).
        launched: this process trains (``rm.train``): a number the launch does not provide is an error.
            False for ``rm.estimate``, which may ask about a layout without launching it.

    Raises:
        ConfigError: ``distributed.num_processes`` disagrees with the launcher, or asks ``rm.train``
            for processes nobody started.

    Example:
        >>> from rm.foundations.config import DistributedConfig
        >>> import os; os.environ.pop("WORLD_SIZE", None) and None
        >>> resolve_world_size(DistributedConfig(name="ddp", num_processes=8), launched=False)
        WorldSize(processes=8, source='distributed.num_processes=8', launcher=False)
    """
    wanted = distributed_cfg.num_processes
    env = launch_env().world_size
    if env is not None:
        if wanted and wanted != env:
            raise ConfigError(f"distributed.num_processes={wanted} but the launcher started {env} processes (WORLD_SIZE); "
                              f"drop the key or launch {wanted}")
        return WorldSize(env, f"WORLD_SIZE={env} from the launcher", True)
    if wanted:
        if launched and wanted > 1:
            raise ConfigError(f"distributed.num_processes={wanted} but this is one process started without a launcher: "
                              f"run bash train_rm_distributed.sh SUBSET {wanted} (torchrun), or drop the key")
        return WorldSize(wanted, f"distributed.num_processes={wanted}", False)
    return WorldSize(1, "one process: started without a launcher (torchrun sets WORLD_SIZE; ask about N with "
                        "distributed.num_processes=N)", False)


def validate(cfg: RunConfig, world_size: int, world_size_source: str = "given", launcher: bool = False,
             micro_batch_size: Optional[int] = None) -> Plan:
    """Reject inconsistent settings and derive what the run needs; ``cfg`` is read, never changed.

    ``hardware=auto`` is resolved here (``rm.foundations.hardware.resolve_hardware``) and checked as detected.

    Args:
        cfg: the typed run config.
        world_size: number of training processes.
        world_size_source: where ``world_size`` came from, in words (:func:`resolve_world_size`).
        launcher: a launcher started the processes (:attr:`WorldSize.launcher`).
        micro_batch_size: instead of ``train.micro_batch_size`` (``preflight.auto_micro_batch``).

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

    t, d, hw = cfg.train, cfg.data, resolve_hardware(cfg.hardware)
    micro = t.micro_batch_size if micro_batch_size is None else micro_batch_size
    errors += _range_errors(cfg, hw)
    if t.max_steps <= 0 and not t.num_train_epochs > 0:
        errors.append(f"train.max_steps={t.max_steps} and train.num_train_epochs={t.num_train_epochs}: set one > 0")
    if t.max_steps * t.global_batch_size > MAX_PAIRS_TRAINED:
        errors.append(f"train.max_steps={t.max_steps} x train.global_batch_size={t.global_batch_size} = "
                      f"{t.max_steps * t.global_batch_size:,} pairs trained, more than {MAX_PAIRS_TRAINED:,}: lower either")
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
    per_step = micro * world_size
    if per_step > 0 and t.global_batch_size > 0:
        if t.global_batch_size % per_step:
            errors.append(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"train.micro_batch_size={micro} x world size {world_size} = {per_step}"
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
    errors += tokenizer_config_errors(cfg.model)

    device = "cpu" if hw.accelerator == "cpu" else "cuda"
    precision = _precision(t.precision, hw, device, errors)
    strategy, zero_stage = _check_profile_and_distribution(cfg.memory_profile, cfg.distributed, errors)
    warnings = (_precision_for_layout(cfg.train, cfg.memory_profile, cfg.distributed, precision, strategy, errors)
                + _attention_warnings(cfg.model))
    errors += _compile_errors(cfg.train, cfg.model, cfg.memory_profile, strategy, device)
    if t.packing and strategy == "deepspeed":  # DeepSpeed fixes the micro-batches per step; packed steps vary
        errors.append("train.packing=true does not work with distributed.strategy=deepspeed: use ddp, or train.packing=false")

    if hw.headroom_gib is not None and not hw.headroom_gib < hw.device_memory_gib:
        errors.append(f"hardware.headroom_gib={hw.headroom_gib} must be below hardware.device_memory_gib={hw.device_memory_gib}")
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
    return Plan(
        world_size=world_size,
        micro_batch_size=micro,
        hardware=hw,
        gradient_accumulation_steps=accumulation,
        precision=precision,
        device=device,
        strategy=strategy,
        zero_stage=zero_stage,
        max_tokens_per_step=t.global_batch_size * 2 * d.max_length,
        world_size_source=world_size_source,
        launcher=launcher,
        warnings=tuple(warnings),
        # the processes of this launch on this node share its cores
        threads=choose_threads(t.threads, launch_env().local_world_size),
    )


def unused_overrides(profile: MemoryProfileConfig, overrides: Sequence[str]) -> List[str]:
    """Keys the command line sets that the run then ignores, one warning each: ``lora.*`` (or ``lora=<option>``)
    under a memory profile that trains no LoRA adapters. A warning, not an error: a sweep over profiles
    (``memory_profile=full,lora lora.r=8,16``) sets them for every job.

        >>> from rm.foundations.config import compose
        >>> unused_overrides(compose(["memory_profile=full"]).memory_profile, ["memory_profile=full", "lora.r=16"])
        ['lora.r=16 has no effect: memory_profile=full trains no LoRA adapters (memory_profile.use_lora=false); use memory_profile=lora or qlora to train them']
    """
    if profile.use_lora:
        return []
    lora = [o.lstrip("+~") for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".")[0] == "lora"]
    if not lora:
        return []
    return [f"{' '.join(lora)} {'has' if len(lora) == 1 else 'have'} no effect: memory_profile={profile.name} "
            "trains no LoRA adapters (memory_profile.use_lora=false); use memory_profile=lora or qlora to train them"]



def _precision(precision: str, hw: HardwareConfig, device: str, errors: List[str]) -> str:
    """Resolve ``train.precision=auto`` for the hardware (a mode that loses no update) and the legacy
    aliases; reject a precision the hardware cannot compute in."""
    given = f"train.precision={precision}"
    if precision == "auto":
        precision = "bf16-mixed" if (device == "cuda" and hw.bf16) else "32-true"
    precision = Precision.canonical(precision)
    if precision.startswith("bf16") and not hw.bf16:
        errors.append(f"{given} but hardware={hw.name} has no bf16 (hardware.bf16=false): use 32-true or 16-mixed")
    if precision == "16-mixed" and device == "cpu":
        errors.append(f"{given} needs a GPU; hardware={hw.name} is a CPU: use 32-true")
    return precision


def _precision_for_layout(train_cfg: TrainConfig, profile: MemoryProfileConfig, dist: DistributedConfig, precision: str,
                          strategy: str, errors: List[str]) -> List[str]:
    """Refuse a precision the engine cannot train as named; warn where ``bf16-true`` will lose updates."""
    mode = Precision.of(precision)
    if strategy == "deepspeed" and mode.deepspeed_refusal:
        errors.append(f"train.precision={precision} with distributed={dist.name}: {mode.deepspeed_refusal}. "
                      f"Use train.precision=bf16-mixed, or distributed=ddp for pure bf16")
    if train_cfg.optim.kahan_summation:
        if precision != "bf16-true":
            errors.append(f"train.optim.kahan_summation=true compensates bf16 weight updates; train.precision={precision} "
                          f"{'keeps fp32 weights for the optimizer already' if mode.mixed or not mode.half else 'is not bf16-true'}: "
                          f"drop the key, or use train.precision=bf16-true")
        if strategy == "deepspeed" or profile.optimizer != "adamw":
            errors.append(f"train.optim.kahan_summation=true replaces torch AdamW by optimi's; memory_profile={profile.name} "
                          f"with distributed={dist.name} uses another optimizer: use distributed=ddp with "
                          f"memory_profile=full or lora")
        if not _installed("optimi"):
            errors.append("train.optim.kahan_summation=true needs optimi: pip install torch-optimi")
    warnings = []
    if train_cfg.precision in PRECISION_ALIASES:
        warnings.append(f"train.precision={train_cfg.precision} reads as {precision} (Lightning's names: bf16-mixed keeps "
                        f"fp32 weights and optimizer states, bf16-true trains bf16 weights)")
    if mode.half and not mode.mixed and not profile.use_lora and not train_cfg.optim.kahan_summation:
        # The weights' scale is unknown before they load; transformers initialises (and most checkpoints keep)
        # linear weights near N(0, 0.02).
        lost = bf16_lost_update_fraction(train_cfg.optim.learning_rate, 0.02)
        if lost > 0.05:
            warnings.append(
                f"train.precision=bf16-true at train.optim.learning_rate={train_cfg.optim.learning_rate:g}: AdamW updates smaller than "
                f"half a bf16 step of the weight round to nothing, about {lost:.0%} of weights of scale 0.02 would never "
                f"move. Use train.precision=bf16-mixed (fp32 master weights and states), or a learning rate of at least "
                f"{_lr_losing_at_most(0.05):.0e}, or train.optim.kahan_summation=true; the lost_updates alarm measures it while training")
    return warnings


def _compile_errors(train_cfg: TrainConfig, model_cfg: ModelConfig, profile: MemoryProfileConfig, strategy: str,
                    device: str) -> List[str]:
    """``train.compile=true`` where its speed and memory were measured: rm's own attention (which stays eager
    between the compiled parts), unquantised layers, the accelerate engine. Each refusal says why."""
    if not train_cfg.compile:
        return []
    errors = []
    if model_cfg.attn_implementation != "sdpa":
        errors.append(f"train.compile=true compiles each decoder layer around rm's attention, model.attn_implementation=sdpa; "
                      f"model.attn_implementation={model_cfg.attn_implementation} was never measured compiled: use sdpa, "
                      f"or train.compile=false")
    if profile.quantize_base != "none":
        errors.append(f"train.compile=true with memory_profile={profile.name}: bitsandbytes' {profile.quantize_base} layers "
                      f"break every compiled graph in pieces; use train.compile=false")
    if strategy == "deepspeed":
        errors.append(f"train.compile=true with distributed.strategy=deepspeed (memory_profile={profile.name}): DeepSpeed's "
                      f"hooks around each layer were never measured compiled; use distributed=ddp, or train.compile=false")
    if device == "cpu" and train_cfg.logging.track_memory:
        errors.append("train.compile=true with train.logging.track_memory=true: the CPU's tensor count sees each operator "
                      "through a dispatch mode, and a compiled kernel's buffers are not operators; drop one of the two")
    if device == "cpu" and not any(shutil.which(cc) for cc in ("g++", "clang++", "c++")):
        errors.append("train.compile=true on a CPU needs a C++ compiler for inductor's kernels (g++ or clang++ on PATH)")
    return errors


def _attention_warnings(model_cfg: ModelConfig) -> List[str]:
    """What a user of an attention implementation should hear before a GPU-hour is spent."""
    if model_cfg.attn_implementation != "flex_attention":
        return []
    # Seen on an H100 (torch 2.11, 2026-11-26, docs/gpu.md): the first sequence length compiles, a later one that
    # torch.compile recompiles with symbolic sizes failed in 2 of 6 runs ("NoValidChoicesError" for flex_attention).
    return ["model.attn_implementation=flex_attention: torch 2.11's inductor failed to recompile flex-attention for a "
            "new sequence length in 2 of 6 runs on an H100 (NoValidChoicesError), so a run can stop at its first batch "
            "of another length; model.attn_implementation=sdpa takes the same masks"]


def _lr_losing_at_most(share: float, weight_std: float = 0.02) -> float:
    """The smallest power-of-two learning rate at which bf16-true loses at most ``share`` of N(0, std) updates."""
    lr = 2.0**-30
    while bf16_lost_update_fraction(lr, weight_std) > share:
        lr *= 2
    return lr


def _range_errors(cfg: RunConfig, hw: HardwareConfig) -> List[str]:
    """Every numeric key against its range in :data:`RANGES` (``hw``: the hardware group resolved), and the model
    shape's divisibility; the enumerated keys are in :data:`CHOICES`."""
    errors: List[str] = []
    for key, allowed in RANGES.items():
        group, _, name = key.partition(".")
        value = hw if group == "hardware" else getattr(cfg, group)
        for part in name.split("."):  # train.optim.learning_rate: a key of a nested group
            value = getattr(value, part)
        if value is not None and not allowed.holds(value):
            errors.append(f"{key}={value} must be {allowed.describe()}")
    return errors + _model_shape_errors(cfg.model)


def _model_shape_errors(m) -> List[str]:
    """A model shape that transformers would reject late, with a message naming no key."""
    errors: List[str] = []
    if m.num_attention_heads >= 1 and m.num_key_value_heads >= 1 and m.num_attention_heads % m.num_key_value_heads:
        errors.append(f"model.num_key_value_heads={m.num_key_value_heads} must divide model.num_attention_heads="
                      f"{m.num_attention_heads} (each key/value head serves a whole group of query heads)")
    if m.head_dim is None and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        errors.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
                      f"{m.num_attention_heads}: set model.head_dim")
    if m.attn_implementation == "flash_attention_2" and not _installed("flash_attn"):
        errors.append("model.attn_implementation=flash_attention_2 needs flash-attn: pip install flash-attn "
                      "--no-build-isolation (CUDA only), or use model.attn_implementation=sdpa")
    if m.tokenizer not in (None, "bpe", "words", "builtin"):
        errors += _tokenizer_path_errors(m.tokenizer)
    if m.pretrained:
        errors += _pretrained_errors(m.pretrained)
        errors += _pretrained_tokenizer_errors(m.pretrained, m.tokenizer)
        errors += _pretrained_shape_errors(m)
    return errors


# config.json key -> the model group's: what the estimate sizes the model by.
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def _pretrained_shape_errors(m) -> List[str]:
    """A local ``model.pretrained`` must have the shape of the ``model`` group: the estimate (and the label of the
    run) come from the group, the weights from the directory. Each key that differs is named with its value there,
    as the override to add. A Hub id cannot be read offline; its group is the one that names it."""
    import json

    config_file = Path(m.pretrained).expanduser() / "config.json"
    if not config_file.is_file():
        return []
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        return [f"model.pretrained={m.pretrained}: {config_file} is not readable JSON ({err})"]
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    if config.get("head_dim") is None and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    ours = {key: getattr(m, key) for key in SHAPE_KEYS}
    if ours["head_dim"] is None:
        ours["head_dim"] = m.hidden_size // max(m.num_attention_heads, 1)
    differ = [key for key in SHAPE_KEYS if key in config and config[key] is not None and config[key] != ours[key]]
    if not differ:
        return []
    fix = " ".join(f"model.{key}={str(config[key]).lower() if isinstance(config[key], bool) else config[key]}" for key in differ)
    return [f"model.pretrained={m.pretrained} has another shape than model={m.name}, by which the memory estimate sizes "
            f"it: " + ", ".join(f"{key} {config[key]} there, {ours[key]} here" for key in differ)
            + f". Add: {fix} (and model.name=<yours>), or choose the model group of that architecture"]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _pretrained_tokenizer_errors(pretrained: str, tokenizer: Optional[str]) -> List[str]:
    """The tokenizer comes from a local ``model.pretrained`` unless ``model.tokenizer`` names one: it must be there
    (a directory of weights alone, such as a saved random init, has none)."""
    path = Path(pretrained).expanduser()
    if tokenizer or not (path / "config.json").is_file() or any((path / f).is_file() for f in TOKENIZER_FILES):
        return []
    return [f"model.pretrained={pretrained} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): name one with "
            "model.tokenizer=<directory or Hub id>"]


def _tokenizer_path_errors(tokenizer: str) -> List[str]:
    """A ``model.tokenizer`` that names a directory must hold a tokenizer; anything else must look like a Hub id.
    Checked here, as ``model.pretrained`` is: transformers would take a path that does not exist for a Hub id and
    fail with "Repo id must be in the form ...", an OSError that reads as a storage fault."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        if any((path / f).is_file() for f in TOKENIZER_FILES):
            return []
        return [f"model.tokenizer={tokenizer} is a directory without a tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                "give the directory save_pretrained wrote the tokenizer to, or a Hub id"]
    if path.exists():
        return [f"model.tokenizer={tokenizer} is a file: give the directory that holds it (model.tokenizer={path.parent})"]
    if tokenizer.startswith((".", "/", "~")) or not _HUB_ID.match(tokenizer):
        return [f"model.tokenizer={tokenizer}: no such directory, and not a Hub id (org/name); or leave it null for "
                "the model's own tokenizer"]
    return []


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _pretrained_errors(pretrained: str) -> List[str]:
    """A local ``model.pretrained`` must hold a model; anything else must look like a Hub id."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            return [f"model.pretrained={pretrained} is a directory without config.json: not a transformers model "
                    "directory (give the directory save_pretrained wrote, or a Hub id)"]
        if not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
            return [f"model.pretrained={pretrained} holds config.json but no weights (*.safetensors)"]
        return []
    if path.exists():
        return [f"model.pretrained={pretrained} is a file: give a model directory or a Hub id"]
    if pretrained.startswith((".", "/", "~")) or not _HUB_ID.match(pretrained):
        return [f"model.pretrained={pretrained}: no such directory, and not a Hub id (org/name)"]
    return []


def _check_extra_eval_files(extra_eval_files, errors: List[str]) -> None:
    """Each name must make metric keys of its own: ``eval_<name>_...`` may not collide with another set's keys."""
    if not extra_eval_files:
        return
    from rm.evaluation.diagnostics import eval_keys  # here: it loads torch, which `--help` and most validations do not need

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
    # On the path, not through sys.modules: an estimate keeps bitsandbytes out of its process (rm.foundations.cli).
    return importlib.machinery.PathFinder.find_spec(module) is not None


def _check_profile_and_distribution(profile: MemoryProfileConfig, dist: DistributedConfig, errors: List[str]):
    """Resolve ``distributed.strategy=auto`` and reject profile/strategy pairs that cannot work."""
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
        # bitsandbytes' 4-bit layers run on the CPU too (its CPU backend, 0.49 on); a model built from its shape is
        # saved and loaded quantised (rm.modelling.model.saved_random_init), so neither CUDA nor pretrained weights are needed.
        if not profile.use_lora:
            errors.append(f"memory_profile.quantize_base={profile.quantize_base} needs memory_profile.use_lora=true (a 4-bit base cannot train)")
        if strategy == "deepspeed" and zero_stage == 3:
            errors.append(f"memory_profile={profile.name} with distributed={dist.name}: ZeRO-3 cannot shard 4-bit weights")
        if not _installed("bitsandbytes"):
            errors.append(f"memory_profile={profile.name} needs bitsandbytes: pip install 'rm-reward[bnb]'")
    return strategy, zero_stage
