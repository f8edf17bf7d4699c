"""Shared command-line behaviour of rm's Hydra apps that only print (rm.estimate, rm.gpu_report)."""

from __future__ import annotations

import sys
from typing import List, Optional

# What keeps Hydra from creating outputs/<date>/<time>/ (with .hydra/ and a log file) for a command
# whose whole output is what it prints: the run directory is the current one, no config copy, no log file.
NO_RUN_DIR = ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
# conf/config.yaml leaves .hydra/ to rm.train (rm.runs.run_record); a command that only prints has no directory
# to refuse, so Hydra writes its record itself when a run directory is asked for.
RECORD = ["hydra.output_subdir=.hydra"]


# log.info(..., extra=DETAIL): a line for the run's log file, on the console only with hydra.verbose
# (rm.foundations.quiet.FirstScreen). Here, not there: the data and tokenizer caches digest this module already.
DETAIL = {"rm_detail": True}


def _sets(argv: List[str], key: str) -> bool:
    return any(a.lstrip("+").startswith(f"{key}=") for a in argv[1:])


def without_run_dir(argv: Optional[List[str]] = None) -> List[str]:
    """Append :data:`NO_RUN_DIR` to ``argv`` (default ``sys.argv``, in place) unless it sets ``hydra.run.dir``
    or ``hydra.output_subdir`` itself, which is how a user asks for the files (with ``hydra.run.dir`` alone,
    Hydra's ``.hydra/`` record: :data:`RECORD`).

    >>> without_run_dir(["rm.estimate", "model=tiny"])[2:4]
    ['hydra.run.dir=.', 'hydra.output_subdir=null']
    >>> without_run_dir(["rm.estimate", "hydra.run.dir=here"])
    ['rm.estimate', 'hydra.run.dir=here', 'hydra.output_subdir=.hydra']
    """
    argv = sys.argv if argv is None else argv
    if not _sets(argv, "hydra.run.dir") and not _sets(argv, "hydra.output_subdir"):
        argv += NO_RUN_DIR
    elif not _sets(argv, "hydra.output_subdir"):
        argv += RECORD
    return argv


def help_page(command: str, argv: Optional[List[str]] = None) -> List[str]:
    """Append ``hydra/help=<command>`` to ``argv`` (default ``sys.argv``, in place) unless it picks a help page:
    ``--help`` then names this command and says what it does (``conf/hydra/help/<command>.yaml``), where Hydra
    would name the calling file (``__main__`` for ``python -m rm.plan``). conf/config.yaml picks rm.train's.

    >>> help_page("plan", ["rm.plan", "--help"])
    ['rm.plan', '--help', 'hydra/help=plan']
    """
    argv = sys.argv if argv is None else argv
    if not _sets(argv, "hydra/help"):
        argv.append(f"hydra/help={command}")
    return argv


def asks_for_help(argv: Optional[List[str]] = None) -> bool:
    """Whether the command line asks Hydra for a help page, which composes the config and runs nothing."""
    return any(a in ("--help", "-h", "--hydra-help") for a in (sys.argv if argv is None else argv)[1:])


def without_bitsandbytes() -> None:
    """Keep bitsandbytes out of a process that only estimates (``rm.estimate``, ``rm.gpu_report``).

    PEFT imports bitsandbytes whenever it is installed, to register its quantised LoRA layers, and
    bitsandbytes compiles its CPU ops with ``torch.compile`` as it is imported: 1.3 s or more of an
    estimate's 8 s on 2 idle cores. The estimate traces plain layers under fake tensors and runs no
    bitsandbytes code (its 8-bit states and NF4 weights are arithmetic), so the module is marked as not
    importable here; ``rm.settings.validate`` still finds it installed on the path.
    """
    sys.modules.setdefault("bitsandbytes", None)
