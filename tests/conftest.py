"""Shared fixtures: compose the real ``conf/`` tree the way ``rm.train`` does, on the CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import rm.foundations.config  # noqa: F401  (registers the schemas)
from rm.foundations.config import to_run_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# The tests run on 2-core machines; more threads than cores only adds contention. Under pytest-xdist (``-n 2``, the
# README's command) each worker is one of the cores: one thread for it and for the processes its tests start.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


def compose_run(overrides=()):
    """Compose ``conf/config.yaml`` with ``overrides`` and return the Hydra DictConfig."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


# Small and quick but still a real run of the pipeline: the tiny model on synthetic pairs, CPU, fp32.
FAST_TINY = [
    "experiment=tiny",
    "hardware=cpu",
    "data.synthetic_train_size=512",
    "data.synthetic_test_size=128",
    "data.max_length=64",
    "train.micro_batch_size=8",
    "train.global_batch_size=16",
    "train.eval_batch_size=64",
    "train.logging.logging_steps=2",
    # experiment=tiny shares prefixes (the fastest on a CPU); the tests of the other layouts need it off,
    # and tests/modelling/test_prefix_sharing.py turns it on where it is tested.
    "train.share_prefix=false",
    # Each test names the layout it tests; train.layout=auto (the default) is tested in tests/plan/test_plan.py.
    "train.layout=given",
]


@pytest.fixture
def tiny_cfg():
    """Typed config of a fast tiny run; pass extra overrides to the returned factory."""

    def make(*overrides):
        return to_run_config(compose_run(FAST_TINY + list(overrides)))

    return make


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """rm's disk cache (``rm.foundations.cache``) for the whole session is a temporary directory, never the user's ``~/.cache/rm``
    (fixtures shared by several tests, built before any test's own, use it)."""
    before = os.environ.get("RM_CACHE")
    os.environ["RM_CACHE"] = str(tmp_path_factory.mktemp("rm_cache_session"))
    yield
    if before is None:
        os.environ.pop("RM_CACHE", None)
    else:
        os.environ["RM_CACHE"] = before


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path_factory, monkeypatch):
    """Each test starts with an empty cache: what it tests is computed, not read from an earlier test's entry
    (tests/foundations/test_startup_cache.py tests the cache itself). The machine's measured rates (``rm.plan.constants``, a few
    seconds to measure, read by every train.layout=auto run) are the session's: one machine, measured once."""
    fresh = tmp_path_factory.mktemp("rm_cache")
    speed = Path(os.environ["RM_CACHE"]) / "speed"
    speed.mkdir(parents=True, exist_ok=True)
    (fresh / "speed").symlink_to(speed, target_is_directory=True)
    monkeypatch.setenv("RM_CACHE", str(fresh))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_runtest_logreport(report):
    """With ``RM_TEST_FAILURES=FILE``, each failure's report is appended to FILE as it happens: a run stopped at a time
    limit (a GPU session) keeps the reasons that the final summary would have printed (the H200 session lost one)."""
    path = os.environ.get("RM_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as out:
            out.write(f"\n== FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    deselected = sum("slow" in item.keywords for item in terminalreporter.stats.get("deselected", []))
    if deselected and "not slow" in (config.getoption("markexpr") or ""):
        terminalreporter.write_line(
            f"{deselected} slow test(s) not run (minutes each); run them with: python -m pytest -m slow"
        )


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one mixed-precision setting per process; let a test pick another, then restore."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
