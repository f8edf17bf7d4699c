"""The values each data policy key accepts, without the data stack (``rm.validate`` checks them before anything
loads; what each one does is documented in :mod:`rm.data.preference`)."""

FORMATS = ("auto", "hh", "prompt", "messages")
TRUNCATION = ("truncate", "drop", "error")
IDENTICAL_PAIRS = ("drop", "keep")
DUPLICATES = ("keep", "drop")
ON_MALFORMED = ("skip", "error")
