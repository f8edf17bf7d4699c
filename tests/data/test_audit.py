"""The pair audit (rm.data.audit) on a crafted split, with numbers worked out by hand.

The split below goes through normalise_pairs and tokenize_pairs with the word-level
vocabulary (rm/data/tokenizer.py) in a tokenizer that itself prepends ``<s>`` and appends ``</s>``
(rm's own add nothing; some tokenizers add both, and truncation must keep the ``<s>``), so a side
of w known words is w + 2 tokens, a word outside the vocabulary becomes ``<unk>`` and ``<pad>`` in
a text is the pad id. ``max_length`` is 6: ``<s>`` plus the last 5 tokens of the body (``</s>`` included).

row  chosen                                   rejected                                  tokens   what it is
  0  red cat dog                              blue                                      5 / 3    kept, chosen longer
  1  red cat dog                              blue                                      5 / 3    exact duplicate of row 0
  2  green                                    green                                     3 / 3    identical texts
  3  (empty)                                  blue                                      -        empty chosen side
  4  red blue green yellow purple orange cat  red blue green yellow purple orange dog   9 / 9    both truncated to 6, differ
  5  red blue green yellow purple orange cat  black blue green yellow purple orange cat 9 / 9    identical after truncation
  6  zebra                                    unicorn                                   3 / 3    both <unk>: identical ids
  7  cat                                      null                                      -        malformed
  8  cat                                      dog                                       3 / 3    tie
  9  cat                                      red dog                                   3 / 4    rejected longer
 10  red cat                                  red blue green yellow purple dog          4 / 8    rejected truncated to 6
 11  cat <pad>                                dog                                       4 / 3    pad id in the text
"""

import json
import logging

import datasets
import pytest
from tokenizers import processors

import rm.train as rm_train
from rm.data.audit import audit_split, format_audit, length_stats, write_audit
from rm.data.normalise import normalise_pairs
from rm.data.tokenise import encode_texts, pair_lengths, tokenize_pairs
from rm.data.synthetic import generate_pairs
from rm.data.tokenizer import build_word_level_tokenizer
from rm.settings.validate import ConfigError

SEVEN = "red blue green yellow purple orange"
ROWS = [
    ("red cat dog", "blue"),
    ("red cat dog", "blue"),
    ("green", "green"),
    ("", "blue"),
    (f"{SEVEN} cat", f"{SEVEN} dog"),
    (f"{SEVEN} cat", f"black {SEVEN[4:]} cat"),
    ("zebra", "unicorn"),
    ("cat", None),
    ("cat", "dog"),
    ("cat", "red dog"),
    ("red cat", "red blue green yellow purple dog"),
    ("cat <pad>", "dog"),
]
MAX_LENGTH = 6


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_word_level_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)]
    )
    return tok


def run_audit(tokenizer, truncation="truncate", identical="drop", duplicates="keep"):
    raw = datasets.Dataset.from_list([{"chosen": c, "rejected": r} for c, r in ROWS])
    pairs, norm_counts = normalise_pairs(raw, "hh", tokenizer, identical=identical, row_index=True)
    # The fixture's post-processor writes <s> ... </s> itself: with no EOS appended on top (TRL's convention would
    # end each side with two), the lengths are those the docstrings work out.
    tokenised, counts = tokenize_pairs(
        pairs, tokenizer, MAX_LENGTH, truncation=truncation, identical=identical, duplicates=duplicates,
        counts=norm_counts, append_eos=False,
    )
    return tokenised, counts, audit_split(counts, *pair_lengths(tokenised))


def test_crafted_rows_tokenise_as_the_table_says(tokenizer):
    # Guards the table in the module docstring that every number below is worked from.
    assert ROWS[5][1] == "black blue green yellow purple orange cat"
    lengths = [len(tokenizer(t)["input_ids"]) for row in ROWS for t in row if t]
    assert lengths == [5, 3, 5, 3, 3, 3, 3, 9, 9, 9, 9, 3, 3, 3, 3, 3, 3, 4, 4, 8, 4, 3]
    assert tokenizer("zebra")["input_ids"] == tokenizer("unicorn")["input_ids"] == [2, tokenizer.unk_token_id, 3]
    assert tokenizer.pad_token_id in tokenizer("cat <pad>")["input_ids"]


