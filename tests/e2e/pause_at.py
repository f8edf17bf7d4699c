"""Run an rm command that pauses at one phase, so that a test can signal it there:
``python -m tests.e2e.pause_at PHASE MODULE [ARGS...]``.

In PHASE the process prints ``PAUSED AT <phase>`` and sleeps :data:`PAUSE_S` seconds, then goes on as it would
have; the test sends its signal on seeing the line. Test-only: the pause is a patch of the function that does
that phase's work, made here before the command's module runs, and nothing in rm knows of it.
"""

from __future__ import annotations

import functools
import runpy
import sys
import time

PAUSE_S = 3.0


def _pausing(phase: str, real, *, after: bool = False, at_call: int = 1):
    """``real`` that pauses on its ``at_call``-th call, before it runs (or ``after`` it, once its work is on disk)."""
    calls = [0]

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        pause = calls[0] == at_call
        if pause and not after:
            _pause(phase)
        result = real(*args, **kwargs)
        if pause and after:
            _pause(phase)
        return result

    return wrapper


def _pause(phase: str) -> None:
    print(f"PAUSED AT {phase}", flush=True)
    time.sleep(PAUSE_S)


def install(phase: str) -> None:
    """Patch the function of ``phase`` (see the test's table of phases)."""
    import rm.evaluation.plots  # noqa: F401
    import rm.modelling.bundle as bundle
    import rm.training.run_setup as run_setup
    import rm.training.trainer as trainer
    from rm.distributed.engine import AccelerateEngine

    if phase == "set-up":  # the model is being built; the data and the run directory are ready
        run_setup._build_model = _pausing(phase, run_setup._build_model)
    elif phase == "training":  # inside the third optimizer step
        AccelerateEngine.step = _pausing(phase, AccelerateEngine.step, at_call=3)
    elif phase == "evaluation":  # the first evaluation
        trainer.evaluate_sets = _pausing(phase, trainer.evaluate_sets)
    elif phase == "checkpoint":  # the first checkpoint's states are in its temporary directory, not yet renamed
        AccelerateEngine.save_state = _pausing(phase, AccelerateEngine.save_state, after=True)
    elif phase == "plots":
        trainer.write_train_plot = _pausing(phase, trainer.write_train_plot)
    elif phase == "export":  # the bundle's files are in its temporary directory (.tmp-final, or rm.export's merge)
        bundle.save_bundle = _pausing(phase, bundle.save_bundle, after=True)
    else:
        raise SystemExit(f"pause_at: unknown phase {phase!r}")


if __name__ == "__main__":
    phase, module, *args = sys.argv[1:]
    install(phase)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
