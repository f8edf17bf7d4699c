"""Property-based neighbours of issue 49's cases: each category is drawn at random rather than listed, so a case
next to a fixed one is tried too.

* refusal kind x earlier run: a start that must be refused (a changed setting or changed data on resume, an
  invalid or out-of-range value, a moved, misspelt or unknown name, missing files, a held lock) over a finished run,
  a stopped one (checkpoints, no ``final/``) or one with a damaged checkpoint: exit 2, 3 or 5, no traceback, and
  every file of the earlier run keeps its sha256 and mtime, with no file added.
* signal x phase x layout: SIGTERM or SIGINT at a random phase of a run with a random layout or profile: exit 0 with a
  whole ``final/``, or 128+N with the checkpoint of the last step, no ``.tmp-*`` anywhere, and the printed command
  resumes it to the end with each step logged once.
* key x bad value (in process, many examples): one to three numeric keys of any group set to 0, -1, a huge value, NaN
  or inf: refused with a ``ConfigError`` that names each key whose value is out of its range, or accepted when every
  drawn value is inside it.
* layout mix x proportion (in process): a file of HH transcripts, prompt/chosen/rejected rows, conversations and
  malformed rows in random proportions and order: ``data_audit.json``'s counts account for every row.

Real processes take 10-40 s each, so the default suite draws a few refusals; ``-m slow`` draws many of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.conftest import CONF_DIR, FAST_TINY  # noqa: E402

ROOT = CONF_DIR.parent
TIMEOUT = 600
LOCK_FILE = ".lock"


def _hashes(run_dir):
    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _run(args, run_dir, timeout=TIMEOUT):
    return subprocess.run([sys.executable, "-m", "rm.train", *args, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "RM_DEBUG": ""})


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A finished 4-step run on local files with its checkpoint of step 2 (the final model stands for step 4);
    returns ``(run_dir, args, data_file)``."""
    from rm.data.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("earlier")
    files = write_synthetic(root / "data", 256, 64, seed=0)
    args = [*FAST_TINY, "data=local", f"data.train_files=[{files['train']}]", f"data.eval_files=[{files['test']}]",
            "train.max_steps=4", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0"]
    proc = _run(args, root / "run")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "run", args, files["train"]


# kind -> (extra overrides, the exit codes allowed). "{tmp}" is the example's own folder.
REFUSALS = {
    "resume, a changed setting": (["train.checkpoint.resume=true", "train.optim.learning_rate=0.05"], {2}),
    "resume, another seed": (["train.checkpoint.resume=true", "train.seed=7"], {2}),
    "resume, a changed max_length": (["train.checkpoint.resume=true", "data.max_length=48"], {2}),
    "resume, changed data": (["train.checkpoint.resume=true"], {2}),
    "resume, an invalid value": (["train.checkpoint.resume=true", "train.optim.adam_beta2=1.0"], {2}),
    "overwrite, an invalid value": (["train.checkpoint.overwrite=true", "train.global_batch_size=-16"], {2}),
    "overwrite, a value out of range": (["train.checkpoint.overwrite=true", "train.max_steps=1000000000000"], {2}),
    "overwrite, missing files": (["train.checkpoint.overwrite=true", "data.train_files=[{tmp}/gone.jsonl]"], {2}),
    "overwrite, a moved key": (["train.checkpoint.overwrite=true", "train.learning_rate=1e-4"], {2}),
    "overwrite, a misspelt key": (["train.checkpoint.overwrite=true", "train.micro_bach_size=4"], {2}),
    "overwrite, an unknown option": (["train.checkpoint.overwrite=true", "experiment=tyni"], {2}),
    "a new start over it": ([], {2}),  # neither resume nor overwrite: refused, the earlier run is named
    "a held lock": (["train.checkpoint.resume=true"], {3}),
}
STATES = ["finished", "stopped", "stopped, newest checkpoint damaged"]


def _refused_over(earlier, tmp_path, kind, state):
    finished, args, data = earlier
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)  # copy2: mtimes kept
    if state.startswith("stopped"):
        shutil.rmtree(run_dir / "final")
    if state.endswith("damaged"):
        newest = max((run_dir / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    extra, codes = REFUSALS[kind]
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    if kind == "a held lock":
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": "now"}))
    original = data.read_bytes()
    if kind == "resume, changed data":
        lines = original.decode().splitlines(keepends=True)
        data.write_text("".join(lines[1:]))  # one row fewer, under the same config
    before = _hashes(run_dir)
    try:
        proc = _run([*args, *extra], run_dir)
    finally:
        data.write_bytes(original)
    out = proc.stdout + proc.stderr
    context = f"{kind} over a {state} run: {shlex.join(extra)}\n{out[-3000:]}"
    allowed = codes | ({5} if state.endswith("damaged") and "train.checkpoint.resume=true" in extra else set())
    assert proc.returncode in allowed and "Traceback" not in out, context
    after = _hashes(run_dir)
    assert after == before, [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


def _refusals(examples):
    @settings(max_examples=examples, deadline=None, derandomize=examples < 10,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(kind=st.sampled_from(sorted(REFUSALS)), state=st.sampled_from(STATES))
    def run(earlier, tmp_path_factory, kind, state):
        _refused_over(earlier, tmp_path_factory.mktemp("refusal"), kind, state)

    return run


@pytest.mark.reliability("Faults", "random refusals (a changed setting or data on resume, invalid, out-of-range, "
                         "moved, misspelt or unknown names, missing files, a held lock) over a finished, a stopped or a "
                         "damaged earlier run (property-based, real processes)",
                         "exit 2, 3 (lock) or 5 (a resume whose checkpoints are damaged); never a `Traceback`; every file "
                         "of the earlier run keeps its sha256 and mtime and none is added")
def test_random_refusals_change_no_file_of_an_earlier_run(earlier, tmp_path_factory):
    _refusals(3)(earlier, tmp_path_factory)


@pytest.mark.slow
def test_random_refusals_change_no_file_of_an_earlier_run_many(earlier, tmp_path_factory):
    _refusals(30)(earlier, tmp_path_factory)


# --- signal x phase x layout ---------------------------------------------------------------------------------------

PHASES = ["set-up", "training", "evaluation", "checkpoint", "plots", "export"]
NEIGHBOURS = [[], ["train.packing=true"], ["train.share_prefix=true"], ["memory_profile=lora"],
              ["train.group_by_length=false"], ["train.optim.lr_scheduler_type=cosine", "train.optim.warmup_ratio=0.2"]]
SIGNAL_ARGS = [*FAST_TINY, "train.max_steps=6", "train.checkpoint.save_steps=2", "train.logging.eval_steps=3",
               "train.logging.logging_steps=1", "train.layout=given"]


def _signalled(tmp_path, phase, signum, neighbour):
    from tests.e2e.test_signals import _checkpoints, _leftovers, _resume_as_printed, _signal_when_paused, _start

    run_dir = tmp_path / "run"
    victim = _start(phase, "rm.train", *SIGNAL_ARGS, *neighbour, f"hydra.run.dir={run_dir}")
    out = _signal_when_paused(victim, signum)
    context = f"{signal.Signals(signum).name} at {phase} with {neighbour}\n{out[-3000:]}"
    assert "Traceback" not in out and _leftovers(run_dir) == [], context
    if victim.returncode == 0:
        from rm.modelling.bundle import verify_bundle

        assert phase in ("plots", "export"), context
        verify_bundle(run_dir / "final")
        return
    assert victim.returncode == 128 + signum and not (run_dir / "final").exists(), context
    assert phase == "set-up" or _checkpoints(run_dir), context  # something trained: its checkpoint is there
    resumed = _resume_as_printed(out)
    assert resumed.returncode == 0 and (run_dir / "final").is_dir(), resumed.stdout[-2000:] + resumed.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("event") == "train"]
    assert steps == list(range(1, 7)), context


@pytest.mark.reliability("Faults", "SIGTERM or SIGINT at a random phase of a run with a random layout, schedule or "
                         "profile (property-based, real processes; slow)",
                         "exit 0 with a whole `final/`, or 128+N with the last step's checkpoint; no `.tmp-*` anywhere; "
                         "the printed command resumes it to the end, each step logged once")
@pytest.mark.slow
def test_a_signal_at_a_random_phase_of_a_random_run():
    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(phase=st.sampled_from(PHASES), signum=st.sampled_from([signal.SIGTERM, signal.SIGINT]),
           neighbour=st.sampled_from(NEIGHBOURS))
    def run(phase, signum, neighbour):
        import tempfile
        from pathlib import Path

        with tempfile.TemporaryDirectory() as tmp:
            _signalled(Path(tmp), phase, signum, neighbour)

    run()


# --- key x bad value (in process) -----------------------------------------------------------------------------------

BAD_VALUES = ["0", "-1", "1000000000000000", "nan", "inf"]


def _numeric_keys():
    from rm.settings.validate import RANGES

    return sorted(RANGES)


@pytest.mark.reliability("Configuration", "one to three numeric keys of any group at once, each 0, -1, 10^15, NaN or "
                         "inf (property-based, 25 draws in process; 2000 with -m slow)",
                         "refused before anything loads: composition names a value of the wrong type, validation names "
                         "every key whose value is outside its range (`rm.settings.validate.RANGES`) and no other")
def test_random_bad_values_are_named_by_their_keys():
    _bad_values(25)()


@pytest.mark.slow
def test_random_bad_values_are_named_by_their_keys_many():
    _bad_values(2000)()


def _bad_values(examples):
    @settings(max_examples=examples, deadline=None, derandomize=examples < 1000)
    @given(drawn=st.dictionaries(st.sampled_from(_numeric_keys()), st.sampled_from(BAD_VALUES), min_size=1, max_size=3))
    def run(drawn):
        _check_bad_values(drawn)

    return run


def _check_bad_values(drawn):
    from rm.foundations.config import compose
    from rm.foundations.errors import ConfigError
    from rm.settings.validate import RANGES, validate

    overrides = [f"{key}={value}" for key, value in drawn.items()]
    try:
        cfg = compose(["experiment=tiny", "hardware=cpu", *overrides])
    except Exception as err:  # noqa: BLE001  (a NaN for an int key: Hydra names the key)
        assert any(key in str(err) for key in drawn), (overrides, err)
        return
    out_of_range = set()
    for key in drawn:
        group, _, name = key.partition(".")
        value = getattr(cfg, group)
        for part in name.split("."):
            value = getattr(value, part)
        if value is not None and not RANGES[key].holds(value):
            out_of_range.add(key)
    try:
        validate(cfg, world_size=1)
    except ConfigError as err:
        named = {key for key in drawn if f"{key}=" in str(err)}
        assert out_of_range <= named, (overrides, str(err)[:2000])
        return
    assert not out_of_range, f"{overrides}: accepted, though {sorted(out_of_range)} are out of range"


# --- layout mix x proportion (in process) --------------------------------------------------------------------------

def _row(kind, i):
    if kind == "hh":
        return {"chosen": f"\n\nHuman: q{i}\n\nAssistant: good {i}", "rejected": f"\n\nHuman: q{i}\n\nAssistant: bad {i}"}
    if kind == "prompt":
        return {"prompt": f"Question {i}? ", "chosen": f"yes {i}", "rejected": f"no {i}"}
    if kind == "messages":
        return {"chosen": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"yes {i}"}],
                "rejected": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"no {i}"}]}
    return {"chosen": i, "rejected": None}  # malformed


