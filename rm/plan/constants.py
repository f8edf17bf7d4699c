"""The hardware's rates for the step-time model: a CUDA profile's datasheet figures, or a CPU's measured ones.

A CPU reaches a fraction of its peak that depends on the size of the product and on the op, so its rates are
measured on it (:func:`measure_rates`, a few seconds): matmul FLOP/s (a projection's forward and backward) in fp32
and bf16 at three widths a reward
model's projections have and three micro-batch sizes (the rate of a model's width and micro-batch is interpolated
between them), the attention
kernel's FLOP/s (SDPA with a mask, as the padded, packed and prefix-shared layouts call it, forward and backward, per
length of one call), memory bandwidth
(a large copy), an elementwise op's by the size of the tensor it writes, LoRA dropout's random draws, and the fixed costs of a real decoder's ops and of a micro-batch
through autograd, forward and backward. Each figure is the best of a
few repeats: other jobs on the machine only slow a repeat down. The result is cached per machine, keyed by the
CPU model, the core count, torch's version and threads, under ``$RM_CACHE/speed`` (default ``~/.cache/rm``), with
when it was measured, the load average then and the host (:func:`measurement_note`, printed with every prediction
made from it). A busy machine still measures slow rates for good: where a run's measured step time and the
prediction differ more than :data:`DISAGREEMENT` times, the entry is removed (:func:`check_prediction`) and the next
plan measures again.

A CUDA profile's figures are its card's datasheet peaks (``conf/hardware/*.yaml`` names the source of each),
not achieved rates: until ``benchmarks/gpu_constants.py`` measures a card, its predictions are optimistic in
absolute terms; rankings between layouts lean on the ratios, which are the datasheet's.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional

from rm.foundations.config import HardwareConfig
from rm.foundations.errors import ConfigError
from rm.foundations.hardware import PROFILE_KEYS
from rm.plan.steptime import Rates

GB = 1e9
# Bumped when what is measured changes: older cache entries are then measured again.
BENCHMARK_VERSION = 6
WIDTHS = (128, 512, 1024)  # matmul widths measured on a CPU: tiny models to 1B-class hidden sizes
# Rows of each measured product: a micro-batch's tokens. A product's rate on a CPU grows with its rows as well as its
# width (measured: width 256 reached ~35 GFLOP/s at 512 rows and ~100 in training micro-batches of ~8,000 tokens).
TOKENS = (256, 1024, 4096)
ATTENTION_LENGTHS = (64, 128, 256, 512)  # tokens of one attention call measured on a CPU
ELEMENTWISE_MIB = (1, 4, 16, 64)  # sizes of the tensor an elementwise op writes, measured on a CPU


# The longest one timed call of measure_rates may take. Where a CPU lacks native bf16 (a 2-core EPYC VM without
# avx512_bf16 ran bf16 matmuls about 100x slower than fp32), the largest products took minutes each and measuring
# the rates over 5 minutes; on that CPU the rate no longer grows with the product's size, so the last one measured
# stands in for the larger ones. On CPUs with bf16 and on GPUs every listed shape runs within it (the largest, fp32 at
# width 1,024 and 4,096 rows, took 1.1 s on a 2-core EPYC with avx512_bf16).
CALL_BUDGET_S = 3.0

# A run's measured step time this many times off the prediction (either way) drops the CPU rates it came from.
DISAGREEMENT = 2.0


def cache_dir() -> Path:
    """Where measured rates are kept: ``$RM_CACHE/speed``, else ``~/.cache/rm/speed``."""
    root = os.environ.get("RM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rm")
    return Path(root) / "speed"


def machine_key() -> str:
    """The machine's CPU model, cores, torch version and threads: what the measured rates depend on."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    safe = "".join(ch if ch.isalnum() else "-" for ch in model).strip("-")
    return f"{safe}_{os.cpu_count()}cores_torch{torch.__version__}_{torch.get_num_threads()}threads_v{BENCHMARK_VERSION}"


def _best(fn, seconds: float = 0.015, repeats: int = 3, sync=None) -> float:
    """The fastest of ``repeats`` timings of ``fn``, each looping for about ``seconds``; ``sync`` waits for queued
    work (a GPU's kernels run after the call that launches them returns)."""
    sync = sync or (lambda: None)
    fn()  # warm-up: first-call allocations and kernel selection
    sync()
    best = float("inf")
    for _ in range(repeats):
        start, calls = time.perf_counter(), 0
        while True:
            fn()
            calls += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        best = min(best, elapsed / calls)
    return best


