"""rm.runs.run_dir: what a run directory refuses, what overwrite replaces, and the run lock."""

from __future__ import annotations

import json
import os
import socket

import pytest

from rm.foundations.errors import Refused
from rm.runs.run_dir import RunDirError, RunLock, check_run_dir, replace_earlier_run


def _earlier_run(run_dir, final=True):
    (run_dir / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    if final:
        (run_dir / "final").mkdir()


def test_an_empty_or_new_directory_starts_fresh(tmp_path):
    assert check_run_dir(tmp_path / "new", resume=False, overwrite=False) == []
    assert check_run_dir(tmp_path, resume=False, overwrite=False) == []


def test_an_earlier_run_is_refused_without_resume_or_overwrite_and_nothing_changes(tmp_path):
    _earlier_run(tmp_path, final=False)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(RunDirError, match="train.checkpoint.resume=true"):
        check_run_dir(tmp_path, resume=False, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_resume_of_a_finished_run_and_resume_with_overwrite_are_refused(tmp_path):
    _earlier_run(tmp_path)
    with pytest.raises(RunDirError, match="finished run"):
        check_run_dir(tmp_path, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="contradict"):
        check_run_dir(tmp_path, resume=True, overwrite=True)


def test_resume_of_an_unfinished_run_is_allowed_and_replaces_nothing(tmp_path):
    _earlier_run(tmp_path, final=False)
    assert check_run_dir(tmp_path, resume=True, overwrite=False) == []


def test_overwrite_names_what_it_replaces_and_replaces_only_that(tmp_path):
    _earlier_run(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    names = check_run_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(names) == ["checkpoints", "final", "metrics.jsonl"]
    assert (tmp_path / "final").exists()  # checking changes nothing
    replace_earlier_run(tmp_path, names)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_second_run_is_refused_naming_the_holder_and_the_lock_is_released(tmp_path):
    with RunLock(tmp_path):
        holder = json.loads((tmp_path / ".lock").read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(Refused, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).__enter__()
    assert not (tmp_path / ".lock").exists()


def test_a_stale_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "since": "x"}))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def test_a_lock_held_on_another_host_is_refused_naming_the_file_to_delete(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": "x"}))
    with pytest.raises(Refused, match=r"elsewhere.*delete .*\.lock"):
        RunLock(tmp_path).__enter__()


def test_what_an_abandoned_write_left_is_removed_and_nothing_else(tmp_path):
    """A run killed mid-write (SIGKILL, a second Ctrl-C) leaves temporary directories that nothing reads; the next
    start removes them, and only them."""
    from rm.runs.run_dir import RunDir

    _earlier_run(tmp_path, final=False)
    left = [tmp_path / ".tmp-final" / "model.safetensors", tmp_path / "checkpoints" / ".tmp-checkpoint-7" / "optimizer.bin",
            tmp_path / ".tmp-replaced-final" / "config.json"]
    for path in left:
        path.parent.mkdir(parents=True)
        path.write_text("half")
    RunDir(tmp_path, resume=True, overwrite=False, is_main=True).remove_abandoned()
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "checkpoints", "checkpoints/checkpoint-2", "metrics.jsonl"]


def test_overwrite_never_leaves_a_half_deleted_final(tmp_path, monkeypatch):
    """The earlier run is renamed out of the way before it is deleted: a stop during the deletion leaves no final/."""
    import shutil

    _earlier_run(tmp_path)
    (tmp_path / "final" / "model.safetensors").write_text("weights")
    real_rmtree = shutil.rmtree

    def stopped_halfway(path, *args, **kwargs):
        if os.path.basename(path).endswith("final") and os.path.exists(path):  # deleting the earlier final/
            raise KeyboardInterrupt
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", stopped_halfway)
    with pytest.raises(KeyboardInterrupt):
        replace_earlier_run(tmp_path, check_run_dir(tmp_path, resume=False, overwrite=True))
    assert not (tmp_path / "final").exists() and (tmp_path / ".tmp-replaced-final").is_dir()


def test_the_resume_command_is_the_run_own_overrides_quoted(tmp_path):
    """Issue 50: followed literally, "Continue with:" must compose the run's config, not the defaults."""
    import shlex

    from rm.runs.run_record import resume_command

    run_dir = tmp_path / "my run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(
        "- experiment=tiny\n- data.train_files=[a b.jsonl]\n- train.checkpoint.resume=true\n- +train.checkpoint.overwrite=false\n")
    command = resume_command(run_dir, overrides=["ignored=1"])
    assert shlex.split(command) == ["python", "-m", "rm.train", "experiment=tiny", "data.train_files=[a b.jsonl]",
                                    "train.checkpoint.resume=true", f"hydra.run.dir={run_dir}"]
    assert shlex.split(resume_command(tmp_path / "no record", ["model=tiny"]))[3] == "model=tiny"


