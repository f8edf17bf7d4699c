"""QLoRA against LoRA on the CPU demo: eval accuracy over seeds, and what the 4-bit base changes (docs/memory.md, QLoRA).

    python benchmarks/qlora_vs_lora.py runs DIR --seeds 42 1 2 3 4 5 6 7 [--steps 100]
    python benchmarks/qlora_vs_lora.py features --seed 42

``runs`` trains, per seed, ``python -m rm.train experiment=tiny train.max_steps=STEPS train.logging.eval_steps=STEPS
train.seed=SEED`` four ways, one process at a time with ``OMP_NUM_THREADS=1`` (on a shared 2-core machine two
threads per process made steps 3-10x slower), and prints the last eval accuracy of each with mean and spread:

* ``lora``: ``memory_profile=lora``, the base built from the shape at the seed;
* ``qlora``: ``memory_profile=qlora``, that same random init saved and loaded in NF4 (rm.modelling.model.saved_random_init);
* ``lorabase``: ``memory_profile=lora`` with ``model.pretrained`` = that saved init, unquantised. Nothing is drawn
  at load, so its adapters start from the draws QLoRA's start from: ``qlora - lorabase`` is the 4-bit base alone
  (tests/memory/test_profiles.py::test_qlora_trains_as_lora_on_its_dequantised_base: QLoRA computes exactly as LoRA on
  the dequantised weights);
* ``loranoise``: as ``lorabase`` with Gaussian noise of the NF4 error's size added to each quantised matrix: a
  perturbation as large as NF4's, without its structure.

A run whose ``final/`` exists is not run again, so the command also reprints a finished table. The runs' bases
(saved init, with the run's tokenizer) go under DIR/bases, the random inits under $RM_CACHE (default ~/.cache/rm).

``features`` prints, for the saved init at one seed, the NF4 round trip's relative error per matrix (with and without
double quantisation, and for a 4096 x 4096 Gaussian of the same std), and how much of the demo's preference signal
the frozen features carry before any training: a logistic probe on (h_chosen - h_rejected), h the last token's
hidden state the reward head reads, fitted on 3200 train pairs and scored on the 1000 eval pairs, for the init, its
NF4 round trip and the init plus Gaussian noise of the NF4 error's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("lora", "qlora", "lorabase", "loranoise")


def saved_init(seed: int) -> Path:
    """The saved random init a ``memory_profile=qlora train.seed=SEED`` demo run quantises."""
    from accelerate.utils import set_seed

    from rm.foundations.config import to_run_config
    from rm.modelling.model import saved_random_init
    from tests.conftest import compose_run

    cfg = to_run_config(compose_run(["experiment=tiny"]))
    set_seed(seed)  # as the run does before it builds
    return saved_random_init(cfg.model, pad_token_id=0)  # the demo tokenizer's <pad>


def nf4_round_trip(weight: torch.Tensor, double_quant: bool = True) -> torch.Tensor:
    """The weight as bitsandbytes stores it for QLoRA (NF4, blocks of 64, as transformers' BitsAndBytesConfig), back in fp32."""
    import bitsandbytes.functional as bnbf

    packed, state = bnbf.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    return bnbf.dequantize_4bit(packed, state).float()


def perturbed_states(state: dict) -> dict:
    """``{"base": state, "nf4": NF4 round trip, "noise": state + Gaussian noise of each matrix's NF4 error std}``."""
    nf4, noise = dict(state), dict(state)
    generator = torch.Generator().manual_seed(1)
    for key, weight in state.items():
        if key.endswith("proj.weight"):  # the linear layers QLoRA quantises (embeddings, norms, head stay as they are)
            nf4[key] = nf4_round_trip(weight).to(weight.dtype)
            noise[key] = weight + torch.randn(weight.shape, generator=generator) * (nf4[key] - weight).float().std()
    return {"base": state, "nf4": nf4, "noise": noise}


def write_bases(seed: int, out: Path, tokenizer_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    init = saved_init(seed)
    for name, state in perturbed_states(load_file(init / "model.safetensors")).items():
        directory = out / f"{name}_s{seed}"
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(init / "config.json", directory)
        for file in tokenizer_dir.iterdir():
            shutil.copy(file, directory)
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"})


def last_eval_accuracy(run_dir: Path) -> float:
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    return evals[-1]["eval_accuracy"]


def train(run_dir: Path, steps: int, seed: int, *overrides: str) -> None:
    if (run_dir / "final").is_dir():
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "rm.train", "experiment=tiny", f"train.max_steps={steps}", f"train.logging.eval_steps={steps}",
               f"train.seed={seed}", *overrides, f"hydra.run.dir={run_dir}"]
    with open(f"{run_dir}.log", "w") as log:
        print(f"{run_dir.name}: load {os.getloadavg()[0]:.1f}", flush=True)
        subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)


