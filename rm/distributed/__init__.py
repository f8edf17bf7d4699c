"""Distributed: the one training-step interface over accelerate (one process, DDP) and DeepSpeed (``conf/distributed``).

- :mod:`rm.distributed.engine`: :class:`~rm.distributed.engine.Engine` and its two implementations, and the
  DeepSpeed configuration built from the run's settings.
"""
