"""Measure each memory profile on a small model on this machine and write benchmarks/results/memory_profiles.md.

    python benchmarks/profile_table.py                 # about 10 minutes on 2 CPU cores
    python benchmarks/profile_table.py --steps 4 --out /tmp/table.md
    python benchmarks/profile_table.py --rows benchmarks/results/memory_profiles.rows.jsonl --measure qlora   # one profile again

Every profile trains the same ~50M-parameter Mistral-architecture model (random init, the
word-level tokenizer, synthetic pairs) for the same steps in a fresh process. Peak memory is counted two ways:
the peak of live tensor bytes (``train.logging.track_memory=true``, exact, what a GPU allocator would
hold) and the process's peak resident set size (``os.wait4``), which adds Python, the libraries and
malloc's caches (importing the stack alone is measured as the floor). Step time is the mean over
logged windows after the first.
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

# ~50M parameters: big enough that weights and optimizer states, not the interpreter, dominate.
MODEL = [
    "model.hidden_size=768", "model.intermediate_size=2048", "model.num_hidden_layers=8",
    "model.num_attention_heads=12", "model.num_key_value_heads=4", "model.head_dim=64",
]
WHERE = {
    "full": "fp32 weights, grads and AdamW states (2 x weights) in device memory",
    "lora": "frozen base in device memory; adapters + head, their grads and AdamW states (<1%)",
    "8bit": "weights and grads as full; AdamW states in 8 bits (2 bytes/param + block scales)",
    "offload": "weights and grads in device memory; fp32 AdamW states and the step on the CPU (DeepSpeed CPU Adam)",
    "qlora": "base in 4 bits (NF4, bitsandbytes; 0.5 byte/param + block scales), fp32 norms; adapters + head as lora",
}
PROFILES = ["none", *WHERE]


def run(profile: str, steps: int, workdir: Path, track_memory: bool) -> dict:
    run_dir = workdir / f"{profile}-{track_memory}"
    overrides = [
        "experiment=tiny", "model.tokenizer=words",  # the tokenizer benchmarks/results/memory_profiles.md was measured with
        *MODEL, "data.synthetic_train_size=1024", "data.synthetic_test_size=64",
        "data.max_length=64", "train.micro_batch_size=8", "train.global_batch_size=16",
        f"train.max_steps={max(steps, 1)}", "train.logging.logging_steps=1", "train.logging.eval_steps=0",
        "train.optim.learning_rate=1e-4", f"train.logging.track_memory={str(track_memory).lower()}", f"hydra.run.dir={run_dir}",
        "train.share_prefix=false",  # experiment=tiny shares prefixes; the profiles are compared on plain padded pairs
    ]
    command = [sys.executable, "-m", "rm.train", *overrides, f"memory_profile={profile}"]
    if profile == "none":  # the floor: the interpreter with torch, transformers, peft and DeepSpeed imported
        command = [sys.executable, "-c", "import rm.train, deepspeed, bitsandbytes"]
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    if status != 0:
        raise SystemExit(f"{profile} failed:\n{stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if profile != "none" else []
    times = [e["step_time_s"] for e in events if e["event"] == "train"][1:]
    live = json.loads((run_dir / "memory.json").read_text())["measured"] if profile != "none" and track_memory else {}
    return {
        "profile": profile,
        "peak_tensor_mib": live.get("peak_allocated_bytes", 0) / 2**20,
        "peak_rss_mib": usage.ru_maxrss / 1024,
        "step_time_s": sum(times) / len(times) if times else float("nan"),
        "wall_s": time.perf_counter() - start,
        "load_average": os.getloadavg()[0],  # beside the step time: other processes slow it, not the memory
    }


def render(rows: list, steps: int) -> str:
    floor = rows[0]["peak_rss_mib"]
    full = next(r for r in rows if r["profile"] == "full")["peak_tensor_mib"]
    lines = [
        "# Memory profiles: what lives where, measured on a CPU",
        "",
        f"Regenerate: `python benchmarks/profile_table.py` ({steps} steps per profile; "
        f"machine: {os.cpu_count()} CPU cores, {platform.machine()}, torch {__import__('torch').__version__}).",
        "",
        "A ~50M-parameter Mistral-architecture model (hidden 768, 8 layers, built-in vocabulary), fp32, 16 pairs per",
        "step in micro-batches of 8, sequences up to 64 tokens. Peak tensors = the peak of live tensor bytes during",
        "training, counted exactly (`train.logging.track_memory=true`); peak RSS = the process's peak resident memory, which",
        f"adds Python, the libraries and malloc's caches (importing them alone takes {floor:.0f} MiB).",
        "Step times come from separate runs without counting (counting slows these steps 5-8x).",
        "On a GPU the same split decides device memory; every profile's estimate against an H100: memory_calibration_gpu.md.",
        "",
        "| profile | what lives where | peak tensors (MiB) | vs `full` | peak RSS (MiB) | step time (s) | load average |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows[1:]:
        tensors, ratio = f"{r['peak_tensor_mib']:.0f}", f"{r['peak_tensor_mib'] / full:.2f}x"
        load = f"{r['load_average']:.1f}" if "load_average" in r else "not recorded"
        lines.append(f"| `{r['profile']}` | {WHERE[r['profile']]} | {tensors} | {ratio} | {r['peak_rss_mib']:.0f} "
                     f"| {r['step_time_s']:.2f} | {load} |")
    lines += [
        "",
        "On a CPU `offload` moves nothing off the device (the device is the CPU, so its row counts the CPU-side fp32",
        "master copy, AdamW moments and gradient copy too) and adds DeepSpeed's two gradient buckets, so it shows the",
        "cost side only; on a GPU it removes the AdamW states (8 bytes/parameter, plus fp32 master weights under",
        "bf16) from device memory. DeepSpeed allocates each bucket at its configured size whatever the model;",
        "rm caps the buckets at the trainable parameter count (DeepSpeed's default, 5e8 elements, would add 4 GB here).",
        "",
        "`qlora` runs on a CPU through bitsandbytes' CPU backend (measured here; the base is a random init saved from the",
        "shape, then loaded in 4 bits, see the profile table of docs/memory.md). Its 4-bit base saves the frozen weights' 3.5",
        "bytes per parameter; the activations, which dominate at this size, stay. Its step time is bitsandbytes' CPU",
        "4-bit matmul without the optional `kernels` package (the weight dequantised in every matmul, forward and",
        "backward): a CPU measures that QLoRA runs and what it holds, not its speed, which belongs to a CUDA GPU.",
        "Step times were measured at the load average beside them (the other rows before it was recorded).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_profiles.md"))
    parser.add_argument("--rows", help="render the table from the JSON rows an earlier run printed, without running")
    parser.add_argument("--measure", nargs="*", choices=PROFILES, default=None,
                        help="with --rows: measure these profiles again and put them in the rows file")
    args = parser.parse_args()
    rows = []
    if args.rows:
        rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.startswith("{")]
    if not args.rows or args.measure:
        measure = args.measure or PROFILES
        rows = [r for r in rows if r["profile"] not in measure]
        with tempfile.TemporaryDirectory() as tmp:
            for profile in measure:
                # Counting tensors dispatches every operator through Python (5-8x slower here), so the
                # step time comes from a second, untracked run.
                row = run(profile, args.steps, Path(tmp), track_memory=True)
                if profile != "none":
                    row["step_time_s"] = run(profile, args.steps, Path(tmp), track_memory=False)["step_time_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        rows.sort(key=lambda r: PROFILES.index(r["profile"]))
        if args.rows:
            Path(args.rows).write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path(args.out).write_text(render(rows, args.steps))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
