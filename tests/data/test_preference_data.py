"""Tests for rm.data.load, rm.data.normalise and rm.data.tokenise: loading, normalising, tokenising preference pairs."""

from __future__ import annotations

import json

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast


from rm.foundations.config import DUPLICATES, FORMATS, IDENTICAL_PAIRS, ON_MALFORMED, TRUNCATION
from rm.data.counts import Drop, PairCounts
from rm.data.load import detect_format, load_preference_split
from rm.data.normalise import normalise_pairs
from rm.data.tokenise import tokenize_pairs

# --------------------------------------------------------------------------- #
# A tiny local tokenizer: one token per word or punctuation run.
# --------------------------------------------------------------------------- #

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
WORDS = ["Human", "Assistant", ":", "hi", "hello", "good", "bad", "answer", "ok", "yes", "no", "what", "?"]
WORDS += [f"p{i}" for i in range(1, 11)]
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
PAD, UNK, BOS, EOS = 0, 1, 2, 3

# The newlines live inside an expression: transformers renders templates with
# trim_blocks, which would eat a newline written right after a block tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '\\n\\nHuman: ' if m['role'] == 'user' else '\\n\\nAssistant: ' }}{{ m['content'] }}"
    "{% endfor %}"
)


def without_reasons(counts):
    """What normalise_pairs counts, without its per-reason detail (tested on its own)."""
    return {
        "rows": counts.rows, "malformed": counts.dropped[Drop.MALFORMED], "empty": counts.dropped[Drop.EMPTY],
        "identical": counts.dropped[Drop.IDENTICAL], "kept": counts.pairs_out,
        "empty_chosen": counts.empty_sides["chosen"], "empty_rejected": counts.empty_sides["rejected"],
    }


def make_tokenizer(pad_token: str = "<pad>") -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token=pad_token,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def tok_pad_is_eos() -> PreTrainedTokenizerFast:
    return make_tokenizer(pad_token="</s>")


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    # Keep load_dataset's cache out of the user's home directory.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def ids_of(*tokens: str) -> list[int]:
    return [VOCAB[t] for t in tokens]


