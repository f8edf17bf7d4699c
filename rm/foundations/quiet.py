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
"""

from __future__ import annotations

import logging
import warnings

log = logging.getLogger(__name__)

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
