"""What starting an engine changes in the process is undone when the job ends: a Hydra sweep's jobs share one."""

import subprocess
import sys

from tests.conftest import CONF_DIR

# One process, as a sweep's jobs run: an offload (DeepSpeed) job's engine started and released, then a job that
# DDP-trains under torchrun's variables for one process. psutil reports 32 physical cores, as a shared host's may.
SCRIPT = r"""
import os, socket
import psutil
psutil.cpu_count = lambda logical=True: 32 if not logical else 2
import torch, torch.distributed as dist
from tests.conftest import compose_run, FAST_TINY
from rm.foundations.config import to_run_config
from rm.settings.validate import validate
from rm.training.run_setup import _start_engine

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
before = {n: os.environ.get(n) for n in NAMES}
cfg = to_run_config(compose_run(FAST_TINY + ["memory_profile=offload", "train.threads=1"]))
plan = validate(cfg, 1, "test")
engine = _start_engine(cfg, plan, None)
assert type(engine).__name__ == "DeepSpeedEngine" and dist.is_initialized()
engine.release()
assert not dist.is_initialized(), "the one-process group outlived its job"
assert {n: os.environ.get(n) for n in NAMES} == before, {n: os.environ.get(n) for n in NAMES}
engine = _start_engine(cfg, plan, None)  # a second DeepSpeed job of the sweep starts again
engine.release()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
os.environ.pop("OMP_NUM_THREADS", None)
cfg = to_run_config(compose_run(FAST_TINY + ["memory_profile=full", "train.threads=1"]))
plan = validate(cfg, 1, "test")
engine = _start_engine(cfg, plan, None)
assert engine.accelerator.distributed_type.name == "MULTI_CPU"
assert torch.get_num_threads() == plan.threads.count == 1, torch.get_num_threads()
print("ok")
"""


def test_a_one_process_deepspeed_engine_leaves_no_group_and_threads_stay_chosen():
    """Before: the group and RANK/WORLD_SIZE/MASTER_* stayed for the sweep's next job (accelerate took them for
    torchrun's), and accelerate's CPU process group set torch's threads to the physical cores over train.threads."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=CONF_DIR.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-3000:]