HH_ROWS = [
    {"chosen": "\n\nHuman: hi\n\nAssistant: good answer", "rejected": "\n\nHuman: hi\n\nAssistant: bad answer"},
    {"chosen": "\n\nHuman: what ?\n\nAssistant: yes", "rejected": "\n\nHuman: what ?\n\nAssistant: no"},
]
PROMPT_ROWS = [
    {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " good answer", "rejected": " bad answer"},
    {"prompt": "\n\nHuman: what ?\n\nAssistant:", "chosen": " yes", "rejected": " no"},
]
MESSAGES_ROWS = [
    {
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "good answer"}],
        "rejected": [{"role": "assistant", "content": "bad answer"}],
    },
    {
        "prompt": [{"role": "user", "content": "what ?"}],
        "chosen": [{"role": "assistant", "content": "yes"}],
        "rejected": [{"role": "assistant", "content": "no"}],
    },
]
EXPECTED_TEXTS = [
    ("\n\nHuman: hi\n\nAssistant: good answer", "\n\nHuman: hi\n\nAssistant: bad answer"),
    ("\n\nHuman: what ?\n\nAssistant: yes", "\n\nHuman: what ?\n\nAssistant: no"),
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_json(path, rows):
    path.write_text(json.dumps(rows))
    return str(path)


def write_parquet(path, rows):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


WRITERS = {"jsonl": write_jsonl, "json": write_json, "parquet": write_parquet}


def test_constants():
    assert FORMATS == ("auto", "hh", "prompt", "messages")
    assert TRUNCATION == ("truncate", "drop", "error")
    assert ON_MALFORMED == ("skip", "error")
    assert IDENTICAL_PAIRS == ("drop", "keep")
    assert DUPLICATES == ("keep", "drop")


# --------------------------------------------------------------------------- #
# Loading + format handling
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize(
    "rows,expected_format",
    [(HH_ROWS, "hh"), (PROMPT_ROWS, "prompt"), (MESSAGES_ROWS, "messages")],
    ids=["hh", "prompt", "messages"],
)
@pytest.mark.parametrize("fmt", ["auto", "explicit"])
def test_load_and_normalise_each_format(tmp_path, tok, ext, rows, expected_format, fmt):
    path = WRITERS[ext](tmp_path / f"data.{ext}", rows)
    raw = load_preference_split("local", files=[path])
    assert len(raw) == 2
    assert detect_format(raw) == expected_format

    ds, counts = normalise_pairs(raw, expected_format if fmt == "explicit" else "auto", tok)
    assert ds.column_names == ["chosen", "rejected", "margin", "templated"]
    assert list(zip(ds["chosen"], ds["rejected"])) == EXPECTED_TEXTS
    assert ds["margin"] == [0.0, 0.0]
    assert ds["templated"] == [expected_format == "messages"] * 2  # rendered by the chat template
    assert without_reasons(counts) == {"rows": 2, "malformed": 0, "empty": 0, "identical": 0, "kept": 2, "empty_chosen": 0, "empty_rejected": 0}


def test_messages_without_prompt_column(tok):
    rows = [
        {
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad"}],
        }
    ]
    ds, _ = normalise_pairs(datasets.Dataset.from_list(rows), "auto", tok)
    assert ds[0]["chosen"] == "\n\nHuman: hi\n\nAssistant: good"
    assert ds[0]["rejected"] == "\n\nHuman: hi\n\nAssistant: bad"


@pytest.mark.reliability("Data", "wrong columns", "names the columns found and the accepted layouts")
def test_unknown_layout_error_names_columns_and_formats(tok):
    raw = datasets.Dataset.from_list([{"question": "q", "answer_a": "a", "answer_b": "b"}])
    with pytest.raises(ValueError) as err:
        normalise_pairs(raw, "auto", tok)
    msg = str(err.value)
    for word in ("question", "answer_a", "answer_b", "hh", "prompt", "messages"):
        assert word in msg


def test_explicit_format_missing_column(tok):
    raw = datasets.Dataset.from_list(HH_ROWS)
    with pytest.raises(ValueError, match="prompt"):
        normalise_pairs(raw, "prompt", tok)


def test_glob_and_several_files_concatenate_and_max_samples(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", HH_ROWS)
    write_jsonl(tmp_path / "b.jsonl", HH_ROWS[:1])
    raw = load_preference_split("local", files=[str(tmp_path / "*.jsonl")])
    assert len(raw) == 3
    # The same file named twice (glob + explicit) is loaded once.
    raw = load_preference_split("local", files=[str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])
    assert len(raw) == 3
    raw = load_preference_split("local", files=[str(tmp_path / "a.jsonl")], max_samples=1)
    assert raw["chosen"] == [HH_ROWS[0]["chosen"]]


def test_missing_file_error_names_path_and_key(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError) as err:
        load_preference_split("local", split="train", files=[missing])
    assert f"data.train_files: no file matches '{missing}'" in str(err.value)
    with pytest.raises(FileNotFoundError, match=r"data\.eval_files: .*\*\.parquet"):
        load_preference_split("local", files=[str(tmp_path / "*.parquet")], files_key="data.eval_files")


def test_mixed_extensions_rejected(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", HH_ROWS)
    b = write_parquet(tmp_path / "b.parquet", HH_ROWS)
    with pytest.raises(ValueError, match="mix"):
        load_preference_split("local", files=[a, b])
    c = tmp_path / "c.csv"
    c.write_text("chosen,rejected\n")
    with pytest.raises(ValueError, match="'.csv'"):
        load_preference_split("local", files=[str(c)])


def test_counts_survive_a_second_call_on_file_backed_data(tmp_path, tok):
    # map() on file-backed data writes cache files; a cache hit would skip the
    # function that gathers the counts.
    rows = HH_ROWS + [{"chosen": "", "rejected": "hi"}]
    raw = load_preference_split("local", files=[write_jsonl(tmp_path / "d.jsonl", rows)])
    first = normalise_pairs(raw, "hh", tok)[1]
    second = normalise_pairs(raw, "hh", tok)[1]
    assert without_reasons(first) == without_reasons(second) == {"rows": 3, "malformed": 0, "empty": 1, "identical": 0, "kept": 2, "empty_chosen": 1, "empty_rejected": 0}


# --------------------------------------------------------------------------- #
# Margins
# --------------------------------------------------------------------------- #


def test_margin_carried_through_to_token_ids(tok):
    rows = [dict(r, score_gap=g) for r, g in zip(HH_ROWS, [1.5, 3])]
    ds, _ = normalise_pairs(datasets.Dataset.from_list(rows), "auto", tok, margin_column="score_gap")
    assert ds["margin"] == [1.5, 3.0]
    out, _ = tokenize_pairs(ds, tok, max_length=32)
    assert out.column_names == ["chosen_input_ids", "rejected_input_ids", "margin"]
    assert out["margin"] == [1.5, 3.0]


def test_requested_margin_column_missing(tok):
    with pytest.raises(ValueError, match="'score_gap'"):
        normalise_pairs(datasets.Dataset.from_list(HH_ROWS), "hh", tok, margin_column="score_gap")


def test_bad_margin_value_is_malformed(tok):
    rows = [dict(HH_ROWS[0], m=None), dict(HH_ROWS[1], m=float("nan")), dict(HH_ROWS[0], m=2.0)]
    raw = datasets.Dataset.from_list(rows)
    ds, counts = normalise_pairs(raw, "hh", tok, margin_column="m")
    assert ds["margin"] == [2.0]
    assert counts.dropped[Drop.MALFORMED] == 2
    with pytest.raises(ValueError, match=r"row 0: 'm' is None"):
        normalise_pairs(raw, "hh", tok, margin_column="m", on_malformed="error")


# --------------------------------------------------------------------------- #
# Malformed, empty and identical rows
# --------------------------------------------------------------------------- #

GOOD = {"chosen": "\n\nHuman: hi\n\nAssistant: good", "rejected": "\n\nHuman: hi\n\nAssistant: bad"}


@pytest.mark.reliability("Data", "non-string or empty fields, malformed messages", "skipped and counted (`data.on_malformed=skip`, default) or an error naming the row (`error`)")
def test_hh_malformed_rows_skip_and_error(tok):
    rows = [
        GOOD,
        {"chosen": GOOD["chosen"], "rejected": None},  # 1 malformed
        {"chosen": "", "rejected": GOOD["rejected"]},  # 2 empty
        {"chosen": GOOD["chosen"], "rejected": " \n\t "},  # 3 whitespace
        {"chosen": GOOD["chosen"], "rejected": GOOD["chosen"]},  # 4 identical
        {"chosen": "\n\nHuman: no\n\nAssistant: yes", "rejected": "\n\nHuman: no\n\nAssistant: no"},
    ]
    raw = datasets.Dataset.from_list(rows)
    ds, counts = normalise_pairs(raw, "hh", tok)
    assert ds["chosen"] == [GOOD["chosen"], rows[5]["chosen"]]
    assert without_reasons(counts) == {"rows": 6, "malformed": 1, "empty": 2, "identical": 1, "kept": 2, "empty_chosen": 1, "empty_rejected": 1}

    with pytest.raises(ValueError, match=r"^row 1: 'rejected' is None"):
        normalise_pairs(raw, "hh", tok, on_malformed="error")
    with pytest.raises(ValueError, match=r"^row 1: 'chosen' is empty"):
        normalise_pairs(raw.select([0, 2, 3]), "hh", tok, on_malformed="error")
    with pytest.raises(ValueError, match=r"^row 1: 'rejected' is whitespace only"):
        normalise_pairs(raw.select([0, 3]), "hh", tok, on_malformed="error")
    # Identical pairs are dropped even in error mode: they are useless, not broken.
    ds, counts = normalise_pairs(raw.select([0, 4]), "hh", tok, on_malformed="error")
    assert len(ds) == 1 and counts.dropped[Drop.IDENTICAL] == 1


def test_non_string_field_is_malformed(tok):
    # Arrow keeps one type per column, so a wrong type shows up column-wide.
    raw = datasets.Dataset.from_list([{"prompt": 7, "chosen": " good", "rejected": " bad"}] * 3)
    with pytest.raises(ValueError, match="prompt"):
        detect_format(raw)
    ds, counts = normalise_pairs(raw, "prompt", tok)
    assert len(ds) == 0 and counts.dropped[Drop.MALFORMED] == 3
    with pytest.raises(ValueError, match=r"^row 0: 'prompt' is int, expected a string"):
        normalise_pairs(raw, "prompt", tok, on_malformed="error")


def test_prompt_format_malformed_and_empty_prompt_allowed(tok):
    rows = [
        {"prompt": "", "chosen": "\n\nHuman: hi\n\nAssistant: good", "rejected": "\n\nHuman: hi\n\nAssistant: no"},
        {"prompt": None, "chosen": " good", "rejected": " bad"},
        {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " good", "rejected": "   "},
    ]
    ds, counts = normalise_pairs(datasets.Dataset.from_list(rows), "auto", tok)
    assert ds["chosen"] == [rows[0]["chosen"]]
    assert without_reasons(counts) == {"rows": 3, "malformed": 1, "empty": 1, "identical": 0, "kept": 1, "empty_chosen": 0, "empty_rejected": 1}


def test_messages_wrong_structure(tok):
    user = {"role": "user", "content": "hi"}
    good = [user, {"role": "assistant", "content": "good"}]
    bad = [user, {"role": "assistant", "content": "bad"}]
    rows = [
        {"chosen": good, "rejected": bad},
        {"chosen": good, "rejected": [user, {"role": "assistant"}]},  # 1 content missing
        {"chosen": [], "rejected": bad},  # 2 empty list
        {"chosen": good, "rejected": [user, {"role": "assistant", "content": "  "}]},  # 3 blank response
        {"chosen": [{"content": "good"}], "rejected": bad},  # 4 role missing
        {"chosen": None, "rejected": bad},  # 5 not a list
        {"chosen": good, "rejected": good},  # 6 identical
    ]
    raw = datasets.Dataset.from_list(rows)
    ds, counts = normalise_pairs(raw, "messages", tok)
    assert ds["rejected"] == ["\n\nHuman: hi\n\nAssistant: bad"]
    assert without_reasons(counts) == {"rows": 7, "malformed": 3, "empty": 2, "identical": 1, "kept": 1, "empty_chosen": 1, "empty_rejected": 1}

    with pytest.raises(ValueError, match=r"^row 1: 'rejected' message 1 has content=None"):
        normalise_pairs(raw, "messages", tok, on_malformed="error")
    with pytest.raises(ValueError, match=r"^row 1: 'chosen' is an empty list"):
        normalise_pairs(raw.select([0, 2]), "messages", tok, on_malformed="error")
    with pytest.raises(ValueError, match=r"^row 0: 'chosen' is None, expected a list of messages"):
        normalise_pairs(raw.select([5]), "messages", tok, on_malformed="error")


def test_messages_column_of_strings_is_malformed(tok):
    raw = datasets.Dataset.from_list([{"chosen": [{"role": "user", "content": "hi"}], "rejected": "hi"}])
    with pytest.raises(ValueError, match="cannot detect"):
        normalise_pairs(raw, "auto", tok)
    with pytest.raises(ValueError, match=r"row 0: 'rejected' is str, expected a list of messages"):
        normalise_pairs(raw, "messages", tok, on_malformed="error")


def test_messages_needs_chat_template():
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        normalise_pairs(datasets.Dataset.from_list(MESSAGES_ROWS), "messages", plain)


def test_synthetic_rows_via_from_list(tok):
    ds, counts = normalise_pairs(datasets.Dataset.from_list(HH_ROWS), "auto", None)
    assert list(zip(ds["chosen"], ds["rejected"])) == EXPECTED_TEXTS
    assert counts.pairs_out == 2


# --------------------------------------------------------------------------- #
# Tokenising and truncation
# --------------------------------------------------------------------------- #


def pairs(*rows, margin=0.0):
    return datasets.Dataset.from_list([{"chosen": c, "rejected": r, "margin": margin} for c, r in rows])


def test_plain_text_sides_keep_the_tokenizers_bos_and_end_with_an_appended_eos(tok):
    """TRL's RewardTrainer convention: this tokenizer prepends <s> (kept) and the EOS string is appended to each
    plain-text side; the reward is then read at that EOS."""
    out, counts = tokenize_pairs(pairs(("Human: hi Assistant: good", "Human: hi Assistant: bad")), tok, 64)
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "Human", ":", "hi", "Assistant", ":", "good", "</s>")
    assert out[0]["rejected_input_ids"] == ids_of("<s>", "Human", ":", "hi", "Assistant", ":", "bad", "</s>")
    assert counts.truncated == 0 and counts.pairs_out == 1
    assert counts.lengths_before_truncation["chosen"]["max"] == 8 and counts.lengths_before_truncation["chosen"]["mean"] == 8.0
    # data.append_eos=false: the text as the tokenizer gives it.
    out, _ = tokenize_pairs(pairs(("Human: hi Assistant: good", "Human: hi Assistant: bad")), tok, 64, append_eos=False)
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "Human", ":", "hi", "Assistant", ":", "good")


def test_templated_sides_are_tokenised_as_rendered(tok):
    """A conversation's special tokens are the template's: the tokenizer adds none, no EOS is appended (TRL's
    apply_chat_template path)."""
    ds = datasets.Dataset.from_list([{"chosen": "<s> hi good </s>", "rejected": "hi bad", "margin": 0.0, "templated": True}])
    out, _ = tokenize_pairs(ds, tok, 64)
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "hi", "good", "</s>")
    assert out[0]["rejected_input_ids"] == ids_of("hi", "bad")


