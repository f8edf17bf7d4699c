"""The default tokenizer of a random-init model: a byte-level BPE trained on the run's texts (rm.data.tokenizer)."""

import hashlib
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import rm.train as rm_train
from rm.runs.run_dir import TOKENIZER_DIR
from rm.data.build import train_pairs
from rm.data.synthetic import generate_pairs
from rm.data.tokenizer import (MIN_BPE_VOCAB, SPECIAL_TOKENS, VOCABULARY, build_tokenizer, encode_sides, run_tokenizer,
                          train_bpe_tokenizer)
from tests.conftest import CONF_DIR, FAST_TINY

# Text the synthetic data never has: other words, accents, other scripts, emoji, digits, tabs.
OWN_TEXT = [{"chosen": f"\n\nHuman: quelle heure est-il {i}\n\nAssistant: il est midi pile",
             "rejected": f"\n\nHuman: quelle heure est-il {i}\n\nAssistant: aucune idée"} for i in range(40)]
STRANGE = ["Grüße aus Köln, 東京 and Zürich 🙂", "tab\there\r\nand\u00a0nbsp", "1234567890 != 0.5e-3", "  leading spaces",
           "\n\nHuman: Warum?\n\nAssistant: Darum."]


def digest(tokenizer) -> str:
    """The tokenizer's vocabulary and merges (its ``tokenizers`` model), as one hash."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    return hashlib.sha256(json.dumps(json.loads(backend.to_str())["model"], sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def synthetic_tokenizer():
    rows = generate_pairs(300, seed=0, split="train")
    return train_bpe_tokenizer([r["chosen"] for r in rows] + [r["rejected"] for r in rows], vocab_size=1024)


def test_any_text_encodes_without_unknown_or_special_tokens_and_decodes_exactly(synthetic_tokenizer):
    tok = synthetic_tokenizer
    assert [tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2, 3]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
    for text in STRANGE:
        ids = tok(text)["input_ids"]
        assert ids == [2] + tok(text, add_special_tokens=False)["input_ids"]  # a BOS, as Llama's tokenizers add
        assert not set(ids[1:]) & {0, 1, 2, 3}, (text, ids)  # no pad, unk, bos or eos from text
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Frequent words of the training texts are single tokens (with the space before them).
    assert tok.convert_ids_to_tokens(tok(" favourite colour", add_special_tokens=False)["input_ids"]) == [
        "Ġfavourite", "Ġcolour"]


def test_size_is_capped_by_vocab_size_and_never_below_the_bytes():
    rows = generate_pairs(300, seed=0, split="train")
    texts = [r["chosen"] for r in rows]
    assert len(train_bpe_tokenizer(texts, vocab_size=300)) == 300
    assert len(train_bpe_tokenizer(texts, vocab_size=16)) == MIN_BPE_VOCAB == 260  # 4 special tokens + 256 bytes
    assert len(train_bpe_tokenizer([], vocab_size=1024)) == MIN_BPE_VOCAB  # nothing to learn from


def test_same_data_and_settings_give_the_same_tokenizer_in_another_process(tiny_cfg):
    """The trainer breaks ties by ids that depend only on the texts (the Rust hash maps are seeded per process,
    which made WordPiece's training non-deterministic: huggingface/tokenizers#1794). The other process trains
    on the same texts without transformers (light enough for a loaded machine)."""
    cfg = tiny_cfg()  # the synthetic train split: 512 pairs of seed 0, chosen sides then rejected sides
    here = digest(run_tokenizer(cfg.model, train_pairs(cfg.data)))
    code = ("import sys; sys.path.insert(0, '.'); from rm.data.synthetic import generate_pairs; "
            "from rm.data.tokenizer import train_byte_level_bpe; "
            f"rows = generate_pairs({cfg.data.synthetic_train_size}, seed={cfg.data.synthetic_seed}, split='train'); "
            f"print(train_byte_level_bpe([r['chosen'] for r in rows] + [r['rejected'] for r in rows], "
            f"{cfg.model.vocab_size}).to_str())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from tokenizers import Tokenizer

    assert digest(Tokenizer.from_str(proc.stdout.strip().splitlines()[-1])) == here
    other = tiny_cfg("data.synthetic_seed=1")  # other data: another vocabulary
    assert digest(run_tokenizer(other.model, train_pairs(other.data))) != here


def test_a_saved_tokenizer_is_read_back_not_trained_again(tiny_cfg, tmp_path):
    """What a resumed run does: the tokenizer its checkpoints were trained with, whatever the data holds now."""
    cfg = tiny_cfg()
    first = run_tokenizer(cfg.model, train_pairs(cfg.data))
    first.save_pretrained(tmp_path / "tokenizer")

    def other_texts():
        raise AssertionError("a saved tokenizer must not be trained again")

    again = build_tokenizer(cfg.model, texts=other_texts, saved=tmp_path / "tokenizer")
    assert digest(again) == digest(first) and again.pad_token_id == 0
    assert again("\n\nHuman: hi")["input_ids"] == first("\n\nHuman: hi")["input_ids"]
    with pytest.raises(ValueError, match="model.tokenizer=bpe is trained on the run's texts"):
        build_tokenizer(cfg.model)


def test_own_text_keeps_every_pair_with_the_default_tokenizer(tiny_cfg, tmp_path):
    """Text of the user's own (none of its words but "Human", "Assistant" and "est" are in the synthetic
    vocabulary): no unknown token, no alarm, all 40 pairs used. With a word-level tokenizer the answers
    become <unk> and the pairs collapse to identical ids (tests/training/test_health.py)."""
    assert {"quelle", "heure", "midi", "aucune"}.isdisjoint(VOCABULARY)
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in OWN_TEXT))
    cfg = tiny_cfg("data=local", f"data.train_files=[{path}]", f"data.eval_files=[{path}]", "train.max_steps=1",
                   "train.logging.eval_steps=0", "health.chance_after_steps=0")
    result = rm_train.train(cfg, tmp_path / "run")
    assert result["status"] == "ok" and "unknown_tokens" not in result["alarms"], result["alarms"]
    audit = json.loads((tmp_path / "run" / "data_audit.json").read_text())["splits"]
    for split in ("train", "eval"):
        assert audit[split]["unk_rate"] == 0 and audit[split]["pairs_out"] == 40, audit[split]
    assert result["eval_pairs"] == 40


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from rm.foundations.config import to_run_config
    from tests.conftest import compose_run

    run_dir = tmp_path_factory.mktemp("run")
    cfg = to_run_config(compose_run(FAST_TINY + ["train.max_steps=2", "train.logging.eval_steps=0"]))
    assert rm_train.train(cfg, run_dir)["status"] == "ok"
    return cfg, run_dir


def test_export_round_trip_gives_identical_ids(exported):
    """final/ -> AutoTokenizer: ``tokenizer(text)`` gives the ids the text trained on (BOS, text, the appended EOS),
    on the training data's texts and on text it never saw; final/trained_tokenizer and the run's own copy are the
    tokenizer as trained; config.json holds its special ids and a vocabulary that covers it."""
    cfg, run_dir = exported
    trained = run_tokenizer(cfg.model, train_pairs(cfg.data))
    loaded = AutoTokenizer.from_pretrained(run_dir / "final")
    rows = generate_pairs(20, seed=5, split="test")
    texts = [r["chosen"] for r in rows] + STRANGE + [r["chosen"] for r in OWN_TEXT[:3]]
    ids = encode_sides(trained, texts, templated=False)
    assert all(row[0] == 2 and row[-1] == 3 for row in ids)
    assert loaded(texts)["input_ids"] == ids
    for kept in (AutoTokenizer.from_pretrained(run_dir / TOKENIZER_DIR), AutoTokenizer.from_pretrained(run_dir / "final" / "trained_tokenizer")):
        assert kept(texts)["input_ids"] == trained(texts)["input_ids"]
    assert loaded.get_vocab() == trained.get_vocab() and digest(loaded) == digest(trained)
    padded = loaded(texts[:4], padding=True)["input_ids"]  # right padding with the pad id, as the bundle says
    assert loaded.padding_side == "right" and padded[0][len(ids[0]):] == [0] * (len(padded[0]) - len(ids[0]))
    config = json.loads((run_dir / "final" / "config.json").read_text())
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (0, 2, 3)
    assert len(loaded) <= config["vocab_size"] == cfg.model.vocab_size


def test_the_old_builtin_name_is_refused_with_the_new_ones(tiny_cfg):
    from rm.settings.validate import ConfigError, validate

    with pytest.raises(ConfigError, match=r"model.tokenizer=builtin is now model.tokenizer=bpe .* or model.tokenizer=words"):
        validate(tiny_cfg("model.tokenizer=builtin"), 1)


@pytest.mark.reliability("Configuration", "a tokenizer that the exported model's readers would load differently "
                         "(a byte-level BPE of one's own with `model.model_type=qwen2`: transformers 5's AutoTokenizer "
                         "makes it a `Qwen2Tokenizer`, whose pre-tokenizer splits other places)",
                         "refused before any weight loads, naming `model.tokenizer`, `model.model_type`, the class "
                         "transformers loads and a text that differs; the same tokenizer with a Llama or Mistral type passes")
def test_a_tokenizer_its_consumers_would_load_differently_is_refused(tiny_cfg):
    from rm.foundations.errors import ConfigError
    from rm.data.tokenizer import check_consumers_tokenize_alike

    # Digit runs and dotted names: byte-level BPE merges across them, Qwen2's pre-tokenizer does not.
    texts = [f"\n\nHuman: call os.path.join({i * 7919}) in 3.{i % 13}\n\nAssistant: x_{i} = ({i * 31}*2)" for i in range(200)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=1024)
    for model_type in ("llama", "mistral"):
        check_consumers_tokenize_alike(tiny_cfg(f"model.model_type={model_type}").model, tokenizer, tuple(texts[:8]))
    with pytest.raises(ConfigError, match=r"model.tokenizer=bpe with model.model_type=qwen2: .* as Qwen2Tokenizer, "
                                          r"which tokenises [1-9]\d* of 11 probe texts differently"):
        check_consumers_tokenize_alike(tiny_cfg("model.model_type=qwen2").model, tokenizer, tuple(texts[:8]))
