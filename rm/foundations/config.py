"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each YAML file under ``conf/<group>/`` inherits its group's schema through
``defaults: [base_<group>, _self_]``, so a misspelt key or a wrong type fails at
composition with Hydra's own message. Every default lives here and nowhere else:
code reads the typed objects returned by :func:`to_run_config` and never calls
``cfg.get(key, default)``.
"""

from __future__ import annotations

import contextlib
import sys
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from rm.foundations.errors import COMPOSITION_HINTS, NAME_CHECKS, ConfigError

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelConfig:
    """The reward model's backbone.

    The shape numbers are the model's real ones, so its size is known without a
    download (the memory estimator reads them). ``pretrained`` null means "build
    from these numbers with random weights", which is what the tiny model does.
    """

    name: str = MISSING
    pretrained: Optional[str] = None  # hub id or local directory; null: random init from the shape below
    # null: the pretrained model's; for a random init (pretrained null too) "bpe". "bpe": a byte-level BPE trained on
    # the run's training texts, at most vocab_size tokens (rm.data.tokenizer); "words": the synthetic data's word list
    # (other words become <unk>); else a hub id or directory.
    tokenizer: Optional[str] = None
    model_type: str = "mistral"  # transformers model_type: mistral | llama | qwen2
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: Optional[int] = None  # null: hidden_size // num_attention_heads
    max_position_embeddings: int = MISSING
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attn_implementation: str = "sdpa"  # sdpa | eager | flash_attention_2
    trust_remote_code: bool = False  # never run code shipped with a checkpoint unless asked


@dataclass
class LoraConfig:
    """PEFT LoRA settings; used only by memory profiles with ``use_lora: true``."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: List[str] = field(default_factory=lambda: list(ALL_LINEAR))
    merge_on_save: bool = False  # also write final/merged: adapters folded into the base, loads with plain transformers


@dataclass
class MemoryProfileConfig:
    """How memory is traded for speed: which weights train, which optimizer steps them, where its states live."""

    name: str = MISSING
    # Where the profile stands among the others (memory_profiles()), lowest first: the least slowdown, then the
    # model unchanged, before other trade-offs. A refused run's suggestions try the profiles in this order, rm.plan
    # searches and rm.gpu_report prints them in it. Required, so that a new profile says where it goes.
    order: int = MISSING
    use_lora: bool = False  # true: only LoRA adapters and the reward head train
    optimizer: str = "adamw"  # adamw (torch, fused) | adamw_8bit (bitsandbytes; paged on CUDA)
    offload_optimizer: bool = False  # true: AdamW states and step on the CPU (DeepSpeed ZeRO-Offload)
    quantize_base: str = "none"  # none | nf4 (frozen base in 4-bit NF4 through bitsandbytes: QLoRA)


@dataclass
class HardwareConfig:
    """What the run may use, per device and per node."""

    name: str = MISSING
    accelerator: str = "cuda"  # cuda | cpu | auto (detect at start)
    # Capacity of one device as its runtime reports it (torch.cuda.mem_get_info()[1]), not the size on
    # the box: an "80 GB" H100 reports 79.19 GiB. hardware=auto reads it from the device; null on a CPU profile:
    # this machine's RAM (rm.foundations.hardware.resolve_hardware), a number overrides it.
    device_memory_gib: Optional[float] = MISSING
    # Kept free for what the estimate does not see (other processes on the device, a profiler).
    # null: 2% of device_memory_gib, the calibration's bound on how far an estimate may be under.
    headroom_gib: Optional[float] = None
    bf16: bool = False  # device computes in bfloat16 natively
    gpus_per_node: int = 1
    host_ram_gib: Optional[int] = MISSING  # RAM of one node; null: this machine's (detected)
    # Rates the step-time model reads (python -m rm.plan; rm/plan/steptime.py). null on a CPU: measured on this
    # machine by a short micro-benchmark, cached per machine (rm/plan/constants.py). A CUDA profile states its
    # card's datasheet figures, each with its source in a comment, until benchmarks/gpu_constants.py measures them.
    peak_bf16_tflops: Optional[float] = None  # dense bf16 matmul, TFLOP/s
    peak_fp32_tflops: Optional[float] = None  # fp32 matmul without TF32 (torch's default), TFLOP/s
    memory_gbps: Optional[float] = None  # device memory bandwidth, GB/s
    link_gbps: Optional[float] = None  # between two devices of a node, one direction, GB/s (DDP/ZeRO collectives)
    inter_node_gbps: Optional[float] = None  # per device between nodes, one direction, GB/s; null: link_gbps
    host_link_gbps: Optional[float] = None  # host <-> one device, one direction, GB/s (ZeRO-Offload's copies)
    host_memory_gbps: Optional[float] = None  # host RAM bandwidth of a node, GB/s (ZeRO-Offload's CPU Adam)
    kernel_us: Optional[float] = None  # fixed cost of one op (dispatch and launch), microseconds; CPU null: measured
    rates_source: str = ""  # where the rates above come from, in words; rm.plan prints it
    # The names torch.cuda.get_device_name() gives the card a profile describes: hardware=auto on such a card takes
    # the profile's rates (rm.foundations.hardware.resolve_hardware), where the command line gives none.
    device_names: List[str] = field(default_factory=list)
    # What a cluster job asks for (hydra/launcher=submitit_slurm reads these):
    nodes: int = 1
    time_limit_min: int = 1440
    slurm_partition: Optional[str] = None


