"""Training-health alarms, the non-finite policy, and the fp32 reward head.

An alarm is a named warning with its likely cause. :class:`HealthMonitor` raises each
alarm once per run: a ``WARNING`` log line (rank 0) and one line of ``metrics.jsonl``,
``{"event": "alarm", "step", "name", "message"}``. Alarms never stop a run, except:

* ``pad_token_unset``: the tokenizer has no pad id (nor unk or eos to stand in for
  it). The pipeline cannot run without one (the collator pads with it, and
  transformers refuses batches of more than one sequence without it), so this is a
  :class:`~rm.settings.validate.ConfigError` before the model is built.
* a non-finite loss or gradient norm (``nonfinite_loss``, ``nonfinite_grad_norm``),
  detected before the optimizer applies the update. ``health.on_nonfinite=stop``
  (default) ends the run cleanly: no checkpoint is written (the newest one in
  ``checkpoints/`` stays the last good one), ``{"event": "stopped", "step", "reason"}``
  goes to ``metrics.jsonl``, ``rm.training.trainer.train`` returns status ``stopped_nonfinite``
  and ``python -m rm.train`` exits with status 4. ``skip`` drops that step's update:
  its gradients are zeroed, weights and optimizer states stay as they were, the step's
  pairs count as seen and the learning-rate schedule advances; each skip is written as
  ``{"event": "skip", "step", "reason"}``, and ``health.max_consecutive_skips`` skips
  in a row stop the run as above.

Where the check happens depends on the engine (``rm.distributed.engine``). With accelerate (one
process, DDP) the gradient norm is computed (and clipped) before the optimizer step,
so a non-finite norm never reaches the weights. DeepSpeed computes the norm inside its
own ``engine.step``; rm checks the loss of every micro-batch before that call, and
DeepSpeed's own overflow check (every ZeRO stage, in fp32, bf16 and fp16) drops an
update whose gradients are not finite, which ``was_step_applied`` reports and the
policy then treats like a non-finite norm. Under fp16 the gradient scaler skips
overflowing steps by design while it calibrates its scale; those skips are neither
counted nor alarmed, a non-finite *loss* still is.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from rm.foundations.lost_updates import LostUpdateProbe, lost_fraction
from rm.modelling.model import HEAD

log = logging.getLogger(__name__)

LN2 = math.log(2.0)

CONTINUE, SKIP, STOP = "continue", "skip", "stop"  # what the loop does with a step


@dataclass(frozen=True)
class Alarm:
    """A named training-health warning.

    Attributes:
        name: stable identifier, e.g. ``loss_at_ln2``.
        message: what was seen and its likely cause, in one paragraph.
    """

    name: str
    message: str


# ---------------------------------------------------------------- pure checks


def pad_token_alarm(pad_token_id: Optional[int], pad_token: Optional[str], pad_in_text: Mapping[str, int]) -> Optional[Alarm]:
    """The pad token is unset, or appears inside texts (the pairs with it were dropped).

    Args:
        pad_token_id: the tokenizer's pad id.
        pad_token: its text, for the message.
        pad_in_text: per split, the pairs dropped because a side contains the pad id.

    Returns:
        ``pad_token_unset``, ``pad_token_in_text`` or ``None``.
    """
    if pad_token_id is None:
        return Alarm(
            "pad_token_unset",
            "the tokenizer has no pad token, and neither unk nor eos to stand in for it: the collator cannot pad "
            "and the reward token cannot be told from padding. Likely cause: a tokenizer saved without special "
            "tokens; use one with a pad (or unk) token, or add a pad token to it.",
        )
    found = {split: int(n) for split, n in pad_in_text.items() if n}
    if not found:
        return None
    where = ", ".join(f"{split} {n}" for split, n in found.items())
    return Alarm(
        "pad_token_in_text",
        f"the pad token {pad_token!r} (id {pad_token_id}) occurs inside the texts of {sum(found.values())} pairs "
        f"({where}), which were dropped: padding there would move the token the reward is read from. Likely "
        "cause: the pad token doubles as a real token (eos used as pad with a chat template that writes eos "
        "between turns, or a pad set to a common token); give the tokenizer a pad token that never occurs in text.",
    )


# Above this share of <unk> tokens in a split, the tokenizer does not know the data: distinct texts
# collapse to the same ids (a word-level tokenizer on other text). Byte-level and byte-fallback tokenizers
# (rm's default bpe, Llama's, Mistral's) emit none.
UNK_RATE_ALARM = 0.01


def unknown_tokens_alarm(unk_rates: Mapping[str, float]) -> Optional[Alarm]:
    """A split's tokens are more than :data:`UNK_RATE_ALARM` unknown (the audit's ``unk_rate``).

    Example:
        >>> unknown_tokens_alarm({"train": 0.002}) is None
        True
        >>> unknown_tokens_alarm({"train": 0.4, "eval": 0.0}).name
        'unknown_tokens'
    """
    found = {split: rate for split, rate in unk_rates.items() if rate > UNK_RATE_ALARM}
    if not found:
        return None
    where = ", ".join(f"{split} {rate:.1%}" for split, rate in found.items())
    return Alarm(
        "unknown_tokens",
        f"{where} of the tokens are the unknown token: the tokenizer does not know this text, so different answers "
        "become the same ids (see the audit's identical pairs). Likely cause: a word-level tokenizer (model.tokenizer="
        "words, or one of yours) on text it was not made for; use the model's own tokenizer (model.tokenizer=<hub id or "
        "dir>), or for a random-init model model.tokenizer=bpe, which is trained on your texts and knows every byte.",
    )


def ln2_plateau_alarm(losses: Sequence[float], tolerance: float) -> Optional[Alarm]:
    """Every step's loss stayed within ``tolerance`` of ln 2: chosen and rejected score alike.

    Args:
        losses: the training loss of each of the first N steps (mean over the step's pairs).
        tolerance: how far from ln 2 a loss may be and still count as "at ln 2".

    Returns:
        ``loss_at_ln2`` or ``None`` (also for no losses).
    """
    if not losses or any(abs(loss - LN2) > tolerance for loss in losses):
        return None
    worst = max(abs(loss - LN2) for loss in losses)
    return Alarm(
        "loss_at_ln2",
        f"the training loss stayed at ln 2 = {LN2:.4f} (within {worst:.2g}, tolerance {tolerance:g}) for the first "
        f"{len(losses)} steps: chosen and rejected get the same reward, nothing is being learned. Likely cause: "
        "identical or unlearnable pairs (see data_audit.json), a learning rate of 0 or far too small, a reward "
        "head that is frozen or zero, or rewards read at a padding position.",
    )


def head_gradient_alarm(gradients: Sequence[Optional[torch.Tensor]], head: str = HEAD) -> Optional[Alarm]:
    """The reward head has no trainable parameter, or its gradient is missing or all zero.

    Args:
        gradients: the full gradient (or ``None``) of each trainable parameter of the head,
            after backward and before the optimizer step; empty when the head has none.
        head: the head's module name, for the message.

    Returns:
        ``head_no_gradient`` or ``None``.
    """
    if not gradients:
        return Alarm(
            "head_no_gradient",
            f"the reward head `{head}` has no trainable parameter: frozen by mistake? A randomly initialised head "
            "that never trains gives random rewards. Likely cause: a memory profile or PEFT config that leaves "
            f"`{head}` out of the trained modules (PEFT: task_type SEQ_CLS or modules_to_save=['{head}']).",
        )
    if any(g is not None and bool(g.detach().ne(0).any()) for g in gradients):
        return None
    return Alarm(
        "head_no_gradient",
        f"the reward head `{head}` receives no gradient (None or all zero): frozen by mistake? Likely cause: "
        "the head is detached from the loss, its gradient is cleared before the step, or every pair is "
        "identical (r_chosen - r_rejected then does not depend on the head).",
    )


def reward_scale_alarm(mean_abs_reward: float, limit: float) -> Optional[Alarm]:
    """The mean |reward| over a step exceeds ``limit`` (0 disables)."""
    if not limit or not mean_abs_reward > limit:
        return None
    return Alarm(
        "reward_scale",
        f"the mean |reward| over a step is {mean_abs_reward:.4g}, above health.max_abs_reward={limit:g}: the reward "
        "scale is blowing up. Likely cause: a learning rate too high, or pairs the model separates perfectly "
        "(leaked labels, duplicated pairs), which the Bradley-Terry loss rewards without bound; "
        "train.center_rewards_coefficient=0.01 keeps rewards centred on zero.",
    )


def chance_accuracy_alarm(accuracy: float, tolerance: float) -> Optional[Alarm]:
    """Eval accuracy at chance (within ``tolerance`` of 0.5) or below it.

    A tie counts as wrong in :func:`rm.evaluation.metrics.evaluate`, so a model that gives every
    sequence the same reward scores 0, not 0.5: below chance is alarmed too.
    """
    if not accuracy <= 0.5 + tolerance:
        return None
    if accuracy < 0.5 - tolerance:
        cause = ("below chance: chosen and rejected may be swapped (data.format, column names), or every pair ties "
                 "(a tie counts as wrong: a constant reward scores 0)")
    else:
        cause = "at chance: the model does not tell chosen from rejected"
    return Alarm(
        "eval_at_chance",
        f"eval accuracy {accuracy:.4f} is {cause}. Likely cause: a learning rate of 0 or far too small, a frozen "
        "reward head, identical or unlearnable pairs, or too few steps for this data.",
    )


def lost_updates_alarm(fraction: Optional[float], threshold: float, steps: int) -> Optional[Alarm]:
    """More than ``threshold`` of the sampled updates rounded to nothing (0 disables).

    Args:
        fraction: the running lost-update fraction (``rm.foundations.lost_updates``) over the steps after warmup.
        threshold: ``health.lost_updates_threshold``.
        steps: the steps it was measured over, for the message.

    Example:
        >>> lost_updates_alarm(0.85, 0.5, 8).name
        'lost_updates'
        >>> lost_updates_alarm(0.5, 0.5, 8), lost_updates_alarm(0.9, 0.0, 8), lost_updates_alarm(None, 0.5, 0)
        (None, None, None)
    """
    if not threshold or fraction is None or not fraction > threshold:
        return None
    return Alarm(
        "lost_updates",
        f"{fraction:.0%} of the sampled weight updates over {steps} step(s) after warmup rounded to nothing (above "
        f"health.lost_updates_threshold={threshold:g}): those weights did not move although their gradient was "
        "nonzero. Likely cause: pure bf16 training (train.precision=bf16-true), whose 8 significant bits drop updates "
        "much smaller than the weight; train with fp32 master weights and optimizer states (train.precision=bf16-mixed), "
        "keep what rounding drops (train.optim.kahan_summation=true), or use a larger learning rate (train.optim.learning_rate).",
    )


def nonfinite_alarm(bad_losses: int, grad_norm: Optional[float]) -> Optional[Alarm]:
    """A non-finite loss (on ``bad_losses`` micro-batches) or gradient norm, before the update.

    Args:
        bad_losses: micro-batches of the step, over all processes, whose loss is NaN or inf.
        grad_norm: the step's gradient norm before clipping, ``None`` where the engine only
            knows it after the update (DeepSpeed).
    """
    cause = ("Likely cause: a learning rate too high, fp16 overflow (bf16 has fp32's range), or a batch with "
             "extreme values (e.g. a margin beyond float32's range).")
    if bad_losses:
        return Alarm("nonfinite_loss", f"the loss is NaN or inf on {bad_losses} micro-batch(es) of the step. {cause}")
    if grad_norm is not None and not math.isfinite(grad_norm):
        return Alarm("nonfinite_grad_norm", f"the gradient norm is {grad_norm} with a finite loss. {cause}")
    return None


# ---------------------------------------------------------------- the monitor


class HealthMonitor:
    """Runs the checks at the loop's hook points, raises each alarm once, applies the non-finite policy.

    Hook points, in loop order: :meth:`check_data` (after the data is built),
    :meth:`observe` (each micro-batch, after backward), :meth:`before_update` (after the
    last backward, before the optimizer step), :meth:`after_update` (after it),
    :meth:`lost_update_fraction` (each logging step), :meth:`check_eval` (after each
    evaluation). Every process calls every hook, so collective calls and decisions stay in
    step across ranks.

    Args:
        ln2_steps: N of the ln 2 check; 0 disables it.
        ln2_tolerance: distance to ln 2 that still counts as "at ln 2".
        chance_after_steps: evaluations from this step on are checked against chance; 0 checks every one.
        chance_tolerance: distance to 0.5 that still counts as chance.
        max_abs_reward: alarm above this mean |reward| over a step; 0 disables.
        lost_updates_threshold: alarm when the running lost-update fraction passes it; 0 disables
            (no probe is attached then: see :meth:`watch_updates`).
        on_nonfinite: ``stop`` or ``skip``.
        max_consecutive_skips: with ``skip``, this many non-finite steps in a row stop the run.
        metrics: where alarms go (an ``rm.evaluation.metrics.MetricsLog``, or anything with its ``write``).
        is_main_process: only rank 0 logs.
        loss_scaling: fp16's gradient scaler skips steps with overflowing gradients by itself.
    """

    def __init__(self, *, ln2_steps: int, ln2_tolerance: float, chance_after_steps: int, chance_tolerance: float,
                 max_abs_reward: float, lost_updates_threshold: float, on_nonfinite: str, max_consecutive_skips: int,
                 metrics=None, is_main_process: bool = True, loss_scaling: bool = False):
        self.ln2_steps, self.ln2_tolerance = ln2_steps, ln2_tolerance
        self.chance_after_steps, self.chance_tolerance = chance_after_steps, chance_tolerance
        self.max_abs_reward = max_abs_reward
        self.lost_updates_threshold = lost_updates_threshold
        self.on_nonfinite, self.max_consecutive_skips = on_nonfinite, max_consecutive_skips
        self.metrics, self.is_main_process, self.loss_scaling = metrics, is_main_process, loss_scaling
        self.alarms: List[Dict] = []  # every alarm raised: {"name", "step", "message"}
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.stop_reason: Optional[str] = None
        self._losses: List[float] = []  # step losses of the first ln2_steps steps
        self._sums: Optional[torch.Tensor] = None
        self._action = CONTINUE
        self._probe: Optional[LostUpdateProbe] = None  # set by watch_updates
        self._warmup_steps = 0
        # Lost-update counts on the device, [lost, counted] of the logging window and of its steps after warmup
        # (summed in after_update without a host sync; read at logging steps).
        self._window_lost: Optional[torch.Tensor] = None
        self._window_steps_after_warmup = 0
        self._lost_after_warmup = [0, 0]  # [lost, counted] over every step after warmup so far, on the host
        self._lost_steps = 0  # steps after warmup those counts cover
        self._pending_window = [0, 0, 0, 0]  # a restored checkpoint's open window, added at the next logging step

    @classmethod
    def from_config(cls, health_cfg, **kwargs) -> "HealthMonitor":
        """From the ``health`` group (``rm.foundations.config.HealthConfig``); ``kwargs`` as for the constructor."""
        h = health_cfg
        return cls(ln2_steps=h.ln2_steps, ln2_tolerance=h.ln2_tolerance, chance_after_steps=h.chance_after_steps,
                   chance_tolerance=h.chance_tolerance, max_abs_reward=h.max_abs_reward,
                   lost_updates_threshold=h.lost_updates_threshold, on_nonfinite=h.on_nonfinite,
                   max_consecutive_skips=h.max_consecutive_skips, **kwargs)

    def state_dict(self) -> Dict:
        """The counters a resumed run continues from (saved by ``rm.runs.train_state``)."""
        return {"alarms": [dict(a) for a in self.alarms], "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "ln2_losses": list(self._losses),
                "lost_updates": [*self._lost_after_warmup, self._lost_steps],
                # the window still open at a checkpoint, so that a resumed run logs and alarms as an unbroken one
                "lost_updates_window": [*self._open_window(), self._window_steps_after_warmup]}

    def _open_window(self) -> List[int]:
        window = self._window_lost.tolist() if self._window_lost is not None else [0, 0, 0, 0]
        return [int(a) + b for a, b in zip(window, self._pending_window)]

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from :meth:`state_dict`; an alarm raised before the checkpoint is not raised again."""
        restored = [dict(a) for a in state.get("alarms", [])]
        names = {a["name"] for a in restored}
        # Alarms of this process's data checks, raised before the checkpoint was known, stay.
        self.alarms = restored + [a for a in self.alarms if a["name"] not in names]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self._losses = [float(x) for x in state.get("ln2_losses", [])]
        lost, counted, steps = state.get("lost_updates", (0, 0, 0))  # absent from checkpoints of older runs
        self._lost_after_warmup, self._lost_steps = [int(lost), int(counted)], int(steps)
        *window, window_steps = state.get("lost_updates_window", (0, 0, 0, 0, 0))
        self._pending_window, self._window_steps_after_warmup = [int(x) for x in window], int(window_steps)
        self._window_lost = None

    @property
    def fired(self) -> List[str]:
        return [a["name"] for a in self.alarms]

    def raise_alarm(self, alarm: Optional[Alarm], step: int) -> None:
        """Log and record ``alarm`` unless it is ``None`` or was raised before."""
        if alarm is None or alarm.name in self.fired:
            return
        self.alarms.append({"name": alarm.name, "step": step, "message": alarm.message})
        if self.is_main_process:
            log.warning("health alarm %s at step %d: %s", alarm.name, step, alarm.message)
        self._write("alarm", step, {"name": alarm.name, "message": alarm.message})

    def watch_updates(self, probe: LostUpdateProbe, warmup_steps: int) -> None:
        """Measure lost updates with ``probe`` at every applied step.

        Args:
            probe: watches the tensors the optimizer updates (``rm.foundations.lost_updates``).
            warmup_steps: the schedule's warmup. Its first steps have a learning rate near 0, whose updates
                are lost by design, so the alarm's running fraction starts after it (the logged one does not).
        """
        self._probe, self._warmup_steps = probe, warmup_steps

    def _write(self, event: str, step: int, values: Dict) -> None:
        if self.metrics is not None:
            self.metrics.write(event, step, values)

    # ---- hook points

    def check_data(self, pad_token_id: Optional[int], pad_token: Optional[str], audit: Mapping) -> None:
        """After the tokenizer and data are built.

        Args:
            audit: the pair audit of ``rm.data.build.build_datasets`` (``audit["splits"][split]["dropped"]``).

        Raises:
            ConfigError: the tokenizer has no pad id (``pad_token_unset``); the pipeline cannot run without one.
        """
        pad_in_text = {split: a["dropped"]["pad_in_text"] for split, a in audit["splits"].items()}
        alarm = pad_token_alarm(pad_token_id, pad_token, pad_in_text)
        self.raise_alarm(alarm, 0)
        self.raise_alarm(unknown_tokens_alarm({split: a.get("unk_rate", 0.0) for split, a in audit["splits"].items()}), 0)
        if alarm is not None and alarm.name == "pad_token_unset":
            from rm.settings.validate import ConfigError

            raise ConfigError(f"{alarm.name}: {alarm.message}")

    def observe(self, loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        """Each micro-batch: accumulate on the device (no host sync) what :meth:`before_update` checks."""
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        rewards = torch.cat([chosen.detach().float().reshape(-1), rejected.detach().float().reshape(-1)])
        sums = torch.stack([
            (~finite).float(),  # micro-batches with a non-finite loss
            torch.where(finite, loss, torch.zeros_like(loss)),  # sum of the finite losses
            finite.float(),  # how many
            rewards.abs().sum(),
            # Filled on the device: a tensor made from a host number is copied there, and that copy waits for the device.
            rewards.new_full((), rewards.numel()),
        ])
        self._sums = sums if self._sums is None else self._sums + sums

    def before_update(self, step: int, grad_norm: Optional[float], head_gradients: Sequence[Optional[torch.Tensor]],
                      reduce: Callable[[torch.Tensor], torch.Tensor]) -> str:
        """After the step's last backward, before the optimizer step: returns ``continue``, ``skip`` or ``stop``.

        Args:
            step: the step being taken (1-based).
            grad_norm: the gradient norm before clipping, or ``None`` where the engine only knows it later.
            head_gradients: as for :func:`head_gradient_alarm`.
            reduce: sums a tensor over processes (``engine.reduce``); every rank gets the same answer.
        """
        sums, self._sums = reduce(self._sums).tolist(), None
        bad_losses, loss_sum, finite_losses, abs_rewards, n_rewards = sums
        self.raise_alarm(head_gradient_alarm(head_gradients), step)
        if n_rewards:
            self.raise_alarm(reward_scale_alarm(abs_rewards / n_rewards, self.max_abs_reward), step)
        # A fp16 scaler skips an overflowing step itself; only a non-finite loss is ours to act on.
        alarm = nonfinite_alarm(int(bad_losses), None if self.loss_scaling else grad_norm)
        if alarm is not None:
            self._action = self._nonfinite(alarm, step)
            return self._action
        if step <= self.ln2_steps and finite_losses:
            self._losses.append(loss_sum / finite_losses)
            if step == self.ln2_steps:
                self.raise_alarm(ln2_plateau_alarm(self._losses, self.ln2_tolerance), step)
        self._action = CONTINUE
        if self._probe is not None:
            self._probe.snapshot()
        return CONTINUE

    def after_update(self, step: int, applied: bool) -> str:
        """After the optimizer step: ``stop`` when the engine did not do what :meth:`before_update` asked.

        Args:
            applied: whether the engine changed the weights.
        """
        counts = self._probe.compare() if self._probe is not None else None
        if counts is not None and applied:  # a dropped update was not lost to rounding
            after_warmup = step > self._warmup_steps
            both = torch.cat([counts, counts if after_warmup else torch.zeros_like(counts)])
            self._window_lost = both if self._window_lost is None else self._window_lost + both
            self._window_steps_after_warmup += after_warmup
        if self._action == SKIP:
            if applied:  # the engine could not drop the update: the weights may no longer be finite
                return self._stop(step, "the update of a non-finite step could not be skipped")
            return CONTINUE
        if applied or self.loss_scaling:
            self.consecutive_skips = 0
            return CONTINUE
        # The engine dropped the update itself: DeepSpeed's overflow check found non-finite gradients.
        return self._nonfinite(Alarm("nonfinite_grad_norm", "the engine found non-finite gradients and did not "
                                     "apply the update (DeepSpeed overflow check)."), step)

    def lost_update_fraction(self, step: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Optional[float]:
        """At a logging step: the logging window's lost-update fraction, and the ``lost_updates`` alarm.

        The alarm reads the running fraction over every step after warmup so far, so that one window at a
        low learning rate (the end of a cosine schedule) does not raise it alone.

        Args:
            step: the last step of the window.
            reduce: sums a tensor over processes; every rank gets the same answer.

        Returns:
            The fraction of the window's sampled elements with a nonzero gradient whose update was lost, or
            ``None`` when nothing is watched or nothing was counted.
        """
        if self._probe is None:
            return None
        window = self._window_lost if self._window_lost is not None else self._probe.zeros(4)  # every step dropped
        window = window + torch.tensor(self._pending_window, dtype=window.dtype, device=window.device)
        self._pending_window = [0, 0, 0, 0]
        # Every rank watches the same elements of its replica: the sums over ranks count each several times,
        # which changes no fraction.
        lost, counted, lost_after, counted_after = reduce(window).tolist()
        self._lost_after_warmup = [self._lost_after_warmup[0] + int(lost_after), self._lost_after_warmup[1] + int(counted_after)]
        self._lost_steps += self._window_steps_after_warmup
        self._window_lost, self._window_steps_after_warmup = None, 0
        self.raise_alarm(lost_updates_alarm(lost_fraction(self._lost_after_warmup), self.lost_updates_threshold,
                                            self._lost_steps), step)
        return lost_fraction((lost, counted))

    def check_eval(self, step: int, accuracy: Optional[float]) -> None:
        """After an evaluation: eval accuracy at (or below) chance once ``chance_after_steps`` are done."""
        if accuracy is not None and step >= self.chance_after_steps:
            alarm = chance_accuracy_alarm(accuracy, self.chance_tolerance)
            if alarm is not None:
                alarm = Alarm(alarm.name, f"after {step} steps, {alarm.message}")
            self.raise_alarm(alarm, step)

    # ---- the non-finite policy

    def _nonfinite(self, alarm: Alarm, step: int) -> str:
        self.raise_alarm(alarm, step)
        if self.on_nonfinite == STOP:
            return self._stop(step, f"{alarm.name} at step {step} (health.on_nonfinite=stop)")
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self._write("skip", step, {"reason": alarm.name})
        if self.is_main_process:
            log.info("step %d skipped: %s (%d skipped so far)", step, alarm.name, self.skipped_steps)
        if self.consecutive_skips >= self.max_consecutive_skips:
            return self._stop(step, f"{self.consecutive_skips} non-finite steps in a row up to step {step}, the last "
                                    f"{alarm.name} (health.max_consecutive_skips={self.max_consecutive_skips})")
        return SKIP

    def _stop(self, step: int, reason: str) -> str:
        self.stop_reason = reason
        self._action = STOP
        self._write("stopped", step, {"reason": reason})
        return STOP