def test_audit_default_policies(tokenizer):
    """truncate, identical pairs dropped, duplicates kept.

    normalise_pairs: 12 rows; row 7 malformed, row 3 empty (its chosen side), row 2 identical texts
    (dropped): 9 pairs go on to tokenize_pairs (rows 0 1 4 5 6 8 9 10 11).
    Lengths before truncation of those 9 (<s> and </s> included):
      chosen   5 5 9 9 3 3 3 4 4 -> sorted 3 3 3 4 4 5 5 9 9: min 3, mean 45/9 = 5.0, median (5th) 4,
               p95 = value at rank ceil(0.95 * 9) = 9 -> 9, max 9;
      rejected 3 3 9 9 3 3 4 8 3 -> sorted 3 3 3 3 3 4 8 9 9: min 3, mean 45/9 = 5.0, median 3, p95 9, max 9.
    Row 6 has equal ids before truncation (<s> <unk> </s>). Rows 4, 5, 10 are truncated; row 5 becomes
    <s> yellow purple orange cat </s> on both sides. Row 11 holds the pad id: dropped. Rows 5 and 6 are
    identical after truncation: dropped. Row 1 repeats row 0: a duplicate, kept.
    Kept: rows 0 1 4 8 9 10 = 6 pairs, 2 of them truncated (4, 10); 12 - (1 + 1 + 1 pad + 3 identical) = 6.
    Identical, counting row 2: 1 as text, 2 as ids before truncation (2, 6), 3 after (2, 5, 6).
    Kept lengths: chosen 5 5 6 3 3 4 -> sorted 3 3 4 5 5 6: min 3, mean 26/6, median (4+5)/2 = 4.5,
    p95 = rank ceil(5.7) = 6 -> 6, max 6; rejected 3 3 6 3 4 6 -> sorted 3 3 3 4 6 6: min 3,
    mean 25/6, median 3.5, p95 6, max 6. Chosen longer in rows 0 1, ties 4 8, rejected longer 9 10: 1/3 each.
    """
    tokenised, counts, audit = run_audit(tokenizer)
    assert audit["pairs_in"] == 12 and audit["pairs_out"] == 6 == len(tokenised)
    assert audit["dropped"] == {
        "malformed": 1, "empty": 1, "no_answer": 0, "other_format": 0, "too_long": 0, "pad_in_text": 1, "identical": 3, "duplicate": 0
    }
    assert audit["truncated"] == 2
    assert (audit["identical_text"], audit["identical_before_truncation"], audit["identical_after_truncation"]) == (1, 2, 3)
    assert audit["duplicates"] == 1
    assert audit["unk_rate"] == pytest.approx(2 / 90)  # "zebra" and "unicorn" among the 9 pairs' 45 + 45 tokens
    assert audit["empty_sides"] == {"chosen": 1, "rejected": 0}
    assert audit["lengths"]["chosen"]["before_truncation"] == {"min": 3, "mean": 5.0, "median": 4.0, "p95": 9, "max": 9}
    assert audit["lengths"]["rejected"]["before_truncation"] == {"min": 3, "mean": 5.0, "median": 3.0, "p95": 9, "max": 9}
    assert audit["lengths"]["chosen"]["kept"] == {"min": 3, "mean": pytest.approx(26 / 6), "median": 4.5, "p95": 6, "max": 6}
    assert audit["lengths"]["rejected"]["kept"] == {"min": 3, "mean": pytest.approx(25 / 6), "median": 3.5, "p95": 6, "max": 6}
    assert audit["longer"] == {"chosen": pytest.approx(1 / 3), "tie": pytest.approx(1 / 3), "rejected": pytest.approx(1 / 3)}
    # The kept pairs are rows 0 1 4 8 9 10, in order; row 4 lost "red blue" on each side.
    ids = tokenizer.convert_tokens_to_ids
    assert tokenised[2]["chosen_input_ids"] == ids(["<s>", "yellow", "purple", "orange", "cat", "</s>"])
    assert tokenised[5]["rejected_input_ids"] == ids(["<s>", "green", "yellow", "purple", "dog", "</s>"])
    json.dumps(audit)  # JSON-able as it is
    assert counts.format().startswith(
        "pairs 12 -> 6 used: 2 truncated, 3 identical, 1 with pad token in text skipped, 1 malformed skipped, "
        "1 empty skipped, 1 duplicates kept (tokens before truncation: chosen mean 5.0 median 4 p95 9 max 9"
    )


