"""The pre-flight memory estimate: what one device will hold at the peak of a training step.

Weights, gradients and optimizer states are arithmetic on exact parameter counts
(from the model's shape numbers; no weights are read), one small function per term
(:func:`weight_bytes`, :func:`deepspeed_terms`, :func:`host_bytes`, :func:`device_terms`, ...),
each naming the library code it models. Activations come from tracing the run's own
model with fake tensors (:mod:`rm.memory.trace`). Terms not yet calibrated on a GPU
(the CUDA context) or at all (DeepSpeed ZeRO-3 buffers) are reported as such.
Which changes would fit a refused run is :mod:`rm.memory.suggest`'s; the table for people is
:mod:`rm.memory.report`'s; the command line (``python -m rm.estimate``) is :mod:`rm.estimate`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from rm.foundations.config import (CheckpointConfig, DataConfig, HealthConfig, LoraConfig, MemoryProfileConfig, ModelConfig,
                                   OptimConfig, RunConfig, TrainConfig)
from rm.foundations.hardware import attention_kernel

if TYPE_CHECKING:  # imported where used: `--help` and config errors need no torch
    from rm.data.shapes import BatchShapes
    from rm.memory.trace import TracedModel
    from rm.settings.validate import Plan

GIB = 1024**3
MIB = 1024**2
# Device-level terms that only a GPU shows, measured on one H100 80GB HBM3 (driver 580.159.04, torch 2.11.0+cu130,
# 2026-11-26; benchmarks/results/memory_calibration_gpu.md) where a number is given:
# - the CUDA context (what the device holds beyond the allocator's reserve, in one process without NCCL): 769 MiB
#   (806,158,336 bytes) in 4 runs of 3 profiles and 2 shapes, 767 MiB in a fifth, 787 MiB with bitsandbytes' 4-bit
#   base. Kept at a 1 GiB bound: older drivers and CUDA versions load more eagerly, and this is one machine.
CUDA_CONTEXT_BYTES = 1 * GIB
# - a process that joins an NCCL group (DeepSpeed always does, one process too; DDP with several): 984 MiB more,
#   outside the allocator, measured under DeepSpeed ZeRO-2 in one process. More peers add channel buffers: with
#   several processes it is a floor, not a measurement.
NCCL_PROCESS_GROUP_BYTES = 984 * MIB
# PyTorch's caching allocator rounds blocks up (512 B; large segments to 2 MiB) and keeps freed blocks reserved:
# max_memory_reserved exceeds max_memory_allocated by the fragmentation of the step's short-lived tensors. No closed
# form exists; the term is a bound read off measured runs (benchmarks/results/memory_calibration_gpu.md), not a measurement of
# any other card. Where the backward creates full-size parameter gradients while it frees activations (full, 8bit,
# offload) the reserve beyond the peak was 17-28% of the activations and temporaries without checkpointing (5 runs
# on an H100, one 7B run on an H200: 26%): bounded at 30%. With gradient checkpointing the backward also recomputes
# each layer (and re-casts its weights under autocast) between the gradients it makes: 40% and 41% on an H200 (a 7B
# and a 1.1B shape, 2026-11-27, points the 30% bound missed by 0.9% and 0.8% of the device total): bounded at 45%.
# Under LoRA it was 2-5% without checkpointing (3 runs on an H100): 10%; with it 15% (7B LoRA r16) and 6.5% (7B
# QLoRA) on an H200: 20%.
ALLOCATOR_FRAGMENTATION = 0.10
ALLOCATOR_FRAGMENTATION_CHECKPOINTED = 0.20
ALLOCATOR_FRAGMENTATION_FULL_GRADIENTS = 0.30
ALLOCATOR_FRAGMENTATION_FULL_GRADIENTS_CHECKPOINTED = 0.45
ALLOCATOR_SMALL_SEGMENTS = 20 * MIB
# A share of the device kept free by default (hardware.headroom_gib=null): the bound the calibration
# holds every point to on the low side (no estimate more than 2% under a measured peak).
DEFAULT_HEADROOM_FRACTION = 0.02
# DeepSpeed takes gradient norms in fp64 wherever the device has it (zero/utils.py, get_norm_dtype).
NORM_BYTES = 8


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter the training process holds (LoRA: base + adapters + head copy)
    trainable: int
    base: int  # the plain model
    trainable_tensors: List[int] = field(default_factory=list)  # numel of each trainable tensor
    tensors: List[int] = field(default_factory=list)  # numel of every parameter tensor (ZeRO-3 partitions each)


def _linear_shapes(m: ModelConfig) -> Dict[str, tuple]:
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    q, kv = m.num_attention_heads * head_dim, m.num_key_value_heads * head_dim
    bias = m.model_type == "qwen2"  # Qwen2 has biases on q/k/v
    h, i = m.hidden_size, m.intermediate_size
    return {
        "q_proj": (h, q, bias), "k_proj": (h, kv, bias), "v_proj": (h, kv, bias), "o_proj": (q, h, False),
        "gate_proj": (h, i, False), "up_proj": (h, i, False), "down_proj": (i, h, False),
    }


def parameter_counts(m: ModelConfig, lora: Optional[LoraConfig]) -> ParameterCounts:
    """Exact parameter counts of ``AutoModelForSequenceClassification`` (one label) for Mistral/Llama/Qwen2.

    Example (the tiny model: embedding 512x128, two layers of 147,712, final norm, score head):
        >>> from rm.foundations.config import ModelConfig
        >>> m = ModelConfig(name="t", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
        >>> parameter_counts(m, None).total
        361216
    """
    shapes = _linear_shapes(m)
    h = m.hidden_size
    layer_tensors = [i * o for i, o, _ in shapes.values()] + [o for _, o, b in shapes.values() if b] + [h, h]
    layer = sum(layer_tensors)
    base = m.vocab_size * h + m.num_hidden_layers * layer + h + h  # embedding, layers, final norm, score (h x 1)
    base_tensors = [m.vocab_size * h] + layer_tensors * m.num_hidden_layers + [h, h]
    if lora is None:
        return ParameterCounts(base, base, base, base_tensors, base_tensors)
    adapter = [lora.r * n for name in lora.target_modules if name in shapes for n in shapes[name][:2]]
    adapters = m.num_hidden_layers * sum(adapter)
    # PEFT's modules_to_save keeps the original head and trains a copy of it.
    tensors = adapter * m.num_hidden_layers + [h]
    return ParameterCounts(base + adapters + h, adapters + h, base, tensors, base_tensors + tensors)


def released_after_forward(m: ModelConfig, lora: Optional[LoraConfig], input_grads: bool) -> List[int]:
    """Numels of the frozen parameters whose module no gradient passes through: ZeRO-3 gathers them for the
    forward only (its backward hooks ride on module outputs that require grad; a module that is not in the
    recorded backward is not reused within ``stage3_max_reuse_distance`` and is released at once).

    Under LoRA the embedding's output requires no grad unless PEFT made it (``enable_input_require_grads``, which it
    calls when activation checkpointing is on and the base is not quantised), and neither does the first layer's
    untargeted q/k/v projection of it (measured: a LoRA point without checkpointing held every gathered weight
    at its peak but the embedding, 6.5% below the estimate that counted it). A full fine-tune trains them all.

    >>> from rm.foundations.config import LoraConfig, ModelConfig
    >>> m = ModelConfig(name="t", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    >>> released_after_forward(m, LoraConfig(target_modules=["q_proj", "v_proj"]), input_grads=False)  # + k_proj
    [65536, 8192]
    >>> released_after_forward(m, LoraConfig(), input_grads=True), released_after_forward(m, None, False)
    ([], [])
    """
    if lora is None or input_grads:
        return []
    shapes = _linear_shapes(m)
    front = [name for name in ("q_proj", "k_proj", "v_proj") if name not in lora.target_modules]
    return [m.vocab_size * m.hidden_size] + [n for name in front for n in
                                             [shapes[name][0] * shapes[name][1]] + [shapes[name][1]] * shapes[name][2]]


def adamw_state_bytes(tensor_numels: List[int], state_bytes: int, eight_bit: bool) -> int:
    """Bytes of AdamW's two moment buffers for these tensors.

    bitsandbytes' 8-bit AdamW keeps uint8 moments with one fp32 scale per 256-element block
    for each, plus two 256-entry fp32 code maps per tensor; tensors under 4096 elements keep
    fp32 moments.

    >>> adamw_state_bytes([1024 * 1024], state_bytes=4, eight_bit=False)
    8388608
    >>> adamw_state_bytes([1024 * 1024, 128], state_bytes=4, eight_bit=True)   # 2 MiB + scales + maps; 128 fp32
    2132992
    """
    if not eight_bit:
        return 2 * state_bytes * sum(tensor_numels)
    total = 0
    for n in tensor_numels:
        total += 2 * n + 2 * 4 * math.ceil(n / 256) + 2 * 256 * 4 if n >= 4096 else 8 * n
    return total


def zero_partition_numels(tensor_numels: List[int], world_size: int) -> List[int]:
    """Per rank, the elements of the whole parameters that touch its ZeRO-1/2 partition.

    DeepSpeed flattens the trainable parameters in order, pads the flat buffer to a multiple of
    2 x world size, and gives rank ``r`` the ``r``-th equal slice. Its gradient partition buffer
    (``grads_in_partition``) holds every parameter that overlaps the slice whole, so a parameter
    that straddles a boundary is counted on both sides.

    Example: 10 and 6 elements over 2 ranks: slices [0, 8) and [8, 16); the first tensor straddles.
        >>> zero_partition_numels([10, 6], 2)
        [10, 16]
    """
    size = _partition_size(tensor_numels, world_size)
    out = []
    for rank in range(world_size):
        lo, hi, start, touching = rank * size, (rank + 1) * size, 0, 0
        for numel in tensor_numels:
            if start < hi and start + numel > lo:
                touching += numel
            start += numel
        out.append(touching)
    return out


def partition_largest(tensor_numels: List[int], world_size: int, rank: Optional[int]) -> int:
    """The largest whole parameter that touches ``rank``'s ZeRO-1/2 slice (:func:`zero_partition_numels`);
    ``None``: the largest of any rank's.

    Example: 10 and 6 elements over 2 ranks: slices [0, 8) and [8, 16); rank 1 holds the end of the first.
        >>> partition_largest([10, 6], 2, 1), partition_largest([20, 4, 4, 12], 2, 1), partition_largest([20, 4, 4, 12], 2, None)
        (10, 12, 20)
    """
    if rank is None:
        return max(tensor_numels, default=0)
    size, start, largest = _partition_size(tensor_numels, world_size), 0, 0
    for numel in tensor_numels:
        if start < (rank + 1) * size and start + numel > rank * size:
            largest = max(largest, numel)
        start += numel
    return largest


@dataclass
class Estimate:
    """Per-device bytes at the peak, and the verdict."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    evaluation: int  # the peak of one scoring forward at train.eval_batch_size, above the weights
    temporaries: int
    overhead: int  # engine buffers that live as long as the engine (offload staging)
    allocated_bytes: int  # the peak of live tensors: what max_memory_allocated measures on a GPU
    allocator_reserve: int  # CUDA: the caching allocator's rounding and cached free blocks
    cuda_context: int
    communication: int  # CUDA in an NCCL process group: its buffers and kernels
    peak_bytes: int  # what the device holds at the peak: allocated + reserve + context + communication + outside_allocator
    peak_phase: str
    usable_bytes: int  # device capacity less headroom
    headroom_bytes: int
    fits: bool
    host_ram_bytes_per_node: int
    params_total: int
    params_trainable: int
    uncalibrated: List[str]
    world_size: int = 1
    world_size_source: str = "given"
    precision: str = ""  # the resolved train.precision, and the dtypes it keeps (rm.foundations.precision)
    numerics: Dict = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)  # the plan's: settings that fit but a user should hear about
    # What activations were sized at: "config" (the worst case the config allows) or "data" (the run's longest
    # micro-batch), and those shapes (rm.data.shapes.BatchShapes.to_dict: train and eval rows x length).
    sized_by: str = "config"
    shapes: Dict = field(default_factory=dict)
    # The process this estimate is for (ranks differ in their data and ZeRO partitions); None: the worst rank.
    rank: Optional[int] = None
    # Sized by the data: every rank's peak_bytes in rank order; this estimate is the largest (the verdict's).
    rank_peak_bytes: List[int] = field(default_factory=list)
    # Device memory that tensors hold outside PyTorch's allocator, left out of allocated_bytes (which
    # max_memory_allocated is compared with) and in peak_bytes: bitsandbytes' paged 8-bit optimizer states on CUDA,
    # in managed memory (measured: an H100's used memory exceeded reserved + context by the states' size).
    outside_allocator: int = 0
    # QLoRA from a shape (no model.pretrained) with no saved random init: what building it holds on this device before
    # the 4-bit load (:func:`random_init_build_bytes`) where this rank builds it on a CPU device; 0 otherwise.
    random_init_build: int = 0

    def to_dict(self) -> Dict:
        return asdict(self)


