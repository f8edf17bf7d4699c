"""The reward at the last real token, and the exported bundle's round trips (full, LoRA adapter,
merged by ``lora.merge_on_save`` and by ``python -m rm.export``). ZeRO-3's round trip runs in
``tests/memory/test_profiles.py::test_two_process_zero3_offload_saves_a_loadable_model`` (slow)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

import rm.modelling.bundle as rm_export
import rm.train as rm_train
from rm.modelling.bundle import ExportMismatch, verify_bundle
from rm.data.build import train_pairs
from rm.data.tokenizer import run_tokenizer
from rm.modelling.model import build_model, sequence_rewards
from tests.conftest import CONF_DIR

STEPS = ["train.max_steps=4", "train.logging.eval_steps=0", "train.logging.logging_steps=2"]
ROWS = [[2, 10, 11, 12, 13, 3], [2, 14, 3], [2, 15, 16, 17, 18, 19, 20, 3]]  # <s> ... </s>, three lengths


def pad(rows, pad_id, side):
    """Pad ``rows`` to the longest on ``side``; returns (input_ids, attention_mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(0, len(row)) if side == "right" else slice(width - len(row), width)
        ids[i, span], mask[i, span] = torch.tensor(row), 1
    return ids, mask


def tiny(tiny_cfg, pad_token_id, kind="mistral"):
    set_seed(0)
    if kind == "gpt2":  # absolute position embeddings: left padding needs positions counted per row
        config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, num_labels=1,
                            pad_token_id=pad_token_id, bos_token_id=2, eos_token_id=3)
        return GPT2ForSequenceClassification(config).eval()
    return build_model(tiny_cfg().model, pad_token_id, "float32", False).eval()


def last_position_alone(model, row):
    """The reference: one unpadded sequence; with no pad id, transformers reads its last position."""
    pad_token_id, model.config.pad_token_id = model.config.pad_token_id, None
    try:
        return model(input_ids=torch.tensor([row])).logits.item()
    finally:
        model.config.pad_token_id = pad_token_id


@pytest.mark.parametrize("kind", ["mistral", "gpt2"])
@torch.no_grad()
def test_right_and_left_padding_give_the_rewards_of_each_sequence_alone(tiny_cfg, kind):
    model = tiny(tiny_cfg, pad_token_id=0, kind=kind)
    alone = torch.tensor([last_position_alone(model, row) for row in ROWS])
    right = sequence_rewards(model, *pad(ROWS, 0, "right"))
    left = sequence_rewards(model, *pad(ROWS, 0, "left"))
    assert torch.allclose(right, alone, atol=1e-5) and torch.allclose(left, alone, atol=1e-5), (alone, right, left)
    if kind == "gpt2":
        # Without positions counted from the first real token, left padding shifts every position.
        ids, mask = pad(ROWS, 0, "left")
        plain_left = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        assert not torch.allclose(plain_left, alone, atol=1e-3)


@pytest.mark.parametrize("side", ["right", "left"])
@torch.no_grad()
def test_pad_equal_to_eos_reads_the_final_eos(tiny_cfg, side):
    """Pad id 3 is the eos id that ends every row: the reward is that of the eos position."""
    model = tiny(tiny_cfg, pad_token_id=3)
    alone = torch.tensor([last_position_alone(model, row) for row in ROWS])
    ids, mask = pad(ROWS, 3, side)
    got = sequence_rewards(model, ids, mask)
    assert torch.allclose(got, alone, atol=1e-5), (got, alone)
    # transformers' own pooling skips every trailing pad id, the eos included: a different token.
    assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits.squeeze(-1), alone, atol=1e-3)


