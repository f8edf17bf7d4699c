"""CPU seconds of one training step's forward and backward per batch layout, on the benchmark's pairs.

    python benchmarks/layout_cost.py                 # multi-turn and single-turn data, 3 steps of 8 pairs

A companion to ``bench_vs_trl.py`` for a shared, loaded machine: it measures the CPU time
(``time.process_time``) of one thread, which other processes do not inflate the way they inflate
wall-clock time (they take cores away; a one-thread process's own CPU seconds stay about the same).
It times only forward + backward of the same 8-pair steps, in every layout, interleaved, on the
``bench_vs_trl`` model shape (Mistral, 4 layers, hidden 256, fp32, SDPA); no optimizer, no data loading.
``padded (8 pairs, 1 micro-batch)`` is what TRL computes; the ratios are the compute each layout saves.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def layouts(step, budget: int):
    """Micro-batches and collator of each layout for one step of pairs (as rm.train cuts them)."""
    from rm.data.batching import split_by_tokens
    from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator, shared_pair_length

    def longest(p):
        return max(len(p["chosen_input_ids"]), len(p["rejected_input_ids"]))

    def shared(p):
        return shared_pair_length(p["chosen_input_ids"], p["rejected_input_ids"])

    both = [len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in step]
    by_length, by_shared = sorted(step, key=longest), sorted(step, key=shared)
    return {
        "padded (8 pairs, 1 micro-batch)": ([step], PairCollator(0)),
        "group_by_length (micro-batch 2)": ([by_length[i : i + 2] for i in range(0, 8, 2)], PairCollator(0)),
        f"packed (budget {budget})": ([[step[i] for i in g] for g in split_by_tokens(range(8), both, budget)],
                                      PackedPairCollator()),
        f"prefix-shared + packed (budget {budget})": (
            [[step[i] for i in g] for g in split_by_tokens(range(8), [shared(p) for p in step], budget)],
            PrefixSharedCollator()),
        "prefix-shared, row per pair + group_by_length (micro-batch 2)": (
            [by_shared[i : i + 2] for i in range(0, 8, 2)], PrefixSharedCollator(packed=False)),
        "prefix-shared, row per pair + group_by_length (micro-batch 4)": (
            [by_shared[i : i + 4] for i in range(0, 8, 4)], PrefixSharedCollator(packed=False)),
    }


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    import bench_vs_trl as bench
    from rm.loss import bradley_terry_loss
    from rm.model import pair_rewards

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--data", nargs="*", default=list(bench.DATASETS), choices=list(bench.DATASETS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = AutoConfig.for_model("mistral", vocab_size=2000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                                  num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    keys = ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
    print(f"1-minute load average {os.getloadavg()[0]:.2f}; CPU seconds of one thread, {args.steps} steps of 8 pairs")
    for name in args.data:
        pairs = bench.DATASETS[name](960, seed=0)
        rng = random.Random(0)
        steps = [rng.sample(pairs, 8) for _ in range(args.steps)]
        seconds = {}
        for step in steps:
            for layout, (batches, collate) in layouts(step, 2 * bench.MAX_LENGTH).items():
                start = time.process_time()
                for features in batches:
                    batch = collate(features)
                    chosen, rejected = pair_rewards(model, **{k: batch[k] for k in keys if k in batch})
                    bradley_terry_loss(chosen, rejected).backward()
                seconds[layout] = seconds.get(layout, 0.0) + time.process_time() - start
        base = seconds["padded (8 pairs, 1 micro-batch)"]
        stats = bench.prefix_stats(pairs)
        print(f"\n{name} data (shared prompt : answer tokens = {stats['prefix_to_suffix']:.2f} : 1)\n")
        print("| layout | CPU s per step | x padded |\n|---|---|---|")
        for layout, s in seconds.items():
            print(f"| {layout} | {s / len(steps):.2f} | {base / s:.2f} |")
    print(f"\n1-minute load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