def test_an_eos_written_in_the_text_is_not_doubled(tok):
    out, _ = tokenize_pairs(pairs(("hi good </s>", "hi bad")), tok, 64)
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "hi", "good", "</s>")
    assert out[0]["rejected_input_ids"] == ids_of("<s>", "hi", "bad", "</s>")


def test_pad_that_is_eos_is_refused_when_every_side_ends_with_it(tok_pad_is_eos):
    assert tok_pad_is_eos.pad_token_id == tok_pad_is_eos.eos_token_id == EOS
    with pytest.raises(ValueError, match=r"pad token '</s>' is the EOS.*data.append_eos"):
        tokenize_pairs(pairs(("hi good", "hi bad")), tok_pad_is_eos, 64)
    out, counts = tokenize_pairs(pairs(("hi good", "hi bad")), tok_pad_is_eos, 64, append_eos=False)
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "hi", "good")
    # With pad == eos, a literal EOS in the text is a pad inside the text.
    out, counts = tokenize_pairs(pairs(("hi good </s>", "hi bad"), ("hi yes", "hi no")), tok_pad_is_eos, 64, append_eos=False)
    assert counts.dropped[Drop.PAD_IN_TEXT] == 1 and counts.pairs_out == 1
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "hi", "yes")


LONG_CHOSEN = "\n\nHuman: p1 p2 p3 p4 p5 p6\n\nAssistant: good answer"
LONG_REJECTED = "\n\nHuman: p1 p2 p3 p4 p5 p6\n\nAssistant: bad"


