"""Compare the pre-flight estimate with measured peaks over a grid, and write benchmarks/results/memory_calibration.md.

    python benchmarks/memory_calibration.py              # about 20 minutes on 2 CPU cores
    python benchmarks/memory_calibration.py --quick      # tiny and small models only, about 2 minutes

Each point trains 2 optimizer steps of 2 micro-batches (so gradients are being accumulated while
optimizer states exist, the steady-state peak) with ``train.logging.track_memory=true``, which counts live
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
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # rm itself, when this file runs as a script from anywhere
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


LAYOUTS = {  # 2-process layouts: name -> (memory_profile, distributed overrides)
    "DDP": ("full", ["ddp"]),
    "ZeRO-1": ("full", ["zero2", "distributed.zero_stage=1"]),
    "ZeRO-2": ("full", ["zero2"]),
    "ZeRO-3": ("full", ["zero3"]),
    "ZeRO-2 + optimizer offload": ("offload", ["zero2"]),
    "ZeRO-3 + parameter offload": ("offload", ["zero3_offload"]),
}


def free_port() -> int:
    """A port no one listens on: consecutive torchrun launches on one port can collide while it closes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def long_pairs(path: Path, pairs: int = 64) -> Path:
    """Pairs whose prompts run past every max_length of the grid, so each rank's sequences are all full
    length (truncation cuts the prompt's start): per-rank peaks then differ only by what sharding does."""
    import random

    rng = random.Random(0)
    words = "the a of to and in is you that it for on with as are this be at have or can what how do not your".split()
    with path.open("w") as f:
        for _ in range(pairs):
            prompt = " ".join(rng.choice(words) for _ in range(400))
            f.write(json.dumps({"prompt": prompt, "chosen": " ".join(rng.choice(words) for _ in range(9)),
                                "rejected": " ".join(rng.choice(words) for _ in range(6))}) + "\n")
    return path


def failure_line(text: str, rc) -> str:
    """The line that says why a run failed: the last error line, a rank's own before torchrun's ChildFailedError."""
    import re

    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w+(Error|Exception): |\] - error: |timed out after", line)]
    errors = [line for line in errors if "ChildFailedError" not in line] or errors
    return ((errors or lines or [f"exit {rc}"])[-1])[:300]


def rank_errors(proc) -> str:
    """What a failed run said, for its error line: torchrun's summary (stderr) and then each rank's own log (stdout),
    where rm writes a rank's traceback and error: torchrun's ChildFailedError names no cause."""
    return f"{proc.stderr or ''}\n{proc.stdout or ''}"


def random_init_env(cache: Path) -> dict:
    """The environment of a run whose QLoRA random init lives in ``cache`` (``$RM_CACHE``), not the user's cache:
    whether the run finds it saved is the point's choice, not what earlier runs left.

    The machine's measured CPU rates (``speed/``, what ``train.layout=auto`` prices layouts with) are the user's, linked
    in: they belong to the machine, not the point, and measured afresh in every point's empty cache they cost 7-8
    minutes a point on 2 cores (a 2-process point measured them on both ranks at once)."""
    from rm.foundations.cache import cache_root

    shared = cache_root() / "speed"
    shared.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "speed").exists():
        (cache / "speed").symlink_to(shared, target_is_directory=True)
    return {**os.environ, "RM_CACHE": str(cache)}


def prepare_random_init(overrides: list, cache: Path, saved: bool):
    """QLoRA from a shape (no ``model.pretrained``): the run builds the shape's fp32 random init before it loads it in
    4 bits unless it finds it saved (``rm.modelling.model.saved_random_init``), a first run's peak which the estimate counts
    (``rm.memory.terms.random_init_build_bytes``). ``saved``: save it into ``cache`` first, as rm does (the pad id of
    the tokenizer the run builds, the run's seed), so that the point measures every later run; else the run builds it.
    Returns "saved" or "built" (whether the run finds it), or ``None`` for a point without a random init."""
    from rm.foundations.config import compose

    cfg = compose(overrides)
    if cfg.memory_profile.quantize_base == "none" or cfg.model.pretrained:
        return None
    if not saved:
        return "built"
    from accelerate.utils import set_seed

    from rm.data.build import train_pairs
    from rm.modelling.model import random_init_saved, saved_random_init
    from rm.data.tokenizer import run_tokenizer

    from unittest import mock

    with mock.patch.dict(os.environ, {"RM_CACHE": str(cache)}):
        pad = run_tokenizer(cfg.model, train_pairs(cfg.data)).pad_token_id
        set_seed(cfg.train.seed)  # as rm.training.run_setup does before the model is built: the init's key
        saved_random_init(cfg.model, pad)
        assert random_init_saved(cfg.model, pad)
    return "saved"


def point(model: str, profile: str, checkpointing: bool, length: int, workdir: Path, distributed: str = "auto",
          nproc: int = 1, accumulation: int = 2, extra=(), data=None, repeats: int = 1) -> dict:
    """Train 2 steps with live-tensor tracking and return estimate vs measurement (the worst rank's error).

    ``repeats``: run the point that many times and take each rank's highest peak (the one that runs out of
    memory); the lowest is kept as ``measured_min_per_rank_mib`` to show the run-to-run spread."""
    runs = [_run_point(model, profile, checkpointing, length, workdir, distributed, nproc, accumulation, extra, data)
            for _ in range(repeats)]
    est, memory = runs[0]
    ranks = [max((run[1]["ranks"][i] for run in runs), key=lambda r: r["peak_allocated_bytes"]) for i in range(len(memory["ranks"]))]
    lowest = [min(run[1]["ranks"][i]["peak_allocated_bytes"] for run in runs) / 2**20 for i in range(len(ranks))]
    errors = [100 * (est - r["peak_allocated_bytes"]) / r["peak_allocated_bytes"] for r in ranks]
    worst = max(range(len(ranks)), key=lambda i: abs(errors[i]))
    return {"model": model, "profile": profile, "distributed": distributed, "checkpointing": checkpointing, "max_length": length,
            "nproc": nproc, "accumulation": accumulation, "repeats": repeats,
            "estimate_mib": est / 2**20, "measured_mib": ranks[worst]["peak_allocated_bytes"] / 2**20,
            "measured_per_rank_mib": [r["peak_allocated_bytes"] / 2**20 for r in ranks], "measured_min_per_rank_mib": lowest,
            "rss_growth_per_rank_mib": [r.get("peak_rss_growth_bytes", 0) / 2**20 for r in ranks],
            "error_pct": errors[worst], "errors_per_rank_pct": errors, "phase": memory["phase"]}


def run_overrides(model, profile, checkpointing, length, distributed, nproc, accumulation, extra=(), data=None) -> list:
    """The ``rm.train`` overrides of a grid point (no run directory)."""
    data = data or ["data.synthetic_train_size=256", "data.synthetic_test_size=8"]
    # experiment=tiny shares prefixes; the layouts of the grid are measured on plain pairs unless a point asks.
    plain = [] if any(o.startswith("train.share_prefix") for o in extra) else ["train.share_prefix=false"]
    # model.tokenizer=words: the sequence lengths of benchmarks/results/memory_calibration.md were measured with the word-level tokenizer.
    return [f"distributed={distributed}", *extra, *plain,
            "experiment=tiny", "model.tokenizer=words", *MODELS[model], f"memory_profile={profile}", f"train.gradient_checkpointing={checkpointing}",
            f"data.max_length={length}", *data,
            "train.micro_batch_size=2", f"train.global_batch_size={2 * nproc * accumulation}", "train.eval_batch_size=1",
            "train.max_steps=2", "train.logging.eval_steps=0", "train.logging.logging_steps=1", "train.logging.track_memory=true", "preflight=warn"]


def recompute(rows) -> None:
    """Estimate each saved point again with the estimator as it is now (a pure function of the config), in place:
    measurements stand, estimates and errors follow the code. Used after a change to the estimate alone."""
    from rm.foundations.config import compose
    from rm.memory.terms import estimate_run
    from rm.settings.validate import validate

    for r in rows:
        extra = LAYOUTS[r["layout"]][1][1:] if "layout" in r else PRECISION_MODES.get(r.get("precision"), ())
        r.setdefault("accumulation", 2)  # one-process rows saved before the key existed: point()'s default
        r.setdefault("measured_per_rank_mib", [r["measured_mib"]])
        cfg = compose(run_overrides(r["model"], r["profile"], r["checkpointing"], r["max_length"], r["distributed"],
                                    r["nproc"], r["accumulation"], extra))
        source = f"WORLD_SIZE={r['nproc']} from the launcher" if r["nproc"] > 1 else "given"
        est = estimate_run(cfg, validate(cfg, r["nproc"], source))
        r["estimate_mib"], r["phase"] = est.peak_bytes / 2**20, est.peak_phase
        r["errors_per_rank_pct"] = [100 * (r["estimate_mib"] - m) / m for m in r["measured_per_rank_mib"]]
        worst = max(range(len(r["errors_per_rank_pct"])), key=lambda i: abs(r["errors_per_rank_pct"][i]))
        r["error_pct"], r["measured_mib"] = r["errors_per_rank_pct"][worst], r["measured_per_rank_mib"][worst]


