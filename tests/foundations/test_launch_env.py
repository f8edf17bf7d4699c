"""The launcher's environment is read in one place (rm.foundations.launch_env), and the plan carries what it says."""

from rm.foundations.launch_env import launch_env
from rm.memory.terms import estimate_run
from rm.settings.validate import resolve_world_size, validate


def test_a_process_started_alone_and_one_started_by_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    alone = launch_env()
    assert (alone.world_size, alone.rank, alone.local_rank, alone.launched, alone.is_main) == (None, None, 0, False, True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank3 = launch_env()
    assert (rank3.world_size, rank3.rank, rank3.local_rank, rank3.launched, rank3.is_main) == (4, 3, 1, True, False)


def test_one_process_under_a_launcher_is_planned_as_ddp_with_buckets(monkeypatch, tiny_cfg):
    """torchrun with one process still wraps the model in DDP, whose buckets hold every gradient: the plan says
    a launcher started it (a typed field, not the words of its source), and the estimate counts the buckets."""
    cfg = tiny_cfg("distributed=ddp")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = validate(cfg, *resolve_world_size(cfg.distributed, launched=True))
    monkeypatch.setenv("WORLD_SIZE", "1")
    launched = validate(cfg, *resolve_world_size(cfg.distributed, launched=True))
    assert (alone.world_size, alone.launcher) == (1, False) and (launched.world_size, launched.launcher) == (1, True)
    assert estimate_run(cfg, launched).peak_bytes > estimate_run(cfg, alone).peak_bytes