def _stored_numerics(plan, profile) -> Dict:
    """The plan's dtypes as stored: QLoRA's frozen base is 4-bit NF4 (bitsandbytes packs it), whatever dtype it
    computes in, so the table does not call it bf16."""
    numerics = asdict(plan.numerics)
    if profile.quantize_base != "none":
        numerics["frozen"] = profile.quantize_base
    return numerics


@dataclass
class TraceFreeTerms:
    """Per-device bytes that are arithmetic on parameter counts: no trace needed.

    ``reduction``: DeepSpeed's gradient reduction at the end of a backward, when it is a peak of its own;
    ``step_extra``: buffers only the optimizer step allocates; ``gathered``: ZeRO-3's whole parameters, held
    through every forward (training or evaluation) but not the step; ``largest_gathered``: ZeRO-3's largest whole
    parameter, ``largest_grad`` and ``largest_layer_grad``: the largest gradient, and the largest but the
    embedding's, each reduce-scattered on its own, ``largest_layer_gathered``: the largest but the embedding
    (:func:`zero3_backward_bytes`); ``released``: ZeRO-3's largest
    parameter gathered for its forward only (:func:`released_after_forward`); ``overhead``: engine buffers that live as long as the engine;
    ``host``: host RAM per node.
    """

    counts: ParameterCounts
    weights: int
    gradients: int
    states: int
    temporaries: int = 0
    overhead: int = 0
    reduction: int = 0
    step_extra: int = 0
    gathered: int = 0
    largest_gathered: int = 0
    largest_grad: int = 0
    largest_layer_grad: int = 0
    largest_layer_gathered: int = 0
    released: int = 0
    host: int = 0
    uncalibrated: List[str] = field(default_factory=list)
    # The part of ``states`` an optimizer makes at its first step (AdamW's moments, torch's and DeepSpeed's alike);
    # None: all of it. DeepSpeed makes its fp32 master and gradient partitions at initialize.
    moments: Optional[int] = None

    @property
    def before_first_step(self) -> int:
        """The states that exist while the first step's micro-batches run."""
        return self.states - (self.states if self.moments is None else self.moments)


def weight_bytes(m: ModelConfig, profile, counts: ParameterCounts, wbytes: int, adapter_bytes: int = 4) -> Tuple[int, int, List[str]]:
    """Device bytes of the weights, bytes per trained element, and what is not calibrated.

    The base sits in the weight dtype (under QLoRA: 4-bit NF4 linear layers, the rest as the adapters); LoRA adapters and the head
    copy PEFT trains (``modules_to_save``) in ``adapter_bytes`` (fp32, but DeepSpeed's bf16/fp16 casts them to its
    compute dtype), the original head in the weight dtype.
    """
    if not profile.use_lora:
        return counts.base * wbytes, wbytes, []
    base_bytes, uncalibrated = counts.base * wbytes, []
    if profile.quantize_base == "nf4":
        linears = [i * o for i, o, _ in _linear_shapes(m).values()]
        # prepare_model_for_kbit_training casts every weight that is not 4-bit (embedding, norms, head) to fp32, and
        # DeepSpeed's bf16/fp16 casts them to its dtype as it does the adapters (measured: a ZeRO-1 bf16-mixed point
        # whose 50k-word embedding the estimate held in fp32 was 31% over).
        base_bytes = ((counts.base - m.num_hidden_layers * sum(linears)) * adapter_bytes
                      + m.num_hidden_layers * sum(map(nf4_bytes, linears)))
    return base_bytes + (counts.trainable - m.hidden_size) * adapter_bytes + m.hidden_size * wbytes, adapter_bytes, uncalibrated


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight loaded in 4-bit NF4 with double quantisation (bitsandbytes ``Params4bit`` and its
    ``QuantState``, read off a loaded model): two weights a byte; one uint8 scale per 64-weight block; those scales'
    own fp32 scale per 256 blocks; the 16-entry NF4 code book, the scales' offset and their 256-entry code book, in fp32.

    >>> nf4_bytes(128 * 256)  # 16384 + 512 + 4 x 2 + 64 + 4 + 1024
    17996
    """
    blocks = math.ceil(numel / 64)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / 256) + 16 * 4 + 4 + 256 * 4


# bitsandbytes' code books, made once a process at its first 4-bit quantisation and kept: the 256-entry dynamic map
# and two 16-entry NF4 tables, fp32 (measured: a loaded model's live bytes exceed its weights and buffers by 1,152).
BNB_CODE_BOOK_BYTES = 1024 + 2 * 64


def _rope_buffer_bytes(m: ModelConfig) -> int:
    """RoPE's ``inv_freq`` and ``original_inv_freq``: head_dim / 2 fp32 each, alive from the model's construction."""
    return 2 * 4 * math.ceil((m.head_dim or m.hidden_size // m.num_attention_heads) / 2)


def one_at_a_time_cast_bytes(numels: List[int], before: int, after: int, held: int = 0) -> int:
    """The peak while tensors change dtype one after another (``param.data = param.data.to(dtype)``): the tensor being
    cast is held in both dtypes, those before it in the new one, those after it in the old. ``held``: what else is alive.

    An embedding of 100 elements and a norm of 10, from bf16 to fp32: 6 x 100 + 2 x 10 = 620 at the embedding, then
    4 x 100 + 6 x 10 = 460:
        >>> one_at_a_time_cast_bytes([100, 10], 2, 4)
        620
    """
    peak, done, rest = 0, 0, before * sum(numels)
    for n in numels:
        rest -= before * n
        peak = max(peak, done + (before + after) * n + rest)
        done += after * n
    return held + peak


def _checkpoint_tensors(m: ModelConfig) -> List[Tuple[str, int, bool]]:
    """(state-dict name, numel, quantised to 4 bits) of every weight of the shape's sequence-classification model."""
    h, tensors = m.hidden_size, [("model.embed_tokens.weight", m.vocab_size * m.hidden_size, False),
                                 ("model.norm.weight", m.hidden_size, False), ("score.weight", m.hidden_size, False)]
    for i in range(m.num_hidden_layers):
        for name, (fan_in, fan_out, bias) in _linear_shapes(m).items():
            module = f"model.layers.{i}.{'mlp' if name in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{name}"
            tensors += [(f"{module}.weight", fan_in * fan_out, True)] + ([(f"{module}.bias", fan_out, False)] if bias else [])
        tensors += [(f"model.layers.{i}.input_layernorm.weight", h, False),
                    (f"model.layers.{i}.post_attention_layernorm.weight", h, False)]
    return tensors


