"""SIGTERM (a SLURM pre-emption) and SIGINT (Ctrl-C) sent to a real ``python -m rm.train`` (and ``rm.export --merge``)
at each phase: set-up, a training step, an evaluation, a checkpoint being written, the plots, the final export.

Each process pauses in its phase (``tests/e2e/pause_at.py``: a patch made in the child, nothing in rm) and the test
signals it there. What must hold wherever the signal lands: either the run finished what it was writing (exit 0, a
whole ``final/`` that reloads to its own rewards) or it left the checkpoint of its last completed step (exit 128+N);
never a ``.tmp-*`` directory, and the command it prints resumes it to the weights of a run never interrupted.
"""

import json
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import CONF_DIR, FAST_TINY

ROOT = CONF_DIR.parent
# Checkpoints at steps 2 and 4, evaluations at 3 and 6; the "training" pause is inside step 3.
ARGS = [*FAST_TINY, "train.max_steps=6", "train.checkpoint.save_steps=2", "train.logging.eval_steps=3", "train.logging.logging_steps=1"]
TIMEOUT = 600


def _start(phase, module, *args):
    return subprocess.Popen([sys.executable, "-m", "tests.e2e.pause_at", phase, module, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signal_when_paused(process, *signums):
    """Send ``signums`` once the process says it paused, each after the process logged the one before; its output."""
    out, pending = [], list(signums)
    for line in process.stdout:
        out.append(line)
        if line.startswith("PAUSED AT") or (len(pending) < len(signums) and "received SIG" in line):
            process.send_signal(pending.pop(0))
            if not pending:
                break
    out.append(process.communicate(timeout=TIMEOUT)[0])
    assert not pending, f"the process ended before it paused:\n{''.join(out)[-3000:]}"
    return "".join(out)


def _leftovers(run_dir):
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".tmp-*"))


def _checkpoints(run_dir):
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("checkpoint-*")) \
        if (run_dir / "checkpoints").is_dir() else []


