"""Hydra multirun sweeps: refusals and failures are recorded and the sweep goes on; Optuna; SLURM launcher."""

import csv
import json
import math
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from rm.runs.sweep import format_summary, job_record
from tests.conftest import CONF_DIR

ROOT = CONF_DIR.parent
# Four steps of the tiny model; 0.032 GiB of "device" memory, between the estimates of the jobs
# (full 27.1 MiB, 8bit 25.1, lora r8 32.5, lora r16 33.4, offload 34.5), so some are refused.
SMALL_RUN = [
    "experiment=tiny", "hardware=cpu", "data.synthetic_train_size=256", "data.synthetic_test_size=64",
    "data.max_length=64", "train.micro_batch_size=8", "train.global_batch_size=16", "train.eval_batch_size=16",
    "train.max_steps=4", "train.logging.eval_steps=0", "train.logging.logging_steps=2",
    # Plain pairs: a prefix-shared run's estimate sizes its rows for pairs without a common prompt, so its
    # measured peak sits below the estimate by more than the 2% this sweep checks.
    "train.share_prefix=false",
    "train.layout=given",  # the refusals above are this layout's; train.layout=auto is tested in tests/plan/test_plan.py
]


def multirun(args, sweep_dir, timeout=600):
    try:
        return subprocess.run(
            [sys.executable, "-m", "rm.train", "-m", *SMALL_RUN, *args, f"hydra.sweep.dir={sweep_dir}"],
            cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired as late:  # the sweep's last lines say which job and where: pytest shows only the first
        said = "".join(o.decode(errors="replace") if isinstance(o, bytes) else o for o in (late.stdout, late.stderr) if o)
        pytest.fail(f"the sweep ran past {timeout} s; its output ended:\n{said[-4000:]}")


def summary_rows(sweep_dir):
    with (sweep_dir / "summary.csv").open() as f:
        return list(csv.DictReader(f))


def _check_refused_and_trained(rows, tmp_path):
    """Each job's row: a refused one with its estimate over the usable bytes, its suggestion and no model; a trained
    one within them, its measured peak within 2% of the estimate, and its model written."""
    usable = 0.032 * 1024**3
    for r in rows:
        assert float(r["usable_bytes"]) == pytest.approx(usable)
        if r["status"] == "refused":
            assert float(r["estimated_peak_bytes"]) > usable and r["measured_peak_bytes"] == ""
            assert r["error"].startswith("would fit with: ")
            assert not (tmp_path / r["job_dir"] / "final").exists()
        else:
            assert float(r["estimated_peak_bytes"]) <= usable
            assert float(r["measured_peak_bytes"]) == pytest.approx(float(r["estimated_peak_bytes"]), rel=0.02)
            assert float(r["tokens_per_s"]) > 0 and 0 <= float(r["eval_accuracy"]) <= 1 and float(r["eval_loss"]) > 0
            final = tmp_path / r["job_dir"] / "final"
            assert (final / "config.json").exists() or (final / "adapter_config.json").exists()


def test_a_refused_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Two jobs of the sweep below: the first refused (offload, over 0.032 GiB), the second trains after it."""
    proc = multirun(["hardware.device_memory_gib=0.032", "hardware.headroom_gib=0", "train.logging.track_memory=true",
                     "memory_profile=offload,full", "lora.r=8"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["refused", "ok"]
    _check_refused_and_trained(rows, tmp_path)
    assert "2 jobs: 1 ok, 1 refused, 0 failed" in proc.stderr + proc.stdout


@pytest.mark.slow  # eight jobs, 35 s; the default suite runs the two-job sweep above
def test_profile_sweep_records_refused_jobs_and_goes_on(tmp_path):
    from tests.e2e.readme_samples import SWEEP_ARGS

    proc = multirun(SWEEP_ARGS, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert len(rows) == 8
    status = {(r["overrides"].split()[-2], r["overrides"].split()[-1]): r["status"] for r in rows}
    assert status == {
        ("memory_profile=full", "lora.r=8"): "ok", ("memory_profile=full", "lora.r=16"): "ok",
        ("memory_profile=lora", "lora.r=8"): "ok", ("memory_profile=lora", "lora.r=16"): "refused",
        ("memory_profile=8bit", "lora.r=8"): "ok", ("memory_profile=8bit", "lora.r=16"): "ok",
        ("memory_profile=offload", "lora.r=8"): "refused", ("memory_profile=offload", "lora.r=16"): "refused",
    }
    _check_refused_and_trained(rows, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())[3]["status"] == "refused"
    # The table at the end names every job by what differs between them.
    assert "8 jobs: 5 ok, 3 refused, 0 failed" in proc.stderr + proc.stdout
    assert "memory_profile=offload lora.r=16" in proc.stderr + proc.stdout
    # The sweep sample of docs/distributed.md (tests/e2e/readme_samples.py) is this sweep, recorded: what does not depend on timing must match.
    from tests.e2e.readme_samples import SWEEP_ARGS, load_record

    recorded = load_record()["sweep"]
    assert recorded["args"] == SMALL_RUN + SWEEP_ARGS
    fixed = ("job", "status", "overrides", "estimated_peak_bytes", "usable_bytes", "error")
    assert [{k: r[k] for k in fixed} for r in json.loads((tmp_path / "summary.json").read_text())] == \
        [{k: r[k] for k in fixed} for r in recorded["records"]], "re-record: python -m tests.e2e.readme_samples --run-sweep DIR"


@pytest.mark.parametrize("on_failure,exit_ok", [pytest.param("raise", False, marks=pytest.mark.slow), ("continue", True)])
def test_a_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path, on_failure, exit_ok):
    # The second job asks for a data file that does not exist: it fails when its data load, not at validation.
    proc = multirun([f"sweep.on_failure={on_failure}", "train.max_steps=2",
                     "data.source=synthetic,local", "data.train_files=[missing.jsonl]", "data.eval_files=[missing.jsonl]",
                     "train.seed=1,2"], tmp_path)
    assert (proc.returncode == 0) == exit_ok, proc.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok", "failed", "failed"]
    assert all("missing.jsonl" in r["error"] for r in rows[2:])
    assert "4 jobs: 2 ok, 0 refused, 2 failed" in proc.stderr + proc.stdout or not exit_ok


@pytest.mark.reliability("Configuration", "a multirun (`-m`) with `sweep.on_failure=raise` whose job has an invalid value "
                         "(`train.optim.adam_beta1=1.5,0.9`)", "the job prints its message, the remaining jobs run (Hydra's basic sweeper), "
                         "the multirun exits 2, the job's code, without Hydra's traceback; `summary.json` keeps the "
                         "whole message, naming the key")
def test_an_invalid_job_under_on_failure_raise_ends_the_sweep_with_its_message_and_code(tmp_path):
    proc = multirun(["sweep.on_failure=raise", "train.optim.adam_beta1=1.5,0.9"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "train.optim.adam_beta1=1.5 must be in [0, 1)" in out and "Traceback" not in out, out[-3000:]
    records = json.loads((tmp_path / "summary.json").read_text())
    assert [r["status"] for r in records] == ["failed", "ok"], records
    assert records[0]["error"].startswith("ConfigError: invalid configuration:")
    assert "train.optim.adam_beta1=1.5 must be in [0, 1)" in records[0]["error"]
    assert "the sweep failed: job 0 exited 2" in out


@pytest.mark.reliability("Configuration", "a multirun (`-m`) whose job Hydra cannot compose (`train.micro_batch_size=4,abc`), "
                         "into a new sweep directory or one that existed before",
                         "Hydra's message and rm's line quoting the command line; exit 2; no job ran, and the sweep folder "
                         "Hydra made and its `multirun.yaml` are removed again (a folder that existed before stays, empty "
                         "as it was); was: `multirun.yaml` left in a new sweep folder")
def test_a_multirun_hydra_cannot_compose_leaves_no_sweep_folder(tmp_path):
    new = tmp_path / "sweeps" / "new"
    proc = multirun(["train.micro_batch_size=4,abc"], new)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "could not be composed" in out and "Traceback" not in out, out[-3000:]
    assert list(tmp_path.iterdir()) == [], sorted(str(p) for p in tmp_path.rglob("*"))
    existing = tmp_path / "existing"
    existing.mkdir()
    proc = multirun(["train.micro_batch_size=4,abc"], existing)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert existing.is_dir() and list(existing.iterdir()) == []


@pytest.mark.slow
def test_optuna_study_of_three_trials_counts_refusals_as_failed_trials(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    # lora.r=32 does not fit in 0.0319 GiB (32.7 MiB; r16 needs 33.4), r4 does. The sampler's seed is
    # train.seed: with 1, TPE's three random start-up trials draw r = 4, 32, 4.
    proc = subprocess.run(
        [sys.executable, "-m", "rm.train", "-m", "hparams_search=lora_optuna", *SMALL_RUN, "hardware.device_memory_gib=0.0319", "hardware.headroom_gib=0",
         "train.seed=1", "hydra.sweeper.n_trials=3",
         "hydra.sweeper.sampler.n_startup_trials=3",
         "lora.r=choice(4,32)", f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert len(rows) == 3 and {r["status"] for r in rows} == {"ok", "refused"}
    for r in rows:
        assert r["status"] == ("refused" if "lora.r=32" in r["overrides"] else "ok"), r
    best = (tmp_path / "optimization_results.yaml").read_text()
    ok = [float(r["eval_accuracy"]) for r in rows if r["status"] == "ok"]
    assert ok, "every trial refused: the test's memory limit is wrong"
    assert f"best_value: {max(ok)}" in best


def test_slurm_launcher_takes_gpus_nodes_and_time_from_the_hardware_group(tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", return_hydra_config=True, overrides=[
            "hydra/launcher=submitit_slurm", "hardware=h100_80g", "hardware.nodes=2", "hardware.time_limit_min=720",
            "hardware.slurm_partition=gpu", f"hydra.sweep.dir={tmp_path}", "hydra.job.name=rm",
        ])
    GlobalHydra.instance().clear()
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    params = OmegaConf.to_container(launcher, resolve=True)
    assert {k: params[k] for k in ("nodes", "gpus_per_node", "tasks_per_node", "timeout_min", "partition", "mem_gb")} == {
        "nodes": 2, "gpus_per_node": 8, "tasks_per_node": 8, "timeout_min": 720, "partition": "gpu", "mem_gb": 2048}

    # What sbatch would receive, built the way the plugin builds its executor. No cluster here:
    # submitit only checks that an `srun` exists, so a stub that is never run stands in for it.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{__import__('os').environ['PATH']}")
    executor = submitit.AutoExecutor(folder=params.pop("submitit_folder"), cluster="slurm",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    params = {k if k in base else f"slurm_{k}": v for k, v in params.items() if k != "_target_"}
    executor.update_parameters(**params)
    script = executor._executor._make_submission_file_text("python -m rm.train", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --time=720", "#SBATCH --partition=gpu", "#SBATCH --mem=2048GB", "#SBATCH --job-name=rm"):
        assert line in script, script


def test_summary_table_shows_what_differs_and_why_jobs_did_not_train():
    records = [
        {**job_record(["a=1", "x=1"], "ok", job=0, result={"eval_accuracy": 0.9, "eval_loss": 0.3, "tokens_per_s": 100.0}),
         "job_dir": "0"},
        {**job_record(["a=1", "x=2"], "refused", job=1, error="would fit with: memory_profile=lora"), "job_dir": "1"},
        {**job_record(["a=1", "x=3"], "failed", job=2, error=ValueError("bad\nsecond line")), "job_dir": "2"},
    ]
    table = format_summary(records)
    assert "x=1" in table and "a=1 x=1" not in table and "common to every job: a=1" in table
    assert "would fit with: memory_profile=lora" in table and "ValueError: bad second line" in table
    assert records[2]["error"] == "ValueError: bad\nsecond line"  # summary.json keeps the whole message
    assert "3 jobs: 1 ok, 1 refused, 1 failed" in table
    assert math.isclose(records[0]["eval_accuracy"], 0.9)


@pytest.mark.slow  # parallel jobs on 2 cores; the basic launcher's sweeps run in the default suite
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    proc = multirun(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "train.max_steps=2", "train.seed=1,2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = summary_rows(tmp_path)
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["overrides"].split()[-1] for r in rows] == ["train.seed=1", "train.seed=2"]
    assert "Joblib.Parallel(n_jobs=2" in proc.stderr + proc.stdout
