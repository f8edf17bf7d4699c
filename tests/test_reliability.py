"""Bad configs and faults: a full disk while saving, a damaged checkpoint, a run directory that holds an
earlier run, secrets in the environment, SIGTERM to a real process. The table in docs/reliability.md
points here."""

import errno
import json
import random
import subprocess
import sys

import pytest
import torch

import rm.checkpoint as ckpt
import rm.train as rm_train
from tests.conftest import CONF_DIR, FAST_TINY

ROOT = CONF_DIR.parent
STEPS = ["train.max_steps=4", "train.save_steps=2", "train.eval_steps=0", "train.save_total_limit=3"]


def test_full_disk_while_saving_gives_a_clear_error_and_keeps_the_previous_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    real_save = rm_train.AccelerateEngine.save_state

    def save_until_the_disk_fills(self, directory):
        real_save(self, directory)
        if directory.name.endswith("checkpoint-4"):
            (directory / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rm_train.AccelerateEngine, "save_state", save_until_the_disk_fills)
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-4 .*No space left on device.*checkpoint-2.* is intact"):
        rm_train.train(tiny_cfg(*STEPS, "train.max_steps=6"), tmp_path)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written directory is gone
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-2"


def test_a_checkpoint_cut_short_after_writing_is_passed_over(tiny_cfg, tmp_path):
    rm_train.train(tiny_cfg(*STEPS), tmp_path)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]  # step 4 is the end: final/, no checkpoint
    state = json.loads((tmp_path / "checkpoints" / "checkpoint-2" / ckpt.STATE_FILE).read_text())
    assert state["step"] == 2 and state["files"]
    # Damage the newest checkpoint the way an interrupted copy or a full network disk does.
    newest = tmp_path / "checkpoints" / "checkpoint-2"
    biggest = max(newest.rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    assert ckpt.latest_checkpoint(tmp_path) is None  # checkpoint-2 was the only one


def test_a_finished_run_is_not_overwritten_silently(tiny_cfg, tmp_path):
    rm_train.train(tiny_cfg(*STEPS), tmp_path)
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a finished run.*train.resume=true.*train.overwrite=true"):
        rm_train.train(tiny_cfg(*STEPS, "train.seed=7"), tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    # Asked for explicitly, the earlier run is replaced.
    rm_train.train(tiny_cfg(*STEPS, "train.seed=7", "train.overwrite=true"), tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() != before
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if '"train"' in l][0] > 0


def test_cli_refuses_an_earlier_run_dir_with_exit_2(tmp_path):
    (tmp_path / "final").mkdir()
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "already holds a finished run" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_secrets_in_the_environment_stay_out_of_the_run_directory(tmp_path):
    secret = "hf_SECRETtoken1234567890"
    proc = subprocess.run(
        [sys.executable, "-m", "rm.train", *FAST_TINY, "train.max_steps=2", "train.eval_steps=0",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_TOKEN": secret, "WANDB_API_KEY": secret},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert secret not in proc.stdout + proc.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("override,needles", [
    ("memory_profile=fast", ["memory_profile", "full", "lora", "offload"]),  # unknown option: Hydra lists the options
    ("train.micro_batch_size=abc", ["train.micro_batch_size", "abc"]),  # wrong type
    ("train.global_batch_size=-4", ["train.global_batch_size=-4", "must be > 0"]),
    ("memory_profile=lora lora.r=0", ["lora.r=0", "must be > 0"]),
    ("memory_profile=lora lora.target_modules=[qkv]", ["lora.target_modules", "qkv", "accepted: q_proj"]),
    ("data.max_length=100000", ["data.max_length=100000", "model.max_position_embeddings"]),
    ("train.global_batch_size=20", ["train.global_batch_size=20 is not divisible", "train.micro_batch_size=8"]),
    ("train.precision=bf16 hardware.bf16=false", ["train.precision=bf16", "hardware.bf16=false"]),
    ("memory_profile=qlora", ["memory_profile=qlora", "CUDA"]),
])
def test_bad_config_fails_before_loading_with_one_message_naming_the_key(tmp_path, override, needles):
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, *override.split(), f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    for needle in needles:
        assert needle in out, (needle, out[-2000:])
    assert "Traceback" not in out
    assert not (tmp_path / "final").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_sigterm_at_a_random_step_of_a_real_process_then_resume_equals_an_uninterrupted_run(tmp_path):
    """SLURM pre-emption: SIGTERM to a running ``python -m rm.train`` at a random step (the seed is in
    the assertion message), exit 143 with a checkpoint, ``train.resume=true`` finishes the run, and the
    final weights equal those of a run that was never interrupted, bit for bit on the CPU."""
    import os
    import signal
    import time

    from safetensors.torch import load_file

    seed = int.from_bytes(os.urandom(2), "little")
    kill_after = random.Random(seed).randint(2, 9)
    args = [*FAST_TINY, "train.max_steps=12", "train.save_steps=5", "train.eval_steps=0", "train.logging_steps=1"]

    def run(run_dir, *extra):
        return subprocess.Popen([sys.executable, "-m", "rm.train", *args, *extra, f"hydra.run.dir={run_dir}"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    straight = run(tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, straight.stdout.read()[-2000:]

    victim = run(tmp_path / "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        if metrics.exists() and sum('"train"' in l for l in metrics.read_text().splitlines()) >= kill_after:
            victim.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out = victim.communicate(timeout=600)[0]
    assert victim.returncode == 128 + signal.SIGTERM, f"seed {seed}: {out[-2000:]}"
    assert list((tmp_path / "killed" / "checkpoints").glob("checkpoint-*")), f"seed {seed}"

    resumed = run(tmp_path / "killed", "train.resume=true")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()[-2000:]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}: resumed weights differ (killed after step {kill_after})"


def test_a_dataset_with_no_usable_pair_is_a_clear_error(tmp_path):
    from rm.data.build import build_split
    from rm.estimate import compose
    from rm.model import build_tokenizer

    rows = [{"prompt": "Human: hi", "chosen": " same", "rejected": " same"}] * 3 + [{"prompt": "x", "chosen": "", "rejected": "y"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{path}]"])
    with pytest.raises(ValueError, match=r"data local \[train\]: no usable pairs left \(pairs 4 -> 0 used"):
        build_split(cfg.data, build_tokenizer(cfg.model), "train")
