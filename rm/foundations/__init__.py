"""Foundations: what every other package of rm stands on, importing nothing of rm above it.

- :mod:`rm.foundations.config`: the typed schema of every ``conf/`` group, registered in Hydra's ConfigStore.
- :mod:`rm.foundations.errors`: rm's error types and the one error boundary of its entry points.
- :mod:`rm.foundations.hardware`: the devices a run will use (``hardware=auto``).
- :mod:`rm.foundations.precision`: the training precisions (``train.precision``) and where each tensor lives.
- :mod:`rm.foundations.lost_updates`: the optimizer updates a weight's own dtype rounds away (``bf16-true``).
- :mod:`rm.foundations.launch_env`: what torchrun tells a process (world size, ranks).
- :mod:`rm.foundations.cache`: rm's disk cache (``$RM_CACHE``).
- :mod:`rm.foundations.cli`: what the print-only commands share; :mod:`rm.foundations.quiet`: two dependency
  warnings silenced.
"""
