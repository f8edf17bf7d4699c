"""``python -m rm.train`` as a user drives it, over random overrides and random small data files: it trains
(exit 0), rejects the input (2), refuses (3) or refuses a resume from damaged checkpoints (5), never with a
traceback, and never changes a file in the directory of an earlier run (bytes or mtime, Hydra's ``.hydra/``
record and the log included, nor adds one) unless it was asked to replace that run (``train.checkpoint.overwrite=true``).
A run that trains accounts for every row of its file in ``data_audit.json`` (kept or dropped with a reason),
and never keeps a conversation without a final assistant answer.

The rows and directories include the cases an adversarial round found (issue 26): a row far over
``data.max_length``, conversations that are system-only, end on a user turn or have no assistant answer,
messages rows with and without the optional ``prompt`` list, files mixing layouts, a CUDA hardware profile on
a machine without CUDA, and a resume over checkpoints whose state file was deleted.

Each example is a real process (about 15 s of imports and a 2-step run), so the default suite runs a few;
``-m slow`` runs many more.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rm.data.synthetic import generate_pairs  # noqa: E402
from tests.conftest import CONF_DIR, FAST_TINY  # noqa: E402

ROOT = CONF_DIR.parent
PAIRS = generate_pairs(64, seed=1, split="train")

# Each key with values that work and values that must be rejected.
OVERRIDES = {
    "train.optim.adam_beta1": ["0.9", "1.5"],
    "train.seed": ["1", "-1"],
    "train.micro_batch_size": ["4", "8", "0", "3"],
    "train.global_batch_size": ["16", "20", "-4"],
    "train.optim.learning_rate": ["1e-3", "0", "nan"],
    "train.optim.weight_decay": ["0.01", "-0.1"],
    "train.optim.max_grad_norm": ["0", "-1"],
    "data.max_length": ["64", "1", "100000"],
    "data.truncation": ["truncate", "drop", "error"],
    "data.on_malformed": ["skip", "error"],
    "data.format": ["auto", "hh", "prompt", "messages"],
    "memory_profile": ["full", "lora", "qlora"],
    "lora.r": ["8", "0"],
    "lora.dropout": ["0.1", "1.5"],
    "hardware.device_memory_gib": ["16", "0.001", "-5"],
    "model.num_key_value_heads": ["2", "3"],
    "train.checkpoint.resume": ["true", "false"],
    "train.checkpoint.overwrite": ["true", "false"],
    "hardware": ["cpu", "h100_80g"],  # a CUDA profile on this machine: refused (2)
    # sizes far out of range: refused (2) by validation before any allocation or data pass (was a 233 TiB array)
    "train.max_steps": ["2", "1000000000000"],
    "data.synthetic_train_size": ["512", "1000000000000"],
    "train.threads": ["0", "1", "-1"],
}


def _turns(*roles):
    return [{"role": role, "content": f"{role} {i}"} for i, role in enumerate(roles)]


# Conversations that are no preference pair: no final assistant answer (system-only, ending on a user turn).
NO_ANSWER = [
    {"chosen": _turns("system"), "rejected": _turns("system")},
    {"chosen": _turns("user", "assistant", "user"), "rejected": _turns("user", "assistant", "user")},
    {"chosen": _turns("system", "user"), "rejected": _turns("system", "user")},
]


def _is_no_answer(row) -> bool:
    return row in NO_ANSWER

ROW = st.one_of(
    st.sampled_from(PAIRS),
    st.fixed_dictionaries({"chosen": st.one_of(st.integers(), st.none(), st.just(""), st.text(max_size=20)),
                           "rejected": st.sampled_from([p["rejected"] for p in PAIRS[:4]])}),
    st.builds(lambda p: {"prompt": "\n\nHuman: hi", "chosen": p["chosen"], "rejected": p["rejected"]}, st.sampled_from(PAIRS)),
    st.just({"chosen": [{"role": "user", "content": "hi"}], "rejected": [{"role": "user", "content": "ho"}]}),
    st.sampled_from(NO_ANSWER),
    # messages rows, with and without the optional prompt list (row by row)
    st.builds(lambda i, prompt: {**({"prompt": _turns("user")} if prompt else {}),
                                 "chosen": [*([] if prompt else _turns("user")), {"role": "assistant", "content": f"yes {i}"}],
                                 "rejected": [*([] if prompt else _turns("user")), {"role": "assistant", "content": f"no {i}"}]},
              st.integers(0, 9), st.booleans()),
    # a side far over data.max_length (64 x max_length characters): cut before it tokenizes, named in the audit
    st.builds(lambda p, n: {**p, "chosen": p["chosen"] + " word" * n}, st.sampled_from(PAIRS), st.sampled_from([5_000, 40_000])),
)
DATA = st.one_of(st.none(), st.just([]), st.lists(ROW, min_size=1, max_size=40))  # None: the synthetic data
EARLIER = st.sampled_from(["none", "finished", "locked", "incomplete"])


def _snapshot(run_dir):
    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _earlier_run(run_dir, kind):
    """A directory as an earlier run left it: a finished model, one still in use (a live pid holds the lock), or a
    run stopped with checkpoints whose ``trainer_state.json`` was deleted since."""
    run_dir.mkdir(parents=True)
    if kind == "none":
        return
    if kind == "incomplete":
        for step in (2, 4):
            (run_dir / "checkpoints" / f"checkpoint-{step}").mkdir(parents=True)
            (run_dir / "checkpoints" / f"checkpoint-{step}" / "model.safetensors").write_bytes(b"weights at step %d" % step)
        (run_dir / "metrics.jsonl").write_text('{"split": "train", "step": 4, "loss": 0.6}\n')
        return
    (run_dir / "final").mkdir()
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights of the earlier run")
    (run_dir / "metrics.jsonl").write_text('{"split": "train", "step": 2, "loss": 0.6}\n')
    (run_dir / "train.log").write_text("the earlier run's log\n")
    (run_dir / ".hydra").mkdir()
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"# the earlier run's {name}\n")
    if kind == "locked":
        (run_dir / ".lock").write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "since": "now"}))


def check_one_run(tmp_dir, overrides, rows, earlier):
    run_dir = tmp_dir / "run"
    _earlier_run(run_dir, earlier)
    before = _snapshot(run_dir)
    data = []
    if rows is not None:
        path = tmp_dir / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        data = ["data=local", f"data.train_files=[{path}]"]
    args = [*FAST_TINY, "train.max_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", *data,
            *[f"{k}={v}" for k, v in overrides.items()], f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "rm.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RM_DEBUG": ""})
    out = proc.stdout + proc.stderr
    context = f"{' '.join(args)}\n{out[-3000:]}"
    assert proc.returncode in (0, 2, 3, 5), context
    assert proc.returncode != 5 or (earlier == "incomplete" and overrides.get("train.checkpoint.resume") == "true"), context
    assert "Traceback" not in out, context
    if proc.returncode == 0 and rows:
        train = json.loads((run_dir / "data_audit.json").read_text())["splits"]["train"]
        assert train["pairs_in"] == len(rows) and train["pairs_out"] + sum(train["dropped"].values()) == len(rows), context
        assert train["pairs_out"] <= len(rows) - sum(map(_is_no_answer, rows)), context  # never trained on
    if earlier == "none":
        return
    after = _snapshot(run_dir)
    changed = [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]
    # Only a run asked to replace an earlier run, that no live run holds, may write in its directory. If it then
    # fails, it has added its log and record only: the earlier run goes once settings and data are known usable.
    record = {"train.log", ".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"}
    replacing = earlier != "locked" and overrides.get("train.checkpoint.overwrite") == "true" and overrides.get("train.checkpoint.resume") != "true"
    resuming = earlier == "incomplete" and overrides.get("train.checkpoint.resume") == "true" and overrides.get("train.checkpoint.overwrite") != "true"
    if resuming:  # accepted for a resume, which finds no intact checkpoint: nothing of the earlier run changes
        assert proc.returncode != 0 and set(changed) <= record | {"data_audit.json"}, f"{changed} changed\n{context}"
    elif not replacing:
        assert not changed, f"{changed} changed\n{context}"
    elif proc.returncode in (2, 3):  # refused before the directory is the run's: nothing of the earlier run changes
        assert not changed, f"{changed} changed\n{context}"
    elif proc.returncode != 0:
        assert set(changed) <= record, f"{changed} changed\n{context}"
        log = run_dir / "train.log"
        assert earlier == "incomplete" or log.read_text().startswith("the earlier run's log\n"), context
    if earlier == "locked":  # refused for the lock, or before it for its own settings (validated first: exit 2)
        assert (proc.returncode == 3 and f"pid {os.getpid()}" in out) or \
            (proc.returncode == 2 and "invalid configuration" in out), context


def _fuzz(examples):
    @settings(max_examples=examples, deadline=None, derandomize=examples < 10,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(overrides=st.dictionaries(st.sampled_from(sorted(OVERRIDES)), st.just(None), max_size=4).flatmap(
               lambda keys: st.fixed_dictionaries({k: st.sampled_from(OVERRIDES[k]) for k in keys})),
           rows=DATA, earlier=EARLIER)
    def run(tmp_path_factory, overrides, rows, earlier):
        check_one_run(tmp_path_factory.mktemp("fuzz"), overrides, rows, earlier)

    return run


@pytest.mark.reliability("Entry points", "random overrides (valid and invalid values of 22 keys, a CUDA profile on a CPU machine "
                         "and sizes of 10^12 among them) and random small data files (huge rows, conversations without a final answer, "
                         "messages rows with and without `prompt`, mixed layouts), in a fresh run directory, over a "
                         "finished run, a locked one or one whose checkpoints lost their state file (property-based, "
                         "real processes)",
                         "exit 0, 2, 3, or 5 for a resume over damaged checkpoints; never a `Traceback`; every row of "
                         "the file kept or dropped with a reason in `data_audit.json`, none without an answer kept; no "
                         "file of an earlier run changed or added (bytes and mtime, `.hydra/` and `train.log` included) "
                         "unless `train.checkpoint.overwrite=true` replaced it, and a refused resume changes no checkpoint")
def test_cli_over_random_overrides_and_data(tmp_path_factory):
    _fuzz(3)(tmp_path_factory)


@pytest.mark.slow
def test_cli_over_random_overrides_and_data_many(tmp_path_factory):
    _fuzz(30)(tmp_path_factory)
