"""The rates a step-time model needs for this GPU, measured: matmul FLOP/s, device memory and host-link bandwidth.

    python benchmarks/gpu_constants.py --out benchmarks/results/gpu/gpu_constants.json     # about 15 s on one H100

Each figure is the median of timed repeats after warm-up, timed with CUDA events, on random data (zeros run
faster on some cards):
- matmul: an n x n x n product (2 n^3 FLOPs) in bf16, in fp32 with TF32 off and with TF32 on;
- device memory: a device-to-device copy of 2 GiB, bytes read plus bytes written;
- host link: pinned host-to-device and device-to-host copies of 1 GiB (what ZeRO-Offload moves each step);
- ``plan_rates``: the tables ``rm.plan``'s step-time model reads (``rm.plan.constants.measure_rates`` run on the GPU, at
  a GPU's widths, micro-batch tokens, attention lengths and tensor sizes; each the best of its repeats): a
  projection's forward and backward by width and rows, masked SDPA forward and backward by call length,
  elementwise traffic by size, the fixed cost of an op and of a micro-batch, and dropout's draws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path


def timed(fn, repeats: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, each between two CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def matmul_flops(dtype, n: int = 8192, tf32: bool = False) -> float:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    seconds = timed(lambda: a @ b)
    torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * n**3 / seconds


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    import torch

    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src))


def host_bandwidth(nbytes: int = 1 << 30) -> dict:
    import torch

    host = torch.randn(nbytes // 4).pin_memory()
    device = torch.empty(nbytes // 4, device="cuda")
    return {"host_to_device_bytes_per_s": nbytes / timed(lambda: device.copy_(host, non_blocking=True), repeats=5),
            "device_to_host_bytes_per_s": nbytes / timed(lambda: host.copy_(device, non_blocking=True), repeats=5)}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_constants.py measures a CUDA GPU; none is visible")
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                            text=True).stdout.strip()
    figures = {
        "gpu": torch.cuda.get_device_name(0), "driver": driver, "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"), "capacity_bytes": torch.cuda.mem_get_info(0)[1],
        "bf16_matmul_flops": matmul_flops(torch.bfloat16),
        "fp32_matmul_flops": matmul_flops(torch.float32),
        "tf32_matmul_flops": matmul_flops(torch.float32, tf32=True),
        "device_memory_bytes_per_s": copy_bandwidth(),
        **host_bandwidth(),
    }
    from rm.plan.constants import measure_rates

    figures["plan_rates"] = measure_rates("cuda", widths=(1024, 2048, 4096), tokens=(1024, 4096, 16384),
                                        lengths=(128, 256, 512, 1024, 2048), elementwise_mib=(16, 64, 256, 1024))
    for key, value in figures.items():
        if key == "plan_rates":
            print(json.dumps(value))
            continue
        shown = f"{value / 1e12:.1f} T" if key.endswith("flops") else f"{value / 1e9:.0f} G" if key.endswith("per_s") else value
        print(f"{key:30} {shown}")
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
