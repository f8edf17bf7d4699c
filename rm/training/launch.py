"""What ``train_rm_distributed.sh`` does around torchrun: its exit code is the ranks', not torchrun's.

    torchrun ... 2> >(python -m rm.training.launch filter >&2)      # drop torchrun's own traceback from stderr
    python -m rm.training.launch summarize EXIT_DIR TORCHRUN_STATUS  # print the ranks' error once; exit with their code

torchrun exits 1 whenever a rank fails, after printing a ``ChildFailedError`` traceback of its own, so a config
error (exit 2 on every rank) would reach the user as a bug (exit 1) with a traceback that is not rm's. Each rank
leaves its exit code and message in ``RM_EXIT_DIR`` (:func:`rm.foundations.errors.record_exit`); rank 0 prints its message
as it fails, the others do not, and ``summarize`` prints one where rank 0 was stopped before it could.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, Tuple

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


def read_exits(directory: Path) -> Dict[int, Tuple[int, str]]:
    """Per rank that reported one: its exit code and message (``rm.foundations.errors.record_exit``)."""
    exits = {}
    for path in directory.glob("rank*"):
        if not path.name[4:].isdigit():
            continue
        code, _, text = path.read_text().partition("\n")
        if code.strip().lstrip("-").isdigit():
            exits[int(path.name[4:])] = (int(code), text.strip())
    return exits


def summarize(directory: Path, status: int) -> int:
    """The exit code of the run, and the one message it still needs printed.

    A rank's own code wins over torchrun's 1: the lowest rank's among those that report rm's expected errors
    (2 config, 3 refused, 4 non-finite, 5 storage), else 1 where a rank met a bug, else a rank's 128+N where a
    signal N stopped it (SLURM's requeue reads 143), else torchrun's status (a crash before rm started). Rank 0
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
    stopped = [code for code, _ in exits.values() if code >= 128]  # stopped by a signal, with a checkpoint
    return min(stopped) if stopped else status


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["filter"]:
        for line in without_torchrun_traceback(sys.stdin):
            sys.stdout.write(line)
            sys.stdout.flush()
        for _ in sys.stdin:  # keep reading so torchrun never blocks on a full pipe
            pass
        return 0
    if len(argv) == 3 and argv[0] == "summarize":
        return summarize(Path(argv[1]), int(argv[2]))
    print("usage: python -m rm.training.launch filter | summarize EXIT_DIR STATUS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
