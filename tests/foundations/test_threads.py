"""train.threads: the CPU threads torch computes with, auto by default (rm.foundations.threads)."""

import os

import pytest

from rm.foundations import threads
from rm.foundations.threads import choose_threads


@pytest.fixture
def machine(monkeypatch):
    """A machine of ``cores`` cores at a one-minute load average of ``load``, OMP_NUM_THREADS unset."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def make(cores, load):
        monkeypatch.setattr(threads, "cores_available", lambda: cores)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))

    return make


@pytest.mark.parametrize("cores,load,processes,expected", [
    (2, 0.3, 1, 2),    # idle: every core (this process's own start is in the load)
    (2, 1.2, 1, 1),    # one other busy job: the core it leaves
    (2, 9.0, 1, 1),    # the shared machine of the issue: one thread, never none
    (16, 0.5, 1, 16),
    (16, 6.0, 1, 11),  # the cores the load leaves idle
    (16, 0.5, 4, 4),   # four processes of a launch share the node's cores
])
def test_auto_takes_the_idle_cores_of_this_process(machine, cores, load, processes, expected):
    machine(cores, load)
    chosen = choose_threads(0, processes)
    assert chosen.count == expected
    assert f"load average {load:.1f}" in chosen.reason


def test_a_given_count_and_omp_num_threads_are_taken_as_they_are(machine, monkeypatch):
    machine(2, 9.0)
    assert choose_threads(4) == (4, "train.threads=4")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(0).count == 3 and "OMP_NUM_THREADS=3" in choose_threads(0).reason
    assert choose_threads(2).count == 2  # the key wins over the environment


def test_the_plan_carries_the_threads_and_the_run_sets_them(tiny_cfg, machine):
    import torch

    from rm.memory.preflight import plan_run

    machine(2, 9.0)
    before = torch.get_num_threads()
    try:
        plan, _ = plan_run(tiny_cfg("train.threads=2", "preflight.mode=off"), [])
        assert plan.threads.count == 2 and torch.get_num_threads() == 2
        plan, _ = plan_run(tiny_cfg("preflight.mode=off"), [])
        assert plan.threads.count == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
