"""Output a person reads: no dependency warnings (rm.foundations.quiet), `--help` for every CLI, no stray run
directories, the first screen of a training run, the training-loss plot."""

import json
import logging
from pathlib import Path
import os
import subprocess
import sys

import pytest

from tests.conftest import CONF_DIR

IMPORTS = (
    "import logging, sys; logging.basicConfig(level=getattr(logging, sys.argv[1]), format='%(name)s %(message)s');"
    "{first}"
    "import transformers, peft, bitsandbytes, deepspeed;"
    "from deepspeed.accelerator import get_accelerator; get_accelerator()"
)


def run(code, level="WARNING"):
    """stdout and stderr together: DeepSpeed's logger writes to stdout."""
    proc = subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, timeout=300,
                          cwd=CONF_DIR.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_bitsandbytes_and_deepspeed_lines_are_dropped_at_their_loggers_and_kept_at_debug():
    bare = run(IMPORTS.format(first=""))
    if "kernels-community" not in bare:  # e.g. a CPU without AVX512-BF16, where bitsandbytes stays silent
        pytest.skip("bitsandbytes does not warn about 'kernels' on this machine")
    assert "Setting accelerator to CPU" in bare  # the two lines rm.foundations.quiet drops exist
    quiet = run(IMPORTS.format(first="import rm;"))
    assert "kernels-community" not in quiet and "Setting accelerator to CPU" not in quiet, quiet
    debug = run(IMPORTS.format(first="import rm;"), level="DEBUG")
    assert "rm.foundations.quiet dropped a bitsandbytes.backends.cpu.ops warning" in debug
    assert "rm.foundations.quiet dropped a DeepSpeed warning" in debug


