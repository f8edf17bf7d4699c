"""Every name on the command line exists (rm.foundations.config.unknown_names), checked before Hydra composes."""

import pytest

from rm.foundations.config import unknown_names


@pytest.mark.parametrize("override", [
    "experiment=tiny", "experiment=null", "model=tiny,mistral_7b", "hparams_search=lora_optuna",
    "train.optim.learning_rate=1e-3", "train.optim.learning_rate=1e-3,2e-3", "+data.extra_eval_files.hard=[hard.jsonl]",
    "lora.target_modules=[q_proj]", "health.on_nonfinite=skip", "sweep.on_failure=continue",
    "hydra.run.dir=x", "hydra/launcher=submitit_slurm", "~train.seed", "model.pretrained=null",
])
def test_names_that_exist_pass(override):
    assert unknown_names(["rm.train", "-m", override]) == []


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
    unknown = unknown_names(["rm.train", "experiment=tiny", override])
    assert len(unknown) == 1 and said in unknown[0], unknown


def test_every_unknown_name_is_named_at_once():
    unknown = unknown_names(["rm.train", "experiment=tyni", "train.learning_rat=1", "lora.r=8"])
    assert len(unknown) == 2 and "experiment=tyni" in unknown[0] and "did you mean train.optim.learning_rate" in unknown[1]


@pytest.mark.reliability("Configuration", "an override written as an option (`--experiment=tiny`, `--max_steps=3`), which "
                         "Hydra's argparse takes for an abbreviation of its own flag (`--experimental-rerun tiny`)",
                         "`--experiment=tiny: not an option of rm's commands, which take overrides: write experiment=tiny "
                         "(no dashes)`, with Hydra's flags; exit 2, no `Traceback` (was: `ValueError: File tiny does not "
                         "exist!` with its traceback, exit 1); Hydra's own flags (`--cfg job`, `-m`) pass")
def test_an_override_written_as_an_option_is_named_not_taken_for_hydras_flag(tmp_path):
    import subprocess
    import sys

    from tests.conftest import CONF_DIR

    unknown = unknown_names(["rm.train", "--max_steps=3", "--cfg", "job", "-m", "--config-name", "config"])
    assert len(unknown) == 1 and "--max_steps=3: not an option of rm's commands" in unknown[0], unknown
    assert "write max_steps=3 (no dashes)" in unknown[0]
    proc = subprocess.run([sys.executable, "-m", "rm.train", "--experiment=tiny", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "write experiment=tiny (no dashes)" in out and "Traceback" not in out, out[-3000:]
