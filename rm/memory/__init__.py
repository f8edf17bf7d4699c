"""Memory: the pre-flight estimate, the activation trace it runs, and the monitor that measures a run.

- :mod:`rm.memory.terms`: every term of the per-device peak, and the verdict. The command line,
  ``python -m rm.estimate``, is :mod:`rm.estimate`.
- :mod:`rm.memory.suggest`: the changes that would make a refused run fit.
- :mod:`rm.memory.report`: the estimate's table, printed by ``rm.estimate`` and logged by the pre-flight check.
- :mod:`rm.memory.trace`: activations, from one step of the run's own model under fake tensors.
- :mod:`rm.memory.monitor`: a run's measured peak (CUDA's allocator statistics, or live CPU tensors).
- :mod:`rm.memory.storage`: the one tracker of live tensor storages that the trace and the monitor share.

Nothing here imports torch at package import: ``python -m rm.estimate --help`` and config errors stay fast.
"""