def test_audit_keep_identical_drop_duplicates(tokenizer):
    """identical pairs kept, duplicates dropped.

    Row 2 now reaches tokenize_pairs (10 pairs). Nothing is dropped as identical; the identical
    counts are the same as with the default policies (1 as text, 2 before truncation, 3 after),
    now all from tokenize_pairs. Row 1 is dropped as a duplicate of row 0; row 11 for the pad id.
    Kept: 12 - (1 malformed + 1 empty + 1 pad + 1 duplicate) = 8 (rows 0 2 4 5 6 8 9 10), 3 truncated (4 5 10).
    Kept lengths: chosen 5 3 6 6 3 3 3 4, rejected 3 3 6 6 3 3 4 6; chosen longer in row 0 (1/8),
    ties in 2 4 5 6 8 (5/8), rejected longer in 9 10 (2/8).
    """
    tokenised, _, audit = run_audit(tokenizer, identical="keep", duplicates="drop")
    assert audit["pairs_out"] == 8 == len(tokenised)
    assert audit["dropped"] == {
        "malformed": 1, "empty": 1, "no_answer": 0, "other_format": 0, "too_long": 0, "pad_in_text": 1, "identical": 0, "duplicate": 1
    }
    assert audit["truncated"] == 3
    assert (audit["identical_text"], audit["identical_before_truncation"], audit["identical_after_truncation"]) == (1, 2, 3)
    assert audit["duplicates"] == 1
    assert pair_lengths(tokenised) == ([5, 3, 6, 6, 3, 3, 3, 4], [3, 3, 6, 6, 3, 3, 4, 6])
    assert audit["longer"] == {"chosen": 1 / 8, "tie": 5 / 8, "rejected": 2 / 8}


def test_audit_drop_long_pairs(tokenizer):
    """truncation=drop: rows 4, 5 and 10 have a side over 6 tokens and go.

    Left after normalisation: rows 0 1 4 5 6 8 9 10 11 (9); minus 3 too long, 1 pad (11) and 1 identical
    (row 6; row 5 never reaches the identity check) = 4 kept (0 1 8 9), none truncated. Identical:
    1 as text (row 2), 2 before truncation (2, 6), 2 after (2, 6). Lengths before truncation are those
    of the default test: they describe every pair that was tokenised.
    """
    _, _, audit = run_audit(tokenizer, truncation="drop")
    assert audit["pairs_out"] == 4 and audit["truncated"] == 0
    assert audit["dropped"] == {
        "malformed": 1, "empty": 1, "no_answer": 0, "other_format": 0, "too_long": 3, "pad_in_text": 1, "identical": 2, "duplicate": 0
    }
    assert (audit["identical_text"], audit["identical_before_truncation"], audit["identical_after_truncation"]) == (1, 2, 2)
    assert audit["lengths"]["chosen"]["before_truncation"]["max"] == 9
    assert audit["lengths"]["chosen"]["kept"] == {"min": 3, "mean": 4.0, "median": 4.0, "p95": 5, "max": 5}


def test_truncation_error_names_the_row_as_read(tokenizer):
    # Rows 2 and 3 are gone before tokenising, so the pair is the third one tokenize_pairs sees;
    # the error still names row 4, its index in the data as read.
    with pytest.raises(ValueError, match=r"^row 4: 'chosen' is 9 tokens \(special tokens included\), more than max_length=6"):
        run_audit(tokenizer, truncation="error")


def test_length_stats_by_hand():
    # 1..20 once each: mean 10.5, median (10 + 11) / 2, p95 = the 19th value (ceil(0.95 * 20) = 19).
    assert length_stats({n: 1 for n in range(1, 21)}) == {"min": 1, "mean": 10.5, "median": 10.5, "p95": 19, "max": 20}
    # 99 sequences of 10 tokens and one of 500: p95 is 10, the max alone sees the outlier.
    assert length_stats({10: 99, 500: 1}) == {"min": 10, "mean": 14.9, "median": 10.0, "p95": 10, "max": 500}
    assert length_stats({}) == {"min": 0, "mean": 0.0, "median": 0.0, "p95": 0, "max": 0}
    assert length_stats({7: 0, 4: 1}) == {"min": 4, "mean": 4.0, "median": 4.0, "p95": 4, "max": 4}