def measure_rates(device: str = "cpu", widths=WIDTHS, tokens=TOKENS, lengths=ATTENTION_LENGTHS,
                  elementwise_mib=ELEMENTWISE_MIB, call_budget_s: float = CALL_BUDGET_S) -> Dict:
    """Measure this CPU's rates (the figures :func:`cpu_rates` caches), or with ``device="cuda"`` a GPU's by the
    same micro-benchmarks (``benchmarks/gpu_constants.py`` records them, at a GPU's widths and sizes).

    Returns:
        ``{"matmul": {dtype: [[width, rows, FLOP/s], ...]}, "attention": {dtype: [[width, length, FLOP/s], ...]}, "memory":
        bytes/s, "elementwise": [[bytes, bytes/s], ...], "kernel_seconds": s, "micro_batch_seconds": s, "dropout":
        elements/s}``. A product or attention call the rate measured so far says would take longer than
        ``call_budget_s`` is not run: it gets the rate of the last shape of that op and dtype measured (see
        :data:`CALL_BUDGET_S`).
    """
    import functools

    import torch

    from rm.modelling.attention import sdpa_kernels

    sync = torch.cuda.synchronize if device == "cuda" else None
    _timed = functools.partial(_best, sync=sync)
    last_rate: Dict = {}

    def rate(fn, flops: float, op, **timing) -> float:
        # Shapes are measured small to large: the op's last rate predicts this call's seconds before it runs.
        if op in last_rate and flops / last_rate[op] > call_budget_s:
            return last_rate[op]
        last_rate[op] = flops / _timed(fn, **timing)
        return last_rate[op]

    out: Dict = {"matmul": {}, "attention": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        table = []
        for width in widths:
            # A projection up to the MLP's width, forward and backward as training runs it: the input's and the
            # weight's gradients are products of other shapes, slower than the forward's on small widths
            # (measured: 128 -> 64 at 2,048 rows, 210 GFLOP/s forward, 138 forward and backward).
            w = torch.randn(4 * width, width, dtype=dtype, device=device, requires_grad=True)
            for rows in tokens:
                x = torch.randn(rows, width, dtype=dtype, device=device, requires_grad=True)
                grad = torch.ones(rows, 4 * width, dtype=dtype, device=device)

                def linear():
                    torch.nn.functional.linear(x, w).backward(grad)
                    x.grad = w.grad = None

                table.append([width, rows, rate(linear, 6 * rows * width * 4 * width, ("matmul", dtype), repeats=2)])
        out["matmul"][name] = table
        # SDPA with a boolean mask over 8 heads of 64, forward and backward (4 x 8 x 64 x L^2 FLOPs forward, twice
        # that backward), at the lengths one call computes: a padded row, a packed row's sequence or a shared pair.
        # Short calls run far below long ones (measured: 35-50 GFLOP/s at 64 tokens, 85 at 128, 110 at 256-512).
        # Under the kernels rm's attention allows (on a GPU not cuDNN's, rm.modelling.attention.sdpa_kernels).
        heads, dim = 8, 64
        table = []
        for length in lengths:
            q, k, v = (torch.randn(1, heads, length, dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
            mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
            grad = torch.ones(1, heads, length, dim, dtype=dtype, device=device)

            def attention():
                with sdpa_kernels(q.device):
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).backward(grad)
                q.grad = k.grad = v.grad = None

            table.append([heads * dim, length, rate(attention, 3 * 4 * heads * dim * length * length, ("attention", dtype))])
        out["attention"][name] = table
    # 16 MiB: beyond the caches of a small CPU, not of every one (a 2-core EPYC VM's L3 held it: 93-137 GB/s, where
    # 64 MiB and more copied at 32); what the optimizer step and the CPU's link are priced at
    src = torch.randn((16 if device == "cpu" else 1024) * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    out["memory"] = 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src))
    # An elementwise op as autograd runs it, writing a fresh output, by size: once a tensor outgrows the caches its
    # output's fresh pages are faulted in (measured on a 2-core EPYC: 36-38 GB/s at 4-16 MiB, 6-7 at 64-256 MiB,
    # where a copy into a reused buffer ran at 32-180).
    out["elementwise"] = []
    for mib in elementwise_mib:
        x = torch.randn(mib * 2**20 // 4, device=device)
        out["elementwise"].append([x.numel() * 4, 2 * x.numel() * 4 / _timed(lambda: torch.nn.functional.silu(x))])
    out.update(_fixed_costs(device, sync))
    # LoRA's dropout draws a random number an input element (PEFT drops each adapted linear's input): on a CPU the
    # draw, not the traffic, is the cost (measured: a quarter of a medium LoRA step with dropout 0.05).
    x = torch.randn(2**20, device=device)
    out["dropout"] = x.numel() / _timed(lambda: torch.nn.functional.dropout(x, 0.05, training=True))
    return out


def _fixed_costs(device: str = "cpu", sync=None) -> Dict[str, float]:
    """The fixed costs of a forward and backward, read off a real decoder: transformers' Llama (the layer Mistral's
    and Qwen2's share) at a width and input so small that its matmuls cost nothing, with one and three layers. A
    layer's fixed cost over the ops :func:`rm.plan.steptime.model_work` counts in it (forward, and a backward as
    two forwards) gives the cost of one op; what one layer leaves over is a micro-batch's own (embedding, final
    norm, head, the loss and autograd's setup). A chain of toy ops measured under half of it a layer.
    """
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rm.plan.steptime import LAYER_KERNELS

    seconds = {}
    for layers in (1, 3):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, pad_token_id=0, num_labels=1)).to(device)
        ids = torch.randint(1, 128, (4, 8), device=device)
        mask = torch.ones_like(ids)

        def step():
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()

        seconds[layers] = _best(step, seconds=0.1, sync=sync)
    layer = max(seconds[3] - seconds[1], 0.0) / 2
    return {"kernel_seconds": layer / (3 * LAYER_KERNELS), "micro_batch_seconds": max(seconds[1] - layer, 0.0)}


