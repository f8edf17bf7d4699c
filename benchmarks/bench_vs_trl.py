"""rm against TRL's RewardTrainer on the same run: pairs/s, real-token throughput, step time, peak memory, eval.

    pip install -e '.[bench]'                          # trl, the one benchmark-only dependency
    python benchmarks/bench_vs_trl.py                  # prints both tables (multi-turn, single-turn)
    python benchmarks/bench_vs_trl.py --write-doc      # and writes them to benchmarks/results/throughput.md
    python benchmarks/bench_vs_trl.py --setup gpu-1b --out-json gpu_1b.json    # on a CUDA GPU (docs/gpu.md)

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

rm's own data pipeline is bypassed in its child (``rm.training.run_setup.build_datasets`` returns the
benchmark's pairs) so that both trainers see identical token ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB, MAX_LENGTH, PAIRS_PER_STEP, STEPS, LR, WARMUP = 2000, 512, 8, 60, 1e-3, 3
SHAPE = ["model.vocab_size=2000", "model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=64",
         "model.max_position_embeddings=512"]


@dataclass(frozen=True)
class Setup:
    """What one comparison runs: the model, the batch, the precision and where; both trainers read it."""

    shape: tuple = tuple(SHAPE)
    pairs_per_step: int = PAIRS_PER_STEP
    steps: int = STEPS
    precision: str = "32-true"  # rm's train.precision; TRL gets the same (bf16-mixed: fp32 model, bf16=True)
    hardware: str = "cpu"
    lora: bool = False  # LoRA r16 on every linear layer, bf16 frozen base (rm's memory_profile=lora)
    checkpointing: bool = False
    micro: int = 8  # pairs per micro-batch of the padded rows (TRL's per-device batch)
    small_micro: int = 2  # the grouped rows
    budget: int = 1024  # tokens per packed micro-batch
    skip_steps: int = 0  # steps left out of the timing (GPU warm-up: kernels, autotuning, the allocator)
    eval_pairs: int = 256


SETUPS = {
    "cpu": Setup(),
    # About 1.1B parameters (TinyLlama's shape, Mistral architecture), full fine-tune in bf16-mixed.
    "gpu-1b": Setup(shape=("model.vocab_size=32000", "model.hidden_size=2048", "model.intermediate_size=5632",
                           "model.num_hidden_layers=22", "model.num_attention_heads=32", "model.num_key_value_heads=4",
                           "model.head_dim=64", "model.max_position_embeddings=2048"),
                    pairs_per_step=32, steps=40, precision="bf16-mixed", hardware="auto", micro=8, small_micro=8,
                    budget=8192, skip_steps=10, eval_pairs=64),
    # The flagship's LoRA run: Mistral-7B shape, r16 on every linear layer, gradient checkpointing.
    "gpu-7b-lora": Setup(shape=("model=mistral_7b", "model.pretrained=null", "model.max_position_embeddings=2048"),
                         pairs_per_step=16, steps=16, precision="bf16-mixed", hardware="auto", lora=True,
                         checkpointing=True, micro=4, small_micro=4, budget=4096, skip_steps=4, eval_pairs=32),
}
SETUP = SETUPS["cpu"]
def variants(setup: Setup) -> dict:
    """name: rm overrides on top of the shared run."""
    m, small, budget = setup.micro, setup.small_micro, setup.budget
    flex = {} if setup.hardware == "cpu" else {  # flex-attention's block-sparse mask is compiled for GPUs only
        f"rm prefix-shared + packed, flex_attention (budget {budget} tokens)": [
            f"train.micro_batch_size={m}", "train.share_prefix=true", "train.packing=true",
            f"train.max_tokens_per_micro_batch={budget}", "model.attn_implementation=flex_attention"]}
    ckpt = f"train.gradient_checkpointing={str(setup.checkpointing).lower()}"
    pinned = {  # each row's layout as given, none left to train.layout=auto
        "rm padded": [f"train.micro_batch_size={m}", "train.group_by_length=false"],
        f"rm padded + group_by_length (micro-batch {small})": [f"train.micro_batch_size={small}", "train.group_by_length=true"],
        f"rm packed (budget {budget} tokens)": [f"train.micro_batch_size={m}", "train.packing=true",
                                                f"train.max_tokens_per_micro_batch={budget}"],
        f"rm prefix-shared + packed (budget {budget} tokens)": [f"train.micro_batch_size={m}", "train.share_prefix=true",
                                                                "train.packing=true", f"train.max_tokens_per_micro_batch={budget}"],
        f"rm prefix-shared, row per pair + group_by_length (micro-batch {small})": [
            f"train.micro_batch_size={small}", "train.share_prefix=true", "train.group_by_length=true"],
        **flex,
    }
    if setup.hardware != "cpu":  # the padded step at other micro-batch sizes: rm.plan's GPU op cost and overlap,
        # fitted from more than one configuration (benchmarks/plan_gpu_check.py prices each row)
        for n in (m // 4, m // 2, 2 * m):
            if n >= 1 and setup.pairs_per_step % n == 0:
                pinned[f"rm padded (micro-batch {n})"] = [f"train.micro_batch_size={n}", "train.group_by_length=false"]
    # What a new user runs: no layout flag at all, checkpointing included. Then the same two compiled
    # (train.compile=true: each decoder layer, its compile in the warm-up steps, which --skip-steps must cover).
    rows = {"rm, no layout flags (train.layout=auto)": [],
            **{name: ["train.layout=given", ckpt, *layout] for name, layout in pinned.items()}}
    rows["rm padded, compiled (train.compile=true)"] = [*rows["rm padded"], "train.compile=true"]
    rows["rm, no layout flags, compiled (train.compile=true)"] = ["train.compile=true"]
    return rows


VARIANTS = variants(SETUP)

BOS, EOS = 2, 3  # each side is BOS + its tokens + EOS, as rm's and TRL's tokenisation gives it (rm.data.tokenizer.encode_sides)


def make_pairs(n: int, seed: int):
    """``n`` pairs of token ids (BOS, then no pad id 0 or eos id 3, then EOS) with long-tailed lengths, chosen better
    than rejected."""
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
        prompt = [BOS] + rng.integers(4, 1000, length(48, 0.7, 320)).tolist()
        room = MAX_LENGTH - len(prompt) - 1
        pairs.append({
            "chosen_input_ids": prompt + answer(True, length(64, 0.6, room)) + [EOS],
            "rejected_input_ids": prompt + answer(False, length(64, 0.6, room)) + [EOS],
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
        prompt = [BOS] + prompt[-(MAX_LENGTH - 66):]  # at least 64 tokens of room for each answer, and its EOS
        room = MAX_LENGTH - len(prompt) - 1
        pairs.append({
            "chosen_input_ids": prompt + answer(True, length(48, 0.6, room)) + [EOS],
            "rejected_input_ids": prompt + answer(False, length(48, 0.6, room)) + [EOS],
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
    """Bradley-Terry loss and accuracy on ``pairs``, padded batches of 8, reward at the last real token
    (on the GPU under bf16 autocast where the setup trains there)."""
    import torch

    from rm.data.collator import PairCollator
    from rm.modelling.loss import bradley_terry_loss
    from rm.modelling.model import pair_rewards

    device = "cuda" if SETUP.hardware != "cpu" and torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    collate, losses, correct = PairCollator(pad_token_id=0), [], 0
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=SETUP.precision.startswith("bf16"))
    with torch.no_grad(), autocast:
        for i in range(0, len(pairs), 8):
            batch = collate(pairs[i : i + 8])
            chosen, rejected = pair_rewards(model, batch["input_ids"].to(device), batch["attention_mask"].to(device))
            losses.append(float(bradley_terry_loss(chosen.float(), rejected.float())) * len(chosen))
            correct += int((chosen > rejected).sum())
    return sum(losses) / len(pairs), correct / len(pairs)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def rm_overrides(variant_overrides, setup: Setup = None):
    """The Hydra overrides of one rm row: the run every row shares, then the row's layout."""
    setup = setup or SETUP
    logging = setup.skip_steps or min(10, setup.steps)  # windows: the first one holds the warm-up steps
    lora = ["memory_profile=lora", "lora=r16"] if setup.lora else []
    # The pairs are token ids made here (make_pairs): the tokenizer only gives the pad id, so the word-level one is
    # used rather than training the default BPE on texts the run never reads.
    # model=tiny's groups without experiment=tiny, whose layout settings would count as the user's
    return ["model=tiny", "data=synthetic", *(lora or ["memory_profile=full"]), f"hardware={setup.hardware}",
            "model.tokenizer=words", *setup.shape,
            f"data.max_length={MAX_LENGTH}", f"train.max_steps={setup.steps}", f"train.global_batch_size={setup.pairs_per_step}",
            "train.eval_batch_size=8", f"train.optim.learning_rate={LR}", "train.optim.lr_scheduler_type=linear",
            f"train.optim.warmup_ratio={WARMUP / setup.steps}", "train.optim.max_grad_norm=1.0", f"train.precision={setup.precision}",
            "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", f"train.logging.logging_steps={logging}", "preflight.mode=off",
            *variant_overrides]


