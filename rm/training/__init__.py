"""Training: the run built once, the loop, its health checks, and the multi-GPU launcher's helper.

- :mod:`rm.training.run_setup`: everything a run holds before its first step, built into one
  :class:`~rm.training.run_setup.Run`.
- :mod:`rm.training.trainer`: setup, loop, save, close (``python -m rm.train``'s body).
- :mod:`rm.training.health`: training-health alarms, the non-finite policy, the fp32 reward head.
- :mod:`rm.training.launch`: what ``train_rm_distributed.sh`` does around torchrun.
"""