@pytest.mark.reliability("Data", "files mixing hh, prompt/chosen/rejected, conversation and malformed rows in random "
                         "proportions and order, one to three files (property-based, 20 draws in process; 300 with -m slow)",
                         "each file's majority layout is its layout; every other row is dropped as `other_format` or "
                         "`malformed` and counted: kept + dropped = rows read; a tie, or a file of malformed rows only, "
                         "is an error naming it")
def test_every_row_of_a_mixed_file_is_accounted_for(tmp_path_factory):
    _mixes(20)(tmp_path_factory)


@pytest.mark.slow
def test_every_row_of_a_mixed_file_is_accounted_for_many(tmp_path_factory):
    _mixes(300)(tmp_path_factory)


def _mixes(examples):
    @settings(max_examples=examples, deadline=None, derandomize=examples < 100,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(files=st.lists(st.lists(st.sampled_from(["hh", "prompt", "messages", "malformed"]), min_size=1, max_size=12),
                          min_size=1, max_size=3))
    def run(tmp_path_factory, files):
        _check_mix(files, tmp_path_factory)

    return run


def _check_mix(files, tmp_path_factory):
    from collections import Counter

    from rm.data.audit import audit_split
    from rm.data.tokenise import pair_lengths
    from rm.foundations.errors import DataError
    from tests.data.test_data_errors import _jsonl, _split

    tmp = tmp_path_factory.mktemp("mix")
    paths, expected_kept, other, malformed, tie, no_layout, index = [], 0, 0, 0, False, False, 0
    for n, kinds in enumerate(files):
        rows = []
        for kind in kinds:
            rows.append(_row(kind, index))
            index += 1
        paths.append(_jsonl(tmp / f"part{n}.jsonl", rows))
        counts = Counter(k for k in kinds if k != "malformed")
        top = counts.most_common()
        tie = tie or (len(top) > 1 and top[0][1] == top[1][1])
        no_layout = no_layout or not top  # a file of malformed rows only: no layout to read it as, an error naming it
        expected_kept += top[0][1] if top else 0
        other += sum(counts.values()) - (top[0][1] if top else 0)
        malformed += kinds.count("malformed")
    total = sum(map(len, files))
    try:
        ds, counts = _split(",".join(map(str, paths)))
    except DataError as err:
        assert tie or no_layout, f"{files}: {err}"
        assert "no format has most rows" in str(err) or any(str(p) in str(err) for p in paths), str(err)
        return
    assert not tie and not no_layout, f"{files}: a tie or a file without a layout was not refused"
    audit = audit_split(counts, *pair_lengths(ds))
    assert audit["pairs_in"] == total and audit["pairs_out"] + sum(audit["dropped"].values()) == total, (files, audit)
    assert audit["pairs_out"] == expected_kept and audit["dropped"]["other_format"] == other, (files, audit)
    assert audit["dropped"]["malformed"] == malformed, (files, audit)