def test_audit_refuses_counts_that_lose_pairs(tokenizer):
    tokenised, counts, _ = run_audit(tokenizer)
    counts.rows += 1  # a row read that was neither kept nor dropped
    with pytest.raises(ValueError, match="do not account for every pair"):
        audit_split(counts, *pair_lengths(tokenised))


def test_format_and_write_audit(tokenizer, tmp_path):
    _, _, split = run_audit(tokenizer)
    audit = {"data": "crafted", "policies": {"truncation": "truncate", "identical_pairs": "drop"}, "splits": {"train": split}}
    line = format_audit(audit)
    assert line.startswith(
        "data audit (crafted; data.truncation=truncate, data.identical_pairs=drop): train: 12 pairs -> 6 kept "
        "(dropped: 1 malformed, 1 empty, 1 pad in text, 3 identical); 2 truncated; identical sides: 1 as text, "
        "2 as ids before truncation, 3 after (0 kept); 1 duplicates (1 kept); empty sides: chosen 1, rejected 0; "
        "tokens min/median/p95/max of kept pairs: chosen 3/4.5/6/6 (before truncation max 9), "
        "rejected 3/3.5/6/6 (before truncation max 9); chosen longer in 33.3% of kept pairs, ties 33.3%"
    ), line
    path = tmp_path / "data_audit.json"
    write_audit(path, audit)
    assert json.loads(path.read_text()) == json.loads(json.dumps(audit))
    assert [p.name for p in tmp_path.iterdir()] == ["data_audit.json"]  # no temporary file left behind


# --------------------------------------------------------------------------- #
# End to end: data=local through rm.train.train, data_audit.json in the run directory
# --------------------------------------------------------------------------- #

E2E_MAX_LENGTH = 48


def short_pairs(tokenizer, n, split):
    """The first ``n`` synthetic pairs whose sides fit in E2E_MAX_LENGTH tokens, so that only the crafted rows
    below are truncated, identical, duplicated or empty."""
    pairs = [
        p for p in generate_pairs(4 * n, seed=0, split=split)
        if all(len(encode_texts(tokenizer, [p[s]])[0]) <= E2E_MAX_LENGTH for s in ("chosen", "rejected"))
    ][:n]
    assert len(pairs) == n and len({(p["chosen"], p["rejected"]) for p in pairs}) == n
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    return pairs


@pytest.fixture
def local_files(tmp_path, tokenizer):
    """train.jsonl: 20 clean pairs, then an identical pair (row 20), a duplicate of row 1 (21), an empty
    chosen side (22) and a pair whose chosen side is 7 + 60 + 3 = 70 words with the run's word-level tokenizer
    (row 23: "Human : Please repeat these words :", 60 colours, "Assistant : red"; the rejected side ends in
    "blue"), 72 tokens with its <s> and the appended </s> (the fixture's post-processor writes both).
    eval.jsonl: 10 clean pairs and an identical one (row 10)."""
    train, evaluation = short_pairs(tokenizer, 20, "train"), short_pairs(tokenizer, 10, "test")
    colours = " ".join(["red", "blue", "green"] * 20)
    long_prompt = f"\n\nHuman: Please repeat these words : {colours}\n\nAssistant:"
    train += [
        {"chosen": train[0]["chosen"], "rejected": train[0]["chosen"]},
        dict(train[1]),
        {"chosen": "", "rejected": train[2]["rejected"]},
        {"chosen": f"{long_prompt} red", "rejected": f"{long_prompt} blue"},
    ]
    assert len(encode_texts(tokenizer, [train[23]["chosen"]], append_eos=False)[0]) == 72
    evaluation += [{"chosen": evaluation[0]["rejected"], "rejected": evaluation[0]["rejected"]}]
    paths = {}
    for name, rows in (("train", train), ("eval", evaluation)):
        paths[name] = tmp_path / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def local_run(tiny_cfg, files, *overrides):
    return tiny_cfg(
        "data=local", f"data.train_files=[{files['train']}]", f"data.eval_files=[{files['eval']}]",
        f"data.max_length={E2E_MAX_LENGTH}", "train.max_steps=2", "train.logging.eval_steps=0",
        "model.tokenizer=words",  # the hand-counted token numbers above are the word-level tokenizer's
        *overrides,
    )


