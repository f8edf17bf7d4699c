"""What ``train_rm_distributed.sh`` does around torchrun: its exit code is the ranks', not torchrun's.

    torchrun ... 2> >(python -m rm.training.launch filter >&2)      # drop torchrun's own traceback from stderr
    python -m rm.training.launch summarize EXIT_DIR TORCHRUN_STATUS  # print the ranks' error once; exit with their code

torchrun exits 1 whenever a rank fails, after printing a ``ChildFailedError`` traceback of its own, so a config
error (exit 2 on every rank) would reach the user as a bug (exit 1) with a traceback that is not rm's. Each rank
leaves its exit code and message in ``RM_EXIT_DIR`` (:func:`rm.foundations.errors.record_exit`); rank 0 prints its message
as it fails, the others do not, and ``summarize`` prints one where rank 0 was stopped before it could.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, Optional, Tuple

# The first lines of the traceback torchrun's elastic agent prints when a child fails (ChildFailedError).
_TORCHRUN_FRAME = re.compile(r'File ".*(torchrun|torch/distributed/(run|elastic|launcher)).*"')


def without_torchrun_traceback(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` up to torchrun's own ``Traceback`` (a traceback whose first frame is torchrun's), which it prints
    last, after every rank has exited; a rank's own traceback passes.

    Example:
        >>> list(without_torchrun_traceback(["a\\n", "Traceback (most recent call last):\\n",
        ...     '  File "/usr/bin/torchrun", line 8, in <module>\\n', "ChildFailedError\\n"]))
        ['a\\n']
    """
    held = None
    for line in lines:
        if held is not None:
            if _TORCHRUN_FRAME.search(line):
                return
            yield held
            held = None
        if line.startswith("Traceback (most recent call last):"):
            held = line
            continue
        yield line
    if held is not None:
        yield held


# torchrun's report of a failed child: a line as it happens, then the summary after its traceback, whose "Root Cause
# (first observed failure)" block names the global rank and its exit code (negative: killed by that signal).
_FAILED_LINE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_RANK_LINE = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: (\d+)\)")
_EXITCODE_LINE = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
# The last line of a traceback: the exception torchrun itself stopped with (the rendezvous port in use, say).
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)(:|$)")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class FailureLog:
    """What torchrun says of ranks that died without a word of their own (SIGKILL: the kernel's out-of-memory killer,
    a scheduler, ``kill -9``): each one's ``killed<RANK>`` record in ``RM_EXIT_DIR`` (code 128+N, a message naming the
    rank and the signal), and ``first``, the rank torchrun observed failing first."""

    def __init__(self, directory: Optional[str]):
        self.directory = Path(directory) if directory else None
        self.root = False
        self.rank: Optional[int] = None
        self.in_torchrun = False  # past the start of torchrun's own traceback (a rank's passes the filter)

    def feed(self, line: str) -> None:
        if self.directory is None:
            return
        if self.in_torchrun and _EXCEPTION_LINE.match(line):  # torchrun's traceback, filtered out: its last line kept
            try:
                (self.directory / "torchrun").write_text(line.strip() + "\n")
            except OSError:
                pass
        if "Root Cause (first observed failure)" in line:
            self.root = True
        if (m := _FAILED_LINE.search(line)) and os.environ.get("NNODES", "1") == "1":
            self._record(int(m.group(2)), int(m.group(1)), int(m.group(3)))  # one node: the local rank is the rank
        if m := _RANK_LINE.search(line):
            self.rank = int(m.group(1))
        elif (m := _EXITCODE_LINE.search(line)) and self.rank is not None:
            self._record(self.rank, int(m.group(1)), int(m.group(2)), first=self.root)
            self.rank, self.root = None, False

    def _record(self, rank: int, code: int, pid: int, first: bool = False) -> None:
        try:
            if first:
                (self.directory / "first").write_text(f"{rank}\n")
            if code >= 0 or (self.directory / f"rank{rank}").exists():
                return  # an exit code of its own: the rank said why itself (rm.foundations.errors.record_exit)
            name = _signal_name(-code)
            hint = " (the kernel's out-of-memory killer sends it: see `dmesg`)" if -code == signal.SIGKILL else ""
            (self.directory / f"killed{rank}").write_text(
                f"{128 - code}\nerror: rank {rank} (pid {pid}) was stopped by {name}{hint}, without a message of its "
                "own\n")
        except OSError:
            pass  # the summary then falls back to the ranks' own codes


