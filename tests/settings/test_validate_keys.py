"""Every numeric and enumerated key is validated once, before anything loads, with its range; the model
shape and optional dependencies are checked by name (rm.settings.validate)."""

import json

import pytest

from rm.foundations.errors import ConfigError
from rm.data.tokenizer import check_tokenizer_fits, run_tokenizer
from rm.settings.validate import validate
from tests.conftest import FAST_TINY


@pytest.mark.reliability("Configuration", "out-of-range numbers: `train.optim.adam_beta1=1.5`, `train.optim.adam_epsilon=-1`, `train.seed=-1`, "
                         "`lora.dropout=1.5`, `data.max_train_samples=0`, `train.optim.weight_decay=-0.1`, `train.optim.max_grad_norm=-1`, "
                         "`hardware.device_memory_gib=-5`, `train.optim.learning_rate=nan`",
                         "`<key>=<value> must be in [low, high)` naming the key; no longer accepted silently or 'refused as too big'")
@pytest.mark.reliability("Configuration", "model shape: `model.num_key_value_heads=3` with 4 heads, a hidden size heads do not divide",
                         "`model.num_key_value_heads=3 must divide model.num_attention_heads=4`")
@pytest.mark.reliability("Configuration", "`model.attn_implementation=flash_attention_2` without flash-attn",
                         "names the key and the install command (`pip install flash-attn`)")
@pytest.mark.reliability("Configuration", "`model.pretrained` an empty or non-model directory, a directory of weights without a tokenizer (a saved random init), or a path that does not exist",
                         "`is a directory without config.json` / `holds config.json but no weights` / `holds no tokenizer ... name one with model.tokenizer=` / `no such directory, and not a Hub id`")
@pytest.mark.reliability("Configuration", "`model.tokenizer` a path that does not exist, a directory without a tokenizer, "
                         "or a file",
                         "`model.tokenizer=<path>: no such directory, and not a Hub id` / `is a directory without a "
                         "tokenizer` / `is a file: give the directory that holds it`, before anything loads; exit 2 (was: "
                         "the Hub's `Repo id must be in the form ...` as a storage error, exit 5, after the data pass)")
@pytest.mark.parametrize("overrides,needle", [
    (["train.optim.adam_beta1=1.5"], "train.optim.adam_beta1=1.5 must be in [0, 1)"),
    (["train.optim.adam_beta2=-0.1"], "train.optim.adam_beta2=-0.1 must be in [0, 1)"),
    (["train.optim.adam_epsilon=-1"], "train.optim.adam_epsilon=-1.0 must be in (0, 1]"),
    (["train.seed=-1"], "train.seed=-1 must be in [0, 4294967295]"),
    (["memory_profile=lora", "lora.dropout=1.5"], "lora.dropout=1.5 must be in [0, 1)"),
    (["data.max_train_samples=0"], "data.max_train_samples=0 must be in [1, 1099511627776] (null: all rows)"),
    (["train.optim.weight_decay=-0.1"], "train.optim.weight_decay=-0.1 must be in [0, 1000]"),
    (["train.optim.max_grad_norm=-1"], "train.optim.max_grad_norm=-1.0 must be in [0, 1000000000000]"),
    (["hardware.device_memory_gib=-5"], "hardware.device_memory_gib=-5.0 must be in (0, 1048576]"),
    (["train.optim.learning_rate=nan"], "train.optim.learning_rate=nan must be"),
    (["train.max_steps=-5"], "train.max_steps=-5 must be -1"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads=3 must divide model.num_attention_heads=4"),
    (["model.hidden_size=130", "model.head_dim=null"], "model.hidden_size=130 is not divisible by model.num_attention_heads=4"),
    (["model.attn_implementation=flash_attention_2"], "needs flash-attn: pip install flash-attn"),
    (["model.pretrained=EMPTY"], "is a directory without config.json"),
    (["model.pretrained=CONFIG_ONLY"], "holds config.json but no weights"),
    (["model.pretrained=WEIGHTS_ONLY"], "holds no tokenizer (none of tokenizer.json"),
    (["model.pretrained=/no/such/model/dir"], "no such directory, and not a Hub id"),
    (["model.tokenizer=/no/such/tokenizer"], "model.tokenizer=/no/such/tokenizer: no such directory, and not a Hub id"),
    (["model.tokenizer=EMPTY"], "is a directory without a tokenizer (none of tokenizer.json"),
    (["model.tokenizer=CONFIG_ONLY/config.json"], "is a file: give the directory that holds it"),
])
def test_each_bad_value_is_rejected_naming_its_key(tiny_cfg, tmp_path, overrides, needle):
    if "flash" in needle and __import__("importlib").util.find_spec("flash_attn"):
        pytest.skip("flash-attn is installed")
    (tmp_path / "config_only").mkdir()
    (tmp_path / "config_only" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"")
    overrides = [o.replace("EMPTY", str(tmp_path)).replace("CONFIG_ONLY", str(tmp_path / "config_only"))
                 .replace("WEIGHTS_ONLY", str(tmp_path / "weights_only")) for o in overrides]
    with pytest.raises(ConfigError) as err:
        validate(tiny_cfg(*overrides), 1)
    assert needle in str(err.value), str(err.value)


@pytest.mark.reliability("Configuration", "a local `model.pretrained` whose config.json has another shape than the "
                         "`model` group; a new tokenizer (`model.tokenizer=bpe|words`) for pretrained weights",
                         "names each differing key with both values and the overrides to add; names the tokenizer key "
                         "and the fix (the model's own tokenizer)")
def test_a_pretrained_directory_must_match_the_model_group(tiny_cfg, tmp_path):
    model_dir = tmp_path / "qwen_small"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"")  # only its presence is checked here
    (model_dir / "tokenizer.json").write_text("{}")  # the same
    shape = {"model_type": "qwen2", "vocab_size": 4096, "hidden_size": 384, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "tie_word_embeddings": False}
    (model_dir / "config.json").write_text(json.dumps(shape))
    with pytest.raises(ConfigError) as err:
        validate(tiny_cfg(f"model.pretrained={model_dir}"), 1)
    text = str(err.value)
    assert f"model.pretrained={model_dir} has another shape than model=tiny" in text
    assert "hidden_size 384 there, 128 here" in text and "head_dim 64 there, 32 here" in text
    assert ("Add: model.model_type=qwen2 model.vocab_size=4096 model.hidden_size=384 model.num_attention_heads=6 "
            "model.head_dim=64") in text
    assert "num_hidden_layers" not in text and "intermediate_size" not in text  # equal keys are not named
    fixed = tiny_cfg(f"model.pretrained={model_dir}", "model.model_type=qwen2", "model.vocab_size=4096",
                     "model.hidden_size=384", "model.num_attention_heads=6", "model.head_dim=64")
    validate(fixed, 1)
    with pytest.raises(ConfigError, match=r"model.tokenizer=bpe makes a new tokenizer, whose ids model.pretrained=.* never learnt"):
        validate(tiny_cfg(f"model.pretrained={model_dir}", "model.model_type=qwen2", "model.vocab_size=4096",
                          "model.hidden_size=384", "model.num_attention_heads=6", "model.head_dim=64", "model.tokenizer=bpe"), 1)