@pytest.mark.parametrize("cli, expect", [
    ("rm.score", "--normalize"), ("rm.export", "--merge"),
    ("rm.estimate", "memory_profile: 8bit"), ("rm.gpu_report", "memory_profile: 8bit"),
])
def test_every_cli_lists_its_arguments_on_help(cli, expect, tmp_path):
    proc = subprocess.run([sys.executable, "-m", cli, "--help"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    assert proc.returncode == 0 and expect in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()  # asking for help writes nothing


@pytest.mark.parametrize("cli", ["rm.score", "rm.estimate", "rm.gpu_report"])
def test_help_does_not_load_torch(cli, tmp_path):
    """Help answers in about the time Python and Hydra start: torch (seconds on 2 cores) loads only for work."""
    code = f"import runpy, sys; sys.argv = ['{cli}', '--help']\ntry:\n    runpy.run_module('{cli}', run_name='__main__')\n" \
           "except SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NO TORCH')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    assert proc.stdout.strip().endswith("NO TORCH"), proc.stdout[-2000:] + proc.stderr[-2000:]


def run_cli(args, cwd):
    """``python -X importtime -m <args>``: exit code, stdout, stderr, and which of the heavy libraries it imported."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    heavy = imported & {"torch", "transformers", "datasets", "peft", "accelerate"}
    stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc.returncode, proc.stdout, stderr, heavy


@pytest.mark.parametrize("cli", ["rm.train", "rm.estimate", "rm.plan"])
def test_help_names_the_command_lists_the_groups_and_points_to_the_docs_without_torch(cli, tmp_path):
    """`python -m rm.plan --help` said "__main__ is powered by Hydra"; each command's page is conf/hydra/help/."""
    code, out, err, heavy = run_cli([cli, "--help"], tmp_path)
    assert code == 0, out[-2000:] + err[-2000:]
    assert out.splitlines()[0].startswith(f"python -m {cli} ") and "powered by Hydra" not in out, out[:500]
    groups = dict(line.split(": ", 1) for line in out.splitlines() if line.split(":")[0] in
                  ("model", "memory_profile", "hardware", "lora", "data", "distributed", "train", "experiment"))
    assert len(groups) == 8 and "tiny" in groups["model"] and "qlora" in groups["memory_profile"], out
    assert "README.md" in out and "--cfg job" in out
    assert heavy == set(), f"{cli} --help imported {heavy}"
    assert list(tmp_path.iterdir()) == []


def test_a_misspelt_key_exits_2_naming_it_before_torch_loads(tmp_path):
    code, out, err, heavy = run_cli(["rm.train", "experiment=tiny", "train.learnin_rate=1"], tmp_path)
    assert code == 2 and "train.learnin_rate" in err and "Traceback" not in err, out[-2000:] + err[-2000:]
    assert heavy == set(), f"a composition error imported {heavy}"
    assert list(tmp_path.iterdir()) == []  # no run directory either


def test_help_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`python -m rm.train --help | head -1`: the reader closes the pipe after one line; the command must end with
    exit 0 and no BrokenPipeError traceback (it printed one before)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "rm.train", "--help"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**__import__("os").environ,
                                                         "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    proc.stdout.readline()
    proc.stdout.close()  # as head does, before the rest is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err[-2000:]


def _record(name, level=logging.INFO, **extra):
    record = logging.LogRecord(name, level, __file__, 1, "a line", None, None)
    record.__dict__.update(extra)
    return record


def test_the_console_shows_rm_lines_and_warnings_and_the_log_file_the_rest():
    from rm.foundations.cli import DETAIL
    from rm.foundations.quiet import FirstScreen

    screen, rm_logger = FirstScreen(), logging.getLogger("rm")
    level = rm_logger.level
    try:
        rm_logger.setLevel(logging.INFO)
        assert screen.filter(_record("rm.train")) and screen.filter(_record("hydra.core.utils"))
        assert not screen.filter(_record("rm.train", **DETAIL))  # for the log file
        assert not screen.filter(_record("accelerate.state"))  # a library's INFO line
        assert screen.filter(_record("accelerate.state", logging.WARNING))
        assert screen.filter(_record("rm.train", logging.WARNING, **DETAIL))
        rm_logger.setLevel(logging.DEBUG)  # hydra.verbose=rm
        assert screen.filter(_record("rm.train", **DETAIL)) and screen.filter(_record("accelerate.state"))
    finally:
        rm_logger.setLevel(level)


def test_a_run_prints_what_runs_first_then_progress_and_keeps_the_rest_in_its_log(tmp_path):
    """The first block on the console is the run summary, naming the model, the memory profile, the layout, the
    precision, the steps, the global batch and where the output goes; the memory table, the data audit and the
    tokenizer's line are in train.log only. The run is stopped once its summary is out (about 10 s idle)."""
    run_dir, stderr = tmp_path / "run", (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rm.train", "experiment=tiny", "memory_profile=lora", "train.max_steps=2",
                             "data.synthetic_train_size=512", "data.synthetic_test_size=128", f"hydra.run.dir={run_dir}"], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CONF_DIR.parent)})
    lines, block = [], []
    try:
        for line in proc.stdout:  # the console handler flushes each record
            line = line.rstrip("\n")
            if lines and lines[-1].endswith("- run summary") or block and line.startswith("  "):
                block.append(line.strip())
                continue
            if block:
                break
            lines.append(line)
    finally:
        proc.kill()
        proc.wait()
        stderr.close()
    assert lines and lines[-1].endswith("- run summary"), (lines, (tmp_path / "stderr.txt").read_text()[-3000:])
    # Before it, at most rm saying that it prepares data (a cold cache): nothing for the record only.
    assert all("reading, normalising and tokenising" in line for line in lines[:-1]), lines
    facts = {" ".join(line.split()[:2]) if line.startswith("memory profile") else line.split()[0]: line for line in block}
    assert "tiny" in facts["model"] and "lora" in facts["memory profile"] and "LoRA r=16" in facts["memory profile"]
    assert "32-true" in facts["precision"] and "packed" in facts["layout"]
    assert "2 steps" in facts["schedule"] and "= 32 pairs/step" in facts["batch"]
    assert str(run_dir) in facts["output"] and "MiB" in facts["memory"]
    log = (run_dir / "train.log").read_text()
    for detail in ("memory estimate per device", "data audit (", "tokenizer: "):
        assert detail in log and not any(detail in line for line in lines), detail


