"""Where the whole ``python -m rm.train`` process spends its time, phase by phase (issue 29 item 6).

    python benchmarks/startup_phases.py experiment=tiny train.max_steps=1 hydra.run.dir=/tmp/phases/run1

Runs the training command in this process with its Hydra overrides, timing each phase from outside the package:
the imports before the first log line, Hydra's composition, then the functions ``rm.training.run_setup`` and ``rm.training.trainer``
call (wrapped here, nothing in ``rm`` changes), and prints one row per phase with the 1-minute load average.
Interpreter start-up and exit are not inside the process's own clock: time the whole command from outside with
``/usr/bin/time -v python -m rm.train ...`` and compare. Run it twice with the same ``RM_CACHE`` to see a warm run
(the memory estimate's traces, the tokenizer and the tokenised data come from the cache).
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections import defaultdict

START = time.perf_counter()
# Libraries a run needs only for some settings (LoRA, 4-bit, DeepSpeed) or at its end (plots): which were imported.
OPTIONAL = ("peft", "bitsandbytes", "deepspeed", "matplotlib", "accelerate", "scipy", "sklearn")
spent = defaultdict(float)
calls = defaultdict(int)
order = []


def timed(module, name: str, label: str) -> None:
    """Wrap ``module.name`` so its time adds to ``label`` (nested wrapped phases are subtracted from the outer)."""
    original = getattr(module, name, None)
    if original is None:
        return
    stack = timed.stack

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        stack.append(0.0)
        try:
            return original(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            inner = stack.pop()
            spent[label] += elapsed - inner
            calls[label] += 1
            if stack:
                stack[-1] += elapsed
            if label not in order:
                order.append(label)

    setattr(module, name, wrapper)


timed.stack = []


def main() -> None:
    import rm.train  # what the command imports before Hydra composes ...
    import rm.training.run_setup as setup  # ... and what its job imports first (rm.train imports it in the job)
    import rm.training.trainer as trainer
    from rm.data.batching import StepBatches

    imported = time.perf_counter()

    for name, label in [
        ("plan_run", "config, validate, worst-case estimate"), ("_start_engine", "engine, seed"),
        ("run_tokenizer", "tokenizer (BPE trained on the train texts)"), ("build_datasets", "data: load, normalise, tokenise"),
        ("build_extra_eval_sets", "data: load, normalise, tokenise"),
        ("check_consumers_tokenize_alike", "consumers tokenize alike"), ("log_prefix_sharing", "prefix-sharing counts"),
        ("run_shapes", "data-sized estimate"), ("data_preflight", "data-sized estimate"),
        ("write_audit", "data audit"), ("format_audit", "data audit"), ("_build_model", "model build"),
        ("summary", "run summary"),
    ]:
        timed(setup, name, label)
    StepBatches.of = classmethod(_timed_plain(StepBatches.of.__func__, "micro-batches"))
    for name, label in [("train_step", "the training step"), ("evaluate_and_save", "final evaluation"),
                        ("write_eval_plots", "plots"), ("write_train_plot", "plots"), ("save_final", "export (save, reload, verify)")]:
        timed(trainer, name, label)
    import rm.foundations.config

    entered = {}
    to_run_config = rm.foundations.config.to_run_config

    def typed(cfg):  # the first thing the task does once Hydra has composed the config
        entered["t"] = time.perf_counter()
        return to_run_config(cfg)

    rm.foundations.config.to_run_config = typed
    code = 0
    try:  # as python -m rm.train runs it: Hydra finds conf/ from the __main__ module's file
        runpy.run_module("rm.train", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code or 0
    end = time.perf_counter()
    load = os.getloadavg()[0]
    rows = [("imports before the first log line", imported - START),
            ("Hydra: compose the config, set up logging", entered.get("t", end) - imported)]
    rows += [(label, spent[label]) for label in order]
    accounted = sum(t for _, t in rows)
    rows.append(("the rest (directory, metrics, monitor, teardown)", (end - START) - accounted))
    print(f"\nphases of: python -m rm.train {' '.join(sys.argv[1:])}  (exit {code}; load average 1 min {load:.2f})",
          file=sys.stderr)
    for label, seconds in rows:
        print(f"  {label:<52} {seconds:7.2f} s", file=sys.stderr)
    print(f"  {'in-process total':<52} {end - START:7.2f} s", file=sys.stderr)
    loaded = [name for name in OPTIONAL if name in sys.modules]
    print(f"  imported of {', '.join(OPTIONAL)}: {', '.join(loaded) or 'none'}", file=sys.stderr)
    sys.exit(code)


def _timed_plain(function, label):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t0
            if timed.stack:
                timed.stack[-1] += time.perf_counter() - t0
            if label not in order:
                order.append(label)
    return wrapper


if __name__ == "__main__":
    main()
