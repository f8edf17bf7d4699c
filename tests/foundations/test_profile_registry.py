"""A memory profile is registered once, by its YAML file: every list of profiles is :func:`rm.foundations.config.memory_profiles`.

A profile added in a config directory of its own (``hydra.searchpath``, as a user adds one without editing ``conf/``)
reaches ``rm.plan``'s search, a refused run's suggestions and ``rm.gpu_report``; with a list of names kept by hand in
any of them, it would not.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rm.foundations.config import compose, memory_profiles
from tests.conftest import CONF_DIR

# A LoRA profile under another name, placed between lora (20) and offload (30).
ADAPTERS = """\
defaults:
  - base_memory_profile
  - _self_
name: adapters
order: 25
use_lora: true
"""


@pytest.fixture
def search_path(tmp_path):
    """``hydra.searchpath`` naming a config directory that holds one more memory profile, ``adapters``."""
    (tmp_path / "memory_profile").mkdir()
    (tmp_path / "memory_profile" / "adapters.yaml").write_text(ADAPTERS)
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_the_profiles_are_the_yaml_files_in_their_order(search_path):
    shipped = [p.name for p in memory_profiles()]
    assert sorted(shipped) == sorted(p.stem for p in (CONF_DIR / "memory_profile").glob("*.yaml"))
    assert shipped == ["full", "8bit", "lora", "offload", "qlora"]  # the order a refusal's suggestions try them in
    assert [p.name for p in memory_profiles([search_path])] == ["full", "8bit", "lora", "adapters", "offload", "qlora"]
    assert compose([search_path, "memory_profile=adapters"]).memory_profile == memory_profiles([search_path])[3]


def test_rm_plan_searches_a_profile_on_the_search_path(search_path):
    from rm.plan.search import candidates
    from rm.settings.validate import resolve_world_size

    overrides = [search_path, "experiment=tiny", "hardware=cpu"]  # no memory_profile: every profile is a candidate
    cfg = compose(overrides)
    found, _ = candidates(cfg, overrides, resolve_world_size(cfg.distributed, launched=False))
    adapters = [c for c in found if "memory_profile=adapters" in c.overrides]
    assert adapters and all(c.changes_math and c.cfg.memory_profile.name == "adapters" for c in adapters)


def test_a_refused_run_is_suggested_a_profile_on_the_search_path(search_path):
    """Each profile that trades something for memory, in order (full trades nothing), the new one among them."""
    from rm.memory.suggest import candidate_overrides, with_overrides
    from rm.settings.validate import resolve_world_size, validate

    overrides = [search_path, "experiment=tiny", "hardware=cpu", "memory_profile=full"]
    cfg = compose(overrides)
    world = resolve_world_size(cfg.distributed, launched=False)
    plan = validate(cfg, *world)
    suggested = [extra for extra in candidate_overrides(cfg.train, cfg.memory_profile, plan, "forward/backward", overrides)
                 if extra[0].startswith("memory_profile=")]
    assert suggested[:4] == [["memory_profile=8bit"], ["memory_profile=lora"], ["memory_profile=adapters"],
                             ["memory_profile=offload"]]
    assert with_overrides(cfg, overrides, ["memory_profile=adapters"]).memory_profile.name == "adapters"


def test_gpu_report_estimates_a_profile_on_the_search_path(search_path):
    """The command line's ``hydra.searchpath`` is Hydra's, not the task's overrides: rm.gpu_report lists and composes
    each profile with the running app's search path."""
    proc = subprocess.run([sys.executable, "-m", "rm.gpu_report", "experiment=tiny", "data.max_length=64",
                           "train.micro_batch_size=2", "train.eval_batch_size=2", search_path],
                          cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert rows == ["full", "8bit", "lora", "adapters", "offload", "qlora"], proc.stdout


# The profile a user writes from lora.yaml's example, forgetting the mandatory order:.
WITHOUT_ORDER = """\
defaults:
  - base_memory_profile
  - _self_
name: mine
use_lora: true
"""


@pytest.mark.reliability("Configuration", "a mandatory key left without a value (`???`): a memory-profile file of one's own "
                         "without `order:`, `memory_profile.order=???` on the command line",
                         "`memory_profile.order has no value (??? in the schema, mandatory): memory_profile=mine "
                         "(<dir>/memory_profile/mine.yaml) does not set order.`, then the values the shipped profiles give "
                         "it; exit 2 (was: omegaconf's traceback, exit 1). `rm.plan`'s and "
                         "`rm.gpu_report`'s list of every profile names the broken file alike, and a profile file of a "
                         "wrong type (`order: abc`) there: `memory_profile=bad (<file>) cannot be read: "
                         "memory_profile.order: Value 'abc' ...`")
def test_a_missing_mandatory_key_names_the_key_and_its_file(tmp_path):
    from rm.foundations.errors import ConfigError

    (tmp_path / "memory_profile").mkdir()
    mine = tmp_path / "memory_profile" / "mine.yaml"
    mine.write_text(WITHOUT_ORDER)
    search = f"hydra.searchpath=[file://{tmp_path}]"
    named = rf"memory_profile\.order has no value \(\?\?\? in the schema, mandatory\): memory_profile=mine \({mine}\) does not set order\."
    with pytest.raises(ConfigError, match=rf"^{named}\nGive it a value in {mine} \(order: "):
        compose([search, "experiment=tiny", "memory_profile=mine"])
    with pytest.raises(ConfigError, match=rf"^{named}"):  # the list rm.plan, refusals and rm.gpu_report read
        memory_profiles([search])
    with pytest.raises(ConfigError, match=r"(?s)^memory_profile\.order has no value .*: the command line gives "
                                          r"memory_profile\.order=\?\?\?\..*conf/memory_profile/'s options set it so: "
                                          r".*lora 20"):
        compose(["experiment=tiny", "memory_profile.order=???"])

    # A value of the wrong type fails the listing's composition (Hydra's error, about profiles.p<i>.order)
    other = tmp_path / "other"
    (other / "memory_profile").mkdir(parents=True)
    bad = other / "memory_profile" / "bad.yaml"
    bad.write_text(WITHOUT_ORDER.replace("name: mine", "name: bad\norder: abc"))
    with pytest.raises(ConfigError, match=rf"^memory_profile=bad \({bad}\) cannot be read: memory_profile\.order: "
                                          r"Value 'abc' of type 'str' could not be converted to Integer"):
        memory_profiles([f"hydra.searchpath=[file://{other}]"])

    proc = subprocess.run([sys.executable, "-m", "rm.estimate", "experiment=tiny", "memory_profile=mine", search],
                          cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"error: memory_profile.order has no value (??? in the schema, mandatory): memory_profile=mine ({mine})" in out
    assert f"Give it a value in {mine} (order: " in out
    assert "Traceback" not in out and "bug in rm" not in out
