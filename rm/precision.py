"""The three training precisions, and what each library calls them.

``train.precision``, once ``rm.validate`` has resolved ``auto``, is ``bf16``, ``fp16`` or ``fp32``.
The model builder needs a torch dtype, the estimator bytes per element, accelerate its
``mixed_precision`` name, DeepSpeed a config section and the export check a tolerance; they are one
row each here, so that no two tables can disagree about a precision.

torch is imported only where a dtype is asked for: the estimator's ``--help`` and config errors need none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Precision:
    """One training precision.

    Attributes:
        name: ``train.precision``: ``bf16`` | ``fp16`` | ``fp32``.
        dtype_name: torch's name of the compute dtype; ``reward_probe.json`` records it.
        bytes: bytes per element of the compute dtype.
        accelerate: ``Accelerator(mixed_precision=...)``.
        deepspeed_key: the DeepSpeed config section that enables it; ``None``: fp32, DeepSpeed's default.
        weight_dtype_name: the dtype weights are stored in. bf16 runs train bf16 weights directly (what TRL
            users do with bf16 models); fp16 needs fp32 master weights under autocast, or the gradient
            scaler cannot unscale fp16 gradients.
        export_tolerance: allowed |reloaded - in-memory| reward per unit of (1 + |reward|) when
            ``rm.export`` verifies a bundle. The same weights reloaded in the same dtype give the same
            rewards to the last bit on a CPU; the slack is for what legitimately differs: a merged LoRA
            (W + BA rounded once, measured 2e-7 on the tiny model in fp32), autocast on the reload where
            DeepSpeed computed in bf16 without it, other kernels on another device. Half-precision
            tolerances are a few units of their rounding (bf16 eps 7.8e-3, fp16 9.8e-4) accumulated over
            the layers. A wrong tensor, head or pad position moves rewards by O(1).

    Example:
        >>> bf16 = Precision.of("bf16")
        >>> bf16.dtype, bf16.bytes, bf16.accelerate, bf16.weight_dtype, bf16.weight_bytes, bf16.export_tolerance
        (torch.bfloat16, 2, 'bf16', torch.bfloat16, 2, 0.05)
        >>> bf16.deepspeed_sections()
        {'bf16': {'enabled': True}, 'fp16': {'enabled': False}}
        >>> fp16 = Precision.of("fp16")
        >>> fp16.dtype, fp16.bytes, fp16.accelerate, fp16.weight_dtype, fp16.weight_bytes, fp16.export_tolerance
        (torch.float16, 2, 'fp16', torch.float32, 4, 0.01)
        >>> fp32 = Precision.of("fp32")
        >>> fp32.dtype, fp32.bytes, fp32.accelerate, fp32.weight_bytes, fp32.export_tolerance
        (torch.float32, 4, 'no', 4, 0.0001)
        >>> fp32.deepspeed_sections()
        {'bf16': {'enabled': False}, 'fp16': {'enabled': False}}
        >>> Precision.of_dtype_name("bfloat16") is bf16
        True
    """

    name: str
    dtype_name: str
    bytes: int
    accelerate: str
    deepspeed_key: Optional[str]
    weight_dtype_name: str
    export_tolerance: float

    @classmethod
    def of(cls, name: str) -> "Precision":
        """The precision ``train.precision`` names.

        Raises:
            ValueError: ``name`` is none of ``bf16``, ``fp16``, ``fp32`` (``auto`` is resolved by ``rm.validate``).
        """
        for precision in PRECISIONS:
            if precision.name == name:
                return precision
        raise ValueError(f"precision {name!r}: expected one of {', '.join(p.name for p in PRECISIONS)}")

    @classmethod
    def of_dtype_name(cls, dtype_name: str) -> "Precision":
        """The precision whose compute dtype torch calls ``dtype_name`` (``float32``, ...).

        Raises:
            ValueError: no precision computes in it.
        """
        for precision in PRECISIONS:
            if precision.dtype_name == dtype_name:
                return precision
        raise ValueError(f"dtype {dtype_name!r}: expected one of {', '.join(p.dtype_name for p in PRECISIONS)}")

    @property
    def dtype(self) -> "torch.dtype":
        """The compute dtype."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def weight_dtype(self) -> "torch.dtype":
        """The dtype weights are stored in."""
        import torch

        return getattr(torch, self.weight_dtype_name)

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the stored weights."""
        return Precision.of_dtype_name(self.weight_dtype_name).bytes

    def deepspeed_sections(self) -> Dict[str, Dict[str, bool]]:
        """DeepSpeed's ``bf16`` and ``fp16`` sections, each stated, the one of this precision enabled."""
        return {p.deepspeed_key: {"enabled": p == self} for p in PRECISIONS if p.deepspeed_key is not None}


PRECISIONS = (
    Precision("bf16", "bfloat16", 2, "bf16", "bf16", "bfloat16", 5e-2),
    Precision("fp16", "float16", 2, "fp16", "fp16", "float32", 1e-2),
    Precision("fp32", "float32", 4, "no", None, "float32", 1e-4),
)
