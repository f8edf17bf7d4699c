"""The step-time model: seconds per optimizer step from FLOPs, memory traffic and communication.

Pure arithmetic on plain values (no torch, no config tree but in :func:`predict_step_seconds`), each term a
function with a hand-computed example. For one micro-batch of ``N`` computed tokens (padding included) and
``S`` attention score entries (query-key pairs the kernel computes, all rows), on a model of ``L`` layers,
``H`` query heads of ``d`` dimensions, ``P_t`` trained and ``P_f`` frozen matmul weights (embedding excluded,
adapters and reward head included):

    forward   = 2 N (P_t + P_f)  +  4 L H d S
    backward  = 2 N (2 P_t + P_f)  +  2 x 4 L H d S      (a frozen weight computes only its input's gradient)
    recompute = forward, under gradient checkpointing
    seconds   = matmul FLOPs / matmul rate + attention FLOPs / attention rate
              + elementwise bytes / memory bandwidth + kernels x per-kernel overhead

QLoRA's 4-bit weights are unpacked into the compute dtype for each forward, backward and recompute (elementwise
traffic of ``P_f x (0.5 + compute bytes)`` a pass), and once per step the optimizer's traffic over memory bandwidth
(host memory and the host link when ZeRO-Offload steps on the CPU), and the collectives' bytes over the link (ring
all-reduce ``2 (n-1)/n`` of the bytes, reduce-scatter and all-gather ``(n-1)/n``). Nothing overlaps in this model:
communication behind the backward and prefetching are not credited, so it errs slow where a run overlaps well.

``S`` follows the layout and the kernel (:func:`micro_batch`, :func:`rm.foundations.hardware.attention_kernel`). SDPA and eager attention
compute the whole ``T x T`` square of a row whenever they are given a mask (padding, packing, a shared prefix), and
the causal triangle only without one (``is_causal``); flash-attention 2 and flex-attention skip masked blocks, so
they compute each sequence's triangle (packed: block-diagonal, ``sum l_i (l_i + 1) / 2``; a shared prefix once,
each answer against prefix + itself). SDPA takes a packed row one segment at a time (``rm.modelling.attention``):
each sequence's triangle, or each prefix-shared pair's square, for some ops more per segment. On CUDA in half
precision the same row is ONE varlen flash call a layer (kernel ``varlen``): no launches per segment, and the
skipped-block sum as flash-attention's (a prefix-shared pair's rejected answer against its prompt and itself); it is
modelled from the profile's rates, never timed on a GPU (``rm.plan.features``: packing is measured on CPUs only).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

# Ops one more segment of a packed row adds to a layer's forward (rm.modelling.attention), its backward taken as twice that:
# the SDPA call, the one node a segment adds to the graph (tests/modelling/test_attention.py), and its share of the
# concatenation; q, k and v are split once a layer whatever the segments. Until 2026-11-28 each segment sliced
# them (6: three more nodes, whose backwards each filled and added a row-sized tensor).
SEGMENT_KERNELS = 2


def causal(n: int) -> int:
    """Query-key pairs of one causal sequence of ``n`` tokens.

    >>> causal(4)
    10
    """
    return n * (n + 1) // 2


@dataclass(frozen=True)
class MicroBatch:
    """What one forward computes.

    Attributes:
        rows: rows of the batch.
        length: tokens per row, padding included.
        tokens: the pairs' tokens, chosen + rejected, whatever the layout computes (a shared prompt counts twice,
            as in the data): what tokens/s counts, so that layouts compare on the same work.
        attention: query-key score entries the attention kernel computes, over all rows (per layer and head).
        masked: the forward builds a 4D mask of ``rows x length x length`` (padding, packing or a shared prefix), or
            a segmented row its pairs' blocks (``attention`` entries); a segmented row of plain packing builds none.
        segments: attention calls a layer makes (more than one: a packed row taken a segment at a time).
    """

    rows: int
    length: int
    tokens: int
    attention: int
    masked: bool
    segments: int = 1

    @property
    def computed(self) -> int:
        """Tokens the matmuls compute, padding included."""
        return self.rows * self.length


def micro_batch(layout: str, chosen: Sequence[int], rejected: Sequence[int], prefix: Sequence[int],
                kernel: str) -> MicroBatch:
    """The shape and attention work of one micro-batch of pairs, as the run's collator lays it out.

    Args:
        layout: ``padded`` (two rows a pair, padded to the longest), ``packed`` (one row of every sequence),
            ``shared`` (a row a pair: prompt + chosen answer + rejected answer, padded to the longest) or
            ``packed+shared`` (one row of those).
        chosen, rejected: per pair, its sides' token lengths.
        prefix: per pair, the tokens both sides share at their start (the prompt).
        kernel: how masked attention is computed (:func:`rm.foundations.hardware.attention_kernel`, given the run's
            device and numerics: ``varlen`` on CUDA in half precision).

    Example: pairs (chosen 5, rejected 3, prompt 2) and (4, 4, 3).
        >>> c, r, p = [5, 4], [3, 4], [2, 3]
        >>> micro_batch("padded", c, r, p, "square")   # 4 rows of 5, a mask: 4 x 5^2
        MicroBatch(rows=4, length=5, tokens=16, attention=100, masked=True, segments=1)
        >>> [micro_batch("packed", c, r, p, k).attention for k in ("square", "skips", "segments")]  # 16^2; 15+6+10+10
        [256, 41, 41]
        >>> micro_batch("shared", c, r, p, "square")   # rows of 2+3+1 and 3+1+1 tokens, padded to 6
        MicroBatch(rows=2, length=6, tokens=16, attention=72, masked=True, segments=1)
        >>> micro_batch("shared", c, r, p, "skips").attention  # (15 + 6 - 3) + (10 + 10 - 6)
        32
        >>> micro_batch("packed+shared", c, r, p, "segments")  # one row of 6 + 5, each pair's square: 36 + 25
        MicroBatch(rows=1, length=11, tokens=16, attention=61, masked=True, segments=2)
        >>> micro_batch("padded", [4], [4], [1], "square").attention  # no padding, no mask: is_causal, 2 x 10
        20

    Under ``varlen`` (SDPA on CUDA in half precision) a packed row of several sequences or pairs is one call a layer
    that skips the blocks between them: the triangles, as ``skips``; no mask is read. (A prefix-shared row still
    builds each pair's mask once a micro-batch for the loop the attention falls back to, and gathers its prompts'
    keys once a layer: neither is priced.) A row of one sequence, and the layouts that are not packed, are one SDPA
    call as under ``segments``.
        >>> micro_batch("packed", c, r, p, "varlen"), micro_batch("packed+shared", c, r, p, "varlen").attention
        (MicroBatch(rows=1, length=16, tokens=16, attention=41, masked=False, segments=1), 32)
    """
    pairs = list(zip(chosen, rejected, prefix))
    if layout in ("shared", "packed+shared"):
        rows_of = [c + r - p for c, r, p in pairs]
        # every token sees what it would see in its own sequence: each side's triangle, the prompt's counted once
        needed = sum(causal(c) + causal(r) - causal(p) for c, r, p in pairs)
    else:
        rows_of = [n for c, r, _ in pairs for n in (c, r)]
        needed = sum(causal(n) for n in rows_of)
    tokens = sum(c + r for c, r, _ in pairs)  # the data's tokens, whichever layout: what tokens/s compares
    if layout.startswith("packed"):
        rows, length = 1, sum(rows_of)
        masked = len(rows_of) > 1 or layout == "packed+shared"
    else:
        rows, length = len(rows_of), max(rows_of)
        masked = layout == "shared" or min(rows_of) < length
    several = layout.startswith("packed") and len(rows_of) > 1  # a packed row of several sequences or pairs
    segments = len(rows_of) if kernel == "segments" and several else 1
    varlen = kernel == "varlen" and several  # one varlen call a layer over the row's sequences
    if (segments > 1 and layout == "packed") or varlen:  # a causal call per sequence, or the varlen call: no mask read
        masked = False
    if kernel == "skips" or varlen:
        attention = needed
    elif segments > 1:  # a causal call per sequence; a pair's call takes its slice of the mask (its square)
        attention = needed if layout == "packed" else sum(n * n for n in rows_of)
    else:
        attention = rows * length * length if masked else rows * causal(length)
    return MicroBatch(rows, length, tokens, attention, masked, segments)


@dataclass(frozen=True)
class ModelWork:
    """The per-token and per-entry work of one model, as plain numbers (:func:`model_work`).

    Attributes:
        trained: matmul weights that train (adapters, the reward head; everything in a full fine-tune).
        frozen: matmul weights that do not (a LoRA base).
        attention_width: layers x query heads x head dimension: the attention FLOPs of one score entry are
            4 x this (``Q K^T`` and ``P V``, 2 FLOPs a multiply-add each).
        elementwise: elements one token reads and writes in the elementwise ops of all layers' forwards
            (norms, RoPE, residual adds, SiLU and gating), each read once and written once.
        kernels: kernels one forward launches, all layers.
        width: the hidden size, which the CPU's measured matmul rate is looked up at.
        dropout: input elements a token's LoRA dropout draws for, all layers (0 without dropout).
        layers: decoder layers.
        dequantised: frozen weights stored in 4 bits (QLoRA), each unpacked into the compute dtype for every matmul
            that uses it; 0 otherwise.
        largest_weight: the elements of the largest projection (what one dequantisation writes).
    """

    trained: int
    frozen: int
    attention_width: int
    elementwise: int
    kernels: int
    width: int
    dropout: int = 0
    layers: int = 1
    dequantised: int = 0
    largest_weight: int = 0


# Ops a decoder layer's forward launches (norms, projections, RoPE, attention, the MLP, residual adds, views); the
# CPU's measured cost of one op is a real layer's fixed cost over this (rm.plan.constants).
LAYER_KERNELS = 30
# Ops torch's single-tensor AdamW (the CPU path) and gradient clipping launch per trained tensor.
OPTIMIZER_KERNELS = 10


def model_work(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
               lora_rank: Optional[int] = None, lora_targets: Sequence[str] = (), bias: bool = False,
               lora_dropout: float = 0.0, quantized: bool = False) -> ModelWork:
    """The work of a Mistral/Llama/Qwen2 reward model (one score per position).

    Elementwise elements per token and layer: two RMSNorms (read h, write h), RoPE on q and k (read and write
    q + kv), two residual adds (read 2h, write h), SiLU (read i, write i) and the gate product (read 2i, write i):
    ``10 h + 2 (q + kv) + 5 i``. Kernels per layer: 30, and 4 more for each LoRA-wrapped linear (dropout, A, B,
    the scaled add). With LoRA dropout, each adapted linear draws one random number per input element.
    ``quantized``: the frozen projections are stored in 4 bits (QLoRA).

    Example (the tiny model: hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV heads of 32):
    a layer's projections hold 128x128 + 2 x 128x64 + 128x128 + 3 x 128x256 = 147,456 weights, the head 128;
    elementwise 10 x 128 + 2 x (128 + 64) + 5 x 256 = 2,944 elements a layer.
        >>> w = model_work(128, 256, 2, 4, 2, 32)
        >>> w.trained, w.frozen, w.attention_width, w.elementwise
        (295040, 0, 256, 5888)
        >>> lora = model_work(128, 256, 2, 4, 2, 32, lora_rank=8, lora_targets=["q_proj", "v_proj"])
        >>> lora.trained, lora.frozen  # 2 x (8 x (128+128) + 8 x (128+64)) + 128
        (7296, 294912)
        >>> model_work(128, 256, 2, 4, 2, 32, 8, ["q_proj", "down_proj"], lora_dropout=0.05).dropout  # 2 x (128+256)
        768
        >>> q = model_work(128, 256, 2, 4, 2, 32, 8, ["q_proj"], quantized=True)
        >>> q.dequantised, q.largest_weight  # every frozen projection; the MLP's 128 x 256
        (294912, 32768)
    """
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
    base = layers * sum(i * o for i, o in shapes.values())
    head = hidden
    if lora_rank is None:
        trained, frozen = base + head, 0
    else:
        adapters = layers * sum(lora_rank * (shapes[t][0] + shapes[t][1]) for t in lora_targets if t in shapes)
        trained, frozen = adapters + head, base
    elementwise = layers * (10 * hidden + 2 * (q + kv) + 5 * intermediate)
    adapted = [t for t in lora_targets if t in shapes] if lora_rank is not None else []
    kernels = layers * (LAYER_KERNELS + 4 * len(adapted))
    dropout = layers * sum(shapes[t][0] for t in adapted) if lora_dropout > 0 else 0
    return ModelWork(trained, frozen, layers * heads * head_dim, elementwise, kernels, hidden, dropout, layers,
                     dequantised=frozen if quantized else 0, largest_weight=max(i * o for i, o in shapes.values()))


def micro_batch_flops(mb: MicroBatch, work: ModelWork, checkpointing: bool) -> Dict[str, int]:
    """Matmul and attention FLOPs of one micro-batch's forward, backward and recomputation.

    Example: 20 computed tokens, 100 entries, 1,000 trained and 10,000 frozen weights, attention width 8:
    forward 2 x 20 x 11,000 = 440,000 matmul and 4 x 8 x 100 = 3,200 attention; backward 2 x 20 x 12,000 =
    480,000 and 6,400; checkpointing recomputes the forward.
        >>> mb = MicroBatch(rows=4, length=5, tokens=16, attention=100, masked=True)
        >>> micro_batch_flops(mb, ModelWork(1000, 10000, 8, 0, 0, 64), checkpointing=True)
        {'matmul': 1360000, 'attention': 12800, 'forward': 443200, 'backward': 486400, 'recompute': 443200}
    """
    n = mb.computed
    fwd_mm = 2 * n * (work.trained + work.frozen)
    bwd_mm = 2 * n * (2 * work.trained + work.frozen)
    fwd_att = 4 * work.attention_width * mb.attention
    bwd_att = 2 * fwd_att
    again = 1 if checkpointing else 0
    return {"matmul": fwd_mm * (1 + again) + bwd_mm, "attention": fwd_att * (1 + again) + bwd_att,
            "forward": fwd_mm + fwd_att, "backward": bwd_mm + bwd_att, "recompute": again * (fwd_mm + fwd_att)}


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring all-reduce: ``2 (n - 1) / n`` of the buffer.

    >>> ring_allreduce_bytes(100, 4), ring_allreduce_bytes(100, 1)
    (150.0, 0.0)
    """
    return 2 * (n - 1) / n * nbytes


