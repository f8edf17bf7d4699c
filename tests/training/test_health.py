"""Training-health alarms: the pure checks by hand, then each failure built on purpose in a tiny run."""

import copy
import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import rm.train as rm_train
import rm.modelling.model as rm_model
import rm.training.run_setup as run_setup
from rm.training.health import (
    LN2, SKIP, STOP, CONTINUE, HealthMonitor, chance_accuracy_alarm, head_gradient_alarm, ln2_plateau_alarm,
    nonfinite_alarm, pad_token_alarm, reward_scale_alarm,
)
from rm.modelling.model import apply_memory_profile, build_model, fp32_head_enabled, keep_head_in_fp32
from rm.settings.validate import ConfigError
from tests.conftest import CONF_DIR, FAST_TINY
from tests.data.test_tokenizer import OWN_TEXT


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def alarms_in(run_dir):
    return {m["name"]: m for m in read_metrics(run_dir) if m["event"] == "alarm"}


# ---------------------------------------------------------------- pure checks, by hand


def test_ln2_plateau_needs_every_step_within_tolerance():
    """ln 2 = 0.693147. [0.6931, 0.7000, 0.6900] are 0.000047, 0.006853 and 0.003147 away: all
    within 0.01, alarm. Replacing the last by 0.6800 (0.013147 away) breaks the plateau."""
    alarm = ln2_plateau_alarm([0.6931, 0.7000, 0.6900], tolerance=0.01)
    assert alarm.name == "loss_at_ln2" and "3 steps" in alarm.message and "learning rate" in alarm.message
    assert ln2_plateau_alarm([0.6931, 0.7000, 0.6800], tolerance=0.01) is None
    assert ln2_plateau_alarm([], tolerance=0.01) is None


def test_head_gradient_alarm_for_no_parameter_none_or_zero():
    frozen = head_gradient_alarm([])
    assert frozen.name == "head_no_gradient" and "no trainable parameter" in frozen.message
    assert head_gradient_alarm([None]).name == "head_no_gradient"
    assert "receives no gradient" in head_gradient_alarm([torch.zeros(3), None]).message
    # One non-zero element anywhere is a gradient, however small.
    assert head_gradient_alarm([torch.zeros(3), torch.tensor([0.0, 1e-30, 0.0])]) is None


def test_reward_scale_alarm_strictly_above_the_limit():
    assert reward_scale_alarm(150.0, 100.0).name == "reward_scale"
    assert reward_scale_alarm(100.0, 100.0) is None
    assert reward_scale_alarm(1e9, 0.0) is None  # 0 disables
    assert reward_scale_alarm(float("nan"), 100.0) is None  # NaN is the non-finite check's business


def test_chance_accuracy_alarm_at_and_below_chance():
    """Tolerance 0.02: 0.52 is at chance (0.5 + 0.02), 0.53 is not; 0.49 is at chance, 0.0 (every pair a
    tie, which counts as wrong) is below it."""
    assert "at chance" in chance_accuracy_alarm(0.52, 0.02).message
    assert chance_accuracy_alarm(0.53, 0.02) is None
    assert "at chance" in chance_accuracy_alarm(0.49, 0.02).message
    below = chance_accuracy_alarm(0.0, 0.02)
    assert below.name == "eval_at_chance" and "below chance" in below.message and "tie" in below.message


def test_nonfinite_alarm_names_loss_before_gradient():
    assert nonfinite_alarm(1, 1.0).name == "nonfinite_loss"
    assert nonfinite_alarm(1, float("nan")).name == "nonfinite_loss"
    assert nonfinite_alarm(0, float("inf")).name == "nonfinite_grad_norm"
    assert nonfinite_alarm(0, None) is None and nonfinite_alarm(0, 3.0) is None


def test_pad_token_alarm():
    assert pad_token_alarm(None, None, {}).name == "pad_token_unset"
    assert pad_token_alarm(0, "<pad>", {"train": 0, "eval": 0}) is None
    alarm = pad_token_alarm(7, "rabbit", {"train": 3, "eval": 1})
    assert alarm.name == "pad_token_in_text" and "4 pairs (train 3, eval 1)" in alarm.message


