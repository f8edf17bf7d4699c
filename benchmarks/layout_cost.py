"""CPU seconds of one training step's forward and backward per batch layout, on the benchmark's pairs.

    python benchmarks/layout_cost.py                 # multi-turn and single-turn data, 3 steps of 8 pairs
    python benchmarks/layout_cost.py --demo          # experiment=tiny's model and data, 6 steps of 32 pairs

A companion to ``bench_vs_trl.py`` for a shared, loaded machine: it measures the CPU time
(``time.process_time``) of one thread, which other processes do not inflate the way they inflate
wall-clock time (they take cores away; a one-thread process's own CPU seconds stay about the same).
It times only forward + backward of the same 8-pair steps, in every layout, interleaved, on the
``bench_vs_trl`` model shape (Mistral, 4 layers, hidden 256, fp32, SDPA); no optimizer, no data loading.
``padded (8 pairs, 1 micro-batch)`` is what TRL computes; the ratios are the compute each layout saves.

``--demo`` times the CPU demo instead (``experiment=tiny``: its 2-layer model, its synthetic pairs, steps of its
32 pairs), against the layout it had before prefix sharing (``group_by_length``, micro-batches of 8): the
measurement behind ``experiment=tiny``'s choice of ``train.share_prefix=true`` with micro-batches of 8.
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
    """Micro-batches and collator of each layout for one step of 8 pairs (as rm.train cuts them)."""
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


def demo_layouts(step, pad_token_id: int):
    """The CPU demo's candidate layouts for one step of its pairs; the first is its layout before prefix sharing."""
    from rm.data.batching import split_by_tokens
    from rm.data.collator import PackedPairCollator, PairCollator, PrefixSharedCollator, shared_pair_length

    def longest(p):
        return max(len(p["chosen_input_ids"]), len(p["rejected_input_ids"]))

    def shared(p):
        return shared_pair_length(p["chosen_input_ids"], p["rejected_input_ids"])

    n = len(step)
    both = [len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in step]
    by_length, by_shared = sorted(step, key=longest), sorted(step, key=shared)
    out = {f"group_by_length (micro-batch {m})": ([by_length[i : i + m] for i in range(0, n, m)], PairCollator(pad_token_id))
           for m in (8, 2)}
    out["packed (budget 256)"] = ([[step[i] for i in g] for g in split_by_tokens(range(n), both, 256)], PackedPairCollator())
    for m in (16, 8, 4, 2):
        out[f"prefix-shared, row per pair + group_by_length (micro-batch {m})"] = (
            [by_shared[i : i + m] for i in range(0, n, m)], PrefixSharedCollator(packed=False, pad_token_id=pad_token_id))
    for budget in (256, 512):
        out[f"prefix-shared + packed (budget {budget})"] = (
            [[step[i] for i in g] for g in split_by_tokens(range(n), [shared(p) for p in step], budget)],
            PrefixSharedCollator())
    return out


def time_layouts(model, steps, layouts_of, repeats: int = 1):
    """CPU seconds of forward + backward per layout, summed over ``steps``; each step's layouts interleaved."""
    import torch

    from rm.modelling.loss import bradley_terry_loss
    from rm.modelling.model import pair_rewards

    keys = ("input_ids", "attention_mask", "position_ids", "ends", "pair_ids", "roles")
    seconds = {}
    for _ in range(repeats):
        for step in steps:
            for layout, (batches, collate) in layouts_of(step).items():
                start = time.process_time()
                for features in batches:
                    batch = collate(features)
                    chosen, rejected = pair_rewards(model, **{k: batch[k] for k in keys if k in batch})
                    bradley_terry_loss(chosen, rejected).backward()
                seconds[layout] = seconds.get(layout, 0.0) + time.process_time() - start
                model.zero_grad(set_to_none=True)
    return {layout: s / (len(steps) * repeats) for layout, s in seconds.items()}


def print_table(seconds, base_layout: str, base_name: str) -> None:
    base = seconds[base_layout]
    print(f"| layout | CPU s per step | x {base_name} |\n|---|---|---|")
    for layout, s in seconds.items():
        print(f"| {layout} | {s:.3f} | {base / s:.2f} |")


def demo(steps: int) -> None:
    """``--demo``: experiment=tiny's model, data and step of 32 pairs."""
    import torch
    from accelerate.utils import set_seed
    from hydra import compose, initialize_config_dir

    import bench_vs_trl as bench
    import rm.foundations.config  # noqa: F401  (registers the schemas)
    from rm.foundations.config import to_run_config
    from rm.data.build import build_datasets
    from rm.modelling.model import build_model
    from rm.data.tokenizer import build_tokenizer

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        # 2,000 pairs of the demo's 16,000: the same generator and lengths, a quarter of a minute to tokenise.
        cfg = to_run_config(compose(config_name="config", overrides=[
            "experiment=tiny", "data.synthetic_train_size=2000", "data.synthetic_test_size=100"]))
    tokenizer = build_tokenizer(cfg.model)
    train_set, _, _ = build_datasets(cfg.data, tokenizer)
    set_seed(cfg.train.seed)
    model = build_model(cfg.model, tokenizer.pad_token_id, "float32", gradient_checkpointing=False)
    pairs = [{"chosen_input_ids": c, "rejected_input_ids": r}
             for c, r in zip(train_set["chosen_input_ids"], train_set["rejected_input_ids"])]
    rng = random.Random(0)
    sampled = [rng.sample(pairs, cfg.train.global_batch_size) for _ in range(steps)]
    time_layouts(model, sampled[:1], lambda step: demo_layouts(step, tokenizer.pad_token_id))  # warm-up, not counted
    seconds = time_layouts(model, sampled, lambda step: demo_layouts(step, tokenizer.pad_token_id), repeats=2)
    stats = bench.prefix_stats(pairs)
    print(f"\nexperiment=tiny data (shared prompt : answer tokens = {stats['prefix_to_suffix']:.2f} : 1, median sequence "
          f"{stats['median_length']} tokens), steps of {cfg.train.global_batch_size} pairs\n")
    print_table(seconds, "group_by_length (micro-batch 8)", "micro-batch 8")


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    import bench_vs_trl as bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="steps timed (default 3; 6 with --demo)")
    parser.add_argument("--data", nargs="*", default=list(bench.DATASETS), choices=list(bench.DATASETS))
    parser.add_argument("--demo", action="store_true", help="time experiment=tiny's layouts on its own model and data")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"1-minute load average {os.getloadavg()[0]:.2f}; CPU seconds of one thread")
    if args.demo:
        demo(args.steps or 6)
        print(f"\n1-minute load average {os.getloadavg()[0]:.2f} at the end")
        return
    config = AutoConfig.for_model("mistral", vocab_size=2000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                                  num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    for name in args.data:
        pairs = bench.DATASETS[name](960, seed=0)
        rng = random.Random(0)
        steps = [rng.sample(pairs, 8) for _ in range(args.steps or 3)]
        seconds = time_layouts(model, steps, lambda step: layouts(step, 2 * bench.MAX_LENGTH))
        stats = bench.prefix_stats(pairs)
        print(f"\n{name} data (shared prompt : answer tokens = {stats['prefix_to_suffix']:.2f} : 1)\n")
        print_table(seconds, "padded (8 pairs, 1 micro-batch)", "padded")
    print(f"\n1-minute load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
