"""How far each consumer's bf16 rewards are from rm.score's fp32 ones, on the demo's bundles.

    python benchmarks/consumers_bf16.py                          # prints the table
    python benchmarks/consumers_bf16.py --write-doc benchmarks/results/consumers_bf16.md

Trains the demo (``experiment=tiny``) for ``--steps`` steps twice, a full fine-tune and a LoRA run whose adapter is
also merged (``lora.merge_on_save=true``), then scores the same eval conversations (the synthetic test pairs, both
sides) with ``python -m rm.score`` in fp32 (the reference) and with each consumer as its users run it in bf16:

* transformers: ``AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.bfloat16)`` and
  ``tokenizer(text)``;
* TRL GRPO's reward path given the bundle's path with ``bf16=True`` (conversational prompts: the path TRL scores
  right; ``rm.score.reward_function`` scores in the bundle's saved dtype and is not in the table);
* OpenRLHF 0.11's reward server (``serve_rm``, its default ``--ds.param_dtype bf16``), through
  ``tests/e2e/consumers/openrlhf_rewards.py`` in OpenRLHF's own installation (built as the slow tests build it).

Each row: the largest and mean |bf16 reward - fp32 reward| over the texts, beside the spread (std) of the fp32
rewards, which says how large that is. The machine, date and load are printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def train(out: Path, steps: int, extra: list) -> Path:
    args = [sys.executable, "-m", "rm.train", "experiment=tiny", f"train.max_steps={steps}", f"train.logging.eval_steps={steps}",
            f"hydra.run.dir={out}", *extra]
    subprocess.run(args, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out / "final"


def conversations(n: int):
    from tests.e2e.test_consumers import messages

    from rm.data.synthetic import generate_pairs

    rows = generate_pairs(n, seed=3, split="test")
    return [messages(r[side]) for r in rows for side in ("chosen", "rejected")]


def reference(bundle: Path, convs, work: Path):
    import torch

    from rm.score import main as score_main

    src, dst = work / "in.jsonl", work / "out.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    assert score_main(["--model", str(bundle), "--input", str(src), "--output", str(dst)]) == 0
    return torch.tensor([json.loads(line)["reward"] for line in dst.read_text().splitlines()])


def transformers_bf16(bundle: Path, convs):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundle)
    model = AutoModelForSequenceClassification.from_pretrained(bundle, dtype=torch.bfloat16).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(convs), 16):
            batch = tokenizer.apply_chat_template(convs[i:i + 16], padding=True, return_tensors="pt", return_dict=True)
            out += model(**batch).logits[:, 0].float().tolist()
    return torch.tensor(out)


def trl_bf16(bundle: Path, convs, work: Path):
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    policy = work / "policy"
    tokenizer = AutoTokenizer.from_pretrained(bundle)
    config = AutoConfig.for_model("mistral", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    trainer = GRPOTrainer(model=str(policy), reward_funcs=str(bundle),
                          args=GRPOConfig(output_dir=str(work / "grpo"), bf16=True, use_cpu=True, report_to=[],
                                          per_device_train_batch_size=4, num_generations=2),
                          train_dataset=datasets.Dataset.from_list([{"prompt": "hi"}] * 4))
    prompts, completions = [c[:-1] for c in convs], [c[-1:] for c in convs]
    rewards = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, [[0]] * len(convs))
    return torch.as_tensor(rewards[:, 0], dtype=torch.float32)


def serve_rm_bf16(bundle: Path, convs, work: Path):
    import torch
    from transformers import AutoTokenizer

    from tests.e2e.test_consumers import _openrlhf_path

    tokenizer = AutoTokenizer.from_pretrained(bundle)
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in convs]  # what the agent decodes, specials in
    spec = work / "spec.json"
    spec.write_text(json.dumps({"texts": texts, "padding_side": "right", "normalize_reward": False, "param_dtype": "bf16"}))
    proc = subprocess.run([sys.executable, str(ROOT / "tests/e2e/consumers/openrlhf_rewards.py"), str(bundle), str(spec)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(_openrlhf_path())})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])["rewards"], dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pairs", type=int, default=64, help="eval pairs scored (both sides)")
    parser.add_argument("--skip-openrlhf", action="store_true")
    parser.add_argument("--write-doc", type=Path)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="rm-bf16-"))
    bundles = {"full": train(work / "full", args.steps, []),
               "LoRA adapter": train(work / "lora", args.steps, ["memory_profile=lora", "lora=r8", "lora.merge_on_save=true",
                                                                  "train.optim.learning_rate=5e-3"])}
    bundles["LoRA merged"] = bundles["LoRA adapter"] / "merged"
    convs = conversations(args.pairs)
    rows = []
    for name, bundle in bundles.items():
        want = reference(bundle, convs, work)
        consumers = {"transformers, dtype=bfloat16": lambda: transformers_bf16(bundle, convs),
                     "TRL GRPO, reward_funcs=<path>, bf16=True": lambda: trl_bf16(bundle, convs, work / name.replace(" ", "_"))}
        if not args.skip_openrlhf:
            consumers["OpenRLHF serve_rm, --ds.param_dtype bf16"] = lambda: serve_rm_bf16(bundle, convs, work)
        for consumer, score in consumers.items():
            diff = (score() - want).abs()
            rows.append((consumer, name, float(diff.max()), float(diff.mean()), float(want.std())))
            print(f"{consumer} | {name}: max {rows[-1][2]:.3g}, mean {rows[-1][3]:.3g} (reward std {rows[-1][4]:.3g})",
                  flush=True)
    lines = ["| consumer | bundle | max abs difference | mean abs difference | fp32 reward std |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {c} | {b} | {m:.3g} | {a:.3g} | {s:.3g} |" for c, b, m, a, s in rows]
    header = (f"# bf16 consumers against rm.score in fp32\n\n`python benchmarks/consumers_bf16.py --steps {args.steps} "
              f"--pairs {args.pairs}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()} CPU "
              f"({os.cpu_count()} cores), 1-minute load {load_before:.2f} before, {os.getloadavg()[0]:.2f} after. "
              f"The demo's bundles after {args.steps} steps; {2 * args.pairs} synthetic test conversations, scored "
              "as each consumer renders them (chat template, the bundle's tokenizer).\n\n")
    note = ("\nbf16 keeps 8 bits of mantissa: a reward of size r moves by up to about r / 256 from its own rounding, "
            "plus what every layer's rounding adds on the way, so the differences grow with the rewards' scale "
            "(the fp32 std beside each row); other bundles give other figures. `rm.score.reward_function` scores in "
            "the bundle's saved dtype whatever TRL's `bf16` says.\n")
    table = header + "\n".join(lines) + "\n" + note
    print(table)
    if args.write_doc:
        args.write_doc.write_text(table)


if __name__ == "__main__":
    main()
