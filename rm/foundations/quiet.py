"""Silence the two dependency warnings every CPU run printed, at their source loggers.

Both are true but say nothing actionable to an rm user, and a warning that shows on every run
teaches users to skip warnings. They are dropped where they are logged, not by raising the
level of the whole library (whose other warnings stay), and re-logged at debug level on
``rm.foundations.quiet`` with the reason, so ``logging.DEBUG`` still shows them:

* bitsandbytes (imported by transformers and PEFT whenever installed) warns on import that the
  optional ``kernels`` package for its fused 4-bit CPU matmul is missing. That kernel serves only
  one-token inference (``gemv_4bit``); training, evaluation and scoring batches dequantise and
  use torch's matmul, and ``kernels`` would fetch it from the Hugging Face Hub at import, which an
  offline machine cannot;
* DeepSpeed warns "Setting accelerator to CPU" on import on a machine without CUDA, which is
  what a CPU machine is.

transformers' ``is_gradient_checkpointing`` FutureWarning, which PEFT triggers on every LoRA
model it wraps or loads, is filtered by its message (a Python warning has no logger).

The first screen of ``rm.train`` (:class:`FirstScreen`, :func:`quiet_progress_bars`): the console shows rm's
lines at INFO and everyone's warnings; what rm logs for the record (``extra=DETAIL``: the worst-case memory table,
the data audit, the tokenizer and cache lines), the libraries' INFO lines and their progress bars stay in the run's
``train.log``, or out, unless ``hydra.verbose=rm`` (or ``hydra.verbose=true``) asks for everything.
"""

from __future__ import annotations

import logging
import warnings

from rm.foundations.cli import DETAIL

log = logging.getLogger(__name__)

# Loggers whose INFO lines the console shows: rm's own, Hydra's and its plugins' (a sweep's jobs and their overrides,
# the Optuna sweeper's trials).
CONSOLE_INFO = ("rm", "hydra", "hydra_plugins", "__main__")

# logger name -> substring of the message to drop, and why (logged at debug level).
DROPPED = {
    "bitsandbytes.backends.cpu.ops": ("gemm_4bit_forward from kernels-community",
                                      "optional 'kernels' Hub download for one-token 4-bit CPU inference, unused by rm's batches"),
    "DeepSpeed": ("Setting accelerator to CPU", "no CUDA device: DeepSpeed uses the CPU, as intended here"),
}


class _Drop(logging.Filter):
    def __init__(self, needle: str, why: str):
        super().__init__()
        self.needle, self.why = needle, why

    def filter(self, record: logging.LogRecord) -> bool:
        if self.needle in record.getMessage():
            log.debug("dropped a %s warning (%s): %s", record.name, self.why, record.getMessage())
            return False
        return True


def install() -> None:
    """Add the filters (idempotent); must run before bitsandbytes or DeepSpeed is imported."""
    for name, (needle, why) in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(needle, why))
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def verbose() -> bool:
    """``hydra.verbose=rm`` or ``hydra.verbose=true``: rm's loggers at DEBUG, the console shows every line."""
    return logging.getLogger("rm").isEnabledFor(logging.DEBUG)


class FirstScreen(logging.Filter):
    """The console handler's filter in rm.train's job logging (``conf/hydra/job_logging/rm.yaml``; the file handler
    has none): warnings and errors always pass; INFO passes from rm's and Hydra's loggers unless marked
    ``extra=DETAIL``; everything passes with :func:`verbose`. So the run summary is the first block a run prints,
    then its progress."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or verbose():
            return True
        if all(getattr(record, key, None) == value for key, value in DETAIL.items()):
            return False
        return record.name.split(".", 1)[0] in CONSOLE_INFO


def quiet_progress_bars() -> None:
    """Turn off the libraries' progress bars (datasets' map and save, transformers' weight loading, the Hub's
    downloads and shard writes) unless :func:`verbose`: on the demo each is a line of noise that ends in under a
    second; rm says itself when it prepares data for the first time (``rm.data.build``). rm's own ``train`` bar stays."""
    if verbose():
        return
    import datasets
    import huggingface_hub.utils
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
