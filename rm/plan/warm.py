"""Imported once by the forkserver that forks ``rm.plan``'s verdict workers (:class:`rm.plan.search.Checker`): the
model code a trace runs (transformers' models, PEFT), about 5 s of imports, done while the search reads lengths and
times layouts, so that each worker starts warm. bitsandbytes stays out, as in every process that only estimates
(:func:`rm.foundations.cli.without_bitsandbytes`)."""

from rm.foundations.cli import without_bitsandbytes

without_bitsandbytes()

import peft  # noqa: E402,F401
import rm.modelling.model  # noqa: E402,F401
import rm.plan.search  # noqa: E402,F401