def quantising_load_bytes(m: ModelConfig, load_bytes: int, disk_bytes: int = 4) -> int:
    """The peak of ``from_pretrained`` loading a checkpoint in 4-bit NF4 on the CPU (transformers 5 with bitsandbytes),
    simulated tensor by tensor in the order it loads them, the checkpoint's sorted names (measured to within 1.2 KB on
    four shapes, fp32 and bf16). Each tensor is read in the checkpoint's dtype (``disk_bytes``: rm saves random inits
    in fp32; a pretrained checkpoint's dtype is not known before it loads, fp32 bounds it) and cast to the load dtype,
    both held until the cast is done; a 4-bit weight is then quantised from its load-dtype copy, beside its NF4 bytes
    and two fp32 copies of its block scales. What is loaded stays: NF4 bytes (:func:`nf4_bytes`), the rest in the load
    dtype; RoPE's buffers exist from the start.

    One layer, hidden 64, intermediate 128, one 64-wide head, vocabulary 256, in fp32. In name order the embedding
    (16,384: 65,536 bytes) and a layer norm (256) come first, then the MLP's three 8,192-weight linears (down, gate,
    up; NF4 5,320 bytes each, 128 blocks), then the attention's four of 4,096. The peak is at ``up_proj``, quantised
    from its fp32 copy (32,768) beside its NF4 bytes (5,320) and two copies of its block scales (2 x 4 x 128), with
    RoPE's buffers (256), bitsandbytes' code books (1,152), the embedding, the norm and the two other MLP weights' NF4
    bytes held: 77,840 + 39,112 = 116,952 (the attention weights, loaded later, are half the size).
        >>> from rm.foundations.config import ModelConfig
        >>> m = ModelConfig(name="t", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                 num_attention_heads=1, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
        >>> quantising_load_bytes(m, 4)
        116952
    """
    loaded = peak = _rope_buffer_bytes(m) + BNB_CODE_BOOK_BYTES  # the code books: a bound from the first weight on
    cast = load_bytes if load_bytes != disk_bytes else 0
    for _, numel, four_bit in sorted(_checkpoint_tensors(m)):
        transient = disk_bytes * numel + cast * numel
        if four_bit:
            transient = max(transient, load_bytes * numel + nf4_bytes(numel) + 2 * 4 * math.ceil(numel / 64))
        peak = max(peak, loaded + transient)
        loaded += nf4_bytes(numel) if four_bit else load_bytes * numel
    return peak


def kbit_cast_bytes(m: ModelConfig, lora: LoraConfig, load_bytes: int, deepspeed_bytes: Optional[int]) -> int:
    """The peaks of QLoRA's two casts of every weight that is not 4-bit, each one tensor at a time
    (:func:`one_at_a_time_cast_bytes`), in the model's parameter order, beside the NF4 weights and RoPE's buffers.
    ``prepare_model_for_kbit_training`` casts the embedding, norms, q/k/v biases and head from the load dtype to fp32
    (peft/utils/other.py; nothing to cast when it loaded in fp32); DeepSpeed's bf16/fp16 (``deepspeed_bytes``) casts
    those and PEFT's fp32 adapters and head copy to its dtype (engine.py, ``_cast_module_mixed_precision``).
    Measured on a 50k-word ZeRO-1 bf16-mixed point: 37.16 MiB at DeepSpeed's cast, the run's peak."""
    shapes, h = _linear_shapes(m), m.hidden_size
    layer, layer_trained = [], []
    for name, (fan_in, fan_out, bias) in shapes.items():
        layer += [fan_out] if bias else []
        layer_trained += ([fan_out] if bias else []) + ([lora.r * fan_in, lora.r * fan_out] if name in lora.target_modules else [])
    base = [m.vocab_size * h] + (layer + [h, h]) * m.num_hidden_layers + [h, h]
    trained = [m.vocab_size * h] + (layer_trained + [h, h]) * m.num_hidden_layers + [h, h, h]  # + PEFT's head copy
    held = m.num_hidden_layers * sum(nf4_bytes(i * o) for i, o, _ in shapes.values()) + _rope_buffer_bytes(m) + BNB_CODE_BOOK_BYTES
    prepare = one_at_a_time_cast_bytes(base, load_bytes, 4, held) if load_bytes != 4 else 0
    deepspeed = one_at_a_time_cast_bytes(trained, 4, deepspeed_bytes, held) if deepspeed_bytes else 0
    return max(prepare, deepspeed)


def qlora_load_bytes(model_cfg: ModelConfig, lora_cfg: LoraConfig, plan: Plan) -> int:
    """QLoRA's model building, before the engine exists: the 4-bit load on a CPU (:func:`quantising_load_bytes`; on a
    GPU its host side is not the device's) and the casts after it (:func:`kbit_cast_bytes`), in the dtypes the plan
    loads the base in (``numerics.frozen``) and DeepSpeed's half precision trains in."""
    numerics = plan.numerics
    half = numerics.master is not None and numerics.weight_bytes < 4
    casts = kbit_cast_bytes(model_cfg, lora_cfg, numerics.frozen_bytes, numerics.weight_bytes if half else None)
    return max(casts, quantising_load_bytes(model_cfg, numerics.frozen_bytes) if plan.device == "cpu" else 0)


def random_init_build_bytes(m: ModelConfig) -> int:
    """Bytes a process holds while it builds a shape's random init to save it for QLoRA (``rm.modelling.model.saved_random_init``,
    when ``model.pretrained`` is null): the whole model in fp32 (transformers' ``from_config`` in the default dtype),
    its parameters and RoPE's two buffers (``inv_freq`` and ``original_inv_freq``, head_dim / 2 fp32 each). Nothing
    else of the run exists yet; the model is freed once saved, before the 4-bit load (measured to the byte on a
    38.5M-parameter Llama shape: 154,098,048 bytes).

    The tiny model (361,216 parameters, head_dim 32): 4 x 361,216 + 2 x 16 x 4 = 1,444,864 + 128.
        >>> from rm.foundations.config import ModelConfig
        >>> m = ModelConfig(name="t", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        ...                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
        >>> random_init_build_bytes(m)
        1444992
    """
    return 4 * parameter_counts(m, None).total + _rope_buffer_bytes(m)


def random_init_builders(world_size: int, nodes: int) -> List[int]:
    """The ranks that build a random init when none is saved: local rank 0 of each node (torchrun numbers a node's
    processes consecutively); the others wait for it. Several nodes on one shared cache build it once, under a file
    lock: the estimate counts it on each node's first rank, whichever gets there first.

    >>> random_init_builders(1, 1), random_init_builders(2, 1), random_init_builders(8, 2)
    ([0], [0], [0, 4])
    """
    per_node = math.ceil(world_size / max(nodes, 1))
    return list(range(0, world_size, per_node))


def zero3_weight_bytes(weights: int, counts: ParameterCounts, wbytes: int, persistence: int, n: int) -> int:
    """ZeRO-3 shards every parameter but those under ``stage3_param_persistence_threshold``, kept whole."""
    if n == 1:
        return weights
    persistent = sum(x for x in counts.tensors if x < persistence) * wbytes
    return (weights - persistent) // n + persistent


def _partition_size(tensor_numels: List[int], world_size: int) -> int:
    """Elements of each rank's slice: DeepSpeed pads the flat buffer of the trainable parameters to a multiple of
    2 x world size and cuts it in equal slices."""
    align = 2 * world_size
    return math.ceil(sum(tensor_numels) / align) * align // world_size


def partition_numel(counts: ParameterCounts, world_size: int, rank: Optional[int]) -> int:
    """The elements of ``rank``'s ZeRO-1/2 gradient partition (:func:`zero_partition_numels`); ``None``: the largest."""
    parts = zero_partition_numels(counts.trainable_tensors, world_size)
    return max(parts) if rank is None else parts[rank]


