"""Detect the devices a run will use (``hardware=auto``)."""

from __future__ import annotations

import dataclasses
import math
import os

from rm.config import HardwareConfig

GIB = 1024**3
# The attention kernels that skip fully masked blocks (varlen or block-sparse); the others compute the square under a mask.
MASK_SKIPPING = ("flash_attention_2", "flex_attention")


def attention_kernel(attn_implementation: str) -> str:
    """How the attention of a masked row is computed: ``skips`` (masked blocks skipped), ``segments`` (a packed row's
    SDPA one sequence or pair at a time, on a CPU and a GPU alike: ``rm.attention``) or ``square`` (the whole row:
    eager attention). The step-time model and the memory estimate both follow it.

    >>> attention_kernel("sdpa"), attention_kernel("flex_attention"), attention_kernel("eager")
    ('segments', 'skips', 'square')
    """
    if attn_implementation in MASK_SKIPPING:
        return "skips"
    return "segments" if attn_implementation == "sdpa" else "square"


def host_ram_gib() -> float:
    """Physical RAM of this node in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def resolve_hardware(hw: HardwareConfig) -> HardwareConfig:
    """Return ``hw`` unchanged, or for ``accelerator: auto`` the detected machine.

    With several GPUs the smallest one's memory is used, since the run must fit
    on every device.
    """
    if hw.accelerator != "auto":
        return hw
    import torch  # here: only detection needs it, and `--help` should not load it

    ram = round(host_ram_gib(), 1)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        # The capacity the runtime reports (what an out-of-memory message calls "total capacity").
        smallest = min(torch.cuda.mem_get_info(i)[1] for i in range(count))
        return dataclasses.replace(
            hw,
            name=f"auto:{torch.cuda.get_device_name(0)}",
            accelerator="cuda",
            device_memory_gib=math.floor(100 * smallest / GIB) / 100,  # rounded down: never more than there is
            bf16=torch.cuda.is_bf16_supported(),
            gpus_per_node=count,
            host_ram_gib=int(ram),
        )
    return dataclasses.replace(
        hw, name="auto:cpu", accelerator="cpu", device_memory_gib=ram, bf16=False, gpus_per_node=1, host_ram_gib=int(ram)
    )