def read_exits(directory: Path, prefix: str = "rank") -> Dict[int, Tuple[int, str]]:
    """Per rank that reported one: its exit code and message (``rm.foundations.errors.record_exit``); with
    ``prefix="killed"``, those :class:`FailureLog` wrote for ranks stopped by a signal before they could."""
    exits = {}
    for path in directory.glob(f"{prefix}*"):
        if not path.name[len(prefix):].isdigit():
            continue
        code, _, text = path.read_text().partition("\n")
        if code.strip().lstrip("-").isdigit():
            exits[int(path.name[len(prefix):])] = (int(code), text.strip())
    return exits


def summarize(directory: Path, status: int) -> int:
    """The exit code of the run, and the one message it still needs printed.

    A rank's own code wins over torchrun's 1: the lowest rank's among those that report rm's expected errors
    (2 config, 3 refused, 4 non-finite, 5 storage), else 1 where a rank met a bug, else 128+N of the first rank
    a signal N stopped without a word (SIGKILL: 137, printed here naming the rank; the others then report 6, a lost
    peer), else a rank's 128+N where a signal N stopped it with a checkpoint (SLURM's requeue reads 143), else 6
    where ranks lost a peer, else 6 with torchrun's own error where it stopped before any rank reported (the
    rendezvous port in use), else torchrun's status (a crash before rm started). Rank 0
    printed its message itself; where it reported nothing (torchrun stopped it first), the lowest reporting rank's
    message is printed here.
    """
    if status == 0:
        return 0
    exits = read_exits(directory)
    expected = {rank: ce for rank, ce in exits.items() if 2 <= ce[0] <= 5}
    if expected:
        rank = min(expected)
        code, text = expected[rank]
        if 0 not in exits and text:
            print(f"{text}\n(rank {rank} of the run; rank 0 was stopped before it reported)", file=sys.stderr)
        return code
    if any(code == 1 for code, _ in exits.values()):
        return 1
    killed = read_exits(directory, "killed")  # ranks that died without a word: the cause of the others' failures
    if killed:
        first = (directory / "first").read_text().strip() if (directory / "first").exists() else ""
        rank = int(first) if first.isdigit() and int(first) in killed else min(killed)
        code, text = killed[rank]
        print(text, file=sys.stderr)
        return code
    stopped = [code for code, _ in exits.values() if code >= 128]  # stopped by a signal, with a checkpoint
    if stopped:
        return min(stopped)
    lost = {rank: ce for rank, ce in exits.items() if ce[0] == 6}  # lost a peer that left no record at all
    if lost:
        rank = min(lost)
        if 0 not in exits and lost[rank][1]:
            print(f"{lost[rank][1]}\n(rank {rank} of the run)", file=sys.stderr)
        return 6
    own = (directory / "torchrun").read_text().strip() if (directory / "torchrun").exists() else ""
    if not exits and own and "ChildFailedError" not in own:
        # torchrun failed before any rank ran rm (its traceback was filtered out): its own words, and the usual fix
        hint = ("; another run holds MASTER_PORT: set MASTER_PORT=<a free port>" if "EADDRINUSE" in own
                or "address already in use" in own else "")
        print(f"error: torchrun stopped before the ranks started: {own}{hint}", file=sys.stderr)
        return 6
    return status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["filter"]:
        failures = FailureLog(os.environ.get("RM_EXIT_DIR"))

        def watched(lines):
            for line in lines:
                failures.feed(line)
                yield line

        lines = watched(sys.stdin)
        for line in without_torchrun_traceback(lines):
            sys.stdout.write(line)
            sys.stdout.flush()
        failures.in_torchrun = True
        for _ in lines:  # keep reading (torchrun's summary names the ranks) so torchrun never blocks on a full pipe
            pass
        return 0
    if len(argv) == 3 and argv[0] == "summarize":
        return summarize(Path(argv[1]), int(argv[2]))
    print("usage: python -m rm.training.launch filter | summarize EXIT_DIR STATUS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
