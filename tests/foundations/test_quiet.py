"""Output a person reads: no dependency warnings (rm.foundations.quiet), `--help` for every CLI, no stray run
directories, the training-loss plot."""

import json
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
