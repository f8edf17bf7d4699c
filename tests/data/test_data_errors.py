"""Data errors name the file, the row and the reason; drops are counted by reason (rm.data)."""

import json

import pytest

from rm.data.build import build_split, train_pairs

from rm.data.tokenizer import run_tokenizer
from rm.data.counts import Drop
from rm.foundations.errors import DataError
from rm.foundations.config import compose
from rm.data.synthetic import generate_pairs


def _split(path, *extra):
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{path}]", *extra])
    return build_split(cfg.data, run_tokenizer(cfg.model, train_pairs(cfg.data)), "train")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PAIRS = generate_pairs(8, seed=0, split="train")
GOOD = PAIRS[0]


@pytest.mark.reliability("Data", "a `.parquet` file that is really CSV", "`<file> is not a Parquet file (no PAR1 magic bytes ...)`")
def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "pairs.parquet"
    path.write_text("chosen,rejected\na,b\n")
    with pytest.raises(DataError, match=rf"{path} is not a Parquet file"):
        _split(path)


@pytest.mark.reliability("Data", "a directory given as a data file (`data.train_files=[pairs/]`, `rm.score --input pairs/`)",
                         "`data.train_files: '<dir>' is a directory: name the files in it ('<dir>/*.jsonl')`; beside "
                         "a missing file both are named; exit 2 (was: `no file matches '<dir>'`, though it exists)")
def test_a_directory_given_as_a_data_file_is_said_to_be_one(tmp_path):
    from rm.data.build import check_data_files
    from rm.data.load import expand_files

    folder = tmp_path / "pairs"
    folder.mkdir()
    with pytest.raises(DataError, match=rf"--input: '{folder}' is a directory: name the files in it \('{folder}/\*.jsonl'\)"):
        expand_files([str(folder)], "--input")
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{folder},{tmp_path / 'gone.jsonl'}]"])
    with pytest.raises(DataError) as err:
        check_data_files(cfg.data)
    assert f"data.train_files: no file matches '{tmp_path / 'gone.jsonl'}'; '{folder}' is a directory" in str(err.value)


@pytest.mark.reliability("Data", "an eval file that is also a training file (`data.eval_files`, `data.extra_eval_files.<name>`; "
                         "the same path, or a glob or link reaching it)",
                         "a warning naming the key and the file: `its metrics score pairs the model trained on, not "
                         "held-out ones`; the run goes on (was: silent, the eval accuracy read as generalisation)")
def test_an_eval_file_that_is_a_training_file_is_warned_about(tmp_path, caplog):
    from rm.data.build import check_data_files

    train = _jsonl(tmp_path / "train.jsonl", [GOOD])
    held_out = _jsonl(tmp_path / "test.jsonl", [GOOD])
    (tmp_path / "link.jsonl").symlink_to(train)
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{train}]", f"data.eval_files=[{tmp_path}/t*.jsonl]",
                   f"+data.extra_eval_files.hard=[{tmp_path / 'link.jsonl'}]"])
    with caplog.at_level("WARNING"):
        check_data_files(cfg.data)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"data.eval_files reads {train}, also in data.train_files") for m in said), said
    assert any(m.startswith(f"data.extra_eval_files.hard reads {tmp_path / 'link.jsonl'}") for m in said), said
    assert not any(str(held_out) in m for m in said) and len(said) == 2, said


@pytest.mark.reliability("Data", "a `.json` file that is one object of columns (`{\"chosen\": [...], \"rejected\": [...]}`, or "
                         "pandas' default `to_json`: `{\"chosen\": {\"0\": ...}}`)",
                         "`<file> is one JSON object of columns (chosen, rejected: N values each), not rows`, with how to "
                         "write rows; exit 2 (was: its columns read as one conversation, `'chosen' message 0 is str`, or "
                         "'cannot detect the preference format'). One pair as one object is still one row")
def test_a_json_object_of_columns_is_named_as_such(tmp_path):
    from rm.data.load import load_preference_split

    pairs = PAIRS[:3]
    as_lists = tmp_path / "lists.json"
    as_lists.write_text(json.dumps({k: [p[k] for p in pairs] for k in ("chosen", "rejected")}))
    by_index = tmp_path / "pandas.json"
    by_index.write_text(json.dumps({k: {str(i): p[k] for i, p in enumerate(pairs)} for k in ("chosen", "rejected")}))
    for path in (as_lists, by_index):
        with pytest.raises(DataError, match=rf"{path} is one JSON object of columns \(chosen, rejected: 3 values each\), not rows"):
            _split(path)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(GOOD))
    assert len(load_preference_split("local", files=[str(one)])) == 1