def test_the_run_dir_callback_makes_the_folders_and_a_refused_start_removes_only_its_own(tmp_path, monkeypatch):
    """Hydra makes hydra.run.dir before the job; the callback makes it first, noting which folders are new, so that a
    refused start removes those (while empty) and never one that existed before."""
    from omegaconf import OmegaConf

    from rm.runs.run_record import RunDirCallback, remove_made

    (tmp_path / "outputs").mkdir()
    run_dir = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}, "output_subdir": None}}))
    assert run_dir.is_dir() and RunDirCallback.made == [run_dir, run_dir.parent]
    remove_made(tmp_path / "elsewhere")  # not this start's run directory: nothing removed
    assert run_dir.is_dir()
    remove_made(run_dir)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["outputs"]  # the folder that existed stays
    # A file written since keeps its folder (os.rmdir removes no file).
    RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}, "output_subdir": None}}))
    (run_dir / "train.log").write_text("x")
    remove_made(run_dir)
    assert (run_dir / "train.log").exists()
    # A folder that cannot be made, or written: exit 5 naming it, before Hydra would print its traceback.
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as stop:
        RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "a_file" / "run")}, "output_subdir": None}}))
    assert stop.value.code == 5
    monkeypatch.setattr(os, "access", lambda *_: False)  # a read-only folder (root ignores permissions)
    RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}, "output_subdir": None}}))
    with pytest.raises(SystemExit) as stop:  # only where Hydra writes its record itself (rm.estimate hydra.run.dir=...)
        RunDirCallback().on_run_start(OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path)}, "output_subdir": ".hydra"}}))
    assert stop.value.code == 5
    with pytest.raises(SystemExit) as stop:
        RunDirCallback().on_multirun_start(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "outputs")}}}))
    assert stop.value.code == 5


@pytest.mark.reliability("Faults", "the disk fills while `train.log` is written",
                         "`could not write the run's log <path>: No space left on device`, exit 5, no \"--- Logging error "
                         "---\" traceback; later lines are dropped from the file, not printed as errors")
def test_a_log_file_that_cannot_be_written_is_a_storage_error_once(tmp_path, capsys):
    import errno
    import logging

    from rm.foundations.errors import StorageError, exit_code
    from rm.runs.run_record import RunLog

    handler = RunLog(tmp_path / "train.log", delay=True)
    logger = logging.getLogger("test.full_disk")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("written")

        def full(_):
            raise OSError(errno.ENOSPC, "No space left on device")

        handler.stream.write = full
        with pytest.raises(StorageError, match=rf"could not write the run's log {tmp_path}/train.log: No space left") as err:
            logger.warning("this line meets a full disk")
        assert exit_code(err.value) == 5
        logger.error("the boundary's message")  # dropped from the file, no second error
        assert "Logging error" not in capsys.readouterr().err
        assert (tmp_path / "train.log").read_text().endswith("written\n")
    finally:
        logger.removeHandler(handler)
        handler.close()