def shard_collective_bytes(nbytes: float, n: int) -> float:
    """Bytes each device sends in a reduce-scatter or an all-gather of a ``nbytes`` buffer: ``(n - 1) / n``.

    >>> shard_collective_bytes(100, 4)
    75.0
    """
    return (n - 1) / n * nbytes


def communication_bytes(strategy: str, zero_stage: int, n: int, micro_batches: int, grad_bytes: float,
                        trained_weight_bytes: float, all_weight_bytes: float, checkpointing: bool) -> Dict[str, float]:
    """Bytes one device sends per optimizer step, by collective.

    - DDP: one all-reduce of the gradients per step (the engine skips it while accumulating);
    - ZeRO-1: the same all-reduce at the step's boundary, then an all-gather of the updated trained weights;
    - ZeRO-2: an all-reduce of each micro-batch's gradients (it reduces every backward), then the all-gather;
    - ZeRO-3: per micro-batch, an all-gather of every weight for the forward, the backward and a recomputation,
      and a reduce-scatter of the gradients.

    Example: 4 devices, 2 micro-batches, 100 bytes of gradients, 100 of trained weights, 1,000 of weights.
        >>> communication_bytes("ddp", 0, 4, 2, 100, 100, 1000, False)
        {'all_reduce': 150.0}
        >>> communication_bytes("deepspeed", 2, 4, 2, 100, 100, 1000, False)
        {'all_reduce': 300.0, 'all_gather': 75.0}
        >>> communication_bytes("deepspeed", 3, 4, 2, 100, 100, 1000, True)
        {'all_gather': 4500.0, 'reduce_scatter': 150.0}
    """
    if n <= 1:
        return {}
    if strategy != "deepspeed":
        return {"all_reduce": ring_allreduce_bytes(grad_bytes, n)}
    if zero_stage == 3:
        gathers = 2 + (1 if checkpointing else 0)
        return {"all_gather": micro_batches * gathers * shard_collective_bytes(all_weight_bytes, n),
                "reduce_scatter": micro_batches * shard_collective_bytes(grad_bytes, n)}
    reductions = micro_batches if zero_stage == 2 else 1
    return {"all_reduce": reductions * ring_allreduce_bytes(grad_bytes, n),
            "all_gather": shard_collective_bytes(trained_weight_bytes, n)}