@dataclass
class DistributedConfig:
    """How processes share the work. Launch several with ``train_rm_distributed.sh`` (torchrun)."""

    name: str = MISSING
    strategy: str = "auto"  # auto (deepspeed ZeRO-2 when the profile offloads, else ddp) | ddp | deepspeed
    zero_stage: int = 2  # deepspeed: 1 shards optimizer states, 2 also gradients, 3 also weights
    offload_params: bool = False  # deepspeed ZeRO-3: weight shards live on the CPU between uses
    # Processes the run has. 0: as launched (torchrun's WORLD_SIZE, else 1). rm.estimate
    # distributed.num_processes=8 asks about 8 processes without launching them; rm.train checks it
    # against the launch. Sharding (DDP buckets, ZeRO partitions) changes the per-device peak.
    num_processes: int = 0


# The data policies' values (what each does: rm.data's docstring). Here, beside the schema, so
# that validating a config does not import the data pipeline (datasets and pyarrow take seconds to import).
FORMATS = ("auto", "hh", "prompt", "messages")
TRUNCATION = ("truncate", "drop", "error")
IDENTICAL_PAIRS = ("drop", "keep")
DUPLICATES = ("keep", "drop")
ON_MALFORMED = ("skip", "error")


# The most pairs a run may train (train.max_steps x train.global_batch_size, or its epochs over the data): 10^8.
# The memory estimate orders every step's pairs before the first step (rm.data.shapes, 8 bytes a pair: 800 MB here);
# HH-RLHF is 160k pairs, so this is over 600 epochs of it. rm.settings.validate and rm.data.batching check it.
MAX_PAIRS_TRAINED = 10**8
# Epochs over the training pairs past which a run warns: a reward model overfits its pairs within a few (eval loss
# 0.81 after 85 epochs of 300 pairs, issue 50).
EPOCHS_WARNED = 3


@dataclass
class DataConfig:
    """Where the preference pairs come from and how they are cut to length."""

    name: str = MISSING
    source: str = "hub"  # hub | local | synthetic
    path: Optional[str] = None  # hub dataset id (source=hub)
    subsets: List[str] = field(default_factory=list)  # hub data_dirs, concatenated; empty: all
    train_split: str = "train"
    eval_split: str = "test"
    train_files: List[str] = field(default_factory=list)  # source=local: jsonl / json / parquet, globs allowed
    eval_files: List[str] = field(default_factory=list)
    # More eval sets, name -> local files, each loaded like the main eval split and reported as eval_<name>_*:
    # +data.extra_eval_files.hard=[hard/*.parquet] (the + because a new name is a new key to Hydra)
    extra_eval_files: Dict[str, List[str]] = field(default_factory=dict)
    format: str = "auto"  # auto | hh | prompt | messages
    # Plain-text sides (hh, prompt) end with the tokenizer's EOS, appended where missing, and keep the tokenizer's
    # own special tokens (BOS): the reward is read at that EOS, as TRL's RewardTrainer and OpenRLHF read it.
    # Conversations (messages) are tokenised as the chat template renders them. false: no EOS appended (rm.data.tokenizer)
    append_eos: bool = True
    margin_column: Optional[str] = None  # column with a per-pair margin for the loss
    max_length: int = 512  # tokens per sequence; longer pairs follow `truncation`. Activations grow with it
    truncation: str = "truncate"  # truncate (cut the prompt's start) | drop | error (stop, naming the row)
    identical_pairs: str = "drop"  # drop | keep: chosen == rejected after truncation trains nothing (loss ln 2)
    duplicates: str = "keep"  # keep | drop: a pair with the same token ids as an earlier pair of its split
    on_malformed: str = "skip"  # skip (count) | error
    max_train_samples: Optional[int] = None
    max_eval_samples: Optional[int] = None
    synthetic_train_size: int = 8000  # source=synthetic: pairs generated for train
    synthetic_test_size: int = 1000
    synthetic_seed: int = 0
    synthetic_multi_turn: bool = False  # source=synthetic: 2-6 chit-chat exchanges before each task, HH-like long shared prompts


