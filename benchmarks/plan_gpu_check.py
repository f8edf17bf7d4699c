"""rm.plan's predicted step time against the steps a GPU measured, on any machine (no GPU needed).

    python benchmarks/plan_gpu_check.py                                         # the H200's 1B rows
    python benchmarks/plan_gpu_check.py --hardware h100_80g --measured "rm padded=0.810" "TRL RewardTrainer=0.844"
    python benchmarks/plan_gpu_check.py --kernel-us 5 46                        # the prediction at other op costs
    python benchmarks/plan_gpu_check.py --pick gpu-7b-lora --hardware h200_141g,h100_80g   # train.layout=auto's pick

Reads a ``bench_vs_trl.py --out-json`` file of a GPU run (default: ``benchmarks/results/gpu/throughput_gpu_1b_h200.json``),
rebuilds its pairs (the benchmark generates them from a seed) and its setup, and predicts each row's seconds per
optimizer step with :func:`rm.plan.steptime.predict_step_seconds` under the named hardware profile's rates: the
terms ``rm.plan`` prices (matmuls and attention, elementwise traffic, a fixed cost per op, the optimizer step).
TRL's row is priced as rm's padded layout with TRL's micro-batch (the same batches, the same kernels). The
prediction never reads the measured step times: they come from a run, the rates from the profile (the datasheet's,
and an op's fixed cost as the profile assumes it, or as ``--kernel-us`` gives it: ``benchmarks/gpu_constants.py``
measured 46 us on the H200 machine's host).

``--measured NAME=SECONDS`` gives step times that have no JSON (the H100 session's, docs/gpu.md), for the file's
rows of those names. ``--kernel-us`` predicts again at each fixed cost per op given, to show what that term does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def bench_lengths(data_name: str):
    """The lengths of bench_vs_trl.py's training pairs of one data set (it generates them from a seed)."""
    import datasets

    import bench_vs_trl as bench
    from rm.plan.lengths import lengths_of

    pairs = bench.DATASETS[data_name](960, seed=0)
    return lengths_of(datasets.Dataset.from_list(
        [{"chosen_input_ids": p["chosen_input_ids"], "rejected_input_ids": p["rejected_input_ids"]} for p in pairs]),
        [], f"bench_vs_trl's {data_name} pairs")


def on_hardware(overrides, hardware: str):
    """bench_vs_trl.py's overrides with the hardware profile replaced."""
    return [o if not o.startswith("hardware=") else f"hardware={hardware}" for o in overrides]


def predict_rows(results: dict, data_name: str, hardware: str, kernel_us=None) -> dict:
    """Predicted :class:`rm.plan.steptime.StepTime` of each row of one data set's results, by row name."""
    import bench_vs_trl as bench
    from rm.foundations.config import compose
    from rm.data.shapes import layout_of
    from rm.foundations.hardware import run_attention_kernel
    from rm.plan.constants import rates_for
    from rm.plan.lengths import step_micro_batches
    from rm.plan.steptime import predict_step_seconds
    from rm.settings.validate import validate

    section = results[data_name]
    setup = bench.Setup(**{**section["setup"], "shape": tuple(section["setup"]["shape"])})
    lengths = bench_lengths(data_name)
    variants = bench.variants(setup)
    out = {}
    for name in section["results"]:
        layout = variants["rm padded"] if name.startswith("TRL") else variants.get(name)
        if layout is None or "train.layout=given" not in layout:
            continue  # a row whose layout train.layout=auto chose in the run: --pick prices that
        cfg = compose(on_hardware(bench.rm_overrides(layout, setup), hardware))
        plan = validate(cfg, 1)
        t = cfg.train
        steps = step_micro_batches(lengths, layout_of(t.packing, t.share_prefix), plan.micro_batch_size,
                                   plan.world_size, t.global_batch_size, t.seed, t.group_by_length,
                                   t.max_tokens_per_micro_batch, steps=setup.steps,
                                   kernel=run_attention_kernel(cfg, plan))
        rates = rates_for(plan.hardware, plan.device)
        if kernel_us is not None:
            rates = dataclasses.replace(rates, kernel_seconds=kernel_us * 1e-6)
        out[name] = predict_step_seconds(cfg, plan, steps, rates)
    return out


def auto_pick(setup_name: str, data_name: str, hardware: str):
    """What ``train.layout=auto`` picks for bench_vs_trl.py's no-flags row of a setup on a hardware profile
    (:func:`rm.plan.auto.choose_layout`, the function a training run calls), as its ``LayoutChoice``."""
    import bench_vs_trl as bench
    from rm.foundations.config import compose
    from rm.plan.auto import choose_layout
    from rm.settings.validate import validate

    cfg = compose(on_hardware(bench.rm_overrides([], bench.SETUPS[setup_name]), hardware))
    return choose_layout(cfg, validate(cfg, 1), [], bench_lengths(data_name))[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/gpu/throughput_gpu_1b_h200.json")
    parser.add_argument("--hardware", default="h200_141g", help="the hardware profile to price the rows with")
    parser.add_argument("--measured", nargs="*", default=[], metavar="NAME=SECONDS",
                        help="measured seconds per step of rows the file does not time")
    parser.add_argument("--kernel-us", nargs="*", type=float, default=[],
                        help="also predict with these fixed costs per op (microseconds)")
    parser.add_argument("--pick", metavar="SETUP", help="instead: what train.layout=auto picks for bench_vs_trl.py's "
                        "SETUP (gpu-1b, gpu-7b-lora) on its multi-turn data, on each --hardware profile (comma-separated)")
    args = parser.parse_args()
    known = sorted(path.stem for path in (ROOT / "conf/hardware").glob("*.yaml"))
    unknown = [h for h in args.hardware.split(",") if h not in known]
    if unknown:
        parser.error(f"--hardware: no profile {unknown} in conf/hardware; the profiles: {known}")
    if args.pick:
        for hardware in args.hardware.split(","):
            choice = auto_pick(args.pick, "multi-turn", hardware)
            print(f"{args.pick} on hardware={hardware}: {' '.join(choice.changed) or 'as configured'} ({choice.reason})")
        return
    results = json.loads(args.results.read_text())
    given = dict(m.rsplit("=", 1) for m in args.measured)
    for data_name, section in results.items():
        print(f"{data_name} data, {section.get('gpu')} run ({args.results.name}), priced as hardware={args.hardware}:")
        print("| row | measured s/step | op cost (us) | predicted s/step | error | compute | elementwise | ops "
              "| optimizer |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for kernel_us in [None, *args.kernel_us]:
            for name, step in predict_rows(results, data_name, args.hardware, kernel_us).items():
                measured = float(given[name]) if name in given else section["results"][name].get("step_s")
                error = f"{100 * (step.seconds / measured - 1):+.1f}%" if measured else ""
                cost = "profile" if kernel_us is None else f"{kernel_us:g}"
                shown = f"{measured:.3f}" if measured else ""
                print(f"| {name} | {shown} | {cost} | {step.seconds:.3f} | {error} | {step.compute:.3f} | "
                      f"{step.elementwise:.3f} | {step.kernels:.3f} | {step.optimizer:.3f} |")


if __name__ == "__main__":
    main()
