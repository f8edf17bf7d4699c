"""Runs: what a training run keeps on disk, and what a resumed run must share with it.

- :mod:`rm.runs.run_dir`: the run directory (:class:`~rm.runs.run_dir.RunDir`): its lock, whether a run may
  start, continue or replace an earlier one, the checkpoint a resume loads.
- :mod:`rm.runs.checkpoint`: checkpoints that are complete and intact or passed over.
- :mod:`rm.runs.train_state`: what the loop carries from step to step, saved in every checkpoint.
- :mod:`rm.runs.resume`: the settings a resumed run must share with the run that wrote its checkpoint.
- :mod:`rm.runs.run_record`: Hydra's record of a job and its log file; :mod:`rm.runs.sweep`: a multirun's summary.
"""
