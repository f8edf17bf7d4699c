"""Detect the devices a run will use (``hardware=auto``)."""

from __future__ import annotations

import dataclasses
import math
import os

from rm.foundations.config import HardwareConfig

GIB = 1024**3
# The rates rm.plan's step-time model needs that a CUDA profile must state (rm.plan.constants.rates_for), and what
# hardware=auto takes from the profile of the card it detects (with_card_rates): those and the two a profile may.
PROFILE_KEYS = ("peak_bf16_tflops", "peak_fp32_tflops", "memory_gbps", "link_gbps", "host_link_gbps",
                "host_memory_gbps")
CARD_RATE_KEYS = (*PROFILE_KEYS, "inter_node_gbps", "kernel_us")
# The attention kernels that skip fully masked blocks (varlen or block-sparse); the others compute the square under a mask.
MASK_SKIPPING = ("flash_attention_2", "flex_attention")


def attention_kernel(attn_implementation: str, device: str = "cpu", numerics=None, quantized: bool = False,
                     head_dim: int = 128) -> str:
    """How the attention of a masked row is computed: ``skips`` (masked blocks skipped), ``segments`` (a packed row's
    SDPA one sequence or pair at a time: ``rm.modelling.attention``), ``varlen`` (the same sequences in ONE varlen
    flash call a layer, which skips the blocks between them) or ``square`` (the whole row: eager attention).

    The one place that says where a packed row takes the varlen call, for the step-time model (``rm.plan.steptime``:
    one call a layer, the skipped-block sum) and the memory estimate (``rm.memory.trace``: the trace runs the varlen
    call and keeps its saved tensors): given the run's ``device`` and ``numerics`` (:class:`rm.foundations.precision.Numerics`),
    SDPA on ``cuda`` whose attention runs in half precision, which is :func:`rm.modelling.attention.takes_varlen`'s
    rule as the plan can know it: under autocast (``bf16-mixed``, ``16-mixed``) always; without it (``bf16-true``)
    where the compute dtype is half and the base is not 4-bit (``quantized``: bitsandbytes' 4-bit linears compute in
    their input's dtype, fp32 after the fp32 norms QLoRA's preparation leaves, so the query is fp32 and the loop runs).
    A CUDA profile is taken to be a GPU flash-attention runs on (compute capability 8.x or 9.x, as every named CUDA
    profile here is; ``gpu_64g`` names no card); attention dropout (none in the models rm trains) is not read. Without
    ``numerics`` (the kernel class of an implementation, :mod:`rm.plan.features`), never ``varlen``; nor for a
    ``head_dim`` flash has no kernel for (:func:`flash_head_dim`, the runtime's rule too).
    The varlen path is unmeasured on a GPU (docs/gpu.md): its step time and memory are modelled, not calibrated.

    >>> attention_kernel("sdpa"), attention_kernel("flex_attention"), attention_kernel("eager")
    ('segments', 'skips', 'square')
    >>> from rm.foundations.precision import Precision
    >>> bf16 = Precision.of("bf16-mixed").numerics(deepspeed=False)
    >>> attention_kernel("sdpa", "cuda", bf16), attention_kernel("sdpa", "cpu", bf16), attention_kernel("eager", "cuda", bf16)
    ('varlen', 'segments', 'square')
    >>> attention_kernel("sdpa", "cuda", Precision.of("32-true").numerics(deepspeed=False))
    'segments'
    >>> true = Precision.of("bf16-true").numerics(deepspeed=False)
    >>> attention_kernel("sdpa", "cuda", true), attention_kernel("sdpa", "cuda", true, quantized=True)
    ('varlen', 'segments')
    >>> attention_kernel("sdpa", "cuda", bf16, head_dim=100)
    'segments'
    """
    if attn_implementation in MASK_SKIPPING:
        return "skips"
    if attn_implementation != "sdpa":
        return "square"
    if device == "cuda" and numerics is not None and half_attention(numerics, quantized) and flash_head_dim(head_dim):
        return "varlen"
    return "segments"


