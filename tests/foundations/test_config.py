"""Composition of every config option, schema errors, and the one validation step."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from rm.foundations.config import GROUPS, to_run_config
from rm.settings.validate import ConfigError, validate
from tests.conftest import CONF_DIR, compose_run

ROOT = CONF_DIR.parent
OPTIONS = [(group, path.stem) for group in [*GROUPS, "experiment"] for path in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_into_typed_objects(group, option):
    cfg = to_run_config(compose_run([f"{group}={option}"]))
    if group in GROUPS:
        section = getattr(cfg, group)
        assert type(section) is GROUPS[group]
        if hasattr(section, "name"):
            assert section.name == option


def test_required_presets_exist():
    names = {g: {p.stem for p in (CONF_DIR / g).glob("*.yaml")} for g in GROUPS}
    assert {"cpu", "a100_40g", "a100_80g", "h100_80g", "h200_141g", "rtx4090_24g", "l40s_48g", "gpu_64g", "auto"} <= names["hardware"]
    assert {"mistral_7b", "llama3_8b", "qwen2_7b", "tiny"} <= names["model"]
    assert {"full", "lora"} <= names["memory_profile"]


def test_default_is_the_flagship():
    cfg = to_run_config(compose_run())
    assert (cfg.model.name, cfg.data.name, cfg.memory_profile.name) == ("mistral_7b", "hh_helpful", "lora")
    assert cfg.data.subsets == ["helpful-base", "helpful-online", "helpful-rejection-sampled"]


def test_prefix_sharing_is_the_cpu_demos_layout_and_no_gpu_default():
    """``experiment=tiny`` (the CPU demo, ``hardware=cpu``) shares prefixes, one row per pair: the fastest exact
    layout measured on a CPU (docs/throughput.md). The schema default, which every ``hardware`` option and so
    every GPU run starts from, does not: nothing is measured on a GPU, and a custom mask takes SDPA off its
    flash kernel. The choice is plain YAML, composed and validated like any other key."""
    demo = to_run_config(compose_run(["experiment=tiny"]))
    assert (demo.hardware.accelerator, demo.model.attn_implementation) == ("cpu", "sdpa")
    t = demo.train
    assert (t.share_prefix, t.group_by_length, t.packing, t.micro_batch_size) == (True, True, False, 8)
    validate(demo, world_size=1)
    for hardware in sorted(path.stem for path in (CONF_DIR / "hardware").glob("*.yaml")):
        assert to_run_config(compose_run([f"hardware={hardware}"])).train.share_prefix is False, hardware


def test_mistral_shape_is_mistral_7b_v01():
    """7,241,732,096 parameters for the causal LM (Mistral's model card: 7.24B).

    embed 32000*4096 + 32 layers * (attn q,o 2*4096^2 + k,v 2*4096*1024 + mlp 3*4096*14336
    + 2 norms * 4096) + final norm 4096 + lm_head 32000*4096.
    """
    m = to_run_config(compose_run(["model=mistral_7b"])).model
    kv = m.num_key_value_heads * m.head_dim
    layer = 2 * m.hidden_size**2 + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.intermediate_size + 2 * m.hidden_size
    total = 2 * m.vocab_size * m.hidden_size + m.num_hidden_layers * layer + m.hidden_size
    assert total == 7_241_732_096


def test_every_yaml_starts_with_the_command_that_uses_it():
    for path in CONF_DIR.rglob("*.yaml"):
        head = [line for line in path.read_text().splitlines()[:3] if line.startswith("#")]
        assert any("python -m rm." in line or "train_rm_distributed.sh" in line for line in head), (
            f"{path} does not start with its command"
        )


def test_unknown_key_fails_at_composition(tmp_path):
    with pytest.raises(ConfigCompositionException, match="alpah"):
        compose_run(["lora.alpah=8"])


def test_wrong_type_fails_at_composition():
    with pytest.raises(ConfigCompositionException) as info:
        compose_run(["lora.r=sixteen"])
    assert isinstance(info.value.__cause__, ValidationError)


def test_validate_derives_accumulation(tiny_cfg):
    plan = validate(tiny_cfg("train.micro_batch_size=2", "train.global_batch_size=16"), world_size=4)
    assert plan.gradient_accumulation_steps == 2
    assert plan.precision == "32-true" and plan.device == "cpu"
    assert plan.max_tokens_per_step == 16 * 2 * 64


@pytest.mark.parametrize(
    "overrides,world,needle",
    [
        (["train.micro_batch_size=3", "train.global_batch_size=16"], 1, "train.global_batch_size=16 is not divisible by train.micro_batch_size=3"),
        (["train.micro_batch_size=4", "train.global_batch_size=16"], 3, "x world size 3"),
        (["data.max_length=4096"], 1, "data.max_length=4096 exceeds model.max_position_embeddings=512"),
        (["train.precision=bf16"], 1, "train.precision=bf16 but hardware=cpu has no bf16"),
        (["train.precision=fp16"], 1, "train.precision=fp16 needs a GPU"),
        (["memory_profile=lora", "lora.r=0"], 1, "lora.r=0 must be in [1, 65536]"),
        (["train.micro_batch_size=0"], 1, "train.micro_batch_size=0 must be in [1, 1048576]"),
        (["data.truncation=middle"], 1, "data.truncation='middle' is not one of truncate, drop"),
        (["data=local"], 1, "data.source=local needs data.train_files"),
    ],
)
def test_validate_names_the_keys(tiny_cfg, overrides, world, needle):
    with pytest.raises(ConfigError, match=None) as info:
        validate(tiny_cfg(*overrides), world_size=world)
    assert needle in str(info.value)


@pytest.mark.parametrize("given,mode", [("bf16", "bf16-mixed"), ("fp32", "32-true"), ("32", "32-true"),
                                        ("bf16-true", "bf16-true"), ("bf16-mixed", "bf16-mixed")])
def test_precision_names_resolve_as_lightning_reads_them(tiny_cfg, given, mode):
    """Lightning's legacy names read as its mixed modes (bf16: fp32 master weights), and the plan says which."""
    plan = validate(tiny_cfg(f"train.precision={given}", "hardware.bf16=true"), world_size=1)
    assert plan.precision == mode
    assert any(f"reads as {mode}" in w for w in plan.warnings) == (given != mode)


def test_auto_precision_on_a_bf16_gpu_loses_no_updates(tiny_cfg):
    plan = validate(tiny_cfg("hardware=h100_80g", "train.precision=auto"), world_size=1)
    assert plan.precision == "bf16-mixed"
    assert (plan.numerics.weights, plan.numerics.states, plan.numerics.autocast) == ("float32", "float32", "bfloat16")


def test_bf16_true_is_refused_under_zero_naming_the_reason(tiny_cfg):
    with pytest.raises(ConfigError) as info:
        validate(tiny_cfg("train.precision=bf16-true", "hardware.bf16=true", "distributed=zero2"), world_size=1)
    assert "train.precision=bf16-true with distributed=zero2" in str(info.value)
    assert "fp32 master weights" in str(info.value) and "train.precision=bf16-mixed" in str(info.value)


@pytest.mark.parametrize("lr,warned", [(1e-5, True), (1e-3, False)])
def test_bf16_true_warns_where_updates_will_round_away(tiny_cfg, lr, warned):
    plan = validate(tiny_cfg("train.precision=bf16-true", "hardware.bf16=true", f"train.optim.learning_rate={lr}"), world_size=1)
    found = [w for w in plan.warnings if "round to nothing" in w]
    assert bool(found) == warned
    if warned:  # 85% of N(0, 0.02) weights at 1e-5 (rm.foundations.precision.bf16_lost_update_fraction)
        assert "about 85%" in found[0] and "train.precision=bf16-mixed" in found[0]
    lora = validate(tiny_cfg("train.precision=bf16-true", "hardware.bf16=true", "memory_profile=lora",
                             f"train.optim.learning_rate={lr}"), world_size=1)
    assert not [w for w in lora.warnings if "round to nothing" in w]  # fp32 adapters lose nothing


def test_validate_reports_every_problem_at_once(tiny_cfg):
    with pytest.raises(ConfigError) as info:
        validate(tiny_cfg("train.micro_batch_size=3", "data.max_length=9999", "train.precision=fp16"), world_size=1)
    assert str(info.value).count("\n  - ") == 3


def test_cli_rejects_bad_config_before_loading_anything(tmp_path):
    """A bad combination exits 2 with one message and no Python traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "rm.train", "experiment=tiny", "train.global_batch_size=33", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "train.global_batch_size=33 is not divisible" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "final").exists()


def test_hardware_cpu_takes_this_machines_memory_unless_given(tiny_cfg):
    """hardware=cpu assumed 16 GiB whatever the machine held; now its device memory and host RAM are detected, a
    number on the command line wins, and a CUDA profile's null memory is refused by name (never guessed)."""
    import pytest

    from rm.foundations.errors import ConfigError
    from rm.foundations.hardware import host_ram_gib, resolve_hardware

    detected = resolve_hardware(tiny_cfg("hardware=cpu").hardware)
    assert detected.device_memory_gib == round(host_ram_gib(), 1) and detected.host_ram_gib == int(round(host_ram_gib(), 1))
    given = resolve_hardware(tiny_cfg("hardware=cpu", "hardware.device_memory_gib=16").hardware)
    assert given.device_memory_gib == 16 and given.host_ram_gib == detected.host_ram_gib
    with pytest.raises(ConfigError, match="hardware.device_memory_gib=null with hardware=h100_80g"):
        resolve_hardware(tiny_cfg("hardware=h100_80g", "hardware.device_memory_gib=null").hardware)

