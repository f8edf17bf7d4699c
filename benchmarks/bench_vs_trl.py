"""rm against TRL's RewardTrainer on the same run: pairs/s, real-token throughput, step time, peak memory, eval.

    pip install -e '.[bench]'                          # trl, the one benchmark-only dependency
    python benchmarks/bench_vs_trl.py                  # prints both tables (multi-turn, single-turn)
    python benchmarks/bench_vs_trl.py --write-doc      # and writes them to docs/throughput.md

One process per trainer, run after run, on the same tokenised pairs: a Mistral-architecture
model (4 layers, hidden 256, vocabulary 2000, random init), fp32, 8 pairs per optimizer step,
max length 512, 60 steps, AdamW lr 1e-3 with linear decay after 3 warm-up steps, gradient
clipping at 1, no gradient checkpointing, no dropout, 2 CPU threads. TRL comes with the ``bench``
extra (a benchmark-only dependency, not one of rm's).

Two data sets, each with HH-RLHF-like long-tailed lengths (log-normal draws):

* multi-turn (:func:`make_multiturn_pairs`): 1 to 6 earlier human/assistant exchanges, then the
  question and two different final answers, so the prompt both sides share carries most tokens,
  as in HH-RLHF; the prompt : answers ratio is printed with the table;
* single-turn (:func:`make_pairs`): one prompt and two answers of similar median length, so the
  shared prompt is a smaller part of each pair.

Batches of 8 random pairs padded to their longest row carry many pad tokens, as HH-RLHF batches
do. Answers carry a learnable signal (chosen answers draw half their tokens from a "good" id range,
rejected ones from a "bad" range), so eval accuracy says whether the trainers learned the same thing.

What is measured, the same way for both:
- real tokens: non-pad tokens of chosen + rejected, as TRL counts them; with prefix sharing the prompt
  is computed once but counted twice, so tokens/s compares the same work;
- pairs/s: pairs trained per second of training time;
- training time: from the start of the training loop to the end of the last step, without
  start-up, evaluation or saving (rm: the logged windows of ``metrics.jsonl``; TRL: a callback);
- tokens/s = real tokens / training time; step time = training time / steps;
- peak memory: the child process's peak resident set size (``ru_maxrss``), the whole run;
- eval loss and accuracy: the same function (padded batches of 8, rm's last-real-token reward)
  on the same 256 held-out pairs, after training.

rm's own data pipeline is bypassed in its child (``rm.run_setup.build_datasets`` returns the
benchmark's pairs) so that both trainers see identical token ids.
"""

from __future__ import annotations

import argparse
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
    "rm prefix-shared + packed (budget 1024 tokens)": ["train.micro_batch_size=8", "train.share_prefix=true",
                                                       "train.packing=true", "train.max_tokens_per_micro_batch=1024"],
    "rm prefix-shared, row per pair + group_by_length (micro-batch 2)": [
        "train.micro_batch_size=2", "train.share_prefix=true", "train.group_by_length=true"],
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


HUMAN, ASSISTANT = 4, 5  # role marker ids of the multi-turn data; neutral tokens are 6..999