@pytest.mark.reliability("Configuration", "`model.vocab_size` smaller than the tokenizer", "`model.vocab_size=16 is smaller than the tokenizer's N tokens`, before the model is built")
def test_a_vocabulary_smaller_than_the_tokenizer_is_rejected(tiny_cfg):
    from rm.data.build import train_pairs

    cfg = tiny_cfg("model.vocab_size=16")
    validate(cfg, 1)  # the tokenizer is not known yet; checked once it is built
    # The byte-level BPE keeps its 4 special tokens and 256 bytes whatever the size asked for.
    with pytest.raises(ConfigError, match=r"model.vocab_size=16 is smaller than the tokenizer's 260 tokens \(model.tokenizer=bpe\)"):
        check_tokenizer_fits(cfg.model, run_tokenizer(cfg.model, train_pairs(cfg.data)))
    words = tiny_cfg("model.vocab_size=16", "model.tokenizer=words")
    with pytest.raises(ConfigError, match=r"model.vocab_size=16 is smaller than the tokenizer's \d+ tokens \(model.tokenizer=words\)"):
        check_tokenizer_fits(words.model, run_tokenizer(words.model, train_pairs(words.data)))
    tiny = tiny_cfg()
    check_tokenizer_fits(tiny.model, run_tokenizer(tiny.model, train_pairs(tiny.data)))  # sized to the tiny model's vocabulary


def test_the_shipped_configs_pass(tiny_cfg):
    assert validate(tiny_cfg(), 1).gradient_accumulation_steps == 2


def test_flex_attention_is_warned_about_before_a_run(tiny_cfg):
    """flex_attention failed to recompile for a new sequence length on an H100 (docs/gpu.md): the plan says so."""
    from rm.settings.validate import validate

    flex = validate(tiny_cfg("model.attn_implementation=flex_attention"), world_size=1)
    assert any("flex_attention" in w and "NoValidChoicesError" in w for w in flex.warnings)
    assert not any("flex" in w for w in validate(tiny_cfg(), world_size=1).warnings)


def test_lora_keys_under_a_profile_without_lora_are_named_as_without_effect(tiny_cfg):
    """lora.r=16 with memory_profile=full was accepted silently: a warning names each lora key set and the profile;
    under a LoRA profile, or with no lora key set, there is none."""
    from rm.settings.validate import unused_overrides

    given = ["memory_profile=full", "lora.r=16", "lora=r64", "train.max_steps=2"]
    warnings = unused_overrides(tiny_cfg(*given).memory_profile, given)
    assert len(warnings) == 1 and warnings[0].startswith("lora.r=16 lora=r64 have no effect: memory_profile=full")
    assert unused_overrides(tiny_cfg("memory_profile=lora", "lora.r=16").memory_profile, ["memory_profile=lora", "lora.r=16"]) == []
    assert unused_overrides(tiny_cfg("memory_profile=full").memory_profile, ["memory_profile=full"]) == []