def deepspeed_terms(model_cfg: ModelConfig, adapters: Optional[LoraConfig], profile: MemoryProfileConfig,
                    gradient_checkpointing: bool, plan: Plan, counts: ParameterCounts, weights: int, trained_bytes: int,
                    wbytes: int, uncalibrated: List[str], rank: Optional[int] = None) -> TraceFreeTerms:
    """What DeepSpeed's ZeRO optimizer (stage_1_and_2.py, stage3.py) allocates beside the weights, on ``rank``
    (``None``: the worst rank); ``adapters``: the LoRA group where the profile trains adapters, else ``None``."""
    from rm.distributed.engine import DEEPSPEED_MAX_LIVE, deepspeed_buckets

    n, stage = plan.world_size, plan.zero_stage
    buckets = deepspeed_buckets(stage, model_cfg.hidden_size, counts.trainable)  # as rm.distributed.engine configures them
    bucket = buckets["reduce"]
    if stage == 3:
        uncalibrated.append("DeepSpeed ZeRO-3 buffers")
    shard = math.ceil(counts.trainable / n)
    t = TraceFreeTerms(counts, weights, gradients=counts.trainable * trained_bytes,
                       states=shard * (4 + 8),  # fp32 master copy + fp32 moments, sharded from ZeRO-1 on
                       uncalibrated=uncalibrated,
                       # torch's AdamW (ZeRO-1/2/3) and DeepSpeed's CPU Adam (offload) alike make them at the first
                       # step (live-storage snapshots: adam.py _init_group, cpu_adam.py step, under _take_model_step)
                       moments=shard * 8)
    if stage >= 2:
        t.gradients = shard * trained_bytes
        if n > 1 and stage == 2:  # whole parameters that touch this rank's slice (the worst rank)
            t.gradients = partition_numel(counts, n, rank) * trained_bytes
        # Two contiguous gradient buckets (overlap_comm), each allocated at full size during backward.
        t.temporaries = 2 * bucket * trained_bytes
    else:  # ZeRO-1: one gradient bucket (no overlap_comm), full gradients until the boundary
        t.temporaries = bucket * trained_bytes
    if stage == 3 and n > 1:
        # DeepSpeed's coordinator (partitioned_param_coordinator.py) releases a parameter after its module
        # runs unless it is used again within stage3_max_reuse_distance elements of the trace: every
        # parameter gathered in the forward is used again in the backward, so up to that distance (and the
        # live limit) all of them are alive when the backward starts. Measured on 2 CPU processes: every
        # non-persistent parameter gathered once and one gradient bucket; a gradient bigger than the bucket is
        # reduce-scattered on its own (zero3_backward_bytes).
        # The step holds neither the gathered parameters nor the reduce-scatter input: the coordinator frees
        # each module's parameters once its backward has run (partitioned_param_coordinator.py,
        # release_sub_module, from the post-backward hook), and the input is dropped once reduced (stage3.py,
        # __reduce_and_partition_ipg_grads). Only the bucket (stage3.py, _setup_for_real_optimizer) lives as
        # long as the optimizer. An evaluation forward has no backward to free what it gathers: at the same
        # reuse distance every parameter stays gathered through it (measured).
        persistent = sum(x for x in counts.tensors if x < buckets["persistence"])
        input_grads = gradient_checkpointing and profile.quantize_base == "none"  # rm.modelling.model, PEFT
        released = [x for x in released_after_forward(model_cfg, adapters, input_grads)
                    if x >= buckets["persistence"]]
        t.gathered = min(counts.total - persistent - sum(released), DEEPSPEED_MAX_LIVE) * wbytes
        t.released = max(released, default=0) * wbytes
        t.temporaries = bucket * trained_bytes
        t.largest_gathered = max(x for x in counts.tensors if x >= buckets["persistence"]) * wbytes
        # parameter_counts lists the embedding first: the largest a layer or the head gathers
        t.largest_layer_gathered = max((x for x in counts.tensors[1:] if x >= buckets["persistence"]), default=0) * wbytes
        t.largest_grad = max(counts.trainable_tensors) * trained_bytes
        # parameter_counts lists the embedding first; LoRA trains none of it
        layers = counts.trainable_tensors if profile.use_lora else counts.trainable_tensors[1:]
        t.largest_layer_grad = max(layers, default=0) * trained_bytes
    # One process: each partition is its whole parameter and nothing is gathered (measured).
    if stage == 3:
        # The step flattens each sub-group's gradient partition (stage3.py, _prepare_fp32_grad_for_sub_group)
        # and casts the copy to fp32, the optimizer's gradient (sub-groups of DeepSpeed's default 1e9 elements).
        flat = min(shard, 1_000_000_000)
        t.step_extra = flat * trained_bytes + (flat * 4 if trained_bytes != 4 else 0)
    copy = 0  # the accumulation buffer's transient twin (below)
    if profile.offload_optimizer:
        # ZeRO-Offload: from ZeRO-2 on, gradients leave the device through the buckets; ZeRO-1 does not
        # partition gradients (stage_1_and_2.py, partition_gradients), so each parameter's full .grad stays
        # on the device until the step's reduction (measured: a random calibration point was 12% under
        # without it). The host keeps, next to master weights and moments, the fp32 gradient partition, a
        # weight-dtype copy of the partition for the upload, per-parameter accumulation buffers when
        # accumulating, and, under ZeRO-1/2, a staging buffer the size of the largest parameter, whose twin the
        # device keeps (stage_1_and_2.py, temp_grad_buffer_for_cpu_offload / _for_gpu_offload). stage3.py has
        # neither (measured: a ZeRO-3 point with a 10M-element embedding was 23% over, two embeddings, with them).
        largest = max(counts.trainable_tensors) * trained_bytes if stage < 3 else 0
        t.gradients = 0 if stage >= 2 else counts.trainable * trained_bytes
        t.states += shard * (4 + trained_bytes) + largest
        # ZeRO-3 accumulates into its partition, and ZeRO-1 in .grad on the device, reducing once at the step's last
        # micro-batch (measured: a ZeRO-1 point accumulating 3 micro-batches was 6.6% over with this buffer)
        if plan.gradient_accumulation_steps > 1 and stage == 2:
            # ... each made at the first micro-batch that reduces its parameter, beside a copy of it
            # (stage_1_and_2.py, async_accumulate_grad_in_cpu_via_gpu): the largest parameter's is made last
            # (the embedding's gradient comes last), when the others exist (measured: a 50k-vocabulary point
            # was 5.8% under, one embedding's size, without it). Only the parameters of this rank's partition have
            # one (copy_grads_in_partition): a rank whose slice misses the embedding holds no buffer of its size
            # (measured: rank 1 of a 32k-vocabulary point 6.1% over, one embedding, with it).
            mine = partition_largest(counts.trainable_tensors, n, rank) * trained_bytes
            t.states += shard * trained_bytes + mine
            copy = largest  # gone by the boundary, where the reduction's own transient comes (measured)
        t.overhead = largest
        if plan.device == "cuda":
            t.host, t.states, t.moments, copy = plan_procs_per_node(plan) * t.states, 0, 0, 0
    if stage < 3:
        t.reduction = zero12_reduction_bytes(plan, counts, profile.offload_optimizer, trained_bytes,
                                             weights + t.states + t.temporaries - copy, rank)
    return t


def zero12_reduction_bytes(plan: Plan, counts: ParameterCounts, offload: bool, trained_bytes: int, resident: int,
                           rank: Optional[int] = None) -> int:
    """The end of a ZeRO-1/2 backward (``resident``: weights, states and buckets), 0 where it is no peak of its own.

    reduce_ipg_grads all-reduces the bucket in place (rm sets reduce_scatter=false: DeepSpeed's reduce-scatter
    path would all-reduce a flattened copy), then copy_grads_in_partition allocates ``grads_in_partition``, the
    whole parameters that touch this rank's slice; offloaded, the partition is among the host states.

    While accumulating, ZeRO-2 reduces every micro-batch, and that partition is allocated afresh each time
    (``_release_ipg_buffers`` drops ``grads_in_partition`` at the end of every backward), while the previous
    micro-batches' gradients are still held in the one before it: ``independent_gradient_partition_epilogue``
    keeps them in ``all_grad_tensors`` (the parameters' gradients, views into that partition) to add the new
    ones into, until the step. ZeRO-1 reduces at the step's last micro-batch only. One process: measured too.

    Example (ZeRO-2, 2 ranks, 10 and 6 fp32 elements: the worst rank's partition holds both tensors, 64 bytes):
        >>> from types import SimpleNamespace as NS
        >>> counts = ParameterCounts(16, 16, 16, [10, 6])
        >>> [zero12_reduction_bytes(NS(world_size=2, zero_stage=2, gradient_accumulation_steps=a), counts, False, 4, 0)
        ...  for a in (1, 2)]
        [64, 128]
    """
    n, accumulating = plan.world_size, plan.gradient_accumulation_steps > 1
    if offload and plan.zero_stage == 2:
        return resident + zero2_offload_reduction_transient(counts, n, trained_bytes, rank)
    if n == 1 and (offload or not accumulating):
        return 0  # a single backward's gradients: the forward/backward phase holds them
    partition = 0 if offload else partition_numel(counts, n, rank) * trained_bytes
    held = partition if accumulating and (plan.zero_stage == 2 or n == 1) else 0
    return resident + partition + held


def zero2_offload_reduction_transient(counts: ParameterCounts, world_size: int, trained_bytes: int,
                                      rank: Optional[int] = None) -> int:
    """What ZeRO-2 with optimizer offload adds to its resident bytes (weights, host states, buckets) while it reduces.

    The larger of two moments, seen in a live-storage snapshot at each rank's peak (2 CPU processes, a 35M-parameter
    model whose 22.5M-element embedding straddles the two partitions, 18% and 6% under without this term):
    - a parameter's gradient as autograd makes it, before the bucket takes it: the largest, the embedding's, comes
      last in the backward, when the activations are gone;
    - at the accumulation boundary, each parameter's slice of this rank's partition is copied to fp64 to take its
      norm for clipping (stage_1_and_2.py, ``set_norm_for_param_grad_in_gpu``: ``.to(get_norm_dtype())``, fp64
      wherever the device has it).

    Example (10 and 6 fp32 elements over 2 ranks, slices [0, 8) and [8, 16): rank 0's largest slice is 8 elements,
    64 bytes in fp64; rank 1's is 6, 48 bytes; both above the largest gradient, 10 x 4 = 40 bytes):
        >>> counts = ParameterCounts(16, 16, 16, [10, 6])
        >>> [zero2_offload_reduction_transient(counts, 2, 4, r) for r in (0, 1)]
        [64, 48]
    """
    largest_gradient = max(counts.trainable_tensors) * trained_bytes
    slices = largest_partition_slices(counts.trainable_tensors, world_size)
    return max(largest_gradient, NORM_BYTES * (max(slices) if rank is None else slices[rank]))


