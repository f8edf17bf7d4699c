"""Verify a run's final bundle again, or fold its LoRA adapter into a plain model: ``python -m rm.export``.

The bundle itself (what it holds, how it is written and checked) is :mod:`rm.modelling.bundle`'s.

    python -m rm.export outputs/<date>/<time>            # verify final/ again (a moved LoRA bundle: and name
                                                         # its base where it now is, for PEFT's AutoPeftModel*)
    python -m rm.export outputs/<date>/<time> --merge    # fold the adapter into final/merged, verify it
    python -m rm.export final/ --merge --out merged/ --base mistralai/Mistral-7B-v0.1
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from rm.foundations.errors import ConfigError, boundary, stop_on_signals
from rm.modelling.bundle import ADAPTER_CONFIG, PROBE_FILE, merge_adapter, rehome, verify_bundle

log = logging.getLogger(__name__)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rm.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run directory (its final/ is used) or a bundle directory")
    parser.add_argument("--merge", action="store_true", help="fold a LoRA adapter into a plain model directory")
    parser.add_argument("--out", type=Path, help="where the merged model goes (default: <bundle>/merged)")
    parser.add_argument("--base", help="the adapter's base model, a hub id or directory (default: adapter_config.json's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    bundle = args.path / "final" if (args.path / "final" / PROBE_FILE).is_file() else args.path
    if not (bundle / PROBE_FILE).is_file():
        raise ConfigError(f"{args.path} holds no bundle ({PROBE_FILE} missing): give a run directory or its final/")
    # Errors end in rm.foundations.errors' boundary (the __main__ block): one message, its exit code, RM_DEBUG's traceback.
    old = rehome(bundle)
    if old is not None:  # moved or copied: PEFT's AutoPeftModel* follow this path as written
        print(f"{bundle / ADAPTER_CONFIG} named its base as {old}; it now names {bundle.resolve()}, the base it holds")
    try:
        if args.merge:
            if not (bundle / ADAPTER_CONFIG).is_file():
                raise ConfigError(f"{bundle} is not a LoRA adapter ({ADAPTER_CONFIG} missing): nothing to merge")
            out = check_out(args.out, bundle) if args.out else bundle / "merged"
            out = merge_into_place(bundle, out, base_model=args.base, device=args.device)
            print(f"merged model written and verified: {out}")
        else:
            verify_bundle(bundle, base_model=args.base, device=args.device)
            print(f"verified: {bundle}")
    except ValueError as err:  # a bundle that is not what it says (rm.modelling.bundle's own checks)
        raise ConfigError(str(err)) from err
    return 0


def check_out(out: Path, bundle: Path) -> Path:
    """``--out`` as a place the merged model may take, or a :class:`ConfigError` naming it; before the merge loads.

    The merge replaces ``out`` whole (:func:`merge_into_place`): a file there, the adapter bundle itself (or a folder
    holding it), or a directory with files of its own (another run's final/, a data folder) would be deleted with
    it. Only ``<bundle>/merged``, where rm.export's own merges go, is replaced when it exists.
    """
    target, source = out.expanduser().resolve(), bundle.resolve()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"--out {out} is a file: give a directory for the merged model (a new one)")
    if target == source or source.is_relative_to(target):
        raise ConfigError(f"--out {out} holds the adapter bundle {bundle}, which the merged model would replace: "
                          f"give a new directory (the default is {bundle / 'merged'})")
    if target != source / "merged" and target.is_dir() and any(target.iterdir()):
        raise ConfigError(f"--out {out} already holds files, which the merged model would replace: give a new "
                          "directory, or remove that one first")
    return out


def merge_into_place(bundle: Path, out: Path, **merge_args) -> Path:
    """:func:`rm.modelling.bundle.merge_adapter` into a hidden temporary directory beside ``out``, renamed to ``out``
    once written and verified: a merge stopped (a signal, a full disk) leaves no ``out`` that looks like a model, and
    its temporary directory is removed. An earlier ``out`` is replaced only by a whole new one."""
    out = Path(out)
    tmp, old = out.with_name(f".tmp-{out.name}"), out.with_name(f".tmp-replaced-{out.name}")
    for leftover in (tmp, old):  # from a merge stopped harder (SIGKILL)
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        merge_adapter(bundle, tmp, **merge_args)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return out


if __name__ == "__main__":
    # SIGTERM as Ctrl-C: the merge in progress is abandoned whole, exit 128 + N.
    with boundary(log), stop_on_signals():
        sys.exit(main())
