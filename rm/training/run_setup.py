"""Everything a training run holds before its first step, built once into one :class:`Run`.

The order keeps a refused run from touching an earlier run's files: settings and memory first
(:mod:`rm.memory.preflight`), then the tokenizer and the data (each checked before anything is written), the layout
``train.layout=auto`` picks for that data (:mod:`rm.plan.auto`), the engine, the memory verdict at the data's own micro-batches
and a resume's comparison with its checkpoint; only then is the run directory claimed (:meth:`rm.runs.run_dir.RunDir.claim`),
then the model is built, and last the checkpoint to resume from is loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from torch.optim.lr_scheduler import LambdaLR

from rm.foundations.threads import apply_threads, resumed_threads
from rm.foundations.config import EPOCHS_WARNED, HealthConfig, MemoryProfileConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from rm.data.audit import format_audit, write_audit
from rm.data.batching import StepBatches, steps_per_epoch, total_training_steps  # noqa: F401  (imported from here too)
from rm.data.build import (build_datasets, build_extra_eval_sets, check_data_files, check_enough_pairs, split_identity,
                           train_pairs)
from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator, common_prefix_length
from rm.distributed.engine import AccelerateEngine, DeepSpeedEngine, Engine, deepspeed_config
from rm.training.health import HealthMonitor
from rm.modelling.loss import PairLoss, build_loss
from rm.foundations.lost_updates import LostUpdateProbe
from rm.memory.terms import Estimate, parameter_counts
from rm.memory.monitor import MemoryMonitor
from rm.evaluation.metrics import MetricsLog
from rm.plan.auto import LayoutChoice, choose_layout
from rm.plan.lengths import lengths_of
from rm.modelling.model import (build_model, build_optimizer, build_reward_model, check_pretrained_source,
                                compile_decoder_layers, count_parameters, fp32_head_enabled, quantization_state_tensors,
                                random_init_saved)
from rm.data.shapes import BatchShapes, data_shapes, layout_of
from rm.data.tokenise import pair_lengths
from rm.foundations.precision import SHORT
from rm.foundations.cli import DETAIL
from rm.memory.preflight import data_preflight, plan_run
from rm.runs.resume import data_digest, fingerprint
from rm.runs.run_dir import RunDir
from rm.runs.train_state import TrainState
from rm.data.tokenizer import check_consumers_tokenize_alike, check_tokenizer_fits, run_tokenizer, save_tokenizer, tokenizer_kind
from rm.settings.validate import Plan

log = logging.getLogger("rm.train")  # these lines belong to the training command's log


@dataclass
class Run:
    """A training run as :func:`setup` builds it: what the loop, the checkpoints and the export read.

    Attributes:
        cfg: the config as composed, with the layout ``train.layout=auto`` chose (:mod:`rm.plan.auto`); never changed
            after that. What the run resolved is in ``plan``.
        plan: the values derived and resolved once (``rm.settings.validate``, ``rm.memory.preflight``).
        estimate: the pre-flight memory estimate sized at the largest micro-batch this data forms
            (:func:`rm.memory.preflight.data_preflight`; ``None`` with ``preflight=off``).
        dir: the run directory (``rm.runs.run_dir``): its checkpoints, its metrics, what may change in it.
        collator: pads pairs for evaluation and the export's probe; ``train_collator`` lays out training
            micro-batches (``train.packing``, ``train.share_prefix``).
        loss: the loss training and evaluation compute (:func:`rm.modelling.loss.build_loss`), the one the estimate traced.
        health: the training-health checks (``rm.training.health``); ``metrics``: ``metrics.jsonl`` and TensorBoard.
        monitor: measures the memory peak (``rm.memory.monitor``).
        state: the loop's state, saved in every checkpoint (``rm.runs.train_state``).
        eval_metrics, eval_scores: the last evaluation's metrics, and its rewards per pair (for the plots).
    """

    cfg: RunConfig
    plan: Plan
    estimate: Optional[Estimate]
    dir: RunDir
    engine: Engine
    tokenizer: Any
    train_set: Any
    eval_set: Optional[Any]
    extra_eval_sets: Dict[str, Any]
    collator: PairCollator
    train_collator: Callable
    model: torch.nn.Module
    loss: PairLoss
    health: HealthMonitor
    metrics: MetricsLog
    monitor: MemoryMonitor
    batches: StepBatches  # this process's micro-batches at each step (rm.data.batching)
    total_steps: int
    state: TrainState
    eval_metrics: Dict[str, float] = field(default_factory=dict)
    eval_scores: Dict = field(default_factory=dict)
    layout: Optional[LayoutChoice] = None  # train.layout=auto's choice and the step time it predicted
    step_time_checked: bool = False  # the measured step time was held against that prediction once


def setup(cfg: RunConfig, directory: RunDir, overrides: Sequence[str], cleanup: ExitStack) -> Run:
    """Validate, estimate, and build everything the loop needs; restore a checkpoint with ``train.checkpoint.resume``.

    Args:
        cfg: the typed config; read, never changed (``train.layout=auto``'s choice is a new config, ``Run.cfg``).
        directory: the run directory, entered (locked and accepted on the main process); claimed here once every check
            that can refuse the run has passed.
        overrides: the Hydra overrides ``cfg`` came from (:func:`rm.memory.preflight.preflight`).
        cleanup: undoes the memory monitor's dispatch mode however the run ends.
    """
    check_data_files(cfg.data)  # every missing file named at once, before the estimate's table
    plan, estimate = plan_run(cfg, overrides)
    check_pretrained_source(cfg.model)  # a Hub id that cannot be fetched: named here, before the data pass

    # model.tokenizer=bpe is trained on the train split's texts and kept in the run directory; a resumed run reads it
    # back, so its checkpoints meet the tokenizer they were trained with.
    resuming = directory.resuming
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data), saved=directory.tokenizer_dir if resuming else None,
                              texts_identity=split_identity(cfg.data, "train"))
    check_tokenizer_fits(cfg.model, tokenizer)  # ids beyond model.vocab_size would fail mid-forward
    train_set, eval_set, data_audit = build_datasets(cfg.data, tokenizer)
    check_enough_pairs(cfg.data, cfg.train, len(train_set), plan.world_size)  # the batches of a step would be cut from fewer pairs than they hold
    extra_eval_sets = build_extra_eval_sets(cfg.data, tokenizer)  # data.extra_eval_files, reported as eval_<name>_*
    # The exported model's readers must see the tokens training saw, on texts like the run's own.
    check_consumers_tokenize_alike(cfg.model, tokenizer, tuple(tokenizer.batch_decode(train_set["chosen_input_ids"][:64],
                                                                                      skip_special_tokens=True)),
                                   append_eos=cfg.data.append_eos)
    # train.layout=auto picks the layout by this data's lengths, before the engine (DeepSpeed's config holds the
    # micro-batch) and the model (checkpointing) are built; every rank computes the same choice from the same data.
    lengths = lengths_of(train_set, [eval_set, *extra_eval_sets.values()], f"data={cfg.data.name}")
    cfg, plan, layout = choose_layout(cfg, plan, overrides, lengths,
                                      pinned=directory.saved_fingerprint() if resuming else None)
    if layout is not None:
        log.info("%s", layout.describe(), extra=DETAIL)  # the summary's layout line says it again
        overrides = [*overrides, *layout.changed]  # what the pre-flight composes its suggestions with
    t = cfg.train
    engine = _start_engine(cfg, plan, directory)
    cleanup.callback(engine.release)  # a sweep's next job starts without this one's process group (a refusal below too)
    run_dir = directory.path
    total_steps = total_training_steps(t, len(train_set))
    warn_many_epochs(t, total_steps, len(train_set))
    # rows are prefix + both suffixes: the budget, the grouping and the estimate count those tokens
    shared = log_prefix_sharing(train_set) if t.share_prefix else None
    batches = StepBatches.of(
        train_set, global_batch_size=t.global_batch_size, micro_batch_size=plan.micro_batch_size,
        world_size=plan.world_size, rank=engine.process_index, seed=t.seed, group_by_length=t.group_by_length,
        max_tokens=t.max_tokens_per_micro_batch, shared_tokens=shared,
    )
    # The verdict, before the model is built and before an earlier run's files are replaced: the estimate
    # sized at the micro-batches this data forms, not at the worst case the config allows.
    if estimate is not None:
        evaluated = [eval_set, *extra_eval_sets.values()]
        shapes = run_shapes(t, batches, total_steps, train_set, shared, evaluated)
        cached = random_init_cached_everywhere(cfg.model, cfg.memory_profile, tokenizer.pad_token_id)
        estimate = data_preflight(cfg, plan, overrides, shapes, random_init_cached=cached)
    # A resume's comparison with its checkpoint, the last check that can refuse the run; only then is the directory
    # this run's (train.checkpoint.overwrite=true deletes the earlier run there): a refused start changes no file of an earlier run.
    current = fingerprint(cfg, plan, data_digest(train_set))  # saved with each checkpoint, compared on resume
    directory.check_resume(t, current, total_steps)
    directory.claim()
    if engine.is_main_process and plan.strategy == "deepspeed":  # what DeepSpeed was given, generated, never edited
        (run_dir / "deepspeed_config.json").write_text(json.dumps(engine.config, indent=2))
    # Saved only now: a run refused for its data or settings leaves an earlier run's files as they were.
    if engine.is_main_process and tokenizer_kind(cfg.model) == "bpe" and not resuming:
        save_tokenizer(tokenizer, directory.tokenizer_dir)
    if engine.is_main_process:  # written only once every split is built: no audit of a run that refused its data
        write_audit(run_dir / "data_audit.json", data_audit)
    log.info("%s", format_audit(data_audit), extra=DETAIL)

    metrics = directory.metrics(tensorboard=t.logging.tensorboard)
    health = HealthMonitor.from_config(  # training-health alarms (rm.training.health), written to metrics.jsonl
        cfg.health, metrics=metrics, is_main_process=engine.is_main_process,
        loss_scaling=plan.numerics.compute == "float16",
    )
    health.check_data(tokenizer.pad_token_id, tokenizer.pad_token, data_audit)  # no pad id at all: ConfigError
    collator = PairCollator(tokenizer.pad_token_id)
    train_collator = PackedPairCollator() if t.packing else collator  # train.packing: one row of real tokens, no pads
    if t.share_prefix:  # one sequence per pair, the shared prompt computed once (several pairs per row when packing)
        train_collator = PrefixSharedCollator(packed=t.packing, pad_token_id=tokenizer.pad_token_id)
    # Started before the model exists: everything the step's peak holds (weights, the engine's buckets and
    # partitions, restored states) is counted as it is allocated.
    monitor = MemoryMonitor(engine.device, track_cpu_tensors=t.logging.track_memory).start()
    cleanup.callback(monitor.stop)
    model = _build_model(cfg, plan, engine, tokenizer.pad_token_id, monitor, total_steps)
    log.info(summary(cfg, plan, engine, total_steps, len(train_set), layout, estimate, run_dir))
    watch_lost_updates(health, engine, cfg.health, cfg.train, total_steps)

    start_step, record = directory.restore(engine, t, current, total_steps) if t.checkpoint.resume else (0, None)
    directory.remove_abandoned()  # what a run stopped mid-write left; only now that this run goes ahead
    kept = resumed_threads(plan.threads, (record or {}).get("torch_threads"))
    if kept is not None:
        apply_threads(kept)
    state = TrainState.start(engine.device, record, start_step, engine.is_main_process, fingerprint=current)
    health.load_state_dict(state.health)
    directory.resume_metrics(metrics, start_step)
    # Anything made before the monitor started (buffers, states held outside the dispatcher) counts too.
    monitor.register(engine.state_tensors())
    return Run(cfg=cfg, plan=plan, estimate=estimate, dir=directory, engine=engine, tokenizer=tokenizer,
               train_set=train_set, eval_set=eval_set, extra_eval_sets=extra_eval_sets, collator=collator,
               train_collator=train_collator, model=model, loss=build_loss(cfg.train, cfg.data), health=health, metrics=metrics, monitor=monitor,
               batches=batches, total_steps=total_steps, state=state, layout=layout)


def random_init_cached_everywhere(model_cfg: ModelConfig, profile: MemoryProfileConfig, pad_token_id: int) -> bool:
    """QLoRA from a shape: whether every process finds the shape's random init saved, so that none builds it
    (``rm.modelling.model.saved_random_init``; the estimate counts the build otherwise). A collective where several processes
    run, which every rank reaches before any of them builds: all ranks decide on the same answer, and none can see
    an init another rank saved after it looked."""
    if profile.quantize_base == "none" or model_cfg.pretrained:
        return True  # nothing to build
    cached = random_init_saved(model_cfg, pad_token_id)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everywhere = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, cached)
        cached = all(everywhere)
    return cached


def run_shapes(train_cfg: TrainConfig, batches: StepBatches, total_steps: int, train_set, shared: Optional[Sequence[int]],
               eval_sets: Sequence) -> List[BatchShapes]:
    """Per rank, the largest training micro-batch and evaluation forward of the run (:func:`rm.data.shapes.data_shapes`).

    Every step from 0 counts, a resumed run's too: its estimate is the uninterrupted run's.

    Args:
        shared: per training pair, its prefix-shared row's tokens (``train.share_prefix``), else ``None``.
        eval_sets: the sets evaluation scores (``None`` entries skipped).
    """
    t = train_cfg
    chosen, rejected = pair_lengths(train_set)
    return data_shapes(batches, total_steps, layout_of(t.packing, t.share_prefix), chosen, rejected,
                       shared,
                       [pair_lengths(ds) for ds in eval_sets if ds is not None], t.eval_batch_size)


def _start_engine(cfg: RunConfig, plan: Plan, directory: RunDir) -> Engine:
    """The engine, and the seed set; torch's threads stay ``train.threads``' choice."""
    engine = build_engine(cfg, plan)
    if torch.get_num_threads() != plan.threads.count:
        # accelerate's CPU process group (torchrun with one process, OMP_NUM_THREADS unset) sets them to the
        # machine's physical cores, which ignores this process's CPU affinity and the load train.threads=0 read.
        torch.set_num_threads(plan.threads.count)
    set_seed(cfg.train.seed)
    return engine


def build_engine(cfg: RunConfig, plan: Plan) -> Engine:
    """The engine the plan asks for: DeepSpeed's for ZeRO, accelerate's for one process or DDP."""
    t = cfg.train.optim
    if plan.strategy == "deepspeed":
        config = deepspeed_config(
            micro_batch_size=plan.micro_batch_size,
            gradient_accumulation_steps=plan.gradient_accumulation_steps,
            world_size=plan.world_size,
            precision=plan.precision,
            max_grad_norm=t.max_grad_norm,
            zero_stage=plan.zero_stage,
            offload_optimizer=cfg.memory_profile.offload_optimizer,
            offload_params=cfg.distributed.offload_params,
            optimizer_params={
                "lr": t.learning_rate, "betas": (t.adam_beta1, t.adam_beta2), "eps": t.adam_epsilon, "weight_decay": t.weight_decay,
            },
            hidden_size=cfg.model.hidden_size,
            trainable_params=parameter_counts(cfg.model, cfg.lora if cfg.memory_profile.use_lora else None).trainable,
        )
        return DeepSpeedEngine(cpu=plan.device == "cpu", config=config)
    return AccelerateEngine(
        cpu=plan.device == "cpu", precision=plan.precision,
        gradient_accumulation_steps=plan.gradient_accumulation_steps, max_grad_norm=t.max_grad_norm,
    )


def _build_model(cfg: RunConfig, plan: Plan, engine: Engine, pad_token_id: int, monitor: MemoryMonitor,
                 total_steps: int) -> torch.nn.Module:
    """The reward model with its memory profile, prepared by the engine with optimizer and schedule."""
    t = cfg.train
    model = build_reward_model(
        cfg.model, cfg.memory_profile, cfg.lora, numerics=plan.numerics, gradient_checkpointing=t.gradient_checkpointing,
        fp32_head=fp32_head_enabled(cfg.health.fp32_head, plan.precision), pad_token_id=pad_token_id,
        device=init_device(cfg.model, plan, engine),
    )
    monitor.register(model.parameters())
    monitor.register(quantization_state_tensors(model))
    if t.compile:  # after PEFT and checkpointing wrap the layers, before the engine wraps the model (torchtitan's order)
        log.info("train.compile: compiling each of %d decoder layers at its first call", compile_decoder_layers(model))
    return engine.prepare(
        model,
        lambda m: build_optimizer(m, cfg.memory_profile, t.optim),
        lambda opt: lr_schedule(t.optim.lr_scheduler_type, opt, warmup_steps(t.optim, total_steps), total_steps),
    )


def lr_schedule(kind: str, optimizer: torch.optim.Optimizer, warmup: int, total: int) -> LambdaLR:
    """transformers' ``get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)`` for the
    three ``train.optim.lr_scheduler_type`` values rm accepts: the same ``LambdaLR`` over a ``functools.partial`` (so a
    checkpoint of either loads in the other), the same factor at every step (``tests/foundations/test_startup_cache.py`` holds
    them equal). Not imported from ``transformers.optimization``, which imports ``transformers.trainer_utils`` and
    with it PEFT and bitsandbytes (which compiles its CPU ops as it loads) into every run, LoRA or not."""
    return LambdaLR(optimizer, functools.partial(lr_factor, kind=kind, warmup=warmup, total=total))


def lr_factor(step: int, *, kind: str, warmup: int, total: int) -> float:
    """The learning rate's factor after ``step`` optimizer steps: linear warmup from 0 over ``warmup`` steps, then
    ``linear`` decay to 0 at ``total``, half a ``cosine`` period to 0 at ``total``, or ``constant_with_warmup``.

    >>> [round(lr_factor(s, kind="cosine", warmup=2, total=6), 3) for s in range(7)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0]
    >>> [lr_factor(s, kind="linear", warmup=1, total=3) for s in range(4)], lr_factor(5, kind="constant_with_warmup", warmup=2, total=3)
    ([0.0, 1.0, 0.5, 0.0], 1.0)
    """
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "constant_with_warmup":
        return 1.0
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    if kind == "cosine":  # transformers' num_cycles=0.5: pi x 0.5 x 2 x progress, which is pi x progress exactly
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"train.optim.lr_scheduler_type={kind!r}: rm schedules linear, cosine or constant_with_warmup")


def warmup_steps(optim_cfg: OptimConfig, total_steps: int) -> int:
    """The schedule's warmup, in optimizer steps."""
    return math.ceil(optim_cfg.warmup_ratio * total_steps)


def watch_lost_updates(health: HealthMonitor, engine: Engine, health_cfg: HealthConfig, train_cfg: TrainConfig,
                       total_steps: int) -> None:
    """Attach the lost-update probe (``rm.foundations.lost_updates``) where the optimizer updates the module's own weights."""
    if not health_cfg.lost_updates_threshold:
        return
    if train_cfg.optim.kahan_summation:
        log.info("health: lost updates not measured: with train.optim.kahan_summation the optimizer keeps what rounding drops "
                 "from a bf16 weight in its compensation buffer, so an unchanged weight is no lost update")
        return
    params = engine.stepped_parameters()
    if params is None:
        log.info("health: lost updates not measured: DeepSpeed updates fp32 master partitions of the weights, not "
                 "the module's weights, and an unchanged bf16 copy is no lost update")
        return
    health.watch_updates(LostUpdateProbe(params, seed=train_cfg.seed), warmup_steps(train_cfg.optim, total_steps))


def init_device(model_cfg: ModelConfig, plan: Plan, engine: Engine) -> Optional[torch.device]:
    """Where a model built from its shape draws its random init: the GPU it trains on (seconds for a 7B shape, where
    the CPU takes minutes), since every engine moves the whole model there anyway, except ZeRO-3, which partitions it
    first; ``None`` (the CPU) otherwise. The seed draws other numbers on another device, so the rebuilt base of an
    exported adapter (:func:`rebuild_base`) must be drawn where the trained one was."""
    zero3 = plan.strategy == "deepspeed" and plan.zero_stage == 3
    return engine.device if model_cfg.pretrained is None and engine.device.type == "cuda" and not zero3 else None


def rebuild_base(run: Run) -> torch.nn.Module:
    """What an adapter is reloaded onto when the export checks it: a random-init base is rebuilt from its seed, on
    the device it was first drawn on."""
    set_seed(run.cfg.train.seed)
    return build_model(run.cfg.model, run.tokenizer.pad_token_id, run.plan.numerics.frozen, False,
                       run.cfg.memory_profile.quantize_base, init_device(run.cfg.model, run.plan, run.engine))


def warn_many_epochs(t: TrainConfig, total_steps: int, num_pairs: int) -> Optional[str]:
    """Warn (and return the warning) where the run passes over its training pairs more than
    :data:`~rm.foundations.config.EPOCHS_WARNED` times: ``experiment=tiny``'s 800 steps on a file of 300 pairs
    are 85 epochs, and a reward model overfits long before.

    >>> from rm.foundations.config import TrainConfig
    >>> warn_many_epochs(TrainConfig(max_steps=800, global_batch_size=32), 800, 300)[:71]
    'train.max_steps=800 x train.global_batch_size=32 = 25,600 pairs trained'
    >>> warn_many_epochs(TrainConfig(max_steps=9), 9, 300) is None
    True
    """
    epochs = total_steps * t.global_batch_size / num_pairs
    if epochs <= EPOCHS_WARNED:
        return None
    per_epoch = steps_per_epoch(num_pairs, t.global_batch_size)
    asked = (f"train.max_steps={t.max_steps} x train.global_batch_size={t.global_batch_size}" if t.max_steps > 0
             else f"train.num_train_epochs={t.num_train_epochs:g}")
    message = (f"{asked} = {total_steps * t.global_batch_size:,} pairs trained: {epochs:.1f} epochs of the {num_pairs:,} "
               f"training pairs, where a reward model overfits after a few (eval loss rises). For 1 epoch: "
               f"train.max_steps={per_epoch} ({per_epoch} steps an epoch), or train.max_steps=-1 train.num_train_epochs=1; "
               f"or give more pairs")
    log.warning("%s", message)
    return message


def summary(cfg: RunConfig, plan: Plan, engine: Engine, total_steps: int, num_pairs: int,
            layout: Optional[LayoutChoice] = None, estimate: Optional[Estimate] = None, run_dir: Optional[Path] = None) -> str:
    """What runs, the first block a run prints on the console (rm.foundations.quiet.FirstScreen); train.log has the rest."""
    trainable, total = count_parameters(engine.unwrapped_model())
    t = cfg.train
    states = "CPU (ZeRO-Offload)" if cfg.memory_profile.offload_optimizer else plan.device
    sharding = f"DeepSpeed ZeRO-{plan.zero_stage}" if plan.strategy == "deepspeed" else ("DDP" if plan.world_size > 1 else "one process")
    lines = [
        f"model            {cfg.model.name} ({cfg.model.pretrained or 'random init from shape'})",
        f"parameters       {total:,} total, {trainable:,} trainable ({100 * trainable / total:.3f}%)",
        f"memory profile   {cfg.memory_profile.name}: {engine.optimizer_name()}, optimizer states on {states}"
        + (f", LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} on {','.join(cfg.lora.target_modules)}" if cfg.memory_profile.use_lora else ""),
        f"precision        {dtypes(cfg.memory_profile, cfg.health, plan)}",
        f"hardware         {plan.hardware.name}: {plan.device}, {plan.hardware.device_memory_gib} GiB/device",
        f"distributed      {sharding}, {plan.world_size} process(es)",
        f"batch            {plan.micro_batch_size} pairs/micro-batch x {plan.gradient_accumulation_steps} accumulation"
        f" x {plan.world_size} processes = {t.global_batch_size} pairs/step",
        f"tokens per step  at most {plan.max_tokens_per_step:,} ({t.global_batch_size} pairs x 2 x max_length {cfg.data.max_length})",
        f"schedule         {total_steps} steps = {total_steps * t.global_batch_size / num_pairs:.2f} epochs of {num_pairs:,} pairs,"
        f" lr {t.optim.learning_rate:g} {t.optim.lr_scheduler_type}, warmup {t.optim.warmup_ratio:g}",
        f"gradient ckpt    {'on' if t.gradient_checkpointing else 'off'}"
        + ("; each decoder layer compiled (train.compile)" if t.compile else ""),
        f"layout           {layout_of(t.packing, t.share_prefix)}"
        + (f", token budget {t.max_tokens_per_micro_batch}" if t.max_tokens_per_micro_batch else "")
        + (", grouped by length" if t.group_by_length else "")
        + (f"; train.layout=auto: {' '.join(layout.changed) or 'as configured'} ({layout.reason})" if layout else
           "; train.layout=given"),
        "memory           " + (f"peak {_size(estimate.peak_bytes)} of {_size(estimate.usable_bytes)} usable per device "
                               "(pre-flight estimate at this data's micro-batches)" if estimate else "not estimated (preflight=off)"),
    ]
    if run_dir is not None:
        lines.append(f"output           {run_dir} (train.log: every line, the memory table, the data audit)")
    return "run summary\n  " + "\n  ".join(lines)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def dtypes(profile: MemoryProfileConfig, health_cfg: HealthConfig, plan: Plan) -> str:
    """Where precision lives, in words, as the profile and engine set it up (``rm.foundations.precision``)."""
    n, short = plan.numerics, SHORT
    # PEFT upcasts adapters to fp32; its trainable copy of the reward head keeps the head's dtype. DeepSpeed casts
    # every module weight to its compute dtype (the head still computes in fp32).
    head = "fp32" if fp32_head_enabled(health_cfg.fp32_head, plan.precision) and plan.strategy != "deepspeed" else short[n.weights]
    trained = f"adapters fp32 + head {head}" if profile.use_lora else short[n.weights]
    if not profile.use_lora and head != short[n.weights]:
        trained += " (reward head fp32)"
    master = f"{short[n.master]} master weights + " if n.master else ""
    if plan.strategy == "deepspeed":
        states = f"{master}{short[n.states]} AdamW states (DeepSpeed)"
    elif profile.optimizer == "adamw_8bit":
        states = "8-bit AdamW states (fp32 for tensors under 4096 elements)"
    else:
        states = f"AdamW states {short[n.states] if not profile.use_lora else 'fp32'}"
    frozen = f"frozen base {'4-bit NF4' if profile.quantize_base != 'none' else short[n.frozen]}, " if profile.use_lora else ""
    compute = f"{short[n.compute]} under autocast" if n.autocast else short[n.compute]
    return f"{plan.precision}: {frozen}trained weights {trained}, gradients alike, {states}; compute {compute}"


def log_prefix_sharing(train_set) -> list:
    """Tokens per pair once its prompt is shared (``train.share_prefix``); logs what sharing saves.

    Returns:
        Per training pair, prefix + chosen suffix + rejected suffix tokens: what the token budget counts.
    """
    # Both columns read once as Python lists (Arrow's own conversion): iterating the dataset's columns goes through
    # its row formatter, seconds for the demo's 16,000 pairs.
    arrow = train_set.with_format("arrow")
    chosen, rejected = arrow["chosen_input_ids"].to_pylist(), arrow["rejected_input_ids"].to_pylist()
    prefix = [common_prefix_length(c, r) for c, r in zip(chosen, rejected)]
    both = sum(len(c) + len(r) for c, r in zip(chosen, rejected))
    shared = both - sum(prefix)
    log.info("train.share_prefix: shared prefix : suffix tokens = %.2f : 1; %s tokens computed instead of %s (%.2fx fewer)",
             sum(prefix) / max(1, shared - sum(prefix)), f"{shared:,}", f"{both:,}", both / max(1, shared), extra=DETAIL)
    return [len(c) + len(r) - n for c, r, n in zip(chosen, rejected, prefix)]
