"""The training loop's state (rm.runs.train_state) is saved in every checkpoint and continues after a resume."""

import json
import shutil

import pytest
import torch

import rm.runs.checkpoint as ckpt
import rm.train as rm_train
from rm.runs.train_state import TrainState


def test_record_round_trip_gives_the_sums_to_the_main_process():
    """One process (reduce is the identity): what a record holds comes back; another process gets the window's
    loss and step count but none of the tokens, which the main process already carries for the sums."""
    state = TrainState.start(torch.device("cpu"), step=4)
    state.tokens, state.window_tokens, state.window_steps, state.train_s = 1000, 300, 2, 5.0
    state.window_loss += 1.25

    def identity(tensor, reduction="sum"):
        return tensor

    record = state.record(identity, trained_s=2.5, health={"skipped_steps": 1})
    assert json.loads(json.dumps(record)) == record
    assert (record["step"], record["tokens"], record["train_s"], record["window_loss"]) == (4, 1000, 7.5, 1.25)
    main = TrainState.start(torch.device("cpu"), record)
    other = TrainState.start(torch.device("cpu"), record, is_main_process=False)
    assert (main.step, main.tokens, main.window_tokens, main.window_steps, main.train_s) == (4, 1000, 300, 2, 7.5)
    assert (other.step, other.tokens, other.window_tokens, other.window_steps) == (4, 0, 0, 2)
    assert main.window_loss.item() == other.window_loss.item() == 1.25
    assert main.health == {"skipped_steps": 1}


def _cfg(*overrides):
    from rm.foundations.config import to_run_config
    from tests.conftest import FAST_TINY, compose_run

    # A log line every 3 steps and checkpoints at 2 and 4: the window at checkpoint-2 holds steps 1-2.
    # ln2_tolerance=1: every early loss (about ln 2 = 0.69) is "at ln 2", so the alarm fires at step ln2_steps=2, before checkpoint-2.
    six = ["train.max_steps=6", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_total_limit=3",
           "train.logging.logging_steps=3", "health.ln2_steps=2", "health.ln2_tolerance=1"]
    return to_run_config(compose_run(FAST_TINY + six + list(overrides)))


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_continues_tokens_log_window_and_health_counters(tmp_path):
    """The same six steps uninterrupted and resumed from checkpoint-2.

    The resumed run logs at step 3 the loss of steps 1-3, as the uninterrupted one did; it writes a
    checkpoint-4 whose state (tokens seen, window, health counters) is the uninterrupted one's; and it
    keeps the ln 2 alarm raised at step 2 without raising it again. Without the state it would log the
    loss of step 3 alone, count only the tokens of steps 3-4, and report no alarm.
    """
    first = tmp_path / "first"
    rm_train.train(_cfg(), first)
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    shutil.rmtree(resumed / "final")
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-4")
    (resumed / "metrics.jsonl").unlink()  # only the resumed run's lines
    result = rm_train.train(_cfg("train.checkpoint.resume=true"), resumed)
    assert result["status"] == "ok" and result["step"] == 6
    assert "loss_at_ln2" in result["alarms"]
    assert not [x for x in _lines(resumed) if x["event"] == "alarm" and x["name"] == "loss_at_ln2"]

    def loss_at_step_3(run_dir):
        return next(x["loss"] for x in _lines(run_dir) if x["event"] == "train" and x["step"] == 3)

    assert loss_at_step_3(resumed) == pytest.approx(loss_at_step_3(first), rel=1e-6)

    def state(run_dir, step):
        return ckpt.checkpoint_state(run_dir / "checkpoints" / f"checkpoint-{step}")["train_state"]

    want, got = state(first, 4), state(resumed, 4)
    assert want["tokens"] > state(first, 2)["tokens"] > 0
    assert [a["name"] for a in want["health"]["alarms"]] == ["loss_at_ln2"]
    for key in ("step", "tokens", "window_tokens", "window_steps", "health"):
        assert got[key] == want[key], key
    assert got["window_loss"] == pytest.approx(want["window_loss"], rel=1e-6)
    assert got["train_s"] > state(first, 2)["train_s"]  # the time before the checkpoint is counted on
