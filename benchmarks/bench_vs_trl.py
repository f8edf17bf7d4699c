"""rm against TRL's RewardTrainer on the same run: real-token throughput, step time, peak memory, eval.

    python benchmarks/bench_vs_trl.py                  # prints the table
    python benchmarks/bench_vs_trl.py --write-doc      # and writes it to docs/throughput.md

One process per trainer, run after run, on the same tokenised pairs: a Mistral-architecture
model (4 layers, hidden 256, vocabulary 2000, random init), fp32, 8 pairs per optimizer step,
max length 512, 60 steps, AdamW lr 1e-3 with linear decay after 3 warm-up steps, gradient
clipping at 1, no gradient checkpointing, no dropout, 2 CPU threads. TRL needs ``pip install trl``
(a benchmark-only dependency, not one of rm's).

The data (:func:`make_pairs`): HH-RLHF-like long-tailed lengths. Prompt and the two answers
each draw a log-normal length, so most sequences are short and a few run to the 512-token cap;
batches of 8 random pairs padded to their longest row are about half pad tokens, as
HH-RLHF batches are. Answers carry a learnable signal (chosen answers draw half their tokens
from a "good" id range, rejected ones from a "bad" range), so eval accuracy says whether both
trainers learned the same thing.

What is measured, the same way for both:
- real tokens: non-pad tokens of the training forward passes (chosen + rejected);
- training time: from the start of the training loop to the end of the last step, without
  start-up, evaluation or saving (rm: the logged windows of ``metrics.jsonl``; TRL: a callback);
- tokens/s = real tokens / training time; step time = training time / steps;
- peak memory: the child process's peak resident set size (``ru_maxrss``), the whole run;
- eval loss and accuracy: the same function (padded batches of 8, rm's last-real-token reward)
  on the same 256 held-out pairs, after training.

rm's own data pipeline is bypassed in its child (``rm.train.build_datasets`` returns the
benchmark's pairs) so that both trainers see identical token ids.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, MAX_LENGTH, PAIRS_PER_STEP, STEPS, LR, WARMUP = 2000, 512, 8, 60, 1e-3, 3
SHAPE = ["model.vocab_size=2000", "model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=64",
         "model.max_position_embeddings=512"]
VARIANTS = {  # name: rm overrides on top of the shared run
    "rm padded": ["train.micro_batch_size=8", "train.group_by_length=false"],
    "rm padded + group_by_length (micro-batch 2)": ["train.micro_batch_size=2", "train.group_by_length=true"],
    "rm packed (budget 1024 tokens)": ["train.micro_batch_size=8", "train.packing=true",
                                       "train.max_tokens_per_micro_batch=1024"],
}


def make_pairs(n: int, seed: int):
    """``n`` pairs of token ids (no pad id 0, no eos id 3) with long-tailed lengths, chosen better than rejected."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def length(median, sigma, cap):
        return int(min(cap, max(1, rng.lognormal(np.log(median), sigma))))

    def answer(good: bool, size: int):
        signal = rng.integers(1000, 1500, size) if good else rng.integers(1500, 2000, size)
        neutral = rng.integers(4, 1000, size)
        return np.where(rng.random(size) < 0.5, signal, neutral).tolist()

    pairs = []
    for _ in range(n):
        prompt = rng.integers(4, 1000, length(48, 0.7, 320)).tolist()
        room = MAX_LENGTH - len(prompt)
        pairs.append({
            "chosen_input_ids": prompt + answer(True, length(64, 0.6, room)),
            "rejected_input_ids": prompt + answer(False, length(64, 0.6, room)),
            "margin": 0.0,
        })
    return pairs