def test_truncation_cuts_prompt_from_the_left(tok):
    # Full chosen: <s> Human : p1 p2 p3 p4 p5 p6 Assistant : good answer </s> = 14 tokens.
    # max_length 8 keeps <s> and the last 7 body tokens, the EOS where the reward is read among them.
    out, counts = tokenize_pairs(pairs((LONG_CHOSEN, LONG_REJECTED), margin=0.5), tok, max_length=8)
    chosen, rejected = out[0]["chosen_input_ids"], out[0]["rejected_input_ids"]
    assert chosen == ids_of("<s>", "p5", "p6", "Assistant", ":", "good", "answer", "</s>")
    assert rejected == ids_of("<s>", "p4", "p5", "p6", "Assistant", ":", "bad", "</s>")
    assert len(chosen) == len(rejected) == 8
    assert chosen[0] == BOS
    assert out[0]["margin"] == 0.5
    assert counts.truncated == 1 and counts.pairs_out == 1
    # Statistics describe the lengths before truncation.
    assert counts.lengths_before_truncation["chosen"]["max"] == 14 and counts.lengths_before_truncation["rejected"]["max"] == 13


def test_truncation_only_cuts_the_long_side(tok):
    out, counts = tokenize_pairs(pairs((LONG_CHOSEN, "hi bad")), tok, max_length=10)
    assert len(out[0]["chosen_input_ids"]) == 10
    assert out[0]["rejected_input_ids"] == ids_of("<s>", "hi", "bad", "</s>")
    assert counts.truncated == 1