@pytest.mark.reliability("Data", "empty (0 bytes) and whitespace-only files", "`<file> is empty (0 bytes)` / `<file> is whitespace only`, each its own message")
def test_empty_and_whitespace_files_have_their_own_message(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text(" \n\t\n")
    with pytest.raises(DataError, match=r"empty.jsonl is empty \(0 bytes\)"):
        _split(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match=r"blank.jsonl is whitespace only"):
        _split(tmp_path / "blank.jsonl")


@pytest.mark.reliability("Data", "one non-string cell in a file (the column's type is then mixed)",
                         "format still detected from the other rows; that row is dropped and counted with its reason "
                         "(`malformed: 'chosen' is int, expected a string`, first row), or with `data.on_malformed=error` "
                         "`in <file>: row 3: 'chosen' is int`")
def test_one_non_string_cell_names_its_row_and_file(tmp_path):
    path = _jsonl(tmp_path / "b.jsonl", PAIRS[2:5] + [dict(PAIRS[5], chosen=7), PAIRS[6]])
    ds, counts = _split(path)
    assert len(ds) == 4 and counts.dropped[Drop.MALFORMED] == 1
    assert counts.drop_reasons == {"malformed: 'chosen' is int, expected a string": {"count": 1, "first_row": 3}}
    with pytest.raises(DataError, match=rf"in {path}: row 3: 'chosen' is int, expected a string"):
        _split(path, "data.on_malformed=error")


@pytest.mark.reliability("Data", "a bad row in the second of several files (`data.on_malformed=error`)",
                         "`in <second file> row <its row in that file>: 'chosen' is empty`; a row too long for "
                         "`data.truncation=error` alike")
def test_a_bad_row_is_located_in_its_own_file(tmp_path):
    first = _jsonl(tmp_path / "a.jsonl", PAIRS[:2])
    second = _jsonl(tmp_path / "b.jsonl", PAIRS[2:4] + [dict(PAIRS[4], chosen=""), PAIRS[5]])
    with pytest.raises(DataError, match=rf"in {second} row 2: 'chosen' is empty") as err:
        _split(f"{first},{second}", "data.on_malformed=error")
    assert "row 4" not in str(err.value)  # the row in the split, which no file has
    long = _jsonl(tmp_path / "c.jsonl", PAIRS[2:3] + [dict(PAIRS[4], chosen=" ".join(str(i) for i in range(600)))])
    with pytest.raises(DataError, match=rf"in {long} row 1: 'chosen' is \d+ tokens") as err:  # found by the tokeniser
        _split(f"{first},{long}", "data.truncation=error")
    assert "row 3" not in str(err.value)


@pytest.mark.reliability("Data", "files of different layouts in one split (an hh file and a prompt file)",
                         "each file's rows are read as that file's own layout and the pairs joined in order; a bad row "
                         "is named by its file and its row there (`in <file> row <n>: ...`), drops in the log as "
                         "`first: <file> row <n>`")
def test_files_of_different_layouts_share_a_split(tmp_path, caplog):
    hh = _jsonl(tmp_path / "hh.jsonl", PAIRS[:3])
    prompts = [{"prompt": f"\n\nHuman: q{i}", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(4)]
    prompt = _jsonl(tmp_path / "prompt.jsonl", prompts[:2] + [dict(prompts[2], rejected=5), prompts[3]])
    ds, counts = _split(f"{hh},{prompt}")
    assert counts.rows == 7 and len(ds) == 6 and counts.dropped[Drop.MALFORMED] == 1
    # the prompt file's rows keep their prompt: prompt + chosen
    texts = build_texts(f"{hh},{prompt}")
    assert "\n\nHuman: q3 yes 3" in texts and texts[0] == PAIRS[0]["chosen"]
    assert counts.drop_reasons == {"malformed: 'rejected' is int, expected a string": {"count": 1, "first_row": 5}}
    assert f"first: {prompt} row 2" in caplog.text
    with pytest.raises(DataError, match=rf"in {prompt} row 2: 'rejected' is int") as err:
        _split(f"{hh},{prompt}", "data.on_malformed=error")
    assert "CastError" not in str(err.value)


def build_texts(files):
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{files}]"])
    return train_pairs(cfg.data)(None)["chosen"]


@pytest.mark.reliability("Data", "a file of mostly hh rows with some prompt/chosen/rejected rows",
                         "each row's own layout decides: the prompt rows are `other_format` under the hh majority "
                         "(`100 -> 70`, never trained as transcripts without their prompt); `data.format=hh` alike")
def test_prompt_rows_among_hh_rows_are_other_format(tmp_path):
    from rm.data.audit import audit_split
    from rm.data.tokenise import pair_lengths

    hh = [{"chosen": f"\n\nHuman: q{i}\n\nAssistant: good {i}", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad {i}"}
          for i in range(7)]
    prompts = [{"prompt": f"Question {i}? ", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(3)]
    path = _jsonl(tmp_path / "mostly_hh.jsonl", hh + prompts)
    for extra in ((), ("data.format=hh",)):
        ds, counts = _split(path, *extra)
        audit = audit_split(counts, *pair_lengths(ds))
        assert audit["pairs_in"] == 10 and audit["pairs_out"] == 7 and audit["dropped"]["other_format"] == 3
        assert sum(audit["dropped"].values()) + audit["pairs_out"] == audit["pairs_in"]
    with pytest.raises(DataError, match="the rows mix preference formats"):
        _split(path, "data.on_malformed=error")


@pytest.mark.reliability("Data", "a file mixing formats (hh, prompt, messages rows)",
                         "`data.on_malformed=error`: `the rows mix preference formats: 1 row(s) hh (first: row 0), 2 row(s) "
                         "prompt (first: row 1) ...`, naming the file; `skip` (default): the format of most rows is the "
                         "split's, the others dropped as `other_format` with their counts and first rows (a tie is an error)")
def test_mixed_formats_in_one_file_are_reported_as_such(tmp_path, caplog):
    from rm.data.audit import audit_split
    from rm.data.tokenise import pair_lengths

    hh, messages = GOOD, {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
                          "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}]}
    prompts = [{"prompt": "\n\nHuman: hi", "chosen": " yes", "rejected": " no"},
               {"prompt": "\n\nHuman: ho", "chosen": " yes", "rejected": " no"}]
    path = _jsonl(tmp_path / "mixed.jsonl", [hh, *prompts, messages])
    with pytest.raises(DataError) as err:
        _split(path, "data.on_malformed=error")
    message = str(err.value)
    assert "the rows mix preference formats" in message and str(path) in message
    assert "1 row(s) hh (first: row 0)" in message and "2 row(s) prompt (first: row 1)" in message
    assert "1 row(s) messages (first: row 3)" in message

    ds, counts = _split(path)  # data.on_malformed=skip: the prompt rows are the split, named in the log
    assert "the rows mix preference formats" in caplog.text and "the split is 'prompt'" in caplog.text
    audit = audit_split(counts, *pair_lengths(ds))
    assert audit["pairs_out"] == 2 and audit["dropped"]["other_format"] == 2 and audit["dropped"]["malformed"] == 0
    assert audit["drop_reasons"] == {
        "other_format: a 'hh' row in a split of format 'prompt'": {"count": 1, "first_row": 0},
        "other_format: a 'messages' row in a split of format 'prompt'": {"count": 1, "first_row": 3},
    }
    with pytest.raises(DataError, match="no format has most rows"):  # one of each: nothing says which was meant
        _split(_jsonl(tmp_path / "tie.jsonl", [prompts[0], messages]))
    # an explicit format names a valid row of another layout as such, not as malformed
    ds, counts = _split(_jsonl(tmp_path / "explicit.jsonl", [*prompts, messages]), "data.format=prompt")
    assert len(ds) == 2 and counts.dropped[Drop.OTHER_FORMAT] == 1 and counts.dropped[Drop.MALFORMED] == 0
    with pytest.raises(DataError, match=r"row 2: a 'messages' row in a split of format 'prompt'"):
        _split(tmp_path / "explicit.jsonl", "data.format=prompt", "data.on_malformed=error")


@pytest.mark.reliability("Data", "rows dropped as malformed or empty", "counted by reason, with the first row of each, in "
                         "`data_audit.json` (`drop_reasons`) and the log")
def test_drop_reasons_reach_the_audit(tmp_path):
    from rm.data.audit import audit_split
    from rm.data.tokenise import pair_lengths

    rows = [PAIRS[0], dict(PAIRS[1], chosen="  "), dict(PAIRS[2], rejected=""), dict(PAIRS[3], chosen=3), PAIRS[4]]
    ds, counts = _split(_jsonl(tmp_path / "p.jsonl", rows))
    audit = audit_split(counts, *pair_lengths(ds))
    assert audit["drop_reasons"] == {
        "empty: 'chosen' is whitespace only": {"count": 1, "first_row": 1},
        "empty: 'rejected' is empty": {"count": 1, "first_row": 2},
        "malformed: 'chosen' is int, expected a string": {"count": 1, "first_row": 3},
    }
    assert audit["dropped"]["malformed"] == 1 and audit["dropped"]["empty"] == 2 and audit["pairs_out"] == 2