def _run_point(model, profile, checkpointing, length, workdir, distributed, nproc, accumulation, extra, data):
    """One training run of the point: (the estimate in bytes, {"ranks": each rank's measurement, "phase": ...})."""
    run_dir = workdir / f"{len(list(workdir.iterdir()))}"
    overrides = run_overrides(model, profile, checkpointing, length, distributed, nproc, accumulation, extra, data)
    overrides.append(f"hydra.run.dir={run_dir}")
    launch = [sys.executable, "-m", "rm.train"]
    if nproc > 1:  # every rank on this machine's CPU, over gloo, as train_rm_distributed.sh starts them
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                  "--master_port", str(free_port()), "-m", "rm.train"]
    proc = subprocess.run([*launch, *overrides], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{model} {profile} {distributed} x{nproc} failed:\n{rank_errors(proc)[-4000:]}")
    memory = json.loads((run_dir / "memory.json").read_text())
    ranks = memory.get("measured_per_rank") or [memory["measured"]]
    return memory["estimate"]["peak_bytes"], {"ranks": ranks, "phase": memory["estimate"]["peak_phase"]}


def merge_runs(old: dict, new: dict) -> dict:
    """One point measured in two sessions: each rank's highest and lowest peak over all the runs."""
    merged = dict(new, repeats=old.get("repeats", 1) + new["repeats"])
    merged["measured_per_rank_mib"] = [max(a, b) for a, b in zip(old["measured_per_rank_mib"], new["measured_per_rank_mib"])]
    merged["measured_min_per_rank_mib"] = [min(a, b) for a, b in zip(old.get("measured_min_per_rank_mib", old["measured_per_rank_mib"]),
                                                                      new["measured_min_per_rank_mib"])]
    merged["errors_per_rank_pct"] = [100 * (new["estimate_mib"] - m) / m for m in merged["measured_per_rank_mib"]]
    worst = max(range(len(merged["errors_per_rank_pct"])), key=lambda i: abs(merged["errors_per_rank_pct"][i]))
    merged["error_pct"], merged["measured_mib"] = merged["errors_per_rank_pct"][worst], merged["measured_per_rank_mib"][worst]
    return merged


def multi_process_rows(models, workdir: Path, quick: bool, repeats: int, saved=(), layouts=None, accumulations=None,
                       more_runs: bool = False) -> list:
    """2-process points: every layout, two model sizes, accumulation 1 and 2, each run ``repeats`` times.

    ``layouts`` / ``accumulations``: measure only these; the other points are kept from ``saved``.
    ``more_runs``: add the new runs to the saved ones of the same point instead of replacing them."""
    data = long_pairs(workdir / "long_pairs.jsonl")
    data_overrides = ["data=local", f"data.train_files=[{data}]", f"data.eval_files=[{data}]"]
    kept = {(r["model"], r["layout"], r["accumulation"]): r for r in saved}
    rows = []
    for model in models:
        for name, (profile, dist) in LAYOUTS.items():
            for accumulation in ([2] if quick else [1, 2]):
                if (layouts and name not in layouts) or (accumulations and accumulation not in accumulations):
                    if (model, name, accumulation) in kept:
                        rows.append(kept[(model, name, accumulation)])
                    continue
                row = point(model, profile, False, 64, workdir, dist[0], nproc=2, accumulation=accumulation,
                            extra=dist[1:], data=data_overrides, repeats=repeats)
                row["layout"] = name
                if more_runs and (model, name, accumulation) in kept:
                    row = merge_runs(kept[(model, name, accumulation)], row)
                rows.append(row)
                print(json.dumps(row), flush=True)
    # Points this run did not reach (--quick leaves out a model and accumulation 1) stay as saved.
    done = {(r["model"], r["layout"], r["accumulation"]) for r in rows}
    return rows + [r for key, r in kept.items() if key not in done]


GPU_MODELS = {  # random weights built from the shape: the GPU machine cannot download
    "0.45B (Mistral-style)": ["model.vocab_size=32000", "model.hidden_size=1536", "model.intermediate_size=4096",
                              "model.num_hidden_layers=16", "model.num_attention_heads=12", "model.num_key_value_heads=4",
                              "model.head_dim=128", "model.max_position_embeddings=4096"],
    "Mistral-7B shape": ["model=mistral_7b", "model.pretrained=null"],
    "1.1B (TinyLlama shape)": ["model.vocab_size=32000", "model.hidden_size=2048", "model.intermediate_size=5632",
                               "model.num_hidden_layers=22", "model.num_attention_heads=32", "model.num_key_value_heads=4",
                               "model.head_dim=64", "model.max_position_embeddings=2048"],
}


def gpu_grid() -> list:
    """(model, profile, checkpointing, length, micro-batch, precision, extra overrides) for `--device cuda`.

    Every profile at both checkpointing settings, each at another length, then the flagship's shapes. Point 15 is
    one the estimate refuses on an 80 GB card (7B full fine-tune in bf16-mixed: fp32 weights, gradients and AdamW
    states alone are 16 bytes a parameter): it must run out of memory there. Points 16-20 were added for the H200
    (see below); point 18 is refused there and must run out of memory."""
    grid = []
    for profile in ["full", "lora", "8bit", "offload", "qlora"]:
        grid.append(("0.45B (Mistral-style)", profile, False, 512, 2, "bf16-mixed", []))
        grid.append(("0.45B (Mistral-style)", profile, True, 1024, 4, "bf16-mixed", []))
    grid += [("0.45B (Mistral-style)", "full", False, 1024, 2, "bf16-true", []),
             ("Mistral-7B shape", "lora", True, 512, 4, "bf16-mixed", ["lora=r16"]),
             ("Mistral-7B shape", "lora", False, 512, 4, "bf16-mixed", ["lora=r16"]),
             ("Mistral-7B shape", "full", True, 384, 1, "bf16-true", []),
             ("Mistral-7B shape", "full", False, 384, 1, "bf16-true", []),
             ("Mistral-7B shape", "full", True, 384, 1, "bf16-mixed", []),
             # Added for the H200 (139.8 GiB): the flagship's QLoRA, a 7B full bf16-mixed run the estimate says
             # fits with 5 GiB to spare, one it refuses (154.6 GiB predicted: it must run out of memory), and a
             # shape none of the points above has (TinyLlama's), at micro-batches none of them uses.
             ("Mistral-7B shape", "qlora", True, 512, 4, "bf16-mixed", ["lora=r16"]),
             ("Mistral-7B shape", "full", False, 384, 1, "bf16-mixed", []),
             ("Mistral-7B shape", "full", False, 384, 4, "bf16-mixed", []),
             ("1.1B (TinyLlama shape)", "full", True, 512, 8, "bf16-mixed", []),
             ("1.1B (TinyLlama shape)", "lora", False, 512, 6, "bf16-mixed", ["lora=r8"])]
    return grid


def saved_random_weights(model: str, workdir: Path) -> Path:
    """The shape's random init saved as a pretrained directory, for memory_profile=qlora (which quantises
    weights as it loads them). Built in a child process, on the GPU when there is one (a 7B shape takes seconds
    there, minutes on the CPU): this process must hold no CUDA context, whose memory the device count of every
    point would include."""
    path = workdir / f"pretrained-{model.split()[0]}"
    if not path.is_dir():
        subprocess.run([sys.executable, __file__, "--save-random-weights", model, str(path)], cwd=ROOT, check=True)
    return path


def save_random_weights(model: str, path: Path) -> None:
    """``--save-random-weights MODEL PATH``: what :func:`saved_random_weights` runs in its child process."""
    import torch

    from rm.foundations.config import compose
    from rm.modelling.model import build_model
    from rm.data.tokenizer import build_tokenizer

    base = [] if GPU_MODELS[model][0].startswith("model=") else ["model=tiny"]
    cfg = compose(["experiment=tiny", *base, "model.tokenizer=words", *GPU_MODELS[model]])
    tokenizer = build_tokenizer(cfg.model)  # saved beside the weights: a pretrained model brings its own
    torch.manual_seed(0)
    device = torch.device("cuda") if torch.cuda.is_available() else None
    build_model(cfg.model, tokenizer.pad_token_id, "bfloat16", gradient_checkpointing=False,
                device=device).save_pretrained(path)
    tokenizer.save_pretrained(path)


def gpu_overrides(spec, workdir: Path, data: Path, dry_run: bool = False, hardware: str = "auto",
                  from_shape: bool = False) -> list:
    """The ``rm.train`` overrides of one GPU grid point (no run directory); ``from_shape``: for an estimate, a qlora
    point's model from its shape rather than from its saved random weights (the same estimate,
    ``tests/memory/test_estimate.py::test_a_qlora_estimate_reads_a_pretrained_models_config_not_its_weights``; no
    weights to build)."""
    model, profile, checkpointing, length, micro, precision, extra = spec
    shape = GPU_MODELS[model]
    base = [] if shape[0].startswith("model=") else ["model=tiny"]
    pretrained = ([f"model.pretrained={saved_random_weights(model, workdir)}"]
                  if profile == "qlora" and not dry_run and not from_shape else [])
    tokenizer = [] if pretrained else ["model.tokenizer=words"]  # the saved weights' own tokenizer otherwise
    overrides = ["experiment=tiny", *base, *shape, *pretrained, *tokenizer, *extra, "train.share_prefix=false",
                 f"memory_profile={profile}", f"hardware={hardware}",
                 f"train.precision={precision}" if not dry_run else "train.precision=32-true",
                 f"train.gradient_checkpointing={checkpointing}", f"data.max_length={length}", "data=local",
                 f"data.train_files=[{data}]", f"data.eval_files=[{data}]", f"train.micro_batch_size={micro}",
                 f"train.global_batch_size={2 * micro}", "train.eval_batch_size=1", "train.max_steps=2",
                 "train.logging.eval_steps=0", "train.logging.logging_steps=1", "train.logging.track_memory=true", "preflight=warn"]
    if dry_run:  # CPU: the tiny model at the point's settings, to exercise the path end to end
        overrides = [o for o in overrides if not any(o.startswith(k) for k in ("model", "hardware", "lora"))]
        overrides += ["hardware=cpu", "model.tokenizer=words", *([] if profile != "qlora" else ["memory_profile=lora"])]
        overrides = [o.replace(f"data.max_length={length}", "data.max_length=32") for o in overrides]
    return overrides


def data_sized_estimate(overrides: list, world_size: int = 1, random_init_cached: bool = False):
    """The estimate ``rm.train`` decides by for these overrides (sized by the data's micro-batches, every rank's peak
    in ``rank_peak_bytes``), computed the way its setup computes it, on ``world_size`` processes as torchrun would
    start them, without a device or a launch: what ``--recompute`` compares with a saved measurement."""
    from unittest import mock

    from rm.foundations.config import compose
    from rm.data.batching import StepBatches
    from rm.data.build import build_datasets, train_pairs
    from rm.data.tokenizer import run_tokenizer
    from rm.memory.preflight import data_preflight, plan_run
    from rm.training.run_setup import log_prefix_sharing, run_shapes, total_training_steps

    cfg = compose(overrides)
    launched = {"WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"} if world_size > 1 else {}
    # A CUDA profile on a machine without CUDA: this estimates the run (as rm.estimate may), it trains nothing.
    with mock.patch.dict(os.environ, launched), mock.patch("rm.memory.preflight.check_device_present"):
        plan, _ = plan_run(cfg, overrides)
    tokenizer = run_tokenizer(cfg.model, train_pairs(cfg.data))
    train_set, eval_set, _ = build_datasets(cfg.data, tokenizer)
    t = cfg.train
    shared = log_prefix_sharing(train_set) if t.share_prefix else None
    batches = StepBatches.of(train_set, global_batch_size=t.global_batch_size, micro_batch_size=plan.micro_batch_size,
                             world_size=plan.world_size, rank=0, seed=t.seed, group_by_length=t.group_by_length,
                             max_tokens=t.max_tokens_per_micro_batch, shared_tokens=shared)
    steps = total_training_steps(t, len(train_set))
    return data_preflight(cfg, plan, overrides, run_shapes(t, batches, steps, train_set, shared, [eval_set]),
                          random_init_cached=random_init_cached)


def random_recompute(path: Path, out=None) -> None:
    """``--random-recompute FILE [--out DOC]``: every measured point of a random calibration against the estimator as
    it is now (each point's pairs are written again from its seed; no training runs). Prints each point and the
    misses; with ``--out``, a markdown table of them (measurements as run, errors then and now)."""
    saved = json.loads(path.read_text())
    rows, meta = saved["rows"], saved["meta"]
    misses, stale, lines = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if "measured_per_rank_mib" not in row:
                continue
            p, stem = row["point"], Path(tmp) / f"p{row['index']}"
            write_random_pairs(stem, p["data"], p["max_length"])
            est = data_sized_estimate(random_overrides(p, str(stem)), RANDOM_LAYOUTS[p["layout"]][0],
                                      random_init_cached=row.get("random_init") == "saved")
            per_rank = [b / 2**20 for b in (est.rank_peak_bytes or [est.peak_bytes])]
            errors = [100 * (e - m) / m for e, m in zip(per_rank, row["measured_per_rank_mib"])]
            before = row["errors_per_rank_pct"]
            now, then = (" / ".join(f"{e:+.2f}%" for e in errs) for errs in (errors, before))
            changed = data_changed(row.get("shapes"), est.shapes)
            if changed:  # the measurement was of other micro-batches: no verdict on the estimator either way
                stale.append(row["index"])
                print(f"{row['index']:3d} {row['short']}: {now}  (was {then})  DATA CHANGED: {changed}", flush=True)
                lines.append(f"| {row['index']} | {row['short']} | {' / '.join(f'{m:.2f}' for m in row['measured_per_rank_mib'])} "
                             f"| {' / '.join(f'{e:.2f}' for e in per_rank)} | not comparable: {changed} | {then} |")
                continue
            miss = is_miss({"errors_per_rank_pct": errors})
            misses += [row["index"]] if miss else []
            print(f"{row['index']:3d} {row['short']}: {now}  (was {then})" + ("  MISS" if miss else ""), flush=True)
            lines.append(f"| {row['index']} | {row['short']} | {' / '.join(f'{m:.2f}' for m in row['measured_per_rank_mib'])} "
                         f"| {' / '.join(f'{e:.2f}' for e in per_rank)} | {now}{' **MISS**' if miss else ''} | {then} |")
    print(f"{len(misses)} MISS: {misses}")
    if stale:
        print(f"{len(stale)} not comparable (their pairs tokenise to other micro-batches now; train them again with "
              f"--random-rerun {path.name} --only ...): {stale}")
    if out:
        head = [f"# Random calibration (seed {meta['seed']}) re-estimated", "",
                f"`python benchmarks/memory_calibration.py --random-recompute {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
                f" --out {out}`: the {len(lines)} points measured by `{meta['command']}` ({meta['date']}), each "
                "against the estimator as it is now (the estimate is a pure function of the config and the point's "
                "pairs, which are written again from their seed; nothing trains). A miss is an error above "
                f"+{RANDOM_MISS_OVER:g}% or below {RANDOM_MISS_UNDER:g}% on any rank.", "",
                f"**{len(misses)} MISS of {len(lines)}**" + (f": points {', '.join(map(str, misses))}." if misses else "."), "",
                "| # | point | measured per rank (MiB) | estimate per rank (MiB) | error now | error as run |",
                "| ---: | --- | ---: | ---: | ---: | ---: |"]
        Path(out).write_text("\n".join(head + lines) + "\n")
        print(f"wrote {out}")


def random_rerun(path: Path, only, timeout: int) -> None:
    """``--random-rerun FILE [--only I ...]``: train the saved points of a random calibration again with rm as it is now
    (the points as the record holds them: a seed's draw changes when the draw gains an option, so ``--random N --seed
    S --only I`` may be another point today). Prints each point's errors now beside those as run."""
    rows = [r for r in json.loads(path.read_text())["rows"] if "measured_per_rank_mib" in r]
    rows = [r for r in rows if only is None or r["index"] in only]
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            now = run_random_point(row["index"], row["point"], Path(tmp), timeout)
            if now.get("failed"):
                print(f"{row['index']:3d} {row['short']}: failed: {now['failed']}", flush=True)
                continue
            fmt = lambda values, unit: " / ".join(f"{v:.2f}{unit}" for v in values)  # noqa: E731
            print(f"{row['index']:3d} {row['short']}: measured {fmt(now['measured_per_rank_mib'], '')} MiB, estimate "
                  f"{fmt(now['estimate_per_rank_mib'], '')}: {fmt(now['errors_per_rank_pct'], '%')}"
                  f"{'  MISS' if is_miss(now) else ''}  (as run: {fmt(row['measured_per_rank_mib'], '')} MiB, "
                  f"{fmt(row['errors_per_rank_pct'], '%')}; {now['wall_s']:.0f} s, load {now['load_after']})", flush=True)


def data_changed(measured: Optional[dict], now: Optional[dict]) -> str:
    """How the micro-batches that size a point's estimate (the step's longest, ``train``, and the evaluation's,
    ``eval``) differ between its measurement and what its pairs give now ("" where they agree, or where the record
    kept none). Written again from their seed, the pairs are the same text, but the tokens are what rm makes of it
    today: a change of tokenisation (EOS appended, BOS kept) or batching moves the lengths, and the old peak is then a
    measurement of other micro-batches. The first step's shapes are left out: they may be another rank's.

        >>> data_changed({"train": {"rows": 1, "length": 1024}}, {"train": {"rows": 1, "length": 1022}, "segment": 511})
        'train length 1024 -> 1022'
        >>> data_changed({"train": {"rows": 1, "length": 1024}, "first_micro_batch": {"length": 96}},
        ...              {"train": {"rows": 1, "length": 1024}, "first_micro_batch": {"length": 48}})
        ''
    """
    if not measured or not now:
        return ""
    diffs = []
    for key in ("train", "eval"):
        then_shape, now_shape = measured.get(key) or {}, now.get(key) or {}
        diffs += [f"{key} {k} {then_shape[k]} -> {now_shape[k]}" for k in sorted(then_shape.keys() & now_shape.keys())
                  if then_shape[k] != now_shape[k]]
    return ", ".join(diffs)


def gpu_point(spec, workdir: Path, data: Path, dry_run: bool, timeout: int = 300) -> dict:
    """One real training run of 2 steps on the GPU; estimate terms against the allocator and the device."""
    model, profile, checkpointing, length, micro, precision, extra = spec
    run_dir = workdir / f"gpu{len(list(workdir.glob('gpu*')))}"
    overrides = [*gpu_overrides(spec, workdir, data, dry_run), f"hydra.run.dir={run_dir}"]
    row = {"model": model, "profile": profile, "checkpointing": checkpointing, "max_length": length, "micro": micro,
           "precision": precision, "extra": list(extra)}
    start, memory_file, memory = time.perf_counter(), run_dir / "memory.json", None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rm.train", *overrides], cwd=ROOT, stdout=out, stderr=err, text=True)
        # memory.json is written when training ends, before the model is exported: the export (14 GB for a 7B full
        # fine-tune, then reloaded to verify it) measures nothing here, so the run is stopped once the file is whole.
        while proc.poll() is None and time.perf_counter() - start < timeout and memory is None:
            time.sleep(0.2)
            try:
                memory = json.loads(memory_file.read_text())
            except (OSError, ValueError):
                memory = None
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if memory is None and memory_file.is_file():
            memory = json.loads(memory_file.read_text())
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    row["wall_s"] = round(time.perf_counter() - start, 1)
    if memory is None:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        out_of_memory = any("OutOfMemoryError" in line or "out of memory" in line for line in lines)
        estimate = next((line for line in (stdout + stderr).splitlines() if "does not fit" in line), "")
        error = f"timed out after {timeout} s" if row["wall_s"] >= timeout else (lines[-1] if lines else f"exit {proc.returncode}")
        log = run_dir / "train.log"  # rm reports an error through its log: Hydra's job logging and the run's file
        tail = (log.read_text() if log.is_file() else stdout).strip().splitlines()
        error = next((line for line in reversed(tail) if "Error" in line or "error:" in line), error)
        return {**row, "error": error[:300], "out_of_memory": out_of_memory or any("out of memory" in t for t in tail),
                "estimate_line": estimate[:300], "stderr_tail": "\n".join(lines[-8:])[-2000:],
                "log_tail": "\n".join(tail[-25:])[-4000:]}
    est, meas = memory["estimate"], memory["measured"]
    row.update({"est_allocated": est["allocated_bytes"], "est_reserve": est["allocator_reserve"], "est_context": est["cuda_context"],
                "est_device": est["peak_bytes"], "fits": est["fits"], "phase": est["peak_phase"],
                "estimate_terms": {k: est[k] for k in ("weights", "gradients", "optimizer_states", "activations", "evaluation",
                                                       "temporaries", "overhead")},
                "allocated": meas.get("peak_allocated_bytes"), "reserved": meas.get("peak_reserved_bytes"),
                "device_used_start": meas.get("device_used_start_bytes"), "device_used": meas.get("device_used_bytes")})
    return row


def gpu_main(out: Path, dry_run: bool, only=None, timeout: int = 300) -> None:
    """`--device cuda`: the GPU grid, written to benchmarks/results/memory_calibration_gpu.md (and .json beside it)."""
    import torch

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; on a CPU use --dry-run to check the grid")
    start, rows = time.perf_counter(), []
    grid = gpu_grid()[:3] if dry_run else [g for i, g in enumerate(gpu_grid()) if only is None or i in only]
    with tempfile.TemporaryDirectory() as tmp:
        data = long_pairs(Path(tmp) / "long_pairs.jsonl", pairs=16)
        for spec in grid:
            rows.append(gpu_point(spec, Path(tmp), data, dry_run, timeout))
            print(json.dumps(rows[-1]), flush=True)
            out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    device = "CPU (dry run: tiny model, fp32, 3 points)" if dry_run else (
        f"{torch.cuda.get_device_name(0)}, driver {torch_driver()}, torch {torch.__version__}, "
        f"capacity {torch.cuda.mem_get_info(0)[1] / 2**30:.2f} GiB")
    write_gpu_doc(out, [(rows, device, time.perf_counter() - start, None)])


# The saved GPU measurements, each with its card's constants and the named profile that stands in for the
# ``hardware=auto`` the runs resolved (the same capacity to 0.01 GiB).
GPU_MEASURED = [
    (ROOT / "benchmarks" / "results" / "gpu" / "memory_calibration_gpu_measured.json", ROOT / "benchmarks" / "results" / "gpu" / "gpu_constants.json", "h100_80g"),
    (ROOT / "benchmarks" / "results" / "gpu" / "memory_calibration_gpu_measured_h200.json", ROOT / "benchmarks" / "results" / "gpu" / "gpu_constants_h200.json",
     "h200_141g"),
]


def gpu_recompute(measured: list, out: Path) -> None:
    """``--device cuda --recompute``: each saved GPU measurement against the estimator as it is now, on this machine
    (no GPU needed: the estimate is a pure function of the config and the data)."""
    sections = []
    with tempfile.TemporaryDirectory() as tmp:
        data = long_pairs(Path(tmp) / "long_pairs.jsonl", pairs=16)
        for rows_file, constants_file, hardware in measured:
            rows = json.loads(rows_file.read_text())
            meta = json.loads(constants_file.read_text())
            for r in rows:
                if "error" in r:
                    continue
                spec = (r["model"], r["profile"], r["checkpointing"], r["max_length"], r["micro"], r["precision"], r["extra"])
                est = data_sized_estimate(gpu_overrides(spec, Path(tmp), data, hardware=hardware, from_shape=True))
                r.update({"est_allocated": est.allocated_bytes, "est_reserve": est.allocator_reserve, "est_context": est.cuda_context,
                          "est_communication": est.communication, "est_outside_allocator": est.outside_allocator,
                          "est_device": est.peak_bytes, "phase": est.peak_phase, "fits": est.fits})
                print(f"{meta['gpu']}: {r['model']} {r['profile']} ckpt={r['checkpointing']} {r['max_length']}x{r['micro']} "
                      f"{r['precision']}: allocated {100 * (est.allocated_bytes - r['allocated']) / r['allocated']:+.1f}%, "
                      f"device {100 * (est.peak_bytes - r['device_used']) / r['device_used']:+.1f}%", flush=True)
            device = f"{meta['gpu']}, driver {meta['driver']}, torch {meta['torch']} (CUDA {meta['cuda']}), {meta['date']}"
            sections.append((rows, device, None, rows_file))
    write_gpu_doc(out, sections)


def write_gpu_doc(out: Path, sections: list) -> None:
    """The GPU tables, one a machine (``(rows, device, seconds or None, saved measurements or None)`` each): each
    point's estimate against the allocator's peak and the device's own count, misses marked."""
    lines = ["# Memory estimate vs measurement (GPU)", "",
             "Measured: `python benchmarks/memory_calibration.py --device cuda` on the machine each table names. "
             "Estimates as the code stands now: `python benchmarks/memory_calibration.py --device cuda --recompute` "
             "(any machine: it re-estimates the saved measurements in `benchmarks/results/gpu/memory_calibration_gpu_measured*.json`).", "",
             "Each point trains 2 optimizer steps of 2 micro-batches from random weights built from the shape (qlora: saved, "
             "then quantised as it loads); the prompts are 400 words, so every sequence holds 408 tokens of the word-level "
             "tokenizer whatever `max_length` allows, and the estimate is sized by that data, as `rm.train` sizes it. "
             "`allocated` is `torch.cuda.max_memory_allocated`, `reserved` `max_memory_reserved`, `device` the device's "
             "own count (`mem_get_info` total - free) after the loop: the allocator's peak reserve, the CUDA context and "
             "anything held outside the allocator. Targets: allocated within 5%; predicted device total never below the "
             "device's count and at most 10% above; misses are marked **MISS**.", "",
             "`as run`: the errors of the estimate each run itself made, before the fixes these runs led to. The H100's "
             "(2026-11-26) led to the trace of dropout as CUDA runs it, paged 8-bit states outside the allocator, the "
             "NCCL group and the allocator-reserve bound without checkpointing; the H200's (2026-11-27), none of them a "
             "point the estimator had been fitted to, to the reserve bound with gradient checkpointing (45% of the "
             "transient bytes with full gradients, 20% under LoRA, `rm/memory/terms.py`). Those bounds were read off "
             "these same points: the `err` columns of the points that set them are not a test on unseen shapes."]
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    for rows, device, elapsed, saved in sections:
        measured = "" if elapsed is None else f"{len(rows)} points, {elapsed:.0f} s; "
        lines += ["", f"## {device.split(',')[0]}", "", f"{measured}{device}"
                  + (f"; measurements in `{saved.relative_to(ROOT)}`" if saved else "") + ".", "",
                  "| model | profile | precision | ckpt | max_length x micro | est. allocated (GiB) | allocated | err | as run "
                  "| est. device | device | err | as run | reserved | peak phase |",
                  "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rows:
            head = (f"| {r['model']} | `{r['profile']}` | {r.get('precision', 'bf16-mixed')} | {'on' if r['checkpointing'] else 'off'} "
                    f"| {r['max_length']} x {r['micro']} |")
            if "error" in r:
                verdict = (" (the estimate refused it and the device ran out of memory: the verdict holds)"
                           if r.get("out_of_memory") and "does not fit" in r.get("estimate_line", "") else "")
                lines.append(f"{head} {r.get('cause') or 'not measured' + verdict + ': ' + r['error'][:160]} |" + " |" * 9)
                continue
            used = r["device_used"] if r["device_used"] is not None else r["allocated"]
            err_a, err_d = (100 * (r["est_allocated"] - r["allocated"]) / r["allocated"], 100 * (r["est_device"] - used) / used)
            as_run = r.get("as_run", r)
            run_a = 100 * (as_run["est_allocated"] - r["allocated"]) / r["allocated"]
            run_d = 100 * (as_run["est_device"] - used) / used
            miss_a = lambda e: " **MISS**" if abs(e) > 5 else ""  # noqa: E731
            miss_d = lambda e: " **MISS**" if e < 0 or e > 10 else ""  # noqa: E731
            lines.append(f"{head} {gib(r['est_allocated'])} | {gib(r['allocated'])} | {err_a:+.1f}%{miss_a(err_a)} | "
                         f"{run_a:+.1f}%{miss_a(run_a)} | {gib(r['est_device'])} | {gib(used)} | {err_d:+.1f}%{miss_d(err_d)} | "
                         f"{run_d:+.1f}%{miss_d(run_d)} | {gib(r['reserved'] or 0)} | {r['phase']} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


def torch_driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


RESULTS = ROOT / "benchmarks" / "results" / "memory_calibration.json"  # every row, so that one part can be rerun alone


PRECISION_MODES = {"bf16-mixed": ["train.precision=bf16-mixed", "hardware.bf16=true"],
                   "bf16-true": ["train.precision=bf16-true", "hardware.bf16=true"]}


def precision_rows(tmp: Path, saved=()) -> list:
    """The bf16 modes on the small model: every profile, checkpointing off and on, one process (CPU autocast
    computes bf16 as a GPU does; what it keeps is what the estimate must count). Points in ``saved`` are kept
    (a run stopped part-way goes on where it stopped)."""
    kept = {(r["precision"], r["profile"], r["checkpointing"]): r for r in saved}
    rows = []
    for mode, extra in PRECISION_MODES.items():
        for profile in PROFILES:
            if profile == "offload" and mode == "bf16-true":
                continue  # DeepSpeed has no bf16-true: refused by rm.settings.validate
            for checkpointing in [False, True]:
                row = kept.get((mode, profile, checkpointing))
                if row is None:
                    row = {**point("small (13M)", profile, checkpointing, 128, tmp, extra=extra), "precision": mode}
                    print(json.dumps(row), flush=True)
                rows.append(row)
                RESULTS.write_text(json.dumps({**json.loads(RESULTS.read_text()), "precision": rows}, indent=1) + "\n")
    return rows


# memory_profile=qlora (4-bit NF4 base, LoRA, prepare_model_for_kbit_training's fp32 casts) on the small model:
# (precision, checkpointing, processes, random init). One process at max_length 128 as the bf16 rows, two (DDP) at
# 64 on the long pairs as the 2-process rows. "saved": the shape's random init is saved before the run (every run
# after a shape's first); "built": the run builds it first (its first run), on local rank 0.
QLORA_GRID = [("32-true", False, 1, "saved"), ("32-true", True, 1, "saved"), ("bf16-mixed", False, 1, "saved"),
              ("bf16-mixed", True, 1, "saved"), ("32-true", False, 2, "saved"), ("32-true", True, 2, "built")]
QLORA_MODEL = "small (13M)"


def qlora_overrides(precision: str, checkpointing: bool, nproc: int, data: Path) -> list:
    """A QLORA_GRID point's ``rm.train`` overrides (no run directory)."""
    extra = PRECISION_MODES.get(precision, ["train.precision=32-true"])
    if nproc == 1:
        return run_overrides(QLORA_MODEL, "qlora", checkpointing, 128, "auto", 1, 2, extra)
    return run_overrides(QLORA_MODEL, "qlora", checkpointing, 64, "ddp", nproc, 2, extra,
                         ["data=local", f"data.train_files=[{data}]", f"data.eval_files=[{data}]"])


def qlora_rows(tmp: Path, saved=()) -> list:
    """Run QLORA_GRID; each rank's peak against that rank's own estimate (``rank_peak_bytes``). Points in ``saved``
    are kept (a run stopped part-way goes on where it stopped)."""
    data = long_pairs(tmp / "long_pairs.jsonl")
    kept = {(r["precision"], r["checkpointing"], r["nproc"], r["random_init"]): r for r in saved}
    rows = []
    for precision, checkpointing, nproc, random_init in QLORA_GRID:
        row = kept.get((precision, checkpointing, nproc, random_init))
        if row is None:
            run_dir = tmp / f"qlora{len(rows)}"
            overrides = qlora_overrides(precision, checkpointing, nproc, data)
            cache = tmp / ("rm_cache" if random_init == "saved" else f"rm_cache_{run_dir.name}")
            assert prepare_random_init(overrides, cache, saved=random_init == "saved") == random_init
            launch = [sys.executable, "-m", "rm.train"] if nproc == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port()), "-m", "rm.train"]
            start = time.perf_counter()
            proc = subprocess.run([*launch, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                                  text=True, env=random_init_env(cache))
            if proc.returncode != 0:
                raise SystemExit(f"qlora {precision} x{nproc} failed:\n{rank_errors(proc)[-4000:]}")
            result = point_result(json.loads((run_dir / "memory.json").read_text()))
            row = {"model": QLORA_MODEL, "profile": "qlora", "precision": precision, "checkpointing": checkpointing,
                   "nproc": nproc, "random_init": random_init, "max_length": 128 if nproc == 1 else 64,
                   "distributed": "auto" if nproc == 1 else "ddp", "wall_s": round(time.perf_counter() - start, 1),
                   "load_after": round(os.getloadavg()[0], 2), **result}
            worst_rank(row)
            print(json.dumps(row), flush=True)
        rows.append(row)
        RESULTS.write_text(json.dumps({**json.loads(RESULTS.read_text()), "qlora": rows}, indent=1) + "\n")
    return rows


def recompute_qlora(rows) -> None:
    """The QLoRA rows against the estimator as it is now, each rank against its own estimate, sized by the data as
    ``rm.train`` sizes it (the same synthetic or long pairs, written again), in place."""
    with tempfile.TemporaryDirectory() as tmp:
        data = long_pairs(Path(tmp) / "long_pairs.jsonl")
        for r in rows:
            est = data_sized_estimate(qlora_overrides(r["precision"], r["checkpointing"], r["nproc"], data), r["nproc"],
                                      random_init_cached=r["random_init"] == "saved")
            per_rank = est.rank_peak_bytes or [est.peak_bytes]
            r["estimate_mib"], r["phase"] = est.peak_bytes / 2**20, est.peak_phase
            r["estimate_per_rank_mib"] = [b / 2**20 for b in per_rank]
            r["errors_per_rank_pct"] = [100 * (e - m) / m for e, m in zip(r["estimate_per_rank_mib"], r["measured_per_rank_mib"])]
            worst_rank(r)


def worst_rank(r: dict) -> None:
    """``error_pct`` and ``measured_mib`` of the rank whose error is largest (the plot's marker), in place."""
    worst = max(range(len(r["errors_per_rank_pct"])), key=lambda i: abs(r["errors_per_rank_pct"][i]))
    r["error_pct"], r["measured_mib"] = r["errors_per_rank_pct"][worst], r["measured_per_rank_mib"][worst]


def qlora_section(rows) -> list:
    """The doc's QLoRA table."""
    errors = [e for r in rows for e in r["errors_per_rank_pct"]]
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        "", "## QLoRA (`memory_profile=qlora`), CPU", "",
        f"The small model with a 4-bit NF4 base (bitsandbytes' CPU backend), `--part qlora` ({len(rows)} points; `--recompute`",
        "re-estimates them as `rm.train` does, sized by the data). One process at `max_length=128` as the bf16 rows,",
        "two (DDP) at 64 on the long pairs as the 2-process rows. The model is built from its shape: rm saves the",
        "shape's fp32 random init once and loads it in 4 bits. `saved`: the init was saved before the run (every run",
        "after a shape's first); `built`: the run builds it first, on local rank 0, which the estimate counts on that",
        "rank (`random-init build`). Each rank against its own estimate; target within +5% / -2% on every rank.",
        f"Largest over **{max(errors):+.2f}%**, largest under **{min(errors):+.2f}%**.", "",
        "| model | precision | grad. checkpointing | processes | random init | max_length | estimate per rank (MiB) "
        "| measured per rank (MiB) | error per rank | peak phase |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        errs = " / ".join(f"{e:+.2f}%" for e in r["errors_per_rank_pct"])
        miss = " **MISS**" if max(r["errors_per_rank_pct"]) > 5 or min(r["errors_per_rank_pct"]) < -2 else ""
        lines.append(f"| {r['model']} | `{r['precision']}` | {'on' if r['checkpointing'] else 'off'} | {r['nproc']} | "
                     f"{r['random_init']} | {r['max_length']} | {fmt(r['estimate_per_rank_mib'])} | "
                     f"{fmt(r['measured_per_rank_mib'])} | {errs}{miss} | {r['phase']} |")
    return lines


def run_parts(args, models, tmp: Path, rows, zero_rows, multi_rows):
    """Measure the parts ``--part`` asks for; the others stay as saved."""
    if args.part in ("all", "single", "zero"):
        rows = rows if args.part == "zero" else []
        zero_rows = []
        for model in models:
            lengths = [64, 128] if model.startswith("medium") else [32, 128]
            for profile in PROFILES if args.part != "zero" else []:
                for checkpointing in [False, True]:
                    for length in lengths:
                        rows.append(point(model, profile, checkpointing, length, tmp))
                        print(json.dumps(rows[-1]), flush=True)
            for distributed in ["zero2", "zero3"]:
                zero_rows.append(point(model, "full", False, 64, tmp, distributed))
                print(json.dumps(zero_rows[-1]), flush=True)
    if args.part in ("all", "multi"):
        multi_rows = multi_process_rows([m for m in models if not m.startswith("tiny")], tmp, args.quick, args.repeats,
                                        multi_rows, args.layouts, args.accumulation, args.more_runs)
    return rows, zero_rows, multi_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny and small models only")
    parser.add_argument("--part", choices=["all", "single", "zero", "multi", "precision", "qlora"], default="all",
                        help="single: one-process grid (with the ZeRO rows); zero: the one-process ZeRO rows; multi: the "
                             "2-process layouts; precision: the bf16-mixed and bf16-true points; qlora: the QLoRA points; the other parts are kept "
                             "from benchmarks/results/memory_calibration.json")
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), help="with --part multi: measure only these layouts")
    parser.add_argument("--accumulation", nargs="*", type=int, help="with --part multi: measure only these accumulations")
    parser.add_argument("--more-runs", action="store_true",
                        help="with --part multi: add the runs to the saved ones of the same points (highest peak over all)")
    parser.add_argument("--recompute", action="store_true",
                        help="run nothing: estimate the saved points again with the current estimator and rewrite the doc")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per 2-process point; each rank's highest peak is compared (default 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="with --device cuda: three tiny points on the CPU")
    parser.add_argument("--only", nargs="*", type=int, help="with --device cuda: only these points of the grid; with --random: only these points of the draw (0-based); with --random-rerun: these saved points")
    parser.add_argument("--random-recompute", metavar="FILE",
                        help="re-estimate the measured points of a random calibration's JSON (no training)")
    parser.add_argument("--random-rerun", metavar="FILE",
                        help="train the measured points of a random calibration's JSON again (with --only: those points)")
    parser.add_argument("--save-random-weights", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--share-prefix", action="store_true",
                        help="run only the train.share_prefix points and rewrite their section of the doc")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="N random run configurations (benchmarks/results/memory_calibration_random.md); see --seed")
    parser.add_argument("--seed", type=int, default=1, help="with --random: the seed of random.Random")
    parser.add_argument("--memtracker", type=int, default=0, metavar="K",
                        help="with --random: run the first K points (and one multi-process point) again under PyTorch's MemTracker")
    parser.add_argument("--profiles", nargs="*", choices=PROFILE_COLOURS, default=None,
                        help="with --random: draw memory profiles from these (default: full lora 8bit offload; the "
                             "default draw is what earlier seeds used, so they stay reproducible)")
    parser.add_argument("--point-timeout", type=int, default=900, help="with --random: seconds before a point counts as failed")
    parser.add_argument("--random-init", choices=["saved", "built"], default="saved",
                        help="with --random, QLoRA points: the shape's random init is saved before the run (every later "
                             "run of the shape: default), or the run builds it (its first run, whose peak may be the build)")
    args = parser.parse_args()
    if args.save_random_weights:
        return save_random_weights(args.save_random_weights[0], Path(args.save_random_weights[1]))
    if args.random_recompute:
        return random_recompute(Path(args.random_recompute).resolve(), args.out)
    if args.random_rerun:
        return random_rerun(Path(args.random_rerun), args.only, args.point_timeout)
    if args.random:
        random_main(args)
        return
    if args.device == "cuda":
        out = Path(args.out or ROOT / "benchmarks" / "results" / "memory_calibration_gpu.md")
        if args.recompute:  # the saved GPU measurements against the estimator as it is now; no GPU needed
            return gpu_recompute(GPU_MEASURED, out)
        gpu_main(out, args.dry_run, args.only, args.point_timeout)
        return
    out = Path(args.out or ROOT / "benchmarks" / "results" / "memory_calibration.md")
    models = [m for m in MODELS if not (args.quick and m.startswith("medium"))]
    if args.share_prefix:
        return write_shared_section(out, shared_points(models))
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    rows, zero_rows, multi_rows = saved.get("single", []), saved.get("zero", []), saved.get("multi", [])
    bf16_rows, q_rows = saved.get("precision", []), saved.get("qlora", [])
    start = time.perf_counter()
    if args.recompute:
        recompute(rows + zero_rows + multi_rows + bf16_rows)
        recompute_qlora(q_rows)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            rows, zero_rows, multi_rows = run_parts(args, models, Path(tmp), rows, zero_rows, multi_rows)
            if args.part in ("all", "precision"):
                bf16_rows = precision_rows(Path(tmp), bf16_rows)
            if args.part in ("all", "qlora"):
                q_rows = qlora_rows(Path(tmp), [] if args.part == "all" else q_rows)
    elapsed = time.perf_counter() - start
    # Beside the doc written: with --out, the committed record (RESULTS, the rows a part is merged into) stays as it is.
    out.with_suffix(".json").write_text(json.dumps({"single": rows, "zero": zero_rows, "multi": multi_rows, "precision": bf16_rows,
                                   "qlora": q_rows}, indent=1) + "\n")
    write_doc(out, rows, zero_rows, multi_rows, args, elapsed, bf16_rows, q_rows)
    if args.part == "all" and not args.recompute:  # its rows are not kept: recomputing them would mean training them
        write_shared_section(out, shared_points(models))
    plot(rows + zero_rows + multi_rows + q_rows, out.with_suffix(".png"))
    print(f"wrote {out}")