def test_drop_policy_drops_long_pairs(tok):
    ds = pairs((LONG_CHOSEN, LONG_REJECTED), ("hi good", "hi bad"))
    out, counts = tokenize_pairs(ds, tok, max_length=8, truncation="drop")
    assert len(out) == 1
    assert out[0]["chosen_input_ids"] == ids_of("<s>", "hi", "good", "</s>")
    assert counts.dropped[Drop.TOO_LONG] == 1 and counts.truncated == 0 and counts.pairs_out == 1
    # A side of exactly max_length (EOS included) is not too long.
    out, counts = tokenize_pairs(pairs(("hi good answer", "hi bad")), tok, max_length=5, truncation="drop")
    assert len(out) == 1 and counts.dropped[Drop.TOO_LONG] == 0


def test_identical_after_truncation_dropped(tok):
    # The pairs differ only in the start of the prompt, which truncation removes.
    ds = pairs(
        ("Human: p1 p2 p3 Assistant: good", "Human: p9 p2 p3 Assistant: good"),
        ("Human: hi Assistant: good", "Human: hi Assistant: bad"),
    )
    out, counts = tokenize_pairs(ds, tok, max_length=7)
    assert counts.identical_after_truncation == 1
    assert counts.rows == 2 and counts.pairs_out == 1
    assert out[0]["rejected_input_ids"][-3:] == ids_of(":", "bad", "</s>")
    # Without truncation the same pair is kept.
    out, counts = tokenize_pairs(ds, tok, max_length=64)
    assert counts.identical_after_truncation == 0 and len(out) == 2