def test_own_text_unknown_to_a_word_level_tokenizer_raises_unknown_tokens_by_name(tiny_cfg, tmp_path):
    """A user's word-level tokenizer (a directory, as model.tokenizer takes it) on text it does not know:
    most words become <unk>, and the run says so by name. The default tokenizer keeps every pair of the same
    text (tests/data/test_tokenizer.py)."""
    from rm.data.tokenizer import build_word_level_tokenizer

    build_word_level_tokenizer().save_pretrained(tmp_path / "words")
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in OWN_TEXT))
    cfg = tiny_cfg("data=local", f"data.train_files=[{path}]", f"data.eval_files=[{path}]", "train.max_steps=1",
                   "data.identical_pairs=keep", f"model.tokenizer={tmp_path / 'words'}", *SHORT)
    result = rm_train.train(cfg, tmp_path / "run")
    assert "unknown_tokens" in result["alarms"]
    message = alarms_in(tmp_path / "run")["unknown_tokens"]["message"]
    assert message.startswith("train ") and "model.tokenizer" in message
    assert json.loads((tmp_path / "run" / "data_audit.json").read_text())["splits"]["train"]["unk_rate"] > 0.3


def test_fp32_head_enabled_auto_follows_precision():
    assert [fp32_head_enabled(None, p) for p in ("bf16", "fp16", "fp32")] == [True, True, False]
    assert fp32_head_enabled(True, "fp32") and not fp32_head_enabled(False, "bf16")


# ---------------------------------------------------------------- the monitor's policy, by hand


class Recorder:
    """Stands in for MetricsLog: keeps what would be written."""

    def __init__(self):
        self.events = []

    def write(self, event, step, values):
        self.events.append({"event": event, "step": step, **values})


def monitor(**overrides):
    args = dict(ln2_steps=0, ln2_tolerance=0.02, chance_after_steps=0, chance_tolerance=0.02, max_abs_reward=0.0,
                lost_updates_threshold=0.5, on_nonfinite="stop", max_consecutive_skips=2, metrics=Recorder())
    args.update(overrides)
    return HealthMonitor(**args)


def take_step(health, step, losses, grad_norm=1.0, head=(torch.ones(2),), chosen=(1.0,), rejected=(0.0,)):
    for loss in losses:
        health.observe(torch.tensor(loss), torch.tensor(chosen), torch.tensor(rejected))
    return health.before_update(step, grad_norm, list(head), reduce=lambda t: t)


def test_monitor_reward_scale_over_the_step_and_once():
    """Two micro-batches, chosen [1, -3] and rejected [2, 0]: |r| sums to 1 + 3 + 2 + 0 = 6 over 4 rewards,
    a mean of 1.5: above a limit of 1.4, not above 1.5. The alarm is written once, not every step."""
    health = monitor(max_abs_reward=1.4)
    for step in (1, 2):
        health.observe(torch.tensor(0.5), torch.tensor([1.0]), torch.tensor([2.0]))
        health.observe(torch.tensor(0.5), torch.tensor([-3.0]), torch.tensor([0.0]))
        assert health.before_update(step, 1.0, [torch.ones(1)], reduce=lambda t: t) == CONTINUE
    assert [(e["event"], e["name"], e["step"]) for e in health.metrics.events] == [("alarm", "reward_scale", 1)]
    quiet = monitor(max_abs_reward=1.5)
    quiet.observe(torch.tensor(0.5), torch.tensor([1.0, -3.0]), torch.tensor([2.0, 0.0]))
    quiet.before_update(1, 1.0, [torch.ones(1)], reduce=lambda t: t)
    assert quiet.fired == []


def test_monitor_ln2_checked_at_step_n_on_the_mean_step_loss():
    """Step losses are the mean over the step's micro-batches: (0.6 + 0.79) / 2 = 0.695, 0.002 from ln 2."""
    health = monitor(ln2_steps=3, ln2_tolerance=0.01)
    for step in (1, 2):
        take_step(health, step, [0.6, 0.79])
        assert health.fired == []
    take_step(health, 3, [LN2, LN2])
    assert health.fired == ["loss_at_ln2"] and health.alarms[0]["step"] == 3


