"""rm: pairwise reward models. Importing any part of it quiets two dependency warnings (rm.foundations.quiet).

The packages of rm, bottom first: a module imports from its own package and the packages before it, never from one
after it (``tests/test_imports.py`` reads every import and checks this, and that no import cycle exists).
The modules at the root are the entry points (``python -m rm.train``, ``rm.estimate``, ``rm.score``, ``rm.export``,
``rm.gpu_report``; ``python -m rm.plan`` is the plan package's ``__main__``), above every package.
"""

LAYERS = (
    "foundations",  # config schema, errors, hardware, precision, launch environment, cache
    "data",  # preference data, from files to batches, and the tokenizer
    "modelling",  # the model, attention, loss, the exported bundle
    "distributed",  # the engine over accelerate and DeepSpeed
    "evaluation",  # metrics, diagnostics, plots
    "settings",  # the one validation of a run's config, and its derived plan
    "memory",  # the pre-flight estimate, its trace, the monitor, the pre-flight check
    "plan",  # the planner: step time and the layout search
    "runs",  # the run directory, checkpoints, train state, resume, records
    "training",  # the run's setup, the loop, health, the launcher's helper
)

from rm.foundations.quiet import install as _install_quiet  # noqa: E402

_install_quiet()