def runs(out: Path, seeds, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        train(out / f"lora_s{seed}", steps, seed, "memory_profile=lora")
        train(out / f"qlora_s{seed}", steps, seed, "memory_profile=qlora")
        if not (out / "bases" / f"noise_s{seed}" / "config.json").is_file():
            write_bases(seed, out / "bases", out / f"lora_s{seed}" / "tokenizer")
        for variant, base in (("lorabase", "base"), ("loranoise", "noise")):
            train(out / f"{variant}_s{seed}", steps, seed, "memory_profile=lora", f"model.pretrained={out / 'bases' / f'{base}_s{seed}'}")
    acc = {v: [last_eval_accuracy(out / f"{v}_s{s}") for s in seeds] for v in VARIANTS}
    print(f"eval accuracy after {steps} steps, seeds {' '.join(map(str, seeds))}")
    for name, values in list(acc.items()) + [
        ("qlora - lora", [q - l for q, l in zip(acc["qlora"], acc["lora"])]),
        ("qlora - lorabase", [q - l for q, l in zip(acc["qlora"], acc["lorabase"])]),
        ("loranoise - lorabase", [q - l for q, l in zip(acc["loranoise"], acc["lorabase"])]),
        ("lorabase - lora", [q - l for q, l in zip(acc["lorabase"], acc["lora"])]),
    ]:
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        print(f"{name:22s} " + " ".join(f"{v:+.3f}" if "-" in name else f"{v:.3f}" for v in values)
              + f"   mean {statistics.mean(values):+.3f}  sd {spread:.3f}  min {min(values):+.3f}  max {max(values):+.3f}")


def probe_accuracy(model, tokenizer, train_pairs, eval_pairs):
    """Train and eval accuracy of an L2-regularised logistic probe on (h_chosen - h_rejected) of the frozen model."""

    def features(pairs):
        out = []
        for start in range(0, len(pairs), 100):
            rows = pairs[start:start + 100]
            enc = tokenizer([r["chosen"] for r in rows] + [r["rejected"] for r in rows], padding=True, truncation=True,
                            max_length=128, return_tensors="pt")
            with torch.no_grad():
                hidden = model.model(**enc).last_hidden_state
            last = hidden[torch.arange(hidden.shape[0]), enc["attention_mask"].sum(1) - 1]
            out.append(last[:len(rows)] - last[len(rows):])
        return torch.cat(out)

    x_train, x_eval = features(train_pairs), features(eval_pairs)
    scale = x_train.std(0) + 1e-6  # not centred: the label (chosen first) is in the sign of the difference
    x_train, x_eval = x_train / scale, x_eval / scale
    w = torch.zeros(x_train.shape[1], requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=500)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.softplus(-(x_train @ w)).mean() + 1e-3 * w.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(((x_train @ w) > 0).float().mean()), float(((x_eval @ w) > 0).float().mean())


def features(seed: int, tokenizer_dir: Path | None) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rm.data.synthetic import generate_pairs

    init = saved_init(seed)
    state = load_file(init / "model.safetensors")
    matrices = {k: v.float() for k, v in state.items() if k.endswith("proj.weight")}
    for double_quant in (True, False):
        errors = [float((nf4_round_trip(w, double_quant) - w).norm() / w.norm()) for w in matrices.values()]
        print(f"NF4 round trip, double quantisation {'on ' if double_quant else 'off'}: relative Frobenius error "
              f"{min(errors):.4f}-{max(errors):.4f} over the {len(errors)} quantised matrices")
    gaussian = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    print(f"a 4096 x 4096 Gaussian matrix, std 0.02: {float((nf4_round_trip(gaussian) - gaussian).norm() / gaussian.norm()):.4f}")
    if tokenizer_dir is None:
        print("(no --tokenizer: the probe needs the demo's tokenizer, e.g. <run dir>/tokenizer)")
        return
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_pairs, eval_pairs = generate_pairs(3200, seed=0, split="train"), generate_pairs(1000, seed=0, split="test")
    model = AutoModelForSequenceClassification.from_pretrained(init, num_labels=1).eval()
    for name, weights in perturbed_states(state).items():
        model.load_state_dict(weights)
        fitted, held_out = probe_accuracy(model, tokenizer, train_pairs, eval_pairs)
        print(f"probe on the frozen features, {name:5s}: train {fitted:.3f}, eval {held_out:.3f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("runs")
    r.add_argument("out", type=Path)
    r.add_argument("--seeds", type=int, nargs="+", required=True)
    r.add_argument("--steps", type=int, default=100)
    f = sub.add_parser("features")
    f.add_argument("--seed", type=int, default=42)
    f.add_argument("--tokenizer", type=Path, help="the demo's tokenizer directory (a demo run's tokenizer/)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "runs":
        runs(args.out, args.seeds, args.steps)
    else:
        features(args.seed, args.tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