def run_rm(data, variant_overrides, workdir: Path):
    from collections import Counter

    import datasets
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForSequenceClassification

    import rm.foundations.config  # noqa: F401  (registers the schemas)
    import rm.training.run_setup
    import rm.train as rm_train
    from rm.data.audit import audit_split, length_stats
    from rm.data.counts import PairCounts
    from rm.foundations.config import to_run_config

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

    rm.training.run_setup.build_datasets = same_pairs  # where the trainer's setup looks it up
    # Tokens the model computes, padding included (a shared prompt once): the compute ceiling's denominator.
    import rm.training.trainer

    computed, moved = [0], rm.training.trainer.to_device

    def counting(batch, keys, device):
        if "margin" in keys:  # a training micro-batch (evaluation moves its batches elsewhere)
            computed[0] += batch["input_ids"].numel()
        return moved(batch, keys, device)

    rm.training.trainer.to_device = counting
    chosen = []  # what train.layout=auto logged it chose

    class Choice(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("train.layout=auto: "):
                chosen.append(record.getMessage().removeprefix("train.layout=auto: "))

    logging.getLogger("rm.train").addHandler(Choice())
    logging.getLogger("rm.train").setLevel(logging.INFO)
    profile_to = os.environ.get("RM_BENCH_PROFILE")  # a file: where the kernels' times go (a short diagnostic run)
    if profile_to:
        import torch

        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        prof = torch.profiler.profile(activities=activities)
        # Only the training steps after the warm-up: set-up, the final evaluation and the save (the model's copy to
        # the host was half the device's time in the H200's first profile) are not a step's time.
        warm, taken, window = min(SETUP.skip_steps, SETUP.steps // 2), [0], {}
        step = rm.training.trainer.train_step

        def profiled_step(run, micro_batches):
            if taken[0] == warm:
                torch.cuda.synchronize() if cuda else None
                prof.start()
                window["began"] = time.perf_counter()
            out = step(run, micro_batches)
            taken[0] += 1
            if taken[0] == SETUP.steps:
                torch.cuda.synchronize() if cuda else None
                window["wall"] = time.perf_counter() - window["began"]
                prof.stop()
            return out

        rm.training.trainer.train_step = profiled_step
        result = rm_train.train(cfg, workdir / "run")
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6
        steps = SETUP.steps - warm
        device = f", {busy:.2f} s of kernels on the device ({busy / window['wall']:.0%} busy)" if cuda else ""
        Path(profile_to).write_text(
            f"{' '.join(variant_overrides)}: steps {warm + 1}-{SETUP.steps} profiled, {window['wall']:.2f} s wall "
            f"({window['wall'] / steps:.3f} s a step, the profiler's own cost included){device}\n"
            + events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=45))
    else:
        result = rm_train.train(cfg, workdir / "run")
    windows = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if w["event"] == "train"]
    sizes = [w["step"] - previous for w, previous in zip(windows, [0] + [w["step"] for w in windows])]
    timed = [(w, n) for w, n in zip(windows, sizes) if w["step"] > SETUP.skip_steps]  # past the warm-up
    seconds = sum(w["step_time_s"] * n for w, n in timed)
    tokens = sum(w["tokens_per_s"] * w["step_time_s"] * n for w, n in timed)
    eval_loss = eval_accuracy = None
    if not SETUP.lora:  # a LoRA run's final/ is an adapter on a random base that exists nowhere else
        model = AutoModelForSequenceClassification.from_pretrained(workdir / "run" / "final")
        eval_loss, eval_accuracy = evaluate(model, data["eval"])
    memory = json.loads((workdir / "run" / "memory.json").read_text())["measured"]
    return {"real_tokens": round(tokens), "train_s": seconds, "steps": sum(n for _, n in timed),
            "computed_tokens_per_step": computed[0] / result["step"], "layout": chosen[0] if chosen else None,
            "final_train_loss": windows[-1]["loss"], "eval_loss": eval_loss, "eval_accuracy": eval_accuracy,
            "peak_allocated_gib": memory.get("peak_allocated_bytes", 0) / 2**30 if "cuda" in memory["method"] else None}


