"""Memory: the pre-flight estimate, the activation trace it runs, and the monitor that measures a run.

- :mod:`rm.memory.estimate`: every term of the per-device peak, and the verdict (``python -m rm.estimate``).
- :mod:`rm.memory.trace`: activations, from one step of the run's own model under fake tensors.
- :mod:`rm.memory.monitor`: a run's measured peak (CUDA's allocator statistics, or live CPU tensors).
- :mod:`rm.memory.storage`: the one tracker of live tensor storages that the trace and the monitor share.

Nothing here imports torch at package import: ``python -m rm.estimate --help`` and config errors stay fast.
"""
