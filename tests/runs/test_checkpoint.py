"""rm.runs.checkpoint on its own: a one-process stand-in engine instead of accelerate, so each case takes
milliseconds. What is checked: a checkpoint is complete only as a whole, its checksums catch a changed byte,
non-finite weights are never written, old checkpoints are pruned, and damaged ones are passed over by name."""

from __future__ import annotations

import json

import pytest
import torch

from rm.foundations.errors import NonFiniteError
from rm.runs import checkpoint as ckpt


class StandInEngine:
    """The part of rm.distributed.engine's interface that checkpointing uses, for one process."""

    is_main_process, num_processes, process_index, device = True, 1, 0, torch.device("cpu")

    def __init__(self):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)

    def unwrapped_model(self):
        return self.model

    def reduce(self, tensor):
        return tensor

    def wait_for_everyone(self):
        pass

    def save_state(self, directory):
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.model.state_dict(), directory / "model.pt")

    def load_state(self, directory):
        self.model.load_state_dict(torch.load(directory / "model.pt"))


def test_a_saved_checkpoint_is_complete_undamaged_and_loads_its_step(tmp_path):
    engine = StandInEngine()
    path = ckpt.save_checkpoint(engine, tmp_path, step=3, keep=2, fingerprint={"train.seed": 1})
    assert path.name == "checkpoint-3" and ckpt.is_complete(path) and ckpt.damage(path) is None
    assert ckpt.checkpoint_state(path)["fingerprint"] == {"train.seed": 1}
    with torch.no_grad():
        engine.model.weight.zero_()
    assert ckpt.load_checkpoint(engine, path) == 3
    assert engine.model.weight.abs().sum() > 0  # the saved weights came back
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    engine = StandInEngine()
    for step in (2, 4, 6):
        ckpt.save_checkpoint(engine, tmp_path, step=step, keep=2)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-6"


def test_a_changed_byte_is_caught_by_the_checksum_and_passed_over_by_name(tmp_path):
    engine = StandInEngine()
    ckpt.save_checkpoint(engine, tmp_path, step=2, keep=3)
    newest = ckpt.save_checkpoint(engine, tmp_path, step=4, keep=3)
    data = bytearray((newest / "model.pt").read_bytes())
    data[-1] ^= 0xFF  # same size: only the sha256 can tell
    (newest / "model.pt").write_bytes(bytes(data))
    assert ckpt.is_complete(newest)
    assert "does not match its sha256" in ckpt.damage(newest)
    good, passed_over = ckpt.resume_candidates(tmp_path)
    assert [p.name for p in good] == ["checkpoint-2"]
    assert passed_over and passed_over[0].startswith("checkpoint-4: model.pt does not match")


def test_a_missing_file_or_state_makes_a_checkpoint_incomplete(tmp_path):
    engine = StandInEngine()
    path = ckpt.save_checkpoint(engine, tmp_path, step=2, keep=1)
    (path / "model.pt").unlink()
    assert not ckpt.is_complete(path) and "missing" in ckpt.damage(path)
    (path / ckpt.STATE_FILE).unlink()
    assert ckpt.damage(path) == f"{ckpt.STATE_FILE} is missing or unreadable"
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_non_finite_weights_are_never_written_and_the_previous_checkpoint_stays(tmp_path):
    engine = StandInEngine()
    good = ckpt.save_checkpoint(engine, tmp_path, step=2, keep=2)
    with torch.no_grad():
        engine.model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="checkpoint-2"):
        ckpt.save_checkpoint(engine, tmp_path, step=4, keep=2, last_good=good)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]


def test_a_checkpoint_marked_non_finite_is_refused(tmp_path):
    path = ckpt.save_checkpoint(StandInEngine(), tmp_path, step=2, keep=1)
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    (path / ckpt.STATE_FILE).write_text(json.dumps({**state, "finite": False}))
    assert ckpt.damage(path) == "its weights are not finite"
