"""The forkserver that ``rm.plan``'s trace workers are forked from (:class:`rm.plan.search.Checker`): started,
its imports begun (:mod:`rm.plan.warm`), and stopped. Only the standard library here: ``python -m rm.plan`` starts
it before importing anything else, since those imports (about 5 s on a 2-core CPU) are what a cold search waits
for first."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys


def context():
    """The forkserver context where two trace workers can run beside this process, else None: one core, no
    forkserver (Windows), or CUDA initialised here."""
    cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    if (os.cpu_count() or 1) < 2 or cuda or "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    return multiprocessing.get_context("forkserver")


def start() -> None:
    """Start the forkserver's imports now; returns at once. Where no workers would be used (one core, no
    forkserver, CUDA initialised), nothing."""
    from multiprocessing import forkserver

    server = context()
    if server is not None:
        server.set_forkserver_preload(["rm.plan.warm"])
        forkserver.ensure_running()  # a running one is kept


def stop() -> None:
    """Stop the forkserver now, if one runs; its next use starts a fresh one. Left alone, it outlives this
    process by its own interpreter's teardown (about 1.5 s with the model's code imported), holding this
    process's stdout and stderr open all that time: ``python -m rm.plan ... | jq`` would wait for it."""
    from multiprocessing import forkserver

    # The stdlib's own stop (private, as is the pid) waits for that teardown; killed first, it waits for nothing,
    # then reaps the server and forgets it, so that the next search starts a fresh one rather than find this
    # one still dying.
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(OSError, AttributeError):
            server._stop()
