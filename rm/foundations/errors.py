"""rm's error types and the one error boundary of its entry points.

Every failure a user can cause or meet (a bad key, a bad row, a full disk, a run that will
not fit) is raised as a subclass of :class:`RmError` whose message names the key, file, row
or path and the fix. The entry points (``rm.train``, ``rm.estimate``, ``rm.score``,
``rm.export``, ``rm.gpu_report``, ``rm.plan``) end through :func:`report`, which prints that message
without a traceback and returns the documented exit code:

==== =====================================================================
code meaning
==== =====================================================================
0    done
1    a bug in rm (the traceback is printed, with a line asking to report it)
2    invalid configuration or data (:class:`ConfigError`, :class:`DataError`), including
     what Hydra cannot compose (unknown key or option, wrong type, bad override syntax)
3    refused: the run will not fit, or another run holds the directory (:class:`Refused`)
4    stopped by a non-finite loss, gradient or weight (:class:`NonFiniteError`)
5    storage: a file could not be written or read back intact (:class:`StorageError`,
     and any ``OSError`` or safetensors error that reaches the boundary)
6    distributed: this rank lost its connection to another rank of the run, which stopped (killed, out of
     memory, crashed) or cannot be reached (:class:`PeerLost`, and gloo's or NCCL's error that reaches the
     boundary); the launcher names the rank that stopped first and exits with its code, and exits 6 itself
     where torchrun could not start the ranks (its rendezvous port in use)
==== =====================================================================

A command stopped by signal N exits 128 + N (SIGTERM 143, SIGINT 130; :class:`Interrupted`).

``RM_DEBUG=1`` adds the traceback to every message.

Hydra catches exceptions raised in a task function and prints them with a traceback and
exit status 1, so the boundary must sit inside the task function (:func:`boundary`);
``SystemExit`` passes through Hydra untouched. Hydra reports a config it cannot compose itself,
before the task function starts, and exits 1; :func:`run_hydra_app` turns that exit into 2.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import sys
import traceback
from contextlib import contextmanager, redirect_stdout
from typing import Callable, List, Optional, Sequence

from rm.foundations.launch_env import launch_env

BUG_LINE = (
    "this is a bug in rm, not a problem with your settings or data: please report it with the "
    "command line and the traceback above"
)


class RmError(Exception):
    """An expected failure; ``str(err)`` is the whole message for the user."""

    exit_code = 2


class ConfigError(RmError, ValueError):
    """Settings that cannot work together; the message names every offending key."""


class DataError(RmError, ValueError):
    """Data that cannot be used; the message names the file or split, the row and the reason.

    ``row`` is the 0-based row in the split as read (files concatenated in order), when one row is
    at fault; ``rm.data.build`` turns it into a file and a row of that file.
    """

    def __init__(self, message: str, row: Optional[int] = None):
        super().__init__(message)
        self.row = row


class DataFileNotFound(DataError, FileNotFoundError):
    """A data path or glob matches no file; the message names the pattern and its config key."""


class Refused(RmError):
    """A valid request that rm declines: the run will not fit, or another run holds the directory."""

    exit_code = 3


class NonFiniteError(RmError):
    """A non-finite loss, gradient or weight stopped the run."""

    exit_code = 4


class StorageError(RmError, OSError):
    """A file could not be written or read back intact; the message names the path."""

    exit_code = 5


class Interrupted(KeyboardInterrupt):
    """SIGTERM (a SLURM pre-emption, ``kill``) or SIGINT (Ctrl-C) stopped a command where it was; exit 128 + N.

    A ``KeyboardInterrupt``, so that ``except Exception`` lets it through to the boundary while ``finally`` blocks
    run on the way: an atomic write removes its temporary directory (:func:`stop_on_signals`).
    """

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def ended_if_forked(owner_pid: int, signum: int) -> bool:
    """For a signal handler that process ``owner_pid`` installed: where it runs in a child forked from that process (a
    DataLoader worker, a multiprocessing pool's process, which inherit Python's handlers with the memory), end the
    child as the signal's default would and return True (the call does not return where the signal ends it). The
    parent's handler would act as the parent there: raise :class:`Interrupted` inside a worker, with its traceback,
    when the pool stops it with SIGTERM, or set a stop flag that no one reads. False in ``owner_pid`` itself."""
    if os.getpid() == owner_pid:
        return False
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return True


@contextmanager
def stop_on_signals():
    """Inside, SIGTERM stops the command as Ctrl-C does (:class:`Interrupted`), where Python's default for SIGTERM
    would end the process at once, in the middle of a write. For commands with nothing worth finishing
    (``rm.export``, ``rm.score``): each write they make is atomic, abandoned whole. ``rm.train`` keeps its own
    handler (``rm.training.trainer.StopRequest``), which finishes a step and writes a checkpoint. A process forked
    inside (:func:`ended_if_forked`) ends as the signal's default would."""

    owner = os.getpid()

    def interrupt(signum, frame):
        if ended_if_forked(owner, signum):
            return
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def named_hub_source(key: str, value: str):
    """Inside, transformers' failure to fetch ``value`` from the Hugging Face Hub (no network, no such repository: an
    ``OSError`` whose text names huggingface.co) is a :class:`StorageError` naming ``key=value`` and what to give
    instead, where the boundary would print transformers' text alone with "check free space and permissions"."""
    try:
        yield
    except OSError as err:
        if isinstance(err, RmError) or "huggingface.co" not in str(err):
            raise
        said = " ".join(str(err).split())
        raise StorageError(f"{key}={value} is not a local directory and could not be read from the Hugging Face Hub "
                           f"here ({said}): give the directory of a downloaded copy ({key}=/path/to/it), or download "
                           f"it where the Hub can be reached (huggingface-cli download {value}) and run with "
                           "HF_HUB_OFFLINE=1 to use that cache") from err


