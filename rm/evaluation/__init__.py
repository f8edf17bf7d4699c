"""Evaluation: what a reward model's scores on pairs say, and the run's metrics and pictures.

- :mod:`rm.evaluation.metrics`: evaluate a model on pairs; the run's metrics log.
- :mod:`rm.evaluation.diagnostics`: pure functions over the per-pair scores (length bias, calibration, ties).
- :mod:`rm.evaluation.plots`: the end-of-run pictures.

Scoring new text with a trained model is ``rm.score``'s, at the root (``python -m rm.score``).
"""