def test_pad_in_text_skip_and_error(tok):
    ds = pairs(("hi good", "hi bad"), ("hi <pad> good", "hi bad"))
    out, counts = tokenize_pairs(ds, tok, 64)
    assert len(out) == 1 and counts.dropped[Drop.PAD_IN_TEXT] == 1
    with pytest.raises(ValueError, match=r"^row 1: 'chosen' contains the pad token id 0"):
        tokenize_pairs(ds, tok, 64, on_malformed="error")


def test_invalid_arguments(tok):
    ds = pairs(("hi good", "hi bad"))
    with pytest.raises(ValueError, match="truncation"):
        tokenize_pairs(ds, tok, 8, truncation="cut")
    with pytest.raises(ValueError, match="max_length"):
        tokenize_pairs(ds, tok, 1)  # only room for BOS
    with pytest.raises(ValueError, match="format"):
        normalise_pairs(datasets.Dataset.from_list(HH_ROWS), "csv", tok)
    with pytest.raises(ValueError, match="source"):
        load_preference_split("s3", files=["x.jsonl"])


def test_end_to_end_counts_and_summary(tmp_path, tok):
    rows = HH_ROWS + [
        {"chosen": LONG_CHOSEN, "rejected": LONG_REJECTED},
        {"chosen": "", "rejected": "x"},
        {"chosen": "hi", "rejected": "hi"},
    ]
    raw = load_preference_split("local", files=[write_jsonl(tmp_path / "e.jsonl", rows)])
    ds, norm_counts = normalise_pairs(raw, "auto", tok)
    out, counts = tokenize_pairs(ds, tok, max_length=10, counts=norm_counts)
    assert len(out) == 3
    line = counts.format()
    assert line.startswith("pairs 5 -> 3 used: 1 truncated, 1 identical, 1 empty skipped (tokens before truncation:")


def test_counts_format_example():
    counts = PairCounts(rows=1000, truncated=5, identical_text=1, identical_before_truncation=1, identical_after_truncation=2)
    counts.dropped.update({Drop.MALFORMED: 3, Drop.IDENTICAL: 2, Drop.TOO_LONG: 3})
    assert counts.format() == "pairs 1000 -> 992 used: 5 truncated, 3 dropped (too long), 2 identical, 3 malformed skipped"
    assert PairCounts(rows=4).format() == "pairs 4 -> 4 used"


def test_tokenize_pairs_goes_on_with_the_counts_of_normalise_pairs(tok):
    raw = datasets.Dataset.from_list(HH_ROWS + [{"chosen": "hi", "rejected": "hi"}])
    ds, norm_counts = normalise_pairs(raw, "hh", tok)
    _, counts = tokenize_pairs(ds, tok, 64, identical="keep", counts=norm_counts)
    assert (counts.rows, counts.pairs_out, counts.dropped[Drop.IDENTICAL]) == (3, 2, 1)
    assert norm_counts.lengths_before_truncation == {}  # the counts given are left as they were
    with pytest.raises(ValueError, match="the counts end with 2 pairs, the dataset has 3"):
        tokenize_pairs(datasets.Dataset.from_list([dict(r, margin=0.0) for r in HH_ROWS * 2][:3]), tok, 64, counts=norm_counts)


@pytest.mark.reliability("Data", "messages rows that are system-only, end on a user turn, or have no assistant answer",
                         "dropped as `no_answer` with the side and its roles in `data_audit.json`'s reasons; an error "
                         "naming the row under `data.on_malformed=error`")
@pytest.mark.reliability("Data", "a messages file where some rows carry the optional `prompt` list and some do not",
                         "each row is read with or without its prompt; none is dropped for the prompt's absence")
