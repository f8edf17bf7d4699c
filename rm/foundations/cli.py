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


# Hydra flags whose value is a config directory: option lists then come from elsewhere too.
_CONFIG_DIR_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")


def unknown_names(argv: Optional[List[str]] = None) -> List[str]:
    """Every name on the command line exists, before Hydra composes: a group option (``experiment=tyni``: Hydra drops
    an unknown option of an optional group in silence and composes the flagship), a key (``train.learning_rat=``) or a
    key added to a typed group (``+train.foo=1``: Hydra adds it). Each unknown one is named with its close matches.

    Overrides of ``hydra`` itself, with a package (``group@pkg=``), and values under a ``Dict`` or ``Any`` key are
    left to Hydra; so are the options of groups when a ``--config-dir`` adds a search path.

    Returns:
        One line per unknown name, naming it and the names it is close to (``difflib``); ``[]`` when all exist.
        :func:`rm.foundations.errors.run_hydra_app` makes them a ``ConfigError`` (exit 2).
    """
    import dataclasses
    import difflib
    import typing

    from hydra._internal.config_repository import ConfigRepository
    from hydra._internal.utils import create_config_search_path
    from hydra.core.object_type import ObjectType
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    from rm.foundations.config import CONF_DIR, MOVED_KEYS, RunConfig

    argv = sys.argv if argv is None else argv
    args = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:
        return []  # a syntax error: Hydra's own message names it
    repo = ConfigRepository(config_search_path=create_config_search_path(str(CONF_DIR)))
    check_options = not any(a.split("=", 1)[0] in _CONFIG_DIR_FLAGS for a in argv[1:])

    def close(name: str, names, prefix: str = "") -> str:
        # 0.5: a swapped pair of letters in a short name ('tyni' for 'tiny') scores 0.5
        near = difflib.get_close_matches(name, list(dict.fromkeys(names)), n=3, cutoff=0.5)
        return f"; did you mean {' or '.join(prefix + n for n in near)}?" if near else ""

    problems = []
    for override in overrides:
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or override.package is not None or override.is_delete():
            continue
        if "." not in key and repo.group_exists(key):
            if not check_options:
                continue
            options = repo.get_group_options(key, results_filter=ObjectType.CONFIG)
            shown = [o for o in options if not o.startswith("base_")]  # the schemas stored for the YAML files' defaults
            value = override.value()
            values = value.list if isinstance(value, ChoiceSweep) else value if isinstance(value, list) else [value]
            for option in values:
                if isinstance(option, str) and option not in options:
                    problems.append(f"{key}={option}: {key} has no option {option!r}{close(option, shown)} "
                                    f"(options: {', '.join(shown)})")
            continue
        if key in MOVED_KEYS:  # an old name: composition says where it went (rm.foundations.config.moved_key_errors)
            continue
        node, path = RunConfig, []
        for part in key.split("."):
            fields = {f.name: f for f in dataclasses.fields(node)}
            if part not in fields:
                where = ".".join(path) or "the config (a group or a key)"
                prefix = "".join(p + "." for p in path)
                if path:  # the group's nested keys too: train.learning_rat -> train.optim.learning_rate
                    leaves = _leaves(node)
                    near = difflib.get_close_matches(part, list(dict.fromkeys(leaves)), n=3, cutoff=0.5)
                    hint = f"; did you mean {' or '.join(prefix + n for n in dict.fromkeys(leaves[m] for m in near))}?" if near else ""
                else:
                    names = list(fields) + [g for g in repo.get_group_options("", ObjectType.GROUP) if g != "hydra"]
                    hint = close(part, names)
                problems.append(f"{key}: {where} has no key {part!r}{hint}")
                break
            path.append(part)
            node = typing.get_type_hints(node).get(part)
            node = next((a for a in typing.get_args(node) if dataclasses.is_dataclass(a)), node)  # Optional[X]
            if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
                break  # a value, a Dict or a List: Hydra checks it
    return problems


def _leaves(node) -> dict:
    """Each key of the dataclass ``node`` and of the dataclasses nested in it, by its last name: ``{name: dotted key}``
    (the shallower key wins a name held by two)."""
    import dataclasses
    import typing

    found: dict = {}
    for f in dataclasses.fields(node):
        found.setdefault(f.name, f.name)
    for f in dataclasses.fields(node):
        child = typing.get_type_hints(node).get(f.name)
        if isinstance(child, type) and dataclasses.is_dataclass(child):
            for name, key in _leaves(child).items():
                found.setdefault(name, f"{f.name}.{key}")
    return found
