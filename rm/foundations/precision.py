"""The training precisions, under Lightning's names, and where each tensor lives in each of them.

``train.precision`` is one of (``auto`` is resolved by ``rm.settings.validate``):

=============  ==============================  ===============  ==================  ========================
mode           trained weights (and grads)     compute          optimizer states    under DeepSpeed ZeRO
=============  ==============================  ===============  ==================  ========================
``32-true``    fp32                            fp32             fp32                the same (fp32 partitions)
``bf16-mixed`` fp32                            bf16 (autocast)  fp32                DeepSpeed's ``bf16``: bf16
                                                                                    module, fp32 master + states
``bf16-true``  bf16, updated in bf16           bf16             bf16                refused (see below)
``16-mixed``   fp32, gradient scaler           fp16 (autocast)  fp32                DeepSpeed's ``fp16``: fp16
                                                                                    module, fp32 master + states
=============  ==============================  ===============  ==================  ========================

``bf16-mixed`` and ``16-mixed`` keep an fp32 copy of every trained weight that the optimizer updates,
so no update is lost to rounding; one process and DDP (accelerate) hold it as the module's own weights
and compute under ``torch.autocast``, DeepSpeed as its fp32 partitions beside a bf16 module (what
transformers' Trainer does with ``--bf16`` and a DeepSpeed config). ``bf16-true`` adds an AdamW update to
a bf16 weight in bf16: an update below half a bf16 unit in the last place of the weight is rounded away
(:func:`bf16_lost_update_fraction`). DeepSpeed has no layout that updates the module's bf16 weights
directly (its bf16 mode is ``bf16-mixed``), so ``bf16-true`` with ZeRO is refused rather than silently
meaning something else.

Weights that do not train (a LoRA or QLoRA base) are stored in the compute dtype in every mode: they
are never updated, so nothing is lost, and storing them wider would only cost memory. LoRA adapters and
the trained copy of the reward head stay fp32 in every mode (PEFT's ``autocast_adapter_dtype``, and
``health.fp32_head``).

The legacy names ``bf16``, ``fp16`` and ``fp32`` (and Lightning's ``16``, ``32``) read as ``bf16-mixed``,
``16-mixed`` and ``32-true``, as Lightning reads them.

torch is imported only where a dtype is asked for: the estimator's ``--help`` and config errors need none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    import torch

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # the names logs and tables print
ALIASES = {"bf16": "bf16-mixed", "fp16": "16-mixed", "16": "16-mixed", "fp32": "32-true", "32": "32-true"}


@dataclass(frozen=True)
class Numerics:
    """The dtypes of one precision under one engine: what the model builder, the engine and the
    estimator read, so that no two of them can disagree. Hashable (the trace caches on it).

    Attributes:
        weights: dtype the module's trained weights, and so their gradients, are stored in.
        frozen: dtype of weights that never train (a LoRA base).
        compute: dtype matmuls run in.
        autocast: dtype ``torch.autocast`` computes in around the forward; ``None``: no autocast.
        states: dtype of the optimizer's moments.
        master: dtype of a separate copy of the trained weights that the optimizer updates (DeepSpeed's
            partitions); ``None``: the optimizer updates the module's own weights.
    """

    weights: str
    frozen: str
    compute: str
    autocast: Optional[str]
    states: str
    master: Optional[str]

    @property
    def weight_bytes(self) -> int:
        return BYTES[self.weights]

    @property
    def frozen_bytes(self) -> int:
        return BYTES[self.frozen]

    @property
    def state_bytes(self) -> int:
        return BYTES[self.states]

    def dtype(self, which: str) -> "torch.dtype":
        """The torch dtype of ``weights``, ``frozen``, ``compute`` or ``states``."""
        import torch

        return getattr(torch, getattr(self, which))


@dataclass(frozen=True)
class Precision:
    """One training precision (see the module docstring for the table).

    Attributes:
        name: ``train.precision``: ``32-true`` | ``bf16-mixed`` | ``bf16-true`` | ``16-mixed``.
        dtype_name: torch's name of the compute dtype; ``reward_probe.json`` records it.
        weight_dtype_name: the dtype the optimizer updates trained weights in (fp32 = a master copy).
        export_tolerance: allowed |reloaded - in-memory| reward per unit of (1 + |reward|) when
            ``rm.export`` verifies a bundle. The same weights reloaded in the same dtype give the same
            rewards to the last bit on a CPU; the slack is for what legitimately differs: a merged LoRA
            (W + BA rounded once, measured 2e-7 on the tiny model in fp32), autocast on the reload where
            DeepSpeed computed in bf16 without it, other kernels on another device. Half-precision
            tolerances are a few units of their rounding (bf16 eps 7.8e-3, fp16 9.8e-4) accumulated over
            the layers. A wrong tensor, head or pad position moves rewards by O(1).

    Example:
        >>> mixed = Precision.of("bf16-mixed")
        >>> mixed.numerics(deepspeed=False)
        Numerics(weights='float32', frozen='bfloat16', compute='bfloat16', autocast='bfloat16', states='float32', master=None)
        >>> mixed.numerics(deepspeed=True)
        Numerics(weights='bfloat16', frozen='bfloat16', compute='bfloat16', autocast=None, states='float32', master='float32')
        >>> mixed.accelerate, mixed.deepspeed_sections()
        ('bf16', {'bf16': {'enabled': True}, 'fp16': {'enabled': False}})
        >>> true = Precision.of("bf16-true")
        >>> true.numerics(deepspeed=False)
        Numerics(weights='bfloat16', frozen='bfloat16', compute='bfloat16', autocast=None, states='bfloat16', master=None)
        >>> true.accelerate, true.deepspeed_refusal is not None
        ('no', True)
        >>> Precision.of("32-true").numerics(deepspeed=True)
        Numerics(weights='float32', frozen='float32', compute='float32', autocast=None, states='float32', master='float32')
        >>> Precision.of("16-mixed").deepspeed_sections()
        {'bf16': {'enabled': False}, 'fp16': {'enabled': True}}
        >>> Precision.canonical("bf16"), Precision.canonical("fp32"), Precision.canonical("bf16-true")
        ('bf16-mixed', '32-true', 'bf16-true')
    """

    name: str
    dtype_name: str
    weight_dtype_name: str
    export_tolerance: float

    @classmethod
    def canonical(cls, name: str) -> str:
        """``name`` with a legacy alias (``bf16``, ``fp16``, ``fp32``, ``16``, ``32``) read as Lightning reads it."""
        return ALIASES.get(name, name)

    @classmethod
    def of(cls, name: str) -> "Precision":
        """The precision ``train.precision`` names (a legacy alias included).

        Raises:
            ValueError: ``name`` names no precision (``auto`` is resolved by ``rm.settings.validate``).
        """
        for precision in PRECISIONS:
            if precision.name == cls.canonical(name):
                return precision
        raise ValueError(f"precision {name!r}: expected one of {', '.join(p.name for p in PRECISIONS)}")

    @classmethod
    def of_dtype_name(cls, dtype_name: str) -> "Precision":
        """A precision that computes in ``dtype_name`` (``float32``, ...): what the export check needs (the
        tolerance follows the compute dtype alone).

        Raises:
            ValueError: no precision computes in it.
        """
        for precision in PRECISIONS:
            if precision.dtype_name == dtype_name:
                return precision
        raise ValueError(f"dtype {dtype_name!r}: expected one of {', '.join(sorted({p.dtype_name for p in PRECISIONS}))}")

    @property
    def dtype(self) -> "torch.dtype":
        """The compute dtype."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def half(self) -> bool:
        """Computes in a 16-bit dtype."""
        return self.dtype_name != "float32"

    @property
    def mixed(self) -> bool:
        """Keeps fp32 weights for the optimizer and computes in half precision."""
        return self.half and self.weight_dtype_name == "float32"

    @property
    def accelerate(self) -> str:
        """``Accelerator(mixed_precision=...)``: autocast for the mixed modes, nothing otherwise."""
        return {"bfloat16": "bf16", "float16": "fp16"}[self.dtype_name] if self.mixed else "no"

    @property
    def deepspeed_refusal(self) -> Optional[str]:
        """Why DeepSpeed cannot train this mode, or ``None``."""
        if self.half and not self.mixed:
            return ("DeepSpeed's bf16 mode keeps fp32 master weights and fp32 optimizer states (that is bf16-mixed); "
                    "ZeRO has no layout that updates bf16 weights in bf16")
        return None

    def numerics(self, deepspeed: bool) -> Numerics:
        """The dtypes of this mode under DeepSpeed ZeRO (``deepspeed``) or accelerate (one process, DDP)."""
        if deepspeed:  # DeepSpeed casts the module to its section's dtype and keeps fp32 partitions
            return Numerics(weights=self.dtype_name, frozen=self.dtype_name, compute=self.dtype_name, autocast=None,
                            states="float32", master="float32")
        return Numerics(weights=self.weight_dtype_name, frozen=self.dtype_name, compute=self.dtype_name,
                        autocast=self.dtype_name if self.mixed else None, states=self.weight_dtype_name, master=None)

    def deepspeed_sections(self) -> Dict[str, Dict[str, bool]]:
        """DeepSpeed's ``bf16`` and ``fp16`` sections, each stated, the one of this mode's compute dtype enabled."""
        return {"bf16": {"enabled": self.half and self.dtype_name == "bfloat16"},
                "fp16": {"enabled": self.half and self.dtype_name == "float16"}}


