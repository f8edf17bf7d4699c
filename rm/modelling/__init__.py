"""Modelling: the reward model, how it attends, its loss, and the bundle it is saved as.

- :mod:`rm.modelling.model`: build the reward model (``conf/model``, ``conf/lora``, ``conf/memory_profile``) and
  score batches with it.
- :mod:`rm.modelling.attention`: SDPA one packed sequence at a time; :mod:`rm.modelling.prefix_sharing`: the mask
  of prefix-shared pairs (``train.share_prefix``).
- :mod:`rm.modelling.loss`: the pairwise loss, built once from config for training, evaluation and the memory trace.
- :mod:`rm.modelling.bundle`: the final model directory, written and verified (``python -m rm.export`` checks one
  again).
"""