@dataclass
class OptimConfig:
    """The optimizer and its schedule (``train.optim.*``): numbers in the update, none of them a tensor or an op."""

    learning_rate: float = 1e-5  # LoRA runs usually want ~1e-4: train.optim.learning_rate=1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    # TRL's RewardTrainer schedule (linear decay, no warm-up). Cosine after a 3% warm-up tied it on single-turn pairs
    # but lost 9 points of eval accuracy on multi-turn ones, for TRL and rm alike (docs/learning.md, "Schedules")
    lr_scheduler_type: str = "linear"  # linear | cosine | constant_with_warmup
    warmup_ratio: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    kahan_summation: bool = False  # bf16-true only: optimi's AdamW keeps a bf16 compensation buffer (+2 bytes per
    # trained weight) so that updates below a bf16 step accumulate instead of rounding away (pip install torch-optimi)


@dataclass
class CheckpointConfig:
    """When checkpoints are written and what a run directory that holds an earlier run does (``train.checkpoint.*``)."""

    save_steps: int = 500  # 0: save only at the end
    save_total_limit: int = 2  # checkpoints kept
    resume: bool = False  # continue from the newest intact checkpoint in the run directory
    resume_allow_changes: bool = False  # resume even if settings that shape training changed (each is logged and applied)
    overwrite: bool = False  # start afresh in a run directory that holds an earlier run (deletes its outputs)


@dataclass
class LoggingConfig:
    """What a run reports while it trains (``train.logging.*``)."""

    logging_steps: int = 10
    eval_steps: int = 200  # 0: evaluate only at the end
    tensorboard: bool = False
    track_memory: bool = False  # CPU: count live tensor bytes into memory.json (slower); CUDA: always measured


@dataclass
class TrainConfig:
    """The optimisation loop. Names follow transformers' TrainingArguments where one exists.

    The optimizer (``optim``), checkpointing and resuming (``checkpoint``) and reporting (``logging``) are groups
    of their own, read by the code that builds each. The layout knobs (micro_batch_size, group_by_length, packing,
    max_tokens_per_micro_batch, share_prefix, gradient_checkpointing, layout) and the batch sizes and precision stay
    here, at ``train.*``: they are what ``train.layout=auto`` and ``rm.plan`` turn and print as overrides, kept
    short and together. A key that moved into a group is named in :data:`MOVED_KEYS`.
    """

    seed: int = 42
    max_steps: int = -1  # optimizer steps; -1: derive from num_train_epochs
    num_train_epochs: float = 1.0
    micro_batch_size: int = 4  # pairs per device per forward (8 sequences); activations grow with it
    global_batch_size: int = 64  # pairs per optimizer step over all devices
    eval_batch_size: int = 8  # pairs per device per eval forward
    group_by_length: bool = True  # sort each step's pairs by length into micro-batches: less padding, same gradient
    packing: bool = False  # concatenate a micro-batch's sequences into one row, no pad tokens: less compute, same gradient
    max_tokens_per_micro_batch: int = 0  # packing: cut each step's pairs into micro-batches of at most this many tokens
    # (0: micro_batch_size pairs each); activations follow this budget; must be 0 or >= 2 x data.max_length
    share_prefix: bool = False  # one sequence per pair, prompt + chosen end + rejected end: the shared prompt is
    # computed once (same rewards and gradient); a 4D mask of rows x T x T (sdpa/eager) per micro-batch
    layout: str = "auto"  # auto: the fastest layout that fits, as rm.plan predicts it for this data and hardware
    # (rm/plan/auto.py), over the knobs micro_batch_size, gradient_checkpointing, group_by_length, packing,
    # max_tokens_per_micro_batch and share_prefix that are left at their default here and not set on the command
    # line; given: every knob as configured. Neither changes what trains: the same pairs, gradients and updates.
    precision: str = "auto"  # auto (bf16-mixed where the hardware has bf16, else 32-true) | 32-true | bf16-mixed | bf16-true | 16-mixed (rm.foundations.precision: memory and numerics of each)
    gradient_checkpointing: bool = True  # true: recompute activations in backward, far less memory, ~30% slower
    center_rewards_coefficient: float = 0.0  # >0 adds coef * mean(r^2) so rewards stay centred (TRL's name)
    dataloader_num_workers: int = 0
    # CPU threads torch computes with. 0: the cores this process may use that other work leaves idle (OMP_NUM_THREADS
    # where set), at least 1: on a shared CPU torch's default of one per core spins against the other jobs
    # (rm.foundations.threads, benchmarks/threads_under_load.py). CPU matmuls round differently with 1 and 2 threads,
    # so auto can change the last bits of a run with the load (a resume keeps its run's count); set it to repeat a run
    threads: int = 0
    # torch.compile each decoder layer (regional, as torchtitan and transformers do): fused elementwise kernels and
    # fewer launches, at a compile of tens of seconds at start and a recompile when the sequence length first changes.
    # rm's attention stays eager between the compiled parts. Opt-in: speed and memory as measured in docs/throughput.md
    # (the memory estimate traces the eager model, an upper bound: tests/modelling/test_compile.py)
    compile: bool = False
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# Keys that moved from train.* into a group of their own after rm 0.1.0. The old name is an error, not an alias:
# rm exits 2 naming the new one (rm.foundations.errors.run_hydra_app). A run directory written before the move has
# the old names in its checkpoints' fingerprints, which rm.runs.resume reads through this mapping. A record of what
# moved, written out: a key added to a group later did not move.
MOVED_KEYS: Dict[str, str] = {
    "train.learning_rate": "train.optim.learning_rate",
    "train.weight_decay": "train.optim.weight_decay",
    "train.adam_beta1": "train.optim.adam_beta1",
    "train.adam_beta2": "train.optim.adam_beta2",
    "train.adam_epsilon": "train.optim.adam_epsilon",
    "train.lr_scheduler_type": "train.optim.lr_scheduler_type",
    "train.warmup_ratio": "train.optim.warmup_ratio",
    "train.max_grad_norm": "train.optim.max_grad_norm",
    "train.kahan_summation": "train.optim.kahan_summation",
    "train.save_steps": "train.checkpoint.save_steps",
    "train.save_total_limit": "train.checkpoint.save_total_limit",
    "train.resume": "train.checkpoint.resume",
    "train.resume_allow_changes": "train.checkpoint.resume_allow_changes",
    "train.overwrite": "train.checkpoint.overwrite",
    "train.logging_steps": "train.logging.logging_steps",
    "train.eval_steps": "train.logging.eval_steps",
    "train.tensorboard": "train.logging.tensorboard",
    "train.track_memory": "train.logging.track_memory",
}