class PeerLost(RmError):
    """This rank lost its connection to another rank of the run (which stopped first, or cannot be reached)."""

    exit_code = 6


def _storage_types():
    types = [OSError]
    try:  # safetensors raises its own type (not an OSError) for a full disk or a damaged file
        from safetensors import SafetensorError

        types.append(SafetensorError)
    except ImportError:
        pass
    return tuple(types)


# torch.save reports a failed write (a full disk) as a RuntimeError from its zip writer, not an OSError;
# seen on a 5 MB tmpfs: "basic_ios::clear: iostream error", then "[enforce fail at inline_container.cc:...]
# unexpected pos ...".
_TORCH_WRITE_FAILURES = ("iostream error", "inline_container.cc", "PytorchStreamWriter failed", "file write failed")


# Libraries written in Rust (tokenizers) raise a bare Exception carrying the OS error: "No space left on device
# (os error 28)" when a tokenizer is saved to a full disk.
_RUST_OS_ERROR = re.compile(r"\(os error \d+\)")


def is_storage_failure(err: BaseException) -> bool:
    """``err``, or the exception it was raised while handling, is a failed read or write of a file."""
    for e in (err, err.__context__, err.__cause__):
        if isinstance(e, _storage_types()):
            return True
        if isinstance(e, RuntimeError) and any(marker in str(e) for marker in _TORCH_WRITE_FAILURES):
            return True
        if type(e) is Exception and _RUST_OS_ERROR.search(str(e)):
            return True
    return False


# What gloo and NCCL raise in a collective whose peer is gone: a RuntimeError (gloo on CPUs, torch 2.x) or one of
# torch.distributed's DistError types (named here, so that this module does not import torch). Seen with gloo when
# the other rank was SIGKILLed: "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:14755: Connection reset
# by peer. This is typically caused by a remote worker hanging or bugs in the application."
_DIST_ERROR_TYPES = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_FAILURES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "gloo/transport",
                  "remote process exited", "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def peer_failure(err: BaseException) -> Optional[str]:
    """Why ``err`` is the loss of another rank (gloo's or NCCL's own words, one line), or None where it is not."""
    for e in (err, err.__context__, err.__cause__):
        if e is None:
            continue
        text = str(e)
        dist_type = any(c.__name__ in _DIST_ERROR_TYPES for c in type(e).__mro__)
        if dist_type or (isinstance(e, RuntimeError) and any(m in text for m in _PEER_FAILURES)):
            # gloo's line starts with its source file in brackets; the reason follows it
            line = (text.strip().splitlines() or [""])[0]
            line = re.sub(r"^\[[^\]]*\]\s*", "", line)
            return line.split(". This is typically")[0].strip() or type(e).__name__
    return None


def exit_code(err: BaseException) -> int:
    """The documented exit status for ``err`` (1: unexpected, a bug)."""
    if isinstance(err, RmError):
        return err.exit_code
    if is_storage_failure(err):
        return StorageError.exit_code
    if peer_failure(err) is not None:
        return PeerLost.exit_code
    return 1


def peer_lost_message(cause: str) -> str:
    """The message of a rank whose peer is gone: which rank this is, what the backend said, where to look next."""
    env = launch_env()
    rank = f"rank {env.rank or 0} of {env.world_size}" if env.world_size else "this process"
    return (f"{rank} lost its connection to another rank of the run ({cause}): another rank stopped first (killed, "
            "out of memory, or failed; its own message, or the launcher's, names it) or cannot be reached. Nothing is "
            "wrong with this rank's settings or data; resume from the last checkpoint with train.checkpoint.resume=true")


