"""rm.runs.resume: which setting changes a resume refuses, names and allows."""

from __future__ import annotations

import pytest

from rm.foundations.errors import ConfigError
from rm.runs.resume import changed_keys, check_resume


def test_changed_keys_names_old_and_new_values_and_keys_only_one_side_has():
    saved = {"train.learning_rate": 0.002, "train.seed": 42, "data.gone": 1}
    current = {"train.learning_rate": 0.01, "train.seed": 42, "data.new": 2}
    assert changed_keys(saved, current) == [
        "data.gone: 1 -> '(unset)'", "data.new: '(unset)' -> 2", "train.learning_rate: 0.002 -> 0.01"]
    assert changed_keys(None, current) == []  # a checkpoint from before fingerprints


def test_a_resume_with_changes_is_refused_naming_each_and_the_way_out():
    with pytest.raises(ConfigError) as err:
        check_resume({"train.seed": 42}, {"train.seed": 7}, "checkpoint-4", allow_changes=False)
    assert "train.seed: 42 -> 7" in str(err.value) and "train.resume_allow_changes=true" in str(err.value)
    assert err.value.exit_code == 2


def test_allowed_changes_are_returned_and_no_change_passes():
    assert check_resume({"a": 1}, {"a": 2}, "checkpoint-4", allow_changes=True) == ["a: 1 -> 2"]
    assert check_resume({"a": 1}, {"a": 1}, "checkpoint-4", allow_changes=False) == []