def make_multiturn_pairs(n: int, seed: int):
    """``n`` HH-like multi-turn pairs: earlier exchanges, a question, two different final answers.

    1 to 6 earlier exchanges (human turns of median 20 tokens, assistant turns of median 40), then the
    question and a final answer of median 48 tokens per side. A prompt too long for the answers is cut
    from its start, the same cut for both sides, as a conversation that began earlier would be; the
    answers then take the room left under ``MAX_LENGTH``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)

    def length(median, sigma, cap):
        return int(min(cap, max(1, rng.lognormal(np.log(median), sigma))))

    def answer(good: bool, size: int):
        signal = rng.integers(1000, 1500, size) if good else rng.integers(1500, 2000, size)
        neutral = rng.integers(6, 1000, size)
        return np.where(rng.random(size) < 0.5, signal, neutral).tolist()

    pairs = []
    for _ in range(n):
        prompt = []
        for _ in range(int(rng.integers(1, 7))):
            prompt += [HUMAN] + rng.integers(6, 1000, length(20, 0.7, 120)).tolist()
            prompt += [ASSISTANT] + rng.integers(6, 1000, length(40, 0.7, 160)).tolist()
        prompt += [HUMAN] + rng.integers(6, 1000, length(20, 0.7, 120)).tolist() + [ASSISTANT]
        prompt = prompt[-(MAX_LENGTH - 64):]  # at least 64 tokens of room for each answer
        room = MAX_LENGTH - len(prompt)
        pairs.append({
            "chosen_input_ids": prompt + answer(True, length(48, 0.6, room)),
            "rejected_input_ids": prompt + answer(False, length(48, 0.6, room)),
            "margin": 0.0,
        })
    return pairs


DATASETS = {"multi-turn": make_multiturn_pairs, "single-turn": make_pairs}


def prefix_stats(pairs) -> dict:
    """Shared prompt : answer tokens, and the share of chosen + rejected tokens that prefix sharing does not compute."""
    from rm.data.collator import common_prefix_length

    prefix = [common_prefix_length(p["chosen_input_ids"], p["rejected_input_ids"]) for p in pairs]
    both = sum(len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in pairs)
    suffix = both - 2 * sum(prefix)
    return {"prefix_to_suffix": sum(prefix) / suffix, "shared_saves": sum(prefix) / both,
            "median_length": sorted(len(p[k]) for p in pairs for k in ("chosen_input_ids", "rejected_input_ids"))[len(pairs)]}


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


def rm_overrides(variant_overrides):
    """The Hydra overrides of one rm row: the run every row shares, then the row's layout."""
    # The pairs are token ids made here (make_pairs): the tokenizer only gives the pad id, so the word-level one is
    # used rather than training the default BPE on texts the run never reads.
    return ["experiment=tiny", "hardware=cpu", "model.tokenizer=words", *SHAPE, f"data.max_length={MAX_LENGTH}",
            f"train.max_steps={STEPS}", f"train.global_batch_size={PAIRS_PER_STEP}", "train.eval_batch_size=8",
            f"train.learning_rate={LR}", "train.lr_scheduler_type=linear", f"train.warmup_ratio={WARMUP / STEPS}",
            "train.max_grad_norm=1.0", "train.precision=32-true", "train.gradient_checkpointing=false",
            "train.eval_steps=0", "train.save_steps=0", f"train.logging_steps={min(10, STEPS)}", "preflight.mode=off",
            # experiment=tiny shares prefixes (the CPU demo's default): off unless the variant turns it on.
            "train.share_prefix=false", *variant_overrides]


