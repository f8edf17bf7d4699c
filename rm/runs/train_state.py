"""What the training loop carries from step to step, saved in every checkpoint and restored on resume.

Without it a resumed run would count tokens and training time from zero, log a first window that
leaves out the steps before the checkpoint, and forget its health counters (alarms already raised,
skipped steps, the losses of the ln 2 check), as if the steps before the checkpoint had not happened.
It goes into the checkpoint's ``trainer_state.json`` under ``train_state`` (:func:`rm.runs.checkpoint.save_checkpoint`).

Counts differ between processes (each sees its own pairs); the record holds the sums over processes,
and a restored state gives them to the main process and zero to the others, so that the sums the loop
takes at each logging step and at the end come out as in an uninterrupted run. The window's loss is
averaged over processes at logging; every process restores the average, which averages the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

import torch


@dataclass
class TrainState:
    """The loop's state.

    Attributes:
        step: optimizer steps taken.
        tokens: real (chosen + rejected) tokens this process trained on.
        train_s: seconds spent training (not evaluating or saving) before this process's loop started.
        window_loss: the logging window's loss: each micro-batch's mean loss weighted by its share of the
            step, summed. It stays on the device until a logging step: reading it per micro-batch
            (``.item()``) would wait for the device each time. float64 adds exactly as the host's floats did.
        window_tokens: real tokens of the window on this process.
        window_steps: steps in the window.
        window_start: ``time.perf_counter()`` when the window started (earlier for a restored window).
        health: the health monitor's counters (``HealthMonitor.state_dict``) at the last checkpoint.
        fingerprint: the settings that shape training (:func:`rm.runs.resume.fingerprint`), as this run applies
            them; saved beside the record in every checkpoint, and compared with a resumed run's.
        loop_start: ``time.perf_counter()`` when this process's loop started.
        paused_s: seconds this process's loop has spent evaluating and saving, not training.
    """

    step: int = 0
    tokens: int = 0
    train_s: float = 0.0
    window_loss: Optional[torch.Tensor] = None
    window_tokens: int = 0
    window_steps: int = 0
    window_start: float = field(default_factory=time.perf_counter)
    health: Dict = field(default_factory=dict)
    fingerprint: Dict = field(default_factory=dict)
    loop_start: float = field(default_factory=time.perf_counter)
    paused_s: float = 0.0

    @classmethod
    def start(cls, device: torch.device, record: Optional[Mapping] = None, step: int = 0,
              is_main_process: bool = True, fingerprint: Optional[Mapping] = None) -> "TrainState":
        """A fresh state at ``step``, or the one a checkpoint's :meth:`record` holds.

        Args:
            device: where the window's loss is summed.
            record: ``train_state`` of the checkpoint resumed from; ``None`` (no checkpoint, or one written
                before the state was saved): counts start at zero.
            step: the step to start from when there is no record.
            is_main_process: the main process takes the record's sums over processes, the others zero.
            fingerprint: this run's settings; a checkpoint's were already compared with them (``rm.runs.resume``).
        """
        state = cls(step=step, window_loss=torch.zeros((), dtype=torch.float64, device=device),
                    fingerprint=dict(fingerprint or {}))
        if record is None:
            return state
        share = 1 if is_main_process else 0
        state.step = int(record["step"])
        state.tokens = share * int(record["tokens"])
        state.train_s = float(record["train_s"])
        state.window_loss.fill_(float(record["window_loss"]))
        state.window_tokens = share * int(record["window_tokens"])
        state.window_steps = int(record["window_steps"])
        state.window_start = time.perf_counter() - float(record["window_s"])
        state.health = dict(record["health"])
        return state

    def add_step(self, loss: torch.Tensor, tokens: int, taken: bool = True) -> None:
        """After a step's forwards and backwards: its loss (on the device, each micro-batch's weighted by its
        share of the step) and its real tokens; ``taken``: the optimizer step counts (not a health stop)."""
        self.window_loss += loss
        self.window_tokens += tokens
        self.tokens += tokens
        if taken:
            self.step += 1
            self.window_steps += 1

    def trained_s(self, until: float) -> float:
        """Seconds this process's loop has trained from its start until ``until``, pauses excluded."""
        return until - self.loop_start - self.paused_s

    def reset_window(self) -> None:
        """After a logging step."""
        self.window_loss.zero_()
        self.window_tokens, self.window_steps, self.window_start = 0, 0, time.perf_counter()

    def record(self, reduce: Callable[..., torch.Tensor], trained_s: float, health: Mapping) -> Dict:
        """The JSON for a checkpoint; every process calls it (it sums over processes).

        Args:
            reduce: ``engine.reduce``.
            trained_s: seconds this process's loop has trained so far, pauses excluded.
            health: ``HealthMonitor.state_dict()``.
        """
        device = self.window_loss.device
        tokens, window_tokens = reduce(torch.tensor([self.tokens, self.window_tokens], device=device), reduction="sum").tolist()
        return {
            "step": self.step,
            "tokens": int(tokens),
            "train_s": self.train_s + trained_s,
            "window_loss": float(reduce(self.window_loss.clone(), reduction="mean")),
            "window_tokens": int(window_tokens),
            "window_steps": self.window_steps,
            "window_s": time.perf_counter() - self.window_start,
            "torch_threads": torch.get_num_threads(),  # a resume under train.threads=0 keeps it (rm.foundations.threads)
            "health": dict(health),
        }