def test_run_writes_the_audit_with_default_policies(tiny_cfg, local_files, tmp_path, caplog):
    """truncate / identical pairs dropped / duplicates kept.

    train: 24 rows; row 22 dropped (empty chosen), row 20 dropped (identical texts); row 21 kept and
    counted as a duplicate; row 23 truncated to 48 tokens and kept: 22 pairs. eval: 11 -> 10.
    """
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="rm.train"):
        result = rm_train.train(local_run(tiny_cfg, local_files), run_dir)
    assert result["status"] == "ok"
    audit = json.loads((run_dir / "data_audit.json").read_text())
    assert audit["policies"] == {"append_eos": True, "max_length": 48, "truncation": "truncate", "identical_pairs": "drop",
                                 "duplicates": "keep", "on_malformed": "skip"}
    train = audit["splits"]["train"]
    assert (train["pairs_in"], train["pairs_out"], train["truncated"], train["duplicates"]) == (24, 22, 1, 1)
    assert train["dropped"] == {"malformed": 0, "empty": 1, "no_answer": 0, "other_format": 0, "too_long": 0, "pad_in_text": 0, "identical": 1, "duplicate": 0}
    assert train["empty_sides"] == {"chosen": 1, "rejected": 0}
    assert train["identical_text"] == train["identical_after_truncation"] == 1
    assert train["lengths"]["chosen"]["before_truncation"]["max"] == 72  # 70 words, the BOS and the appended EOS
    assert train["lengths"]["chosen"]["kept"]["max"] == 48
    evaluation = audit["splits"]["eval"]
    assert (evaluation["pairs_in"], evaluation["pairs_out"], evaluation["dropped"]["identical"]) == (11, 10, 1)
    assert result["eval_pairs"] == 10
    assert "data audit (local; data.max_length=48, data.truncation=truncate" in caplog.text
    assert "train: 24 pairs -> 22 kept (dropped: 1 empty, 1 identical)" in caplog.text


@pytest.mark.reliability("Data", "identical pairs, duplicates, enormous rows", "per `data.identical_pairs`, `data.duplicates`, `data.truncation`; all counted in `data_audit.json`")
def test_run_keeps_identical_pairs_and_drops_duplicates_and_long_pairs(tiny_cfg, local_files, tmp_path):
    """truncation=drop, identical_pairs=keep, duplicates=drop.

    train: 24 rows - row 22 (empty) - row 21 (duplicate of row 1) - row 23 (too long) = 21, the identical
    row 20 among them; eval keeps its identical pair: 11.
    """
    run_dir = tmp_path / "run"
    cfg = local_run(tiny_cfg, local_files, "data.truncation=drop", "data.identical_pairs=keep", "data.duplicates=drop")
    result = rm_train.train(cfg, run_dir)
    assert result["status"] == "ok" and result["eval_pairs"] == 11
    audit = json.loads((run_dir / "data_audit.json").read_text())
    train = audit["splits"]["train"]
    assert (train["pairs_in"], train["pairs_out"], train["truncated"], train["duplicates"]) == (24, 21, 0, 1)
    assert train["dropped"] == {"malformed": 0, "empty": 1, "no_answer": 0, "other_format": 0, "too_long": 1, "pad_in_text": 0, "identical": 0, "duplicate": 1}
    assert train["identical_text"] == train["identical_after_truncation"] == 1
    assert train["lengths"]["chosen"]["kept"]["max"] <= E2E_MAX_LENGTH
    assert audit["splits"]["eval"]["pairs_out"] == 11


@pytest.mark.reliability("Data", "an over-long row with `data.truncation=error`", "an error naming the row and its length, before anything is written")
def test_truncation_error_stops_before_anything_is_written(tiny_cfg, local_files, tmp_path):
    # Row 22 is dropped (empty) before tokenising; the error still names row 23 of the file.
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError) as err:
        rm_train.train(local_run(tiny_cfg, local_files, "data.truncation=error"), run_dir)
    assert str(err.value).startswith(
        f"data local [train] in {local_files['train']}: row 23: 'chosen' is 72 tokens (special tokens included), "
        "more than max_length=48"
    )
    left = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    assert not {"data_audit.json", "data_audit.json.tmp", "metrics.jsonl", "final", "checkpoints"} & set(left), left


def test_invalid_policy_is_refused_naming_the_key(tiny_cfg, local_files, tmp_path):
    with pytest.raises(ConfigError, match="data.duplicates='skip' is not one of keep, drop"):
        rm_train.train(local_run(tiny_cfg, local_files, "data.duplicates=skip"), tmp_path / "run")
