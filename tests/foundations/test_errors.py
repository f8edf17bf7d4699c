"""The error boundary of the entry points (rm.foundations.errors): one message naming what is wrong, the documented exit
code, no traceback unless RM_DEBUG=1, and a traceback with a bug line for anything unexpected."""

import errno
import os
import json
from pathlib import Path
import subprocess
import sys

import pytest

from rm.foundations.errors import BUG_LINE, ConfigError, DataError, NonFiniteError, Refused, StorageError, boundary, report
from tests.conftest import CONF_DIR, FAST_TINY

ROOT = CONF_DIR.parent


def _raise(err):
    raise err


@pytest.mark.reliability("Entry points", "any expected failure (config, data, refusal, non-finite, storage)",
                         "`error: <message>` only; exit 2, 2, 3, 4, 5")
@pytest.mark.reliability("Entry points", "an `OSError`, a safetensors error or torch.save's failed write from anywhere (disk full, permissions)",
                         "`error: storage error (<path>): <reason>`; exit 5")
def test_expected_errors_print_one_message_and_their_exit_code(capsys, monkeypatch):
    from safetensors import SafetensorError

    monkeypatch.delenv("RM_DEBUG", raising=False)
    cases = [
        (ConfigError("train.seed=-1 must be in [0, 4294967295]"), 2),
        (DataError("data.train_files: a.jsonl is empty"), 2),
        (Refused("run dir is in use by another run (pid 7)"), 3),
        (NonFiniteError("loss is nan at step 3"), 4),
        (StorageError("could not write checkpoint-4"), 5),
        (OSError(errno.ENOSPC, "No space left on device", "/run/final/model.safetensors"), 5),
        (SafetensorError("Error while serializing: IoError(No space left on device)"), 5),
        # What torch.save raised on a real full disk (a 5 MB tmpfs): a RuntimeError from its zip writer.
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1316672 vs 1316560"), 5),
    ]
    for err, code in cases:
        with pytest.raises(SystemExit) as exited, boundary():
            _raise(err)
        assert exited.value.code == code, err
        out = capsys.readouterr().err
        assert out.startswith("error: ") and "Traceback" not in out, out
    assert "storage error (/run/final/model.safetensors): No space left on device" in _last_message(capsys, cases[5][0])


@pytest.mark.reliability("Faults", "disk full while the run's tokenizer is saved at start-up (tokenizers raises a bare "
                         "`Exception: No space left on device (os error 28)`)",
                         "exit 5 naming the tokenizer directory, which is removed (no partial `tokenizer.json`); "
                         "not reported as a bug")
def test_a_full_disk_while_the_tokenizer_is_saved_is_a_storage_error(tmp_path, capsys, monkeypatch):
    from rm.data.tokenizer import save_tokenizer

    monkeypatch.delenv("RM_DEBUG", raising=False)

    class FullDisk:
        def save_pretrained(self, directory):
            Path(directory).mkdir(parents=True)
            (Path(directory) / "tokenizer.json").write_text('{"version": "1.0", "trunc')  # cut short
            raise Exception("No space left on device (os error 28)")

    with pytest.raises(SystemExit) as exited, boundary():
        save_tokenizer(FullDisk(), tmp_path / "tokenizer")
    out = capsys.readouterr().err
    assert exited.value.code == 5 and f"could not save the run's tokenizer to {tmp_path / 'tokenizer'}" in out, out
    assert "os error 28" in out and "Traceback" not in out and not (tmp_path / "tokenizer").exists()


def _last_message(capsys, err):
    report(err)
    return capsys.readouterr().err


@pytest.mark.reliability("Entry points", "an unexpected exception (a bug)",
                         "its traceback, then a line saying it is a bug to report; exit 1")
