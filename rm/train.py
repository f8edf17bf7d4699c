"""Train a pairwise (Bradley-Terry) reward model: ``python -m rm.train [hydra overrides]``.

Reads top to bottom: setup (validate, accelerator), build (tokenizer, data,
model, optimizer), loop (accumulate, clip, step, log, evaluate, checkpoint),
save (a directory that plain transformers loads).
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers import get_scheduler

from rm.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from rm.config import RunConfig, to_run_config
from rm.data.batching import micro_batches_for_step, steps_per_epoch
from rm.data.build import build_datasets
from rm.data.collator import PairCollator
from rm.hardware import resolve_hardware
from rm.loss import bradley_terry_loss
from rm.metrics import MetricsLog, evaluate
from rm.model import apply_memory_profile, build_model, build_optimizer, build_tokenizer, count_parameters, pair_rewards
from rm.validate import ConfigError, Plan, validate

log = logging.getLogger("rm.train")

MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


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


def summary(cfg: RunConfig, plan: Plan, model, optimizer, total_steps: int, num_pairs: int) -> str:
    trainable, total = count_parameters(model)
    t = cfg.train
    lines = [
        f"model            {cfg.model.name} ({cfg.model.pretrained or 'random init from shape'})",
        f"parameters       {total:,} total, {trainable:,} trainable ({100 * trainable / total:.3f}%)",
        f"memory profile   {cfg.memory_profile.name}: {type(getattr(optimizer, 'optimizer', optimizer)).__name__}"
        + (f", LoRA r={cfg.lora.r} alpha={cfg.lora.alpha} on {','.join(cfg.lora.target_modules)}" if cfg.memory_profile.use_lora else ""),
        f"hardware         {cfg.hardware.name}: {plan.device}, {cfg.hardware.device_memory_gib} GiB/device, precision {plan.precision}",
        f"batch            {t.micro_batch_size} pairs/micro-batch x {plan.gradient_accumulation_steps} accumulation"
        f" x {plan.world_size} processes = {t.global_batch_size} pairs/step",
        f"tokens per step  at most {plan.max_tokens_per_step:,} ({t.global_batch_size} pairs x 2 x max_length {cfg.data.max_length})",
        f"schedule         {total_steps} steps = {total_steps * t.global_batch_size / num_pairs:.2f} epochs of {num_pairs:,} pairs,"
        f" lr {t.learning_rate:g} {t.lr_scheduler_type}, warmup {t.warmup_ratio:g}",
        f"gradient ckpt    {'on' if t.gradient_checkpointing else 'off'}",
    ]
    return "run summary\n  " + "\n  ".join(lines)


def train(cfg: RunConfig, run_dir: Path) -> Dict[str, float]:
    """Run one training job into ``run_dir``; return the final eval metrics and the status."""
    # ---- setup: validate everything before anything heavy
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.hardware = resolve_hardware(cfg.hardware)
    plan = validate(cfg, world_size)
    t = cfg.train
    accelerator = Accelerator(
        cpu=plan.device == "cpu",
        mixed_precision=MIXED_PRECISION[plan.precision],
        log_with="tensorboard" if t.tensorboard else None,
        project_dir=str(run_dir),
    )
    set_seed(t.seed)
    if t.tensorboard:
        accelerator.init_trackers("tensorboard")

    # ---- build
    tokenizer = build_tokenizer(cfg.model)
    train_set, eval_set, _ = build_datasets(cfg.data, tokenizer)
    collator = PairCollator(tokenizer.pad_token_id)
    model = build_model(cfg.model, tokenizer.pad_token_id, plan.precision, t.gradient_checkpointing)
    model = apply_memory_profile(model, cfg.memory_profile, cfg.lora)
    optimizer = build_optimizer(
        model, cfg.memory_profile, t.learning_rate, t.weight_decay, (t.adam_beta1, t.adam_beta2), t.adam_epsilon
    )
    total_steps = total_training_steps(cfg, len(train_set))
    scheduler = get_scheduler(
        t.lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(t.warmup_ratio * total_steps), num_training_steps=total_steps
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    log.info(summary(cfg, plan, model, optimizer, total_steps, len(train_set)))

    start_step = 0
    if t.resume:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            log.warning("train.resume=true but %s holds no complete checkpoint: starting from step 0", run_dir)
        else:
            start_step = load_checkpoint(accelerator, checkpoint)
            log.info("resumed from %s at step %d", checkpoint, start_step)

    # ---- loop
    lengths = None
    if t.group_by_length:
        lengths = [max(len(c), len(r)) for c, r in zip(train_set["chosen_input_ids"], train_set["rejected_input_ids"])]
    metrics = MetricsLog(run_dir, accelerator)
    device = accelerator.device
    eval_metrics: Dict[str, float] = {}
    window_loss, window_tokens, window_steps, window_start = 0.0, 0, 0, time.perf_counter()
    # In a log file (SLURM, CI) a bar redrawn ten times a second buries everything else.
    progress = tqdm(
        total=total_steps, initial=start_step, desc="train", disable=not accelerator.is_main_process,
        mininterval=0.1 if sys.stderr.isatty() else 30,
    )
    step = start_step
    with StopRequest() as stop:
        while step < total_steps and not stop.signum:
            micro_batches = micro_batches_for_step(
                step, len(train_set), t.global_batch_size, t.micro_batch_size, world_size, accelerator.process_index, t.seed,
                lengths,
            )
            for i, indices in enumerate(micro_batches):
                batch = collator(train_set.select(indices))
                last = i == len(micro_batches) - 1
                # Gradients are all-reduced once per optimizer step, not per micro-batch.
                with accelerator.no_sync(model) if not last else nullcontext():
                    with accelerator.autocast():
                        chosen, rejected = pair_rewards(
                            model, batch["input_ids"].to(device), batch["attention_mask"].to(device)
                        )
                        loss = bradley_terry_loss(chosen, rejected, batch["margin"].to(device), t.center_rewards_coefficient)
                    accelerator.backward(loss / len(micro_batches))
                window_loss += loss.item() / len(micro_batches)
                window_tokens += int(batch["attention_mask"].sum())
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm) if t.max_grad_norm > 0 else None
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            progress.update(1)

            if t.logging_steps and (step % t.logging_steps == 0 or step == total_steps):
                elapsed = time.perf_counter() - window_start
                tokens = int(accelerator.reduce(torch.tensor(window_tokens, device=device), reduction="sum"))
                values = {
                    "loss": window_loss / window_steps,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "epoch": step * t.global_batch_size / len(train_set),
                    "tokens_per_s": tokens / elapsed,
                }
                metrics.write("train", step, values)
                progress.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)
                window_loss, window_tokens, window_steps, window_start = 0.0, 0, 0, time.perf_counter()
            if eval_set is not None and ((t.eval_steps and step % t.eval_steps == 0) or step == total_steps):
                eval_metrics = evaluate(model, eval_set, collator, t.eval_batch_size, accelerator)
                metrics.write("eval", step, eval_metrics)
                log.info("step %d: %s", step, "  ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items()))
            if t.save_steps and step % t.save_steps == 0 and step < total_steps:
                save_checkpoint(accelerator, run_dir, step, t.save_total_limit)
        progress.close()

        if stop.signum:
            path = save_checkpoint(accelerator, run_dir, step, t.save_total_limit)
            log.warning(
                "stopped at step %d of %d; checkpoint %s. Continue with: train.resume=true hydra.run.dir=%s",
                step, total_steps, path, run_dir,
            )
            accelerator.end_training()
            return {**eval_metrics, "status": "interrupted", "step": step, "signal": stop.signum}

    # ---- save
    final_dir = run_dir / "final"
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        final_dir, is_main_process=accelerator.is_main_process, save_function=accelerator.save, safe_serialization=True
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(final_dir)
    log.info("saved the reward model to %s", final_dir)
    accelerator.end_training()
    return {**eval_metrics, "status": "ok", "step": step}


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    run_cfg = to_run_config(cfg)
    try:
        result = train(run_cfg, Path(HydraConfig.get().runtime.output_dir))
    except ConfigError as err:
        log.error("%s", err)
        sys.exit(2)
    if result["status"] == "interrupted":
        sys.exit(128 + result["signal"])
    return result.get("eval_accuracy", float("nan"))


if __name__ == "__main__":
    main()
