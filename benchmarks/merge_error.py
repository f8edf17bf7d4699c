"""How far a merged LoRA / QLoRA bundle scores from its adapter bundle: the merge error docs/export.md states.

    python benchmarks/merge_error.py RUN_DIR [RUN_DIR ...]

For each run directory (a LoRA or QLoRA run of ``python -m rm.train``), ``final/merged`` is written with
``python -m rm.export RUN_DIR --merge`` where it is missing, then both bundles score the demo's eval pairs
(``generate_pairs(1000, seed=0, split="test")``: 2000 texts) through ``python -m rm.score``, the reference every
consumer test compares against. Printed: the largest and the mean absolute reward difference, and the rewards'
spread for scale. rm.score computes a 4-bit layer through its dequantised weight, as training did; with
``--bf16-kernel`` the adapter is also scored by a fresh transformers load that keeps bitsandbytes' AVX512-BF16
CPU inference kernel (only on a CPU that has it), which is what a consumer gets unless it turns the kernel off.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from rm.data.synthetic import generate_pairs
from rm.export import main as export_main
from rm.score import main as score_main


def rm_score_texts(bundle: Path, texts, work: Path) -> torch.Tensor:
    src, dst = work / "texts.jsonl", work / "scored.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert score_main(["--model", str(bundle), "--input", str(src), "--output", str(dst), "--batch-size", "64"]) == 0
    return torch.tensor([json.loads(line)["reward"] for line in dst.read_text().splitlines()])


def kernel_rewards(bundle: Path, texts) -> torch.Tensor:
    """The adapter bundle as plain transformers loads it: bitsandbytes' bf16 CPU kernel left as it is."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bundle)
    model = AutoModelForSequenceClassification.from_pretrained(bundle).eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            out.append(model(**tokenizer(texts[i:i + 64], padding=True, return_tensors="pt")).logits[:, 0].float())
    return torch.cat(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--bf16-kernel", action="store_true", help="also score the adapter with bitsandbytes' CPU kernel")
    args = parser.parse_args(argv)
    pairs = generate_pairs(1000, seed=0, split="test")
    texts = [p["chosen"] for p in pairs] + [p["rejected"] for p in pairs]
    print(f"{'run':40s} {'texts':>6s} {'reward std':>10s} {'max |adapter - merged|':>23s} {'mean':>9s}")
    for run in args.runs:
        final = run / "final"
        if not (final / "merged" / "config.json").is_file():
            assert export_main([str(run), "--merge"]) == 0
        with tempfile.TemporaryDirectory() as work:
            adapter = rm_score_texts(final, texts, Path(work))
            merged = rm_score_texts(final / "merged", texts, Path(work))
        diff = (adapter - merged).abs()
        print(f"{str(run):40s} {len(texts):6d} {float(adapter.std()):10.3f} {float(diff.max()):23.2e} {float(diff.mean()):9.2e}")
        quantised = "quantization_config" in json.loads((final / "config.json").read_text())
        if args.bf16_kernel and quantised:
            from bitsandbytes.functional import has_avx512bf16

            if has_avx512bf16():
                kdiff = (kernel_rewards(final, texts) - merged).abs()
                print(f"{'  adapter with the bf16 CPU kernel':40s} {len(texts):6d} {'':10s} {float(kdiff.max()):23.2e} "
                      f"{float(kdiff.mean()):9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
