"""How many CPU threads torch computes with (``train.threads``).

torch's default is one thread per physical core, whether or not other jobs use them. On a shared CPU its threads
then spin waiting for each other while the other jobs hold the cores. On a 2-core machine a tiny-model step took
0.137 s with the default 2 threads and 0.241 s with one when idle, but 6.3 s against 0.43 s beside one busy process
and 12.7 s against 0.80 s at a load average of 8.6 (benchmarks/threads_under_load.py,
benchmarks/results/2026-11-29_threads_under_load.md). ``train.threads=0`` (the default) takes the cores this process
may run on that other work leaves idle, at least one: all of them on an idle machine, one on a busy one. The choice
is made once, at start; ``train.threads=1`` is the safe setting on a machine known to be shared.
"""

from __future__ import annotations

import logging
import math
import os
from typing import NamedTuple, Optional

from rm.foundations.cli import DETAIL

log = logging.getLogger(__name__)


class Threads(NamedTuple):
    """The threads a process computes with, and why, in words (logged at start)."""

    count: int
    reason: str


def cores_available() -> int:
    """The cores this process may run on (its CPU affinity: a container's or a job scheduler's share), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def choose_threads(requested: int, processes_per_node: int = 1) -> Threads:
    """``requested`` threads, or for 0 the cores this process may use that the machine's other work leaves idle.

    Auto, in order: ``OMP_NUM_THREADS`` where set (the user's or the launcher's choice: torchrun sets 1 for several
    processes); else the cores of :func:`cores_available` shared by ``processes_per_node``, less those the
    one-minute load average says are busy (this process's own start counts in it, hence the +1), at least one.

    Args:
        requested: ``train.threads``; 0: auto.
        processes_per_node: training processes sharing this node's cores.

    >>> choose_threads(3).count
    3
    """
    if requested > 0:
        return Threads(requested, f"train.threads={requested}")
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return Threads(int(env), f"train.threads=0 (auto): OMP_NUM_THREADS={env} from the environment")
    cores = max(1, cores_available() // max(1, processes_per_node))
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    idle = math.floor(cores_available() - load + 1) // max(1, processes_per_node)
    count = max(1, min(cores, idle))
    return Threads(count, f"train.threads=0 (auto): {cores} core(s) for this process, load average {load:.1f} over "
                          f"the last minute; spare cores {max(idle, 0)} (train.threads=N to choose)")


def apply_threads(threads: Threads) -> None:
    """Set torch's intra-op and inter-op threads before its first op (inter-op can only be set before any parallel
    work starts; where it has, torch keeps its own and says nothing here)."""
    import torch

    torch.set_num_threads(threads.count)
    try:
        torch.set_num_interop_threads(threads.count)
    except RuntimeError:  # parallel work already started in this process (a test, a second run in one process)
        pass
    log.info("torch threads: %d (%s)", threads.count, threads.reason, extra=DETAIL)  # train.log; the console's first
    # screen is the run summary (rm.foundations.quiet)


def resumed_threads(chosen: Threads, saved: Optional[int]) -> Optional[Threads]:
    """The threads a resumed run computes with when auto chose them: the count its checkpoint's run used (CPU matmuls
    round differently with 1 and 2 threads, and a resume must end where the uninterrupted run would). ``None``: keep
    ``chosen`` (given by ``train.threads`` or ``OMP_NUM_THREADS``, the same already, or an older checkpoint).

    >>> resumed_threads(Threads(1, "train.threads=0 (auto): 2 core(s) ..."), 2).count
    2
    >>> resumed_threads(Threads(1, "train.threads=1"), 2) is None
    True
    """
    if saved is None or int(saved) == chosen.count or not chosen.reason.startswith("train.threads=0 (auto): ") \
            or "OMP_NUM_THREADS" in chosen.reason:
        return None
    return Threads(int(saved), f"train.threads=0 (auto) on resume: the {int(saved)} its checkpoint's run computed "
                               "with, so that the resumed run rounds as the uninterrupted one would")