def largest_partition_slices(tensor_numels: List[int], world_size: int) -> List[int]:
    """Per rank, the most elements any one parameter has inside its ZeRO-1/2 slice of the flat buffer (the slicing of
    :func:`zero_partition_numels`).

    Example: 10 and 6 elements over 2 ranks, slices [0, 8) and [8, 16): the first tensor gives 8 to rank 0, 2 to
    rank 1, whose largest is the second tensor's 6.
        >>> largest_partition_slices([10, 6], 2)
        [8, 6]
    """
    size = _partition_size(tensor_numels, world_size)
    out = []
    for rank in range(world_size):
        lo, hi, start, largest = rank * size, (rank + 1) * size, 0, 0
        for numel in tensor_numels:
            largest = max(largest, min(hi, start + numel) - max(lo, start))
            start += numel
        out.append(largest)
    return out


def trace_free_terms(cfg: RunConfig, plan: Plan, rank: Optional[int] = None) -> TraceFreeTerms:
    """Weights, gradients, optimizer states, engine buffers and host RAM: everything but activations, on ``rank``
    (``None``: the worst rank)."""
    from rm.distributed.engine import deepspeed_buckets

    m, profile, numerics = cfg.model, cfg.memory_profile, plan.numerics
    counts = parameter_counts(m, cfg.lora if profile.use_lora else None)
    # The dtype the model is built and loaded in: a frozen LoRA base in the compute dtype, trained weights in
    # the dtype the engine updates them in (fp32 under accelerate's mixed modes, the compute dtype under DeepSpeed,
    # whose fp32 master partitions are among its states).
    wbytes = numerics.frozen_bytes if profile.use_lora else numerics.weight_bytes
    adapter_bytes = numerics.weight_bytes if numerics.master else 4  # DeepSpeed casts every parameter, adapters too
    weights, trained_bytes, uncalibrated = weight_bytes(m, profile, counts, wbytes, adapter_bytes)
    if plan.zero_stage == 3:
        persistence = deepspeed_buckets(3, m.hidden_size, counts.trainable)["persistence"]
        weights = zero3_weight_bytes(weights, counts, wbytes, persistence, plan.world_size)
    if plan.strategy == "deepspeed":
        t = deepspeed_terms(m, cfg.lora if profile.use_lora else None, profile, cfg.train.gradient_checkpointing, plan,
                            counts, weights, trained_bytes, wbytes, uncalibrated, rank)
    else:
        states = adamw_state_bytes(counts.trainable_tensors, trained_bytes, profile.optimizer == "adamw_8bit")
        t = TraceFreeTerms(counts, weights, counts.trainable * trained_bytes, states, uncalibrated=uncalibrated)
        if cfg.train.optim.kahan_summation:
            # optimi's compensation buffer, one per trained tensor in its dtype; its per-tensor step divides by
            # sqrt(exp_avg_sq) into one tensor-sized scratch (optimi.adam, _single_adam).
            t.states += counts.trainable * trained_bytes
            t.step_extra = max(counts.trainable_tensors) * trained_bytes
    t.host += host_bytes(cfg.model, cfg.train.checkpoint, plan, counts, t.states, wbytes)
    probe = lost_update_probe_bytes(cfg.health, cfg.train.optim, plan, counts)
    t.overhead += probe
    t.step_extra += probe
    return t


def lost_update_probe_bytes(health_cfg: HealthConfig, optim_cfg: OptimConfig, plan: Plan, counts: ParameterCounts) -> int:
    """The lost-update probe (``rm.foundations.lost_updates``) where ``rm.training.run_setup.watch_lost_updates`` attaches it: its
    sampled positions (int64) for the whole run, and around each optimizer step a snapshot of as many values and
    gradients, which ``torch.cat`` widens to fp32 (one more 8 bytes an element)."""
    from rm.foundations.lost_updates import SAMPLE_SIZE

    attached = health_cfg.lost_updates_threshold > 0 and plan.strategy != "deepspeed" and not optim_cfg.kahan_summation
    return 8 * min(SAMPLE_SIZE, counts.trainable) if attached else 0


def host_bytes(model_cfg: ModelConfig, checkpoint_cfg: CheckpointConfig, plan: Plan, counts: ParameterCounts, states: int,
               wbytes: int) -> int:
    """Host RAM per node beyond what the engine keeps there: loading, resuming and the export check."""
    host = 0
    if model_cfg.pretrained:
        # from_pretrained reads the checkpoint into host memory in every process before moving it.
        host += plan_procs_per_node(plan) * counts.base * wbytes
    if checkpoint_cfg.resume and plan.device == "cuda":
        # Resuming reads each process's optimizer states from the checkpoint into host memory first (accelerate
        # and DeepSpeed load with map_location="cpu"), then copies them into the optimizer. On a CPU device the
        # loaded tensors are the optimizer's own (same device and dtype): nothing is copied.
        saved = math.ceil(counts.trainable / plan.world_size) * (4 + 8) if plan.strategy == "deepspeed" else states
        host += plan_procs_per_node(plan) * saved
    # The export check reloads the saved model on the CPU of the main process (rm.modelling.bundle), beside
    # whatever the host already holds for this node's processes.
    return host + counts.total * wbytes


def device_terms(plan: Plan, activations: int, temporaries: int, full_gradients: bool = True,
                 checkpointing: bool = False) -> Tuple[int, int, int, List[str]]:
    """What a CUDA device holds beyond live tensors: allocator reserve, context, an NCCL group's memory; and the names
    of the terms that no measurement backs (the reserve, a bound from measured runs; the NCCL term with several
    processes).

    ``full_gradients``: the backward creates gradients of the whole model (not LoRA's adapters), which fragments more;
    ``checkpointing``: it recomputes each layer among them, which fragments more again.
    """
    if plan.device != "cuda":
        return 0, 0, 0, []
    fragmentation = {(True, False): ALLOCATOR_FRAGMENTATION_FULL_GRADIENTS,
                     (True, True): ALLOCATOR_FRAGMENTATION_FULL_GRADIENTS_CHECKPOINTED,
                     (False, False): ALLOCATOR_FRAGMENTATION,
                     (False, True): ALLOCATOR_FRAGMENTATION_CHECKPOINTED}[full_gradients, checkpointing]
    reserve = int(fragmentation * (activations + temporaries)) + ALLOCATOR_SMALL_SEGMENTS
    nccl = plan.strategy == "deepspeed" or plan.world_size > 1
    communication = NCCL_PROCESS_GROUP_BYTES if nccl else 0
    return reserve, CUDA_CONTEXT_BYTES, communication, ["allocator reserve"] + (["NCCL buffers of several processes"]
                                                                                if plan.world_size > 1 else [])


def usable_bytes(plan: Plan) -> Tuple[int, int]:
    """Device capacity less headroom, and the headroom (``hardware.headroom_gib``, or a share of the capacity)."""
    capacity = int(plan.hardware.device_memory_gib * GIB)
    headroom = int(capacity * DEFAULT_HEADROOM_FRACTION if plan.hardware.headroom_gib is None else plan.hardware.headroom_gib * GIB)
    return capacity - headroom, headroom


def cannot_fit(cfg: RunConfig, plan: Plan) -> bool:
    """True when the optimizer step alone (weights, gradients, states, engine buffers, device terms) exceeds
    the usable memory: the run is refused whatever its activations, so no trace is needed to say so."""
    t = trace_free_terms(cfg, plan)
    _, context, communication, _ = device_terms(plan, 0, 0)
    step = t.weights + t.gradients + t.states + t.temporaries + t.step_extra + t.overhead
    return step + context + communication > usable_bytes(plan)[0]


def traced_model(cfg: RunConfig, plan: Plan) -> "TracedModel":
    """The model the run trains, as the trace builds it. flash_attention_2 and flex_attention cannot be
    traced on the CPU; SDPA's footprint stands in (it bounds flex-attention's, a BlockMask, not T x T)."""
    from rm.modelling.loss import build_loss
    from rm.memory.trace import TracedModel
    from rm.foundations.precision import fp32_head_enabled  # not rm.modelling.model's: a cached trace needs no transformers

    m = cfg.model
    if m.attn_implementation in ("flash_attention_2", "flex_attention"):
        m = replace(m, attn_implementation="sdpa")
    return TracedModel.of(m, cfg.memory_profile, cfg.lora, numerics=plan.numerics,
                          gradient_checkpointing=cfg.train.gradient_checkpointing,
                          fp32_head=fp32_head_enabled(cfg.health.fp32_head, plan.precision),
                          loss=build_loss(cfg.train, cfg.data), device=plan.device,
                          zero3_linear=plan.strategy == "deepspeed" and plan.zero_stage == 3)


