"""Every numeric key of the schemas has one range (rm.settings.validate.RANGES), checked by validate() before anything
that scales with it: a sweep of each key over 0, -1, a huge value, NaN and inf either validates or names the key and
its allowed range; nothing else escapes (no traceback, no allocation)."""

import copy
import dataclasses
import math
import os
import subprocess
import sys
import typing

import pytest

from rm.foundations.config import RunConfig
from rm.foundations.errors import ConfigError
from rm.settings.validate import RANGES, Range, validate
from tests.conftest import CONF_DIR, FAST_TINY


def numeric_keys(schema=RunConfig, prefix=""):
    """``{dotted key: the number type}`` of every int / float (Optional or not) field of ``schema``, nested
    dataclasses (a config group, or a group inside one) walked into: a new numeric key is found here by itself."""
    found = {}
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        kind = hints[field.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)] if typing.get_origin(kind) is typing.Union else [kind]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            found.update(numeric_keys(args[0], f"{prefix}{field.name}."))
        elif len(args) == 1 and args[0] in (int, float):
            found[f"{prefix}{field.name}"] = args[0]
    return found


NUMERIC = numeric_keys()


def test_every_numeric_key_has_one_range():
    assert len(NUMERIC) > 50  # the walk found the groups
    assert sorted(set(NUMERIC) - set(RANGES)) == [], "numeric keys without a range in rm.settings.validate.RANGES"
    assert sorted(set(RANGES) - set(NUMERIC)) == [], "ranges of keys no schema has"
    for key, allowed in RANGES.items():
        assert math.isfinite(allowed.low) and math.isfinite(allowed.high), f"{key}: a range is bounded both ways"


def test_a_new_numeric_key_without_a_range_is_found():
    @dataclasses.dataclass
    class Train:
        threads_per_core: int = 2

    @dataclasses.dataclass
    class Config:
        train: Train = dataclasses.field(default_factory=Train)

    assert numeric_keys(Config) == {"train.threads_per_core": int}


def _set(cfg, key, value):
    cfg = copy.deepcopy(cfg)
    *path, name = key.split(".")
    node = cfg
    for part in path:  # train.optim.learning_rate: a key of a nested group
        node = getattr(node, part)
    setattr(node, name, value)
    return cfg


HUGE = {int: 10**30, float: 1e300}


@pytest.mark.reliability("Configuration", "every numeric key at 0, -1, a huge value (`train.max_steps=1000000000000`), "
                         "NaN and inf", "`<key>=<value> must be in [low, high]` naming the key and its range, before any "
                         "allocation or data pass (was: a 233 TiB allocation's traceback); every key has one range")
def test_every_numeric_key_swept_validates_or_names_its_range(tiny_cfg):
    base = tiny_cfg()
    refused = 0
    for key, kind in NUMERIC.items():
        values = [0, -1, HUGE[kind]] + ([math.nan, math.inf] if kind is float else [])  # Hydra refuses nan for an int
        for value in values:
            cfg = _set(base, key, kind(value))
            allowed = RANGES[key]
            try:
                validate(cfg, 1)
            except ConfigError as err:
                if not allowed.holds(value):
                    assert f"{key}={kind(value)} must be {allowed.describe()}" in str(err), (key, value, str(err))
                    refused += 1
                else:  # in range: refused by another rule, which names the key too
                    assert key.partition(".")[2] in str(err), (key, value, str(err))
            else:
                assert allowed.holds(value), f"{key}={value} is outside {allowed.describe()} but validated"
    assert refused > 2 * len(NUMERIC)


@pytest.mark.parametrize("value,holds", [(-1, True), (0, False), (1, True), (10**9, True), (10**9 + 1, False)])
def test_range_with_a_special_value(value, holds):
    allowed = Range(1, 10**9, also=(-1,), why="-1: derive")
    assert allowed.holds(value) is holds
    assert allowed.describe() == "-1 or in [1, 1000000000] (-1: derive)"
    assert not Range(0, 1).holds(math.nan) and not Range(0, 1).holds(True)


@pytest.mark.parametrize("override,needle", [  # one process (~15 s of imports); the sweep above covers every key
    ("train.max_steps=1000000000000", "train.max_steps=1000000000000 must be -1 or in [1, 100000000]"),
])
def test_a_huge_size_exits_2_naming_its_range(tmp_path, override, needle):
    """The command a user ran: exit 2, the key and its range, no traceback, and no data generated or read first."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, override, f"hydra.run.dir={tmp_path}/run"],
                          cwd=CONF_DIR.parent, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and needle in out and "Traceback" not in out, out[-3000:]
    assert "[train]: pairs" not in out, "data was read before the check"


def test_pairs_trained_are_capped_given_or_derived(tiny_cfg):
    """Each key in range, the run's length out of it: the steps given (validate) or derived from epochs over the data
    (rm.data.batching, once the data is read, before the estimate orders every step's pairs)."""
    from rm.data.batching import total_training_steps
    from rm.foundations.config import MAX_PAIRS_TRAINED, TrainConfig

    with pytest.raises(ConfigError, match=r"train.max_steps=100000000 x train.global_batch_size=16 = 1,600,000,000 pairs"):
        validate(tiny_cfg("train.max_steps=100000000"), 1)
    many = TrainConfig(max_steps=-1, num_train_epochs=10**4, global_batch_size=16)
    with pytest.raises(ConfigError, match=r"train.num_train_epochs=10000 of 100,000 pairs .* more than 100,000,000 pairs"):
        total_training_steps(many, 100_000)
    assert total_training_steps(many, 160) * 16 <= MAX_PAIRS_TRAINED
