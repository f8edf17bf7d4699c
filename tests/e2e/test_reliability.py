"""Bad configs and faults: a full disk while saving, a damaged checkpoint, a run directory that holds an
earlier run, secrets in the environment, SIGTERM to a real process. The table in docs/reliability.md
points here."""

import errno
import json
import random
import subprocess
import sys

import pytest
import torch

import rm.runs.checkpoint as ckpt
import rm.train as rm_train
import rm.training.run_setup as run_setup
from rm.runs.run_dir import LOCK_FILE, RunDirError, RunLock
from rm.distributed.engine import AccelerateEngine
from rm.foundations.errors import ConfigError, NonFiniteError, Refused, StorageError
from tests.conftest import CONF_DIR, FAST_TINY

ROOT = CONF_DIR.parent
STEPS = ["train.max_steps=4", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_total_limit=3"]


@pytest.mark.reliability("Faults", "disk full (or a crash) while a checkpoint is written", "written to a hidden temporary directory, removed on failure: `CheckpointError: could not write checkpoint-4 ...: No space left on device. The previous checkpoint, .../checkpoint-2, is intact`; exit 5")
def test_full_disk_while_saving_gives_a_clear_error_and_keeps_the_previous_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    real_save = AccelerateEngine.save_state

    def save_until_the_disk_fills(self, directory):
        real_save(self, directory)
        if directory.name.endswith("checkpoint-4"):
            (directory / "model.safetensors").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(AccelerateEngine, "save_state", save_until_the_disk_fills)
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-4 .*No space left on device.*checkpoint-2.* is intact"):
        rm_train.train(tiny_cfg(*STEPS, "train.max_steps=6"), tmp_path)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written directory is gone
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint-2"


@pytest.mark.reliability("Faults", "a checkpoint cut short after writing", "its file sizes do not match `trainer_state.json`: passed over for the previous one, with a warning")
def test_a_checkpoint_cut_short_after_writing_is_passed_over(tiny_cfg, tmp_path):
    rm_train.train(tiny_cfg(*STEPS), tmp_path)
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]  # step 4 is the end: final/, no checkpoint
    state = json.loads((tmp_path / "checkpoints" / "checkpoint-2" / ckpt.STATE_FILE).read_text())
    assert state["step"] == 2 and state["files"]
    # Damage the newest checkpoint the way an interrupted copy or a full network disk does.
    newest = tmp_path / "checkpoints" / "checkpoint-2"
    biggest = max(newest.rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    assert ckpt.latest_checkpoint(tmp_path) is None  # checkpoint-2 was the only one


@pytest.mark.reliability("Faults", "a run directory that already holds a run", "refused unless `train.checkpoint.resume=true` (an unfinished run) or `train.checkpoint.overwrite=true`; a finished run is offered only overwrite or another directory (resume would be refused); exit 2")
def test_a_finished_run_is_not_overwritten_silently(tiny_cfg, tmp_path):
    rm_train.train(tiny_cfg(*STEPS), tmp_path)
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    # No advice that is then refused: a finished run cannot be resumed, so only overwrite and another directory are offered.
    with pytest.raises(FileExistsError, match=r"already holds a finished run \(final/\)\. Keep it and choose another "
                                              r"hydra\.run\.dir, or replace it with train\.checkpoint\.overwrite=true$"):
        rm_train.train(tiny_cfg(*STEPS, "train.seed=7"), tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    # Asked for explicitly, the earlier run is replaced.
    rm_train.train(tiny_cfg(*STEPS, "train.seed=7", "train.checkpoint.overwrite=true"), tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() != before
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
            if '"train"' in l][0] > 0


@pytest.mark.reliability("Faults", "the same, from the command line", "exit 2, no traceback")
def test_cli_refuses_an_earlier_run_dir_with_exit_2(tmp_path):
    (tmp_path / "final").mkdir()
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "already holds a finished run" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def _files(run_dir):
    """Every file under ``run_dir`` with its bytes and modification time."""
    return {str(p.relative_to(run_dir)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.reliability("Faults", "a run refused for its directory (it holds a finished run; `train.checkpoint.resume=true` on it)",
                         "no file under the directory changes, Hydra's `.hydra/` record and `train.log` included (bytes and "
                         "mtime): rm writes them only once the directory is the run's; exit 2")
def test_a_refused_run_changes_no_file_of_the_earlier_run(cli_run, tmp_path):
    import shutil

    from omegaconf import OmegaConf

    from tests.conftest import compose_run

    finished, args = cli_run
    # The record rm wrote once the directory was the run's: what Hydra itself writes.
    record = finished / ".hydra"
    assert (record / "config.yaml").read_text() == OmegaConf.to_yaml(compose_run(args))
    assert OmegaConf.load(record / "overrides.yaml") == args
    assert OmegaConf.load(record / "hydra.yaml").hydra.runtime.output_dir == str(finished)
    assert "saved the reward model" in (finished / "train.log").read_text()
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)  # copy2: mtimes kept
    before = _files(run_dir)
    assert {"final/model.safetensors", "checkpoints/checkpoint-1/trainer_state.json", "metrics.jsonl"} <= set(before)
    for extra, needle in [([], "already holds a finished run"), (["train.checkpoint.resume=true"], "there is nothing to resume")]:
        proc = subprocess.run([sys.executable, "-m", "rm.train", *args, "train.seed=7", *extra, f"hydra.run.dir={run_dir}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and needle in out and "Traceback" not in out, out[-3000:]
        after = _files(run_dir)
        assert after == before, [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A finished 2-step run of the CLI on local data files (``data/train.jsonl``, ``data/test.jsonl``), with a
    checkpoint at step 1; returns ``(run_dir, overrides)``."""
    from rm.data.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("cli_run")
    files = write_synthetic(root / "data", 256, 64, seed=0)
    args = [*FAST_TINY, "data=local", f"data.train_files=[{files['train']}]", f"data.eval_files=[{files['test']}]",
            "data.max_length=64", "train.max_steps=2", "train.checkpoint.save_steps=1", "train.logging.eval_steps=0"]
    proc = subprocess.run([sys.executable, "-m", "rm.train", *args, f"hydra.run.dir={root / 'run'}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "run", args


def _hashes(run_dir):
    """Every file under ``run_dir``: its sha256 and modification time."""
    import hashlib

    return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.reliability("Faults", "a refused start over an earlier run: `train.checkpoint.resume=true` with a changed setting, with "
                         "changed data or with an invalid value; `train.checkpoint.overwrite=true` with an invalid value or missing "
                         "data files; a held lock",
                         "refused before the directory is the run's: every file of the earlier run keeps its sha256 and "
                         "mtime (`.hydra/`, `train.log`, `data_audit.json`, checkpoints, final/); exit 2, 3 for the lock; "
                         "missing files are all named, before the memory estimate prints")
@pytest.mark.parametrize("case", [  # two in the default suite; the fuzz of tests/e2e/test_fuzz_neighbours.py draws others
    "resume_changed_setting", pytest.param("resume_changed_data", marks=pytest.mark.slow),
    pytest.param("resume_invalid_value", marks=pytest.mark.slow), pytest.param("overwrite_invalid_value", marks=pytest.mark.slow),
    "overwrite_missing_files", pytest.param("lock_held", marks=pytest.mark.slow)])
def test_a_refused_start_changes_no_file_of_an_earlier_run(cli_run, tmp_path, case):
    import os
    import shutil

    finished, args = cli_run
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)  # copy2: mtimes kept
    if case.startswith("resume"):
        shutil.rmtree(run_dir / "final")  # as if stopped after checkpoint-1
    extra, code, needles = {
        "resume_changed_setting": (["train.checkpoint.resume=true", "train.optim.learning_rate=0.01"], 2, ["train.optim.learning_rate: 0.002 -> 0.01"]),
        "resume_changed_data": (["train.checkpoint.resume=true"], 2, ["data.train_sha256"]),
        "resume_invalid_value": (["train.checkpoint.resume=true", "train.optim.adam_beta1=1.5"], 2, ["train.optim.adam_beta1=1.5"]),
        "overwrite_invalid_value": (["train.checkpoint.overwrite=true", "train.optim.adam_beta1=1.5"], 2, ["train.optim.adam_beta1=1.5"]),
        "overwrite_missing_files": (["train.checkpoint.overwrite=true", f"data.train_files=[{tmp_path}/gone.jsonl]",
                                     f"data.eval_files=[{tmp_path}/lost*.jsonl]"], 2,
                                    ["data.train_files: no file matches", "gone.jsonl", "data.eval_files: no file matches",
                                     "lost*.jsonl"]),
        "lock_held": (["train.checkpoint.resume=true"], 3, ["is in use by another run"]),
    }[case]
    data = finished.parent / "data" / "train.jsonl"
    original = data.read_bytes()
    if case == "resume_changed_data":  # one row edited in place, under the same config
        lines = original.decode().splitlines(keepends=True)
        row = json.loads(lines[0])
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
        data.write_text(json.dumps(row) + "\n" + "".join(lines[1:]))
    if case == "lock_held":  # a live process (this one) holds the directory
        (run_dir / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": __import__("socket").gethostname(),
                                                     "since": "now"}))
    before = _hashes(run_dir)
    try:
        proc = subprocess.run([sys.executable, "-m", "rm.train", *args, *extra, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
    finally:
        data.write_bytes(original)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code and "Traceback" not in out, out[-3000:]
    for needle in needles:
        assert needle in out, (needle, out[-3000:])
    if case == "overwrite_missing_files":
        assert "memory estimate" not in out  # named before the estimate's table, not after it
    after = _hashes(run_dir)
    assert after == before, [name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]


@pytest.mark.reliability("Configuration", "an invalid or refused run started without `hydra.run.dir`",
                         "Hydra's new `outputs/<date>/<time>/` is removed again (folders that existed before stay)")
def test_a_refused_start_leaves_no_empty_folder(tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "outputs").mkdir()  # existed before: stays
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, "train.optim.adam_beta1=1.5"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "train.optim.adam_beta1=1.5" in out, out[-2000:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["outputs"]  # no outputs/<date>/<time>/ left


@pytest.mark.reliability("Faults", "a `hydra.run.dir` that cannot be made (a parent is a file, read-only, or full)",
                         "`storage error (<path>): Not a directory`; exit 5, not Hydra's traceback and 'could not be composed'")
def test_a_run_dir_that_cannot_be_made_is_a_storage_error(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 5 and "Traceback" not in out, out[-2000:]
    assert f"storage error ({tmp_path / 'a_file' / 'run'})" in out and "could not be composed" not in out, out[-2000:]


@pytest.mark.reliability("Configuration", "`hydra.run.dir` (or a multirun's `hydra.sweep.dir`) that names an existing file",
                         "`hydra.run.dir=<path> is a file, not a directory`; exit 2, the file unchanged (was: `storage "
                         "error (<path>): File exists`, exit 5, and 'check free space and permissions')")
def test_a_run_dir_that_is_a_file_is_named_as_a_setting(tmp_path):
    a_file = tmp_path / "pairs.jsonl"
    a_file.write_text("{}\n")
    for mode, key in (([], "hydra.run.dir"), (["-m"], "hydra.sweep.dir")):
        proc = subprocess.run([sys.executable, "-m", "rm.train", *mode, *FAST_TINY, f"{key}={a_file}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and f"{key}={a_file} is a file, not a directory" in out, out[-2000:]
        assert "Traceback" not in out and "free space" not in out and a_file.read_text() == "{}\n", out[-2000:]


@pytest.mark.reliability("Security", "tokens in the environment (`HF_TOKEN`, `WANDB_API_KEY`)", "never in the log, `metrics.jsonl`, the saved Hydra config or any other file of the run")
def test_secrets_in_the_environment_stay_out_of_the_run_directory(tmp_path):
    secret = "hf_SECRETtoken1234567890"
    proc = subprocess.run(
        [sys.executable, "-m", "rm.train", *FAST_TINY, "train.max_steps=2", "train.logging.eval_steps=0",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "HF_TOKEN": secret, "WANDB_API_KEY": secret},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert secret not in proc.stdout + proc.stderr
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.reliability("Configuration", "unknown group option (`memory_profile=fast`), of an optional group too "
                         "(`experiment=tyni`, which Hydra would drop in silence and compose the flagship)",
                         "named before Hydra composes, with the close matches and the group's options: "
                         "`experiment has no option 'tyni'; did you mean tiny?`")
@pytest.mark.reliability("Configuration", "wrong type (`train.micro_batch_size=abc`)", "Hydra names the key and the value")
@pytest.mark.reliability("Configuration", "unknown or misspelt key (`train.micro_batch=4`, `lora.alpah=8`), a key added to "
                         "a typed group (`+train.foo=1`)", "each named, with its close matches: `train has no key "
                         "'micro_batch'; did you mean train.micro_batch_size or ...?`")
@pytest.mark.reliability("Configuration", "override syntax error (`train.x=[`)", "Hydra's message, then one line quoting the command line")
@pytest.mark.reliability("Configuration", "zero or negative size (`train.global_batch_size=-4`), LoRA rank 0", "`train.global_batch_size=-4 must be in [1, 16777216]`")
@pytest.mark.reliability("Configuration", "LoRA target module not in the model (`lora.target_modules=[qkv]`)", "names the module and lists the accepted ones")
@pytest.mark.reliability("Configuration", "sequence length above the model's maximum", "names `data.max_length` and `model.max_position_embeddings`")
@pytest.mark.reliability("Configuration", "batch sizes that do not divide", "`train.global_batch_size=20 is not divisible by train.micro_batch_size=8 x world size 1`")
@pytest.mark.reliability("Configuration", "bf16 on hardware without bf16", "names `train.precision` and `hardware.bf16`")
@pytest.mark.reliability("Configuration", "a profile that cannot train (`memory_profile=qlora memory_profile.use_lora=false`)", "names the key and what it needs")
@pytest.mark.parametrize("override,needles", [
    ("memory_profile=fast", ["memory_profile", "full", "lora", "offload"]),  # unknown option: its options listed
    ("experiment=tyni", ["experiment has no option 'tyni'; did you mean tiny?"]),  # an optional group's
    ("train.micro_batch_size=abc", ["train.micro_batch_size", "abc"]),  # wrong type
    ("train.micro_batch=4", ["train has no key 'micro_batch'; did you mean train.micro_batch_size or "]),  # unknown key
    ("lora.alpah=8 +train.foo=1", ["lora has no key 'alpah'; did you mean lora.alpha?", "train has no key 'foo'"]),
    ("train.x=[", ["could not be composed from the command line: ", "train.x=["]),  # override syntax
    ("train.global_batch_size=-4", ["train.global_batch_size=-4", "must be in [1, 16777216]"]),
    ("memory_profile=lora lora.r=0", ["lora.r=0", "must be in [1, 65536]"]),
    ("memory_profile=lora lora.target_modules=[qkv]", ["lora.target_modules", "qkv", "accepted: q_proj"]),
    ("data.max_length=100000", ["data.max_length=100000", "model.max_position_embeddings"]),
    ("train.global_batch_size=20", ["train.global_batch_size=20 is not divisible", "train.micro_batch_size=8"]),
    ("train.precision=bf16 hardware.bf16=false", ["train.precision=bf16", "hardware.bf16=false"]),
    ("memory_profile=qlora memory_profile.use_lora=false", ["memory_profile.quantize_base=nf4", "memory_profile.use_lora=true"]),
])
def test_bad_config_fails_before_loading_with_one_message_naming_the_key(tmp_path, override, needles):
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, *override.split(), f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]  # Hydra's own composition errors too (rm.foundations.errors.run_hydra_app)
    for needle in needles:
        assert needle in out, (needle, out[-2000:])
    assert "Traceback" not in out
    assert not (tmp_path / "final").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.reliability("Configuration", "a CUDA hardware profile (`hardware=h100_80g`) on a machine without CUDA",
                         "`rm.train` refuses it before anything loads, naming the profile and `hardware=auto`; "
                         "`rm.estimate` still estimates it")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: the profile is right for it")
def test_a_cuda_profile_without_cuda_is_refused_for_training_not_for_estimating(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, "hardware=h100_80g", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert "hardware=h100_80g is a CUDA profile" in out and "hardware=auto" in out and "Traceback" not in out
    assert not (tmp_path / "final").exists() and not (tmp_path / "metrics.jsonl").exists()
    estimate = subprocess.run([sys.executable, "-m", "rm.estimate", *FAST_TINY, "hardware=h100_80g"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert estimate.returncode == 0 and "hardware=h100_80g" in estimate.stdout, estimate.stderr[-2000:]


@pytest.mark.reliability("Faults", "SIGTERM to a real process at a random step", "exit 143 with a checkpoint; resumed, equal to an uninterrupted run bit for bit")
@pytest.mark.reliability("Faults", "SIGKILL to a real process at a random step", "resumed from the last periodic checkpoint "
                         "(or step 0), equal to an uninterrupted run bit for bit; `metrics.jsonl` holds each step once")
@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_sigterm_at_a_random_step_of_a_real_process_then_resume_equals_an_uninterrupted_run(tmp_path, signum):
    """SLURM pre-emption: SIGTERM to a running ``python -m rm.train`` at a random step (the seed is in
    the assertion message), exit 143 with a checkpoint, ``train.checkpoint.resume=true`` finishes the run, and the
    final weights equal those of a run that was never interrupted, bit for bit on the CPU. SIGKILL (the OOM
    killer, a node lost) leaves no checkpoint of its own: the resume starts from the last periodic one."""
    import os
    import signal
    import time

    from safetensors.torch import load_file

    seed = int.from_bytes(os.urandom(2), "little")
    kill_after = random.Random(seed).randint(2, 9)
    args = [*FAST_TINY, "train.max_steps=12", "train.checkpoint.save_steps=5", "train.logging.eval_steps=0", "train.logging.logging_steps=1"]

    def run(run_dir, *extra):
        return subprocess.Popen([sys.executable, "-m", "rm.train", *args, *extra, f"hydra.run.dir={run_dir}"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    straight = run(tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, straight.stdout.read()[-2000:]

    victim = run(tmp_path / "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        if metrics.exists() and sum('"train"' in l for l in metrics.read_text().splitlines()) >= kill_after:
            victim.send_signal(getattr(signal, signum))
            break
        time.sleep(0.05)
    out = victim.communicate(timeout=600)[0]
    if signum == "SIGTERM":
        assert victim.returncode == 128 + signal.SIGTERM, f"seed {seed}: {out[-2000:]}"
        assert list((tmp_path / "killed" / "checkpoints").glob("checkpoint-*")), f"seed {seed}"
    else:
        assert victim.returncode == -signal.SIGKILL, f"seed {seed}: {out[-2000:]}"
        assert (tmp_path / "killed" / LOCK_FILE).exists()  # left behind: the resume takes the stale lock over

    resumed = run(tmp_path / "killed", "train.checkpoint.resume=true")
    assert resumed.wait(timeout=600) == 0, resumed.stdout.read()[-2000:]
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), f"seed {seed}: resumed weights differ (killed after step {kill_after})"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if r["event"] == "train"]
    assert steps == list(range(1, 13)), f"seed {seed}: {steps}"  # each step once, in order


@pytest.mark.reliability("Data", "zero usable pairs after filtering", "`data local [train]: no usable pairs left (pairs 4 -> 0 used: ...)`")
def test_a_dataset_with_no_usable_pair_is_a_clear_error(tmp_path):
    from rm.data.build import build_split, train_pairs
    from rm.data.tokenizer import run_tokenizer
    from rm.foundations.config import compose

    rows = [{"prompt": "Human: hi", "chosen": " same", "rejected": " same"}] * 3 + [{"prompt": "x", "chosen": "", "rejected": "y"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose(["experiment=tiny", "data=local", f"data.train_files=[{path}]"])
    with pytest.raises(ValueError, match=r"data local \[train\]: no usable pairs left \(pairs 4 -> 0 used"):
        build_split(cfg.data, run_tokenizer(cfg.model, train_pairs(cfg.data)), "train")


# ---- a finished run, copied by each test below, and what may or may not be done with it

SIX = ["train.max_steps=6", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_total_limit=3", "train.logging.logging_steps=1"]


def _cfg(*overrides):
    from rm.foundations.config import to_run_config
    from tests.conftest import compose_run

    return to_run_config(compose_run(FAST_TINY + SIX + list(overrides)))


@pytest.fixture(scope="module")
def six_step_run(tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 2 and 4 (none at 6: the end writes final/)."""
    run_dir = tmp_path_factory.mktemp("six") / "run"
    rm_train.train(_cfg(), run_dir)
    return run_dir


def _copy(run_dir, tmp_path, unfinished=True):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    if unfinished:  # as if it had been stopped after checkpoint-4
        shutil.rmtree(copy / "final")
    return copy


def _flip(path):
    """Change bytes in the middle of ``path`` without changing its size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


@pytest.mark.reliability("Faults", "`train.checkpoint.resume=true` on a finished run (final/ exists), with or without checkpoints",
                         "refused: `holds a finished run (final/): there is nothing to resume`; final/ unchanged; exit 2")
def test_resume_on_a_finished_run_is_refused(six_step_run, tmp_path):
    run_dir = _copy(six_step_run, tmp_path, unfinished=False)
    import shutil

    shutil.rmtree(run_dir / "checkpoints")  # the case that used to retrain from step 0 over final/
    before = (run_dir / "final" / "model.safetensors").read_bytes()
    with pytest.raises(RunDirError, match=r"holds a finished run \(final/\): there is nothing to resume"):
        rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert (run_dir / "final" / "model.safetensors").read_bytes() == before


@pytest.mark.reliability("Faults", "`metrics.jsonl` after a resume (a run killed after its last checkpoint, a fall back "
                         "to an earlier checkpoint)", "the records of steps after the resumed one are dropped before "
                         "they are written again: each step appears once per event")
@pytest.mark.parametrize("fallback", [False, True], ids=["killed-or-export-failed-after-step-6", "fallback-to-checkpoint-2"])
def test_metrics_after_a_resume_hold_each_step_once(six_step_run, tmp_path, fallback):
    from collections import Counter

    run_dir = _copy(six_step_run, tmp_path)  # final/ gone, metrics.jsonl up to step 6: as if killed before the export
    if fallback:
        (run_dir / "checkpoints" / "checkpoint-4" / ckpt.STATE_FILE).unlink()
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"event": "train", "step": 6, "lo')  # a record cut short by the kill
    rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    counts = Counter((r["event"], r["step"]) for r in records)
    assert counts and all(n == 1 for n in counts.values()), counts
    assert max(r["step"] for r in records if r["event"] == "train") == 6


@pytest.mark.reliability("Faults", "every checkpoint's `trainer_state.json` deleted, then `train.checkpoint.resume=true`",
                         "refused, naming each checkpoint and why, with the choices (restore one, or "
                         "`train.checkpoint.overwrite=true`); every file left as it was; exit 5")
@pytest.mark.reliability("Faults", "the newest checkpoint's `trainer_state.json` deleted",
                         "resumes from the previous one, naming the one it passed over and why")
def test_incomplete_checkpoints_are_named_and_never_destroyed_by_a_resume(six_step_run, tmp_path, caplog):
    import logging

    run_dir = _copy(six_step_run, tmp_path)
    (run_dir / "checkpoints" / "checkpoint-4" / ckpt.STATE_FILE).unlink()
    caplog.set_level(logging.INFO)
    rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert "checkpoint-4 cannot be used (trainer_state.json is missing or unreadable)" in caplog.text
    assert f"resumed from {run_dir / 'checkpoints' / 'checkpoint-2'} at step 2" in caplog.text

    run_dir = _copy(six_step_run, tmp_path / "all")
    for state in (run_dir / "checkpoints").glob(f"checkpoint-*/{ckpt.STATE_FILE}"):
        state.unlink()
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint in .* is intact: checkpoint-4: trainer_state\.json is "
                                                  r"missing or unreadable; checkpoint-2: .*train\.checkpoint\.overwrite=true"):
        rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert {p: b for p, b in before.items() if p.name != ".lock"} == after  # nothing deleted, retrained or rewritten


@pytest.mark.reliability("Faults", "bytes changed in a checkpoint without changing its size (`optimizer.bin`, `model.safetensors`)",
                         "its sha256 does not match `trainer_state.json`: passed over for the previous checkpoint with a "
                         "warning, before anything of it is loaded; the run resumes from there and finishes")
@pytest.mark.reliability("Faults", "every checkpoint damaged", "`CheckpointError: ... no checkpoint ... is intact: checkpoint-4: "
                         "optimizer.bin does not match its sha256 ...`; exit 5; nothing loaded")
def test_a_checkpoint_with_changed_bytes_falls_back_to_the_previous_one(six_step_run, tmp_path, caplog):
    caplog.set_level("INFO", logger="rm.train")
    run_dir = _copy(six_step_run, tmp_path)
    _flip(run_dir / "checkpoints" / "checkpoint-4" / "optimizer.bin")
    assert "does not match its sha256" in ckpt.damage(run_dir / "checkpoints" / "checkpoint-4")
    assert ckpt.damage(run_dir / "checkpoints" / "checkpoint-2") is None
    result = rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert result["status"] == "ok" and result["step"] == 6
    assert "checkpoint-4 cannot be used (optimizer.bin does not match its sha256" in caplog.text
    assert "resumed from" in caplog.text and "checkpoint-2 at step 2" in caplog.text

    run_dir = _copy(six_step_run, tmp_path / "all")
    _flip(run_dir / "checkpoints" / "checkpoint-4" / "optimizer.bin")
    _flip(run_dir / "checkpoints" / "checkpoint-2" / "model.safetensors")
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint .* is intact: checkpoint-4: optimizer.bin does not "
                                                   r"match .*checkpoint-2: model.safetensors does not match") as err:
        rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert err.value.exit_code == 5 and "weights_only" not in str(err.value)


def _poison(checkpoint):
    """NaN in a checkpoint's weights, with its manifest rewritten to match: sha256 alone cannot tell."""
    from safetensors.torch import load_file, save_file

    from rm.foundations.cache import file_digest

    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})
    state = json.loads((checkpoint / ckpt.STATE_FILE).read_text())
    state["files"]["model.safetensors"] = {"size": weights.stat().st_size, "sha256": file_digest(weights)}
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps(state))
    assert ckpt.damage(checkpoint) is None


@pytest.mark.reliability("Faults", "a checkpoint whose weights are NaN but whose files match their sha256, then `train.checkpoint.resume=true`",
                         "loaded, checked and passed over (`its weights are not finite`) for the previous one; a run that "
                         "then stops on a NaN names as the last good checkpoint only one it loaded and checked or wrote, "
                         "never the newest on disk; all of them NaN: `no checkpoint ... is intact`, exit 5")
def test_a_checkpoint_with_nan_weights_and_matching_sha256_is_never_the_last_good_one(six_step_run, tmp_path, caplog, monkeypatch):
    import rm.training.trainer as trainer

    caplog.set_level("INFO", logger="rm.train")
    run_dir = _copy(six_step_run, tmp_path)
    _poison(run_dir / "checkpoints" / "checkpoint-4")
    real_rewards, calls = trainer.pair_rewards, []

    def nan_from_step_4(model, **inputs):  # 2 micro-batches a step: the 3rd call after the resume is step 4's
        calls.append(1)
        chosen, rejected = real_rewards(model, **inputs)
        return (chosen * float("nan"), rejected) if len(calls) >= 3 else (chosen, rejected)

    monkeypatch.setattr(trainer, "pair_rewards", nan_from_step_4)
    result = rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert "checkpoint-4 matches its sha256 but its weights are not finite" in caplog.text
    assert f"resumed from {run_dir / 'checkpoints' / 'checkpoint-2'} at step 2" in caplog.text
    assert (result["status"], result["step"]) == ("stopped_nonfinite", 3)
    assert f"the last good one is {run_dir / 'checkpoints' / 'checkpoint-2'}." in caplog.text
    monkeypatch.undo()

    run_dir = _copy(six_step_run, tmp_path / "all")
    for checkpoint in (run_dir / "checkpoints").glob("checkpoint-*"):
        _poison(checkpoint)
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint .* is intact: checkpoint-4: its weights are not "
                                                   r"finite .*checkpoint-2: its weights are not finite") as err:
        rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert err.value.exit_code == 5


@pytest.mark.reliability("Faults", "`rm.score` on a model whose weights changed after the export, or are NaN",
                         "changed bytes: `does not match the sha256 in .../weights_sha256.json`, exit 5; NaN weights "
                         "(the sha256 rewritten to match): `weight tensor(s) hold NaN or inf`, exit 4; nothing scored")
def test_score_checks_the_weights_it_loads(six_step_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    import rm.score
    from rm.modelling.bundle import WEIGHT_SUMS, write_weight_sums

    final = tmp_path / "final"
    shutil.copytree(six_step_run / "final", final)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Human: hi", "chosen": " hello", "rejected": " go away"}) + "\n")
    args = ["--model", str(final), "--input", str(pairs)]
    assert rm.score.main(args) == 0
    _flip(final / "model.safetensors")
    with pytest.raises(StorageError, match=rf"model.safetensors does not match the sha256 in .*{WEIGHT_SUMS}") as err:
        rm.score.main(args)
    assert err.value.exit_code == 5

    tensors = load_file(six_step_run / "final" / "model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, final / "model.safetensors", metadata={"format": "pt"})
    write_weight_sums(final)
    with pytest.raises(NonFiniteError, match=rf"1 weight tensor\(s\) hold NaN or inf \({first}\)") as err:
        rm.score.main(args)
    assert err.value.exit_code == 4


@pytest.mark.reliability("Data", "`rm.score` given several `--input` files of different layouts or columns (an hh file "
                         "and a prompt file; texts with and without an extra column; pairs and single texts)",
                         "each file read as its own layout, as `rm.train` reads a split's files, the rows scored in "
                         "order; a bad row named `--input <file> row <n>`; pairs mixed with single texts or "
                         "conversations: exit 2 naming each file, what it holds and its columns (was: datasets' "
                         "`CastError ... column names don't match`)")
def test_score_reads_each_input_file_as_its_own_layout(six_step_run, tmp_path, capsys):
    import rm.score
    from rm.foundations.errors import DataError

    def write(name, *rows):
        path = tmp_path / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return str(path)

    prompt = write("prompt.jsonl", {"prompt": "Human: hi", "chosen": " hello", "rejected": " go away"})
    hh = write("hh.jsonl", {"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: go"},
               {"chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"})
    texts = write("texts.jsonl", {"text": "Human: hi Assistant: hello"})
    texts_with_id = write("texts_id.jsonl", {"text": "Human: hi Assistant: bye", "id": 7})
    model = str(six_step_run / "final")

    out = tmp_path / "scored.jsonl"
    assert rm.score.main(["--model", model, "--input", prompt, hh, "--output", str(out)]) == 0
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["chosen"] for r in scored] == ["Human: hi hello", "\n\nHuman: hi\n\nAssistant: hello",
                                             "\n\nHuman: a\n\nAssistant: b"]
    assert all("reward_chosen" in r and "reward_rejected" in r for r in scored)

    assert rm.score.main(["--model", model, "--input", texts, texts_with_id, "--output", str(out)]) == 0
    assert [r["text"] for r in map(json.loads, out.read_text().splitlines())] == ["Human: hi Assistant: hello",
                                                                                   "Human: hi Assistant: bye"]

    bad = write("bad.jsonl", {"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": 3, "rejected": "b"})
    with pytest.raises(DataError, match=rf"^--input {bad} row 1: 'chosen' is int"):
        rm.score.main(["--model", model, "--input", hh, bad, "--on-malformed", "error"])

    with pytest.raises(DataError, match=rf"^--input mixes pairs and single texts or conversations.*: {prompt}: pairs "
                                        rf"\(columns prompt, chosen, rejected\); {texts}: texts \(columns text\)\. "
                                        "Score each kind in a run of its own"):
        rm.score.main(["--model", model, "--input", prompt, texts])


@pytest.mark.reliability("Faults", "resume with changed settings that shape training (model, data, seed, batch sizes, optimizer, schedule)",
                         "refused, naming each changed key with its old and new value (`train.optim.learning_rate: 0.002 -> 0.01`); exit 2")
def test_resume_refuses_changed_settings_naming_each_key(six_step_run, tmp_path):
    run_dir = _copy(six_step_run, tmp_path)
    changes = ["train.optim.learning_rate=1e-2", "train.seed=7", "data.synthetic_seed=3", "train.global_batch_size=32",
               "train.optim.lr_scheduler_type=linear", "model.num_hidden_layers=3"]
    with pytest.raises(ConfigError) as err:
        rm_train.train(_cfg("train.checkpoint.resume=true", *changes), run_dir)
    for key in ("train.optim.learning_rate: 0.002 -> 0.01", "train.seed: 42 -> 7", "data.synthetic_seed: 0 -> 3",
                "train.global_batch_size: 16 -> 32", "train.optim.lr_scheduler_type: 'cosine' -> 'linear'",
                "model.num_hidden_layers: 2 -> 3", "train.checkpoint.resume_allow_changes=true"):
        assert key in str(err.value), (key, str(err.value))
    # What does not shape training may change freely.
    result = rm_train.train(_cfg("train.checkpoint.resume=true", "train.logging.logging_steps=2", "train.checkpoint.save_total_limit=1"), run_dir)
    assert result["status"] == "ok"


@pytest.mark.reliability("Faults", "resume after the training data changed under the same config (a file edited in place)",
                         "refused naming `data.train_sha256`, the digest of the train token ids")
def test_resume_refuses_train_data_that_changed_under_the_same_config(six_step_run, tmp_path, monkeypatch):
    run_dir = _copy(six_step_run, tmp_path)
    real = run_setup.build_datasets

    def one_pair_edited(data_cfg, tokenizer):
        train, eval_set, audit = real(data_cfg, tokenizer)
        ids = list(train["rejected_input_ids"])
        ids[0] = list(reversed(ids[0]))
        return train.remove_columns("rejected_input_ids").add_column("rejected_input_ids", ids), eval_set, audit

    monkeypatch.setattr(run_setup, "build_datasets", one_pair_edited)
    with pytest.raises(ConfigError) as err:
        rm_train.train(_cfg("train.checkpoint.resume=true"), run_dir)
    assert "data.train_sha256" in str(err.value)


def test_data_digest_follows_the_token_ids_and_their_order():
    import datasets

    from rm.runs.resume import data_digest

    def ds(chosen, rejected):
        return datasets.Dataset.from_dict({"chosen_input_ids": chosen, "rejected_input_ids": rejected, "margin": [0.0] * len(chosen)})

    base = data_digest(ds([[1, 2], [3]], [[1], [4, 5]]))
    assert base == data_digest(ds([[1, 2], [3]], [[1], [4, 5]]))
    assert base != data_digest(ds([[3], [1, 2]], [[4, 5], [1]]))  # order
    assert base != data_digest(ds([[1, 2], [3]], [[1], [4, 6]]))  # one id
    assert base != data_digest(ds([[1], [2, 3]], [[1], [4, 5]]))  # where a sequence ends


@pytest.mark.reliability("Faults", "resume with `train.checkpoint.resume_allow_changes=true` and a new learning rate",
                         "each change logged, and applied: from the resumed step the schedule runs from the new rate")
def test_resume_allow_changes_applies_a_new_learning_rate(six_step_run, tmp_path, caplog):
    run_dir = _copy(six_step_run, tmp_path)
    rm_train.train(_cfg("train.checkpoint.resume=true", "train.checkpoint.resume_allow_changes=true", "train.optim.learning_rate=5e-4"), run_dir)
    assert "train.optim.learning_rate: 0.002 -> 0.0005" in caplog.text
    logged = {r["step"]: r["lr"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r.get("split", "train") == "train" and "lr" in r}
    # Before the resume (from checkpoint-4) the old rate's schedule; after it, the new rate's.
    assert logged[3] == pytest.approx(_cosine_lr(2e-3, 3), rel=1e-6)
    assert logged[5] == pytest.approx(_cosine_lr(5e-4, 5), rel=1e-6)


def _cosine_lr(base, step, warmup=1, total=6):
    """The rate transformers' cosine schedule gives after ``step`` steps (1 warmup step: ceil(0.05 x 6))."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    sched = get_scheduler("cosine", opt, num_warmup_steps=warmup, num_training_steps=total)
    for _ in range(step):
        opt.step()
        sched.step()
    return sched.get_last_lr()[0]


@pytest.mark.reliability("Faults", "a checkpoint past `train.max_steps` (resumed with a lower max_steps)",
                         "`checkpoint-4 is at step 4, but this run ends at step 3`; exit 2")
def test_a_checkpoint_past_max_steps_is_a_clear_error(six_step_run, tmp_path):
    run_dir = _copy(six_step_run, tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint-4 is at step 4, but this run ends at step 3"):
        rm_train.train(_cfg("train.checkpoint.resume=true", "train.checkpoint.resume_allow_changes=true", "train.max_steps=3"), run_dir)


@pytest.mark.reliability("Faults", "SIGTERM (a SLURM pre-emption, `kill`) during the last step",
                         "the run finishes: the final model is written, not a checkpoint at the last step that no "
                         "resume could continue (it would be at `train.max_steps`); exit 0")
def test_a_signal_during_the_last_step_finishes_the_run(tiny_cfg, tmp_path, monkeypatch, caplog):
    import os
    import signal

    real_step = AccelerateEngine.step
    steps = []

    def step_then_signal(self, skip=False):
        steps.append(skip)
        if len(steps) == 4:  # the last step of train.max_steps=4
            os.kill(os.getpid(), signal.SIGTERM)  # rm.training.trainer.StopRequest handles it while the run lasts
        return real_step(self, skip)

    monkeypatch.setattr(AccelerateEngine, "step", step_then_signal)
    result = rm_train.train(tiny_cfg(*STEPS), tmp_path)
    assert result["status"] == "ok" and result["step"] == 4
    assert "received SIGTERM during the last step: writing the final model" in caplog.text
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert [step for step, _ in ckpt.list_checkpoints(tmp_path)] == [2]


@pytest.mark.reliability("Faults", "the disk fills (or safetensors fails) while the final model is written",
                         "`could not write the final model to .../final`; no final/ and no temporary directory left, so "
                         "`train.checkpoint.resume=true` continues; exit 5")
def test_a_failed_final_export_leaves_no_partial_final(tiny_cfg, tmp_path, monkeypatch):
    import rm.modelling.bundle
    from safetensors import SafetensorError

    real_save = rm.modelling.bundle.save_bundle

    def save_until_the_disk_fills(model, tokenizer, directory, **kwargs):
        model.config.save_pretrained(directory)  # what a full disk left behind: config.json only
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(rm.modelling.bundle, "save_bundle", save_until_the_disk_fills)
    with pytest.raises(StorageError, match=r"could not write the final model to .*final: .*No space left") as err:
        rm_train.train(tiny_cfg(*STEPS), tmp_path)
    assert err.value.exit_code == 5
    assert not (tmp_path / "final").exists() and not (tmp_path / ".tmp-final").exists()
    monkeypatch.setattr(rm.modelling.bundle, "save_bundle", real_save)
    assert rm_train.train(tiny_cfg(*STEPS, "train.checkpoint.resume=true"), tmp_path)["status"] == "ok"
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.reliability("Faults", "weights that are not finite when a checkpoint is due",
                         "no checkpoint is written (never a 'good' one with NaN weights): `NonFiniteError`; exit 4")
def test_non_finite_weights_are_never_saved_as_a_checkpoint(tmp_path):
    class Engine:  # the part of rm.distributed.engine's interface that saving uses
        device, is_main_process, process_index, num_processes = torch.device("cpu"), True, 0, 1
        model = torch.nn.Linear(2, 2)

        def unwrapped_model(self):
            return self.model

        def reduce(self, tensor, reduction="sum"):
            return tensor

        def wait_for_everyone(self):
            pass

        def save_state(self, directory):
            directory.mkdir(parents=True)
            torch.save(self.model.state_dict(), directory / "model.bin")

    engine = Engine()
    good = ckpt.save_checkpoint(engine, tmp_path, 2, keep=3)
    with torch.no_grad():
        engine.model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"weights at step 4 are not finite.*checkpoint-2, stays") as err:
        ckpt.save_checkpoint(engine, tmp_path, 4, keep=3, last_good=good)
    assert err.value.exit_code == 4
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2]


@pytest.mark.reliability("Faults", "a second run started in a run directory that a live run uses",
                         "refused before anything is written: `is in use by another run (pid N on <host>, since ...)`; exit 3")
@pytest.mark.reliability("Faults", "a lock left by a run that died (its pid is gone on this host)",
                         "taken over with a warning; the new run goes on")
def test_a_run_directory_is_locked(tiny_cfg, tmp_path, caplog):
    import os
    import socket

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "since": "now"}))
        with pytest.raises(Refused, match=rf"is in use by another run \(pid {holder.pid} on ") as err:
            rm_train.train(tiny_cfg(*STEPS), tmp_path)
        assert err.value.exit_code == 3
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # nothing of the refused run
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path):  # the holder is gone: its lock is stale
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"stale lock of {tmp_path}: process {holder.pid} is gone" in caplog.text
    assert not (tmp_path / LOCK_FILE).exists()  # released at the end


def test_a_run_directory_refused_for_an_earlier_run_is_not_claimed_and_unlocked(tmp_path):
    """RunDir decides before it claims: a refused directory keeps its files, its lock is released, its log held."""
    from rm.runs.run_dir import RunDir

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    directory = RunDir(tmp_path, resume=False, overwrite=False, is_main=True)
    with pytest.raises(RunDirError, match=r"holds an earlier run \(metrics\.jsonl\)"):
        with directory:
            pass
    assert not directory.claimed and not (tmp_path / LOCK_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with RunDir(tmp_path, resume=False, overwrite=True, is_main=True) as directory:
        assert not directory.claimed and (tmp_path / "metrics.jsonl").exists()  # replaced only once claimed
        directory.claim()
        assert directory.claimed and not (tmp_path / "metrics.jsonl").exists()
    other = RunDir(tmp_path, resume=False, overwrite=False, is_main=False)
    with other:  # another rank: no lock, no decision; it claims at the same point as the main process
        assert not other.claimed and not (tmp_path / LOCK_FILE).exists()
        other.claim()
        assert other.claimed


@pytest.mark.slow
@pytest.mark.reliability("Faults", "a real full disk (a 5 MB tmpfs) while a checkpoint is written",
                         "`could not write checkpoint-2 ...`; exit 5, no traceback, no `.tmp-checkpoint-*` left")
def test_a_real_full_disk_exits_5_and_leaves_no_temporary_directory(tmp_path):
    import shutil

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs permission to mount a tmpfs")
    try:
        # A large enough model that one checkpoint (weights + AdamW states) does not fit in 5 MB.
        proc = subprocess.run([sys.executable, "-m", "rm.train", *FAST_TINY, "model.hidden_size=256", "model.head_dim=64",
                               "train.max_steps=4", "train.checkpoint.save_steps=2", "train.logging.eval_steps=0", f"hydra.run.dir={mount / 'run'}",
                               "hydra.output_subdir=null", "hydra/job_logging=disabled"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 5, out[-3000:]
        assert "Traceback" not in out and "could not write checkpoint-2" in out, out[-3000:]
        assert not list((mount / "run" / "checkpoints").glob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(mount)])
        shutil.rmtree(mount, ignore_errors=True)


# Run as each rank of a 2-process run: a full disk on one rank only, then rm.train as `python -m rm.train` runs it.
ONE_RANK_FAILS = r"""
import errno, os, runpy, sys

fault, faulty_rank = sys.argv.pop(1), sys.argv.pop(1)
if os.environ["RANK"] == faulty_rank:
    if fault == "checkpoint":  # every rank writes its part of a checkpoint (its RNG state here)
        from rm.distributed.engine import AccelerateEngine

        real_save = AccelerateEngine.save_state

        def save_state(self, directory):
            real_save(self, directory)
            if directory.name.endswith("checkpoint-4"):
                (directory / "partial").write_bytes(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device", str(directory / "partial"))

        AccelerateEngine.save_state = save_state
    elif fault == "deepspeed":  # DeepSpeed writes this rank's ZeRO optimizer shard inside its own save_checkpoint
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        real_ds_save = TorchCheckpointEngine.save

        def ds_save(self, state_dict, path):
            if "checkpoint-4" in str(path) and "optim_states" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_ds_save(self, state_dict, path)

        TorchCheckpointEngine.save = ds_save
    else:  # the main process writes the final model
        import rm.modelling.bundle
        from safetensors import SafetensorError

        def save_bundle(model, tokenizer, directory, **kwargs):
            model.config.save_pretrained(directory)
            raise SafetensorError("Error while serializing: IoError(No space left on device)")

        rm.modelling.bundle.save_bundle = save_bundle
runpy.run_module("rm.train", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.reliability("Faults", "2 processes (DDP): the disk fills on one rank only, while a checkpoint (rank 1) or the "
                         "final model (rank 0) is written",
                         "the ranks agree on the outcome: every rank exits 5 with `could not write checkpoint-4 ...` / "
                         "`could not write the final model ...` (the others name the rank that failed); none waits at a "
                         "barrier; no temporary directory, no final/, the previous checkpoint intact")
@pytest.mark.reliability("Faults", "2 processes (ZeRO-2): the disk fills on one rank only while DeepSpeed's own "
                         "save_checkpoint writes that rank's optimizer shard",
                         "DeepSpeed's writes are deferred past its barriers: every rank exits 5 as above, none waits")
@pytest.mark.parametrize("fault, faulty_rank", [("checkpoint", 1), ("final", 0), ("deepspeed", 1)])
def test_a_save_failing_on_one_rank_fails_every_rank_without_hanging(tmp_path, fault, faulty_rank):
    import os
    import socket
    import time

    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    run_dir = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [*FAST_TINY, f"distributed={'zero2' if fault == 'deepspeed' else 'ddp'}", f"train.max_steps={4 if fault == 'final' else 6}", "train.checkpoint.save_steps=2",
            "train.logging.eval_steps=0", f"hydra.run.dir={run_dir}"]
    # Started by hand with torchrun's variables rather than by torchrun, whose agent stops the other ranks
    # once one exits and would hide a rank left waiting at a barrier.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "PYTHONPATH": str(ROOT), "RM_DEBUG": ""}
    procs = [subprocess.Popen([sys.executable, str(script), fault, str(faulty_rank), *args], cwd=ROOT, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    deadline, outs = time.monotonic() + 420, []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"a rank still runs after {fault} failed on rank {faulty_rank}: it waits for the other at a barrier")
    what = "the final model to" if fault == "final" else "checkpoint-4 in"
    for rank, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 5, f"rank {rank}:\n{out[-3000:]}"
        assert f"could not write {what}" in out or (rank != faulty_rank and "the main process could not write" in out), out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert "No space left on device" in outs[faulty_rank]
    if fault != "final":
        assert f"process(es) {faulty_rank} of this run could not write their part" in outs[1 - faulty_rank]
    assert not list((run_dir / "checkpoints").glob(".tmp-*")) and not (run_dir / ".tmp-final").exists()
    assert not (run_dir / "final").exists()
    assert [step for step, _ in ckpt.list_checkpoints(run_dir)] == [2] and ckpt.damage(ckpt.latest_checkpoint(run_dir)) is None
    assert not (run_dir / LOCK_FILE).exists()