def message(err: BaseException) -> str:
    """What the user reads for ``err``: our own message, or a storage error with its path."""
    if isinstance(err, RmError) or exit_code(err) == 1:
        return str(err)
    if exit_code(err) == PeerLost.exit_code:
        return peer_lost_message(peer_failure(err))
    path = getattr(err, "filename", None)
    what = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    where = f" ({path})" if path else ""
    return f"storage error{where}: {what} [{type(err).__name__}]. Check free space and permissions, then run again"


def debug() -> bool:
    return os.environ.get("RM_DEBUG", "").strip() not in ("", "0", "false", "no")


def report(err: BaseException, log: Optional[logging.Logger] = None) -> int:
    """Print ``err`` for the user and return its exit code.

    Expected errors print ``error: <message>`` only (with the traceback under ``RM_DEBUG=1``);
    anything else prints its traceback and :data:`BUG_LINE`. The message goes to ``log`` when
    logging is set up (under Hydra it then also lands in the run's log file), else to stderr.
    """
    code = exit_code(err)
    text = message(err)
    if code == 1 or debug():
        trace = "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()
        text = f"{trace}\n{BUG_LINE}" if code == 1 else f"{trace}\nerror: {text}"
    else:
        text = f"error: {text}"
    # Under train_rm_distributed.sh every rank meets the same config error: rank 0 prints it, and the launcher prints
    # another rank's only where rank 0 was stopped before it could (a bug's traceback every rank prints).
    if code == 1 or not _launcher_collects() or launch_env().is_main:
        if log is not None and logging.getLogger().handlers:
            log.error("%s", text)
        else:
            print(text, file=sys.stderr)
    record_exit(code, text)
    return code


def _launcher_collects() -> bool:
    return bool(os.environ.get("RM_EXIT_DIR"))


