"""What each precision mode does to training at a small learning rate, measured on the CPU: benchmarks/results/precision_modes.md.

    python benchmarks/precision_modes.py                # every row, about 10 minutes on 2 cores
    python benchmarks/precision_modes.py --steps 20     # a quick look

The demo model (``experiment=tiny``: 2 layers, hidden 128, weights from N(0, 0.02)) trains ``--steps`` optimizer steps
at ``train.optim.learning_rate=1e-5`` (the README's full fine-tune value) in each mode and layout. A wrapper saves the weights
as the factory built them (before the first step); the share of weights that differ bit for bit in ``final/`` is the
share the run moved at all. CPU autocast computes bf16 as a GPU's does; fp16 (``16-mixed``) needs a GPU and is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rm.foundations.precision import Precision  # noqa: E402

# Runs rm.train as `python -m rm.train` does, with the factory wrapped to save what it built (rank 0).
WRAPPER = """
import os, runpy
import rm.training.run_setup as setup
from safetensors.torch import save_file
real = setup.build_reward_model
def build(*args, **kwargs):
    model = real(*args, **kwargs)
    if int(os.environ.get("RANK", "0")) == 0:
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, os.environ["RM_INITIAL"])
    return model
setup.build_reward_model = build
runpy.run_module("rm.train", run_name="__main__", alter_sys=True)
"""

LAYOUTS = {"one process": (1, ["distributed=ddp"]), "DDP x2": (2, ["distributed=ddp"]), "ZeRO-2 x2": (2, ["distributed=zero2"])}
ROWS = [  # (train.precision, extra overrides, layout)
    ("32-true", [], "one process"),
    ("bf16-mixed", [], "one process"),
    ("bf16-true", [], "one process"),
    ("bf16-true", ["train.optim.kahan_summation=true"], "one process"),
    ("32-true", [], "DDP x2"),
    ("bf16-mixed", [], "DDP x2"),
    ("bf16-true", [], "DDP x2"),
    ("32-true", [], "ZeRO-2 x2"),
    ("bf16-mixed", [], "ZeRO-2 x2"),
]


def run_row(precision: str, extra: list, layout: str, steps: int, lr: float, workdir: Path) -> dict:
    """Train one row; the share of weights changed, the eval loss and accuracy, the lost-update metric if logged."""
    from safetensors.torch import load_file

    nproc, dist = LAYOUTS[layout]
    run_dir = workdir / f"run{len(list(workdir.iterdir()))}"
    script = workdir / "wrapper.py"
    script.write_text(WRAPPER)
    overrides = ["experiment=tiny", *dist, f"train.precision={precision}", "hardware.bf16=true", *extra,
                 f"train.optim.learning_rate={lr}", f"train.max_steps={steps}", f"train.logging.eval_steps={steps}", "train.optim.warmup_ratio=0",
                 "train.optim.lr_scheduler_type=constant_with_warmup", f"train.global_batch_size={8 * nproc}",
                 "train.micro_batch_size=8", "train.eval_batch_size=64", "train.checkpoint.save_steps=0", f"hydra.run.dir={run_dir}"]
    launch = [sys.executable, str(script)]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                  str(_free_port()), str(script)]
    env = dict(os.environ, RM_INITIAL=str(run_dir.with_suffix(".initial.safetensors")))
    start = time.perf_counter()
    proc = subprocess.run([*launch, *overrides], cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    row = {"precision": precision, "extra": extra, "layout": layout, "steps": steps, "lr": lr, "wall_s": wall}
    if proc.returncode != 0:
        return {**row, "error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300]}
    initial = load_file(env["RM_INITIAL"])
    final = load_file(run_dir / "final" / "model.safetensors")
    changed = total = 0
    for name, before in initial.items():
        if name in final and before.is_floating_point():
            after = final[name].to(before.dtype)
            changed += int((after != before).sum())
            total += before.numel()
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in evals if "eval_loss" in r][-1]
    lost = [r["lost_update_fraction"] for r in evals if "lost_update_fraction" in r]
    return {**row, "changed": changed / total, "weights": total, "eval_loss": last["eval_loss"],
            "eval_accuracy": last["eval_accuracy"], "lost_update_fraction": lost[-1] if lost else None,
            "saved_dtype": _dominant_dtype(final)}


def _dominant_dtype(tensors: dict) -> str:
    """The dtype that holds most of the elements (the reward head may be fp32 beside bf16 weights)."""
    counts: dict = {}
    for t in tensors.values():
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return str(max(counts, key=counts.get)).replace("torch.", "")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_doc(rows: list, args, elapsed: float, out: Path) -> None:
    load = os.getloadavg()
    lines = [
        "# Precision modes at a small learning rate (CPU)",
        "",
        f"Regenerate: `python benchmarks/precision_modes.py --steps {args.steps}` ({elapsed:.0f} s on {os.cpu_count()} CPU cores, "
        f"load average {load[0]:.1f} at the end, {time.strftime('%Y-%m-%d')}).",
        "",
        f"The demo model (`experiment=tiny`, 2 layers, hidden 128, weights from N(0, 0.02)) trains {args.steps} optimizer steps of",
        f"8 pairs per process at `train.optim.learning_rate={args.lr:g}` (constant) in each mode. **Weights changed**: the share of",
        "the model's weights that differ at all from what the factory built, compared in the dtype the run keeps them in.",
        "**Lost updates**: the `lost_update_fraction` the run logged at its last step (`rm.training.health`), where logged.",
        "`16-mixed` needs a GPU (CPU autocast has no gradient scaler path in rm) and is not run here.",
        "",
        "**Trained weights**: the dtype the optimizer's view of the weights is kept in under that engine (`rm.foundations.precision`:",
        "DeepSpeed keeps fp32 master partitions beside a bf16 module, and its saved weights are the bf16 module's, so",
        "an fp32 update too small to move the bf16 copy yet shows as unchanged there).",
        "",
        "| train.precision | layout | trained weights | weights changed | lost updates | eval loss | eval accuracy | wall (s) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mode = f"`{r['precision']}`" + (" + " + " ".join(f"`{e}`" for e in r["extra"]) if r["extra"] else "")
        if "error" in r:
            lines.append(f"| {mode} | {r['layout']} | failed: {r['error']} | | | | | |")
            continue
        n = Precision.of(r["precision"]).numerics(deepspeed=r["layout"].startswith("ZeRO"))
        trained = n.weights.replace("float32", "fp32").replace("bfloat16", "bf16") + (" (fp32 master)" if n.master and n.master != n.weights else "")
        lost = "" if r["lost_update_fraction"] is None else f"{r['lost_update_fraction']:.1%}"
        lines.append(f"| {mode} | {r['layout']} | {trained} | {r['changed']:.1%} | {lost} | {r['eval_loss']:.5f} | "
                     f"{r['eval_accuracy']:.4f} | {r['wall_s']:.0f} |")
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--rows", nargs="*", type=int, help="only these rows of ROWS (0-based)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "precision_modes.md"))
    parser.add_argument("--doc-only", type=float, metavar="SECONDS",
                        help="run nothing: write the doc from the saved JSON, stating SECONDS as the run's wall time")
    args = parser.parse_args()
    if args.doc_only is not None:
        write_doc(json.loads(Path(args.out).with_suffix(".json").read_text()), args, args.doc_only, Path(args.out))
        return
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (precision, extra, layout) in enumerate(ROWS):
            if args.rows is None or i in args.rows:
                rows.append(run_row(precision, extra, layout, args.steps, args.lr, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    write_doc(rows, args, time.perf_counter() - start, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
