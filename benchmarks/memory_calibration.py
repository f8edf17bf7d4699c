"""Compare the pre-flight estimate with measured peaks over a grid, and write docs/memory_calibration.md.

    python benchmarks/memory_calibration.py              # about 20 minutes on 2 CPU cores
    python benchmarks/memory_calibration.py --quick      # tiny and small models only, about 2 minutes

Each point trains 2 optimizer steps of 2 micro-batches (so gradients are being accumulated while
optimizer states exist, the steady-state peak) with ``train.track_memory=true``, which counts live
tensor bytes exactly, and reads estimate and measurement from the run's memory.json. Every point
runs in its own process. The ``offload`` profile runs DeepSpeed ZeRO-2 with CPU Adam; on a CPU its
"host" states share the device, so the count includes them. A second table runs the ``full``
profile under DeepSpeed ZeRO-2 and ZeRO-3 in one process (ZeRO-3 with one process gathers nothing,
so it measures DeepSpeed's fixed buffers only).
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
PROFILES = ["full", "lora", "8bit", "offload"]
HEADER = [
    "| model | profile | grad. checkpointing | max_length | estimate (MiB) | measured (MiB) | error | peak phase |",
    "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
]
MODELS = {
    "tiny (0.4M)": [],
    "small (13M)": ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_hidden_layers=4",
                    "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.head_dim=64"],
    "medium (134M)": ["model.hidden_size=1024", "model.intermediate_size=2816", "model.num_hidden_layers=12",
                      "model.num_attention_heads=16", "model.num_key_value_heads=4", "model.head_dim=64"],
}


def point(model: str, profile: str, checkpointing: bool, length: int, workdir: Path, distributed: str = "auto",
          extra: tuple = ()) -> dict:
    run_dir = workdir / f"{len(list(workdir.iterdir()))}"
    overrides = [f"distributed={distributed}",
        "experiment=tiny", *MODELS[model], f"memory_profile={profile}", f"train.gradient_checkpointing={checkpointing}",
        f"data.max_length={length}", "data.synthetic_train_size=256", "data.synthetic_test_size=8",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_batch_size=1", "train.max_steps=2",
        "train.eval_steps=0", "train.logging_steps=1", "train.track_memory=true", "preflight=warn",
        f"hydra.run.dir={run_dir}", *extra,
    ]
    proc = subprocess.run([sys.executable, "-m", "rm.train", *overrides], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model} {profile} failed:\n{proc.stderr[-3000:]}")
    memory = json.loads((run_dir / "memory.json").read_text())
    est, meas = memory["estimate"]["peak_bytes"], memory["measured"]["peak_allocated_bytes"]
    return {"model": model, "profile": profile, "distributed": distributed, "checkpointing": checkpointing, "max_length": length,
            "estimate_mib": est / 2**20, "measured_mib": meas / 2**20, "error_pct": 100 * (est - meas) / meas,
            "phase": memory["estimate"]["peak_phase"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--share-prefix", action="store_true",
                        help="run only the train.share_prefix points and rewrite their section of the doc")
    parser.add_argument("--out", default=str(ROOT / "docs" / "memory_calibration.md"))
    args = parser.parse_args()
    models = [m for m in MODELS if not (args.quick and m.startswith("medium"))]
    if args.share_prefix:
        return write_shared_section(Path(args.out), shared_points(models))
    rows, zero_rows, start = [], [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            lengths = [64, 128] if model.startswith("medium") else [32, 128]
            for profile in PROFILES:
                for checkpointing in [False, True]:
                    for length in lengths:
                        rows.append(point(model, profile, checkpointing, length, Path(tmp)))
                        print(json.dumps(rows[-1]), flush=True)
            for distributed in ["zero2", "zero3"]:
                zero_rows.append(point(model, "full", False, 64, Path(tmp), distributed))
                print(json.dumps(zero_rows[-1]), flush=True)
    worst = max(abs(r["error_pct"]) for r in rows)
    lines = [
        "# Memory estimate vs measurement (CPU)",
        "",
        f"Regenerate: `python benchmarks/memory_calibration.py{' --quick' if args.quick else ''}` "
        f"({len(rows)} points, {time.perf_counter() - start:.0f} s on {os.cpu_count()} CPU cores).",
        "",
        "Each point: 2 optimizer steps of 2 micro-batches of 2 pairs (4 sequences) padded to `max_length`, fp32,",
        "measured as the exact peak of live tensor bytes (`train.track_memory=true`). Largest error: "
        f"**{worst:.2f}%**. GPU figures (allocator reserve, CUDA context) are not measured yet: no GPU was available.",
        "",
        *HEADER,
    ]
    for r in rows:
        lines.append(row_line(r))
    lines += [
        "",
        "## DeepSpeed ZeRO stages, `full` profile, one process",
        "",
        "Checkpointing off, `max_length=64`. With one process ZeRO-3 shards and gathers nothing, so these rows check",
        "DeepSpeed's own buffers; the estimate for ZeRO-3 is labelled uncalibrated in its output.",
        "",
        *HEADER,
        *(row_line(r, r["distributed"]) for r in zero_rows),
        "",
        f"![estimate vs measured]({Path(args.out).with_suffix('.png').name})",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    write_shared_section(Path(args.out), shared_points(models))
    plot(rows + zero_rows, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}; largest error {worst:.2f}%")


# train.share_prefix layouts: one row of prefix + both suffixes per pair, or all pairs of a micro-batch in one row.
SHARED_LAYOUTS = {"row per pair": ("train.share_prefix=true",),
                  "packed, budget 256": ("train.share_prefix=true", "train.packing=true",
                                         "train.max_tokens_per_micro_batch=256")}
SHARED_BEGIN, SHARED_END = "<!-- share_prefix:begin -->", "<!-- share_prefix:end -->"


def shared_points(models) -> list:
    """The prefix-sharing grid: tiny and small models, full and LoRA, checkpointing off and on, both layouts.

    Row per pair is sized for a pair with no common prefix (2 x max_length), which these pairs never are:
    the points show how far that worst case is from HH-style data. A token budget bounds the row whatever
    the data, and the synthetic pairs fill most of it.
    """
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in models if not m.startswith("medium")]:
            for profile in ["full", "lora"]:
                for checkpointing in [False, True]:
                    for layout, extra in SHARED_LAYOUTS.items():
                        rows.append({**point(model, profile, checkpointing, 128, Path(tmp), extra=extra), "layout": layout})
                        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_shared_section(path: Path, rows: list) -> None:
    """Put the prefix-sharing table between its markers in the doc (appended the first time)."""
    worst = max(abs(r["error_pct"]) for r in rows)
    block = "\n".join([
        SHARED_BEGIN,
        "## Prefix sharing (`train.share_prefix=true`)",
        "",
        f"Regenerate: `python benchmarks/memory_calibration.py --share-prefix` ({len(rows)} points). The estimate sizes each",
        "pair at chosen + rejected tokens (no common prefix, the worst case) and counts the 4D mask; the synthetic",
        "pairs share their prompt and rarely fill a row, so it over-estimates by what sharing saves: an upper bound,",
        "never below the measurement. For a full row it is exact to the byte",
        "(`tests/test_prefix_sharing.py::test_activation_estimate_matches_a_real_shared_step`).",
        f"Largest error: **{worst:.2f}%**.",
        "",
        *[h.replace("| model | profile |", "| model | layout | profile |").replace("| --- | --- |", "| --- | --- | --- |", 1)
          for h in HEADER],
        *(row_line(r).replace(f"| {r['model']} |", f"| {r['model']} | {r['layout']} |", 1) for r in rows),
        SHARED_END,
    ])
    body = path.read_text() if path.exists() else ""
    if SHARED_BEGIN in body:
        body = body[: body.index(SHARED_BEGIN)] + block + body[body.index(SHARED_END) + len(SHARED_END):]
    else:
        body = body.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(body)
    print(f"wrote the share_prefix section of {path}; largest error {worst:.2f}%")


def row_line(r: dict, profile_note: str = "") -> str:
    profile = f"`{r['profile']}`" + (f" + `distributed={profile_note}`" if profile_note else "")
    return (f"| {r['model']} | {profile} | {'on' if r['checkpointing'] else 'off'} | {r['max_length']} | "
            f"{r['estimate_mib']:.2f} | {r['measured_mib']:.2f} | {r['error_pct']:+.2f}% | {r['phase']} |")


def plot(rows: list, path: Path) -> None:
    """Estimate error against measured peak, one marker per profile: where the misses are."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(r["profile"], r["distributed"]) for r in rows}):
        pts = [r for r in rows if (r["profile"], r["distributed"]) == key]
        label = key[0] if key[1] == "auto" else f"{key[0]} + {key[1]}"
        ax.scatter([r["measured_mib"] for r in pts], [r["error_pct"] for r in pts], label=label, s=18)
    ax.axhspan(-5, 5, color="green", alpha=0.08, label="within 5%")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("measured peak of live tensor bytes (MiB)")
    ax.set_ylabel("estimate error (%)")
    ax.set_title("Pre-flight estimate vs measurement, CPU")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
