"""Every name on the command line exists (rm.foundations.cli.check_names), checked before Hydra composes."""

import pytest

from rm.foundations.cli import check_names
from rm.foundations.errors import ConfigError


@pytest.mark.parametrize("override", [
    "experiment=tiny", "experiment=null", "model=tiny,mistral_7b", "hparams_search=lora_optuna",
    "train.learning_rate=1e-3", "train.learning_rate=1e-3,2e-3", "+data.extra_eval_files.hard=[hard.jsonl]",
    "lora.target_modules=[q_proj]", "health.on_nonfinite=skip", "sweep.on_failure=continue",
    "hydra.run.dir=x", "hydra/launcher=submitit_slurm", "~train.seed", "model.pretrained=null",
])
def test_names_that_exist_pass(override):
    check_names(["rm.train", "-m", override])


@pytest.mark.parametrize("override, said", [
    ("experiment=tyni", "experiment=tyni: experiment has no option 'tyni'; did you mean tiny? (options: tiny)"),
    ("experiment=tiny,tyni", "experiment has no option 'tyni'; did you mean tiny?"),  # a sweep's every choice
    ("hparams_search=lora_optun", "hparams_search has no option 'lora_optun'; did you mean lora_optuna?"),
    ("memory_profile=fast", "memory_profile has no option 'fast' (options: 8bit, full, lora, offload, qlora)"),
    ("lora.alpah=8", "lora.alpah: lora has no key 'alpah'; did you mean lora.alpha?"),
    ("+train.foo=1", "train.foo: train has no key 'foo'"),  # Hydra would add it to the typed group
    ("trian.seed=1", "the config (a group or a key) has no key 'trian'; did you mean train?"),
    ("modle=tiny", "has no key 'modle'; did you mean model?"),
])
def test_an_unknown_name_is_named_with_its_close_matches(override, said):
    with pytest.raises(ConfigError) as err:
        check_names(["rm.train", "experiment=tiny", override])
    assert said in str(err.value) and err.value.exit_code == 2


def test_every_unknown_name_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        check_names(["rm.train", "experiment=tyni", "train.learning_rat=1", "lora.r=8"])
    assert "experiment=tyni" in str(err.value) and "did you mean train.learning_rate" in str(err.value)
    assert "lora" not in str(err.value)  # a name that exists is not named
