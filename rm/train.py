"""Train a pairwise (Bradley-Terry) reward model: ``python -m rm.train [hydra overrides]``.

Reads top to bottom: setup (validate, engine), build (tokenizer, data,
model, optimizer), loop (accumulate, clip, step, log, evaluate, checkpoint),
save (a directory that plain transformers loads).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import datasets
import hydra
import torch
from accelerate.utils import set_seed
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers import get_scheduler

from rm.checkpoint import (
    CheckpointError, RunLock, check_run_dir, checkpoint_state, failed_ranks, latest_checkpoint, load_checkpoint,
    raise_save_failure, replace_earlier_run, resume_candidates, save_checkpoint,
)
from rm.config import RunConfig, to_run_config
from rm.data.batching import StepBatches, steps_per_epoch
from rm.data.audit import format_audit, write_audit
from rm.data.build import build_datasets, build_extra_eval_sets, run_tokenizer
from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator, common_prefix_length
from rm.engine import AccelerateEngine, DeepSpeedEngine, Engine, deepspeed_config, join_submitit_tasks
from rm.export import PROBE_PAIRS, export_final, reward_stats_from_eval
from rm.estimate import best_micro_batch, estimate_label, estimate_run, format_suggestions, format_table, parameter_counts, suggestions
from rm.hardware import resolve_hardware
from rm.health import HEAD, SKIP, STOP, HealthMonitor, fp32_head_enabled, keep_head_in_fp32
from rm.loss import bradley_terry_loss
from rm.memory_monitor import MemoryMonitor, gather_snapshots
from rm.sweep import job_record, write_job_record
from rm.train_state import TrainState
from rm.metrics import LineProgressFile, MetricsLog, evaluate_sets, format_eval
from rm.plots import write_eval_plots, write_train_plot
from rm.model import apply_memory_profile, build_model, build_optimizer, count_parameters, pair_rewards, tokenizer_kind
from rm.validate import ConfigError, Plan, check_consumers_tokenize_alike, check_tokenizer_fits, resolve_world_size, validate
from rm.errors import NonFiniteError, Refused, StorageError, boundary, report, run_hydra_app, task_started
from rm.run_record import claim as claim_run_dir, hold_log
from rm.resume import apply_changes, check_resume, data_digest
from rm.resume import fingerprint as fingerprint_of

log = logging.getLogger("rm.train")
TOKENIZER_DIR = "tokenizer"  # in the run directory: the tokenizer model.tokenizer=bpe trained, read back on resume

class StopRequest:
    """Turns SIGTERM (SLURM pre-emption, ``kill``) and SIGINT (Ctrl-C) into a checkpoint and a clean exit.

    The first signal only sets a flag that the loop checks after each optimizer
    step; a second SIGINT interrupts at once.
    """

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("received %s: stopping after this step and writing a checkpoint", signal.Signals(signum).name)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def total_training_steps(cfg: RunConfig, num_pairs: int) -> int:
    per_epoch = steps_per_epoch(num_pairs, cfg.train.global_batch_size)
    if per_epoch == 0:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is larger than the {num_pairs} usable training pairs"
        )
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    return max(1, math.ceil(cfg.train.num_train_epochs * per_epoch))


def summary(cfg: RunConfig, plan: Plan, engine: Engine, total_steps: int, num_pairs: int) -> str:
    trainable, total = count_parameters(engine.unwrapped_model())
    t = cfg.train
    states = "CPU (ZeRO-Offload)" if cfg.memory_profile.offload_optimizer else plan.device
    sharding = f"DeepSpeed ZeRO-{plan.zero_stage}" if plan.strategy == "deepspeed" else ("DDP" if plan.world_size > 1 else "one process")
    lines = [
        f"model            {cfg.model.name} ({cfg.model.pretrained or 'random init from shape'})",
        f"parameters       {total:,} total, {trainable:,} trainable ({100 * trainable / total:.3f}%)",
        f"memory profile   {cfg.memory_profile.name}: {engine.optimizer_name()}, optimizer states on {states}"
        + (f", LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} on {','.join(cfg.lora.target_modules)}" if cfg.memory_profile.use_lora else ""),
        f"precision        {dtypes(cfg, plan)}",
        f"hardware         {cfg.hardware.name}: {plan.device}, {cfg.hardware.device_memory_gib} GiB/device",
        f"distributed      {sharding}, {plan.world_size} process(es)",
        f"batch            {t.micro_batch_size} pairs/micro-batch x {plan.gradient_accumulation_steps} accumulation"
        f" x {plan.world_size} processes = {t.global_batch_size} pairs/step",
        f"tokens per step  at most {plan.max_tokens_per_step:,} ({t.global_batch_size} pairs x 2 x max_length {cfg.data.max_length})",
        f"schedule         {total_steps} steps = {total_steps * t.global_batch_size / num_pairs:.2f} epochs of {num_pairs:,} pairs,"
        f" lr {t.learning_rate:g} {t.lr_scheduler_type}, warmup {t.warmup_ratio:g}",
        f"gradient ckpt    {'on' if t.gradient_checkpointing else 'off'}",
    ]
    return "run summary\n  " + "\n  ".join(lines)


def dtypes(cfg: RunConfig, plan: Plan) -> str:
    """Where precision lives, in words, as the profile and engine set it up."""
    profile = cfg.memory_profile
    base = "4-bit NF4" if profile.quantize_base != "none" else plan.precision
    # PEFT upcasts adapters to fp32; its trainable copy of the reward head keeps the head's dtype.
    head = "fp32" if fp32_head_enabled(cfg.health.fp32_head, plan.precision) and plan.strategy != "deepspeed" else plan.precision
    trained = f"adapters fp32 + head {head}" if profile.use_lora else plan.precision
    if not profile.use_lora and head != plan.precision:
        trained += " (reward head fp32)"
    if plan.strategy == "deepspeed":
        master = "fp32 master weights + " if plan.precision != "fp32" else ""
        states = f"{master}fp32 AdamW states (DeepSpeed)"
    elif profile.optimizer == "adamw_8bit":
        states = "8-bit AdamW states (fp32 for tensors under 4096 elements)"
    else:
        states = "AdamW states like the weights they update"
    frozen = f"frozen base {base}, " if profile.use_lora else ""
    return f"{frozen}trained weights {trained}, gradients alike, {states}; compute {plan.precision}"


def log_prefix_sharing(train_set) -> list:
    """Tokens per pair once its prompt is shared (``train.share_prefix``); logs what sharing saves.

    Returns:
        Per training pair, prefix + chosen suffix + rejected suffix tokens: what the token budget counts.
    """
    chosen, rejected = train_set["chosen_input_ids"], train_set["rejected_input_ids"]
    prefix = [common_prefix_length(c, r) for c, r in zip(chosen, rejected)]
    both = sum(len(c) + len(r) for c, r in zip(chosen, rejected))
    shared = both - sum(prefix)
    log.info("train.share_prefix: shared prefix : suffix tokens = %.2f : 1; %s tokens computed instead of %s (%.2fx fewer)",
             sum(prefix) / max(1, shared - sum(prefix)), f"{shared:,}", f"{both:,}", both / max(1, shared))
    return [len(c) + len(r) - n for c, r, n in zip(chosen, rejected, prefix)]


def build_engine(cfg: RunConfig, plan: Plan) -> Engine:
    """The engine the plan asks for: DeepSpeed's for ZeRO, accelerate's for one process or DDP."""
    t = cfg.train
    if plan.strategy == "deepspeed":
        config = deepspeed_config(
            micro_batch_size=t.micro_batch_size,
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


class PreflightRefusal(Refused):
    """The estimated peak exceeds device memory; the message holds the breakdown and what would fit."""

    def __init__(self, message: str, estimate, fits=()):
        super().__init__(message)
        self.estimate = estimate
        self.fits = list(fits)  # override sets that would fit, cheapest first


def preflight(cfg: RunConfig, plan: Plan, overrides: Sequence[str]):
    """Estimate the peak before anything loads; refuse, warn, or pick the micro-batch, as configured.

    Returns:
        ``(plan, estimate)``; the plan is re-derived when ``preflight.auto_micro_batch`` changed the
        micro-batch. ``estimate`` is ``None`` with ``preflight=off``.
    """
    if cfg.preflight.mode == "off":
        return plan, None
    if cfg.preflight.auto_micro_batch:
        micro = best_micro_batch(list(overrides), cfg, plan)
        if micro is not None and micro != cfg.train.micro_batch_size:
            log.info("preflight.auto_micro_batch: train.micro_batch_size %d -> %d (the global batch stays %d)",
                     cfg.train.micro_batch_size, micro, cfg.train.global_batch_size)
            cfg.train.micro_batch_size = micro
            overrides = [*overrides, f"train.micro_batch_size={micro}"]
            plan = validate(cfg, plan.world_size, plan.world_size_source)
    est = estimate_run(cfg, plan)
    label = estimate_label(cfg, plan)
    table = format_table(est, label)
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


def train(cfg: RunConfig, run_dir: Path, overrides: Sequence[str] = (),
          on_claim: Optional[Callable[[], None]] = None) -> Dict[str, float]:
    """Run one training job into ``run_dir``; return the final eval metrics and the status.

    ``overrides`` are the Hydra overrides the config came from; the pre-flight check
    re-composes them with candidate changes to say which would fit. The run directory is
    locked for the whole job (by the main process: torchrun's ranks are one run).
    ``on_claim`` is called, once per process, as soon as the directory is known to be this run's
    (locked and accepted by ``check_run_dir``): before it, nothing of the directory may change.
    """
    is_main = int(os.environ.get("RANK", "0")) == 0
    # The lock and the memory monitor's dispatch mode are undone however the run ends.
    with RunLock(run_dir) if is_main else nullcontext(), ExitStack() as cleanup:
        replaced = []
        if is_main:  # one process decides (torchrun stops the others if it refuses)
            replaced = check_run_dir(run_dir, cfg.train.resume, cfg.train.overwrite)
            if on_claim is not None:
                on_claim()
        return _train(cfg, Path(run_dir), overrides, cleanup, replaced, on_claim)


def _train(cfg: RunConfig, run_dir: Path, overrides: Sequence[str], cleanup: ExitStack, replaced: List[str],
           on_claim: Optional[Callable[[], None]]) -> Dict[str, float]:
    # ---- setup: validate and estimate memory before anything heavy
    run_dir = Path(run_dir)
    cfg.hardware = resolve_hardware(cfg.hardware)
    plan = validate(cfg, *resolve_world_size(cfg, launched=True))
    plan, estimate = preflight(cfg, plan, overrides)
    t = cfg.train
    engine = build_engine(cfg, plan)
    if not engine.is_main_process and on_claim is not None:  # the main process has accepted the directory by now
        on_claim()
    if engine.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        if plan.strategy == "deepspeed":  # a record of what DeepSpeed was given, generated, never edited
            (run_dir / "deepspeed_config.json").write_text(json.dumps(engine.config, indent=2))
    set_seed(t.seed)

    # ---- build
    # model.tokenizer=bpe is trained on the train split's texts and kept in the run directory; a resumed run reads it
    # back, so its checkpoints meet the tokenizer they were trained with.
    saved_tokenizer = run_dir / TOKENIZER_DIR
    resuming = t.resume and latest_checkpoint(run_dir) is not None
    tokenizer = run_tokenizer(cfg.model, cfg.data, saved=saved_tokenizer if resuming else None)
    check_tokenizer_fits(cfg.model, tokenizer)  # ids beyond model.vocab_size would fail mid-forward
    train_set, eval_set, data_audit = build_datasets(cfg.data, tokenizer)
    extra_eval_sets = build_extra_eval_sets(cfg.data, tokenizer)  # data.extra_eval_files, reported as eval_<name>_*
    # The exported model's readers must see the tokens training saw, on texts like the run's own.
    check_consumers_tokenize_alike(cfg.model, tokenizer, tuple(tokenizer.batch_decode(train_set["chosen_input_ids"][:64])))
    total_steps = total_training_steps(cfg, len(train_set))
    # train.overwrite=true: the earlier run goes only now, once the settings and the data are known to be usable.
    replace_earlier_run(run_dir, replaced)
    # Saved only now: a run refused for its data or settings leaves an earlier run's files as they were.
    if engine.is_main_process and tokenizer_kind(cfg.model) == "bpe" and not resuming:
        tokenizer.save_pretrained(saved_tokenizer)
    if engine.is_main_process:  # written only once every split is built: no audit of a run that refused its data
        write_audit(run_dir / "data_audit.json", data_audit)
    log.info("%s", format_audit(data_audit))
    health = HealthMonitor.from_config(  # training-health alarms (rm.health), written to metrics.jsonl
        cfg.health, metrics=MetricsLog(run_dir, engine.is_main_process), is_main_process=engine.is_main_process,
        loss_scaling=plan.precision == "fp16",
    )
    health.check_data(tokenizer.pad_token_id, tokenizer.pad_token, data_audit)  # no pad id at all: ConfigError
    collator = PairCollator(tokenizer.pad_token_id)
    train_collator = PackedPairCollator() if t.packing else collator  # train.packing: one row of real tokens, no pads
    if t.share_prefix:  # one sequence per pair, the shared prompt computed once (several pairs per row when packing)
        train_collator = PrefixSharedCollator(packed=t.packing, pad_token_id=tokenizer.pad_token_id)
    # Started before the model exists: everything the step's peak holds (weights, the engine's buckets and
    # partitions, restored states) is counted as it is allocated.
    monitor = MemoryMonitor(engine.device, track_cpu_tensors=t.track_memory).start()
    cleanup.callback(monitor.stop)
    model = build_model(
        cfg.model, tokenizer.pad_token_id, plan.precision, t.gradient_checkpointing, cfg.memory_profile.quantize_base
    )
    monitor.register(model.parameters())
    if fp32_head_enabled(cfg.health.fp32_head, plan.precision):
        keep_head_in_fp32(model)  # before PEFT copies the head, so that its trained copy is fp32 too
    model = apply_memory_profile(model, cfg.memory_profile, cfg.lora)
    model = engine.prepare(
        model,
        lambda m: build_optimizer(m, cfg.memory_profile, t.learning_rate, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.adam_epsilon),
        lambda opt: get_scheduler(
            t.lr_scheduler_type, opt, num_warmup_steps=math.ceil(t.warmup_ratio * total_steps), num_training_steps=total_steps
        ),
    )
    log.info(summary(cfg, plan, engine, total_steps, len(train_set)))

    fingerprint = fingerprint_of(cfg, plan.world_size, data_digest(train_set))  # saved with each checkpoint, compared on resume
    start_step, record = resume(engine, run_dir, cfg, fingerprint, total_steps) if t.resume else (0, None)
    state = TrainState.start(engine.device, record, start_step, engine.is_main_process)
    health.load_state_dict(state.health)

    # ---- loop
    per_rank = t.global_batch_size // plan.world_size
    batches = StepBatches.of(
        train_set, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, world_size=plan.world_size,
        rank=engine.process_index, seed=t.seed, group_by_length=t.group_by_length, max_tokens=t.max_tokens_per_micro_batch,
        # rows are prefix + both suffixes: the budget and the grouping count those tokens
        shared_tokens=log_prefix_sharing(train_set) if t.share_prefix else None,
    )
    metrics = MetricsLog(run_dir, engine.is_main_process, tensorboard=t.tensorboard)
    device = engine.device
    eval_metrics: Dict[str, float] = {}
    eval_scores = {}  # per eval set, every pair's rewards and lengths at the last evaluation: the end-of-run plot
    # In a log file (SLURM, CI) a bar redrawn ten times a second buries everything else.
    progress = tqdm(
        total=total_steps, initial=start_step, desc="train", disable=not engine.is_main_process,
        mininterval=0.1 if sys.stderr.isatty() else 30, file=None if sys.stderr.isatty() else LineProgressFile(sys.stderr),
    )
    # Throughput of the whole run for sweep summaries: real tokens over time spent training (not evaluating or saving).
    paused_s, loop_start = 0.0, time.perf_counter()

    def checkpoint() -> Path:  # during a pause, begun at pause_start: the training time ends there
        record = state.record(engine.reduce, pause_start - loop_start - paused_s, health.state_dict())
        return save_checkpoint(engine, run_dir, state.step, t.save_total_limit, fingerprint, record)

    # Anything made before the monitor started (buffers, states held outside the dispatcher) counts too.
    monitor.register(engine.state_tensors())
    stopping = False  # agreed by every rank before each step, unlike the signal itself
    with StopRequest() as stop:
        while state.step < total_steps:
            # A signal must stop every rank at the same step, or the next collective would hang: the ranks agree
            # before each step whether any of them received one (during the last step, its logging or evaluation).
            if engine.reduce(torch.tensor(float(stop.signum > 0), device=device)).item():
                stopping = True
                stop.signum = stop.signum or signal.SIGTERM
                break
            micro_batches = batches.for_step(state.step)
            for n, indices in enumerate(micro_batches):
                batch = train_collator(train_set.select(indices))
                inputs = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
                          if k in batch}
                with engine.autocast():
                    chosen, rejected = pair_rewards(model, **inputs)
                    loss = bradley_terry_loss(chosen, rejected, batch["margin"].to(device), t.center_rewards_coefficient)
                engine.backward(loss, share=len(indices) / per_rank, last=n == len(micro_batches) - 1)
                health.observe(loss, chosen, rejected)
                state.window_loss += loss.detach().double() * len(indices) / per_rank
                # Real tokens are chosen + rejected tokens, as an unshared trainer (TRL) counts them, whatever the layout.
                real = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
                real = int(batch["num_pair_tokens"]) if "num_pair_tokens" in batch else real
                state.window_tokens += real
                state.tokens += real
            # Checked before the optimizer applies the update, so that a NaN never reaches the weights.
            action = health.before_update(state.step + 1, engine.clip_gradients(), engine.gradients_of(HEAD), engine.reduce)
            if action == STOP:
                break
            applied = engine.step(skip=action == SKIP)
            if health.after_update(state.step + 1, applied) == STOP:  # e.g. DeepSpeed dropped a non-finite update itself
                break
            grad_norm = engine.grad_norm()
            state.step += 1
            state.window_steps += 1
            step = state.step
            progress.update(1)

            if t.logging_steps and (step % t.logging_steps == 0 or step == total_steps):
                elapsed = time.perf_counter() - state.window_start
                tokens = int(engine.reduce(torch.tensor(state.window_tokens, device=device), reduction="sum"))
                values = {
                    "loss": float(engine.reduce((state.window_loss / state.window_steps).float(), reduction="mean")),
                    "lr": engine.lr(),
                    "grad_norm": grad_norm,
                    "epoch": step * t.global_batch_size / len(train_set),
                    "tokens_per_s": tokens / elapsed,
                    "step_time_s": elapsed / state.window_steps,
                }
                metrics.write("train", step, values)
                progress.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)
                state.reset_window()
            pause_start = time.perf_counter()
            if (eval_set is not None or extra_eval_sets) and ((t.eval_steps and step % t.eval_steps == 0) or step == total_steps):
                eval_metrics, eval_scores = evaluate_sets(model, eval_set, extra_eval_sets, collator, t.eval_batch_size, engine)
                metrics.write("eval", step, eval_metrics)
                health.check_eval(step, eval_metrics.get("eval_accuracy"))
                log.info("step %d: %s", step, format_eval(eval_metrics))
            if t.save_steps and step % t.save_steps == 0 and step < total_steps:
                checkpoint()
            paused_s += time.perf_counter() - pause_start
        progress.close()
        step = state.step
        pause_start = time.perf_counter()  # for the checkpoint of a stopped run
        train_s = state.train_s + (time.perf_counter() - loop_start - paused_s)
        if engine.is_main_process and eval_scores:  # after train_s: drawing is not training time
            log.info("eval plots: %s", write_eval_plots(eval_scores, run_dir / "eval_plots.png"))
        if engine.is_main_process and metrics.path.is_file():
            log.info("training-loss plot: %s", write_train_plot(metrics.path, run_dir / "train_plot.png"))
        run_tokens = int(engine.reduce(torch.tensor(state.tokens, device=device), reduction="sum"))
        monitor.stop()
        measured_per_rank = gather_snapshots(monitor.snapshot())
        measured = measured_per_rank[engine.process_index]
        run_stats = {
            "tokens_per_s": run_tokens / train_s if train_s > 0 else None,
            "measured_peak_bytes": measured.get("peak_allocated_bytes"),
            "estimated_peak_bytes": estimate.peak_bytes if estimate else None,
            "usable_bytes": estimate.usable_bytes if estimate else None,
            "alarms": health.fired,
            "skipped_steps": health.skipped_steps,
        }

        if stop.signum and step == total_steps:  # trained to the end anyway: the final model, not a checkpoint
            log.warning("received %s during the last step: writing the final model instead of a checkpoint",
                        signal.Signals(stop.signum).name)
        elif stopping:
            path = checkpoint()
            log.warning(
                "stopped at step %d of %d; checkpoint %s. Continue with: train.resume=true hydra.run.dir=%s",
                step, total_steps, path, run_dir,
            )
            metrics.close()
            engine.end()
            return {**eval_metrics, **run_stats, "status": "interrupted", "step": step, "signal": stop.signum}
        if health.stop_reason:  # no checkpoint: the newest one on disk stays the last good one
            log.error(
                "stopped before step %d of %d: %s. No checkpoint was written; the newest, %s, is the last good one "
                "(continue from it with train.resume=true hydra.run.dir=%s once the cause is fixed)",
                step + 1, total_steps, health.stop_reason, latest_checkpoint(run_dir) or "none (none was due yet)", run_dir,
            )
            metrics.close()
            engine.end()
            return {**eval_metrics, **run_stats, "status": "stopped_nonfinite", "step": step, "reason": health.stop_reason}

    if engine.is_main_process:
        (run_dir / "memory.json").write_text(json.dumps(
            {"estimate": estimate.to_dict() if estimate else None, "measured": measured,
             "measured_per_rank": measured_per_rank}, indent=2
        ))

    # ---- save: one bundle, reloaded in a fresh model and checked on a probe batch (rm.export)
    final_dir = run_dir / "final"

    def fresh_base():  # what an adapter is reloaded onto: a random-init base is rebuilt from its seed
        set_seed(t.seed)
        return build_model(cfg.model, tokenizer.pad_token_id, plan.precision, False, cfg.memory_profile.quantize_base)

    probe_set = eval_set if eval_set is not None else train_set
    # Like a checkpoint: written and verified in a temporary directory, then renamed, so that final/ is
    # either the whole verified model or absent (a full disk must not leave a final/ that later runs
    # take for a finished one).
    tmp_final = run_dir / ".tmp-final"
    if engine.is_main_process:
        shutil.rmtree(tmp_final, ignore_errors=True)
    error: Optional[BaseException] = None
    try:
        export_final(
            engine, model, tokenizer, tmp_final,
            probe=collator(probe_set.select(range(min(PROBE_PAIRS, len(probe_set))))),
            reward_stats=reward_stats_from_eval(eval_metrics, step, cfg.data.max_length), precision=plan.precision,
            merge=cfg.memory_profile.use_lora and cfg.lora.merge_on_save,
            base_factory=fresh_base if cfg.memory_profile.use_lora else None, base_is_random=cfg.model.pretrained is None,
            final_dir=final_dir,
        )
        if engine.is_main_process:
            os.replace(tmp_final, final_dir)
    except Exception as err:  # noqa: BLE001  (every process hears of it first: none may wait for another)
        error = err
    failed = failed_ranks(engine, error is not None)
    if failed:
        if engine.is_main_process:
            shutil.rmtree(tmp_final, ignore_errors=True)
        raise_save_failure(
            error, failed, f"the final model to {final_dir}", run_dir,
            f"Nothing was left half-written; free space and run again with train.resume=true (newest checkpoint: "
            f"{latest_checkpoint(run_dir) or 'none'})", kind=StorageError,
        )
    log.info("saved the reward model to %s", final_dir)
    metrics.close()
    engine.end()
    return {**eval_metrics, **run_stats, "status": "ok", "step": step}


def resume(engine: Engine, run_dir: Path, cfg: RunConfig, fingerprint: Dict, total_steps: int) -> Tuple[int, Optional[Dict]]:
    """Restore the newest intact checkpoint whose settings match; return its step (0: none yet) and the
    loop's state it holds (``None``: none yet, or a checkpoint written before the state was saved).

    Checkpoints that fail their checksums, or whose states do not load, are passed over for the
    previous one with a warning, as DeepSpeed falls back from a bad ``latest`` tag by hand.

    Raises:
        ConfigError: settings that shape training changed (without ``train.resume_allow_changes``),
            or the checkpoint is past ``train.max_steps``.
        CheckpointError: checkpoints exist but none is intact.
    """
    candidates, passed_over = resume_candidates(run_dir)
    if not candidates and not passed_over:
        log.warning("train.resume=true but %s holds no complete checkpoint: starting from step 0", run_dir)
        return 0, None
    for checkpoint in candidates:
        state = checkpoint_state(checkpoint)
        if state["step"] >= total_steps:
            raise ConfigError(
                f"{checkpoint} is at step {state['step']}, but this run ends at step {total_steps} "
                f"(train.max_steps={cfg.train.max_steps}, train.num_train_epochs={cfg.train.num_train_epochs}): "
                "raise train.max_steps with train.resume_allow_changes=true to train further"
            )
        changes = check_resume(state.get("fingerprint"), fingerprint, checkpoint, cfg.train.resume_allow_changes)
        try:
            step = load_checkpoint(engine, checkpoint)
        except Exception as err:  # noqa: BLE001  (a checkpoint that passed its checksums but does not load: try the previous)
            log.warning("checkpoint %s does not load (%s: %s): falling back to an earlier one", checkpoint, type(err).__name__, err)
            passed_over.append(f"{checkpoint.name}: does not load ({type(err).__name__})")
            continue
        apply_changes(engine.optimizer, engine.scheduler, cfg, changes)
        log.info("resumed from %s at step %d", checkpoint, step)
        return step, state.get("train_state")
    raise CheckpointError(
        f"train.resume=true but no checkpoint in {run_dir / 'checkpoints'} is intact: {'; '.join(passed_over)}. "
        "Restore one from a copy, or start afresh with train.overwrite=true"
    )


def _quiet_other_ranks() -> None:
    """Only rank 0 speaks: other ranks keep warnings and errors."""
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger().setLevel(logging.WARNING)
        datasets.disable_progress_bars()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    """One job. Every failure ends at the error boundary of ``rm.errors``: a message and the documented
    exit code (2 config or data, 3 refused, 4 non-finite, 5 storage), or a traceback for a bug. In a
    multirun (``-m``) a refusal is recorded in ``job_result.json`` and the sweep goes on (``rm.sweep``);
    other failures follow ``sweep.on_failure``.
    Returns the final eval accuracy, the objective of ``hydra/sweeper=optuna``; None for a job that did not train, which
    the Optuna sweeper records as a failed (infeasible) trial rather than a value to learn from."""
    task_started()  # from here on, an exit 1 is a bug (a multirun job does not pass through boundary())
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return _job(cfg)  # a failed job goes to Hydra's sweeper, which goes on or stops per sweep.on_failure
    with boundary(log):
        return _job(cfg)


def _job(cfg: DictConfig) -> Optional[float]:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir, overrides = Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task)
    # Until train() has the directory (locked, no earlier run in the way), the log stays in memory and
    # .hydra/ unwritten: a refused run changes no file of an earlier one (rm.run_record).
    hold_log(run_dir)
    join_submitit_tasks()
    _quiet_other_ranks()
    run_cfg = to_run_config(cfg)
    is_main = int(os.environ.get("RANK", "0")) == 0
    claimed = False

    def claim():
        nonlocal claimed
        claim_run_dir(run_dir, cfg, is_main)
        claimed = True

    def record(status, **fields):
        if multirun and is_main and claimed:  # a refused directory keeps the record of the job that ran there
            write_job_record(run_dir, job_record(overrides, status, job=hydra_cfg.job.num, **fields))

    try:
        result = train(run_cfg, run_dir, overrides, on_claim=claim)
    except PreflightRefusal as err:
        log.error("refusing to start: the estimated peak does not fit in device memory\n%s", err)
        record("refused", estimate=err.estimate,
               error=f"would fit with: {err.fits[0]}" if err.fits else "no single change found that fits")
        if multirun:
            return None
        sys.exit(err.exit_code)
    except Exception as err:
        record("failed", error=err)
        if not multirun:
            raise  # to the boundary in main: message and exit code
        if run_cfg.sweep.on_failure == "continue":
            report(err, log)
            log.error("job failed; sweep.on_failure=continue: the sweep goes on")
            return None
        raise
    if result["status"] == "interrupted":
        record("failed", result=result, error=f"interrupted by signal {result['signal']} at step {result['step']}; "
                                              "a checkpoint was written, resume with train.resume=true")
        sys.exit(128 + result["signal"])
    if result["status"] == "stopped_nonfinite":
        error = NonFiniteError(f"stopped before step {result['step'] + 1}: {result['reason']}; no checkpoint was written after it")
        record("failed", result=result, error=error)
        if multirun and run_cfg.sweep.on_failure == "continue":
            return None
        raise error  # exit 4 at the boundary; in a multirun, like any failed job under sweep.on_failure=raise
    record("ok", result=result)
    return result.get("eval_accuracy", float("nan"))


if __name__ == "__main__":
    run_hydra_app(main)
