"""Packed rows on a CPU: the row's SDPA in one call against one call per pair (rm/modelling/attention.py), and what it costs.

    python benchmarks/packed_attention.py            # about a minute on an idle 2-core CPU

On bench_vs_trl.py's model (Mistral architecture, 4 layers x 256, 4 heads on 2 KV heads), random prefix-shared pairs
of multi-turn size (prompt 150-350 tokens, each answer 30-90), seed 0, it prints (median of repeats, with the load):

* forward + backward of one packed row, the whole row in one SDPA call (the 4D mask from the per-token rule, as
  before rm/modelling/attention.py) against one call per pair (``rm.modelling.attention.segmented_inputs``), for rows of 2, 4 and 8 pairs;
* building that row's mask: the per-token rule over the whole row (``rm.modelling.prefix_sharing.allowed``) against each
  pair's block alone, all segmented SDPA reads (``rm.modelling.attention.segmented_inputs``), one thread;
* the same 8 pairs as one row, two rows of 4 and four rows of 2, one call per pair: what packing a step into fewer,
  longer rows changes in the forward and backward.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rm.modelling.attention import segmented_inputs  # noqa: E402
from rm.data.collator import PrefixSharedCollator  # noqa: E402
from rm.modelling.prefix_sharing import allowed  # noqa: E402


def model():
    from transformers import MistralConfig, MistralForSequenceClassification

    config = MistralConfig(vocab_size=2000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    return MistralForSequenceClassification._from_config(config, attn_implementation="sdpa")


def pairs(count: int, rng: random.Random):
    def tokens(n):
        return [rng.randrange(1, 2000) for _ in range(n)]

    out = []
    for _ in range(count):
        prompt = tokens(rng.randint(150, 350))
        out.append({"chosen_input_ids": prompt + tokens(rng.randint(30, 90)),
                    "rejected_input_ids": prompt + tokens(rng.randint(30, 90))})
    return out


def step(net, rows, split: bool) -> None:
    """Forward and backward of each packed row (a sum of its per-token scores as the loss)."""
    for batch in rows:
        inputs = segmented_inputs(batch["input_ids"], batch["position_ids"], batch["pair_ids"], batch["roles"]) \
            if split else {"attention_mask": allowed(batch["pair_ids"], batch["roles"])}
        net(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **inputs).logits.sum().backward()
    net.zero_grad(set_to_none=True)


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    collate, net, rng = PrefixSharedCollator(packed=True), model(), random.Random(0)
    load = os.getloadavg()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.threads} threads, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, 1-minute load average {load:.2f} before\n")

    print("| pairs in the row | tokens | whole row, one SDPA call (s) | one call per pair (s) | speed-up |")
    print("|---|---|---|---|---|")
    for count in (2, 4, 8):
        row = [collate(pairs(count, rng))]
        whole = median_seconds(lambda: step(net, row, split=False), args.repeats)
        split = median_seconds(lambda: step(net, row, split=True), args.repeats)
        print(f"| {count} | {row[0]['input_ids'].shape[1]:,} | {whole:.3f} | {split:.3f} | {whole / split:.2f}x |")

    batch = collate(pairs(8, rng))
    torch.set_num_threads(1)
    per_token = median_seconds(lambda: allowed(batch["pair_ids"], batch["roles"]), args.repeats)
    blocks = median_seconds(lambda: segmented_inputs(batch["input_ids"], batch["position_ids"], batch["pair_ids"],
                                                     batch["roles"]), args.repeats)
    torch.set_num_threads(args.threads)
    print(f"\nThe mask of a row of {batch['input_ids'].shape[1]:,} tokens in 8 pairs, one thread: per-token rule over "
          f"the row {per_token * 1e3:.1f} ms, each pair's block alone (no row mask) {blocks * 1e3:.1f} ms.\n")

    same = pairs(8, rng)
    print("| the same 8 pairs as | tokens | forward + backward, one call per pair (s) |")
    print("|---|---|---|")
    for rows in (1, 2, 4):
        size = 8 // rows
        batches = [collate(same[i:i + size]) for i in range(0, 8, size)]
        seconds = median_seconds(lambda: step(net, batches, split=True), args.repeats)
        print(f"| {rows} row(s) of {size} | {sum(b['input_ids'].shape[1] for b in batches):,} | {seconds:.3f} |")
    print(f"\n1-minute load average {os.getloadavg()[0]:.2f} after; `python benchmarks/packed_attention.py`")


if __name__ == "__main__":
    main()