def test_messages_without_a_final_answer_are_not_pairs_and_the_prompt_is_optional_per_row(tok):
    user, system = {"role": "user", "content": "hi"}, {"role": "system", "content": "you are helpful"}
    good, bad = {"role": "assistant", "content": "good"}, {"role": "assistant", "content": "bad"}
    rows = [
        {"prompt": [user], "chosen": [good], "rejected": [bad]},  # 0 with a prompt list
        {"prompt": None, "chosen": [user, good], "rejected": [user, bad]},  # 1 without: Arrow's None
        {"prompt": None, "chosen": [system], "rejected": [system, bad]},  # 2 system only on one side
        {"prompt": None, "chosen": [user, good, user], "rejected": [user, bad]},  # 3 chosen ends on a user turn
        {"prompt": [system], "chosen": [user], "rejected": [user]},  # 4 no assistant message at all
    ]
    raw = datasets.Dataset.from_list(rows)
    ds, counts = normalise_pairs(raw, "messages", tok)
    assert ds["chosen"] == ["\n\nHuman: hi\n\nAssistant: good"] * 2
    assert counts.dropped[Drop.NO_ANSWER] == 3 and counts.dropped[Drop.MALFORMED] == 0 and counts.pairs_out == 2
    reasons = counts.drop_reasons
    assert reasons["no_answer: 'chosen' has no assistant message (roles ['system'])"] == {"count": 1, "first_row": 2}
    assert reasons["no_answer: 'chosen' ends on a 'user' message, not an assistant answer"] == {"count": 1, "first_row": 3}
    assert reasons["no_answer: 'chosen' has no assistant message (roles ['system', 'user'])"] == {"count": 1, "first_row": 4}
    with pytest.raises(ValueError, match=r"^row 2: 'chosen' has no assistant message"):
        normalise_pairs(raw, "messages", tok, on_malformed="error")


@pytest.mark.reliability("Data", "one row of tens of megabytes among normal rows",
                         "a side over `data.max_length` x 64 characters is cut to its end before it tokenizes (the ids "
                         "truncation keeps, unchanged), counted in `data_audit.json` (`capped_before_tokenizing`) and "
                         "named with its file and row in the log; dropped as too long under `data.truncation=drop`, an "
                         "error naming the row under `error`. Measured (`python benchmarks/huge_row_rss.py`: 200 pairs, "
                         "2 steps of `experiment=tiny`): peak RSS 904 MiB with one 50 MB row against 686 MiB without "
                         "it, at load 2.4 (11.0 GB before the cap, in an earlier measurement)")
def test_a_side_far_over_max_length_is_cut_before_it_tokenizes_to_the_same_ids(tok):
    from rm.data.normalise import max_chars_for
    from rm.data.tokenise import tokenize_pairs

    max_length = 8
    cap = max_chars_for(max_length)
    long_prompt = "hi " * 5000  # 15,000 characters, far over 8 tokens x 64
    rows = [{"prompt": long_prompt, "chosen": "good answer", "rejected": "bad answer"},
            {"prompt": "hi ", "chosen": "ok", "rejected": "no"}]
    raw = datasets.Dataset.from_list(rows)
    capped, counts = normalise_pairs(raw, "prompt", tok, max_chars=cap)
    assert counts.capped == 1 and counts.capped_first_row == 0 and counts.capped_longest == len(long_prompt) + 11
    assert len(capped["chosen"][0]) == cap and capped["chosen"][0] == (long_prompt + "good answer")[-cap:]
    whole, whole_counts = normalise_pairs(raw, "prompt", tok)  # no cap: the whole text tokenizes, then truncates
    got, _ = tokenize_pairs(capped, tok, max_length, counts=counts)
    want, _ = tokenize_pairs(whole, tok, max_length, counts=whole_counts)
    assert got["chosen_input_ids"] == want["chosen_input_ids"] and got["rejected_input_ids"] == want["rejected_input_ids"]
    _, dropped = normalise_pairs(raw, "prompt", tok, max_chars=cap, truncation="drop")
    assert dropped.dropped[Drop.TOO_LONG] == 1 and dropped.pairs_out == 1
    with pytest.raises(ValueError, match=r"^row 0: a side is 15,011 characters"):
        normalise_pairs(raw, "prompt", tok, max_chars=cap, truncation="error")
