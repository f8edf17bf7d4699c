"""Short real runs of the pipeline on the tiny model: it learns, saves, reloads and resumes."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import rm.train as rm_train
from rm.modelling.bundle import bundle_tokenizer
from rm.evaluation.metrics import MetricsLog
from rm.runs.run_dir import TOKENIZER_DIR
from rm.data.build import build_split, train_pairs
from rm.data.tokenizer import run_tokenizer
from rm.data.collator import PairCollator
from rm.modelling.model import build_model, pair_rewards
from tests.conftest import CONF_DIR


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory):
    """One tiny full fine-tune, shared by the tests that inspect its outputs. 160 steps: at this seed
    400 reach no higher (eval accuracy 0.80 both), and take 30-50 s more."""
    from tests.conftest import FAST_TINY, compose_run
    from rm.foundations.config import to_run_config

    cfg = to_run_config(
        compose_run(
            FAST_TINY
            + ["data.max_length=128", "data.synthetic_train_size=8192", "data.synthetic_test_size=256",
               "train.global_batch_size=32", "train.max_steps=160", "train.logging.eval_steps=80"]
        )
    )
    run_dir = tmp_path_factory.mktemp("learned")
    result = rm_train.train(cfg, run_dir)
    return cfg, run_dir, result


def test_eval_accuracy_rises_well_above_chance(learned_run):
    _, run_dir, result = learned_run
    assert result["status"] == "ok"
    evals = [m for m in read_metrics(run_dir) if m["event"] == "eval"]
    assert [m["step"] for m in evals] == [80, 160]
    # Refusal pairs alone (a fifth of the data) give about 0.6; more needs the answer read against the
    # prompt. Measured: 0.80 at step 160, as at step 400 (the full demo goes on to 0.93). Other seeds learn slower
    # (seed 1: 0.70 at step 200), which is why this checks the default seed only. With the packages a fresh install
    # resolves on 2026-12-07 (transformers 5.24-5.25, accelerate 1.15-1.16 alike) this seed reaches 0.727 at step 160,
    # the same at 3a76c3e, before that day's changes: the trajectory moved with the environment, not the code.
    assert result["eval_accuracy"] >= 0.70, result
    train_events = [m for m in read_metrics(run_dir) if m["event"] == "train"]
    assert all({"step", "loss", "lr", "tokens_per_s"} <= m.keys() for m in train_events)
    assert train_events[-1]["loss"] < train_events[0]["loss"]


def test_trainable_weights_changed(learned_run):
    cfg, run_dir, _ = learned_run
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    set_seed(cfg.train.seed)  # the same seed train() sets before building: the same initial weights
    initial = build_model(cfg.model, tokenizer.pad_token_id, "float32", False).state_dict()
    final = load_file(run_dir / "final" / "model.safetensors")
    changed = [k for k, v in final.items() if not torch.equal(v, initial[k])]
    assert "score.weight" in changed
    assert len(changed) == len(final), set(final) - set(changed)


def test_saved_model_gives_the_pipelines_rewards_with_plain_transformers(learned_run):
    cfg, run_dir, result = learned_run
    model = AutoModelForSequenceClassification.from_pretrained(run_dir / "final").eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    assert tokenizer.pad_token_id == model.config.pad_token_id == run_tokenizer(cfg.model, train_pairs(cfg.data)).pad_token_id
    trained, _ = bundle_tokenizer(run_dir / "final")  # the tokenizer as trained; the top-level one adds the EOS itself
    eval_set, _ = build_split(cfg.data, trained, "eval")
    batch = PairCollator(tokenizer.pad_token_id)(eval_set)
    with torch.no_grad():
        chosen, rejected = pair_rewards(model, batch["input_ids"], batch["attention_mask"])
        # Plain transformers, one unpadded sequence at a time: the reward must not depend on padding.
        alone = [model(input_ids=torch.tensor([ids])).logits.item() for ids in eval_set["chosen_input_ids"][:8]]
    assert torch.allclose(chosen[:8], torch.tensor(alone), atol=1e-5)
    accuracy = (chosen > rejected).float().mean().item()
    assert accuracy == pytest.approx(result["eval_accuracy"], abs=1e-9)


def test_score_cli_reports_the_same_accuracy(learned_run, tmp_path):
    cfg, run_dir, result = learned_run
    from rm.data.synthetic import write_synthetic

    paths = write_synthetic(tmp_path, n_train=1, n_test=cfg.data.synthetic_test_size, seed=cfg.data.synthetic_seed)
    out = tmp_path / "scored.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "rm.score", "--model", str(run_dir / "final"), "--input", str(paths["test"]),
         "--max-length", str(cfg.data.max_length), "--output", str(out)],
        capture_output=True, text=True, cwd=CONF_DIR.parent, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"pairwise accuracy {result['eval_accuracy']:.4f}" in proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == result["eval_pairs"] and {"reward_chosen", "reward_rejected"} <= rows[0].keys()


def _signal_at(monkeypatch, step_to_stop, signum):
    """Deliver a real signal to this process once the run logs ``step_to_stop``."""
    original = MetricsLog.write

    def write(self, event, step, values):
        original(self, event, step, values)
        if event == "train" and step == step_to_stop:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(MetricsLog, "write", write)


@pytest.mark.reliability("Faults", "SIGTERM / SIGINT during training", "finishes the step, writes a checkpoint, exits 128+N; `train.checkpoint.resume=true` continues; final weights equal an uninterrupted run's bit for bit")
# SIGINT under -m slow (tests/e2e/test_signals.py drives both through a real process there too)
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_interrupted_and_resumed_run_equals_uninterrupted(tiny_cfg, tmp_path, monkeypatch, signum):
    overrides = ("train.max_steps=10", "train.checkpoint.save_steps=4", "train.logging.eval_steps=0", "train.checkpoint.save_total_limit=2")
    straight = rm_train.train(tiny_cfg(*overrides), tmp_path / "straight")
    assert straight["status"] == "ok"

    _signal_at(monkeypatch, 6, signum)
    stopped = rm_train.train(tiny_cfg(*overrides), tmp_path / "resumed")
    assert (stopped["status"], stopped["step"]) == ("interrupted", 6)
    checkpoints = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint-4", "checkpoint-6"]
    monkeypatch.undo()

    assert (tmp_path / "resumed" / TOKENIZER_DIR / "tokenizer.json").is_file()  # read back on resume
    resumed = rm_train.train(tiny_cfg(*overrides, "train.checkpoint.resume=true"), tmp_path / "resumed")
    assert resumed["status"] == "ok"
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    assert resumed["eval_loss"] == straight["eval_loss"]
    steps = [m["step"] for m in read_metrics(tmp_path / "resumed") if m["event"] == "train"]
    assert steps == [2, 4, 6, 8, 10]


@pytest.mark.slow  # two QLoRA runs and a resume: about a minute on 2 cores
def test_interrupted_and_resumed_qlora_run_equals_uninterrupted(tiny_cfg, tmp_path, monkeypatch):
    """QLoRA as the other profiles: the 4-bit base is rebuilt from the same saved random init on resume, the adapters,
    head and optimizer come from the checkpoint, and the final adapter equals an uninterrupted run's bit for bit."""
    pytest.importorskip("bitsandbytes")
    monkeypatch.setenv("RM_CACHE", str(tmp_path / "cache"))
    overrides = ("memory_profile=qlora", "train.max_steps=8", "train.checkpoint.save_steps=4", "train.logging.eval_steps=0")
    straight = rm_train.train(tiny_cfg(*overrides), tmp_path / "straight")
    assert straight["status"] == "ok"

    _signal_at(monkeypatch, 6, signal.SIGTERM)
    stopped = rm_train.train(tiny_cfg(*overrides), tmp_path / "resumed")
    assert (stopped["status"], stopped["step"]) == ("interrupted", 6)
    monkeypatch.undo()
    monkeypatch.setenv("RM_CACHE", str(tmp_path / "cache"))
    resumed = rm_train.train(tiny_cfg(*overrides, "train.checkpoint.resume=true"), tmp_path / "resumed")
    assert resumed["status"] == "ok"
    a = load_file(tmp_path / "straight" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed adapter differs from the uninterrupted run"
    assert resumed["eval_loss"] == straight["eval_loss"]


def test_lora_profile_trains_adapters_and_head_only(tiny_cfg, tmp_path):
    cfg = tiny_cfg("memory_profile=lora", "lora=r8", "train.max_steps=4", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0")
    result = rm_train.train(cfg, tmp_path)
    assert result["status"] == "ok"
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    set_seed(cfg.train.seed)
    base = build_model(cfg.model, tokenizer.pad_token_id, "float32", False).state_dict()
    saved = load_file(tmp_path / "checkpoints" / "checkpoint-2" / "model.safetensors")
    base_keys = {k: k.replace("base_model.model.", "").replace(".base_layer", "") for k in saved if "lora_" not in k}
    frozen = [k for k, plain in base_keys.items() if plain in base and "score" not in k]
    assert frozen and all(torch.equal(saved[k], base[base_keys[k]]) for k in frozen)
    lora_b = [k for k in saved if "lora_B" in k]
    assert lora_b and all(saved[k].abs().sum() > 0 for k in lora_b)  # peft initialises lora_B at zero
    adapter = load_file(tmp_path / "final" / "adapter_model.safetensors")
    assert any("score" in k for k in adapter), "the reward head must be saved with the adapter"


def test_tensorboard_when_asked(tiny_cfg, tmp_path):
    pytest.importorskip("tensorboard")
    rm_train.train(tiny_cfg("train.max_steps=2", "train.logging.eval_steps=0", "train.logging.tensorboard=true"), tmp_path)
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no tensorboard event file written"


@pytest.mark.slow
def test_demo_reaches_90_percent(tmp_path):
    """The README's demo, exactly as a user runs it (about 2 minutes on 2 idle cores; RM_DEMO_TIMEOUT_S raises the
    15-minute limit on a machine busy with other work, where it has taken over an hour)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rm.train", "experiment=tiny", f"hydra.run.dir={tmp_path}"],
        cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=int(os.environ.get("RM_DEMO_TIMEOUT_S", 900)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [m for m in read_metrics(tmp_path) if m["event"] == "eval"][-1]
    assert final["step"] == 800 and final["eval_accuracy"] >= 0.90, final
    # The README's figure (benchmarks/results/readme_samples.json) is a run of this command: this one lands near it (CPU
    # kernels may round differently on another machine, so not to the bit).
    from tests.e2e.readme_samples import load_record

    recorded = load_record()["demo"]
    assert recorded["step"] == final["step"] and recorded["eval"]["eval_pairs"] == final["eval_pairs"]
    assert abs(recorded["eval"]["eval_accuracy"] - final["eval_accuracy"]) <= 0.02, (recorded["eval"], final)