def write_doc(out: Path, rows, zero_rows, multi_rows, args, elapsed: float, bf16_rows=(), q_rows=()) -> None:
    worst = max((abs(r["error_pct"]) for r in rows), default=0.0)
    load = os.getloadavg()
    lines = [
        "# Memory estimate vs measurement (CPU)",
        "",
        f"Regenerate: `python benchmarks/memory_calibration.py` (all parts; `--part single` or `--part multi` reruns one "
        f"and keeps the other from `benchmarks/results/memory_calibration.json`). This run: `{'--recompute' if args.recompute else '--part ' + args.part}`, {elapsed:.0f} s on "
        f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} at the end.",
        "",
        *(PROVENANCE if args.recompute else []),
        "Each point: 2 optimizer steps of 2 micro-batches of 2 pairs (4 sequences) padded to `max_length`, fp32,",
        "measured as the exact peak of live tensor bytes (`train.logging.track_memory=true`). Largest error: "
        f"**{worst:.2f}%**. On a GPU (allocator reserve, CUDA context, what lives outside the allocator): "
        "[memory_calibration_gpu.md](memory_calibration_gpu.md), `python benchmarks/memory_calibration.py --device cuda`.",
        "",
        *HEADER,
        *(row_line(r) for r in rows),
        "",
        "## DeepSpeed ZeRO stages, `full` profile, one process",
        "",
        "Checkpointing off, `max_length=64`. With one process ZeRO-3 shards and gathers nothing, so these rows check",
        "DeepSpeed's own buffers.",
        "",
        *HEADER,
        *(row_line(r, r["distributed"]) for r in zero_rows),
    ]
    if bf16_rows:
        lines += [
            "",
            "## bf16, one process (CPU autocast)",
            "",
            "The small model at `max_length=128` in the two bf16 modes (`rm/foundations/precision.py`): `bf16-mixed` keeps fp32 weights,",
            "gradients and AdamW states and runs the forward under bf16 autocast, whose cache holds the bf16 cast of each",
            "weight until the forward ends; under DeepSpeed (`offload`) it is DeepSpeed's bf16 (bf16 module, fp32 partitions).",
            "`bf16-true` keeps everything in bf16 (DeepSpeed has no such mode). Largest error "
            f"**{max(abs(r['error_pct']) for r in bf16_rows):.2f}%**.",
            "",
            *[h.replace("| model | profile |", "| model | precision | profile |").replace("| --- | --- |", "| --- | --- | --- |", 1)
              for h in HEADER],
            *(row_line(r).replace(f"| {r['model']} |", f"| {r['model']} | `{r['precision']}` |", 1) for r in bf16_rows),
        ]
    if q_rows:
        lines += qlora_section(q_rows)
    if multi_rows:
        worst_multi = max(abs(e) for r in multi_rows for e in r["errors_per_rank_pct"])
        lowest = min(e for r in multi_rows for e in r["errors_per_rank_pct"])
        lines += [
            "",
            "## Two processes (torchrun, gloo, CPU)",
            "",
            "`max_length=64`, checkpointing off, 2 pairs per micro-batch, accumulation 1 and 2; data whose prompts run past",
            "`max_length` (every sequence full length, so ranks differ only by sharding). Each rank's own peak is measured;",
            f"the error is the estimate against each rank. Largest error **{worst_multi:.2f}%**, lowest {lowest:+.2f}%",
            "(target: within 5% of every rank, never more than 2% under).",
            "",
            "A point run several times (runs) compares each rank's highest peak (the one that runs out of memory); the",
            "lowest is in brackets.",
            "",
            "| model | layout | accumulation | runs | estimate (MiB) | rank 0 (MiB) | rank 1 (MiB) | error rank 0 | error rank 1 | peak phase |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in multi_rows:
            m, e = r["measured_per_rank_mib"], r["errors_per_rank_pct"]
            lo = r.get("measured_min_per_rank_mib", m)
            lines.append(f"| {r['model']} | {r['layout']} | {r['accumulation']} | {r.get('repeats', 1)} | {r['estimate_mib']:.2f} | {m[0]:.2f} ({lo[0]:.2f}) | "
                         f"{m[1]:.2f} ({lo[1]:.2f}) | {e[0]:+.2f}% | {e[1]:+.2f}% | {r['phase']} |")
        misses = [r for r in multi_rows if max(r["errors_per_rank_pct"]) > 5 or min(r["errors_per_rank_pct"]) < -2]
        if misses:
            lines += ["", "Points outside the target: " + "; ".join(
                f"{r['model']} {r['layout']} accumulation {r['accumulation']} "
                f"({min(r['errors_per_rank_pct']):+.1f}% to {max(r['errors_per_rank_pct']):+.1f}%)" for r in misses) + "."]
        lines += ["", *MULTI_NOTES, "", *independent_check(rows, multi_rows)]
    lines += ["", f"![estimate vs measured]({out.with_suffix('.png').name})"]
    old = out.read_text() if out.is_file() else ""
    if SHARED_BEGIN in old:  # the train.share_prefix section is regenerated by --share-prefix alone
        lines += ["", old[old.index(SHARED_BEGIN):old.index(SHARED_END) + len(SHARED_END)]]
    out.write_text("\n".join(lines) + "\n")


# Printed by --recompute, which keeps measurements from several runs: where they came from (as of 2026-11-23).
PROVENANCE = [
    "Where the measurements come from: the one-process grid from a full run on an idle 2-core machine (927 s,",
    "2026-11-23); the one-process ZeRO rows and every 2-process ZeRO-1/2 row (with and without optimizer offload)",
    "after rm set `reduce_scatter: false` (2026-11-24, load 5-9); the 2-process ZeRO-3 rows after DeepSpeed's ZeRO-3",
    "sizing changed (2026-11-23, load 8-9); the DDP rows in the session before (load 7-11). Load changes timings, not",
    "live-tensor counts. The QLoRA rows from `--part qlora` (2026-11-27, load 12-14). Every estimate is recomputed with the",
    "estimator as committed (`--recompute`).",
    "",
]


MULTI_NOTES = [
    "What the rows show:",
    "",
    "- **ZeRO-1/2, the end of a backward.** DeepSpeed's default reduce-scatter path (`average_tensor` with",
    "  `use_multi_rank_bucket_allreduce`) all-reduces a flattened copy of the whole bucket (`allreduce_bucket`), and",
    "  `copy_grads_in_partition` then allocates the rank's gradient partition (every parameter touching its slice,",
    "  whole). Whether that copy was freed before the partition was allocated depended on when gloo's worker thread",
    "  dropped its reference: the same point peaked 9-11% apart from run to run. rm now sets `reduce_scatter: false`",
    "  for ZeRO-1/2, which all-reduces the contiguous bucket in place: the same bytes on the wire, one bucket-sized",
    "  transient less, and no race. Every ZeRO-1/2 point was measured again after that change (2026-11-24, load",
    "  5-9), accumulation-1 points 3 times and the others twice: each rank peaked the same in every run. rm calls",
    "  `gc.collect()` after each DeepSpeed backward and step: DeepSpeed's old partitions sat in reference cycles,",
    "  which made the peak swing by a partition between runs. ZeRO-2 reduces every micro-batch: while accumulating,",
    "  each backward's reduction allocates a fresh partition (`_release_ipg_buffers` dropped the last one) beside the",
    "  gradients accumulated so far, still held in the previous one (`all_grad_tensors`, in",
    "  `independent_gradient_partition_epilogue`): two partitions, the peak when activations are smaller (issue 25).",
    "- **ZeRO-3** is configured as transformers' Trainer configures `\"auto\"` (`rm.distributed.engine.deepspeed_buckets`: bucket",
    "  hidden^2, prefetch 0.9 x hidden^2, persistence 10 x hidden). DeepSpeed's coordinator keeps a gathered",
    "  parameter until its reuse in the backward (`stage3_max_reuse_distance`), so the backward starts with every",
    "  non-persistent parameter gathered once; with it one gradient bucket and the reduce-scatter input of the largest",
    "  gradient. The step flattens the gradient partition (`_prepare_fp32_grad_for_sub_group`), the one-process peak;",
    "  by then the backward has released every gathered parameter (`release_sub_module`). An evaluation forward has",
    "  no backward to release them: every parameter stays gathered through it (issue 25).",
    "- **DDP** runs with `gradient_as_bucket_view=True`: gradients are views into the reducer's buckets, which exist",
    "  from the wrap on, so one gradient copy is alive for the whole step (before, the buckets were a second copy:",
    "  the -17.6% of issue 13).",
]


def independent_check(rows, multi_rows) -> list:
    """The live-tensor count against the growth of each process's peak resident size (ru_maxrss)."""
    pairs = [(r, i) for r in multi_rows for i in range(len(r["measured_per_rank_mib"]))]
    pairs += [(r, 0) for r in rows if r.get("rss_growth_per_rank_mib")]
    lines = ["## An independent measure: peak resident size",
             "",
             "The live-tensor count is rm's own instrument. Beside it, every run records how far its process's peak",
             "resident size (`ru_maxrss`) grew after the monitor started, which sees every byte malloc hands out,",
             "tensor or not (allocator caching, gloo's and DeepSpeed's own buffers, Python objects).",
             "",
             "| model | run | live-tensor peak (MiB) | peak RSS growth (MiB) | RSS / tensors |",
             "| --- | --- | ---: | ---: | ---: |"]
    ratios = []
    for r, i in pairs:
        tensors, rss = r["measured_per_rank_mib"][i], r["rss_growth_per_rank_mib"][i]
        if not rss:
            continue
        ratios.append((r["model"], rss / tensors))
        run = f"{r.get('layout', r['profile'])}, accumulation {r.get('accumulation', 2)}, rank {i}" if r.get("nproc", 1) > 1 \
            else f"`{r['profile']}`, one process, length {r['max_length']}"
        lines.append(f"| {r['model']} | {run} | {tensors:.1f} | {rss:.1f} | {rss / tensors:.3f} |")
    for model in sorted({m for m, _ in ratios}):
        values = [v for m, v in ratios if m == model]
        lines.append("")
        verdict = ("never below the tensor count: the count misses no tensor memory that RSS sees; the excess is "
                   "memory outside torch's tensors (malloc caching, gloo, Python), which a GPU's allocator does not hold"
                   if min(values) >= 1 else "below the tensor count at some points (memory counted before the monitor "
                   "started, or pages never touched): the two measures disagree there")
        lines.append(f"{model}: RSS growth is {min(values):.2f}-{max(values):.2f} x the live-tensor peak over "
                     f"{len(values)} process peaks, {verdict}.")
    return lines


# train.share_prefix layouts: one row of prefix + both suffixes per pair, or all pairs of a micro-batch in one row.
# train.layout=given: each point measures the layout it names (train.layout=auto packed the rows per pair as well).
SHARED_LAYOUTS = {"row per pair": ("train.share_prefix=true", "train.layout=given"),
                  "packed, budget 256": ("train.share_prefix=true", "train.packing=true",
                                         "train.max_tokens_per_micro_batch=256", "train.layout=given")}
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
        f"Regenerate: `python benchmarks/memory_calibration.py --share-prefix` ({len(rows)} points, "
        f"{time.strftime('%Y-%m-%d')}, load {os.getloadavg()[0]:.1f} at the end). Each",
        "point trains 2 steps on the synthetic pairs, and its peak is compared with the estimate the run decides by:",
        "sized by the micro-batches this data forms (each pair's prompt once, both answers after it; a packed row up to",
        "its budget), with the 4D mask counted. For a full row it is exact to the byte",
        "(`tests/modelling/test_prefix_sharing.py::test_activation_estimate_matches_a_real_shared_step`).",
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
    finish_error_plot(fig, ax, path, (-5, 5, "within 5%"), "measured peak of live tensor bytes (MiB)",
                      "Pre-flight estimate vs measurement, CPU", legend=(7, 2))


def finish_error_plot(fig, ax, path: Path, band, xlabel: str, title: str, legend) -> None:
    """The target band, a log x axis of measured MiB, the error in % on y; saved and closed."""
    low, high, label = band
    ax.axhspan(low, high, color="green", alpha=0.08, label=label)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("estimate error (%)")
    ax.set_title(title)
    ax.legend(fontsize=legend[0], ncol=legend[1])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# --random N --seed S: whole run configurations drawn at random from the space users have (nobody tunes to them).

# Precision modes drawn, each with the overrides that select it on this CPU machine. Precision names are being
# renamed (32-true, bf16-mixed, bf16-true, 16-mixed): this list is the one place the random calibration names them.
PRECISIONS_DRAWN = [("32-true", ["train.precision=32-true"]),
                    ("bf16-mixed", ["train.precision=bf16-mixed", "hardware.bf16=true"]),
                    ("bf16-true", ["train.precision=bf16-true", "hardware.bf16=true"])]
RANDOM_PROFILES = ["full", "lora", "8bit", "offload"]  # the default draw; --profiles qlora draws QLoRA (slow on a CPU)
PROFILE_COLOURS = [*RANDOM_PROFILES, "qlora"]
RANDOM_LAYOUTS = {  # name -> (processes, overrides)
    "1 process": (1, ["distributed=auto"]),
    "DDP": (2, ["distributed=ddp"]),
    "ZeRO-1": (2, ["distributed=zero2", "distributed.zero_stage=1"]),
    "ZeRO-2": (2, ["distributed=zero2"]),
    "ZeRO-3": (2, ["distributed=zero3"]),
    "ZeRO-3 offload": (2, ["distributed=zero3_offload"]),
}
RANDOM_MAX_PARAMS = 150_000_000  # the largest shape drawn
# Training compute of a point (6 x non-embedding parameters x tokens of its 2 steps, x processes: they share 2
# cores); points above it are redrawn and counted, so that 60 points take well under an hour on 2 cores.
RANDOM_MAX_FLOPS = 1.5e12
# bf16 matmuls run about 100x slower than fp32 on a CPU without AVX512-BF16/AMX (0.95 against 144 GFLOP/s for a
# 512x1024 @ 1024x1024 product on the 2-core EPYC this was drawn on): a bf16 point's FLOPs weigh this much more
# against the cap, so that one bf16 point cannot take 13 minutes.
RANDOM_BF16_WEIGHT = 50
# Evaluation-peak points (issue 48): this share of points scores its eval set in forwards of one of these many pairs
# (train.eval_batch_size; 1 otherwise), so that the evaluation forward is the peak of some of them.
RANDOM_EVAL_SHARE, RANDOM_EVAL_BATCHES = 0.35, (8, 16, 32, 64)
RANDOM_MISS_OVER, RANDOM_MISS_UNDER = 5.0, -2.0  # %: the calibration's target (within 5% over, never 2% under)
RANDOM_RESULTS = ROOT / "benchmarks" / "results" / "memory_calibration_random.json"
RANDOM_DOC = ROOT / "benchmarks" / "results" / "memory_calibration_random.md"
DATA_PLACEHOLDER = "POINT_DATA"  # in the recorded overrides: the point's own JSONL (train) and POINT_DATA_eval


def draw_shape(rng) -> dict:
    """A decoder shape: layers, hidden, heads / kv heads (GQA), head_dim, intermediate, vocabulary, model_type."""
    hidden = 64 * rng.randint(2, 16)
    heads = rng.choice([h for h in (1, 2, 4, 8, 16) if hidden // h >= 16])
    kv = rng.choice([k for k in range(1, heads + 1) if heads % k == 0])
    head_dim = rng.choice([32, 64, 128]) if rng.random() < 0.35 else None  # explicit, or hidden / heads
    ratio = rng.choice([2.0, 2.6875, 2.75, 3.5, 4.0, round(rng.uniform(1.5, 4.5), 3)])
    intermediate = max(64, int(round(hidden * ratio / 8)) * 8)
    model_type = rng.choice(["mistral", "llama", "qwen2"])
    vocab = rng.choice([234, 300, 512, 1000, 4096, 8192, 32000, 50304])
    if model_type == "qwen2":  # its points use the byte-level BPE, which needs 4 specials and 256 bytes (rm refuses fewer)
        vocab = max(vocab, 300)
    return {"model_type": model_type, "num_hidden_layers": rng.randint(1, 8), "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "intermediate_size": intermediate, "vocab_size": vocab}


def draw_eval_batch(data_seed: int) -> int:
    """The point's ``train.eval_batch_size``, from a generator of its own seeded by the point's data seed: every other
    choice of a seed stays what runs before evaluation-peak points drew."""
    import random

    side = random.Random(f"eval batch {data_seed}")
    return side.choice(RANDOM_EVAL_BATCHES) if side.random() < RANDOM_EVAL_SHARE else 1


def draw_point(rng, profiles=RANDOM_PROFILES) -> dict:
    """One run configuration, every choice independent; validated by the caller."""
    shape = draw_shape(rng)
    layout = rng.choice(list(RANDOM_LAYOUTS))
    precision = rng.randrange(len(PRECISIONS_DRAWN))
    max_length = rng.choice([32, 48, 64, 96, 128, 160, 192, 256])
    packing = rng.random() < 0.25
    budget = 0
    if packing and rng.random() < 0.6:
        budget = rng.choice([2, 3, 4, 6]) * max_length
    p = {"shape": shape, "profile": rng.choice(profiles), "layout": layout, "precision": precision,
         "micro": rng.randint(1, 4), "accumulation": rng.randint(1, 4), "max_length": max_length,
         "checkpointing": rng.random() < 0.5, "packing": packing, "max_tokens": budget,
         "share_prefix": rng.random() < 0.3,
         "data": {"seed": rng.randrange(2**31), "pairs": 128, "long_fraction": round(rng.uniform(0.2, 0.5), 3),
                  "median_fraction": round(rng.uniform(0.15, 0.6), 3), "sigma": round(rng.uniform(0.4, 1.0), 3)}}
    with_eval_batch(p, draw_eval_batch(p["data"]["seed"]))
    return p


def with_eval_batch(p: dict, eval_batch: int) -> None:
    """Set the point's evaluation batch, with eval pairs enough for every rank to score full batches (8 at least)."""
    p["eval_batch"] = eval_batch
    p["data"]["eval_pairs"] = max(8, eval_batch * RANDOM_LAYOUTS[p["layout"]][0])


def random_overrides(p: dict, data: str = DATA_PLACEHOLDER) -> list:
    """The point's ``rm.train`` overrides (no run directory)."""
    s = p["shape"]
    nproc, layout = RANDOM_LAYOUTS[p["layout"]]
    # qwen2: rm refuses model.tokenizer=words (AutoTokenizer reloads it as Qwen2Tokenizer, which tokenises
    # differently), so qwen2 points train the byte-level BPE on their own texts.
    tokenizer = "bpe" if s["model_type"] == "qwen2" else "words"
    shape = [f"model.{k}={'null' if v is None else v}" for k, v in s.items()]
    return [*layout, "experiment=tiny", f"model.tokenizer={tokenizer}", *shape, f"memory_profile={p['profile']}",
            *PRECISIONS_DRAWN[p["precision"]][1], f"train.gradient_checkpointing={str(p['checkpointing']).lower()}",
            f"data.max_length={p['max_length']}", "data=local", f"data.train_files=[{data}.jsonl]",
            f"data.eval_files=[{data}_eval.jsonl]", f"train.micro_batch_size={p['micro']}",
            f"train.global_batch_size={p['micro'] * nproc * p['accumulation']}", f"train.eval_batch_size={p.get('eval_batch', 1)}",
            f"train.packing={str(p['packing']).lower()}", f"train.max_tokens_per_micro_batch={p['max_tokens']}",
            f"train.share_prefix={str(p['share_prefix']).lower()}",
            "train.max_steps=2", "train.logging.eval_steps=0", "train.checkpoint.save_steps=0", "train.logging.logging_steps=1",
            "train.logging.track_memory=true", "preflight=warn"]


def point_cost(p: dict, cfg) -> tuple:
    """(parameters, FLOPs of the point's 2 training steps over all processes and of its evaluation forwards, bf16
    weighted by RANDOM_BF16_WEIGHT)."""
    from rm.memory.terms import parameter_counts

    counts = parameter_counts(cfg.model, None)
    nproc = RANDOM_LAYOUTS[p["layout"]][0]
    non_embedding = counts.total - cfg.model.vocab_size * cfg.model.hidden_size
    tokens = 2 * p["micro"] * p["max_length"] * p["accumulation"] * nproc * 2
    weight = RANDOM_BF16_WEIGHT if PRECISIONS_DRAWN[p["precision"]][0].startswith("bf16") else 1
    eval_tokens = 2 * p["data"].get("eval_pairs", 8) * p["max_length"]  # one forward of each side, padded
    return counts.total, ((8 if p["checkpointing"] else 6) * tokens + 2 * eval_tokens) * non_embedding * weight


def draw_valid_points(n: int, seed: int, profiles=RANDOM_PROFILES):
    """``n`` points the project's validation accepts; the refused draws counted by reason."""
    import random
    import re

    from rm.foundations.config import compose
    from rm.settings.validate import ConfigError, validate

    rng = random.Random(seed)
    points, redrawn = [], {}
    while len(points) < n:
        p = draw_point(rng, profiles)
        nproc = RANDOM_LAYOUTS[p["layout"]][0]
        cfg = compose(random_overrides(p))
        try:
            validate(cfg, nproc, f"WORLD_SIZE={nproc} from the launcher" if nproc > 1 else "given")
        except ConfigError as e:
            for line in str(e).splitlines()[1:]:
                reason = "validate: " + re.sub(r"\d+", "N", line.strip(" -"))[:160]
                redrawn[reason] = redrawn.get(reason, 0) + 1
            continue
        params, flops = point_cost(p, cfg)
        while flops > RANDOM_MAX_FLOPS and p["eval_batch"] > 1:  # a smaller evaluation, not a redraw: the seed's
            with_eval_batch(p, p["eval_batch"] // 2)  # other points stay those it drew
            params, flops = point_cost(p, cfg)
        if params > RANDOM_MAX_PARAMS:
            redrawn["size: more than 150M parameters"] = redrawn.get("size: more than 150M parameters", 0) + 1
            continue
        if flops > RANDOM_MAX_FLOPS:
            key = f"time: more than {RANDOM_MAX_FLOPS:.1e} training FLOPs, bf16 x{RANDOM_BF16_WEIGHT} (2 cores)"
            redrawn[key] = redrawn.get(key, 0) + 1
            continue
        p["params"], p["flops"] = params, flops
        points.append(p)
    return points, redrawn


def write_random_pairs(stem: Path, spec: dict, max_length: int) -> None:
    """Train and eval JSONL for one point: log-normal prompt lengths (in words) with a drawn median and spread, a
    drawn fraction of prompts longer than max_length (truncation cuts their start: full-length rows), short answers."""
    import math
    import random

    from rm.data.tokenizer import VOCABULARY

    rng = random.Random(spec["seed"])
    words = [w for w in VOCABULARY if w.isalpha()]
    median = max(1.0, spec["median_fraction"] * max_length)

    def pair():
        if rng.random() < spec["long_fraction"]:
            n = int(max_length * rng.uniform(1.05, 2.5))
        else:
            n = max(1, min(int(rng.lognormvariate(math.log(median), spec["sigma"])), 4 * max_length))
        cap = max(2, max_length // 4)
        answer = lambda: " ".join(rng.choice(words) for _ in range(min(cap, max(1, int(rng.lognormvariate(math.log(8), 0.7))))))  # noqa: E731
        return {"prompt": " ".join(rng.choice(words) for _ in range(n)), "chosen": answer(), "rejected": answer()}

    for path, count in ((Path(f"{stem}.jsonl"), spec["pairs"]), (Path(f"{stem}_eval.jsonl"), spec.get("eval_pairs", 8))):
        with path.open("w") as f:
            for _ in range(count):
                f.write(json.dumps(pair()) + "\n")


def short_form(p: dict) -> str:
    """The point in one line: shape | profile | layout | precision | batch | options."""
    s = p["shape"]
    hd = f" d{s['head_dim']}" if s["head_dim"] else ""
    opts = [f"mb{p['micro']}x{RANDOM_LAYOUTS[p['layout']][0]}x{p['accumulation']}", f"len{p['max_length']}"]
    opts += ["ckpt"] * p["checkpointing"] + (["pack" + (str(p["max_tokens"]) if p["max_tokens"] else "")] if p["packing"] else [])
    opts += ["share"] * p["share_prefix"] + ([f"eval{p['eval_batch']}"] if p.get("eval_batch", 1) > 1 else [])
    return (f"{s['model_type']} L{s['num_hidden_layers']} h{s['hidden_size']} a{s['num_attention_heads']}/kv{s['num_key_value_heads']}"
            f"{hd} i{s['intermediate_size']} V{s['vocab_size']} ({p['params'] / 1e6:.1f}M) | {p['profile']} | {p['layout']} | "
            f"{PRECISIONS_DRAWN[p['precision']][0]} | {' '.join(opts)}")


def run_random_point(i: int, p: dict, workdir: Path, timeout: int, memtracker: bool = False,
                     random_init_saved_first: bool = True) -> dict:
    """Train the point (2 steps, live-tensor tracking); with ``memtracker`` under PyTorch's MemTracker as well.
    ``random_init_saved_first``: a QLoRA point's random init is saved before the run (:func:`prepare_random_init`)."""
    stem = workdir / f"p{i}"
    if not Path(f"{stem}.jsonl").exists():
        write_random_pairs(stem, p["data"], p["max_length"])
    run_dir = workdir / (f"run{i}" + ("_memtracker" if memtracker else ""))
    nproc = RANDOM_LAYOUTS[p["layout"]][0]
    overrides = [*random_overrides(p, str(stem)), f"hydra.run.dir={run_dir}"]
    target = [str(ROOT / "benchmarks" / "memtracker_train.py")] if memtracker else ["-m", "rm.train"]
    launch = [sys.executable, *target]
    if nproc > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                  "--master_port", str(free_port()), *target]
    start = time.perf_counter()
    cache = workdir / (f"rm_cache_p{i}" + ("_memtracker" if memtracker else ""))
    random_init = prepare_random_init(overrides, cache, saved=random_init_saved_first)
    try:
        proc = subprocess.run([*launch, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=random_init_env(cache))
        rc, err = proc.returncode, rank_errors(proc)
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        err += f"\ntimed out after {timeout} s"
    out = {"wall_s": round(time.perf_counter() - start, 1), "load_after": round(os.getloadavg()[0], 2)}
    if random_init is not None:
        out["random_init"] = random_init
    memory_file = run_dir / "memory.json"
    if rc != 0 or not memory_file.is_file():
        out["failed"] = failure_line(err, rc)
        return out
    out.update(point_result(json.loads(memory_file.read_text()), memtracker))
    return out


def point_result(memory: dict, memtracker: bool = False) -> dict:
    """A point's row from its run's ``memory.json``: each rank's measured peak against that rank's own estimate."""
    ranks = memory.get("measured_per_rank") or [memory["measured"]]
    est = memory["estimate"]
    # Each rank against its own estimate (its data and partitions); the verdict's is the largest.
    per_rank = est.get("rank_peak_bytes") or [est["peak_bytes"]] * len(ranks)
    out = {"estimate_mib": est["peak_bytes"] / 2**20, "phase": est["peak_phase"], "shapes": est.get("shapes"),
           "estimate_per_rank_mib": [b / 2**20 for b in per_rank],
           "estimate_terms_mib": {k: est[k] / 2**20 for k in ("weights", "gradients", "optimizer_states", "activations",
                                                                "evaluation", "temporaries", "overhead", "communication")
                                  if isinstance(est.get(k), (int, float))},
           "measured_per_rank_mib": [r["peak_allocated_bytes"] / 2**20 for r in ranks],
           "rss_growth_per_rank_mib": [r.get("peak_rss_growth_bytes", 0) / 2**20 for r in ranks]}
    out["errors_per_rank_pct"] = [100 * (e - m) / m for e, m in zip(out["estimate_per_rank_mib"], out["measured_per_rank_mib"])]
    if memtracker:
        out["memtracker_per_rank_mib"] = [r["memtracker_peak_bytes"] / 2**20 if r.get("memtracker_peak_bytes") is not None
                                          else None for r in ranks]
        out["memtracker_breakdown_per_rank_mib"] = [r.get("memtracker_peak_breakdown_mib") for r in ranks]
        out["memtracker_error"] = [r.get("memtracker_error") for r in ranks]
    return out


def is_miss(row: dict) -> bool:
    e = row.get("errors_per_rank_pct")
    return bool(e) and (max(e) > RANDOM_MISS_OVER or min(e) < RANDOM_MISS_UNDER)


def random_main(args) -> None:
    """``--random N --seed S``: draw, run, and write benchmarks/results/memory_calibration_random.{json,md,png} after every point."""
    out = Path(args.out or RANDOM_DOC)
    results = out.with_suffix(".json")
    profiles = args.profiles or RANDOM_PROFILES
    command = f"python benchmarks/memory_calibration.py --random {args.random} --seed {args.seed}" + (
        f" --memtracker {args.memtracker}" if args.memtracker else "") + (
        f" --profiles {' '.join(profiles)}" if args.profiles else "") + (
        f" --random-init {args.random_init}" if args.random_init != "saved" else "") + (
        f" --only {' '.join(map(str, args.only))}" if args.only else "")
    points, redrawn = draw_valid_points(args.random, args.seed, profiles)
    indices = args.only or range(len(points))  # a few points of a draw: the rest of it stays what the seed drew
    points = [points[i] for i in indices]
    tracked = set(range(min(args.memtracker, len(points))))
    if args.memtracker and not any(RANDOM_LAYOUTS[points[i]["layout"]][0] > 1 for i in tracked):
        multi = [i for i, p in enumerate(points) if RANDOM_LAYOUTS[p["layout"]][0] > 1]
        tracked |= set(multi[:1])  # at least one multi-process point
    deepspeed = lambda p: p["layout"] not in ("1 process", "DDP") or p["profile"] == "offload"  # noqa: E731
    if args.memtracker and all(deepspeed(points[i]) for i in tracked):
        tracked |= set([i for i, p in enumerate(points) if not deepspeed(p)][:1])  # and one without DeepSpeed
    start, loads = time.perf_counter(), [os.getloadavg()[0]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(points):
            row = {"index": indices[i], "point": p, "short": short_form(p), "overrides": random_overrides(p)}
            saved = args.random_init == "saved"
            row.update(run_random_point(i, p, Path(tmp), args.point_timeout, random_init_saved_first=saved))
            if i in tracked:
                row["memtracker_run"] = run_random_point(i, p, Path(tmp), args.point_timeout, memtracker=True,
                                                         random_init_saved_first=saved)
            loads.append(row["load_after"])
            rows.append(row)
            status = row.get("failed") or " ".join(f"{e:+.2f}%" for e in row["errors_per_rank_pct"]) + (" MISS" if is_miss(row) else "")
            print(f"[{i + 1}/{len(points)}] {row['wall_s']:.0f} s {row['short']}: {status}", flush=True)
            meta = {"seed": args.seed, "n": args.random, "command": command, "redrawn": redrawn,
                    "precisions_drawn": PRECISIONS_DRAWN, "max_params": RANDOM_MAX_PARAMS, "max_flops": RANDOM_MAX_FLOPS,
                    "bf16_weight": RANDOM_BF16_WEIGHT, "elapsed_s": round(time.perf_counter() - start), "load_min_max": [min(loads), max(loads)],
                    "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "complete": i + 1 == len(points),
                    "random_init": args.random_init}
            results.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
            write_random_doc(out, meta, rows)
            plot_random(rows, out.with_suffix(".png"))
    print(f"wrote {out}, {results}, {out.with_suffix('.png')}")


def random_summary(meta: dict, rows: list) -> dict:
    ok = [r for r in rows if "errors_per_rank_pct" in r]
    errors = [e for r in ok for e in r["errors_per_rank_pct"]]
    return {"points": len(rows), "measured": len(ok), "failed": len(rows) - len(ok), "misses": sum(map(is_miss, ok)),
            "over": max(errors, default=0.0), "under": min(errors, default=0.0)}


def write_random_doc(out: Path, meta: dict, rows: list) -> None:
    s = random_summary(meta, rows)
    fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        "# Memory estimate vs measurement: random configurations (CPU)",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['elapsed_s']} s on {meta['cpu_count']} CPU cores, load average "
        f"{meta['load_min_max'][0]:.1f}-{meta['load_min_max'][1]:.1f}{'' if meta['complete'] else '; INCOMPLETE: the run stopped early'}).",
        "",
        f"**{s['points']} points (seed {meta['seed']}): {s['measured']} measured, {s['failed']} failed, {s['misses']} MISS "
        f"(an error above +{RANDOM_MISS_OVER:g}% or below {RANDOM_MISS_UNDER:g}% on any rank); largest over {s['over']:+.2f}%, "
        f"largest under {s['under']:+.2f}%.**",
        "",
        *[note for note in meta.get("notes", [])],
        *([""] if meta.get("notes") else []),
        "Every point is a whole run configuration drawn with `random.Random(seed)` (`draw_point` in",
        "`benchmarks/memory_calibration.py`): shape (model_type mistral / llama / qwen2, 1-8 layers, hidden 128-1024, heads",
        "and GQA kv heads, explicit head_dim or hidden / heads, intermediate size, vocabulary), memory profile (full, lora,",
        "8bit, offload), process layout (one process, or 2 processes: DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-3 offload),",
        f"precision ({', '.join(name for name, _ in meta['precisions_drawn'])}), micro-batch 1-4, accumulation 1-4,",
        "`data.max_length` 32-256, gradient checkpointing, `train.packing` (with or without a token budget) and",
        "`train.share_prefix`, and for about a third of the points a larger `train.eval_batch_size` (8-64 pairs, `evalN`;",
        "1 otherwise) so that the evaluation forward is the peak of some. Each point writes its own pairs: log-normal prompt lengths (drawn median and spread) and a",
        "drawn 20-50% of prompts longer than `max_length` (cut to full-length rows). 2 optimizer steps, live-tensor peak",
        "of every rank (`train.logging.track_memory=true`) against that rank's own estimate in `memory.json` (`rank_peak_bytes`:",
        "sized at the micro-batches its data forms and its ZeRO partition; the verdict is the largest),",
        "`model.tokenizer=words` (qwen2: `bpe`, as rm refuses `words` for",
        "qwen2). A draw the project's validation (`rm.settings.validate.validate` on the composed config) refuses is redrawn, as",
        f"is one over {meta['max_params'] / 1e6:.0f}M parameters or {meta['max_flops']:.1e} training FLOPs (time on 2 cores; a bf16",
        f"point's FLOPs count {meta.get('bf16_weight', 1)}x, as CPU bf16 matmuls are that much slower);",
        "the overrides of every point are in the JSON beside this file (`POINT_DATA` stands for the point's own JSONL).",
        *(random_init_note(meta["random_init"]) if meta.get("random_init") and any(r.get("random_init") for r in rows) else []),
        "",
        "Redrawn: " + ("; ".join(f"{n} x {reason}" for reason, n in sorted(meta["redrawn"].items(), key=lambda kv: -kv[1]))
                       or "none") + ".",
        "",
        "| # | point | estimate per rank (MiB) | measured per rank (MiB) | error per rank | peak phase |",
        "| ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        head = f"| {r['index']} | {r['short']} |"
        if "errors_per_rank_pct" not in r:
            lines.append(f"{head} | | failed: `{r['failed'].replace('|', '/')}` | |")
            continue
        errs = " / ".join(f"{e:+.2f}%" for e in r["errors_per_rank_pct"]) + (" **MISS**" if is_miss(r) else "")
        lines.append(f"{head} {fmt(r.get('estimate_per_rank_mib', [r['estimate_mib']]))} | {fmt(r['measured_per_rank_mib'])} | {errs} | {r['phase']} |")
    lines += ["", *option_table(rows)]
    tracked = [r for r in rows if "memtracker_run" in r]
    if tracked:
        lines += ["", "## An independent measure: PyTorch's MemTracker", "",
                  "For these points the same training ran once more under `benchmarks/memtracker_train.py`, which opens",
                  "`torch.distributed._tools.mem_tracker.MemTracker` (PyTorch's own dispatch-mode tracker of real tensors, with",
                  "its module, gradient and optimizer hooks and `UntypedStorage.resize_` patched) beside rm's count in the same",
                  "process, and hands it the tensors rm registers (weights, engine states). Both peaks are of that run; the",
                  "main table's peak (a separate run) is repeated for the run-to-run difference.", "",
                  "| # | point | rm, main run (MiB) | rm, this run (MiB) | MemTracker (MiB) | MemTracker / rm | MemTracker at its peak |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]
        for r in tracked:
            m = r["memtracker_run"]
            if "measured_per_rank_mib" not in m:
                lines.append(f"| {r['index']} | {r['short']} | | | failed: `{m.get('failed', '').replace('|', '/')}` | | |")
                continue
            mt = m.get("memtracker_per_rank_mib") or []
            ratio = " / ".join(f"{a / b:.4f}" if a else "-" for a, b in zip(mt, m["measured_per_rank_mib"]))
            brk = m.get("memtracker_breakdown_per_rank_mib") or [None]
            top = ", ".join(f"{k} {v:.1f}" for k, v in sorted((brk[0] or {}).items(), key=lambda kv: -kv[1]) if v >= 0.05 and k != "Total")
            lines.append(f"| {r['index']} | {r['short']} | {fmt(r.get('measured_per_rank_mib', []))} | {fmt(m['measured_per_rank_mib'])} | "
                         f"{' / '.join('-' if a is None else f'{a:.2f}' for a in mt)} | {ratio} | rank 0: {top} |")
    lines += ["", f"![error vs measured]({out.with_suffix('.png').name})", ""]
    out.write_text("\n".join(lines))


def random_init_note(mode: str) -> list:
    """How the QLoRA points met their shape's random init (``--random-init``), in the doc's words."""
    if mode == "saved":
        return ["QLoRA points build no weights: each shape's fp32 random init was saved before its run (into an empty",
                "`RM_CACHE` of the point's own, as `rm.modelling.model.saved_random_init` saves it), so the runs are those after a",
                "shape's first, and their estimates count no build. A first run builds it on local rank 0 before",
                "anything else exists (`rm.memory.terms.random_init_build_bytes`: the fp32 model, exact to the byte),",
                "its peak where that is larger: `--random-init built` measures those."]
    return ["QLoRA points are each shape's first run: it finds no saved random init (an empty `RM_CACHE` of the",
            "point's own), builds the fp32 model on local rank 0 and saves it before the 4-bit load; the estimate",
            "counts that build on that rank (`rm.memory.terms.random_init_build_bytes`)."]


def option_table(rows: list) -> list:
    """Misses and errors by each drawn option's value (every rank's error counts): where the misses gather."""
    ok = [r for r in rows if "errors_per_rank_pct" in r]
    options = {
        "profile": lambda p: p["profile"], "layout": lambda p: p["layout"],
        "precision": lambda p: PRECISIONS_DRAWN[p["precision"]][0], "model_type": lambda p: p["shape"]["model_type"],
        "share_prefix": lambda p: p["share_prefix"], "packing": lambda p: ("budget" if p["max_tokens"] else "on") if p["packing"] else "off",
        "checkpointing": lambda p: p["checkpointing"], "micro-batch": lambda p: p["micro"],
        "max_length": lambda p: "<= 96" if p["max_length"] <= 96 else "> 96",
        "size": lambda p: "< 10M" if p["params"] < 1e7 else "10M+",
    }
    lines = ["## Misses by option", "", "Each drawn option's values: points, misses, and the median and range of every rank's error.",
             "", "| option | value | points | misses | median error | range |", "| --- | --- | ---: | ---: | ---: | --- |"]
    for name, key in options.items():
        for value in sorted({str(key(r["point"])) for r in ok}):
            group = [r for r in ok if str(key(r["point"])) == value]
            errs = sorted(e for r in group for e in r["errors_per_rank_pct"])
            lines.append(f"| {name} | {value} | {len(group)} | {sum(map(is_miss, group))} | {errs[len(errs) // 2]:+.2f}% | "
                         f"{errs[0]:+.2f}% to {errs[-1]:+.2f}% |")
    return lines


def plot_random(rows: list, path: Path) -> None:
    """Error against measured peak, one marker per rank; colour by profile, shape by layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = dict(zip(RANDOM_LAYOUTS, "os^vDP"))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for profile in PROFILE_COLOURS:
        for layout, marker in markers.items():
            pts = [(m, e) for r in rows if "errors_per_rank_pct" in r and r["point"]["profile"] == profile
                   and r["point"]["layout"] == layout for m, e in zip(r["measured_per_rank_mib"], r["errors_per_rank_pct"])]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, s=22, color=f"C{PROFILE_COLOURS.index(profile)}",
                           label=f"{profile}, {layout}")
    finish_error_plot(fig, ax, path, (RANDOM_MISS_UNDER, RANDOM_MISS_OVER, "target"),
                      "measured peak of live tensor bytes, each rank (MiB)",
                      "Pre-flight estimate vs measurement, random configurations, CPU", legend=(6, 3))


if __name__ == "__main__":
    main()