def evaluate(model, pairs):
    """Bradley-Terry loss and accuracy on ``pairs``, padded batches of 8, reward at the last real token."""
    import torch

    from rm.data.collator import PairCollator
    from rm.loss import bradley_terry_loss
    from rm.model import pair_rewards

    model.eval()
    collate, losses, correct = PairCollator(pad_token_id=0), [], 0
    with torch.no_grad():
        for i in range(0, len(pairs), 8):
            batch = collate(pairs[i : i + 8])
            chosen, rejected = pair_rewards(model, batch["input_ids"], batch["attention_mask"])
            losses.append(float(bradley_terry_loss(chosen, rejected)) * len(chosen))
            correct += int((chosen > rejected).sum())
    return sum(losses) / len(pairs), correct / len(pairs)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_rm(data, variant_overrides, workdir: Path):
    import datasets
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForSequenceClassification

    import rm.config  # noqa: F401  (registers the schemas)
    import rm.train as rm_train
    from rm.data.audit import audit_split
    from rm.config import to_run_config

    overrides = ["experiment=tiny", "hardware=cpu", *SHAPE, f"data.max_length={MAX_LENGTH}",
                 f"train.max_steps={STEPS}", f"train.global_batch_size={PAIRS_PER_STEP}", "train.eval_batch_size=8",
                 f"train.learning_rate={LR}", "train.lr_scheduler_type=linear", f"train.warmup_ratio={WARMUP / STEPS}",
                 "train.max_grad_norm=1.0", "train.precision=fp32", "train.gradient_checkpointing=false",
                 "train.eval_steps=0", "train.save_steps=0", f"train.logging_steps={min(10, STEPS)}", "preflight.mode=off",
                 *variant_overrides]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    train_set = datasets.Dataset.from_list(data["train"])
    eval_set = datasets.Dataset.from_list(data["eval"])

    def same_pairs(data_cfg, tokenizer):
        def counts(n):  # nothing is dropped or truncated: the pairs are generated within max_length
            return collections.defaultdict(int, rows=n, pairs_out=n)

        splits = {name: audit_split(counts(len(rows)), [len(p["chosen_input_ids"]) for p in rows],
                                    [len(p["rejected_input_ids"]) for p in rows])
                  for name, rows in (("train", data["train"]), ("eval", data["eval"]))}
        return train_set, eval_set, {"data": "bench_vs_trl", "policies": {}, "splits": splits}

    rm_train.build_datasets = same_pairs
    result = rm_train.train(cfg, workdir / "run")
    windows = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if w["event"] == "train"]
    sizes = [w["step"] - previous for w, previous in zip(windows, [0] + [w["step"] for w in windows])]
    seconds = sum(w["step_time_s"] * n for w, n in zip(windows, sizes))
    tokens = sum(w["tokens_per_s"] * w["step_time_s"] * n for w, n in zip(windows, sizes))
    model = AutoModelForSequenceClassification.from_pretrained(workdir / "run" / "final")
    eval_loss, eval_accuracy = evaluate(model, data["eval"])
    return {"real_tokens": round(tokens), "train_s": seconds, "steps": result["step"],
            "final_train_loss": windows[-1]["loss"], "eval_loss": eval_loss, "eval_accuracy": eval_accuracy}