@torch.no_grad()
def test_peft_wrapped_model_reads_its_trained_head(tiny_cfg):
    """PEFT's trained copy of the head (modules_to_save) is what the reward comes from."""
    from peft import LoraConfig, TaskType, get_peft_model

    model = tiny(tiny_cfg, pad_token_id=3)
    before = torch.tensor([last_position_alone(model, row) for row in ROWS])
    wrapped = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["q_proj"])).eval()
    wrapped.base_model.model.score.modules_to_save["default"].weight.mul_(-2.0)  # original head untouched
    # LoRA's B starts at zero, so only the trained copy of the head changes the rewards.
    ids, mask = pad(ROWS, 3, "right")
    assert torch.allclose(sequence_rewards(wrapped, ids, mask), -2.0 * before, atol=1e-5)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from rm.foundations.config import to_run_config
    from tests.conftest import FAST_TINY, compose_run

    cfg = to_run_config(compose_run(FAST_TINY + STEPS))
    run_dir = tmp_path_factory.mktemp("full")
    return cfg, run_dir, rm_train.train(cfg, run_dir)


def probe_of(bundle):
    probe = json.loads((bundle / "reward_probe.json").read_text())
    return torch.tensor(probe["input_ids"]), torch.tensor(probe["attention_mask"]), torch.tensor(probe["rewards"])


@pytest.mark.reliability("Security", "pickles", "model weights are written and read as safetensors; optimizer, scheduler and RNG states are read with `torch.load(weights_only=True)`, and only after their sha256 matched")
def test_full_bundle_holds_tokenizer_pad_id_stats_and_reloads_with_the_same_rewards(full_run):
    cfg, run_dir, result = full_run
    final = run_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    assert tokenizer.pad_token_id == model.config.pad_token_id == run_tokenizer(cfg.model, train_pairs(cfg.data)).pad_token_id
    assert (final / "chat_template.jinja").is_file() and tokenizer.chat_template == run_tokenizer(cfg.model, train_pairs(cfg.data)).chat_template
    ids, mask, recorded = probe_of(final)
    assert ids.shape[0] == 2 * rm_export.PROBE_PAIRS and mask.sum(1).unique().numel() > 1  # padding exercised
    with torch.no_grad():
        assert torch.equal(sequence_rewards(model, ids, mask), recorded)
    # The statistics are those of the saved model's rewards on the whole eval set (population std).
    from rm.data.build import build_split
    from rm.data.collator import PairCollator

    trained, append_eos = rm_export.bundle_tokenizer(final)  # the tokenizer as trained, beside the consumers' one
    assert append_eos and trained.get_vocab() == tokenizer.get_vocab()
    eval_set, _ = build_split(cfg.data, trained, "eval")
    batch = PairCollator(tokenizer.pad_token_id)(eval_set)
    with torch.no_grad():
        rewards = sequence_rewards(model, batch["input_ids"], batch["attention_mask"]).double()
    stats = json.loads((final / "reward_stats.json").read_text())
    assert stats["mean"] == pytest.approx(rewards.mean().item(), abs=1e-5)
    assert stats["std"] == pytest.approx(rewards.std(correction=0).item(), abs=1e-5)
    assert stats["pairs"] == len(eval_set) and stats["step"] == result["step"]
    assert stats["max_length"] == cfg.data.max_length
    assert (run_dir / "train_plot.png").is_file()  # the training loss, next to eval_plots.png
    assert verify_bundle(final) == 0.0  # same weights, same dtype, same CPU: the same bits


