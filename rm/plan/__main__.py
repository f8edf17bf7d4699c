"""The fastest layouts that fit, before a GPU-hour is spent.

    python -m rm.plan [the same overrides as rm.train]      # the five fastest that fit; exit 3 when none does
    python -m rm.plan plan.json=true ...                     # JSON on stdout, nothing else

Each candidate changes only knobs that do not change the math (micro-batch at the same global batch,
checkpointing, grouping, packing, prefix sharing, ZeRO stage, offload), keeps every knob set on the command
line, and, where ``memory_profile`` is not set there, tries the other profiles, marked as changing what trains.
The search is :mod:`rm.plan.search`; the step-time model :mod:`rm.plan.steptime`; the rates
:mod:`rm.plan.constants`; the data's lengths :mod:`rm.plan.lengths`.
"""

from __future__ import annotations

from typing import List

GIB = 1024**3


def format_plan(result, label: str) -> str:
    """The table people read: the config as given, then the fastest that fit."""
    from rm.plan.constants import describe

    lines = [f"rm.plan: {label}", f"lengths: {result.lengths.source}", *describe(result.rates), ""]
    device = "a GPU" if result.given.plan.device == "cuda" else result.given.plan.device
    header = f"{'':3} {'s/step':>8} {'tokens/s':>10} {'pairs/s':>8} {'peak GiB':>9} {'headroom':>9}  overrides"
    lines.append(header)

    def row(mark: str, c) -> str:
        peak = f"{c.peak_bytes / GIB:9.2f}" if c.peak_bytes is not None else f"{'-':>9}"
        room = f"{c.headroom_bytes / GIB:9.2f}" if c.peak_bytes is not None else f"{'-':>9}"
        what = " ".join(c.overrides) or "(as given)"
        tail = "  [changes what trains]" if c.changes_math else ""
        if c.unmeasured:
            tail += f"  (not measured on {device}: {', '.join(c.unmeasured)})"
        return (f"{mark:3} {c.step.seconds:8.3f} {c.step.tokens_per_second:10.0f} {c.step.pairs_per_second:8.1f} "
                f"{peak} {room}  {what}{tail}")

    given = result.given
    lines.append(row("now", given) + ("" if given.fits else f"  ({given.verdict})"))
    for i, c in enumerate(result.top, 1):
        lines.append(row(f"{i}.", c))
    if result.other_profiles:
        lines.append("    changing what trains (another memory_profile), the fastest that fits of each"
                     + (", where faster than 1.:" if result.top else ":"))
        lines += [row("", c) for c in result.other_profiles]
    if not result.top:
        lines.append("    no candidate fits: try a larger device (hardware=...), more processes or a shorter data.max_length")
    counts = {}
    for c in result.candidates:
        counts[c.verdict] = counts.get(c.verdict, 0) + 1
    lines += ["", f"{len(result.candidates)} layouts ({result.skipped} more refused by validation): "
              + ", ".join(f"{n} {v}" for v, n in counts.items())
              + ". Checked fastest first; 'unchecked' ones are slower than those listed."
              + (f" Layouts with a feature never timed on {device} (marked) rank after those that were."
                 if any(c.unmeasured for c in result.candidates) else ""),
              "Predicted from FLOPs, memory traffic and communication (rm/plan/steptime.py); "
              "peak and headroom are rm.estimate's, sized by the data's micro-batches."]
    return "\n".join(lines)


def main() -> None:
    from rm.foundations.cli import asks_for_help
    from rm.plan import forkserver

    if not asks_for_help():  # a help page searches nothing
        forkserver.start()  # the trace workers' imports on the other core (the cold path's longest), before any here
    import gc
    import json
    import logging
    import os
    import sys

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from rm.foundations.cli import help_page, without_bitsandbytes, without_run_dir
    from rm.foundations.config import to_run_config
    from rm.foundations.errors import answer_only_on_stdout, run_hydra_app

    without_run_dir()  # it only prints: no outputs/<date>/<time>/ unless hydra.run.dir is given
    without_bitsandbytes()
    help_page("plan")

    @hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
    def run(raw) -> None:
        with answer_only_on_stdout() as answer:
            from rm.memory.report import estimate_label
            from rm.plan.search import plan

            cfg = to_run_config(raw)
            overrides: List[str] = [o for o in HydraConfig.get().overrides.task if not o.startswith("plan.")]
            result = plan(cfg, overrides)
            forkserver.stop()  # this command searches once
            if cfg.plan.json:
                text = json.dumps(result.to_dict(), indent=2)
            else:
                text = format_plan(result, estimate_label(cfg.model, cfg.memory_profile, result.given.plan))
        print(text, file=answer)
        sys.exit(0 if result.top else 3)

    try:
        run_hydra_app(run)
    except SystemExit as stop:
        # The answer is out and the trace workers are gone: what is left is the interpreter's teardown of torch
        # (0.4-0.5 s measured on a 2-core CPU), which a command that only prints has no use for.
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        gc.collect()  # the workers' pool first: its semaphores unregistered, or the resource tracker warns
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


if __name__ == "__main__":
    main()