def test_library_progress_bars_are_off_unless_verbose():
    """datasets' map bars, transformers' "Loading weights", the Hub's "Writing model shards": one line of noise
    each on the demo, where each ends in under a second."""
    import datasets
    import huggingface_hub.utils
    import transformers

    from rm.foundations.quiet import quiet_progress_bars

    rm_logger = logging.getLogger("rm")
    level = rm_logger.level
    try:
        rm_logger.setLevel(logging.DEBUG)  # hydra.verbose=rm
        quiet_progress_bars()
        assert datasets.is_progress_bar_enabled() and transformers.utils.logging.is_progress_bar_enabled()
        rm_logger.setLevel(logging.INFO)
        quiet_progress_bars()
        assert not datasets.is_progress_bar_enabled() and not transformers.utils.logging.is_progress_bar_enabled()
        assert huggingface_hub.utils.are_progress_bars_disabled()
    finally:
        rm_logger.setLevel(level)
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
        huggingface_hub.utils.enable_progress_bars()


# rm.gpu_report estimates every profile (a minute on 2 cores): slow; rm.estimate runs the same code path here.
@pytest.mark.parametrize("cli", ["rm.estimate", pytest.param("rm.gpu_report", marks=pytest.mark.slow)])
def test_commands_that_only_print_leave_no_run_directory(cli, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(CONF_DIR.parent)}
    proc = subprocess.run([sys.executable, "-m", cli, "experiment=tiny"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0 and "fits" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    # Asked for: hydra.run.dir gives the usual run directory with its .hydra/ record.
    proc = subprocess.run([sys.executable, "-m", cli, "experiment=tiny", "hydra.run.dir=kept"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0 and (tmp_path / "kept" / ".hydra" / "config.yaml").is_file()


def test_train_plot_is_drawn_from_metrics_jsonl(tmp_path):
    from rm.evaluation.plots import write_train_plot

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "train", "step": 10, "loss": 0.69}, {"event": "train", "step": 20, "loss": 0.5},
        {"event": "eval", "step": 20, "eval_loss": 0.55}, {"event": "alarm", "step": 20, "name": "x"},
    ]))
    out = write_train_plot(metrics, tmp_path / "train_plot.png")
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    metrics.write_text(json.dumps({"event": "eval", "step": 0, "eval_loss": 0.7}) + "\n")
    assert write_train_plot(metrics, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


@pytest.mark.parametrize("profile", ["full", "lora"])
def test_a_checkpointed_model_builds_without_future_warnings(tiny_cfg, profile):
    """transformers 5.2x deprecates `gradient_checkpointing_enable` and `is_gradient_checkpointing` with a
    FutureWarning on every call; rm calls the new names, and what PEFT still calls is filtered (rm.foundations.quiet)."""
    import warnings

    from rm.modelling.model import apply_memory_profile, build_model
    from rm.foundations.quiet import install

    cfg = tiny_cfg(f"memory_profile={profile}", "lora=r8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, once per call, as a fresh process would show it
        install()  # rm's own filters, which every entry point has (simplefilter cleared them)
        model = apply_memory_profile(build_model(cfg.model, 0, "float32", True), cfg.memory_profile, cfg.lora)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert model.is_activation_checkpointing


def test_each_metrics_record_carries_its_wall_clock_time(tmp_path):
    """Throughput between any two records from the file alone (an outside benchmark polled its mtime before)."""
    import time

    from rm.evaluation.metrics import MetricsLog

    before = time.time()
    MetricsLog(tmp_path, is_main_process=True).write("train", 3, {"loss": 0.5, "bad": float("nan")})
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert before - 0.01 <= record["time"] <= time.time() + 0.01
    assert record == {"event": "train", "step": 3, "time": record["time"], "loss": 0.5, "bad": None}