def adamw_traffic_bytes(elements: int, grad_bytes: int, state_bytes: float, weight_bytes: int,
                        master_bytes: int = 0) -> int:
    """Bytes an AdamW step reads and writes for ``elements`` trained weights: the gradient read, both moments
    read and written, the weight read and written, and a master copy read and written (its result then written
    to the weight).

    Example: fp32 torch AdamW, 1,000 weights: (4 + 4 x 4 + 2 x 4) x 1,000; DeepSpeed bf16 with fp32 master
    and moments: (4 + 16 + 2 + 2 x 4) x 1,000, the fp32 gradient partition read.
        >>> adamw_traffic_bytes(1000, 4, 4, 4), adamw_traffic_bytes(1000, 4, 4, 2, master_bytes=4)
        (28000, 30000)
    """
    weight_rw = weight_bytes + (2 * master_bytes if master_bytes else weight_bytes)
    return int(elements * (grad_bytes + 4 * state_bytes + weight_rw))


def _interpolate(points: Sequence, x: float) -> float:
    """``y`` at ``x`` from ``(x, y)`` points, linear in ``log x``, clamped at the ends."""
    points = sorted(points)
    if x <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return float(y0 + f * (y1 - y0))
    return float(points[-1][1])


@dataclass(frozen=True)
class Rates:
    """What the hardware achieves (:mod:`rm.plan.constants` gives them, with their source).

    Attributes:
        matmul: FLOP/s of matmuls per compute dtype (``float32``, ``bfloat16``), as ``[(width, FLOP/s), ...]``
            (a datasheet gives one figure for all) or ``[(width, rows, FLOP/s), ...]`` (a CPU measures products of
            several sizes: a micro-batch of 256 tokens reaches a fraction of the rate 4,096 tokens do).
        attention: FLOP/s of the attention kernel per compute dtype, same form, the middle figure the length of one
            call (a CPU's short calls, a packed row's sequences, run well below its long ones).
        memory: device memory bytes/s. link, inter_node, host_link, host_memory: bytes/s (one direction).
        kernel_seconds: the fixed cost of one kernel launch (dispatch included), seconds.
        micro_batch_seconds: a micro-batch's fixed cost beyond its layers' ops (embedding, head, loss, autograd's
            setup), seconds; 0: not measured.
        dropout: elements/s of dropout's random draws (LoRA's, on each adapted input); 0: not measured.
        elementwise: bytes/s of an elementwise op that writes a fresh output, by the tensor's size, as
            ``[(bytes, bytes/s), ...]`` (a CPU's: far below a copy's once the tensor outgrows the caches, whose
            fresh pages are faulted in); empty (a datasheet): ``memory`` at any size.
        shared_cores: the processes of one machine share its cores (a CPU): each computes at 1/n of the rates.
        source: where the figures come from, in words.
        measured: for rates measured on this machine, when, at what load and on which machine (a CPU's rates
            measured under load are slower than the same CPU idle); empty for a profile's stated figures.
    """

    matmul: Dict[str, List]
    attention: Dict[str, List]
    memory: float
    link: float
    inter_node: float
    host_link: float
    host_memory: float
    kernel_seconds: float = 0.0
    micro_batch_seconds: float = 0.0
    dropout: float = 0.0
    shared_cores: bool = False
    source: str = ""
    measured: str = ""
    elementwise: Sequence = ()  # [(tensor bytes, bytes/s), ...] of an elementwise op; empty: ``memory`` for all

    @staticmethod
    def at(table: List, width: int, rows: Optional[int] = None) -> float:
        """The rate of a product of ``rows`` x ``width`` tokens by weights, from a table of ``[width, rate]`` (one
        figure per width: a datasheet's) or ``[width, rows, rate]`` (a CPU's matmuls, whose rate grows with both
        sides of the product; its attention, with ``rows`` the length of one call), interpolated in log-width and
        log-rows, clamped at the ends.

        >>> Rates.at([(128, 1e9), (512, 3e9)], 256), Rates.at([(128, 1e9)], 4096)
        (2000000000.0, 1000000000.0)
        >>> grid = [(128, 256, 1e9), (128, 1024, 3e9), (512, 256, 5e9), (512, 1024, 7e9)]
        >>> Rates.at(grid, 256, 512), Rates.at(grid, 128, 4096)
        (4000000000.0, 3000000000.0)
        """
        if len(table[0]) == 2:
            return _interpolate(table, width)
        rows = rows or max(entry[1] for entry in table)  # no size given: the largest product measured
        widths = sorted({entry[0] for entry in table})
        return _interpolate([(w, _interpolate([(n, r) for tw, n, r in table if tw == w], rows)) for w in widths], width)

    def elementwise_rate(self, tensor_bytes: int) -> float:
        """Bytes/s of elementwise traffic over tensors of ``tensor_bytes``, interpolated in log-size.

        >>> r = Rates({}, {}, 1e11, 1, 1, 1, 1, elementwise=[(2**20, 4e10), (2**26, 1e10)])
        >>> r.elementwise_rate(2**23), Rates({}, {}, 1e11, 1, 1, 1, 1).elementwise_rate(2**23)
        (25000000000.0, 100000000000.0)
        """
        return _interpolate(self.elementwise, max(1, tensor_bytes)) if self.elementwise else self.memory

    def to_dict(self) -> Dict:
        return asdict(self)


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, by term (the slowest rank's micro-batches).

    Attributes:
        seconds: the step.
        compute, elementwise, kernels: the micro-batches' matmul and attention time, their elementwise
            traffic, their kernels' fixed cost; ``optimizer``: the step's traffic; ``offload``: host-device
            copies; ``communication``: the collectives.
        flops: matmul and attention FLOPs of the step (the slowest rank's).
        tokens, computed_tokens: the pairs' tokens (chosen + rejected) and the tokens computed (padding included, a
            shared prompt once) per step over all ranks.
        pairs: pairs per step over all ranks.
        micro_batches: the slowest rank's forwards per step (the mean over the steps timed).
    """

    seconds: float
    compute: float
    elementwise: float
    kernels: float
    optimizer: float
    offload: float
    communication: float
    flops: float
    tokens: float
    computed_tokens: float
    pairs: int
    micro_batches: float
    bytes: Dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def pairs_per_second(self) -> float:
        return self.pairs / self.seconds

    def to_dict(self) -> Dict:
        out = asdict(self)
        out.update(tokens_per_second=self.tokens_per_second, pairs_per_second=self.pairs_per_second)
        return out


def micro_batch_seconds(mb: MicroBatch, work: ModelWork, checkpointing: bool, rates: Rates, dtype: str,
                        act_bytes: int) -> Dict[str, float]:
    """Seconds of one micro-batch's forward and backward, by term.

    The elementwise traffic is the forward's, again in the backward (each op reads its output's gradient and its
    saved input, writes its input's gradient: about twice the forward), once more when recomputed; the 4D mask,
    where one is built, is written once (a byte a score entry) and read by every layer. Kernels: the forward's,
    twice that in the backward, again when recomputed, plus the micro-batch's own fixed cost. LoRA dropout's
    draws count with the elementwise time (forward, and again when recomputed).

    Example: 1e9 FLOP/s for matmuls and attention, 1e9 bytes/s, 1 microsecond a kernel; the micro-batch and model
    of :func:`micro_batch_flops` with 10 elementwise elements a token and 10 kernels, fp32, checkpointing (4 passes:
    forward, twice in the backward, recompute): (1,360,000 + 12,800) FLOPs in 1,372,800 ns; 20 tokens x 10 x 4
    bytes x 4 + a mask of 4 x 5^2 bytes x 4 = 3,600 bytes in 3,600 ns; 10 kernels x 4 in 40 us.
        >>> r = Rates({"float32": [(64, 1e9)]}, {"float32": [(64, 1e9)]}, 1e9, 1, 1, 1, 1, kernel_seconds=1e-6)
        >>> mb = MicroBatch(rows=4, length=5, tokens=16, attention=100, masked=True)
        >>> s = micro_batch_seconds(mb, ModelWork(1000, 10000, 8, 10, 10, 64), True, r, "float32", 4)
        >>> round(s["compute"] * 1e9), round(s["elementwise"] * 1e9), round(s["kernels"] * 1e6)
        (1372800, 3600, 40)
    """
    flops = micro_batch_flops(mb, work, checkpointing)
    again = 1 if checkpointing else 0
    # One attention call's length: a padded row's, or the root mean square of a segmented row's sequences or pairs.
    call = math.isqrt(max(1, mb.attention // max(1, mb.rows * mb.segments)))
    compute = flops["matmul"] / Rates.at(rates.matmul[dtype], work.width, mb.computed) + \
        flops["attention"] / Rates.at(rates.attention[dtype], work.width, call)
    elementwise = mb.computed * work.elementwise * act_bytes * (1 + 2 + again)
    if mb.segments > 1:  # each pair's own mask built once (a byte an entry) and read in each pass; no row mask
        elementwise += mb.attention * (1 + 1 + 2 + again) if mb.masked else 0
    elif mb.masked:  # a byte a score entry, for each pass
        elementwise += mb.rows * mb.length * mb.length * (1 + 2 + again)
    kernels = (work.kernels + work.layers * SEGMENT_KERNELS * (mb.segments - 1)) * (1 + 2 + again)
    draws = mb.computed * work.dropout * (1 + again) / rates.dropout if rates.dropout else 0.0
    # priced by the size of a hidden-wide activation of this micro-batch (the norms', residuals' and RoPE's tensors)
    traffic = rates.elementwise_rate(mb.computed * work.width * act_bytes)
    # QLoRA: bitsandbytes unpacks each 4-bit weight (half a byte an element, with its block scales) into a fresh
    # compute-dtype copy for the forward's matmul and again for the backward's (and the recompute's), whatever the
    # micro-batch's size: a weight-sized write priced at the rate of a tensor that large.
    dequantise = work.dequantised * (0.5 + act_bytes) * (2 + again)
    if dequantise:
        dequantise /= rates.elementwise_rate(work.largest_weight * act_bytes)
    return {"compute": compute, "elementwise": elementwise / traffic + draws + dequantise,
            "kernels": kernels * rates.kernel_seconds + rates.micro_batch_seconds,
            "flops": flops["matmul"] + flops["attention"]}


def _slowest_rank_mean(steps, work: ModelWork, ckpt: bool, rates: Rates, dtype: str, act_bytes: int,
                       sharing: int) -> Dict[str, float]:
    """Per step, the slowest rank's micro-batches' time by term, its FLOPs and the step's tokens (all ranks), averaged
    over the steps. ``sharing``: processes computing on one machine's cores (a CPU's), each at 1/n of the rates."""
    per_step = []
    seen: Dict[MicroBatch, Dict[str, float]] = {}
    for ranks in steps:
        timed = []
        for micro_batches in ranks:
            parts = [seen.get(mb) or seen.setdefault(mb, micro_batch_seconds(mb, work, ckpt, rates, dtype, act_bytes))
                     for mb in micro_batches]
            timed.append({k: sum(p[k] for p in parts) for k in ("compute", "elementwise", "kernels", "flops")}
                         | {"count": len(micro_batches)})
        for t in timed:
            t["compute"] *= sharing
            t["elementwise"] *= sharing
        slowest = max(timed, key=lambda t: t["compute"] + t["elementwise"] + t["kernels"])
        slowest["tokens"] = sum(mb.tokens for r in ranks for mb in r)
        slowest["computed"] = sum(mb.computed for r in ranks for mb in r)
        per_step.append(slowest)
    return {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}


def predict_step_seconds(cfg, plan, steps: Sequence[Sequence[Sequence[MicroBatch]]], rates: Rates,
                         memo: Optional[Dict] = None) -> StepTime:
    """Predicted seconds of one optimizer step of a validated config, averaged over the steps given.

    Args:
        cfg: the typed run config (``rm.foundations.config.RunConfig``): model, LoRA, memory profile, checkpointing.
        plan: its :class:`rm.settings.validate.Plan` (world size, strategy, ZeRO stage, precision, micro-batches).
        steps: per optimizer step, per rank, that rank's micro-batches (:func:`rm.plan.lengths.step_micro_batches`).
        rates: the hardware's rates (:func:`rm.plan.constants.rates_for`).
        memo: a dict kept by the caller for these very ``steps`` and ``rates``: the micro-batches' time, per model
            and numerics, is computed once for every config that passes it (a search times hundreds of layouts
            over the same steps).

    Returns:
        A :class:`StepTime`: the slowest rank's micro-batches (ranks wait for each other at every step) plus the
        optimizer step, offload copies and collectives.
    """
    from rm.memory.terms import parameter_counts
    from rm.foundations.precision import BYTES

    m, profile, numerics = cfg.model, cfg.memory_profile, plan.numerics
    lora = cfg.lora if profile.use_lora else None
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    work = model_work(m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads,
                      m.num_key_value_heads, head_dim, lora.r if lora else None, lora.target_modules if lora else (),
                      lora_dropout=lora.dropout if lora else 0.0, quantized=profile.quantize_base != "none")
    dtype = "float32" if numerics.compute == "float32" else "bfloat16"  # fp16 runs at the bf16 rate
    act_bytes = BYTES[numerics.compute]
    ckpt = cfg.train.gradient_checkpointing
    procs_per_machine = math.ceil(plan.world_size / max(plan.hardware.nodes, 1))

    key = (work, ckpt, dtype, act_bytes, procs_per_machine if rates.shared_cores else 1)
    mean = memo.get(key) if memo is not None else None
    if mean is None:
        mean = _slowest_rank_mean(steps, work, ckpt, rates, dtype, act_bytes, key[-1])
        if memo is not None:
            memo[key] = mean

    # The optimizer step, on the device or (ZeRO-Offload) on the host, and the collectives.
    counts = parameter_counts(m, lora)
    n, deepspeed = plan.world_size, plan.strategy == "deepspeed"
    trained_bytes = numerics.weight_bytes if (lora is None or numerics.master) else 4  # accelerate keeps adapters fp32
    frozen_bytes = numerics.frozen_bytes if lora else numerics.weight_bytes
    elements = math.ceil(counts.trainable / n) if deepspeed else counts.trainable
    state_bytes = 1 if profile.optimizer == "adamw_8bit" else numerics.state_bytes
    # DeepSpeed steps its fp32 master partition with an fp32 copy of the gradient partition
    traffic = adamw_traffic_bytes(elements, 4 if deepspeed else trained_bytes, state_bytes, trained_bytes,
                                  4 if numerics.master else 0)
    procs_per_node = max(1, min(n, plan.hardware.gpus_per_node))
    offload = 0.0
    if profile.offload_optimizer:
        optimizer = traffic / (rates.host_memory / procs_per_node)  # CPU Adam; the node's RAM shared by its processes
        offload = 2 * elements * trained_bytes / rates.host_link  # gradients down, updated weights up
    else:
        optimizer = traffic / rates.memory
    if plan.device == "cpu":  # torch's AdamW and clipping loop over the tensors there (CUDA groups them: foreach)
        optimizer += OPTIMIZER_KERNELS * len(counts.trainable_tensors) * rates.kernel_seconds
    weights_bytes = counts.trainable * trained_bytes + (counts.total - counts.trainable) * frozen_bytes
    micro_batches = mean["count"]
    if deepspeed and plan.zero_stage == 3 and cfg.distributed.offload_params:  # every shard crosses the host link
        offload += micro_batches * (2 + (1 if ckpt else 0)) * weights_bytes / n / rates.host_link
    sent = communication_bytes(plan.strategy, plan.zero_stage, n, round(micro_batches), counts.trainable * trained_bytes,
                               counts.trainable * trained_bytes, weights_bytes, ckpt)
    nodes = math.ceil(n / plan.hardware.gpus_per_node)
    bandwidth = rates.link if nodes <= 1 else rates.inter_node
    communication = sum(sent.values()) / bandwidth
    seconds = mean["compute"] + mean["elementwise"] + mean["kernels"] + optimizer + offload + communication
    return StepTime(seconds=seconds, compute=mean["compute"], elementwise=mean["elementwise"], kernels=mean["kernels"],
                    optimizer=optimizer, offload=offload, communication=communication, flops=mean["flops"],
                    tokens=mean["tokens"], computed_tokens=mean["computed"], pairs=cfg.train.global_batch_size,
                    micro_batches=micro_batches, bytes={"optimizer": traffic, **sent})