RATES_LOCK_WAIT_S = 1800  # how long a process waits for another's measurement of the CPU rates


def cpu_rates(refresh: bool = False) -> Dict:
    """This machine's measured rates, from the cache or measured now and cached."""
    from filelock import FileLock, Timeout

    path = rates_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The ranks of one run measure once and read the same figures: train.layout=auto must choose alike on each.
        # The others wait as long as a measurement takes on a busy machine (over 4 minutes on 2 shared cores, where
        # 120 s let the second rank time out and measure beside the first, both slower and both under the other's
        # load); the lock is the kernel's, released if its holder dies.
        lock = FileLock(str(path) + ".lock", timeout=RATES_LOCK_WAIT_S)
        lock.acquire()
    except (OSError, Timeout):
        lock = None  # a read-only cache: measured here, again next time
    try:
        if not refresh:
            try:
                return json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        measured = measure_rates()
        measured.update(measured_at=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=load,
                        cores=os.cpu_count(), machine=platform.node())
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(measured, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
        return measured
    finally:
        if lock is not None:
            lock.release()


def rates_path() -> Path:
    """This machine's cache entry of measured CPU rates."""
    return cache_dir() / f"{machine_key()}.json"


def measurement_note(measured: Dict) -> str:
    """When, at what load and where CPU rates were measured, in words.

        >>> measurement_note({"measured_at": "2026-11-29 06:40 UTC", "load_average": 1.37, "cores": 2, "machine": "h"})
        'measured 2026-11-29 06:40 UTC at load 1.37 on 2 cores (h)'
    """
    if "measured_at" not in measured:
        return f"cached before rm recorded when and at what load (remove {rates_path()} to measure again)"
    load = measured.get("load_average")
    return (f"measured {measured['measured_at']} at load {'unknown' if load is None else f'{load:.2f}'} on "
            f"{measured.get('cores')} cores ({measured.get('machine')})")


def check_prediction(predicted_s: Optional[float], measured_s: float, rates: Rates) -> Optional[str]:
    """Where a run's measured seconds a step and the prediction from this machine's cached CPU rates differ more than
    :data:`DISAGREEMENT` times either way (rates measured while other jobs ran, or on an idle machine now busy):
    the cache entry is removed so that the next plan measures again, and the message says so. None where they
    agree, or the rates are not a CPU measurement.

        >>> check_prediction(1.0, 1.5, Rates({}, {}, 1, 1, 1, 1, 1, measured="")) is None
        True
    """
    if not rates.measured or not predicted_s or not measured_s:
        return None
    ratio = measured_s / predicted_s
    if 1 / DISAGREEMENT <= ratio <= DISAGREEMENT:
        return None
    path = rates_path()
    try:
        path.unlink()
        what = f"{path} is removed: the next rm.plan or train.layout=auto measures them again"
    except FileNotFoundError:
        what = "they were removed already: the next rm.plan or train.layout=auto measures them again"
    except OSError as err:
        what = f"{path} could not be removed ({err}); remove it to measure them again"
    return (f"step time measured {measured_s:.3g} s against {predicted_s:.3g} predicted ({ratio:.2f}x): the CPU rates "
            f"of the prediction ({rates.measured}) do not hold for this run; {what}")


def _given(hw: HardwareConfig) -> Dict[str, Optional[float]]:
    return {key: getattr(hw, key) for key in PROFILE_KEYS}


def rates_for(hw: HardwareConfig, device: str) -> Rates:
    """The rates a run's hardware profile gives (``hw`` resolved: ``hardware=auto`` detected).

    A CPU measures what its profile leaves null; a CUDA profile must state every rate.

    Raises:
        ConfigError: a CUDA profile without a rate, naming each missing key.
    """
    given = _given(hw)
    if device == "cpu":
        measured = cpu_rates()
        note = measurement_note(measured)
        memory = given["memory_gbps"] * GB if given["memory_gbps"] else measured["memory"]
        matmul = dict(measured["matmul"])
        for name, key in (("float32", "peak_fp32_tflops"), ("bfloat16", "peak_bf16_tflops")):
            if given[key]:
                matmul[name] = [[1, given[key] * 1e12]]
        # Processes on one machine talk through its memory (gloo over shared memory); the host is the device.
        link = given["link_gbps"] * GB if given["link_gbps"] else memory / 2
        return Rates(matmul=matmul, attention=measured["attention"], memory=memory, link=link,
                     inter_node=hw.inter_node_gbps * GB if hw.inter_node_gbps else link,
                     host_link=given["host_link_gbps"] * GB if given["host_link_gbps"] else memory,
                     host_memory=given["host_memory_gbps"] * GB if given["host_memory_gbps"] else memory,
                     kernel_seconds=hw.kernel_us * 1e-6 if hw.kernel_us is not None else measured["kernel_seconds"],
                     micro_batch_seconds=measured["micro_batch_seconds"], dropout=measured["dropout"],
                     elementwise=[] if given["memory_gbps"] else measured["elementwise"],
                     shared_cores=True, measured=note,
                     source=hw.rates_source or f"rm.plan's CPU micro-benchmark, {note}")
    missing = [f"hardware.{key}" for key, value in given.items() if not value]
    if missing:
        raise ConfigError(f"hardware={hw.name} states no {', '.join(missing)}: rm.plan needs the card's rates. Use a "
                          f"named profile (hardware=h100_80g, ...), or give them, e.g. hardware.peak_bf16_tflops=989.5 "
                          f"(benchmarks/gpu_constants.py measures them on the card)")
    peak = {"float32": [[1, given["peak_fp32_tflops"] * 1e12]], "bfloat16": [[1, given["peak_bf16_tflops"] * 1e12]]}
    link = given["link_gbps"] * GB
    return Rates(matmul=peak, attention=peak, memory=given["memory_gbps"] * GB, link=link,
                 inter_node=hw.inter_node_gbps * GB if hw.inter_node_gbps else link,
                 host_link=given["host_link_gbps"] * GB, host_memory=given["host_memory_gbps"] * GB,
                 kernel_seconds=(hw.kernel_us or 0.0) * 1e-6, source=hw.rates_source or f"hardware={hw.name} as given")


def describe(rates: Rates) -> List[str]:
    """The rates in words, for the table's header."""
    mm = ", ".join(f"{d} {max(entry[-1] for entry in t) / 1e12:.3g}" for d, t in rates.matmul.items())
    source = rates.source if not rates.measured or rates.measured in rates.source else f"{rates.source}, {rates.measured}"
    return [f"rates ({source}): matmul TFLOP/s {mm}; memory {rates.memory / GB:.3g} GB/s; "
            f"link {rates.link / GB:.3g} GB/s; host link {rates.host_link / GB:.3g} GB/s"
            + (f"; {rates.kernel_seconds * 1e6:.1f} us an op" if rates.kernel_seconds else "")
            + (f", {rates.micro_batch_seconds * 1e3:.2f} ms a micro-batch" if rates.micro_batch_seconds else "")]
