"""rm.runs.resume: which setting changes a resume refuses, names and allows."""

from __future__ import annotations

import re

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


@pytest.mark.reliability("Faults", "resume with a changed setting of the numerics: `train.optim.kahan_summation`, "
                         "`train.share_prefix`, `health.fp32_head`, or `train.precision=auto` resolving to another "
                         "precision (another machine)",
                         "refused like any setting that shapes training, naming the key (`train.optim.kahan_summation: "
                         "False -> True`, `train.precision: '32-true' -> 'bf16-mixed'`); was: resumed with other "
                         "numerics in silence. A checkpoint written before rm recorded these keys resumes, them unchecked")
def test_a_changed_numerics_setting_is_refused_on_resume(tiny_cfg):
    import dataclasses

    from rm.runs.resume import LATER_KEYS, fingerprint, stored_fingerprint
    from rm.settings.validate import resolve_world_size, validate

    cfg = tiny_cfg("train.precision=auto")
    plan = validate(cfg, *resolve_world_size(cfg.distributed, launched=False))
    saved = fingerprint(cfg, plan)
    assert saved["train.precision"] == plan.precision == "32-true"  # as resolved on this CPU, not "auto"
    train, optim = cfg.train, cfg.train.optim
    changed = {
        "train.optim.kahan_summation: False -> True":
            (dataclasses.replace(cfg, train=dataclasses.replace(train, optim=dataclasses.replace(optim, kahan_summation=True))), plan),
        "train.share_prefix: False -> True": (dataclasses.replace(cfg, train=dataclasses.replace(train, share_prefix=True)), plan),
        "health.fp32_head: None -> True": (dataclasses.replace(cfg, health=dataclasses.replace(cfg.health, fp32_head=True)), plan),
        "train.precision: '32-true' -> 'bf16-mixed'": (cfg, dataclasses.replace(plan, precision="bf16-mixed")),  # a bf16 machine
    }
    for change, (c, p) in changed.items():
        with pytest.raises(ConfigError, match=re.escape(change)):
            check_resume(saved, fingerprint(c, p), "checkpoint-4", allow_changes=False)
    # A checkpoint of an earlier rm: none of these keys, precision as configured. It resumes; what it lacks is unchecked.
    older = {**{k: v for k, v in saved.items() if k not in LATER_KEYS}, "train.precision": "auto"}
    for c, p in changed.values():
        assert check_resume(stored_fingerprint(older), fingerprint(c, p), "checkpoint-4", allow_changes=False) == []
    assert changed_keys(stored_fingerprint(older), {**saved, "train.seed": 7}) == ["train.seed: 42 -> 7"]