def run_rm(data, variant_overrides, workdir: Path):
    from collections import Counter

    import datasets
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForSequenceClassification

    import rm.config  # noqa: F401  (registers the schemas)
    import rm.run_setup
    import rm.train as rm_train
    from rm.data.audit import audit_split, length_stats
    from rm.data.counts import PairCounts
    from rm.config import to_run_config

    overrides = rm_overrides(variant_overrides)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=overrides))
    train_set = datasets.Dataset.from_list(data["train"])
    eval_set = datasets.Dataset.from_list(data["eval"])

    def same_pairs(data_cfg, tokenizer):
        def audit(rows):  # nothing is dropped or truncated: the pairs are generated within max_length
            lengths = {side: [len(p[f"{side}_input_ids"]) for p in rows] for side in ("chosen", "rejected")}
            counts = PairCounts(rows=len(rows), lengths_before_truncation={
                side: length_stats(Counter(values)) for side, values in lengths.items()})
            return audit_split(counts, lengths["chosen"], lengths["rejected"])

        splits = {name: audit(rows) for name, rows in (("train", data["train"]), ("eval", data["eval"]))}
        return train_set, eval_set, {"data": "bench_vs_trl", "policies": {}, "splits": splits}

    rm.run_setup.build_datasets = same_pairs  # where the trainer's setup looks it up
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
        cfg = to_run_config(compose(config_name="config", overrides=["experiment=tiny", "hardware=cpu", "model.tokenizer=words", *SHAPE]))
    tokenizer = build_tokenizer(cfg.model)
    set_seed(42)
    model = build_model(cfg.model, tokenizer.pad_token_id, "float32", gradient_checkpointing=False)

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
    data = json.loads(Path(args.data_file).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        result = run_trl(data, Path(tmp)) if args.child == "trl" else run_rm(data, VARIANTS[args.child], Path(tmp))
    result.update(peak_rss_mib=peak_rss_mib(), tokens_per_s=result["real_tokens"] / result["train_s"],
                  pairs_per_s=result["steps"] * PAIRS_PER_STEP / result["train_s"], step_s=result["train_s"] / result["steps"])
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


def table(results) -> str:
    trl = results["TRL RewardTrainer"]
    lines = ["| trainer | pairs/s | real tokens/s | x TRL | step time (s) | peak RSS (MiB) | x TRL | final train loss "
             "| eval loss | eval accuracy | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['pairs_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / trl['tokens_per_s']:.2f} "
                     f"| {r['step_s']:.3f} | {r['peak_rss_mib']:,.0f} | {r['peak_rss_mib'] / trl['peak_rss_mib']:.2f} "
                     f"| {r['final_train_loss']:.4f} | {r['eval_loss']:.4f} | {r['eval_accuracy']:.3f} | {r['load']:.2f} |")
    return "\n".join(lines)


def run_dataset(name: str, args, tmp: Path) -> str:
    """Every trainer on one data set, one process each; returns the markdown section for it."""
    data = {"train": DATASETS[name](960, seed=0), "eval": DATASETS[name](256, seed=1)}
    fraction = padded_fraction(data["train"], seed=0)
    stats = prefix_stats(data["train"])
    about = (f"{len(data['train'])} train / {len(data['eval'])} eval pairs, median sequence {stats['median_length']} tokens; "
             f"shared prompt : answer tokens = {stats['prefix_to_suffix']:.2f} : 1 (prefix sharing computes "
             f"{100 * (1 - stats['shared_saves']):.0f}% of chosen + rejected tokens); random batches of {PAIRS_PER_STEP} "
             f"pairs padded to their longest row are {100 * fraction:.0f}% real tokens")
    print(f"{name} data: {about}", flush=True)
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(data))
    results = {}
    for trainer in ["TRL RewardTrainer", *VARIANTS]:
        if args.only and trainer not in args.only and trainer != "TRL RewardTrainer":
            continue
        out = tmp / "result.json"
        load = os.getloadavg()[0]
        print(f"  running {trainer} (1-minute load average {load:.2f}) ...", flush=True)
        done = subprocess.run([sys.executable, __file__, "--child", "trl" if trainer.startswith("TRL") else trainer,
                               "--data-file", str(path), "--out", str(out), "--threads", str(args.threads),
                               "--steps", str(STEPS)], cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{trainer} failed:\n{done.stderr[-4000:]}")
        results[trainer] = {**json.loads(out.read_text()), "load": (load + os.getloadavg()[0]) / 2}
        r = results[trainer]
        print(f"    {r['pairs_per_s']:.2f} pairs/s, {r['tokens_per_s']:,.0f} real tokens/s, {r['step_s']:.3f} s/step, "
              f"peak RSS {r['peak_rss_mib']:,.0f} MiB, eval accuracy {r['eval_accuracy']:.3f}", flush=True)
    return f"### {name} data\n\n{about}.\n\n{table(results)}\n"


def main() -> None:
    global STEPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (a smoke test: --steps 10)")
    parser.add_argument("--data", nargs="*", default=list(DATASETS), choices=list(DATASETS), help="data sets to run")
    parser.add_argument("--write-doc", action="store_true", help="write the tables into docs/throughput.md")
    parser.add_argument("--only", nargs="*", help="run only these rm trainers (names as in the table); TRL always runs")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data-file", dest="data_file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    STEPS = args.steps
    if args.child:
        return child(args)

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        sections = [run_dataset(name, args, Path(tmp)) for name in args.data]
    load_after = os.getloadavg()
    footer = (f"1-minute / 5-minute load average {load_before[0]:.2f} / {load_before[1]:.2f} before the run, "
              f"{load_after[0]:.2f} / {load_after[1]:.2f} after (the load avg column: mean of before and after each trainer); "
              f"{args.threads} threads, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d', time.gmtime())}, "
              f"`python benchmarks/bench_vs_trl.py {' '.join(sys.argv[1:])}`.")
    text = "\n".join(sections) + "\n" + footer
    print(text)
    if args.write_doc:
        doc = ROOT / "docs" / "throughput.md"
        body = doc.read_text() if doc.exists() else ""
        start, end = "<!-- bench_vs_trl:begin -->", "<!-- bench_vs_trl:end -->"
        block = f"{start}\n{text}\n{end}"
        body = body[: body.index(start)] + block + body[body.index(end) + len(end):] if start in body else body + "\n" + block + "\n"
        doc.write_text(body)
        print(f"wrote {doc}")


if __name__ == "__main__":
    main()