@dataclass
class PreflightConfig:
    """The memory check that runs before any weight loads."""

    name: str = MISSING
    mode: str = "error"  # error: refuse a run that will not fit | warn: say so and go on | off
    auto_micro_batch: bool = False  # pick the largest micro-batch that fits; accumulation keeps the global batch


@dataclass
class EstimateOutput:
    json: bool = False  # python -m rm.estimate estimate.json=true: print JSON instead of a table


@dataclass
class PlanOutput:
    """What ``python -m rm.plan`` searches and prints (rm/plan/__main__.py)."""

    json: bool = False  # plan.json=true: print JSON instead of a table, nothing else on stdout
    top: int = 5  # candidates printed, fastest first
    steps: int = 32  # optimizer steps of the run whose micro-batches are timed (the run's first ones)
    stand_in_pairs: int = 2048  # pairs of synthetic stand-in data where the configured data cannot be read here


@dataclass
class SweepConfig:
    """How a job of a multirun (``-m``) ends when it fails for a reason other than a refusal.

    raise: Hydra's own behaviour. The job is recorded as failed and prints its message; the basic sweeper runs the
        remaining jobs and the multirun exits with the first failed job's code at the end (2 for an invalid value;
        no traceback but a bug's); Optuna stops the study.
    continue: the job is recorded as failed and returns no objective (Optuna counts a failed trial);
        every sweeper goes on and the multirun exits 0.
    A job the pre-flight estimate refuses is always recorded as refused, returns no objective, and
    the sweep goes on.
    """

    on_failure: str = "raise"  # raise | continue


@dataclass
class HealthConfig:
    """Training-health alarms and what a non-finite step does (``rm.training.health`` documents each alarm)."""

    ln2_steps: int = 50  # alarm when the loss of each of the first N steps is within ln2_tolerance of ln 2; 0: off
    ln2_tolerance: float = 0.02
    chance_after_steps: int = 100  # alarm when an eval from this step on has accuracy <= 0.5 + chance_tolerance
    chance_tolerance: float = 0.02
    max_abs_reward: float = 100.0  # alarm when the mean |reward| over a step exceeds it; 0: off
    # Alarm when more than this fraction of sampled weight updates (nonzero gradient) rounds to nothing, over the
    # steps after warmup (pure bf16 at a small learning rate); 0: off, and nothing is measured
    lost_updates_threshold: float = 0.5
    on_nonfinite: str = "stop"  # NaN/inf loss or gradient norm: stop (keep the last good checkpoint) | skip the step
    max_consecutive_skips: int = 10  # on_nonfinite=skip: this many non-finite steps in a row stop the run
    fp32_head: Optional[bool] = None  # reward head weights and compute in fp32; null: on with fp16/bf16, off in fp32


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    lora: LoraConfig = MISSING
    memory_profile: MemoryProfileConfig = MISSING
    hardware: HardwareConfig = MISSING
    distributed: DistributedConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = MISSING
    preflight: PreflightConfig = MISSING
    estimate: EstimateOutput = field(default_factory=EstimateOutput)
    plan: PlanOutput = field(default_factory=PlanOutput)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    health: HealthConfig = field(default_factory=HealthConfig)