def _resume_as_printed(out):
    """Run the command the stopped run printed after "Continue with:", as a user would paste it."""
    lines = out.splitlines()
    command = shlex.split(lines[next(i for i, line in enumerate(lines) if line.rstrip().endswith("Continue with:")) + 1])
    assert command[:3] == ["python", "-m", "rm.train"] and "train.checkpoint.resume=true" in command, command
    return subprocess.run([sys.executable, *command[1:]], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(run_dir / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The same run, never interrupted."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    done = subprocess.run([sys.executable, "-m", "rm.train", *ARGS, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return run_dir


# phase -> the checkpoint a stopped run leaves (None: none, nothing was trained), or "final": the run finishes.
PHASES = {"set-up": None, "training": 3, "evaluation": 3, "checkpoint": 2, "plots": "final", "export": "final"}
SIGNALS = (signal.SIGTERM, signal.SIGINT)


@pytest.mark.reliability("Faults", "SIGTERM or SIGINT while the final model is written (`.tmp-final/` exists; a real "
                         "process)", "the final model is finished: a whole `final/` that reloads to its rewards, no "
                         "`.tmp-final/`, exit 0 (quicker than a checkpoint, which adds the optimizer states)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=lambda s: signal.Signals(s).name)  # SIGINT's fast twin: test_a_second_ctrl_c_in_process
def test_a_signal_while_the_final_model_is_written_finishes_it(signum, tmp_path, request):
    """One real run each, about 25 s on 2 busy cores."""
    _signal_at("export", signum, tmp_path, request)


@pytest.mark.reliability("Faults", "SIGTERM or SIGINT to a real `rm.train` during set-up",
                         "stops at once, exit 128+N, no checkpoint (nothing trained); the printed command resumes it")
@pytest.mark.reliability("Faults", "SIGTERM or SIGINT during a step, an evaluation or a checkpoint's write (real process)",
                         "the step or checkpoint finishes (an evaluation stops at its next batch, unrecorded), then the "
                         "checkpoint of that step (never written twice), exit 128+N; the printed command (the run's own overrides, `train.checkpoint.resume=true`, "
                         "`hydra.run.dir`) resumes it to the weights of an uninterrupted run")
@pytest.mark.reliability("Faults", "SIGTERM or SIGINT while the plots are drawn (real process)",
                         "the run trained its last step: the final model is written, exit 0")
@pytest.mark.slow  # a run and its resume for each of ten cases: about 10 minutes on 2 busy cores
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("phase", [p for p in PHASES if p != "export"])
def test_a_signal_at_any_other_phase_loses_nothing_trained(phase, signum, tmp_path, request):
    _signal_at(phase, signum, tmp_path, request)


def _signal_at(phase, signum, tmp_path, request):
    run_dir = tmp_path / "run"
    victim = _start(phase, "rm.train", *ARGS, f"hydra.run.dir={run_dir}")
    out = _signal_when_paused(victim, signum)
    assert _leftovers(run_dir) == [], out[-3000:]
    expected = PHASES[phase]
    if expected == "final":
        from rm.modelling.bundle import verify_bundle

        assert victim.returncode == 0, out[-3000:]
        assert _checkpoints(run_dir) == [2, 4] and (run_dir / "final").is_dir(), out[-3000:]
        verify_bundle(run_dir / "final")  # the whole model: it reloads to the rewards the trained one gave
        assert f"received {signal.Signals(signum).name}: the run trained its last step: finishing" in out
        return
    assert victim.returncode == 128 + signum and not (run_dir / "final").exists(), out[-3000:]
    assert _checkpoints(run_dir) == ([] if expected is None else sorted({2, expected})), out[-3000:]
    if expected is not None:
        log = (run_dir / "train.log").read_text()  # accelerate's INFO lines are the log file's, not the console's
        assert log.count(f"Saving current state to {run_dir}/checkpoints/.tmp-checkpoint-{expected}") == 1, \
            "the checkpoint of the stopping step is written once"
    resumed = _resume_as_printed(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    straight = request.getfixturevalue("straight")
    a, b = _weights(straight), _weights(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), f"{phase}: the resumed run's weights differ from an uninterrupted run's"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, 7))


@pytest.mark.reliability("Faults", "a second Ctrl-C while the final model is written",
                         "abandoned whole: no `final/`, no `.tmp-final/`; exit 130, naming the last good checkpoint "
                         "and the command that resumes from it")
@pytest.mark.slow  # a real process, about 25 s on 2 busy cores; test_a_second_ctrl_c_in_process is its fast twin
def test_a_second_ctrl_c_abandons_the_final_model_whole(tmp_path):
    run_dir = tmp_path / "run"
    victim = _start("export", "rm.train", *ARGS, f"hydra.run.dir={run_dir}")
    out = _signal_when_paused(victim, signal.SIGINT, signal.SIGINT)
    assert victim.returncode == 130 and not (run_dir / "final").exists() and _leftovers(run_dir) == [], out[-3000:]
    assert _checkpoints(run_dir) == [2, 4]
    assert f"the last good checkpoint is {run_dir}/checkpoints/checkpoint-4. Continue with:" in out, out[-3000:]
    assert "interrupted by SIGINT" in out


@pytest.mark.reliability("Faults", "SIGTERM or SIGINT to `rm.export --merge` while it writes the merged model",
                         "abandoned whole: no `merged/`, no temporary directory, the adapter bundle unchanged; exit "
                         "128+N; the same command then merges")
@pytest.mark.slow  # a LoRA run, then two merges: about a minute on 2 busy cores
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_a_merge_leaves_no_partial_merged_model(signum, tmp_path):
    run_dir = tmp_path / "run"
    trained = subprocess.run([sys.executable, "-m", "rm.train", *ARGS, "memory_profile=lora", f"hydra.run.dir={run_dir}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    final = run_dir / "final"
    before = {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()}
    merge = _start("export", "rm.export", str(run_dir), "--merge")
    out = _signal_when_paused(merge, signum)
    assert merge.returncode == 128 + signum, out[-3000:]
    assert not (final / "merged").exists() and _leftovers(run_dir) == [], out[-3000:]
    assert {p.name: p.read_bytes() for p in final.iterdir() if p.is_file()} == before
    again = subprocess.run([sys.executable, "-m", "rm.export", str(run_dir), "--merge"], cwd=ROOT, capture_output=True,
                           text=True, timeout=TIMEOUT)
    assert again.returncode == 0 and (final / "merged" / "model.safetensors").is_file(), again.stderr[-2000:]


def test_a_second_ctrl_c_in_process_leaves_no_temporary_final(tiny_cfg, tmp_path, monkeypatch, caplog):
    """The second Ctrl-C of the test above, raised inside the export's write: ``.tmp-final`` goes with it."""
    import rm.modelling.bundle as bundle
    import rm.train as rm_train
    from rm.foundations.errors import Interrupted

    real_save = bundle.save_bundle

    def save_then_ctrl_c(model, tokenizer, directory, **kwargs):
        real_save(model, tokenizer, directory, **kwargs)
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(bundle, "save_bundle", save_then_ctrl_c)
    with pytest.raises(Interrupted):
        rm_train.train(tiny_cfg("train.max_steps=4", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0"), tmp_path)
    assert not (tmp_path / "final").exists() and _leftovers(tmp_path) == []
    assert f"the last good checkpoint is {tmp_path}/checkpoints/checkpoint-2. Continue with:" in caplog.text


@pytest.mark.reliability("Faults", "SIGTERM or SIGINT during a long evaluation (before the last step)",
                         "the evaluation stops at its next batch (every process agrees, as before a step), unrecorded "
                         "(no eval record of that step, no alarm from part of the set); then the checkpoint of the step, "
                         "exit 128+N, and the printed command resumes it; was: the whole eval set first. The last step's "
                         "evaluation finishes: the final model's reward statistics come from it")
def test_a_signal_during_an_evaluation_stops_it_at_the_next_batch(tiny_cfg, tmp_path, monkeypatch, caplog):
    import os

    import rm.evaluation.metrics as metrics
    import rm.train as rm_train

    real = metrics.pair_rewards
    forwards = []

    def signalled_on_the_first_batch(*args, **kwargs):  # a SIGTERM arrives while the first eval batch is scored
        forwards.append(1)
        if len(forwards) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, "pair_rewards", signalled_on_the_first_batch)
    overrides = ("train.max_steps=4", "train.checkpoint.save_steps=0", "train.logging.eval_steps=2", "train.eval_batch_size=8")
    result = rm_train.train(tiny_cfg(*overrides), tmp_path)  # 128 eval pairs: 16 batches
    assert (result["status"], result["step"], result["signal"]) == ("interrupted", 2, signal.SIGTERM)
    assert len(forwards) == 1, f"{len(forwards)} eval batches scored after the signal"
    assert "step 2: evaluation stopped by SIGTERM before its end; no eval record for this step" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records if r["event"] == "eval"] == []
    assert _checkpoints(tmp_path) == [2] and _leftovers(tmp_path) == []

    monkeypatch.setattr(metrics, "pair_rewards", real)
    resumed = rm_train.train(tiny_cfg(*overrides, "train.checkpoint.resume=true"), tmp_path)
    assert (resumed["status"], resumed["step"]) == ("ok", 4) and (tmp_path / "final").is_dir()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == [4]