def test_full_bundle_config_is_right_for_both_transformers_majors_and_openrlhf(full_run):
    """The ids are the tokenizer's (a config built from shape had Mistral's defaults 1 and 2), the rope
    base is where transformers 4 reads it, and the reward stats where OpenRLHF reads them."""
    cfg, run_dir, _ = full_run
    final = run_dir / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    config = json.loads((final / "config.json").read_text())
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 2, 3)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == cfg.model.rope_theta
    stats = json.loads((final / "reward_stats.json").read_text())
    assert (config["mean"], config["std"], config["reward_max_length"]) == (stats["mean"], stats["std"], cfg.data.max_length)
    tok_config = json.loads((final / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # transformers 4 has no TokenizersBackend
    assert tok_config["model_input_names"] == ["input_ids", "attention_mask"]  # Mistral rejects token_type_ids
    assert "token_type_ids" not in tokenizer("Human: hi")
    # tokenizer(text) gives the ids the text trained on: the BOS and the EOS training appended, as the flags say
    # (transformers 4's Llama tokenizers rebuild the post-processor from them).
    assert (tok_config["add_bos_token"], tok_config["add_eos_token"]) == (True, True)
    text = "\n\nHuman: is the sky blue ?\n\nAssistant: yes"
    assert tokenizer(text)["input_ids"] == [2] + tokenizer(text, add_special_tokens=False)["input_ids"] + [3]


def test_corrupted_weights_fail_verification_loudly(full_run, tmp_path):
    _, run_dir, _ = full_run
    bundle = shutil.copytree(run_dir / "final", tmp_path / "final")
    weights = load_file(bundle / "model.safetensors")
    weights["score.weight"] = weights["score.weight"] * 1.5
    save_file(weights, bundle / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExportMismatch, match="max abs difference"):
        verify_bundle(bundle)


@pytest.mark.reliability("Faults", "a saved model that does not reload to the same rewards", "`ExportMismatch` with the largest difference; no final/ (it is verified before it is renamed into place); exit 5")
def test_a_run_whose_bundle_does_not_reload_fails(tiny_cfg, tmp_path, monkeypatch):
    """The head zeroed on disk after writing, before the reload: the run itself fails, loudly."""
    save_bundle = rm_export.save_bundle

    def lose_the_head(model, tokenizer, directory, **kwargs):
        out = save_bundle(model, tokenizer, directory, **kwargs)
        weights = load_file(directory / "model.safetensors")
        save_file({k: torch.zeros_like(v) if k == "score.weight" else v for k, v in weights.items()},
                  directory / "model.safetensors", metadata={"format": "pt"})
        return out

    monkeypatch.setattr(rm_export, "save_bundle", lose_the_head)
    with pytest.raises(ExportMismatch, match="does not reproduce the in-memory rewards") as err:
        rm_train.train(tiny_cfg(*STEPS), tmp_path)
    assert err.value.exit_code == 5
    assert not (tmp_path / "final").exists() and not (tmp_path / ".tmp-final").exists()  # no unverified model left


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from rm.foundations.config import to_run_config
    from tests.conftest import FAST_TINY, compose_run

    cfg = to_run_config(compose_run(
        FAST_TINY + STEPS + ["memory_profile=lora", "lora=r8", "lora.merge_on_save=true", "train.optim.learning_rate=5e-3"]
    ))
    run_dir = tmp_path_factory.mktemp("lora")
    return cfg, run_dir, rm_train.train(cfg, run_dir)


def test_lora_adapter_and_merged_model_reload_with_the_in_memory_rewards(lora_run):
    cfg, run_dir, result = lora_run
    final, merged = run_dir / "final", run_dir / "final" / "merged"
    assert (final / "adapter_model.safetensors").is_file() and (final / "model.safetensors").is_file()  # adapter and base
    assert all((d / name).is_file() for d in (final, merged) for name in ("reward_probe.json", "reward_stats.json"))
    ids, mask, recorded = probe_of(final)
    set_seed(cfg.train.seed)  # the random-init base the adapter was trained on
    base = build_model(cfg.model, AutoTokenizer.from_pretrained(final).pad_token_id, "float32", False)
    assert verify_bundle(final, base_model=base) == 0.0
    plain = AutoModelForSequenceClassification.from_pretrained(merged).eval()  # plain transformers, no PEFT
    assert plain.config.pad_token_id == AutoTokenizer.from_pretrained(merged).pad_token_id
    with torch.no_grad():
        # fp32 merge rounds W + BA once: measured 1.8e-7.
        assert torch.allclose(sequence_rewards(plain, ids, mask), recorded, atol=1e-5)


@pytest.mark.slow
def test_lora_bundle_holds_its_random_base_and_loads_after_the_run_moves(lora_run, tmp_path):
    """No base object, no network: the base is saved in final/ itself, so the bundle loads wherever it is moved;
    ``python -m rm.export`` then names the new place in adapter_config.json, which PEFT's Auto classes follow."""
    from peft import AutoPeftModelForSequenceClassification

    _, run_dir, _ = lora_run
    final = run_dir / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(final.resolve())
    assert verify_bundle(final) < 1e-6
    moved = tmp_path / "elsewhere"
    shutil.move(run_dir, moved)
    try:
        assert verify_bundle(moved / "final") < 1e-6
        proc = subprocess.run([sys.executable, "-m", "rm.export", str(moved)], cwd=CONF_DIR.parent,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "it now names" in proc.stdout, proc.stderr[-2000:]
        named = json.loads((moved / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert named == str((moved / "final").resolve())
        ids, mask, recorded = probe_of(moved / "final")
        model = AutoPeftModelForSequenceClassification.from_pretrained(moved / "final").eval()
        with torch.no_grad():
            assert torch.allclose(sequence_rewards(model, ids, mask), recorded, atol=1e-5)
    finally:
        shutil.move(moved, run_dir)
        rm_export.rehome(final)


@pytest.mark.reliability("Entry points", "`rm.export --merge --out` naming a file, the adapter bundle itself, the run "
                         "directory that holds it, or a directory with files of its own (another run's final/)",
                         "refused before the merge, naming `--out` (`is a file`, `holds the adapter bundle`, `already "
                         "holds files`); every file there unchanged; exit 2 (was: each replaced by the merged model, the "
                         "adapter and its base deleted). `<bundle>/merged`, the default, is still replaced by a new merge")
def test_export_merge_refuses_an_out_that_would_delete_files(lora_run, tmp_path, capsys):
    import rm.export
    from rm.foundations.errors import boundary

    _, run_dir, _ = lora_run
    final = run_dir / "final"
    a_file = tmp_path / "pairs.jsonl"
    a_file.write_text("{}\n")
    other = tmp_path / "other_final"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"weights")
    before = {p: p.read_bytes() for p in [*final.rglob("*"), a_file, other / "model.safetensors"] if p.is_file()}
    for out, said in ((a_file, "is a file"), (final, "holds the adapter bundle"), (run_dir, "holds the adapter bundle"),
                      (other, "already holds files")):
        with pytest.raises(SystemExit) as exited, boundary():
            sys.exit(rm.export.main([str(run_dir), "--merge", "--out", str(out)]))
        text = "".join(capsys.readouterr())
        assert exited.value.code == 2 and f"--out {out} {said}" in text and "Traceback" not in text, text[-2000:]
    assert {p: p.read_bytes() for p in before} == before


def test_export_cli_refuses_to_merge_an_adapter_without_its_base(lora_run, tmp_path):
    _, run_dir, _ = lora_run
    bundle = shutil.copytree(run_dir / "final", tmp_path / "final",
                             ignore=shutil.ignore_patterns("config.json", "model.safetensors", "merged"))
    config = json.loads((bundle / "adapter_config.json").read_text())
    (bundle / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    proc = subprocess.run([sys.executable, "-m", "rm.export", str(bundle), "--merge", "--out", str(tmp_path / "cli_merged")],
                          cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "base model is not on disk" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_export_cli_merges_an_adapter_onto_its_base_on_disk(tiny_cfg, tmp_path):
    """A base on disk, as with a hub checkpoint: the adapter names it, and the CLI merges and verifies."""
    cfg = tiny_cfg()
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    set_seed(1)
    build_model(cfg.model, tokenizer.pad_token_id, "float32", False).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")  # a checkpoint carries its tokenizer, which the run then uses
    run = tmp_path / "run"
    rm_train.train(tiny_cfg(*STEPS, "memory_profile=lora", "lora=r8", "train.optim.learning_rate=5e-3",
                            f"model.pretrained={tmp_path / 'base'}"), run)
    assert json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tmp_path / "base")
    proc = subprocess.run([sys.executable, "-m", "rm.export", str(run), "--merge"],
                          cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "export verified" in proc.stderr and "merged model written and verified" in proc.stdout
    merged = run / "final" / "merged"
    ids, mask, recorded = probe_of(run / "final")
    model = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    with torch.no_grad():
        assert torch.allclose(sequence_rewards(model, ids, mask), recorded, atol=1e-5)
    assert json.loads((merged / "reward_stats.json").read_text()) == json.loads((run / "final" / "reward_stats.json").read_text())
