"""The trainer behind ``python -m rm.train``: setup, loop, save, close.

:func:`train` reads top to bottom: :func:`rm.training.run_setup.setup` builds one :class:`~rm.training.run_setup.Run`
(tokenizer, datasets, model, engine, health checks, metrics, the loop's state); :func:`fit` runs
:func:`train_step` until the last step, a signal or a health stop; :func:`wrap_up` turns the outcome
into the result (writing a checkpoint for an interrupted run); :func:`save_final` exports the model.
One ``finally`` closes the metrics and the engine however the run ends. A signal (SIGTERM, SIGINT) at any point
loses nothing trained (:class:`StopRequest`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from tqdm.auto import tqdm

from rm.runs.checkpoint import failed_ranks, raise_save_failure
from rm.foundations.config import RunConfig
from rm.data.batching import rows_at
from rm.foundations.errors import Interrupted, StorageError, ended_if_forked
from rm.modelling.bundle import PROBE_PAIRS, export_final, model_card, reward_stats_from_eval
from rm.training.health import SKIP, STOP
from rm.memory.monitor import gather_snapshots
from rm.evaluation.metrics import LineProgressFile, evaluate_sets, format_eval
from rm.modelling.model import HEAD, host_hints, pair_rewards
from rm.evaluation.plots import write_eval_plots, write_train_plot
from rm.runs.run_dir import RunDir
from rm.runs.run_record import resume_command
from rm.training.run_setup import Run, rebuild_base, setup
from rm.settings.validate import launched_as_main

log = logging.getLogger("rm.train")  # these lines belong to the training command's log



class Status(str, Enum):
    """How a run ended: what :func:`fit` returns and the ``status`` of :func:`train`'s result (a ``str``, so the
    result stays JSON as it is)."""

    OK = "ok"  # trained to the last step
    INTERRUPTED = "interrupted"  # a signal: a checkpoint was written, resume with train.checkpoint.resume=true
    STOPPED_NONFINITE = "stopped_nonfinite"  # the health checks stopped it; no checkpoint of the bad step

    def __str__(self) -> str:
        return self.value

# What the model's forward takes from a collated batch (the layout decides which are there).
MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")


def train(cfg: RunConfig, run_dir: Union[Path, RunDir], overrides: Sequence[str] = ()) -> Dict[str, float]:
    """Run one training job into ``run_dir``; return the final eval metrics and the status.

    ``overrides`` are the Hydra overrides the config came from; the pre-flight check
    re-composes them with candidate changes to say which would fit. ``run_dir`` (a path, or a
    :class:`~rm.runs.run_dir.RunDir` that writes Hydra's record when claimed) is locked for the whole job
    by the main process (torchrun's ranks are one run), and nothing of it changes before it is claimed.

    Returns:
        The last evaluation's metrics, the run's statistics, ``status`` (``ok``, ``interrupted`` with
        ``signal``, ``stopped_nonfinite`` with ``reason``) and ``step``.
    """
    directory = run_dir if isinstance(run_dir, RunDir) else RunDir.of(run_dir, cfg.train.checkpoint, launched_as_main())
    # The lock and the memory monitor's dispatch mode are undone however the run ends; signals are handled from the
    # first line of set-up to the last of the export.
    with directory, ExitStack() as cleanup, StopRequest() as stop:
        try:
            run = setup(cfg, directory, overrides, cleanup)
            stop.phase = TRAINING
            finished = False
            try:
                outcome = fit(run, stop)
                if outcome is Status.OK:
                    stop.phase = FINISHING
                result, memory = wrap_up(run, outcome, stop, overrides)
                if result["status"] is Status.OK:
                    save_final(run, memory)
                finished = True
                return result
            finally:
                close(run, finished)
        except Interrupted as stopped:  # during set-up, or a second Ctrl-C: exit 128 + N at the boundary
            log.warning("stopped by %s during %s; nothing is left half-written%s. Continue with:\n  %s",
                        signal.Signals(stopped.signum).name, stop.phase,
                        f", and the last good checkpoint is {directory.checked}" if stop.phase != SETUP else "",
                        resume_command(directory.path, overrides))
            raise


def fit(run: Run, stop: "StopRequest") -> Status:
    """The loop, from the state's step on; returns how it ended: OK, INTERRUPTED (a signal) or STOPPED_NONFINITE
    (the health checks)."""
    state, engine, t = run.state, run.engine, run.cfg.train
    progress = _progress_bar(run)
    # Throughput of the whole run for sweep summaries: real tokens over time spent training (not evaluating or saving).
    state.loop_start = time.perf_counter()
    try:
        while state.step < run.total_steps:
            # A signal must stop every rank at the same step, or the next collective would hang: the ranks agree
            # before each step whether any of them received one (during the last step, its logging or evaluation).
            if engine.reduce(torch.tensor(float(stop.signum > 0), device=engine.device)).item():
                stop.signum = stop.signum or signal.SIGTERM
                return Status.INTERRUPTED
            stats = train_step(run, run.batches.for_step(state.step))
            state.add_step(stats.loss, stats.tokens, taken=not stats.stop)
            if stats.stop:
                return Status.STOPPED_NONFINITE
            progress.update(1)
            if t.logging.logging_steps and (state.step % t.logging.logging_steps == 0 or state.step == run.total_steps):
                log_window(run, progress)
            evaluate_and_save(run, stop)
        return Status.OK
    finally:
        progress.close()


@dataclass
class StepStats:
    """What one optimizer step of this process adds to the loop's state."""

    loss: torch.Tensor  # each micro-batch's mean loss x its share of the step, summed; on the device until logging
    tokens: int  # real (chosen + rejected) tokens, counted on the host from the collated batches
    stop: bool  # the health checks stopped the run at this step; the update was not taken


def train_step(run: Run, micro_batches: List[List[int]]) -> StepStats:
    """Forward and backward over the step's micro-batches, the health checks, then the optimizer step.

    Nothing of rm's waits for the device per micro-batch: the loss is summed there, and the tokens and a packed row's
    segments are read on the host before the copy (``host_hints``).
    """
    engine, per_rank = run.engine, run.batches.per_rank
    loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
    tokens = 0
    for n, indices in enumerate(micro_batches):
        batch = run.train_collator(rows_at(run.train_set, indices))
        tokens += real_tokens(batch)
        hints = host_hints(batch)  # read before the copy: on the device, each read would wait for it
        inputs = to_device(batch, (*MODEL_INPUTS, "margin"), engine.device)
        margin = inputs.pop("margin")
        with engine.micro_batch(last=n == len(micro_batches) - 1):
            with engine.autocast():
                chosen, rejected = pair_rewards(run.model, **inputs, **hints)
                loss = run.loss(chosen, rejected, margin)
            engine.backward(loss, share=len(indices) / per_rank)
        run.health.observe(loss, chosen, rejected)
        loss_sum += loss.detach().double() * len(indices) / per_rank
    step = run.state.step + 1
    # Checked before the optimizer applies the update, so that a NaN never reaches the weights.
    action = run.health.before_update(step, engine.clip_gradients(), engine.gradients_of(HEAD), engine.reduce)
    if action == STOP:
        return StepStats(loss_sum, tokens, stop=True)
    applied = engine.step(skip=action == SKIP)
    # e.g. DeepSpeed dropped a non-finite update itself
    return StepStats(loss_sum, tokens, stop=run.health.after_update(step, applied) == STOP)


def real_tokens(batch: Dict[str, torch.Tensor]) -> int:
    """Chosen + rejected tokens, as an unshared trainer (TRL) counts them, whatever the layout (on the host)."""
    if "num_pair_tokens" in batch:
        return int(batch["num_pair_tokens"])
    return int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()


def to_device(batch: Dict[str, torch.Tensor], keys: Sequence[str], device: torch.device) -> Dict[str, torch.Tensor]:
    """The batch's tensors under ``keys`` on ``device``, copied without waiting; on CUDA from pinned memory,
    which an asynchronous copy needs (from pageable memory it would wait). On a CPU device nothing is copied."""
    pin = device.type == "cuda"
    return {k: (batch[k].pin_memory() if pin else batch[k]).to(device, non_blocking=True) for k in keys if k in batch}


def log_window(run: Run, progress: tqdm) -> None:
    """A logging step: the window's loss, throughput and lost-update fraction, over processes, to metrics.jsonl."""
    state, engine, t = run.state, run.engine, run.cfg.train
    elapsed = time.perf_counter() - state.window_start
    tokens = int(engine.reduce(torch.tensor(state.window_tokens, device=engine.device), reduction="sum"))
    values = {
        "loss": float(engine.reduce((state.window_loss / state.window_steps).float(), reduction="mean")),
        "lr": engine.lr(),
        "grad_norm": engine.grad_norm(),
        "epoch": state.step * t.global_batch_size / len(run.train_set),
        "tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed / state.window_steps,
    }
    lost = run.health.lost_update_fraction(state.step, engine.reduce)  # also raises the lost_updates alarm
    if lost is not None:
        values["lost_update_fraction"] = lost
    run.metrics.write("train", state.step, values)
    # Once, at the second window (the first holds the first step's warm-up): a prediction from CPU rates measured
    # under other load is dropped for the next plan to measure again (rm.plan.constants.check_prediction). Not under
    # train.logging.track_memory: every operator then goes through the live-tensor count in Python, and the step it
    # times is that count's (4.8x the prediction on a 1-process offload point of the random calibration, which then
    # dropped the machine's good rates for every later run to measure again).
    if (run.layout is not None and not run.step_time_checked and state.step > t.logging.logging_steps
            and not t.logging.track_memory):
        run.step_time_checked = True
        stale = run.layout.against_run(values["step_time_s"]) if engine.is_main_process else None
        if stale:
            log.warning("%s", stale)
    progress.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)
    state.reset_window()


def evaluate_and_save(run: Run, stop: Optional["StopRequest"] = None) -> None:
    """After a step: evaluation and a checkpoint when due; the time they take is not training time.

    A signal (``stop``) during an evaluation before the last step's stops it at its next batch, unrecorded: the loop
    then writes the checkpoint of this step and exits, without waiting for the rest of the eval set. The last step's
    evaluation always finishes: the final model's reward statistics come from it (``finishing`` in :class:`StopRequest`).
    """
    t, step = run.cfg.train, run.state.step
    paused = time.perf_counter()
    if (run.eval_set is not None or run.extra_eval_sets) and ((t.logging.eval_steps and step % t.logging.eval_steps == 0) or step == run.total_steps):
        stopping = (lambda: stop.signum > 0) if stop is not None and step < run.total_steps else None
        done = evaluate_sets(run.model, run.eval_set, run.extra_eval_sets, run.collator, t.eval_batch_size, run.engine,
                             run.loss, stopping=stopping)
        if done is None:
            stop.signum = stop.signum or signal.SIGTERM  # another rank's signal: this one stops with the same code
            log.warning("step %d: evaluation stopped by %s before its end; no eval record for this step",
                        step, signal.Signals(stop.signum).name)
        else:
            run.eval_metrics, run.eval_scores = done
            run.metrics.write("eval", step, run.eval_metrics)
            run.health.check_eval(step, run.eval_metrics.get("eval_accuracy"))
            log.info("step %d: %s", step, format_eval(run.eval_metrics))
    if t.checkpoint.save_steps and step % t.checkpoint.save_steps == 0 and step < run.total_steps:
        checkpoint(run, paused)
    run.state.paused_s += time.perf_counter() - paused


def checkpoint(run: Run, paused: float) -> Path:
    """Save the states and the loop's state; every process calls it, during a pause begun at ``paused``
    (where the training time it records ends)."""
    state = run.state
    record = state.record(run.engine.reduce, state.trained_s(paused), run.health.state_dict())
    return run.dir.save_checkpoint(run.engine, state.step, run.cfg.train.checkpoint.save_total_limit, state.fingerprint, record)


def wrap_up(run: Run, outcome: Status, stop: "StopRequest", overrides: Sequence[str] = ()) -> Tuple[Dict, Dict]:
    """After the loop: the checkpoint of an interrupted run, the plots and the run's statistics.

    Returns:
        The result :func:`train` returns, and what ``memory.json`` records (estimated and measured peaks).
    """
    state, engine, step, total = run.state, run.engine, run.state.step, run.total_steps
    ended = time.perf_counter()  # for the checkpoint of a stopped run
    train_s = state.train_s + state.trained_s(ended)
    # First: a pre-empted job has seconds left, and the plots can wait for them.
    saved = stop_checkpoint(run, ended) if outcome is Status.INTERRUPTED else None
    if engine.is_main_process and run.eval_scores:  # after train_s: drawing is not training time
        log.info("eval plots: %s", write_eval_plots(run.eval_scores, run.dir.path / "eval_plots.png"))
    if engine.is_main_process and run.metrics.path.is_file():
        log.info("training-loss plot: %s", write_train_plot(run.metrics.path, run.dir.path / "train_plot.png"))
    run_tokens = int(engine.reduce(torch.tensor(state.tokens, device=engine.device), reduction="sum"))
    run.monitor.stop()
    measured_per_rank = gather_snapshots(run.monitor.snapshot())
    measured = measured_per_rank[engine.process_index]
    estimate = run.estimate
    result = {
        **run.eval_metrics,
        "tokens_per_s": run_tokens / train_s if train_s > 0 else None,
        "measured_peak_bytes": measured.get("peak_allocated_bytes"),
        "estimated_peak_bytes": estimate.peak_bytes if estimate else None,
        "usable_bytes": estimate.usable_bytes if estimate else None,
        "alarms": run.health.fired,
        "skipped_steps": run.health.skipped_steps,
    }
    memory = {"estimate": estimate.to_dict() if estimate else None, "measured": measured,
              "measured_per_rank": measured_per_rank}
    if outcome is Status.OK and stop.signum:  # trained to the end anyway: the final model, not a checkpoint
        log.warning("received %s during the last step: writing the final model instead of a checkpoint",
                    signal.Signals(stop.signum).name)
    command = resume_command(run.dir.path, overrides) + (
        f"  (under the launcher that started its {engine.num_processes} processes)" if engine.num_processes > 1 else "")
    if outcome is Status.INTERRUPTED:
        log.warning("stopped at step %d of %d; %s. Continue with:\n  %s", step, total,
                    f"checkpoint {saved}" if saved else "nothing was trained yet", command)
        return {**result, "status": outcome, "step": step, "signal": stop.signum}, memory
    if outcome is Status.STOPPED_NONFINITE:  # no checkpoint: the newest one this run checked stays the last good one
        log.error(
            "stopped before step %d of %d: %s. No checkpoint was written; the last good one is %s. Once the cause is "
            "fixed, continue from it with:\n  %s",
            step + 1, total, run.health.stop_reason,
            run.dir.checked or "none: this run wrote or loaded none (none was due yet)", command,
        )
        return {**result, "status": outcome, "step": step, "reason": run.health.stop_reason}, memory
    return {**result, "status": outcome, "step": step}, memory


def stop_checkpoint(run: Run, ended: float) -> Optional[Path]:
    """The checkpoint a stopped run continues from: the one of its last step where this run has it already (the
    signal came while it was written, or before the first step after a resume from it), none where nothing was
    trained yet, else a new one (every process calls it)."""
    checked = run.dir.checked
    if checked is not None and checked.name == f"checkpoint-{run.state.step}":
        return checked
    return checkpoint(run, ended) if run.state.step > 0 else None


def save_final(run: Run, memory: Dict) -> None:
    """``memory.json``, then one bundle in ``final/``, reloaded in a fresh model and checked on a probe batch (rm.modelling.bundle).

    Like a checkpoint, the bundle is written and verified in a temporary directory, then renamed, so that
    ``final/`` is either the whole verified model or absent (a full disk must not leave a ``final/`` that
    later runs take for a finished one). A signal while it is written lets it finish (:class:`StopRequest`); a
    second Ctrl-C abandons it, and its temporary directory goes with it.

    Raises:
        StorageError: any process failed to write its part; nothing is left half-written.
    """
    engine, run_dir, cfg = run.engine, run.dir.path, run.cfg
    if engine.is_main_process:
        (run_dir / "memory.json").write_text(json.dumps(memory, indent=2))
    final_dir, tmp_final = run_dir / "final", run_dir / ".tmp-final"
    probe_set = run.eval_set if run.eval_set is not None else run.train_set
    lora = cfg.memory_profile.use_lora
    if engine.is_main_process:
        shutil.rmtree(tmp_final, ignore_errors=True)
    error: Optional[BaseException] = None
    try:
        export_final(
            engine, run.model, run.tokenizer, tmp_final,
            probe=run.collator(probe_set.select(range(min(PROBE_PAIRS, len(probe_set))))),
            reward_stats=reward_stats_from_eval(run.eval_metrics, run.state.step, cfg.data.max_length),
            precision=run.plan.precision, merge=lora and cfg.lora.merge_on_save,
            base_factory=functools.partial(rebuild_base, run) if lora else None,
            base_is_random=cfg.model.pretrained is None, final_dir=final_dir, append_eos=cfg.data.append_eos,
            card=_model_card(run),
        )
        if engine.is_main_process:
            os.replace(tmp_final, final_dir)
    except Exception as err:  # noqa: BLE001  (every process hears of it first: none may wait for another)
        error = err
    except BaseException:  # a second Ctrl-C (Interrupted): nothing half-written stays
        if engine.is_main_process:
            shutil.rmtree(tmp_final, ignore_errors=True)
        raise
    failed = failed_ranks(engine, error is not None)
    if failed:
        if engine.is_main_process:
            shutil.rmtree(tmp_final, ignore_errors=True)
        raise_save_failure(
            error, failed, f"the final model to {final_dir}", run_dir,
            f"Nothing was left half-written; free space and run again with train.checkpoint.resume=true (newest checkpoint: "
            f"{run.dir.latest_checkpoint() or 'none'})", kind=StorageError,
        )
    log.info("saved the reward model to %s", final_dir)


def close(run: Run, finished: bool) -> None:
    """The one way out of a run that started: the metrics are closed however it ends; the engine is ended
    (a barrier under DeepSpeed) only when the run got to its end, since after an error on one process the
    others might never reach that barrier."""
    run.metrics.close()
    run.model = run.engine.unwrapped_model()  # the DDP wrapper must be gone before its process group (rm.distributed.engine)
    if finished:
        run.engine.end()


def _model_card(run: Run) -> str:
    """The final bundle's README.md from what this run was (rm.modelling.bundle.model_card)."""
    cfg = run.cfg
    m, d = cfg.model, cfg.data
    base = m.pretrained or f"random init of the {m.name} shape ({m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size})"
    files = " ".join(d.train_files) if d.source == "local" else ""
    return model_card(name=m.name, base=base, profile=cfg.memory_profile.name, data=f"data={d.name} {files}".strip(),
                      steps=run.state.step, pairs=len(run.train_set), eval_accuracy=run.eval_metrics.get("eval_accuracy"),
                      eval_pairs=len(run.eval_set) if run.eval_set is not None else None, precision=run.plan.precision,
                      adapter=cfg.memory_profile.use_lora, merged=cfg.memory_profile.use_lora and cfg.lora.merge_on_save)


def _progress_bar(run: Run) -> tqdm:
    # In a log file (SLURM, CI) a bar redrawn ten times a second buries everything else.
    tty = sys.stderr.isatty()
    return tqdm(total=run.total_steps, initial=run.state.step, desc="train", disable=not run.engine.is_main_process,
                mininterval=0.1 if tty else 30, file=None if tty else LineProgressFile(sys.stderr))


# Where a run is, for what a signal does (StopRequest).
SETUP, TRAINING, FINISHING = "set-up", "training", "finishing"


class StopRequest:
    """Turns SIGTERM (SLURM pre-emption, ``kill``) and SIGINT (Ctrl-C) into a clean exit that loses nothing trained.

    What the first signal does depends on :attr:`phase`:

    - ``set-up``: nothing was trained by this start, so it stops at once (:class:`~rm.foundations.errors.Interrupted`,
      exit 128 + N); a resume starts where this one would have (its checkpoint, or step 0).
    - ``training`` (steps, evaluation, periodic checkpoints): a flag that every process checks before each step and
      each evaluation batch. The step and a checkpoint being written finish, an evaluation stops at its next batch
      (unrecorded; the last step's finishes: the final model needs it); then the checkpoint of that step (none is
      written twice), and exit 128 + N.
    - ``finishing`` (the run trained its last step: plots, ``final/``): the final model is finished, exit 0. It is
      the quicker way to keep the run: a checkpoint would also write the optimizer states.

    A second SIGINT interrupts at once wherever the run is; a write in progress is abandoned whole (its temporary
    directory is removed, or never read and removed by the next start: :meth:`rm.runs.run_dir.RunDir.remove_abandoned`).
    """

    _SAYS = {
        TRAINING: "stopping after this step (an evaluation in progress stops at its next batch; a checkpoint due is "
                  "written) and writing a checkpoint",
        FINISHING: "the run trained its last step: finishing the final model (a second Ctrl-C "
                   "abandons it, and the steps after the last checkpoint with it)",
    }

    def __init__(self):
        self.signum = 0
        self.phase = SETUP
        self._previous = {}
        self._pid = os.getpid()

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if ended_if_forked(self._pid, signum):  # a process forked during set-up (the estimate's pool, a DataLoader worker)
            return
        name = signal.Signals(signum).name
        if self.phase == SETUP or (self.signum and signum == signal.SIGINT):
            raise Interrupted(signum)
        if self.signum:
            log.warning("received %s again: already stopping", name)
            return
        self.signum = signum
        log.warning("received %s: %s", name, self._SAYS[self.phase])

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