def worst_case_shapes(train_cfg: TrainConfig, data_cfg: DataConfig, plan: Plan) -> "BatchShapes":
    """The largest micro-batch the config allows, whatever the data: every sequence ``data.max_length`` tokens,
    and under ``train.share_prefix`` pairs with no common prompt. It bounds :func:`rm.data.shapes.data_shapes`:
    every side is at most ``data.max_length`` tokens (``rm.data.tokenise`` truncates or drops longer ones), a
    micro-batch holds at most ``train.micro_batch_size`` pairs, and a token budget is at least a pair's worst case."""
    from rm.data.shapes import BatchShape, BatchShapes

    t, max_length = train_cfg, data_cfg.max_length
    rows, length = 2 * plan.micro_batch_size, max_length
    accumulating = False
    if t.packing:  # one row of at most the token budget, or of micro-batch x 2 x max_length
        rows, length = 1, t.max_tokens_per_micro_batch or 2 * plan.micro_batch_size * max_length
        # A budget smaller than the step's pairs at max_length may cut the step into several micro-batches.
        accumulating = length < 2 * (t.global_batch_size // plan.world_size) * max_length
    if t.share_prefix:
        rows, length = shared_prefix_rows(plan.micro_batch_size, max_length, t.max_tokens_per_micro_batch, t.packing)
    segment = (2 * max_length if t.share_prefix else max_length) if t.packing else None
    return BatchShapes(train=BatchShape(rows, length), eval=BatchShape(2 * t.eval_batch_size, max_length),
                       accumulating=accumulating, sized_by="config", segment=segment)


def activation_terms(traced: "TracedModel", model_cfg: ModelConfig, train_cfg: TrainConfig, plan: Plan,
                     shapes: "BatchShapes", buckets: bool = False, first_in_step: bool = False) -> Tuple[Dict, int, int, bool]:
    """The traced activations of one training micro-batch, its input tensors, the evaluation forward's peak,
    and whether gradients are already allocated when the micro-batch runs (accumulating), at ``shapes``
    (:func:`worst_case_shapes`, or the data's, :func:`rm.data.shapes.data_shapes`). ``traced``: the run's model as
    the trace builds it (:func:`traced_model`).

    ``buckets``: every gradient has a home before the backward (DDP's bucket views), into which each new one is
    copied and then freed: traced as accumulation is, where each new gradient is added into ``.grad`` and freed.
    ``first_in_step``: the step's first micro-batch, which runs before any gradient of its step exists: the optimizer
    step freed the last (``zero_grad(set_to_none=True)``); DeepSpeed keeps its partitions, so there it changes nothing."""
    from rm.memory.trace import estimate_activations, inference_peak_bytes

    t = train_cfg
    batch, seq_len = shapes.train.rows, shapes.train.length
    accumulating = (plan.gradient_accumulation_steps > 1 or shapes.accumulating) and not (
        first_in_step and plan.strategy != "deepspeed")
    # A packed row under SDPA: a sequence (or pair) at a time, traced with every one as long as the longest; on a GPU
    # in half precision the same sequences in one varlen call a layer, which the trace then runs
    # (rm.memory.trace._varlen_device; rm.foundations.hardware.attention_kernel says where).
    segment = shapes.segment or 0
    if not (t.packing and attention_kernel(model_cfg.attn_implementation) == "segments") or segment >= seq_len:
        segment = 0
    act = estimate_activations(traced, model_cfg.num_hidden_layers, batch, seq_len, accumulating=accumulating or buckets,
                               packed=t.packing, shared_prefix=t.share_prefix, padded=shapes.train.padded,
                               segment=segment)
    # The token ids and mask of the micro-batch (int64) stay alive through forward and backward.
    inputs = shared_prefix_input_bytes(batch, seq_len) if t.share_prefix else 2 * batch * seq_len * 8  # packed: the ids and position ids
    evaluation = 0  # no eval set: no evaluation forward
    if shapes.eval is not None:
        rows, length = shapes.eval.rows, shapes.eval.length
        evaluation = inference_peak_bytes(traced, rows, length) + 2 * rows * length * 8
    return act, inputs, evaluation, accumulating


def estimate_run(cfg: RunConfig, plan: Plan, shapes: Optional["BatchShapes"] = None, rank: Optional[int] = None,
                 random_init_cached: bool = False) -> Estimate:
    """The estimate for a validated config, on the plan's hardware and micro-batch.

    Args:
        shapes: the largest micro-batch and evaluation forward to size activations at: one rank's data's
            (:func:`rm.data.shapes.data_shapes`, what ``rm.train`` decides by), or ``None`` for the worst case
            the config allows (:func:`worst_case_shapes`, what ``python -m rm.estimate`` reports).
        rank: the process whose ZeRO partitions to count; ``None``: the largest partition of any rank.
        random_init_cached: QLoRA from a shape only: its random init is saved already (``rm.modelling.model.random_init_saved``,
            which ``rm.train`` asks before it builds anything), so the run does not build it first. ``False``, the
            default, counts the build, a first run's peak (:func:`random_init_build_bytes`).
    """
    shapes = shapes or worst_case_shapes(cfg.train, cfg.data, plan)
    build = 0 if random_init_cached or cfg.memory_profile.quantize_base == "none" or cfg.model.pretrained else \
        random_init_build_bytes(cfg.model)
    return max((_estimate_at(cfg, plan, replace(shapes, train=shape), rank, first_step=first, recording=recording,
                             random_init=build, first_in_step=alone)
                for shape, first, recording, alone in micro_batch_phases(shapes)), key=lambda e: e.peak_bytes)


def micro_batch_phases(shapes: "BatchShapes") -> List[Tuple["BatchShape", bool, bool, bool]]:
    """The micro-batches :func:`estimate_run` weighs, as ``(shape, first step, recording, first of its step)``: each
    phase at its longest micro-batch and, where that one is unpadded, at its longest padded one too; a phase another
    one bounds (as long or longer on the same side of a packed row's segment, no lighter in any of the flags) is left
    out.

    torch's, bitsandbytes' and DeepSpeed's optimizers make their moments at their first step (DeepSpeed its master
    and gradient partitions at initialize). Where the first step's micro-batches are the largest, they run without
    them (measured: a 2-step DDP run whose longest micro-batch was in its first step peaked 13% below that
    micro-batch with the states; a ZeRO-3 rank 16% below). The run's very first micro-batch is lighter still under
    ZeRO-3, which gathers one module at a time while it records its trace (:func:`zero3_backward_bytes`).

    Gradients accumulate from a step's first micro-batch on, and the optimizer step frees them (where they are not a
    DDP bucket's or a DeepSpeed partition's, :func:`activation_terms`): a step's first micro-batch runs with none, the
    others beside them. Under a token budget the first is often the fullest (the step's pairs sorted shortest first, cut
    greedily): weighing every micro-batch as the longest beside the gradients was one set of trainable gradients
    too many (measured, issue 48: +18.7% on a full fine-tune, +5.7% on LoRA r64).

    Example: a first micro-batch of 2 x 40 tokens, the rest of the first step 2 x 20, later steps' first micro-batches
    2 x 30 and their others 2 x 25 (which, beside the gradients and with the states, bound the first step's rest):
        >>> from rm.data.shapes import BatchShape, BatchShapes
        >>> s = BatchShapes(BatchShape(2, 40), None, True, "data", after_first_step=BatchShape(2, 30),
        ...                 first_micro_batch=BatchShape(2, 40), first_step_rest=BatchShape(2, 20),
        ...                 after_first_step_rest=BatchShape(2, 25))
        >>> [(b.length, *flags) for b, *flags in micro_batch_phases(s)]
        [(40, True, True, True), (30, False, False, True), (25, False, False, False)]
    """
    later, train = shapes.after_first_step, shapes.train
    if shapes.sized_by != "data":
        phases = [(train, False, False, False)]
    elif shapes.first_micro_batch is None:  # shapes made without the first micro-batch apart: the first step whole
        phases = [(train, True, False, False), (later, False, False, False)]  # later None: a one-step run
    else:
        phases = [(shapes.first_micro_batch, True, True, True), (shapes.first_step_rest, True, False, False),
                  (later, False, False, True), (shapes.after_first_step_rest, False, False, False)]
    found = [(v, *flags) for shape, *flags in phases if shape is not None for v in shape.variants()]
    segment = shapes.segment or 0
    return [p for i, p in enumerate(found)
            if not any(_phase_covers(q, p, segment) and (j < i or not _phase_covers(p, q, segment))
                       for j, q in enumerate(found) if j != i)]


def _phase_covers(a: tuple, b: tuple, segment: int) -> bool:
    """Whether :func:`micro_batch_phases`' phase ``a`` weighs at least ``b``: at least its rows and length (padded
    where ``b`` is; on the same side of ``segment``, across which a packed row's attention changes), with the optimizer
    states where ``b`` has them, not recording where ``b`` is not, beside the step's gradients where ``b`` is."""
    (sa, first_a, recording_a, alone_a), (sb, first_b, recording_b, alone_b) = a, b
    same_side = not segment or (sa.length > segment) == (sb.length > segment)
    return (sa.rows >= sb.rows and sa.length >= sb.length and (sa.padded or not sb.padded) and same_side
            and (first_b or not first_a) and recording_a <= recording_b and (alone_b or not alone_a))


def outweighs(heavier: Sequence["BatchShapes"], lighter: Sequence["BatchShapes"], segmented: bool) -> bool:
    """Whether the estimate of a run at ``heavier``'s shapes (per rank) is at least that of the same run at
    ``lighter``'s on every rank, without a trace: a layout that does not fit then makes any it is outweighed by
    not fit either (``rm.plan`` infers those verdicts).

    It is when each micro-batch :func:`estimate_run` weighs on ``lighter``'s rank (:func:`micro_batch_phases`) has
    one on ``heavier``'s of at least its rows and length, padded where it is, weighed with the optimizer states and
    beside the step's gradients where it is and not lighter for ZeRO-3's recording (:func:`_phase_covers`); their
    evaluation forwards as large; and gradients accumulated alike. The estimate grows with a micro-batch's rows and length, and a padded micro-batch weighs at
    least an unpadded one as long (:func:`bounding_shapes` rests on the same, and tests/memory/test_worst_rank.py checks it),
    except across a packed row's longest sequence where ``segmented``: there the two must lie on the same side.

    Example: one rank, a step of one micro-batch of 4 x 50 tokens against one of 2 x 40, and of 4 x 30:
        >>> from rm.data.shapes import BatchShape, BatchShapes
        >>> def one(rows, length):
        ...     return [BatchShapes(BatchShape(rows, length), BatchShape(8, 64), False, "config")]
        >>> outweighs(one(4, 50), one(2, 40), segmented=False), outweighs(one(4, 30), one(2, 40), segmented=False)
        (True, False)
    """
    def rank(a: "BatchShapes", b: "BatchShapes") -> bool:
        if (a.accumulating, a.sized_by, a.segment) != (b.accumulating, b.sized_by, b.segment):
            return False
        if b.eval is not None and (a.eval is None or not _phase_covers((a.eval, 0, 0, 0), (b.eval, 0, 0, 0), 0)):
            return False
        segment = (b.segment or 0) if segmented else 0
        mine = micro_batch_phases(a)
        return all(any(_phase_covers(pa, pb, segment) for pa in mine) for pb in micro_batch_phases(b))

    return len(heavier) == len(lighter) and all(rank(a, b) for a, b in zip(heavier, lighter))


def bounding_shapes(shapes: Sequence["BatchShapes"], segmented: bool) -> List["BatchShapes"]:
    """Shapes whose estimates, on any rank, are at least that rank's own (:func:`estimate_run` at ``shapes[rank]``).

    A rank's estimate is the largest over its micro-batches (its longest, its first, the rest of its first step, its
    longest after the first step), each weighed with the optimizer states that exist by then, and its evaluation
    forward. Each micro-batch weighs at most as much as one with the states, of at least its rows and length, and
    padded where it is (a padded micro-batch weighs at least an unpadded one as long,
    :attr:`rm.data.shapes.BatchShape.padded`), since the estimate grows with rows and length. So the largest
    micro-batch of any rank, weighed with the states (``sized_by="bound"``: one phase, after the first step),
    beside the largest evaluation forward, bounds every rank, with one exception: a packed row no longer than its
    longest sequence is traced as one SDPA call under a whole-row mask, which weighs more than a row one token
    longer taken a segment at a time (measured on a 7B LoRA shape at 512 tokens). Below and above the longest
    sequence the estimate grows with the length, so the micro-batches on each side are bounded apart
    (tests/memory/test_worst_rank.py checks the growth and the bound on random shapes). ``segmented``: packed rows take SDPA
    a segment at a time (:func:`activation_terms`).

    Example: three ranks' packed rows of 30, 35 and 50 tokens, sequences of at most 40: the longest row (50), and
    the longest of those at most 40 (35), which bounds the row of 30.
        >>> from rm.data.shapes import BatchShape, BatchShapes
        >>> ranks = [BatchShapes(BatchShape(1, n), None, False, "data", segment=40) for n in (30, 35, 50)]
        >>> [b.train.length for b in bounding_shapes(ranks, segmented=True)]
        [50, 35]
        >>> [b.train.length for b in bounding_shapes(ranks, segmented=False)]
        [50]
    """
    from rm.data.shapes import BatchShapes, largest_shape

    micro = [m for s in shapes for m in (s.train, s.after_first_step, s.first_micro_batch, s.first_step_rest,
                                         s.after_first_step_rest) if m is not None]
    segment = max((s.segment or 0 for s in shapes), default=0)
    groups = [micro]
    if segmented and segment:
        groups = [[m for m in micro if m.length > segment], [m for m in micro if m.length <= segment]]
    evaluation = largest_shape(s.eval for s in shapes)
    accumulating = any(s.accumulating for s in shapes)
    return [BatchShapes(train=largest_shape(group), eval=evaluation, accumulating=accumulating, sized_by="bound",
                        segment=segment or None) for group in groups if group]


def worst_rank_estimate(cfg: RunConfig, plan: Plan, shapes: Sequence["BatchShapes"]) -> Estimate:
    """The largest of the ranks' estimates, each :func:`estimate_run` at its own shapes (``shapes``, in rank order):
    the verdict :func:`rm.memory.preflight.data_preflight` reaches, with fewer traces where there are several ranks.

    Each trace costs about half a second, and eight ranks' shapes are mostly distinct. So every rank is first bounded
    by the estimate at :func:`bounding_shapes` (the same few traces for all ranks; the rank still decides its ZeRO
    partition), then ranks are estimated at their own shapes, highest bound first, until no rank left can exceed
    the largest found (branch and bound: the answer is the largest estimate, not a bound of it).
    """
    from rm.data.shapes import largest_shape

    if len(shapes) == 1:
        return estimate_run(cfg, plan, shapes[0])
    bounds = bounding_shapes(shapes, cfg.train.packing and attention_kernel(cfg.model.attn_implementation) == "segments")
    ceiling = [max(estimate_run(cfg, plan, b, rank=r).peak_bytes for b in bounds) for r in range(len(shapes))]

    def likeliest(r: int) -> tuple:
        """The ranks likeliest to reach their bound first: the longest micro-batch (after the first step, where the
        states exist), that micro-batch the bound's own, then the largest evaluation forward."""
        def key(shape):
            return None if shape is None else (shape.rows, shape.length, largest_shape([shape]).padded_length)

        mine = shapes[r].after_first_step or shapes[r].train
        return (-ceiling[r], -any(key(mine) == key(b.train) for b in bounds), -mine.rows * mine.length,
                -any(key(shapes[r].eval) == key(b.eval) for b in bounds), r)

    worst: Optional[Estimate] = None
    for r in sorted(range(len(shapes)), key=likeliest):
        if worst is not None and ceiling[r] <= worst.peak_bytes:
            break
        found = estimate_run(cfg, plan, shapes[r], rank=r)
        if worst is None or found.peak_bytes > worst.peak_bytes:
            worst = found
    return worst


def _estimate_at(cfg: RunConfig, plan: Plan, shapes: "BatchShapes", rank: Optional[int], first_step: bool,
                 recording: bool = False, random_init: int = 0, first_in_step: bool = False) -> Estimate:
    """:func:`estimate_run` at one set of shapes; ``first_step``: no optimizer states during the backward;
    ``recording``: the run's first micro-batch, where ZeRO-3 records its module trace; ``random_init``: the bytes of
    building QLoRA's random init, where the run builds one (:func:`random_init_build_bytes`); ``first_in_step``: the
    micro-batch is its step's first, with no gradients accumulated yet (:func:`micro_batch_phases`)."""
    t = trace_free_terms(cfg, plan, rank)
    # The random init is built on the host, before anything else of the run exists: on a CPU device, a phase of its
    # own on each rank that builds it; on a GPU, host RAM.
    builds_here = rank is None or rank in random_init_builders(plan.world_size, plan.hardware.nodes)
    build = random_init if plan.device == "cpu" and builds_here else 0
    kbit_load = qlora_load_bytes(cfg.model, cfg.lora, plan) if cfg.memory_profile.quantize_base == "nf4" else 0
    states = t.before_first_step if first_step else t.states  # alive through the backward
    # DDP over several processes (or under a launcher) keeps gradients as views of its buckets,
    # which exist from the wrap on: they are always alive.
    ddp_buckets = plan.strategy == "ddp" and (plan.world_size > 1 or plan.launcher)
    act, inputs, evaluation, accumulating = activation_terms(traced_model(cfg, plan), cfg.model, cfg.train, plan, shapes,
                                                             buckets=ddp_buckets, first_in_step=first_in_step)
    activations, temporaries = act["peak_bytes"], t.temporaries + inputs
    # ZeRO-3 allocates its gradient partition with the optimizer: alive from the start too.
    zero3_partition = plan.strategy == "deepspeed" and plan.zero_stage == 3 and plan.world_size > 1
    backward_temporaries = temporaries + t.gathered
    if zero3_partition:
        backward_temporaries = temporaries + zero3_backward_bytes(t, act, accumulating, recording) - activations

    # The step's peak: during backward (states exist from the first step; gradients are fully
    # allocated while accumulating, and are being created while activations are freed otherwise),
    # or at the optimizer step (weights + gradients + states, activations gone).
    if accumulating or ddp_buckets or zero3_partition:
        backward = t.weights + states + t.gradients + activations
    elif plan.strategy != "deepspeed" or plan.zero_stage == 1:
        # Gradients stay in .grad as the backward makes them (ZeRO-1 has no gradient hooks): the trace's own
        # timeline of activations and gradients together.
        backward = t.weights + states + max(activations, act["backward_with_gradients_bytes"], t.gradients)
    else:  # ZeRO-2/3 hooks move each gradient into a bucket as it is made: the partition at the end
        backward = t.weights + states + max(activations, t.gradients)
    # Evaluation runs after an optimizer step has freed the gradients; DDP keeps its buckets, ZeRO-3 its partition.
    # ZeRO-1 and ZeRO-2 (one optimizer, stage_1_and_2.py) drop theirs: the step sets averaged_gradients to None, and
    # the flat grads_in_partition is released at each backward's end. Measured on seed-13 point 19 of the random
    # calibration (2 processes, the peak at a 64-pair evaluation): ZeRO-2 was over by its partition to the MiB on each
    # rank (+5.42%) and ZeRO-1 by its full gradients (+9.40%); both peak at 735.37 MiB, estimated so now. ZeRO-3 there
    # measured 807.59 MiB against 804.51 estimated with its partition kept (-0.38%).
    freed = plan.strategy == "deepspeed" and plan.zero_stage in (1, 2)
    kept_gradients = t.gradients if (plan.strategy == "deepspeed" and not freed) or ddp_buckets else 0
    # DDP rebuilds its buckets once, in the order the first all-reducing backward made the gradients: in the forward
    # after it (DistributedDataParallel._pre_forward), all new buckets are allocated while the old ones still hold the
    # gradients. rm's engine all-reduces the process's first micro-batch (AccelerateEngine.micro_batch), so under
    # accumulation that is step 1's second forward, before any optimizer state (measured on a 2-process 8-bit point:
    # weights + twice the buckets, 2.3% over the estimate's evaluation, the peak it named). Without accumulation the
    # rebuild comes in step 2's first forward, after zero_grad(set_to_none=True) let the old buckets go (the engine
    # keeps .grad as bucket views only after the rebuild): no second copy, none counted.
    # Counted at every micro-batch weighed: the moment is the step's, whichever of its micro-batches bounds the others.
    rebuild = ddp_buckets and plan.gradient_accumulation_steps > 1
    phases = {
        "bucket rebuild": t.weights + t.before_first_step + 2 * t.gradients + temporaries if rebuild else 0,
        "forward/backward": backward + backward_temporaries,
        "optimizer step": t.weights + t.gradients + t.states + temporaries + t.step_extra,
        "gradient reduction": t.reduction - (t.states - states if t.reduction else 0),
        "evaluation": t.weights + t.states + kept_gradients + t.gathered + evaluation,
        "load": t.weights + (ddp_broadcast_bytes(t.weights, max(t.counts.tensors) * max(
            plan.numerics.weight_bytes, plan.numerics.frozen_bytes)) if ddp_buckets else 0),
        "random-init build": build,
        "4-bit load": kbit_load,
    }
    phase = max(phases, key=phases.get)
    # Paged 8-bit states live in CUDA managed memory: on the device, but not in torch's allocator.
    paged = plan.device == "cuda" and cfg.memory_profile.optimizer == "adamw_8bit"
    before_engine = ("random-init build", "4-bit load")
    held_states = {"forward/backward": states, "bucket rebuild": t.before_first_step, "load": 0,
                   **{p: 0 for p in before_engine}}.get(phase, t.states)
    outside = held_states if paged else 0
    # The engine's buffers are made when it wraps the model: after the model is built.
    allocated = phases[phase] + (0 if phase in before_engine else t.overhead) - outside
    reserve, context, communication, device_assumed = device_terms(plan, activations, backward_temporaries,
                                                                   full_gradients=not cfg.memory_profile.use_lora,
                                                                   checkpointing=cfg.train.gradient_checkpointing)
    usable, headroom = usable_bytes(plan)
    peak = allocated + reserve + context + communication + outside
    return Estimate(
        weights=t.weights, gradients=t.gradients, optimizer_states=t.states, activations=activations,
        evaluation=evaluation, temporaries=backward_temporaries, overhead=t.overhead, allocated_bytes=allocated,
        allocator_reserve=reserve, cuda_context=context, communication=communication, peak_bytes=peak, peak_phase=phase,
        usable_bytes=usable, headroom_bytes=headroom, fits=peak <= usable,
        host_ram_bytes_per_node=t.host + random_init, params_total=t.counts.total, params_trainable=t.counts.trainable,
        uncalibrated=t.uncalibrated + device_assumed, world_size=plan.world_size, world_size_source=plan.world_size_source,
        precision=plan.precision, numerics=_stored_numerics(plan, cfg.memory_profile), warnings=list(plan.warnings),
        sized_by=shapes.sized_by, shapes=shapes.to_dict(), rank=rank, outside_allocator=outside, random_init_build=build,
    )


# Copies of a gradient that a ZeRO-3 reduce-scatter holds at once: the gradient and a flat copy (measured on gloo:
# three embedding-sized tensors at the peak, the gathered weight, its gradient and the copy). NCCL may reduce in
# place; until a GPU measures it, the same count there (too high by one gradient at most).
REDUCE_SCATTER_COPIES = 2


def zero3_backward_bytes(t: TraceFreeTerms, act: Dict, accumulating: bool, recording: bool = False) -> int:
    """ZeRO-3's backward above its weights, partitions and bucket: the larger of two moments.

    Early, every parameter is still gathered (reused within ``stage3_max_reuse_distance`` of the forward) beside
    the activations' peak and a layer's gradient being reduce-scattered. Late, at the embedding's backward, the
    other modules have released their parameters and most activations are gone, but the largest gradient is
    reduce-scattered beside its own gathered weight (measured at a 50k-vocabulary point: 10% below the early
    moment's terms plus that gradient, which the estimate used to add together). A trace into existing gradients
    (``accumulating``) already holds each new gradient once, at its moment.

    ``recording``: the run's first micro-batch. DeepSpeed's coordinator has no trace yet (it records one there:
    partitioned_param_coordinator.py, ``reset_step`` turns INVALID into RECORD at the first forward and RECORD
    into COMPLETE at the second), and without one ``release_sub_module`` frees each module's parameters once it
    has run: early, one module's parameters are gathered, not all, and not the embedding's, whose forward ran first
    (measured on a 2-process LoRA point whose rank 1 had its longest micro-batch first: its peak came at a later,
    41% shorter micro-batch, 24% below the estimate that counted every parameter gathered at the first).

    Example (MiB): activations 92 at their peak, 3 at the embedding's backward; gathered 144, the largest 86; the
    largest gradient 86, a layer's 2. Early, with the gradient being made: 92 + 144 + 2 = 238; late:
    3 + 86 + 2 x 86 = 261.
        >>> t = TraceFreeTerms(None, 0, 0, 0, gathered=144, largest_gathered=86, largest_grad=86, largest_layer_grad=2)
        >>> act = {"peak_bytes": 92, "embedding_backward_bytes": 3}
        >>> zero3_backward_bytes(t, act, False)
        261

    Under LoRA without checkpointing the frozen 86 MiB embedding is gathered for its forward only, and the gradients
    are small (2). Early: 92 + 58 + 2 = 152; at the first micro-batch, one layer's largest weight (10) instead of
    every one, and the gradient with its copy: 92 + 10 + 2 x 2 = 106; the embedding's forward: 86 + 58, or 86
    alone while recording. With activations of 40 the embedding's forward is the peak (86 + 58 = 144 against
    40 + 58 + 2 = 100):
        >>> lora = TraceFreeTerms(None, 0, 0, 0, gathered=58, largest_gathered=86, largest_layer_gathered=10,
        ...                       largest_grad=2, largest_layer_grad=2, released=86)
        >>> [zero3_backward_bytes(lora, act, False, recording) for recording in (False, True)]
        [152, 106]
        >>> zero3_backward_bytes(lora, {"peak_bytes": 40, "embedding_backward_bytes": 3}, False)
        144
    """
    held = 1 if accumulating else 0
    copies = REDUCE_SCATTER_COPIES - held
    # With the trace recorded, a layer's gradient is being made at the activations' peak, but not its flat copy: the
    # reduce-scatter runs in the hook after that module's backward, once its saved inputs are freed. One gradient,
    # accumulating or not (measured on two 1-layer full points whose MLP weight was most of the model: 6.3% over
    # with two; 2.9% under with none while accumulating). While recording, the layer's own weight is gathered again
    # for its backward beside the one counted: the count of the first step's measurements, left as it was.
    early_grads = copies if recording else 1
    early = act["peak_bytes"] + (t.largest_layer_gathered if recording else t.gathered) + early_grads * t.largest_layer_grad
    late = act["embedding_backward_bytes"] + t.largest_gathered + copies * t.largest_grad
    # A parameter gathered for its forward only (the frozen embedding under LoRA), at its forward: the others may be
    # gathered already from the micro-batch before (measured: a point accumulating 3 micro-batches held its embedding
    # beside every layer's weights at the third one's start, 13% above the estimate without them); not while recording.
    front = t.released + (0 if recording else t.gathered)
    return max(early, late, front)


# torch's DistributedDataParallel broadcasts rank 0's parameters and buffers at the wrap in flattened chunks of up
# to this many bytes (distributed.py: _DEFAULT_BROADCAST_BUCKET_SIZE, 250 MiB; one larger tensor is a chunk alone).
DDP_BROADCAST_BUCKET_BYTES = 250 * MIB


def ddp_broadcast_bytes(weight_bytes: int, largest_tensor_bytes: int) -> int:
    """The flat copy DDP's wrap holds beside the weights while it broadcasts them (``_sync_module_states``, through
    ``_broadcast_coalesced``): one chunk at a time, frozen weights included (measured: a LoRA model that is mostly a
    frozen embedding peaks at twice its weights, under DDP only). Bounded by the chunk size or the largest tensor.

    >>> ddp_broadcast_bytes(100 * MIB, 4 * MIB) // MIB, ddp_broadcast_bytes(14 * GIB, 500 * MIB) // MIB
    (100, 500)
    """
    return min(weight_bytes, max(DDP_BROADCAST_BUCKET_BYTES, largest_tensor_bytes))


def shared_prefix_rows(micro_batch_size: int, max_length: int, max_tokens: int, packing: bool) -> Tuple[int, int]:
    """Rows x length of the largest prefix-shared micro-batch (``train.share_prefix``), which activations follow.

    A pair takes prefix + two suffixes, at most chosen + rejected = ``2 x max_length`` tokens (no common
    prefix), the worst case the estimate must hold. Packed: one row of the token budget, or of every pair
    of the micro-batch; otherwise one row per pair.

    >>> shared_prefix_rows(4, 512, 0, packing=False), shared_prefix_rows(4, 512, 2048, packing=True)
    ((4, 1024), (1, 2048))
    """
    if packing:
        return 1, max_tokens or 2 * micro_batch_size * max_length
    return micro_batch_size, 2 * max_length


def shared_prefix_input_bytes(rows: int, seq_len: int) -> int:
    """The int64 token ids, position ids, pair ids and roles of a prefix-shared micro-batch, alive through the step.

    The 4D mask built from them is in the activations: the trace builds it as ``rm.modelling.model`` does.
    """
    return 4 * rows * seq_len * 8


def plan_procs_per_node(plan: Plan) -> int:
    """Processes of the run on one node: what shares its host memory."""
    return min(plan.world_size, plan.hardware.gpus_per_node)
