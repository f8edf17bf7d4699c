"""Faults: a full disk while saving, a damaged checkpoint, a run directory that holds an earlier run."""

import errno
import json
import subprocess
import sys

import pytest

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
