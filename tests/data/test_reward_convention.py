"""rm trains on the token ids TRL's RewardTrainer trains on, and its bundle's tokenizer gives them back.

The reference is TRL's own processed dataset (``RewardTrainer(...).train_dataset``: its ``add_eos`` on plain-text
rows, its chat-template path on conversational ones), built from the same rows with the same tokenizer, as a TRL
user runs it. Three tokenizer styles, each built here from a byte-level BPE trained on the rows:

* ``bos``: Llama/Mistral style, the post-processor adds ``<s>``; a Mistral-like chat template that writes ``<s>``
  and ``</s>`` after each answer;
* ``bos_eos``: the post-processor adds ``<s>`` and ``</s>`` (TRL then ends a plain-text side with two EOS: its
  ``add_eos`` appends the string, the post-processor adds another); a ChatML-like template that writes neither;
* ``rm``: rm's own byte-level BPE (``model.tokenizer=bpe``).
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rm.foundations.config import ModelConfig
from rm.data.normalise import normalise_pairs
from rm.data.tokenise import tokenize_pairs
from rm.foundations.errors import ConfigError
from rm.data.tokenizer import (HH_CHAT_TEMPLATE, build_tokenizer, check_consumers_tokenize_alike, consumer_tokenizer,
                          encode_sides, train_bpe_tokenizer, train_byte_level_bpe, write_tokenizer_compat_fields)

HH = [
    {"chosen": "\n\nHuman: Where is Lima?\n\nAssistant: Lima is in Peru.",
     "rejected": "\n\nHuman: Where is Lima?\n\nAssistant: Lima is in Spain."},
    {"chosen": "\n\nHuman: Hi!\n\nAssistant: Hello.\n\nHuman: What colour is the sky?\n\nAssistant: Blue, mostly.",
     "rejected": "\n\nHuman: Hi!\n\nAssistant: Hello.\n\nHuman: What colour is the sky?\n\nAssistant: Green.</s>"},
]
PROMPT = [{"prompt": "\n\nHuman: Name a fruit.\n\nAssistant:", "chosen": " A mango.", "rejected": " A chair."},
          {"prompt": "", "chosen": "Two plus two is four.", "rejected": "Two plus two is five."}]
MESSAGES = [
    {"chosen": [{"role": "user", "content": "Where is Lima?"}, {"role": "assistant", "content": "In Peru."}],
     "rejected": [{"role": "user", "content": "Where is Lima?"}, {"role": "assistant", "content": "In Spain."}]},
    {"prompt": [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Sky colour?"}],
     "chosen": [{"role": "assistant", "content": "Blue."}], "rejected": [{"role": "assistant", "content": "Green."}]},
]
MISTRAL_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
CHATML_LIKE = "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"


def texts_of(rows):
    out = []
    for row in rows:
        for side in ("chosen", "rejected"):
            value = row[side]
            out.append(value if isinstance(value, str) else " ".join(m["content"] for m in value))
        out.append(row.get("prompt") if isinstance(row.get("prompt"), str) else "")
    return out


def style_tokenizer(style: str, directory) -> str:
    """A tokenizer of ``style`` saved in ``directory``, as a user would hand it to both trainers."""
    texts = texts_of(HH + PROMPT + MESSAGES) * 3
    if style == "rm":
        tok = train_bpe_tokenizer(texts, vocab_size=400)
    else:
        core = train_byte_level_bpe(texts, vocab_size=400)
        single = "<s> $A" if style == "bos" else "<s> $A </s>"
        core.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1", special_tokens=[("<s>", 2), ("</s>", 3)])
        tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                      eos_token="</s>")
        tok.chat_template = MISTRAL_LIKE if style == "bos" else CHATML_LIKE
    tok.save_pretrained(directory)
    return str(directory)


def trl_ids(tokenizer_dir: str, rows, tmp_path):
    """TRL's RewardTrainer's processed rows: (chosen_ids, rejected_ids) per pair."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_labels=1,
                                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    # bf16 off (TRL's default is on): what is compared is the processed dataset, and accelerate keeps one mixed
    # precision per process (the fixture resets it for the tests after this one).
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_steps=1, bf16=False,
                        per_device_train_batch_size=2, dataset_num_proc=None)
    trainer = RewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                            processing_class=tokenizer)
    return list(zip(trainer.train_dataset["chosen_ids"], trainer.train_dataset["rejected_ids"]))


def rm_ids(tokenizer_dir: str, rows):
    """rm's token ids for the same rows: its tokenizer loading (``model.tokenizer=<dir>``) and data pipeline."""
    model_cfg = ModelConfig(name="t", tokenizer=tokenizer_dir, vocab_size=512, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=128)
    tokenizer = build_tokenizer(model_cfg)
    pairs, counts = normalise_pairs(datasets.Dataset.from_list(rows), "auto", tokenizer)
    out, _ = tokenize_pairs(pairs, tokenizer, 1024, counts=counts)
    return list(zip(out["chosen_input_ids"], out["rejected_input_ids"])), tokenizer


