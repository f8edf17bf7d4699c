"""rm.runs.resume: which setting changes a resume refuses, names and allows."""

from __future__ import annotations

import pytest

from rm.foundations.errors import ConfigError
from rm.runs.resume import changed_keys, check_resume


def test_changed_keys_names_old_and_new_values_and_keys_only_one_side_has():
    saved = {"train.optim.learning_rate": 0.002, "train.seed": 42, "data.gone": 1}
    current = {"train.optim.learning_rate": 0.01, "train.seed": 42, "data.new": 2}
    assert changed_keys(saved, current) == [
        "data.gone: 1 -> '(unset)'", "data.new: '(unset)' -> 2", "train.optim.learning_rate: 0.002 -> 0.01"]
    assert changed_keys(None, current) == []  # a checkpoint from before fingerprints


def test_a_resume_with_changes_is_refused_naming_each_and_the_way_out():
    with pytest.raises(ConfigError) as err:
        check_resume({"train.seed": 42}, {"train.seed": 7}, "checkpoint-4", allow_changes=False)
    assert "train.seed: 42 -> 7" in str(err.value) and "train.checkpoint.resume_allow_changes=true" in str(err.value)
    assert err.value.exit_code == 2


def test_allowed_changes_are_returned_and_no_change_passes():
    assert check_resume({"a": 1}, {"a": 2}, "checkpoint-4", allow_changes=True) == ["a: 1 -> 2"]
    assert check_resume({"a": 1}, {"a": 1}, "checkpoint-4", allow_changes=False) == []


def test_a_checkpoint_written_before_keys_moved_compares_under_the_new_names():
    """A run directory from before train.learning_rate became train.optim.learning_rate (MOVED_KEYS) stores the
    old names in its fingerprint: the same settings resume, a changed one is named by its new key."""
    from rm.runs.resume import stored_fingerprint

    old = {"train.learning_rate": 0.002, "train.warmup_ratio": 0.05, "train.seed": 42, "model.name": "tiny"}
    current = {"train.optim.learning_rate": 0.002, "train.optim.warmup_ratio": 0.05, "train.seed": 42, "model.name": "tiny"}
    assert check_resume(stored_fingerprint(old), current, "checkpoint-4", allow_changes=False) == []
    changed = {**current, "train.optim.learning_rate": 0.01}
    assert check_resume(stored_fingerprint(old), changed, "checkpoint-4", allow_changes=True) == [
        "train.optim.learning_rate: 0.002 -> 0.01"]
    assert stored_fingerprint(None) is None  # a checkpoint from before fingerprints


def test_resuming_a_run_directory_written_before_keys_moved(tmp_path):
    """The whole read: a checkpoint whose fingerprint has the old flat names resumes under today's config, and a
    changed learning rate is refused naming train.optim.learning_rate."""
    from rm.foundations.config import TrainConfig
    from rm.runs.checkpoint import save_checkpoint
    from rm.runs.run_dir import RunDir
    from tests.runs.test_checkpoint import StandInEngine

    old = {"train.learning_rate": 0.002, "train.max_grad_norm": 1.0, "train.seed": 42}
    save_checkpoint(StandInEngine(), tmp_path, step=2, keep=2, fingerprint=old)
    current = {"train.optim.learning_rate": 0.002, "train.optim.max_grad_norm": 1.0, "train.seed": 42}
    directory = RunDir(tmp_path, resume=True, overwrite=False, is_main=True)
    engine = StandInEngine()
    engine.optimizer = engine.scheduler = None  # apply_changes has nothing to write: no change
    assert directory.restore(engine, TrainConfig(), current, total_steps=10)[0] == 2
    with pytest.raises(ConfigError, match=r"train\.optim\.learning_rate: 0\.002 -> 0\.01") as err:
        directory.restore(StandInEngine(), TrainConfig(), {**current, "train.optim.learning_rate": 0.01}, total_steps=10)
    assert "train.learning_rate" not in str(err.value)
    assert directory.saved_fingerprint() == current
