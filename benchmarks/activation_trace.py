"""How long one activation trace of Mistral-7B takes, and what a layer keeps per token.

    python benchmarks/activation_trace.py      # a few seconds; prints a table, not a test

The trace (``rm.memory.trace``) builds the run's model on the meta device and runs one step under fake
tensors; the estimate caches it, so a second call with the same shapes is arithmetic. The per-layer bytes
are given as a multiple of ``s*b*h`` (sequence x batch x hidden), the unit of the closed formulas it
replaces (``34*s*b*h`` for a GPT layer without checkpointing).
"""

from __future__ import annotations

import os
import tempfile
import time

# The first call of each shape is to trace, not to read rm.memory.trace's disk cache of an earlier run.
os.environ["RM_CACHE"] = tempfile.mkdtemp(prefix="rm-cache-")

from rm.foundations.cli import without_bitsandbytes  # noqa: E402

without_bitsandbytes()  # as the estimate CLI runs

t0 = time.perf_counter()
import transformers.models.mistral.modeling_mistral  # noqa: E402,F401  (the trainer has it imported anyway)

from rm.foundations.config import compose  # noqa: E402
from rm.memory.terms import traced_model  # noqa: E402
from rm.memory.trace import estimate_activations  # noqa: E402
from rm.settings.validate import validate  # noqa: E402

IMPORTS = time.perf_counter() - t0


def main() -> None:
    batch, seq = 8, 512  # 4 pairs of 512 tokens
    print(f"imports: {IMPORTS:.2f} s (once per process, not counted below); 1-min load {os.getloadavg()[0]:.2f}")
    print("| profile | checkpointing | call | time | peak | phase | kept per layer |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: |")
    for profile in ("full", "lora"):
        for ckpt in (False, True):
            cfg = compose(["model=mistral_7b", f"memory_profile={profile}", "hardware=h100_80g",
                           f"train.gradient_checkpointing={str(ckpt).lower()}", "train.micro_batch_size=4"])
            traced = traced_model(cfg, validate(cfg, 1, "benchmark"))
            for call in ("first", "cached"):
                t0 = time.perf_counter()
                est = estimate_activations(traced, cfg.model.num_hidden_layers, batch, seq)
                dt = time.perf_counter() - t0
                sbh = batch * seq * cfg.model.hidden_size
                print(f"| {profile} | {ckpt} | {call} | {dt * 1000:.1f} ms | {est['peak_bytes'] / 2**30:.2f} GiB "
                      f"| {est['peak_phase']} | {est['per_layer_saved_bytes'] / sbh:.2f}*s*b*h |")


if __name__ == "__main__":
    main()