@pytest.mark.reliability("Entry points", "`RM_DEBUG=1`", "expected errors also print their traceback")
def test_a_bug_keeps_its_traceback_and_rm_debug_shows_every_traceback(capsys, monkeypatch):
    monkeypatch.delenv("RM_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited, boundary():
        _raise(ZeroDivisionError("division by zero"))
    out = capsys.readouterr().err
    assert exited.value.code == 1 and "Traceback" in out and "ZeroDivisionError" in out and BUG_LINE in out
    monkeypatch.setenv("RM_DEBUG", "1")
    with pytest.raises(SystemExit) as exited, boundary():
        _raise(ConfigError("train.seed=-1"))
    out = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" in out and "error: train.seed=-1" in out and BUG_LINE not in out


@pytest.mark.reliability("Entry points", "an unexpected exception inside `python -m rm.train` (under Hydra)",
                         "its traceback, then the line saying it is a bug to report; exit 1 (not "
                         "Hydra's own report)")
def test_a_bug_in_the_train_cli_shows_its_traceback_and_the_bug_line(tmp_path):
    code = (  # a bug planted where rm.train calls it, then run as `python -m rm.train` runs it
        "import runpy\n"
        "import rm.data.tokenizer\n"
        "def build_tokenizer(*args, **kwargs):\n"
        "    return 1 / 0\n"
        "rm.data.tokenizer.build_tokenizer = build_tokenizer\n"
        "runpy.run_module('rm.train', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *FAST_TINY, "train.max_steps=2", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "RM_DEBUG": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" in out and "ZeroDivisionError: division by zero" in out and BUG_LINE in out, out[-3000:]
    assert "Set the environment variable HYDRA_FULL_ERROR" not in out  # the boundary, not Hydra, reported it


def _run(module, *args, timeout=300, env=None):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)
    return proc.returncode, proc.stdout + proc.stderr


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.reliability("Data", "missing file or glob matching nothing",
                         "`data.train_files: no file matches '<pattern>'`; exit 2")
@pytest.mark.reliability("Data", "a file where every row is dropped (zero usable pairs)",
                         "`no usable pairs left (pairs 2 -> 0 used: ...; 1 x malformed: 'chosen' is int, expected a string (first: row 0 in <file>); 1 x empty: ...)`; exit 2")
@pytest.mark.reliability("Data", "an empty or whitespace-only file", "`<file> is empty (0 bytes)` / `is whitespace only`; exit 2")
@pytest.mark.reliability("Data", "fewer usable pairs than one optimizer step takes (a 5-row file, `train.global_batch_size=16`)",
                         "`data local [train]: 5 usable pair(s), fewer than one optimizer step takes "
                         "(train.global_batch_size=16) ... set train.micro_batch_size=5 train.global_batch_size=5`, sizes that fit "
                         "(was: `at most 5`, which no multiple of the micro-batch of 8 is); exit 2 (was: a "
                         "`ValueError` traceback from the layout's timing, exit 1)")
@pytest.mark.parametrize("case", ["missing", "all_dropped", "whitespace", "too_few"])
def test_train_cli_data_errors_exit_2_without_traceback(tmp_path, case):
    if case == "missing":
        files, needles = [str(tmp_path / "nope" / "*.jsonl")], ["data.train_files: no file matches", "nope"]
    elif case == "all_dropped":
        path = _write(tmp_path / "bad.jsonl", [{"chosen": 1, "rejected": "a"}, {"chosen": " ", "rejected": "b"}])
        files, needles = [str(path)], ["no usable pairs left", "'chosen' is int", f"(first: row 0 in {path})"]
    elif case == "too_few":
        path = _write(tmp_path / "few.jsonl", [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": " no"} for i in range(5)])
        files, needles = [str(path)], ["5 usable pair(s), fewer than one optimizer step takes (train.global_batch_size=16)",
                                       "set train.micro_batch_size=5 train.global_batch_size=5"]
    else:
        path = tmp_path / "blank.jsonl"
        path.write_text("  \n\n")
        files, needles = [str(path)], [f"{path} is whitespace only"]
    code, out = _run("rm.train", *FAST_TINY, "data=local", f"data.train_files=[{','.join(files)}]",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2, out[-3000:]
    assert "Traceback" not in out
    for needle in needles:
        assert needle in out, (needle, out[-3000:])


@pytest.mark.reliability("Entry points", "`rm.estimate` with an invalid key (`train.optim.adam_beta1=1.5`)",
                         "`train.optim.adam_beta1=1.5 must be in [0, 1)`; exit 2")
def test_estimate_cli_config_error_exits_2(tmp_path):
    code, out = _run("rm.estimate", "experiment=tiny", "train.optim.adam_beta1=1.5", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "train.optim.adam_beta1=1.5 must be in [0, 1)" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.reliability("Entry points", "`rm.estimate`, `rm.gpu_report`: a key Hydra cannot compose (unknown key, "
                         "wrong type, override syntax)", "the unknown key named with its close matches, or Hydra's message "
                         "and a line quoting the command line; exit 2, no `Traceback`, no `outputs/` folder")
@pytest.mark.parametrize("module", ["rm.estimate", "rm.gpu_report"])
@pytest.mark.parametrize("override,needle", [("train.micro_batch=4", "train.micro_batch"),
                                             ("train.micro_batch_size=abc", "abc"), ("train.x=[", "train.x=[")])
def test_printing_clis_exit_2_on_what_hydra_cannot_compose(tmp_path, module, override, needle):
    proc = subprocess.run([sys.executable, "-m", module, "experiment=tiny", override], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    said = ("unknown name(s) on the command line" if override == "train.micro_batch=4"  # rm.foundations.config.unknown_names
            else f"could not be composed from the command line: experiment=tiny {override}")
    assert said in out and needle in out
    assert "Traceback" not in out and not any(tmp_path.iterdir())


@pytest.mark.reliability("Entry points", "`rm.gpu_report` with an invalid key (`train.optim.adam_beta1=1.5`)",
                         "each profile's line says why it cannot run, then `no memory profile can run this config` "
                         "naming the key; exit 2")
@pytest.mark.slow  # rm.gpu_report estimates every profile before it answers
def test_gpu_report_config_error_exits_2(tmp_path):
    code, out = _run("rm.gpu_report", "experiment=tiny", "train.optim.adam_beta1=1.5", f"hydra.run.dir={tmp_path}")
    assert code == 2 and "no memory profile can run this config" in out and "train.optim.adam_beta1=1.5 must be in [0, 1)" in out
    assert "Traceback" not in out, out[-3000:]
    # one profile that cannot run (8-bit AdamW is not sharded by ZeRO) does not stop the report
    code, out = _run("rm.gpu_report", "experiment=tiny", "distributed=zero2", f"hydra.run.dir={tmp_path}")
    assert code == 0 and "8bit     cannot run here" in out and "full     peak" in out, out[-3000:]


@pytest.mark.reliability("Entry points", "`rm.export` of a directory that holds no bundle", "names the path and what is missing; exit 2")
def test_export_cli_without_a_bundle_exits_2(tmp_path):
    code, out = _run("rm.export", str(tmp_path))
    assert code == 2 and str(tmp_path) in out and "reward_probe.json" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.reliability("Entry points", "`RM_DEBUG=1 python -m rm.export` on a directory without a bundle",
                         "the same message and exit 2, with its traceback: rm.export ends in the shared error boundary")
@pytest.mark.slow
def test_export_cli_shows_the_traceback_under_rm_debug(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rm.export", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RM_DEBUG": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" in out and "ConfigError" in out and "reward_probe.json" in out, out[-3000:]


@pytest.mark.reliability("Entry points", "`rm.score` or `rm.export` on a truncated `model.safetensors`",
                         "exit 5 naming the file as damaged or cut short, and what to do; not 'check free space'")
def test_a_truncated_weights_file_is_named_as_damaged(tmp_path, tiny_model_dir):
    import shutil

    from rm.foundations.errors import StorageError
    from rm.modelling.bundle import load_bundle

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(StorageError, match="model.safetensors cannot be read back .* damaged or cut short"):
        load_bundle(model)  # what rm.export's verification and rm.score load through
    pairs = _write(tmp_path / "pairs.jsonl", [{"chosen": "Human: hi Assistant: yes", "rejected": "Human: hi Assistant: no"}])
    code, out = _run("rm.score", "--model", str(model), "--input", str(pairs))
    assert code == 5 and f"{weights} cannot be read back" in out and "free space" not in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.reliability("Faults", "`model.pretrained` a directory whose `model.safetensors` is cut short (an interrupted "
                         "download or copy)",
                         "exit 5 naming the file as damaged or cut short and `model.pretrained=<dir>`, the fix: copy or "
                         "download it again (was: `storage error: Error while deserializing header: invalid header "
                         "length`, no file named, and 'check free space')")
def test_a_truncated_pretrained_weights_file_is_named_with_its_key(tmp_path, tiny_model_dir):
    import shutil

    from rm.foundations.config import compose
    from rm.foundations.errors import StorageError
    from rm.modelling.model import build_model

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    cfg = compose(["experiment=tiny", f"model.pretrained={model}"])
    with pytest.raises(StorageError) as err:
        build_model(cfg.model, 0, "float32", False)
    assert f"{weights} cannot be read back" in str(err.value) and f"model.pretrained={model}" in str(err.value)
    assert "free space" not in str(err.value)


@pytest.mark.reliability("Faults", "`model.pretrained` or `model.tokenizer` a Hub id that cannot be fetched here (no "
                         "network, `HF_HUB_OFFLINE=1` without a cached copy, no such repository)",
                         "`model.tokenizer=<id> is not a local directory and could not be read from the Hugging Face Hub "
                         "here (<transformers' reason>): give the directory of a downloaded copy ...`; exit 5 (was: "
                         "transformers' text alone, no key named, and 'check free space and permissions'); "
                         "`model.pretrained`'s before the data pass, with a local `model.tokenizer` too (was: after it, "
                         "minutes on HH-RLHF)")
def test_a_hub_id_that_cannot_be_fetched_names_its_key(tmp_path):
    from rm.data.build import train_pairs
    from rm.data.tokenizer import run_tokenizer
    from rm.foundations.config import compose

    cfg = compose(["experiment=tiny"])
    run_tokenizer(cfg.model, train_pairs(cfg.data)).save_pretrained(tmp_path / "tokenizer")
    for key, extra in [("model.tokenizer", []), ("model.pretrained", []),  # the tokenizer of model.pretrained loads first
                       ("model.pretrained", [f"model.tokenizer={tmp_path / 'tokenizer'}"])]:
        code, out = _run("rm.train", *FAST_TINY, f"{key}=someorg/no-such-model", *extra,
                         f"hydra.run.dir={tmp_path / 'run'}", env={**os.environ, "HF_HUB_OFFLINE": "1"})
        said = f"{key}=someorg/no-such-model is not a local directory and could not be read from the Hugging Face Hub"
        assert code == 5 and said in out and "huggingface-cli download someorg/no-such-model" in out, out[-3000:]
        assert "free space" not in out and "Traceback" not in out, out[-3000:]
        assert "tokenising the pairs" not in out, out[-3000:]  # before the data pass


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny reward model (random weights): enough for rm.score's input handling."""
    from rm.foundations.config import compose
    from rm.data.build import train_pairs
    from rm.data.tokenizer import run_tokenizer
    from rm.modelling.model import build_model

    cfg = compose(["experiment=tiny"])
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    directory = tmp_path_factory.mktemp("model")
    build_model(cfg.model, tokenizer.pad_token_id, "float32", False).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.reliability("Entry points", "`rm.score`: missing model directory, a directory with no model, a run directory, "
                         "a file (`final/config.json`), `--max-length 0`, an empty input file, input with no usable pair",
                         "one message naming the argument or file (`--model <path>: no such directory`, `is a file: give the directory that holds it`, "
                         "`holds no model`, `give its final/`, `--max-length: 0 must be >= 1`, `is empty`, `no usable pairs`); exit 2")
@pytest.mark.parametrize("case", ["no_dir", "a_file", "no_model", "run_dir", "max_length", "empty_input", "no_pairs"])
def test_score_cli_bad_input_exits_2_naming_it(tmp_path, tiny_model_dir, case, capsys):
    good = _write(tmp_path / "pairs.jsonl", [{"chosen": "Human: hi Assistant: yes", "rejected": "Human: hi Assistant: no"}])
    model, inputs, extra, needle = str(tiny_model_dir), [str(good)], [], None
    if case == "no_dir":
        model, needle = str(tmp_path / "nope"), "no such directory"
    elif case == "a_file":
        model, needle = str(tiny_model_dir / "config.json"), f"is a file: give the directory that holds it (--model {tiny_model_dir})"
    elif case == "no_model":
        model, needle = str(tmp_path), "holds no model"
    elif case == "run_dir":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "final").symlink_to(tiny_model_dir)
        model, needle = str(tmp_path / "run"), "give its final/"
    elif case == "max_length":
        extra, needle = ["--max-length", "0"], "--max-length: 0 must be >= 1"
    elif case == "empty_input":
        (tmp_path / "empty.jsonl").write_text("")
        inputs, needle = [str(tmp_path / "empty.jsonl")], "empty.jsonl is empty"
    else:
        inputs, needle = [str(_write(tmp_path / "bad.jsonl", [{"chosen": "a", "rejected": "a"}]))], "no usable pairs"
    args = ["--model", model, "--input", *inputs, *extra]
    if case == "no_dir":  # once through a real process; the rest in this one (a process costs ~15 s of imports)
        code, out = _run("rm.score", *args)
    else:
        from rm.score import main

        with pytest.raises(SystemExit) as exited, boundary():
            sys.exit(main(args))
        code, out = exited.value.code, "".join(capsys.readouterr())
    assert code == 2, out[-3000:]
    assert needle in out and "Traceback" not in out, out[-3000:]


@pytest.mark.reliability("Data", "`rm.score` with one `--input` file: columns of no known layout, a malformed row under "
                         "`--on-malformed error`, no usable pair, an empty text",
                         "each message names the file, as with several files (`--input <file>: cannot detect the "
                         "preference format ...`, `--input <file> row 1: 'chosen' is int`, `--input <file>: no usable "
                         "pairs`, `--input <file> row 0: 'text' is empty`); exit 2 (was: `--input` or no name at all)")
@pytest.mark.parametrize("case", ["columns", "malformed", "no_pairs", "empty_text"])
def test_score_names_its_one_input_file_in_every_data_error(tmp_path, tiny_model_dir, case, capsys):
    from rm.score import main

    rows, extra, needle = {
        "columns": ([{"a": 1}], [], ": cannot detect the preference format"),
        "malformed": ([{"chosen": "Human: hi Assistant: yes", "rejected": "Human: hi Assistant: no"},
                       {"chosen": 5, "rejected": "Human: hi Assistant: no"}], ["--on-malformed", "error"],
                      " row 1: 'chosen' is int"),
        "no_pairs": ([{"chosen": "Human: hi Assistant: same", "rejected": "Human: hi Assistant: same"}], [],
                     ": no usable pairs"),
        "empty_text": ([{"text": " "}], [], " row 0: 'text' is empty"),
    }[case]
    path = _write(tmp_path / "in.jsonl", rows)
    with pytest.raises(SystemExit) as exited, boundary():
        sys.exit(main(["--model", str(tiny_model_dir), "--input", str(path), *extra]))
    out = "".join(capsys.readouterr())
    assert exited.value.code == 2 and f"--input {path}{needle}" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("output", [None, "-"])
def test_score_prints_each_rows_reward_on_stdout_without_output_or_with_dash(tmp_path, tiny_model_dir, capsys, output,
                                                                             monkeypatch):
    """Without --output (and with ``--output -``, no file named '-') the scored rows are JSON lines on stdout, one per
    row in order, and the counts go to stderr."""
    from rm.score import main

    texts = _write(tmp_path / "texts.jsonl", [{"text": "hello there"}, {"text": "a longer text to score"}])
    monkeypatch.chdir(tmp_path)
    assert main(["--model", str(tiny_model_dir), "--input", str(texts), *(["--output", output] if output else [])]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in rows] == ["hello there", "a longer text to score"], out
    assert all(isinstance(r["reward"], float) for r in rows)
    assert "scored 2 texts" in err and not (tmp_path / "-").exists()


@pytest.mark.reliability("Entry points", "`rm.score --output` that names one of its `--input` files, a directory, or a "
                         "file in a directory that does not exist",
                         "refused before the model loads or a row is scored, naming `--output` and the fix (`is also an "
                         "--input file: the scored rows would replace your data`, `is a directory`, `its directory ... does "
                         "not exist`); the input file unchanged; exit 2. Was: the input replaced by the scored rows (its "
                         "`prompt` column gone), or the scoring done and lost with exit 5 naming the hidden `.tmp-` file")
@pytest.mark.parametrize("case", ["same_as_input", "a_directory", "missing_directory"])
def test_score_refuses_an_output_it_cannot_or_must_not_write_before_scoring(tmp_path, tiny_model_dir, case, capsys):
    from rm.score import main

    pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "Human: hi", "chosen": " yes", "rejected": " no"}])
    before = pairs.read_bytes()
    output, needle = {"same_as_input": (str(pairs), "is also an --input file"),
                      "a_directory": (str(tmp_path), "is a directory"),
                      "missing_directory": (str(tmp_path / "nope" / "scored.jsonl"), "does not exist")}[case]
    with pytest.raises(SystemExit) as exited, boundary():
        sys.exit(main(["--model", str(tiny_model_dir), "--input", str(pairs), "--output", output]))
    out = "".join(capsys.readouterr())
    assert exited.value.code == 2 and f"--output {output}" in out and needle in out, out[-3000:]
    assert "Traceback" not in out and "pairs 1 -> 1 used" not in out, out[-3000:]  # refused before anything was scored
    assert pairs.read_bytes() == before and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.reliability("Entry points", "a LoRA adapter whose base directory is gone (moved), to `rm.score`; "
                         "`rm.export --merge --base <path>` with a path that does not exist",
                         "`is an adapter whose base model <path> (named by .../adapter_config.json) does not exist` "
                         "with the fix, not the Hub's `Repo id must be in the form ...`; exit 2")
def test_an_adapter_whose_base_is_gone_is_named_with_exit_2(tmp_path, tiny_model_dir, capsys):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    final = tmp_path / "final"
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir)
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["score"])).save_pretrained(final)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(final)
    config = json.loads((final / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved")  # where the base was when it trained
    (final / "adapter_config.json").write_text(json.dumps(config))
    good = _write(tmp_path / "pairs.jsonl", [{"chosen": "Human: hi Assistant: yes", "rejected": "Human: hi Assistant: no"}])
    from rm.score import main as score

    with pytest.raises(SystemExit) as exited, boundary():
        sys.exit(score(["--model", str(final), "--input", str(good)]))
    out = "".join(capsys.readouterr())
    assert exited.value.code == 2 and f"base model {tmp_path / 'moved'} (named by" in out and "--base" in out, out[-3000:]
    assert "Traceback" not in out and "Repo id" not in out, out[-3000:]

    from rm.modelling.bundle import PROBE_FILE
    from rm.export import main as export

    (final / PROBE_FILE).write_text("{}")  # what makes a directory a bundle to rm.export; the base fails first
    with pytest.raises(SystemExit) as exited, boundary():  # rm.export ends in the boundary, as its __main__ does
        sys.exit(export([str(final), "--merge", "--base", str(tmp_path / "nope")]))
    assert exited.value.code == 2
    out = "".join(capsys.readouterr())
    assert f"base model {tmp_path / 'nope'} (given as the base) does not exist" in out and "Traceback" not in out, out[-3000:]


@pytest.mark.reliability("Configuration", "a list key given one bare value (`data.train_files=pairs.jsonl`, no brackets)",
                         "Hydra's message, then `data.train_files is a list: write 'data.train_files=[pairs.jsonl]'`; "
                         "exit 2, no `Traceback` (was: Hydra's `str is not a ListConfig` and 'could not be composed', "
                         "no fix)")
def test_a_list_key_given_a_bare_value_is_shown_with_brackets(tmp_path):
    code, out = _run("rm.train", "experiment=tiny", "data=local", "data.train_files=pairs.jsonl",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert code == 2 and "error: data.train_files is a list: write 'data.train_files=[pairs.jsonl]'" in out, out[-3000:]
    assert "could not be composed" not in out and "Traceback" not in out, out[-3000:]


@pytest.mark.reliability("Configuration", "a key that moved into a group (`train.learning_rate=1e-4`, now "
                         "`train.optim.learning_rate`), on the command line or in the user's own experiment YAML",
                         "an error, not an alias: `train.learning_rate moved to train.optim.learning_rate (after rm 0.1.0): "
                         "write train.optim.learning_rate=1e-4` (in a YAML file: the group to put it under); exit 2, "
                         "no `Traceback`")
@pytest.mark.parametrize("where", ["command line", "yaml"])
def test_a_moved_key_exits_2_naming_its_new_name(tmp_path, where):
    if where == "yaml":
        (tmp_path / "experiment").mkdir()
        (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrain:\n  learning_rate: 1.0e-4\n")
        args = ["experiment=mine", f"hydra.searchpath=[file://{tmp_path}]"]
        fix = "in a YAML file, put it under train: optim:"
    else:
        args = ["experiment=tiny", "train.learning_rate=1e-4"]
        fix = "write train.optim.learning_rate=1e-4"
    proc = subprocess.run([sys.executable, "-m", "rm.estimate", *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"error: train.learning_rate moved to train.optim.learning_rate (after rm 0.1.0): {fix}" in out, out[-3000:]
    assert "could not be composed" not in out and "Traceback" not in out


def test_a_moved_key_added_with_a_plus_is_refused_not_dropped():
    """Hydra's own message for a key the schema lacks suggests ``+train.learning_rate=...``, which composes (the key
    is added beside the schema's) and would be dropped unread: the typed config refuses it."""
    from rm.foundations.config import compose

    with pytest.raises(ConfigError, match=r"^train\.learning_rate moved to train\.optim\.learning_rate \(after rm 0\.1\.0\): "
                                          r"write train\.optim\.learning_rate=0\.0001$"):
        compose(["experiment=tiny", "+train.learning_rate=1e-4"])
    assert compose(["experiment=tiny", "train.optim.learning_rate=1e-4"]).train.optim.learning_rate == 1e-4


def test_a_lost_peer_is_exit_6_naming_the_rank_not_a_bug(monkeypatch):
    """gloo's error (as raised when the other rank was SIGKILLed) and torch's DistBackendError are a lost peer, exit 6,
    with this rank's number and gloo's reason; an unrelated RuntimeError stays a bug."""
    import torch.distributed as dist

    from rm.foundations.errors import exit_code, message

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:14755: Connection reset by peer. This is typically caused by a remote worker "
                        "hanging or bugs in the application.")
    assert exit_code(gloo) == 6
    assert message(gloo).startswith("rank 1 of 4 lost its connection to another rank of the run (Read error "
                                    "[127.0.0.1]:14755: Connection reset by peer)")
    assert exit_code(dist.DistBackendError("NCCL communicator was aborted on rank 1")) == 6
    assert exit_code(RuntimeError("shape mismatch")) == 1


def _forked_child_status(signum):
    """Fork; the child sends itself ``signum`` under the handler it inherited. Its wait status: ended by the signal
    (the default action), or exit 3 where the inherited handler raised as the parent's would."""
    import signal
    import time

    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)
            os._exit(0)
        except BaseException:  # noqa: BLE001  (the parent's handler raised Interrupted in the child)
            os._exit(3)
    return os.waitpid(pid, 0)[1]


@pytest.mark.reliability("Entry points", "a process forked under a command's signal handler (a DataLoader worker, a "
                         "pool's process) gets SIGTERM or SIGINT (the pool stopping it)",
                         "it ends as the signal's default would; the parent's handler does not act in it (`Interrupted` "
                         "raised inside the worker, or `rm.train`'s stop flag set where no one reads it)")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_never_runs_the_parents_signal_handler():
    import signal
    import time

    from rm.foundations.errors import Interrupted, stop_on_signals
    from rm.training.trainer import StopRequest

    for signum in (signal.SIGTERM, signal.SIGINT):
        with stop_on_signals():
            status = _forked_child_status(signum)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signum, f"child wait status {status}"
            with pytest.raises(Interrupted):  # the parent's own handler still acts in the parent
                os.kill(os.getpid(), signum)
                time.sleep(5)
        with StopRequest() as stop:
            stop.phase = "training"
            status = _forked_child_status(signum)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signum, f"child wait status {status}"
            assert stop.signum == 0