def test_monitor_stop_policy():
    health = monitor()
    assert take_step(health, 1, [0.5, 0.5]) == CONTINUE and health.after_update(1, True) == CONTINUE
    assert take_step(health, 2, [0.5, float("nan")]) == STOP
    assert health.stop_reason.startswith("nonfinite_loss at step 2")
    assert [e["event"] for e in health.metrics.events] == ["alarm", "stopped"]
    assert "1 micro-batch" in health.metrics.events[0]["message"]


def test_monitor_skip_policy_counts_and_stops_after_k_in_a_row():
    health = monitor(on_nonfinite="skip", max_consecutive_skips=2)
    assert take_step(health, 1, [float("inf")]) == SKIP and health.after_update(1, False) == CONTINUE
    assert take_step(health, 2, [0.5]) == CONTINUE and health.after_update(2, True) == CONTINUE  # resets the run of skips
    assert take_step(health, 3, [0.5], grad_norm=float("nan")) == SKIP and health.after_update(3, False) == CONTINUE
    assert take_step(health, 4, [float("nan")]) == STOP
    assert health.skipped_steps == 3 and "2 non-finite steps in a row" in health.stop_reason
    events = [(e["event"], e["step"]) for e in health.metrics.events]
    assert events == [("alarm", 1), ("skip", 1), ("alarm", 3), ("skip", 3), ("skip", 4), ("stopped", 4)]


def test_monitor_engine_side_outcomes():
    # DeepSpeed dropped an update itself (its overflow check found non-finite gradients).
    health = monitor()
    assert take_step(health, 1, [0.5], grad_norm=None) == CONTINUE
    assert health.after_update(1, False) == STOP and health.fired == ["nonfinite_grad_norm"]
    # A skip the engine could not honour: the weights may be corrupt, stop whatever the policy.
    health = monitor(on_nonfinite="skip")
    assert take_step(health, 1, [float("nan")]) == SKIP
    assert health.after_update(1, True) == STOP and "could not be skipped" in health.stop_reason
    # fp16: the gradient scaler skips overflowing steps while it calibrates; neither counted nor alarmed.
    health = monitor(loss_scaling=True)
    assert take_step(health, 1, [0.5], grad_norm=float("inf")) == CONTINUE and health.after_update(1, False) == CONTINUE
    assert health.fired == [] and health.skipped_steps == 0


# ---------------------------------------------------------------- fp32 head


