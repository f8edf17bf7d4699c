"""Profile/strategy validation, the generated DeepSpeed config, and the launcher's arguments."""

import subprocess
import sys

import pytest

from rm.distributed.engine import deepspeed_config
from rm.settings.validate import ConfigError, validate
from tests.conftest import CONF_DIR

ROOT = CONF_DIR.parent


def test_auto_picks_zero2_for_offload_and_ddp_otherwise(tiny_cfg):
    pytest.importorskip("deepspeed")
    assert (validate(tiny_cfg("memory_profile=offload"), 1).strategy, validate(tiny_cfg("memory_profile=offload"), 1).zero_stage) == ("deepspeed", 2)
    plan = validate(tiny_cfg("memory_profile=full"), 1)
    assert (plan.strategy, plan.zero_stage) == ("ddp", 0)
    assert validate(tiny_cfg("distributed=zero3"), 2).zero_stage == 3


@pytest.mark.reliability("Configuration", "profile and distribution that cannot work together (8-bit without bitsandbytes, offload without ZeRO, ...)", "names the keys and the install hint (`pip install 'rm-reward[bnb]'`)")
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["memory_profile=offload", "distributed=ddp"], "memory_profile=offload offloads the optimizer through DeepSpeed ZeRO-Offload, but distributed=ddp"),
        (["memory_profile=8bit", "distributed=zero2"], "memory_profile=8bit (bitsandbytes 8-bit AdamW) with distributed=zero2"),
        (["memory_profile=qlora", "distributed=zero3"], "memory_profile=qlora with distributed=zero3: ZeRO-3 cannot shard 4-bit weights"),
        (["distributed=zero2", "distributed.offload_params=true"], "distributed.offload_params=true needs ZeRO-3"),
        (["distributed=zero2", "distributed.zero_stage=5"], "distributed.zero_stage=5 must be 1, 2 or 3"),
    ],
)
def test_conflicting_combinations_are_rejected_naming_the_keys(tiny_cfg, overrides, needle):
    with pytest.raises(ConfigError) as info:
        validate(tiny_cfg(*overrides), world_size=1)
    assert needle in str(info.value)


def test_deepspeed_config_follows_the_run_settings():
    cfg = deepspeed_config(
        micro_batch_size=4, gradient_accumulation_steps=2, world_size=8, precision="bf16-mixed", max_grad_norm=1.0,
        zero_stage=3, offload_optimizer=True, offload_params=True, hidden_size=256, trainable_params=1_000_000,
        optimizer_params={"lr": 1e-5, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
    )
    assert cfg["train_batch_size"] == 4 * 2 * 8
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    plain = deepspeed_config(micro_batch_size=1, gradient_accumulation_steps=1, world_size=1, precision="32-true",
                             max_grad_norm=0.0, zero_stage=2, offload_optimizer=False, offload_params=False,
                             hidden_size=256, trainable_params=1_000_000)
    assert "optimizer" not in plain and "offload_optimizer" not in plain["zero_optimization"]
    # ZeRO-1/2 all-reduce the bucket in place: DeepSpeed's reduce-scatter path would all-reduce a flattened copy
    assert plain["zero_optimization"]["reduce_scatter"] is False and "reduce_scatter" not in zero


def launcher(*args, env=None):
    return subprocess.run(["bash", "train_rm_distributed.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "SUBSET NUM_GPUS"),
        (["helpful", "eight"], "NUM_GPUS must be a positive integer, got 'eight'"),
        (["helpful", "0"], "NUM_GPUS must be a positive integer"),
        (["no/such/path", "2"], "SUBSET must be helpful, harmless, synthetic, or an existing file or directory"),
    ],
)
def test_launcher_rejects_bad_arguments(args, needle):
    proc = launcher(*args)
    assert proc.returncode == 2 and needle in proc.stderr


def test_launcher_needs_a_shared_run_dir_on_several_nodes():
    import os

    proc = launcher("helpful", "8", env={**os.environ, "NNODES": "2"})
    assert proc.returncode == 2 and "RUN_DIR" in proc.stderr


def test_launcher_composes_the_torchrun_command(tmp_path):
    """The printed command, with a fake torchrun that only echoes what it got."""
    import os

    (tmp_path / "torchrun").write_text("#!/usr/bin/env bash\necho \"torchrun-args: $*\"\n")
    (tmp_path / "torchrun").chmod(0o755)
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "train.jsonl").write_text("{}\n")
    (tmp_path / "pairs" / "test.jsonl").write_text("{}\n")
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "NNODES": "2", "NODE_RANK": "1",
           "MASTER_ADDR": "node0", "MASTER_PORT": "4242", "RUN_DIR": "/shared/run"}
    proc = launcher(str(tmp_path / "pairs"), "4", "lora=r64", env=env)
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.splitlines()[-1]
    assert got.startswith("torchrun-args: --nnodes 2 --nproc_per_node 4 --node_rank 1 --master_addr node0 --master_port 4242 -m rm.train")
    assert f"data=local data.train_files=[{tmp_path}/pairs/train.jsonl] data.eval_files=[{tmp_path}/pairs/test.jsonl]" in got
    assert got.endswith("hydra.run.dir=/shared/run lora=r64")
    assert proc.stdout.startswith("+ torchrun")