def run_trl(data, workdir: Path):
    import datasets
    import torch
    from accelerate.utils import set_seed
    from hydra import compose, initialize_config_dir
    from transformers import TrainerCallback
    from trl import RewardConfig, RewardTrainer

    import rm.foundations.config  # noqa: F401
    from rm.foundations.config import to_run_config
    from rm.modelling.model import build_model
    from rm.data.tokenizer import build_tokenizer

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=["experiment=tiny", "model.tokenizer=words", *SETUP.shape,
                                                                     *(["lora=r16"] if SETUP.lora else [])]))
    tokenizer = build_tokenizer(cfg.model)
    set_seed(42)
    # bf16-mixed as HF users run it: an fp32 model under bf16=True (autocast); a LoRA base frozen in bf16, as rm's.
    dtype = "bfloat16" if SETUP.lora else "float32"
    with torch.device("cuda" if SETUP.hardware != "cpu" else "cpu"):  # random init where it trains: seconds, not minutes
        model = build_model(cfg.model, tokenizer.pad_token_id, dtype, gradient_checkpointing=False)
    peft = None
    if SETUP.lora:
        from peft import LoraConfig

        peft = LoraConfig(task_type="SEQ_CLS", r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                          target_modules=list(cfg.lora.target_modules))

    class Clock(TrainerCallback):
        """Time and TRL's own real-token count at the end of every step (after the GPU has finished it)."""
        begin, marks = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            Clock.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            Clock.marks.append((time.perf_counter(), Clock.trainer._total_train_tokens))

    train = datasets.Dataset.from_dict({"chosen_ids": [p["chosen_input_ids"] for p in data["train"]],
                                        "rejected_ids": [p["rejected_input_ids"] for p in data["train"]]})
    bf16 = SETUP.precision.startswith("bf16")
    args = RewardConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=min(SETUP.micro, SETUP.pairs_per_step),
        gradient_accumulation_steps=max(1, SETUP.pairs_per_step // SETUP.micro),
        max_steps=SETUP.steps, learning_rate=LR, lr_scheduler_type="linear", warmup_steps=WARMUP, max_grad_norm=1.0,
        weight_decay=0.0, logging_steps=min(10, SETUP.steps), save_strategy="no", eval_strategy="no", report_to=[],
        use_cpu=SETUP.hardware == "cpu", bf16=bf16, fp16=False, gradient_checkpointing=SETUP.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if SETUP.checkpointing else None,
        max_length=MAX_LENGTH, seed=42, dataloader_num_workers=0, disable_dropout=True,
    )
    computed = [0]

    def count(module, args, kwargs):  # tokens TRL's forwards compute in training, padding included
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and ids is not None:
            computed[0] += ids.numel()

    model.register_forward_pre_hook(count, with_kwargs=True)
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer, callbacks=[Clock()],
                            peft_config=peft)
    Clock.trainer = trainer
    # TRL trains with transformers' own SDPA, as its users do (rm's, which keeps a GPU off cuDNN's kernel, is
    # registered by rm's first rewards: the evaluation after training)
    assert "rm.modelling.attention" not in sys.modules, "rm's attention would replace transformers' SDPA in TRL's run"
    out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    eval_loss, eval_accuracy = evaluate(trainer.model, data["eval"][: SETUP.eval_pairs]) if not SETUP.lora else (None, None)
    start_time, start_tokens = Clock.marks[SETUP.skip_steps - 1] if SETUP.skip_steps else (Clock.begin, 0)
    end_time, end_tokens = Clock.marks[-1]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    return {"real_tokens": int(end_tokens - start_tokens), "train_s": end_time - start_time,
            "steps": out.global_step - SETUP.skip_steps, "computed_tokens_per_step": computed[0] / out.global_step, "final_train_loss": losses[-1], "eval_loss": eval_loss,
            "eval_accuracy": eval_accuracy, "peak_allocated_gib": peak}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    data = json.loads(Path(args.data_file).read_text())
    data["eval"] = data["eval"][: SETUP.eval_pairs]
    with tempfile.TemporaryDirectory() as tmp:
        result = run_trl(data, Path(tmp)) if args.child == "trl" else run_rm(data, VARIANTS[args.child], Path(tmp))
    result.update(peak_rss_mib=peak_rss_mib(), tokens_per_s=result["real_tokens"] / result["train_s"],
                  pairs_per_s=result["steps"] * SETUP.pairs_per_step / result["train_s"],
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


def matmul_parameters(model) -> int:
    """Weights every token multiplies through: the blocks' projections and the reward head (not the embedding)."""
    heads, kv, hd = model.num_attention_heads, model.num_key_value_heads, model.head_dim or model.hidden_size // model.num_attention_heads
    per_layer = model.hidden_size * hd * (2 * heads + 2 * kv) + 3 * model.hidden_size * model.intermediate_size
    return model.num_hidden_layers * per_layer + model.hidden_size


def pair_flops(pair, model, shared: bool, lora: bool) -> float:
    """Model FLOPs of one pair's forward and backward, the formula of docs/gpu.md.

    Matmuls: 6 N per token (forward 2 N, backward 4 N); LoRA's frozen weights get no weight gradient, so 4 N.
    Attention: 12 x layers x (heads x head_dim) per (query, key) position pair the mask allows (QK^T and AV,
    2 FLOPs per multiply-add, forward + backward 3x the forward), causal within each sequence. Padding, the
    recomputation of gradient checkpointing and the tiny LoRA matmuls are not counted. With prefix sharing the
    prompt is computed once: its tokens count once and the rejected answer attends to the prompt, not to the
    chosen answer."""
    from rm.data.collator import common_prefix_length

    per_token = (4 if lora else 6) * matmul_parameters(model)
    width = model.num_attention_heads * (model.head_dim or model.hidden_size // model.num_attention_heads)
    c, r = len(pair["chosen_input_ids"]), len(pair["rejected_input_ids"])
    causal = lambda n: n * (n + 1) / 2  # noqa: E731
    if shared:
        p = common_prefix_length(pair["chosen_input_ids"], pair["rejected_input_ids"])
        tokens, positions = c + r - p, causal(c) + (r - p) * p + causal(r - p)
    else:
        tokens, positions = c + r, causal(c) + causal(r)
    return per_token * tokens + 12 * model.num_hidden_layers * width * positions


DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s, SXM datasheets


def peak_bf16() -> tuple:
    """(name, dense bf16 FLOP/s from the datasheet) of this GPU, or (name, None) if the table has no entry."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return name, next((v for k, v in DATASHEET_BF16.items() if k in name), None)


def table(results) -> str:
    trl = results["TRL RewardTrainer"]
    gpu = any(r.get("mfu") is not None for r in results.values())
    memory = "peak allocated (GiB)" if gpu else "peak RSS (MiB)"
    lines = [f"| trainer | pairs/s | real tokens/s | x TRL | compute ceiling | step time (s) | {memory} | x TRL "
             f"| final train loss | eval loss | eval accuracy |{' MFU |' if gpu else ''} load avg |",
             f"|---|---|---|---|---|---|---|---|---|---|---|{'---|' if gpu else ''}---|"]
    num = lambda v, f: format(v, f) if v is not None else "n/a"  # noqa: E731
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:120]} |" + " |" * (10 + gpu))
            continue
        mem, base = (r["peak_allocated_gib"], trl.get("peak_allocated_gib")) if gpu else (r["peak_rss_mib"], trl["peak_rss_mib"])
        # TRL's computed tokens per step over this trainer's: the speed-up computing less alone would give
        ceiling = trl.get("computed_tokens_per_step", 0) / r["computed_tokens_per_step"] if r.get("computed_tokens_per_step") else None
        lines.append(f"| {name} | {r['pairs_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / trl['tokens_per_s']:.2f} "
                     f"| {num(ceiling, '.2f')} | {r['step_s']:.3f} | {num(mem, ',.2f' if gpu else ',.0f')} | {num(mem / base if mem and base else None, '.2f')} "
                     f"| {r['final_train_loss']:.4f} | {num(r['eval_loss'], '.4f')} | {num(r['eval_accuracy'], '.3f')} |"
                     f"{' ' + num(100 * r['mfu'] if r.get('mfu') else None, '.1f') + '% |' if gpu else ''} {r['load']:.2f} |")
    return "\n".join(lines)


def run_dataset(name: str, args, tmp: Path, saved: dict) -> str:
    """Every trainer on one data set, one process each; returns the markdown section for it. Each result also
    goes into ``saved`` (written to ``--out-json`` after every trainer, so a run cut short keeps what it measured)."""
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
    gpu_name, peak = peak_bf16() if SETUP.hardware != "cpu" else (None, None)
    if peak:
        from hydra import compose, initialize_config_dir

        from rm.foundations.config import to_run_config

        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            model = to_run_config(compose(config_name="config", overrides=rm_overrides([]))).model
        flops = {shared: sum(pair_flops(p, model, shared, SETUP.lora) for p in data["train"]) / len(data["train"])
                 for shared in (False, True)}
    results = saved.setdefault(name, {"about": about, "gpu": gpu_name, "setup": SETUP.__dict__, "results": {}})["results"]
    turns: Dict[str, List[dict]] = {}
    # --only's order: a GPU session cut short keeps the rows it named first. By default on a CPU the compiled rows
    # are left out: their compile, tens of seconds, needs --skip-steps to stay out of the timing.
    rows = args.only or [t for t in VARIANTS if SETUP.hardware != "cpu" or "train.compile=true" not in VARIANTS[t]]
    # TRL once; rm's rows --repeat turns each, in an order that rotates every turn, so that each row runs in each
    # place of a turn equally often (a machine's drift, or what one run leaves the next, then falls on every row
    # alike; an order merely reversed keeps the middle row in the middle), each row reported by its turn of median
    # step time.
    for turn in range(args.repeat):
        rotated = rows[turn % len(rows):] + rows[:turn % len(rows)]
        for trainer in (["TRL RewardTrainer"] if turn == 0 else []) + rotated:
            env = dict(os.environ)
            if args.profile_dir:  # a diagnostic of rm's rows: where each one's time goes, not a comparison
                if trainer.startswith("TRL"):
                    continue
                slug = "".join(ch if ch.isalnum() else "_" for ch in trainer).strip("_")[:60]
                env["RM_BENCH_PROFILE"] = str(Path(args.profile_dir).resolve() / f"profile_{name}_{slug}.txt")
            out = tmp / "result.json"
            load = os.getloadavg()[0]
            print(f"  running {trainer} (1-minute load average {load:.2f}) ...", flush=True)
            done = subprocess.run([sys.executable, __file__, "--child", "trl" if trainer.startswith("TRL") else trainer,
                                   "--data-file", str(path), "--out", str(out), "--threads", str(args.threads),
                                   "--steps", str(SETUP.steps), "--skip-steps", str(SETUP.skip_steps), "--setup", args.setup],
                                  cwd=ROOT, capture_output=True,
                                  text=True, env=env)
            if done.returncode:
                if trainer.startswith("TRL") or SETUP.hardware == "cpu":
                    sys.exit(f"{trainer} failed:\n{done.stderr[-4000:]}")
                results[trainer] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
                print(f"    failed: {done.stderr[-3000:]}", flush=True)
                continue
            r = {**json.loads(out.read_text()), "load": (load + os.getloadavg()[0]) / 2}
            if peak:
                r["model_flops_per_pair"] = flops["prefix-shared" in trainer]
                r["mfu"] = r["pairs_per_s"] * r["model_flops_per_pair"] / peak
            turns.setdefault(trainer, []).append(r)
            ordered = sorted(turns[trainer], key=lambda x: x["step_s"])
            results[trainer] = {**ordered[(len(ordered) - 1) // 2], "turns_step_s": [x["step_s"] for x in turns[trainer]]}
            if args.out_json:
                Path(args.out_json).write_text(json.dumps(saved, indent=1))
            print(f"    {r['pairs_per_s']:.2f} pairs/s, {r['tokens_per_s']:,.0f} real tokens/s, {r['step_s']:.3f} s/step, "
                  f"peak RSS {r['peak_rss_mib']:,.0f} MiB" + (f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") else "")
                  + (f", eval accuracy {r['eval_accuracy']:.3f}" if r["eval_accuracy"] is not None else ""), flush=True)
    results = {t: results[t] for t in ["TRL RewardTrainer", *rows] if t in results}  # the table's order
    saved[name]["results"] = results
    if args.profile_dir:
        return f"### {name} data: profiles in {args.profile_dir}\n"
    picked = [f"`{r['layout']}`" for r in results.values() if r.get("layout")]
    note = f"\n\nThe no-layout-flags row chose: {'; '.join(picked)}." if picked else ""
    if args.repeat > 1:
        note += (f"\n\nEach rm row ran {args.repeat} turns (TRL once) and is reported by its turn of median step time; "
                 "the turns' step times (s): " + "; ".join(f"{t}: {', '.join(f'{x:.3f}' for x in r['turns_step_s'])}"
                                                          for t, r in results.items() if len(r.get("turns_step_s", [])) > 1) + ".")
    return f"### {name} data\n\n{about}.\n\n{table(results)}{note}\n"


def main() -> None:
    global SETUP, VARIANTS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setup", choices=list(SETUPS), default="cpu",
                        help="cpu: the tiny model on 2 threads; gpu-1b: a 1.1B full fine-tune; gpu-7b-lora: Mistral-7B LoRA r16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (a smoke test: --steps 10)")
    parser.add_argument("--skip-steps", type=int, default=None, help="steps left out of the timing (the setup's "
                        "warm-up; a compiled row's compile needs about 10 on a CPU)")
    parser.add_argument("--data", nargs="*", default=list(DATASETS), choices=list(DATASETS), help="data sets to run")
    parser.add_argument("--write-doc", action="store_true", help="write the tables into benchmarks/results/throughput.md")
    parser.add_argument("--out-json", help="every result as JSON, rewritten after each trainer")
    parser.add_argument("--only", nargs="*", help="run only these rm trainers (names as in the table), in this order; "
                        "TRL always runs, first")
    parser.add_argument("--repeat", type=int, default=1, help="turns of each rm row (TRL runs once), reported by the "
                        "median step time: rows closer than one run's noise (about 10%% here) need several")
    parser.add_argument("--profile-dir", help="run rm's rows under torch.profiler (no TRL row) and write each one's "
                        "kernel table here: where a step's time goes (short runs: --steps 6)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--data-file", dest="data_file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    SETUP = replace(SETUPS[args.setup], **({"steps": args.steps} if args.steps else {}),
                    **({"skip_steps": args.skip_steps} if args.skip_steps is not None else {}))
    VARIANTS = variants(SETUP)
    if args.child:
        return child(args)
    unknown = [name for name in args.only or [] if name not in VARIANTS]
    if unknown:  # a misspelt row would be left out without a word
        parser.error(f"--only: no row named {unknown} in --setup {args.setup}; the rows: {list(VARIANTS)}")

    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    saved = {}
    with tempfile.TemporaryDirectory() as tmp:
        sections = [run_dataset(name, args, Path(tmp), saved) for name in args.data]
    load_after = os.getloadavg()
    footer = (f"1-minute / 5-minute load average {load_before[0]:.2f} / {load_before[1]:.2f} before the run, "
              f"{load_after[0]:.2f} / {load_after[1]:.2f} after (the load avg column: mean of before and after each trainer); "
              f"{args.threads} threads, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d', time.gmtime())}, "
              f"`python benchmarks/bench_vs_trl.py {' '.join(sys.argv[1:])}`.")
    text = "\n".join(sections) + "\n" + footer
    print(text)
    if args.write_doc:
        doc = ROOT / "benchmarks" / "results" / "throughput.md"
        body = doc.read_text() if doc.exists() else ""
        start, end = "<!-- bench_vs_trl:begin -->", "<!-- bench_vs_trl:end -->"
        block = f"{start}\n{text}\n{end}"
        body = body[: body.index(start)] + block + body[body.index(end) + len(end):] if start in body else body + "\n" + block + "\n"
        doc.write_text(body)
        print(f"wrote {doc}")


if __name__ == "__main__":
    main()