GROUPS = {
    "model": ModelConfig,
    "lora": LoraConfig,
    "memory_profile": MemoryProfileConfig,
    "hardware": HardwareConfig,
    "distributed": DistributedConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "preflight": PreflightConfig,
}


def register_configs() -> None:
    """Register the schemas so YAML files can inherit them (`defaults: [base_<group>]`)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for group, schema in GROUPS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    _rename_submitit_slurm_schema(cs)


def _rename_submitit_slurm_schema(cs: ConfigStore) -> None:
    """Let ``conf/hydra/launcher/submitit_slurm.yaml`` extend hydra-submitit-launcher's schema.

    A YAML file and a ConfigStore entry of the same name trigger Hydra's deprecated automatic
    schema matching; Hydra's migration is to store the schema under another name and list it in
    the YAML's defaults. The plugin registers its schema itself, so it is moved here.
    """
    from hydra.core.plugins import Plugins

    Plugins.instance()  # discovers the plugins, which register their configs
    launchers = cs.repo.get("hydra", {}).get("launcher", {})
    node = launchers.pop("submitit_slurm.yaml", None)
    if node is not None:
        cs.store(group="hydra/launcher", name="submitit_slurm_schema", node=node.node, provider=node.provider)


def moved_key_message(key: str, value: Optional[str] = None) -> str:
    """What to write instead of a key of :data:`MOVED_KEYS`: ``key=value`` on the command line, else in YAML."""
    new = MOVED_KEYS[key]
    fix = f"write {new}={value}" if value is not None else f"in a YAML file, put it under train: {new.split('.')[1]}:"
    return f"{key} moved to {new} (after rm 0.1.0): {fix}"


def moved_key_errors(argv: Sequence[str], hydra_message: str) -> List[str]:
    """A line for a key that Hydra could not compose because it moved (:data:`MOVED_KEYS`), naming the new one, with
    the value where the command line gave it; only a key Hydra's message names (it stops at the first error).

    >>> moved_key_errors(["experiment=tiny", "train.learning_rate=1e-4"], "full_key: train.learning_rate")
    ['error: train.learning_rate moved to train.optim.learning_rate (after rm 0.1.0): write train.optim.learning_rate=1e-4']
    >>> moved_key_errors(["train.bogus=1", "train.learning_rate=1e-4"], "full_key: train.bogus")
    []
    """
    given = {}
    for arg in argv:
        key, eq, value = arg.lstrip("+~").partition("=")
        if eq and key in MOVED_KEYS:
            given[key] = value
    named = [k for pair in re.findall(r"full_key: ([\w.]+)|'([\w.]+)'", hydra_message) for k in pair if k in MOVED_KEYS]
    return [f"error: {moved_key_message(key, given.get(key))}" for key in dict.fromkeys(named)]


COMPOSITION_HINTS.append(moved_key_errors)  # run_hydra_app prints these lines for a composition that failed


def list_value_errors(argv: Sequence[str], hydra_message: str) -> List[str]:
    """A line for a list key given one bare value (``data.train_files=pairs.jsonl``), which Hydra refuses as "str is
    not a ListConfig" without saying how to write a list: the override with its brackets.

    >>> list_value_errors(["data.train_files=a.jsonl"], "str is not a ListConfig, list or tuple. full_key: data.train_files")
    ["error: data.train_files is a list: write 'data.train_files=[a.jsonl]' (brackets; quoted for the shell)"]
    """
    if "is not a ListConfig" not in hydra_message:
        return []
    named = re.findall(r"full_key: ([\w.]+)", hydra_message)
    given = {key: value for key, eq, value in (a.lstrip("+~").partition("=") for a in argv) if eq}
    return [f"error: {key} is a list: write '{key}=[{given[key]}]' (brackets; quoted for the shell)"
            for key in dict.fromkeys(named) if key in given]


COMPOSITION_HINTS.append(list_value_errors)


def to_run_config(cfg: DictConfig, runtime: Optional[dict] = None, overrides: Optional[Sequence[str]] = None) -> RunConfig:
    """Turn the composed Hydra config into typed objects, once, at the entry point.

    Args:
        runtime: the composition's ``hydra.runtime`` (its ``choices`` and ``config_sources``), to name the file a
            mandatory key is missing from; None: the running app's.
        overrides: the command line it was composed with; None: the running app's.

    Raises:
        ConfigError: a key of :data:`MOVED_KEYS` was added under its old name (``+train.learning_rate=1e-4``, as
            Hydra's own message suggests for a key the schema lacks), which would otherwise be dropped unread; or a
            mandatory key (``???``: ``memory_profile.order``) has no value (:func:`missing_value_message`).
    """
    from omegaconf.errors import MissingMandatoryValue

    moved = [f"{moved_key_message(key, str(OmegaConf.select(cfg, key)))}" for key in MOVED_KEYS
             if OmegaConf.select(cfg, key, default=None) is not None]
    if moved:
        raise ConfigError("\n".join(moved))
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:
        # Composition leaves a ``???`` in place (a profile file of the user's without order:, a key=??? override);
        # only the typed objects need it, and omegaconf's error would read as a bug in rm.
        if runtime is None or overrides is None:
            from hydra.core.hydra_config import HydraConfig

            if HydraConfig.initialized():
                hydra_cfg = HydraConfig.get()
                runtime = _runtime_facts(hydra_cfg.runtime) if runtime is None else runtime
                overrides = list(hydra_cfg.overrides.task) if overrides is None else overrides
        raise ConfigError(missing_value_message(err.full_key, runtime or {}, overrides or ())) from None


def _runtime_facts(runtime) -> dict:
    """What :func:`missing_value_message` reads of a composition's ``hydra.runtime``: the option chosen for each group
    and the directories searched, as plain values (the node itself goes with the ``hydra`` key it is deleted with)."""
    return {"choices": dict(runtime.choices),
            "config_sources": OmegaConf.to_container(runtime.config_sources, resolve=False)}


def option_file(group: str, option: Optional[str], runtime: dict) -> Optional[str]:
    """The YAML file Hydra read for ``group=option``: the first directory of the search path that holds one (Hydra's
    own order), or None (an option stored in code, or a composition whose search path is not known)."""
    if not option:
        return None
    for source in runtime.get("config_sources") or ():
        if source.get("schema") == "file":
            path = Path(source["path"]) / group / f"{option}.yaml"
            if path.is_file():
                return str(path)
    return None


def shipped_values(key: str) -> Dict[str, object]:
    """The value each option of ``conf/<group>/`` gives ``key`` (``{"full": 0, "lora": 20, ...}``), where it gives one."""
    group, _, sub = key.partition(".")
    values = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        try:
            value = OmegaConf.select(OmegaConf.load(path), sub, default=None, throw_on_missing=False)
        except Exception:  # noqa: BLE001  (an example only: a file it cannot read gives none)
            continue
        if value is not None and not OmegaConf.is_config(value) and value != "???":
            values[path.stem] = value
    return values


def missing_value_message(key: str, runtime: dict, overrides: Sequence[str] = ()) -> str:
    """Why the mandatory ``key`` has no value (``???``) and where it should come from, with the values the shipped
    options give it (the schema's comment in ``rm/foundations/config.py`` says what it means); ``runtime`` as
    :func:`to_run_config` has it.

    >>> missing_value_message("memory_profile.order", {"choices": {"memory_profile": "mine"}}).splitlines()[0]
    'memory_profile.order has no value (??? in the schema, mandatory): memory_profile=mine does not set order.'
    """
    group, _, sub = key.partition(".")
    choices = runtime.get("choices") or {}
    if not sub:  # a whole group, removed (~model) or never chosen
        options = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
        return f"{group}: no option of the group is chosen; choose one with {group}=<option> (options: {options})"
    given = [o for o in overrides if o.lstrip("+~").partition("=")[0] == key]
    option = choices.get(group)
    file = None if given else option_file(group, option, runtime)
    if given:
        where = f"the command line gives {given[-1]}"
    elif option:
        where = f"{group}={option}{f' ({file})' if file else ''} does not set {sub}"
    else:
        where = f"nothing sets {sub}"
    lines = [f"{key} has no value (??? in the schema, mandatory): {where}."]
    shipped = shipped_values(key)
    example = next(iter(shipped.values()), "<value>")
    fix = f"on the command line ({key}={example})"
    if not given:
        fix = f"in {file or 'the YAML file'} ({sub}: {example}) or {fix}"
    lines.append(f"Give it a value {fix}" + (f"; conf/{group}/'s options set it so: "
                                             + ", ".join(f"{name} {value}" for name, value in shipped.items())
                                             if shipped else ""))
    return "\n".join(lines)


register_configs()


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@contextlib.contextmanager
def _compose_api() -> Iterator[None]:
    """Hydra's compose API: the running app's where there is one, else initialised on ``conf/`` for the call."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        yield


def _with_search_path(overrides: Sequence[str]) -> List[str]:
    """``overrides``, after the running Hydra app's ``hydra.searchpath`` unless they set one: a composition made
    inside the app (a suggestion's, another profile's) must find the config directories the app's own found, and
    Hydra keeps a command line's ``hydra.searchpath`` out of the task overrides that the app passes on."""
    from hydra.core.hydra_config import HydraConfig

    if any(o.lstrip("+~").startswith("hydra.searchpath=") for o in overrides) or not HydraConfig.initialized():
        return list(overrides)
    paths = list(HydraConfig.get().searchpath)
    if not paths:
        return list(overrides)
    return [f"hydra.searchpath=[{','.join(repr(str(p)) for p in paths)}]", *overrides]


def compose(overrides: List[str]) -> RunConfig:
    """Compose ``conf/`` with overrides into typed objects, inside or outside a running Hydra app (whose
    ``hydra.searchpath`` it keeps)."""
    from hydra import compose as hydra_compose

    overrides = _with_search_path(overrides)
    with _compose_api():
        raw = hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    runtime = _runtime_facts(raw.hydra.runtime)  # this composition's options and files, not the running app's
    with open_dict(raw):
        del raw["hydra"]
    return to_run_config(raw, runtime, overrides)


def memory_profiles(overrides: Sequence[str] = ()) -> List[MemoryProfileConfig]:
    """Every memory profile, in its ``order``: each ``memory_profile/<name>.yaml`` on Hydra's config search path
    (``conf/``, and the directories of a ``hydra.searchpath`` in ``overrides`` or in the running app).

    The one list of profiles: ``rm.plan`` searches these, a refused run's suggestions try these
    (:mod:`rm.memory.suggest`), ``rm.gpu_report`` estimates each. A new profile is its YAML file alone.

    Args:
        overrides: a command line; only its ``hydra.searchpath`` is read.
    """
    from hydra import compose as hydra_compose
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import MissingMandatoryValue

    search = [o for o in _with_search_path(overrides) if o.lstrip("+~").startswith("hydra.searchpath=")]
    with _compose_api():
        names = [name for name in GlobalHydra.instance().config_loader().get_group_options("memory_profile", overrides=search)
                 if name != "base_memory_profile"]  # the schema, stored beside the options (register_configs)
        # One composition for all of them, each at its own package (a package cannot be a name like 8bit): one
        # Hydra composition costs about as much as one profile's, and rm.plan's search waits for it.
        try:
            raw = hydra_compose(config_name=None, overrides=[*search, *(f"+memory_profile@profiles.p{i}={name}"
                                                                       for i, name in enumerate(names))],
                                return_hydra_config=True)
        except ConfigCompositionException as err:  # a profile file of the user's with a value of the wrong type
            sources = hydra_compose(config_name=None, overrides=search, return_hydra_config=True)
            raise ConfigError(_broken_profile_message(str(err), _runtime_facts(sources.hydra.runtime))) from None
    runtime = _runtime_facts(raw.hydra.runtime)
    profiles = []
    for i, name in enumerate(names):
        try:
            profiles.append(OmegaConf.to_object(raw.profiles[f"p{i}"]))
        except MissingMandatoryValue as err:  # a profile file of the user's that leaves out a mandatory key
            key = "memory_profile." + err.full_key.split(".", 2)[2]  # profiles.p3.order -> memory_profile.order
            raise ConfigError(missing_value_message(key, {**runtime, "choices": {"memory_profile": name}})) from None
    return sorted(profiles, key=lambda p: (p.order, p.name))


def _broken_profile_message(hydra_message: str, runtime: dict) -> str:
    """Hydra's error for the composition of every profile (:func:`memory_profiles`), about the one profile it names, by
    its file and the key as a run names it (``memory_profile.order``, not the listing's ``profiles.p3.order``).

    >>> _broken_profile_message("In 'memory_profile/bad': ValidationError raised while composing config:\\nValue 'abc' "
    ...                         "of type 'str' could not be converted to Integer\\n    full_key: profiles.p1.order", {})
    "memory_profile=bad cannot be read: memory_profile.order: Value 'abc' of type 'str' could not be converted to Integer. Fix it, or take the file off the config search path (hydra.searchpath)"
    """
    option = re.search(r"In 'memory_profile/([^']+)'", hydra_message)
    key = re.search(r"full_key: profiles\.p\d+\.([\w.]+)", hydra_message)
    # omegaconf's reason is the line after Hydra's "In '<option>': ..."; its own full_key/object_type lines follow
    details = ("full_key:", "object_type=", "reference_type=")
    lines = [line.strip() for line in hydra_message.splitlines()[1:] if line.strip() and not line.strip().startswith(details)]
    reason = lines[0] if lines else hydra_message.splitlines()[0]
    name = option.group(1) if option else None
    file = option_file("memory_profile", name, runtime)
    where = f"memory_profile={name}" + (f" ({file})" if file else "") if name else "a memory profile"
    return (f"{where} cannot be read: {f'memory_profile.{key.group(1)}: ' if key else ''}{reason}. Fix it, or take the "
            "file off the config search path (hydra.searchpath)")


# Hydra flags whose value is a config directory: option lists then come from elsewhere too.
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")


def unknown_names(argv: Optional[List[str]] = None) -> List[str]:
    """Every name on the command line exists, before Hydra composes: a group option (``experiment=tyni``: Hydra drops
    an unknown option of an optional group in silence and composes the flagship), a key (``train.learning_rat=``) or a
    key added to a typed group (``+train.foo=1``: Hydra adds it). Each unknown one is named with its close matches.

    Overrides of ``hydra`` itself, with a package (``group@pkg=``), and values under a ``Dict`` or ``Any`` key are
    left to Hydra; so are the options of groups when a ``--config-dir`` adds a search path.

    Returns:
        One line per unknown name, naming it and the names it is close to (``difflib``); ``[]`` when all exist.
        :func:`rm.foundations.errors.run_hydra_app` makes them a ``ConfigError`` (exit 2).
    """
    import dataclasses
    import difflib
    import typing

    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException


    argv = sys.argv if argv is None else argv
    problems = _unknown_flags(argv)
    args = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return []  # a syntax error: Hydra's own message names it
    repo = ConfigRepository(config_search_path=create_config_search_path(str(CONF_DIR)))
    # A --config-dir or a hydra.searchpath adds options this search path does not hold: those are Hydra's to check.
    check_options = not any(a.split("=", 1)[0].lstrip("+") in _CONFIG_DIR_FLAGS + ("hydra.searchpath",) for a in argv[1:])

    def close(name: str, names, prefix: str = "") -> str:
        # 0.5: a swapped pair of letters in a short name ('tyni' for 'tiny') scores 0.5
        near = difflib.get_close_matches(name, list(dict.fromkeys(names)), n=3, cutoff=0.5)
        return f"; did you mean {' or '.join(prefix + n for n in near)}?" if near else ""

    for override in overrides:
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or override.package is not None or override.is_delete():
            continue
        if "." not in key and repo.group_exists(key):
            if not check_options:
                continue
            options = repo.get_group_options(key, results_filter=ObjectType.CONFIG)
            shown = [o for o in options if not o.startswith("base_")]  # the schemas stored for the YAML files' defaults
            value = override.value()
            values = value.list if isinstance(value, ChoiceSweep) else value if isinstance(value, list) else [value]
            for option in values:
                if isinstance(option, str) and option not in options:
                    problems.append(f"{key}={option}: {key} has no option {option!r}{close(option, shown)} "
                                    f"(options: {', '.join(shown)})")
            continue
        if key in MOVED_KEYS:  # an old name: composition says where it went (rm.foundations.config.moved_key_errors)
            continue
        node, path = RunConfig, []
        for part in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(node)}
            if part not in fields:
                where = ".".join(path) or "the config (a group or a key)"
                prefix = "".join(p + "." for p in path)
                if path:  # the group's nested keys too: train.learning_rat -> train.optim.learning_rate
                    leaves = _leaves(node)
                    near = difflib.get_close_matches(part, list(dict.fromkeys(leaves)), n=3, cutoff=0.5)
                    hint = f"; did you mean {' or '.join(prefix + n for n in dict.fromkeys(leaves[m] for m in near))}?" if near else ""
                else:
                    names = list(fields) + [g for g in repo.get_group_options("", ObjectType.GROUP) if g != "hydra"]
                    hint = close(part, names)
                problems.append(f"{key}: {where} has no key {part!r}{hint}")
                break
            path.append(part)
            node = typing.get_type_hints(node).get(part)
            node = next((a for a in typing.get_args(node) if dataclasses.is_dataclass(a)), node)  # Optional[X]
            if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
                break  # a value, a Dict or a List: Hydra checks it
    return problems


def _unknown_flags(argv: List[str]) -> List[str]:
    """Each ``--name`` on the command line that is not one of Hydra's own flags, written as it is meant: an override.

    Hydra's argparse takes an abbreviation of a flag for the flag: ``--experiment=tiny`` is ``--experimental-rerun
    tiny``, which fails with "File tiny does not exist!" as a traceback and exit 1 (and any other override is ignored).
    """
    from hydra._internal.utils import get_args_parser

    flags = get_args_parser()._option_string_actions  # noqa: SLF001  (Hydra's flags, as its own parser knows them)
    problems = []
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        if arg == "--" or not arg.startswith("--") or name in flags:
            continue
        meant = arg[2:] if "=" in arg else f"{arg[2:]}=<value>"
        problems.append(f"{arg}: not an option of rm's commands, which take overrides: write {meant} (no dashes); "
                        "Hydra's own flags are " + ", ".join(sorted(f for f in flags if f.startswith("--"))))
    return problems


def _leaves(node) -> dict:
    """Each key of the dataclass ``node`` and of the dataclasses nested in it, by its last name: ``{name: dotted key}``
    (the shallower key wins a name held by two)."""
    import dataclasses
    import typing

    found: dict = {}
    for f in dataclasses.fields(node):
        found.setdefault(f.name, f.name)
    for f in dataclasses.fields(node):
        child = typing.get_type_hints(node).get(f.name)
        if isinstance(child, type) and dataclasses.is_dataclass(child):
            for name, key in _leaves(child).items():
                found.setdefault(name, f"{f.name}.{key}")
    return found


NAME_CHECKS.append(unknown_names)  # run_hydra_app runs it before Hydra composes