def test_fp32_head_keeps_weights_and_compute_in_fp32_under_bf16_autocast(tiny_cfg):
    cfg = tiny_cfg()
    model = build_model(cfg.model, 0, "bfloat16", False)
    keys = set(model.state_dict())
    keep_head_in_fp32(model)
    assert model.score.weight.dtype == torch.float32 and model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert set(model.state_dict()) == keys  # saved models keep their keys
    hidden = torch.randn(2, 3, cfg.model.hidden_size, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.score(hidden)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, hidden.float() @ model.score.weight.T, rtol=0, atol=0)
    # PEFT trains a deep copy of the head; the copy must keep both the fp32 weights and the fp32 forward.
    lora = apply_memory_profile(model, tiny_cfg("memory_profile=lora").memory_profile, cfg.lora)
    trained = [p for n, p in lora.named_parameters() if "score" in n and p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    copy_head = lora.base_model.model.score.modules_to_save["default"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert copy_head(hidden).dtype == torch.float32
    assert copy.deepcopy(model.score)(hidden.float()).dtype == torch.float32


# ---------------------------------------------------------------- each failure built on purpose


SHORT = ("train.logging.eval_steps=0", "train.checkpoint.save_steps=0", "health.chance_after_steps=0")


def test_learning_rate_zero_and_zero_head_raise_ln2_and_chance_alarms(tiny_cfg, tmp_path, monkeypatch):
    """A run that cannot learn: a zero-initialised head gives every sequence reward 0, so every step's
    loss is exactly -log sigmoid(0) = ln 2, and with learning rate 0 it stays so; every eval pair ties
    (accuracy 0: a tie counts as wrong). The run still finishes and keeps its data."""
    real_build_model, real_build_optimizer = rm_model.build_model, run_setup.build_optimizer

    def zero_head_model(*args, **kwargs):
        model = real_build_model(*args, **kwargs)
        torch.nn.init.zeros_(model.score.weight)
        return model

    monkeypatch.setattr(rm_model, "build_model", zero_head_model)  # what the factory, build_reward_model, calls
    # train.optim.learning_rate=0 is refused by validation; the optimizer gets it directly.
    monkeypatch.setattr(run_setup, "build_optimizer", lambda m, profile, optim: real_build_optimizer(
        m, profile, dataclasses.replace(optim, learning_rate=0.0)))
    result = rm_train.train(tiny_cfg("train.max_steps=4", "health.ln2_steps=4", *SHORT), tmp_path)
    assert result["status"] == "ok" and result["eval_accuracy"] == 0.0
    assert set(result["alarms"]) == {"loss_at_ln2", "eval_at_chance"}
    alarms = alarms_in(tmp_path)
    assert alarms["loss_at_ln2"]["step"] == 4 and "below chance" in alarms["eval_at_chance"]["message"]
    train_events = [m for m in read_metrics(tmp_path) if m["event"] == "train"]
    assert [m["step"] for m in train_events] == [2, 4] and all(m["loss"] == pytest.approx(LN2, abs=1e-6) for m in train_events)
    assert (tmp_path / "final").is_dir()


def test_a_dataset_of_identical_pairs_kept_on_purpose_raises_the_ln2_alarm(tiny_cfg, tmp_path):
    """data.identical_pairs=keep on pairs whose chosen and rejected are the same text: both sides get
    the same reward, so every loss is exactly ln 2 with zero gradient whatever the weights; the audit
    counts them, the alarm names them, and the run keeps its data (audit, metrics, final model)."""
    rows = [{"prompt": f"Human: what is {w}?\n\nAssistant:", "chosen": f" {w} is a word.", "rejected": f" {w} is a word."}
            for w in ("cat", "dog", "sun", "tree", "rain", "milk", "road", "book") * 4]
    data = tmp_path / "identical.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "run"
    result = rm_train.train(tiny_cfg("data=local", f"data.train_files=[{data}]", "data.identical_pairs=keep",
                                     "train.max_steps=3", "health.ln2_steps=3", *SHORT), run_dir)
    assert result["status"] == "ok" and "loss_at_ln2" in result["alarms"]
    audit = json.loads((run_dir / "data_audit.json").read_text())["splits"]["train"]
    assert audit["identical_after_truncation"] == len(rows) == audit["pairs_out"]
    losses = [m["loss"] for m in read_metrics(run_dir) if m["event"] == "train"]
    assert losses and all(loss == pytest.approx(LN2, abs=1e-6) for loss in losses)
    assert (run_dir / "final").is_dir()


def test_a_learning_run_raises_no_alarm(tiny_cfg, tmp_path):
    """The control: the same short run with the default learning rate leaves ln 2 within 4 steps
    (per-step losses move by more than 0.02 from the first updates on) and raises nothing."""
    result = rm_train.train(tiny_cfg("train.max_steps=4", "health.ln2_steps=4", "train.logging.eval_steps=0"), tmp_path)
    assert result["status"] == "ok" and result["alarms"] == [] and not alarms_in(tmp_path)


def test_tokenizer_without_pad_id_is_a_clear_error(tiny_cfg, tmp_path, monkeypatch):
    real = run_setup.run_tokenizer

    def no_pad(model_cfg, train_pairs, **kwargs):
        tokenizer = real(model_cfg, train_pairs, **kwargs)
        tokenizer.pad_token = None
        return tokenizer

    monkeypatch.setattr(run_setup, "run_tokenizer", no_pad)
    with pytest.raises(ConfigError, match="pad_token_unset: the tokenizer has no pad token"):
        rm_train.train(tiny_cfg("train.max_steps=2"), tmp_path)
    assert "pad_token_unset" in alarms_in(tmp_path)


def test_pad_token_inside_texts_raises_an_alarm_and_trains(tiny_cfg, tmp_path, monkeypatch):
    real = run_setup.run_tokenizer

    def word_as_pad(model_cfg, train_pairs, **kwargs):
        tokenizer = real(model_cfg, train_pairs, **kwargs)
        tokenizer.pad_token = "rabbit"  # a word of the synthetic texts, and a token of the word-level tokenizer
        return tokenizer

    monkeypatch.setattr(run_setup, "run_tokenizer", word_as_pad)
    result = rm_train.train(tiny_cfg("train.max_steps=2", "model.tokenizer=words", *SHORT), tmp_path)
    assert result["status"] == "ok" and "pad_token_in_text" in result["alarms"]
    audit = json.loads((tmp_path / "data_audit.json").read_text())
    dropped = audit["splits"]["train"]["dropped"]["pad_in_text"] + audit["splits"]["eval"]["dropped"]["pad_in_text"]
    words = tiny_cfg("model.tokenizer=words")
    assert dropped > 0 and f"'rabbit' (id {real(words.model, words.data).convert_tokens_to_ids('rabbit')})" in \
        alarms_in(tmp_path)["pad_token_in_text"]["message"]


@pytest.mark.parametrize("profile", ["full", "lora"])
def test_head_frozen_by_mistake_raises_an_alarm(tiny_cfg, tmp_path, monkeypatch, profile):
    real = rm_model.apply_memory_profile

    def freeze_head(model, *args):
        model = real(model, *args)
        for name, param in model.named_parameters():
            if "score" in name.split("."):  # under PEFT also its trained copy
                param.requires_grad_(False)
        return model

    monkeypatch.setattr(rm_model, "apply_memory_profile", freeze_head)  # what the factory calls
    result = rm_train.train(tiny_cfg(f"memory_profile={profile}", "train.max_steps=2", "train.logging.eval_steps=0"), tmp_path)
    assert result["status"] == "ok" and result["alarms"] == ["head_no_gradient"]
    alarm = alarms_in(tmp_path)["head_no_gradient"]
    assert alarm["step"] == 1 and "frozen by mistake" in alarm["message"]


def test_lora_head_copy_counts_as_the_trained_head(tiny_cfg, tmp_path):
    """Under PEFT the original head is frozen and its copy trains: no alarm."""
    result = rm_train.train(tiny_cfg("memory_profile=lora", "train.max_steps=2", "train.logging.eval_steps=0"), tmp_path)
    assert result["status"] == "ok" and "head_no_gradient" not in result["alarms"]


def test_reward_scale_alarm_with_a_tiny_limit(tiny_cfg, tmp_path):
    """A random head gives rewards of order 0.1-1, far above a limit of 1e-4."""
    result = rm_train.train(tiny_cfg("train.max_steps=2", "health.max_abs_reward=1e-4", "train.logging.eval_steps=0"), tmp_path)
    assert result["status"] == "ok" and result["alarms"] == ["reward_scale"]
    assert alarms_in(tmp_path)["reward_scale"]["step"] == 1


def inject_nan(monkeypatch, steps, micro_batches_per_step=2):
    """Make the training loss NaN on the first micro-batch of each step in ``steps`` (1-based): the run's loss as
    rm.training.run_setup builds it (``Run.loss``), not the memory trace's, which would count calls of its own."""
    real_build, calls = run_setup.build_loss, []

    def build_loss(train_cfg, data_cfg):
        real = real_build(train_cfg, data_cfg)

        def loss(*args, **kwargs):
            calls.append(1)
            value = real(*args, **kwargs)
            step = (len(calls) - 1) // micro_batches_per_step + 1
            first = (len(calls) - 1) % micro_batches_per_step == 0
            return value * float("nan") if step in steps and first else value  # NaN flows into the gradients too

        return loss

    monkeypatch.setattr(run_setup, "build_loss", build_loss)


@pytest.mark.reliability("Faults", "NaN/inf loss or gradient (`health.on_nonfinite=stop`, default)", "stops before the update, no checkpoint of it; exit 4")
def test_nan_loss_stops_cleanly_and_keeps_the_last_good_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    overrides = ("train.max_steps=6", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0")
    inject_nan(monkeypatch, {3})
    result = rm_train.train(tiny_cfg(*overrides), tmp_path)
    assert (result["status"], result["step"]) == ("stopped_nonfinite", 2)
    assert result["reason"].startswith("nonfinite_loss at step 3")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-2"]
    assert not (tmp_path / "final").exists()
    events = read_metrics(tmp_path)  # every line parses
    assert [(m["event"], m["step"]) for m in events] == [("train", 2), ("alarm", 3), ("stopped", 3)]
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-2" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in saved.values())
    monkeypatch.undo()

    resumed = rm_train.train(tiny_cfg(*overrides, "train.checkpoint.resume=true"), tmp_path)  # the checkpoint loads and trains on
    assert (resumed["status"], resumed["step"]) == ("ok", 6)


@pytest.mark.reliability("Faults", "NaN/inf loss with `health.on_nonfinite=skip`", "drops that update and goes on")
def test_nan_loss_with_skip_drops_that_update_and_goes_on(tiny_cfg, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {3})
    cfg = tiny_cfg("health.on_nonfinite=skip", "train.max_steps=4", "train.checkpoint.save_steps=1", "train.checkpoint.save_total_limit=4",
                   "train.logging.eval_steps=0")
    result = rm_train.train(cfg, tmp_path)
    assert (result["status"], result["step"], result["skipped_steps"]) == ("ok", 4, 1)
    assert [(m["event"], m["step"]) for m in read_metrics(tmp_path) if m["event"] in ("alarm", "skip")] == [
        ("alarm", 3), ("skip", 3)]
    ckpt = {s: load_file(tmp_path / "checkpoints" / f"checkpoint-{s}" / "model.safetensors") for s in (1, 2, 3)}
    assert all(torch.equal(ckpt[3][k], ckpt[2][k]) for k in ckpt[2]), "the skipped step changed the weights"
    assert not all(torch.equal(ckpt[2][k], ckpt[1][k]) for k in ckpt[1]), "a normal step left the weights as they were"
    final = load_file(tmp_path / "final" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in final.values())


@pytest.mark.reliability("Faults", "`health.max_consecutive_skips` non-finite steps in a row", "the run stops (status `stopped_nonfinite`)")
def test_consecutive_skips_stop_the_run(tiny_cfg, tmp_path, monkeypatch):
    inject_nan(monkeypatch, {2, 3, 4})
    cfg = tiny_cfg("health.on_nonfinite=skip", "health.max_consecutive_skips=2", "train.max_steps=5", "train.logging.eval_steps=0")
    result = rm_train.train(cfg, tmp_path)
    assert (result["status"], result["step"], result["skipped_steps"]) == ("stopped_nonfinite", 2, 2)
    assert "2 non-finite steps in a row up to step 3" in result["reason"]


@pytest.mark.parametrize("precision,weights", [("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_bf16_run_trains_an_fp32_head(tiny_cfg, tmp_path, fresh_accelerator_state, precision, weights):
    """bf16 on a CPU, health.fp32_head left at auto: the head trains and is saved in fp32; the other weights
    are stored as the mode keeps them (bf16-true: bf16; bf16-mixed: the fp32 weights autocast computes from)."""
    cfg = tiny_cfg("hardware.bf16=true", f"train.precision={precision}", "train.max_steps=2", "train.checkpoint.save_steps=1",
                   "train.logging.eval_steps=0")
    result = rm_train.train(cfg, tmp_path)
    assert result["status"] == "ok" and result["alarms"] == []
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-1" / "model.safetensors")
    assert saved["score.weight"].dtype == torch.float32
    assert saved["model.layers.0.mlp.up_proj.weight"].dtype == weights
    assert math.isfinite(float(saved["score.weight"].abs().sum()))


def test_cli_exits_4_after_a_nonfinite_stop(tmp_path):
    """``python -m rm.train`` itself: a loss that is NaN from the first step ends the job with exit status 4."""
    code = (  # patched where rm.train imports it from, then run as `python -m rm.train` runs it
        "import runpy, sys\n"
        "import rm.modelling.loss\n"
        "real = rm.modelling.loss.bradley_terry_loss\n"
        "rm.modelling.loss.bradley_terry_loss = lambda *a, **k: real(*a, **k) * float('nan')\n"
        "runpy.run_module('rm.train', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *FAST_TINY, "train.max_steps=3", f"hydra.run.dir={tmp_path}"],
        cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "stopped before step 1 of 3: nonfinite_loss at step 1" in proc.stdout + proc.stderr
    assert [m["event"] for m in read_metrics(tmp_path)] == ["alarm", "stopped"]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final").exists()