def run_attention_kernel(cfg, plan) -> str:
    """:func:`attention_kernel` of a validated run (``rm.foundations.config.RunConfig`` and its
    ``rm.settings.validate.Plan``): its model's implementation on the plan's device, in the plan's numerics."""
    m = cfg.model
    return attention_kernel(m.attn_implementation, plan.device, plan.numerics, cfg.memory_profile.quantize_base != "none",
                            m.head_dim or m.hidden_size // m.num_attention_heads)


def flash_head_dim(head_dim: int) -> bool:
    """Whether torch's flash kernels (the varlen call's) take this head size: a multiple of 8, at most 256."""
    return head_dim % 8 == 0 and head_dim <= 256


def half_attention(numerics, quantized: bool = False) -> bool:
    """Whether attention computes in fp16 or bf16 under ``numerics`` (:func:`attention_kernel`)."""
    if numerics.autocast is not None:
        return numerics.autocast in HALF
    return numerics.compute in HALF and not quantized


HALF = ("bfloat16", "float16")


def host_ram_gib() -> float:
    """Physical RAM of this node in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def resolve_hardware(hw: HardwareConfig) -> HardwareConfig:
    """Return ``hw`` unchanged, or for ``accelerator: auto`` the detected machine.

    With several GPUs the smallest one's memory is used, since the run must fit
    on every device.
    """
    if hw.accelerator != "auto":
        return _with_detected_ram(hw)
    import torch  # here: only detection needs it, and `--help` should not load it

    ram = round(host_ram_gib(), 1)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        # The capacity the runtime reports (what an out-of-memory message calls "total capacity").
        smallest = min(torch.cuda.mem_get_info(i)[1] for i in range(count))
        names = {torch.cuda.get_device_name(i) for i in range(count)}
        detected = dataclasses.replace(
            hw,
            name=f"auto:{torch.cuda.get_device_name(0)}",
            accelerator="cuda",
            device_memory_gib=math.floor(100 * smallest / GIB) / 100,  # rounded down: never more than there is
            bf16=torch.cuda.is_bf16_supported(),
            gpus_per_node=count,
            host_ram_gib=int(ram),
        )
        return with_card_rates(detected, names.pop()) if len(names) == 1 else detected
    return dataclasses.replace(
        hw, name="auto:cpu", accelerator="cpu", device_memory_gib=ram, bf16=False, gpus_per_node=1, host_ram_gib=int(ram)
    )


def _with_detected_ram(hw: HardwareConfig) -> HardwareConfig:
    """A named profile's memory left null, detected: a CPU profile's device memory and any profile's host RAM are
    this machine's (``hardware=cpu`` on a 24 GiB machine is 24 GiB, not a fixed 16). A card's memory is never
    guessed from the host: a CUDA profile must state it (or use ``hardware=auto``).

    Raises:
        ConfigError: a CUDA profile with ``hardware.device_memory_gib=null``.
    """
    if hw.device_memory_gib is not None and hw.host_ram_gib is not None:
        return hw
    if hw.device_memory_gib is None and hw.accelerator != "cpu":
        from rm.foundations.errors import ConfigError

        raise ConfigError(f"hardware.device_memory_gib=null with hardware={hw.name} (accelerator {hw.accelerator}): only a "
                          "CPU's memory is detected from the machine; give the card's GiB, or use hardware=auto")
    ram = round(host_ram_gib(), 1)
    return dataclasses.replace(hw, device_memory_gib=ram if hw.device_memory_gib is None else hw.device_memory_gib,
                               host_ram_gib=int(ram) if hw.host_ram_gib is None else hw.host_ram_gib)


def card_profile(device_name: str):
    """The named hardware profile (``conf/hardware/*.yaml``) that lists ``device_name`` in its ``device_names``, as
    ``(name, its YAML as a dict)``; None for a card no profile names."""
    from omegaconf import OmegaConf

    from rm.foundations.config import CONF_DIR

    for path in sorted((CONF_DIR / "hardware").glob("*.yaml")):
        raw = OmegaConf.to_container(OmegaConf.load(path))
        if device_name in (raw.get("device_names") or []):
            return path.stem, raw
    return None


def with_card_rates(hw: HardwareConfig, device_name: str) -> HardwareConfig:
    """``hw`` with the rates of the profile that names its card, where ``hw`` gives none: ``hardware=auto`` on an
    H100 prices ``rm.plan``'s step times (and ``train.layout=auto``'s choice) as ``hardware=h100_80g`` does, and
    keeps its own detected memory, count and bf16. A rate given on the command line stays. A card no profile
    names keeps none: ``rm.plan`` then asks for them by name."""
    found = card_profile(device_name)
    if found is None:
        return hw
    profile, raw = found
    rates = {key: raw[key] for key in CARD_RATE_KEYS if getattr(hw, key) is None and raw.get(key) is not None}
    if not rates:
        return hw
    source = hw.rates_source or (f"{raw.get('rates_source', '')} (hardware={profile}'s rates, for the {device_name} "
                                 "detected)")
    return dataclasses.replace(hw, **rates, rates_source=source)