@pytest.mark.parametrize("style", ["bos", "bos_eos", "rm"])
@pytest.mark.parametrize("layout", ["hh", "prompt", "messages"])
def test_rm_trains_on_the_ids_trls_reward_trainer_trains_on(style, layout, tmp_path, fresh_accelerator_state):
    rows = {"hh": HH, "prompt": PROMPT, "messages": MESSAGES}[layout]
    directory = style_tokenizer(style, tmp_path / "tok")
    want = trl_ids(directory, rows, tmp_path)
    got, tokenizer = rm_ids(directory, rows)
    assert got == want
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if layout != "messages":  # plain text: the tokenizer's BOS first, the reward read at an EOS
        assert all(ids[0] == bos and ids[-1] == eos for pair in got for ids in pair)
        assert all(ids[-2] != eos for pair in got for ids in pair) == (style != "bos_eos")
    if layout == "messages" and style in ("bos", "rm"):  # templates that write BOS and a final EOS
        assert all(ids[0] == bos and ids[-1] == eos for pair in got for ids in pair)


@pytest.mark.parametrize("style", ["bos", "bos_eos", "rm"])
def test_the_exported_tokenizer_gives_plain_text_its_training_ids(style, tmp_path):
    """``consumer_tokenizer`` saved as rm.modelling.bundle writes it and reloaded by AutoTokenizer: ``tokenizer(text)`` is what
    the text trained on; the tokenizer itself is unchanged."""
    tokenizer = AutoTokenizer.from_pretrained(style_tokenizer(style, tmp_path / "tok"))
    texts = [row["chosen"] for row in HH[:1]] + [p["prompt"] + p["chosen"] for p in PROMPT]
    before = tokenizer(texts)["input_ids"]
    exported = consumer_tokenizer(tokenizer)
    exported.save_pretrained(tmp_path / "bundle")
    write_tokenizer_compat_fields(tmp_path / "bundle")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "bundle")
    assert reloaded(texts)["input_ids"] == encode_sides(tokenizer, texts, templated=False)
    assert tokenizer(texts)["input_ids"] == before
    config = json.loads((tmp_path / "bundle" / "tokenizer_config.json").read_text())
    # BOS + EOS is what add_bos_token/add_eos_token say; two EOS are not, and the flags are left out.
    assert (config.get("add_bos_token"), config.get("add_eos_token")) == ((None, None) if style == "bos_eos" else (True, True))


def test_a_post_processor_that_is_not_a_template_gets_the_eos_after_it(tmp_path):
    """GPT-2-style tokenizers keep a ByteLevel post-processor: the EOS is appended after it (a Sequence)."""
    core = train_byte_level_bpe(texts_of(HH) * 3, vocab_size=300)
    core.post_processor = processors.ByteLevel(trim_offsets=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>")
    exported = consumer_tokenizer(tok)
    assert exported("Hello")["input_ids"] == tok("Hello")["input_ids"] + [3]
    exported.save_pretrained(tmp_path)
    write_tokenizer_compat_fields(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("Hello")["input_ids"] == tok("Hello")["input_ids"] + [3]
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).post_processor.__class__.__name__ == "Sequence"


def llama3_like(tmp_path, spare: bool):
    """A tokenizer like Llama 3's: no pad, no unk, BOS and EOS its only special tokens, maybe reserved ones too."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer, core.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    core.train_from_iterator(texts_of(HH) * 3, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    if spare:
        tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>", "<|finetune_right_pad_id|>"]})
    tok.chat_template = HH_CHAT_TEMPLATE
    tok.save_pretrained(tmp_path)
    return ModelConfig(name="t", tokenizer=str(tmp_path), vocab_size=512, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)


def test_a_tokenizer_without_pad_pads_with_a_spare_special_token_never_the_eos(tmp_path):
    """transformers reads the reward at the last token that is not the pad id: an EOS pad would move it off the EOS."""
    tokenizer = build_tokenizer(llama3_like(tmp_path / "spare", spare=True))
    assert tokenizer.pad_token == "<|finetune_right_pad_id|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    with pytest.raises(ConfigError, match=r"no pad token, no unk token and no spare special token.*EOS \('</s>'\)"):
        build_tokenizer(llama3_like(tmp_path / "none", spare=False))


def test_a_tokenizer_that_reloads_differently_as_exported_is_refused(tmp_path, monkeypatch):
    """The check before any weight loads covers the exported form: a reload that loses the appended EOS is refused."""
    import rm.data.tokenizer

    model_cfg = ModelConfig(name="t", model_type="mistral", vocab_size=512, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            max_position_embeddings=128)
    tokenizer = train_bpe_tokenizer(texts_of(HH) * 3, vocab_size=300)
    check_consumers_tokenize_alike(model_cfg, tokenizer, ("\n\nHuman: hi",))
    monkeypatch.setattr(rm.data.tokenizer, "consumer_tokenizer", lambda tok, append_eos=True: tok)  # the EOS left out
    with pytest.raises(ConfigError, match=r"\(as exported\).*tokenises \d+ of \d+ probe texts differently"):
        check_consumers_tokenize_alike(model_cfg, tokenizer, ("\n\nHuman: hi",))
