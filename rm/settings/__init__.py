"""Settings: the one check of a run's composed config before anything heavy, and the plan it derives.

- :mod:`rm.settings.validate`: rejects bad combinations with a message naming the keys, resolves ``auto`` values
  (hardware, precision, strategy) and derives the :class:`~rm.settings.validate.Plan` (world size, accumulation).

It sits above the data (a tokenizer's settings are checked as the tokenizer defines them) and the evaluation (an
extra eval set's metric names), and below every package that reads a plan: memory, plan, runs, training.
"""