def record_exit(code: int, text: str = "", keep: bool = False) -> None:
    """Under ``train_rm_distributed.sh`` (``RM_EXIT_DIR`` set), leave this rank's exit code and message where the
    launcher reads them: torchrun itself exits 1 with its own traceback whatever the ranks' codes were. ``keep``:
    leave a record already written (with its message) as it is."""
    directory = os.environ.get("RM_EXIT_DIR")
    if not directory:
        return
    try:
        path = os.path.join(directory, f"rank{launch_env().rank or 0}")
        if keep and os.path.exists(path):
            return
        with open(path + ".tmp", "w") as f:
            f.write(f"{code}\n{text}\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # the launcher then reports torchrun's own exit: nothing is lost but the code


@contextmanager
def boundary(log: Optional[logging.Logger] = None):
    """Turn any exception in the block into its message and exit code (``sys.exit``).

    Use it inside a Hydra task function, where Hydra would otherwise print the traceback and
    exit 1, and around the body of an argparse ``main``.
    """
    task_started()
    try:
        yield
    except KeyboardInterrupt as err:  # Ctrl-C, or Interrupted: SIGTERM too
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        sys.exit(128 + signum)
    except Exception as err:  # noqa: BLE001  (the boundary: every exception ends here, with its code)
        sys.exit(report(err, log))


_task_started = False
# The exit code of the first failed job of a multirun under sweep.on_failure=raise (rm.runs.sweep.job_failed): Hydra
# exits 1 after its sweeper re-raises the job's failure, and run_hydra_app exits with this instead.
sweep_exit_code: Optional[int] = None


class _HeldStderr(io.TextIOBase):
    """Standard error of a rank other than 0 under the launcher, kept until Hydra has composed the config: a
    composition error (Hydra prints it before rm's code runs) reaches the user once, from rank 0, not once per rank."""

    def __init__(self, target):
        self.target, self.parts = target, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def text(self) -> str:
        return "".join(self.parts)


class _CopiedStderr:
    """Standard error passed through, with a copy of what Hydra prints until it has composed the config: the key
    its composition error names (``full_key: train.learning_rate``) may be one that moved (:data:`COMPOSITION_HINTS`).
    Everything else (``fileno``, ``isatty``, ``encoding``) is the real stream's."""

    def __init__(self, target):
        self.target, self.parts, self.copying = target, [], True

    def write(self, text: str) -> int:
        if self.copying:
            self.parts.append(text)
        return self.target.write(text)

    def __getattr__(self, name):
        return getattr(self.target, name)

    def text(self) -> str:
        return "".join(self.parts)


def _release_copy() -> None:
    if isinstance(sys.stderr, _CopiedStderr):
        copied, sys.stderr = sys.stderr, sys.stderr.target
        copied.copying = False  # a logging handler made meanwhile may still hold it: it passes through, keeps nothing


def task_started() -> None:
    """Mark that Hydra composed the config and called the task: an exit 1 from here on is rm's own (a bug).
    A held standard error is written out and released."""
    global _task_started
    _task_started = True
    if isinstance(sys.stderr, _HeldStderr):
        held, sys.stderr = sys.stderr, sys.stderr.target
        sys.stderr.write(held.text())
    _release_copy()


# What a failed composition may mean beyond Hydra's own message: each takes the command line and Hydra's message and
# returns lines to print instead of the generic one (none: not its case). rm.foundations.config adds the one for keys
# that moved (MOVED_KEYS), so that this module, below it, imports nothing of it.
COMPOSITION_HINTS: List[Callable[[Sequence[str], str], List[str]]] = []
# Undo what a start made before Hydra failed to compose a job's config (rm.runs.run_record.undo_sweep_start: a
# multirun's sweep folder and Hydra's multirun.yaml in it, written before the jobs are composed): nothing ran.
COMPOSITION_CLEANUPS: List[Callable[[], None]] = []
# Checks of the command line's names before Hydra composes (rm.foundations.config.unknown_names registers itself: the
# schemas live above this module): each returns one line per unknown name.
NAME_CHECKS: List[Callable[[], List[str]]] = []


def run_hydra_app(main: Callable[[], object]) -> None:
    """Call a ``@hydra.main`` function, with exit 2 for a config Hydra cannot compose or a name that does not exist
    (:func:`rm.foundations.config.unknown_names`, via :data:`NAME_CHECKS`, before Hydra composes).

    Hydra prints why (the key, the option list) and exits 1 before the task function runs, the code
    rm keeps for bugs; the same mistake caught by :mod:`rm.settings.validate` exits 2, and so does this one.
    Its last line is rm's: what :data:`COMPOSITION_HINTS` make of Hydra's message (a key that moved, and where
    to), else the command line quoted.
    """
    held = copied = None
    if _launcher_collects() and not launch_env().is_main:
        held = sys.stderr = _HeldStderr(sys.stderr)
    else:
        copied = sys.stderr = _CopiedStderr(sys.stderr)
    try:
        # What Hydra would compose in silence (an unknown option of an optional group) or name without a guess.
        unknown = [line for check in NAME_CHECKS for line in check()]
        if unknown:
            sys.exit(report(ConfigError("unknown name(s) on the command line:\n  - " + "\n  - ".join(unknown))))
        main()
    except SystemExit as stop:
        if sys.stderr is held:  # Hydra stopped before the task: its message is rank 0's to print
            sys.stderr = held.target
        hydra_message = (held or copied).text()
        _release_copy()
        if isinstance(stop.code, int) and stop.code not in (0, 1):
            # Every exit ends here, also those that bypass report() (a signal's 128+N): the launcher reads the code.
            record_exit(stop.code, keep=True)
        if stop.code == 1 and sweep_exit_code is not None:
            raise SystemExit(sweep_exit_code) from None
        if stop.code == 1 and not _task_started:
            # Hydra's message names the key, except for a syntax error: name what it was given.
            from rm.foundations.cli import NO_RUN_DIR  # added by rm itself, not typed by the user

            given = " ".join(a for a in sys.argv[1:] if a not in NO_RUN_DIR)
            hints = [line for hint in COMPOSITION_HINTS for line in hint(sys.argv[1:], hydra_message)]
            text = "\n".join(hints) or f"error: the config could not be composed from the command line: {given}"
            if held is None:
                print(text, file=sys.stderr)
            for cleanup in COMPOSITION_CLEANUPS:
                cleanup()
            record_exit(2, text if held is None else f"{held.text().strip()}\n{text}")
            raise SystemExit(2) from None
        raise
    except BrokenPipeError:  # `--help | head`: the reader has what it wanted; no traceback for a closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        raise SystemExit(0) from None
    finally:
        _release_copy()


@contextmanager
def answer_only_on_stdout():
    """For commands whose stdout is their answer (a table, or JSON for ``| python -m json.tool``): inside, logs,
    library warnings and prints go to stderr (Hydra's console handler writes to stdout), errors pass through
    :func:`boundary`; yields the real stdout to print the answer on."""
    answer = sys.stdout
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
    with boundary(), redirect_stdout(sys.stderr):
        yield answer