@pytest.mark.reliability("Entry points", "`train_rm_distributed.sh`: a rank fails with a config error (or a refusal, a storage error) and torchrun "
                         "exits 1 with its own `ChildFailedError` traceback",
                         "the script exits with the ranks' code (2, 3, 4, 5), prints the message once, no torchrun "
                         "traceback; a rank stopped by torchrun before it reported is not needed")
def test_launcher_exits_with_the_ranks_code_not_torchruns(tmp_path):
    """A fake torchrun: rank 1 reports exit 2 and its message, rank 0 reports nothing (torchrun stopped it), and
    torchrun prints its own traceback and exits 1, as the real one does."""
    import os

    (tmp_path / "torchrun").write_text(
        "#!/usr/bin/env bash\n"
        "printf '2\\nerror: invalid configuration: train.optim.adam_beta1=1.5 must be in [0, 1)\\n' > \"$RM_EXIT_DIR/rank1\"\n"
        "echo 'rank output' >&2\n"
        "printf 'Traceback (most recent call last):\\n  File \"/usr/bin/torchrun\", line 8, in <module>\\n' >&2\n"
        "echo 'torch.distributed.elastic.multiprocessing.errors.ChildFailedError:' >&2\n"
        "exit 1\n")
    (tmp_path / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RUN_DIR": str(tmp_path / "run")}
    proc = launcher("synthetic", "2", env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("train.optim.adam_beta1=1.5 must be in [0, 1)") == 1 and "rank 1" in proc.stderr
    assert "rank output" in proc.stderr and "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def test_launcher_reports_a_signal_stop_as_128_plus_n_not_torchruns_1(tmp_path):
    """SLURM's requeue reads 143: a rank stopped by SIGTERM (after its checkpoint) reports 143, torchrun exits 1."""
    import os

    from rm.training.launch import summarize

    (tmp_path / "rank0").write_text("143\n\n")
    (tmp_path / "rank1").write_text("143\n\n")
    assert summarize(tmp_path, 1) == 143
    (tmp_path / "rank1").write_text("3\nrefusing to start\n")  # an expected error of one rank wins over the signal
    assert summarize(tmp_path, 1) == 3
    for name in os.listdir(tmp_path):
        (tmp_path / name).unlink()
    assert summarize(tmp_path, 1) == 1  # no rank reported: torchrun's own status


def test_a_rank_other_than_0_records_a_composition_error_without_printing_it(tmp_path):
    """A composition error is printed before the job runs, once per rank: rank 1 keeps it for the launcher."""
    import os

    exits = tmp_path / "exits"
    exits.mkdir()
    env = {**os.environ, "RM_EXIT_DIR": str(exits), "RANK": "1"}
    proc = subprocess.run([sys.executable, "-m", "rm.train", "experiment=tiny", "model=nope", f"hydra.run.dir={tmp_path}/run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model/nope" not in proc.stdout + proc.stderr
    code, _, text = (exits / "rank1").read_text().partition("\n")
    assert code == "2" and "model has no option 'nope'" in text  # rm.foundations.config.unknown_names, before Hydra


@pytest.mark.distributed
@pytest.mark.parametrize("override, code, once", [
    # Hydra's, before rm's code runs (one rank's part without a launch: test_a_rank_other_than_0_records_...)
    pytest.param("model=nope", 2, ["model has no option 'nope'"], marks=pytest.mark.slow),
    ("train.optim.adam_beta1=1.5", 2, ["train.optim.adam_beta1=1.5 must be in [0, 1)"]),  # rm.settings.validate's
    # the pre-flight verdict (the summary's choice of code without a launch: test_launcher_reports_a_signal_stop_...)
    pytest.param("hardware.device_memory_gib=0.02", 3, ["refusing to start", "changes that fit"], marks=pytest.mark.slow),
])
def test_launcher_passes_an_error_of_two_real_ranks_through_once(tmp_path, override, code, once):
    import os

    proc = subprocess.run(["bash", "train_rm_distributed.sh", "synthetic", "2", "experiment=tiny", override],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "RUN_DIR": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert all(out.count(text) == 1 for text in once) and "Traceback" not in out, out[-3000:]


def test_deepspeed_buckets_follow_the_hidden_size_and_cap_at_the_trainable_parameters():
    """DeepSpeed allocates each gradient bucket at its full size (measured with the tensor counter), so
    it is capped at the trainable parameters. ZeRO-1/2 keep DeepSpeed's 5e8; ZeRO-3 takes transformers'
    "auto" sizes: hidden_size squared (Mistral-7B: 4096 x 4096), prefetch 0.9 of it, persistence 10 x hidden."""
    small = deepspeed_config(micro_batch_size=1, gradient_accumulation_steps=1, world_size=1, precision="32-true",
                             max_grad_norm=1.0, zero_stage=2, offload_optimizer=True, offload_params=False,
                             hidden_size=1024, trainable_params=361_216)
    assert small["zero_optimization"]["reduce_bucket_size"] == 361_216
    assert small["zero_optimization"]["allgather_bucket_size"] == 361_216
    zero2 = deepspeed_config(micro_batch_size=1, gradient_accumulation_steps=1, world_size=1, precision="bf16-mixed",
                             max_grad_norm=1.0, zero_stage=2, offload_optimizer=False, offload_params=False,
                             hidden_size=4096, trainable_params=7_110_664_192)
    assert zero2["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    big = deepspeed_config(micro_batch_size=1, gradient_accumulation_steps=1, world_size=1, precision="bf16-mixed",
                           max_grad_norm=1.0, zero_stage=3, offload_optimizer=False, offload_params=False,
                           hidden_size=4096, trainable_params=7_110_664_192)
    zero = big["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 40960


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(path, text, proc, timeout=240):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


# The run goes on long enough to be killed while it trains: 256 pairs tokenise in a second, 100,000 steps never end.
_LONG_TINY_RUN = ["experiment=tiny", "data.synthetic_train_size=256", "data.synthetic_test_size=32",
                  "train.max_steps=100000", "train.logging.eval_steps=0", "train.logging.logging_steps=1"]


@pytest.mark.distributed
@pytest.mark.slow  # two ranks of the tiny model over gloo, one SIGKILLed once it trains: about 25 s on 2 busy cores
@pytest.mark.reliability("Faults", "one rank of a distributed run is SIGKILLed (the out-of-memory killer, `kill -9`) while "
                         "the others train", "the survivor exits 6 with `rank 0 of 2 lost its connection to another rank "
                         "of the run (... Connection reset by peer)`, no traceback, not called a bug")
def test_a_rank_whose_peer_is_killed_says_so_and_exits_6(tmp_path):
    """Two ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), without torchrun, so that the
    survivor's own exit code is seen; the launcher's is test_the_launcher_exits_with_the_killed_ranks_code."""
    import os
    import signal

    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in (0, 1):
        logs.append(tmp_path / f"rank{rank}.txt")
        with logs[-1].open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rm.train", *_LONG_TINY_RUN, f"hydra.run.dir={tmp_path}/run"], cwd=ROOT,
                stdout=out, stderr=subprocess.STDOUT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    try:
        assert _wait_for(logs[0], "train:", procs[0]), logs[0].read_text()[-3000:]
        procs[1].send_signal(signal.SIGKILL)
        code = procs[0].wait(timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    out = logs[0].read_text()
    assert code == 6, out[-3000:]
    assert "rank 0 of 2 lost its connection to another rank of the run" in out, out[-3000:]
    assert "Traceback" not in out and "bug in rm" not in out, out[-3000:]


@pytest.mark.distributed
@pytest.mark.slow  # the launcher around two ranks of the tiny model, one SIGKILLed: about 25 s on 2 busy cores
@pytest.mark.reliability("Entry points", "`train_rm_distributed.sh`: one rank is SIGKILLed while the others train (torchrun "
                         "exits 1; the survivor loses its peer)", "the script exits 137 (128 + SIGKILL, the first failing "
                         "rank's) within seconds and names the rank: `rank 1 (pid N) was stopped by SIGKILL`; the survivor "
                         "says it lost its peer; no traceback")
def test_the_launcher_exits_with_the_killed_ranks_code(tmp_path):
    import os
    import signal
    import time

    log = tmp_path / "launcher.txt"
    run_dir = tmp_path / "run"
    with log.open("w") as out:
        launcher_proc = subprocess.Popen(
            ["bash", "train_rm_distributed.sh", "synthetic", "2", *_LONG_TINY_RUN], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, env={**os.environ, "RUN_DIR": str(run_dir), "MASTER_PORT": str(_free_port()),
                                           "OMP_NUM_THREADS": "1"})
    try:
        assert _wait_for(log, "train:", launcher_proc), log.read_text()[-3000:]
        rank1 = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _is_rank(pid, 1, run_dir)]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGKILL)
        killed = time.monotonic()
        code = launcher_proc.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        if launcher_proc.poll() is None:
            launcher_proc.kill()
    out = log.read_text()
    assert code == 128 + signal.SIGKILL, out[-3000:]
    assert f"rank 1 (pid {rank1[0]}) was stopped by SIGKILL" in out, out[-3000:]
    assert "rank 0 of 2 lost its connection to another rank of the run" in out, out[-3000:]
    assert "Traceback" not in out and "bug in rm" not in out, out[-3000:]
    print(f"launcher exited {took:.1f} s after the kill")


def _is_rank(pid, rank, run_dir):
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False
    return (f"hydra.run.dir={run_dir}".encode() in cmdline and f"RANK={rank}".encode() in environ
            and b"TORCHELASTIC_RUN_ID" in b"".join(environ) and b"torchrun" not in b"".join(cmdline))


def test_the_launcher_names_a_rank_torchrun_saw_killed_from_torchruns_own_report(tmp_path, capsys, monkeypatch):
    """torchrun's lines when rank 1 was SIGKILLed (copied from a run) and the survivor's own record (exit 6): the
    launcher exits 137, rank 1's code, and names it; without torchrun's report it exits with the survivor's 6."""
    from rm.training.launch import FailureLog, summarize

    monkeypatch.delenv("NNODES", raising=False)
    (tmp_path / "rank0").write_text("6\nerror: rank 0 of 2 lost its connection to another rank of the run (...)\n")
    assert summarize(tmp_path, 1) == 6
    failures = FailureLog(str(tmp_path))
    for line in [
        "E1129 06:29:07.024000 13193 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        "(exitcode: -9) local_rank: 1 (pid: 13375) of binary: /usr/bin/python\n",
        "Root Cause (first observed failure):\n", "[0]:\n", "  time      : 2026-11-29_06:29:06\n",
        "  rank      : 1 (local_rank: 1)\n", "  exitcode  : -9 (pid: 13375)\n",
    ]:
        failures.feed(line)
    assert (tmp_path / "first").read_text().strip() == "1"
    capsys.readouterr()
    assert summarize(tmp_path, 1) == 137
    assert "rank 1 (pid 13375) was stopped by SIGKILL" in capsys.readouterr().err
    (tmp_path / "rank1").write_text("2\nerror: invalid configuration\n")  # a rank's own expected error still wins
    assert summarize(tmp_path, 1) == 2


def test_the_launcher_names_torchruns_own_failure_before_any_rank_ran(tmp_path, capsys):
    """torchrun's rendezvous port in use: its traceback (which the filter drops) ends on a DistNetworkError and no
    rank ran; the launcher says so with the fix and exits 6, not a silent 1."""
    from rm.training.launch import FailureLog, summarize

    failures = FailureLog(str(tmp_path))
    failures.feed("ModuleNotFoundError: a rank's own traceback, which the filter passes\n")
    assert not (tmp_path / "torchrun").exists()
    failures.in_torchrun = True  # as the filter sets it at torchrun's first frame
    for line in ["Traceback (most recent call last):\n", '  File "/usr/bin/torchrun", line 8, in <module>\n',
                 "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                 "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use\n"]:
        failures.feed(line)
    assert summarize(tmp_path, 1) == 6
    err = capsys.readouterr().err
    assert "torchrun stopped before the ranks started: torch.distributed.DistNetworkError" in err and "MASTER_PORT" in err