PRECISIONS = (
    Precision("32-true", "float32", "float32", 1e-4),
    Precision("bf16-mixed", "bfloat16", "float32", 5e-2),
    Precision("bf16-true", "bfloat16", "bfloat16", 5e-2),
    Precision("16-mixed", "float16", "float32", 1e-2),
)
NAMES = tuple(p.name for p in PRECISIONS)


def bf16_lost_update_fraction(learning_rate: float, weight_std: float) -> float:
    """The share of N(0, ``weight_std``) bf16 weights that an update of size ``learning_rate`` leaves unchanged.

    AdamW's first update of every weight is ``learning_rate`` in size (its moments normalise the gradient to
    +-1), later ones at most about that. bf16 keeps 8 significant bits: a weight in [2^e, 2^(e+1)) is spaced
    2^(e-7) from its neighbours, and an update below half of that, 2^(e-8), rounds back to the same weight.
    So every weight of magnitude at least 2^k is lost, k the smallest integer with 2^(k-8) > lr.

    Example: at lr 1e-5, k = -8: |w| >= 2^-8 = 0.0039, about 0.2 standard deviations of N(0, 0.02): 85% are
    lost, which matches the 15% changed after 10 steps measured on a 1024 x 1024 weight. At 1e-4, 12%.
        >>> round(bf16_lost_update_fraction(1e-5, 0.02), 2), round(bf16_lost_update_fraction(1e-4, 0.02), 2)
        (0.85, 0.12)
    """
    k = math.floor(math.log2(learning_rate)) + 9
    return math.erfc(2.0**k / (weight_std * math.sqrt(2)))


def fp32_head_enabled(setting: Optional[bool], precision: str) -> bool:
    """``health.fp32_head``: null (auto) means on where the run computes in fp16/bf16, where it matters.

    >>> fp32_head_enabled(None, "bf16-mixed"), fp32_head_enabled(None, "32-true"), fp32_head_enabled(False, "bf16-true")
    (True, False, False)
    """
    return Precision.of(precision).half if setting is None else setting