def run_trl(data, workdir: Path):
    import datasets
    import torch
    from accelerate.utils import set_seed
    from hydra import compose, initialize_config_dir
    from transformers import TrainerCallback
    from trl import RewardConfig, RewardTrainer

    import rm.config  # noqa: F401
    from rm.config import to_run_config
    from rm.model import build_model, build_tokenizer

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=["experiment=tiny", "hardware=cpu", *SHAPE]))
    tokenizer = build_tokenizer(cfg.model)
    set_seed(42)
    model = build_model(cfg.model, tokenizer.pad_token_id, "fp32", gradient_checkpointing=False)

    class Clock(TrainerCallback):
        begin = end = None

        def on_train_begin(self, args, state, control, **kwargs):
            Clock.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            Clock.end = time.perf_counter()

    train = datasets.Dataset.from_dict({"chosen_ids": [p["chosen_input_ids"] for p in data["train"]],
                                        "rejected_ids": [p["rejected_input_ids"] for p in data["train"]]})
    args = RewardConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0,
        weight_decay=0.0, logging_steps=min(10, STEPS), save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, max_length=MAX_LENGTH, seed=42,
        dataloader_num_workers=0, disable_dropout=True,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[Clock()])
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss, eval_accuracy = evaluate(trainer.model, data["eval"])
    return {"real_tokens": int(trainer._total_train_tokens), "train_s": Clock.end - Clock.begin,
            "steps": out.global_step, "final_train_loss": losses[-1], "eval_loss": eval_loss, "eval_accuracy": eval_accuracy}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    data = json.loads(Path(args.data).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        result = run_trl(data, Path(tmp)) if args.child == "trl" else run_rm(data, VARIANTS[args.child], Path(tmp))
    result.update(peak_rss_mib=peak_rss_mib(), tokens_per_s=result["real_tokens"] / result["train_s"],
                  step_s=result["train_s"] / result["steps"])
    Path(args.out).write_text(json.dumps(result))


def padded_fraction(pairs, seed: int) -> float:
    """Real / computed tokens of random 8-pair batches padded to their longest row (what TRL computes)."""
    import random

    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    real = computed = 0
    for i in range(0, len(order) - 7, 8):
        rows = [len(pairs[j][k]) for j in order[i : i + 8] for k in ("chosen_input_ids", "rejected_input_ids")]
        real, computed = real + sum(rows), computed + len(rows) * max(rows)
    return real / computed


def table(results, load) -> str:
    trl = results["TRL RewardTrainer"]
    lines = ["| trainer | real tokens/s | x TRL | step time (s) | peak RSS (MiB) | x TRL | final train loss | eval loss | eval accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / trl['tokens_per_s']:.2f} | {r['step_s']:.3f} "
                     f"| {r['peak_rss_mib']:,.0f} | {r['peak_rss_mib'] / trl['peak_rss_mib']:.2f} | {r['final_train_loss']:.4f} "
                     f"| {r['eval_loss']:.4f} | {r['eval_accuracy']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (a smoke test: --steps 10)")
    parser.add_argument("--write-doc", action="store_true", help="write the table into docs/throughput.md")
    parser.add_argument("--only", nargs="*", help="run only these trainers (names as in the table)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    STEPS = args.steps
    if args.child:
        return child(args)

    data = {"train": make_pairs(960, seed=0), "eval": make_pairs(256, seed=1)}
    fraction = padded_fraction(data["train"], seed=0)
    print(f"data: {len(data['train'])} train / {len(data['eval'])} eval pairs; random batches of {PAIRS_PER_STEP} pairs "
          f"padded to their longest row are {100 * fraction:.0f}% real tokens", flush=True)
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pairs.json"
        path.write_text(json.dumps(data))
        for name in ["TRL RewardTrainer", *VARIANTS]:
            if args.only and name not in args.only and name != "TRL RewardTrainer":
                continue
            out = Path(tmp) / "result.json"
            print(f"running {name} ...", flush=True)
            done = subprocess.run([sys.executable, __file__, "--child", "trl" if name.startswith("TRL") else name,
                                   "--data", str(path), "--out", str(out), "--threads", str(args.threads),
                                   "--steps", str(STEPS)], cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-4000:]}")
            results[name] = json.loads(out.read_text())
            print(f"  {results[name]['tokens_per_s']:,.0f} real tokens/s, {results[name]['step_s']:.3f} s/step, "
                  f"peak RSS {results[name]['peak_rss_mib']:,.0f} MiB, eval accuracy {results[name]['eval_accuracy']:.3f}", flush=True)
    load_after = os.getloadavg()[0]
    text = table(results, load)
    print(text)
    print(f"1-minute load average: {load:.2f} before, {load_after:.2f} after")
    if args.write_doc:
        doc = ROOT / "docs" / "throughput.md"
        body = doc.read_text() if doc.exists() else ""
        start, end = "<!-- bench_vs_trl:begin -->", "<!-- bench_vs_trl:end -->"
        block = (f"{start}\n{text}\n\nReal tokens in random batches padded to their longest row: {100 * fraction:.0f}%. "
                 f"1-minute load average {load:.2f} before the run, {load_after:.2f} after; {args.threads} threads, "
                 f"{time.strftime('%Y-%m-%d', time.gmtime())}.\n{end}")
        body = body[: body.index(start)] + block + body[body.index(end) + len(end):] if start in body else body + "\n" + block + "\n"
        doc.write_text(body)
        print(f"wrote {doc}")


if __name__ == "__main__":
    main()
