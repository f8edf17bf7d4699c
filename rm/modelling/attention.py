"""SDPA one packed sequence at a time; on CUDA in half precision, one varlen flash call a packed row and layer.

A packed row (``train.packing``, with or without ``train.share_prefix``) holds several independent sequences
(or prefix-shared pairs). Given a mask, SDPA computes the whole ``T x T`` score matrix of the row, the blocks
between different sequences included, though the mask throws them away: a 1,024-token row of eight
128-token sequences computes eight times the attention it needs (an 8,192-token row of twelve, twelve times: on a
1B model that is more attention than all of its matmuls). flash-attention's varlen kernel and flex-attention
skip those blocks, but SDPA, the default, has neither. Here each segment of the row gets its own SDPA call
over its own keys (a causal one for a plain packed sequence, the pair's own mask for a prefix-shared pair),
and the outputs are concatenated: the same scores and the same softmax per query, since
a query's masked-out keys contribute nothing (``tests/modelling/test_attention.py`` checks outputs and gradients).

It plugs in through transformers' ``AttentionInterface``, under the name ``sdpa`` itself, so that the
configured ``model.attn_implementation=sdpa``, the saved config and every consumer stay as they are: the
function is transformers' own SDPA unless the caller passes ``packed_row`` (only
:func:`rm.modelling.model.sequence_rewards` does, for packed rows). In the loop a plain packed sequence's call is
SDPA's causal one, which on a GPU takes its flash kernel in half precision. The segments are read off the row's ids:
by the training step on the host before the batch moves (:func:`rm.modelling.model.host_hints`), elsewhere off the
device (one small copy a micro-batch, which waits for the device).

On a GPU every call, a segment's or a whole padded or prefix-shared row's, keeps off cuDNN's SDPA kernel
(:func:`sdpa_kernels`); :func:`rm.modelling.model.sequence_rewards` registers this module whatever the layout, so that
padded rows get that too.

On CUDA the segments' loop is one SDPA call per segment and layer: hundreds of launches a layer for a long row. Where
flash-attention runs, a packed row's layer is instead ONE call of torch's varlen flash kernel
(``torch.nn.attention.varlen.varlen_attn``), which takes many sequences of one tensor at once (cumulative offsets)
and skips the blocks between them. A plain packed sequence is one varlen sequence (causal, with Mistral's window as
``(window - 1, 0)``, transformers' own flash rule); a prefix-shared pair is two: its prompt and chosen answer
(causal), then its rejected answer against the keys ``[prompt ; rejected answer]``, gathered once a layer by an
index built once a micro-batch on the host (:func:`varlen_layout`). Flash's causal mask is bottom-right aligned when
a sequence has fewer queries than keys: query ``i`` of ``n_q`` sees keys up to ``i + n_k - n_q`` (``mask.h`` of
torch's flash-attention: ``col_idx_limit_right = row + 1 + seqlen_k - seqlen_q + window_right``), so rejected token
``j`` sees the whole prompt and rejected tokens ``0 .. j``: what it sees in its own unshared sequence, window
included. (The loop windows a pair's mask by the row's unshared positions where the layer's window is shorter than the
pair, as every prefix-shared mask form does: :func:`rm.modelling.prefix_sharing.within_window`.) Which path runs where
(:func:`takes_varlen`, the one switch):

* CPU: segmented SDPA, as above (the estimate's trace too, unless it traces a GPU run: below);
* CUDA in fp16 or bf16 (bf16-true's queries, or any under bf16/fp16 autocast, which SDPA would have cast down),
  on Ampere or Hopper, no attention dropout: varlen, one call a layer;
* CUDA fp32 (flash takes half precision only), or attention dropout (the varlen call has none): segmented SDPA.

The memory estimate's trace runs on fake CPU tensors, where :func:`varlen_available` says no; tracing a run whose
device takes the varlen call (:func:`rm.foundations.hardware.attention_kernel` gives ``varlen``), it enters
:func:`estimated_varlen_device`, inside which the kernel counts as available and :func:`takes_varlen` decides on the
traced query as it would on the GPU: the trace then runs ``varlen_attn`` itself, whose fake implementation
(``register_fake`` in ``torch.nn.attention.varlen``) gives its output and log-sum-exp, and whose autograd keeps what
the GPU's keeps (q, the gathered k and v, cumulative offsets, output, log-sum-exp, a 16-byte rng state).

``tests/modelling/test_varlen.py`` checks the layout, and the varlen path on a CPU reference kernel against the
segmented one; ``tests/e2e/test_gpu_varlen.py`` checks the real kernel against the padded path on a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from contextlib import nullcontext
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from rm.foundations.hardware import flash_head_dim

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before the varlen kernel (rm takes torch>=2.4): the segmented loop everywhere
    varlen_attn = None
else:  # the first releases of it took no window and no grouped-query heads
    if not {"window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters):
        varlen_attn = None


class PackedRow:
    """A packed row's segments, as every layer's attention takes them (:func:`segmented_inputs` builds it).

    Attributes:
        bounds: ``0 = b_0 < b_1 < ... < b_n = T``: segment ``i`` is tokens ``b_i .. b_{i+1} - 1``; no query attends
            outside its segment.
        causal: every segment is one causal sequence (plain packing), so each call takes SDPA's ``is_causal`` (the
            triangle) instead of a mask (the square); a segment longer than the model's ``sliding_window``
            (Mistral's, passed by its attention) gets the windowed triangle instead, as transformers' own mask would
            give it.
        masks: per segment, its own ``(1, 1, n, n)`` mask (a prefix-shared pair's), where the segments are not causal
            sequences.
        positions: the row's ``(T,)`` position ids (a prefix-shared pair's are its unshared ones), read only where a
            layer's sliding window is shorter than a pair (:meth:`windowed_mask`).
        varlen: the same segments as varlen sequences (:func:`varlen_layout`, on the query's device): where
            :func:`takes_varlen`, the whole row is one varlen flash call instead of a call per segment.

    One plain object rather than a list and tensors among the layers' keyword arguments, so that ``torch.compile``
    (``train.compile``) passes it through to the eager attention unread: it guards on what it reads of a compiled
    layer's arguments, a list's length included, and would recompile every layer for each new packing.
    """

    __slots__ = ("bounds", "causal", "masks", "varlen", "positions", "_windowed")

    def __init__(self, bounds: Sequence[int], causal: bool = True, masks: Optional[Sequence[torch.Tensor]] = None,
                 varlen: Optional["VarlenLayout"] = None, positions: Optional[torch.Tensor] = None):
        self.bounds, self.causal, self.masks, self.varlen = list(bounds), causal, masks, varlen
        self.positions, self._windowed = positions, {}

    def windowed_mask(self, segment: int, window: int) -> torch.Tensor:
        """Segment ``segment``'s mask less the keys ``window`` or more positions before their query: built once a
        micro-batch and window, then kept (every layer of a Mistral takes the same; checkpointing's recomputation
        too)."""
        key = (segment, window)
        if key not in self._windowed:
            from rm.modelling.prefix_sharing import within_window

            if self.positions is None:
                raise ValueError("a prefix-shared pair longer than the sliding window needs the row's positions")
            start, end = self.bounds[segment], self.bounds[segment + 1]
            self._windowed[key] = self.masks[segment] & within_window(self.positions[start:end], window)
        return self._windowed[key]


def segmented_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                   is_causal: Optional[bool] = None, packed_row: Optional[PackedRow] = None, **kwargs):
    """transformers' SDPA attention, one segment of the (single) row at a time when ``packed_row`` is given.

    Args:
        query, key, value: ``(1, heads, T, head_dim)`` (key and value with the model's key-value heads).
        attention_mask: the row's ``(1, 1, T, T)`` mask, or None; with ``packed_row``, not read.
        packed_row: the row's segments (:class:`PackedRow`).

    Returns:
        ``(attention output (1, T, heads, head_dim), None)``, as transformers' attention functions do.
    """
    if packed_row is None or query.shape[0] != 1:
        with sdpa_kernels(query.device):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    segment_bounds, varlen = packed_row.bounds, packed_row.varlen
    window = kwargs.get("sliding_window")
    if varlen is not None and takes_varlen(query, dropout):
        return varlen_sdpa(query, key, value, varlen, scaling, window), None
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # One split of each tensor, not a slice per segment: a slice's backward writes its gradient into a zero tensor
    # of the whole row, so n slices cost n row-sized fills and adds per tensor and layer (on a GPU, kernel launches
    # a segment and layer); a split's backward is one concatenation.
    sizes = [end - start for start, end in zip(segment_bounds[:-1], segment_bounds[1:])]
    parts = zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
    outputs = []
    with sdpa_kernels(query.device):
        for i, (q, k, v) in enumerate(parts):
            n = sizes[i]
            if packed_row.causal:
                mask = windowed_causal(n, window, query.device) if window and n > window else None
            else:
                mask = packed_row.windowed_mask(i, window) if window and n > window else packed_row.masks[i]
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None and n > 1))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


class VarlenLayout(NamedTuple):
    """A packed row's segments as the sequences of one varlen flash call (:func:`varlen_layout`)."""

    cu_seq_q: torch.Tensor  # (N + 1,) int32: sequence i's queries are the row's tokens cu_seq_q[i] .. cu_seq_q[i+1] - 1
    cu_seq_k: torch.Tensor  # (N + 1,) int32: the same offsets into the keys
    key_index: Optional[torch.Tensor]  # (T_k,) int64: the row's token of each key; None: the keys are the row itself
    max_q: int  # longest sequence's queries
    max_k: int  # and keys

    def to(self, device) -> "VarlenLayout":
        # From pinned memory: an asynchronous copy from pageable memory may wait for the device
        pin = torch.device(device).type == "cuda"
        move = lambda t: None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=True)  # noqa: E731
        cu_seq_q = move(self.cu_seq_q)
        cu_seq_k = cu_seq_q if self.cu_seq_k is self.cu_seq_q else move(self.cu_seq_k)
        return self._replace(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, key_index=move(self.key_index))


def varlen_layout(bounds: Sequence[int], roles: Optional[Sequence[int]] = None) -> Optional[VarlenLayout]:
    """The varlen sequences of a packed row, on the host: a pure function of its segments and roles.

    Plain packing (``roles`` None): each segment is one causal sequence, its own queries and keys. A prefix-shared
    pair (prompt ``p``, chosen answer ``c``, rejected answer ``r`` tokens, in that order) is two: ``A``, queries and
    keys its first ``p + c`` tokens; ``B``, queries its ``r`` rejected tokens and keys ``[prompt ; rejected]``,
    under flash's bottom-right aligned causal mask (rejected token ``j`` sees the prompt and rejected ``0 .. j``).
    The queries stay in row order (``A0, B0, A1, B1, ...`` is the row); a sequence without queries (``r == 0``; ``A``
    of a pair without prompt and chosen answer) is left out. Where no pair needs its keys gathered (each has
    ``p == 0`` or ``r == 0``), the keys are the row itself, as in plain packing.

    Args:
        bounds: the segments, ``[0, ..., T]`` (:func:`segment_bounds`).
        roles: prefix-shared only: the row's roles (``rm.data.collator`` constants), as a list.

    Returns:
        The layout (CPU tensors), or None where a segment's roles are not those of one pair (then the segmented
        loop, which takes any mask, runs).

    Example (the rows of :class:`~rm.data.collator.PrefixSharedCollator`'s example: a pair with ``p, c, r = 2, 1, 2``,
    then one with ``0, 1, 2``):
        >>> plain = varlen_layout([0, 3, 5, 6])
        >>> plain.cu_seq_q, plain.key_index, plain.max_q
        (tensor([0, 3, 5, 6], dtype=torch.int32), None, 3)
        >>> shared = varlen_layout([0, 5, 8], [0, 0, 1, 2, 2, 1, 2, 2])
        >>> shared.cu_seq_q, shared.cu_seq_k
        (tensor([0, 3, 5, 6, 8], dtype=torch.int32), tensor([ 0,  3,  7,  8, 10], dtype=torch.int32))
        >>> shared.key_index  # B0 gathers the prompt (0, 1) and its rejected tokens (3, 4)
        tensor([0, 1, 2, 0, 1, 3, 4, 5, 6, 7])
        >>> shared.max_q, shared.max_k
        (3, 4)
    """
    from rm.modelling.prefix_sharing import pair_parts

    if roles is None:
        sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
        cu = torch.tensor(list(bounds), dtype=torch.int32)
        return VarlenLayout(cu, cu, None, max(sizes), max(sizes))
    q_lengths: List[int] = []
    k_lengths: List[int] = []
    index: List[int] = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        parts = pair_parts(roles[start:end])
        if parts is None:
            return None
        p, c, r = parts
        if p + c:
            q_lengths.append(p + c)
            k_lengths.append(p + c)
            index.extend(range(start, start + p + c))
        if r:
            q_lengths.append(r)
            k_lengths.append(p + r)
            index.extend(range(start, start + p))
            index.extend(range(start + p + c, end))
    cu_q = torch.tensor([0] + q_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if len(index) == bounds[-1]:  # nothing gathered twice: the keys are the row (index == range(T))
        return VarlenLayout(cu_q, cu_q, None, max(q_lengths), max(q_lengths))
    cu_k = torch.tensor([0] + k_lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return VarlenLayout(cu_q, cu_k, torch.tensor(index, dtype=torch.int64), max(q_lengths), max(k_lengths))


def varlen_available(device: torch.device) -> bool:
    """Whether torch's varlen flash kernel can run on ``device``: a CUDA device of compute capability 8.x or 9.x, the
    GPUs torch's flash-attention 2 admits (``flash_api.cpp`` refuses others), and a torch that has the kernel; any
    device inside :func:`estimated_varlen_device` (the estimate's fake tensors stand for such a GPU)."""
    if varlen_attn is None:
        return False
    return bool(_ESTIMATED) or (device.type == "cuda" and _flash_capable(device.index))


# The estimate's assumption, innermost last (estimated_varlen_device): the roles of a fake prefix-shared row (empty:
# plain packing).
_ESTIMATED: List[List[int]] = []


@contextlib.contextmanager
def estimated_varlen_device(roles: Optional[Sequence[int]] = None):
    """Inside, the device counts as one that runs the varlen kernel (:func:`varlen_available`, whatever the tensors'
    device): the memory estimate's trace (``rm.memory.trace``) of a run on a GPU that takes it, whose fake tensors
    are CPU ones. The rest of the switch is unchanged: :func:`takes_varlen` still reads the traced query's dtype,
    head size and dropout, as the GPU run would. Outside it (training, tests), the real device decides.

    Args:
        roles: a prefix-shared packed row's roles (``rm.data.collator`` constants, a list over the row), which fake
            ``roles`` cannot hold: the pairs :func:`segmented_inputs` lays the row out as (the trace's choice of
            pairs, :func:`rm.memory.trace._varlen_roles`). None: plain packing, whose layout needs only the bounds.
    """
    _ESTIMATED.append([] if roles is None else list(roles))
    try:
        yield
    finally:
        _ESTIMATED.pop()


@functools.lru_cache(maxsize=None)
def _flash_capable(index: Optional[int]) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major in (8, 9)


def takes_varlen(query: torch.Tensor, dropout: float) -> bool:
    """The one switch between the varlen call and the segmented loop (module docstring): a query flash takes (fp16 or
    bf16, a head size it has a kernel for) on a device it runs on, and no dropout (the varlen call has none)."""
    return (not dropout and flash_head_dim(query.shape[-1]) and varlen_available(query.device)
            and attention_dtype(query) in (torch.float16, torch.bfloat16))


def attention_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype SDPA would compute in: under autocast (bf16-mixed, 16-mixed) autocast's, whatever the query's. There
    the query is fp32 (RoPE multiplies the bf16 projection by fp32 cos and sin) and SDPA, on autocast's list, casts
    q, k and v down; the varlen kernel is not on that list, so :func:`varlen_sdpa` casts them itself."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def varlen_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: VarlenLayout,
                scaling: Optional[float], window: Optional[int]) -> torch.Tensor:
    """A packed row's attention in one varlen flash call.

    Args:
        query, key, value: ``(1, heads, T, head_dim)``, key and value with the model's key-value heads (flash takes
            grouped-query heads as they are: no ``repeat_kv``).
        layout: :func:`varlen_layout`'s, on the query's device.
        scaling: the softmax scale (None: ``head_dim ** -0.5``).
        window: Mistral's ``sliding_window`` (key ``k`` seen from query ``q`` when ``q - window < k <= q``), or None.

    Returns:
        ``(1, T, heads, head_dim)``.

    Nothing here reads the device's values or depends on them beyond the layout, so checkpointing's recomputation
    saves what the forward saved: the varlen call keeps ``q`` and the (gathered) ``k``, ``v`` for its backward,
    and its output and log-sum-exp.
    """
    dtype = attention_dtype(query)
    # (T, heads, head_dim); contiguous is a no-op after RoPE, which keeps the projection's (T, heads) order
    q = query[0].transpose(0, 1).to(dtype).contiguous()
    k, v = key[0].transpose(0, 1).to(dtype), value[0].transpose(0, 1).to(dtype)
    if layout.key_index is None:
        k, v = k.contiguous(), v.contiguous()
    else:  # a prefix-shared pair's rejected answer reads its prompt's keys again
        k, v = k.index_select(0, layout.key_index), v.index_select(0, layout.key_index)
    out = varlen_attn(q, k, v, layout.cu_seq_q, layout.cu_seq_k, layout.max_q, layout.max_k, scale=scaling,
                      window_size=(window - 1, 0) if window else (-1, 0), enable_gqa=q.shape[1] != k.shape[1])
    return out.unsqueeze(0)


def sdpa_kernels(device: torch.device):
    """The SDPA kernels rm's attention may take: on a GPU, not cuDNN's. Its kernels are fast, but it builds an
    execution graph for every new shape, and the lengths of training change every micro-batch (a padded batch's
    longest row, each segment of a packed row): on an H200 each call cost 2.6 ms of CPU time against 30 us of
    kernel (a prefix-shared packed 1B step took 4.65 s where the padded one took 0.78, docs/gpu.md). A padded
    batch's masked calls, unprofiled, can go the same way: 176 a step in that 1B run (22 layers x 4 micro-batches
    x forward and backward), a new length each micro-batch. Flash (a causal call without a mask, bf16) and
    memory-efficient attention (any mask, or fp32) take any length for free, and are the kernels whose saved
    tensors the memory estimate traces. A CPU keeps its own choice.

    Entered inside the attention function, not around the step, so that checkpointing's recomputation in the
    backward picks the same kernel as the forward did (it must save the same tensors)."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def windowed_causal(length: int, window: int, device) -> torch.Tensor:
    """A causal mask in which a query sees only its last ``window`` keys, itself included (transformers' sliding
    window: key ``k`` is seen from query ``q`` when ``q - window < k <= q``).

    >>> windowed_causal(4, 2, "cpu").int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    ones = torch.ones(length, length, dtype=torch.bool, device=device)
    return ones.tril() & ~ones.tril(-window)


def segmented_inputs(input_ids: torch.Tensor, position_ids: torch.Tensor, pair_ids: Optional[torch.Tensor] = None,
                     roles: Optional[torch.Tensor] = None, bounds: Optional[Sequence[int]] = None,
                     row_roles: Optional[Sequence[int]] = None) -> Optional[Dict]:
    """The model inputs beyond ids and positions that make :func:`segmented_sdpa` take a packed row a segment at a
    time: a stand-in for the row's mask and the row's :class:`PackedRow` (``packed_row``): its bounds, whether each
    segment is one causal sequence (plain packing) or a prefix-shared pair (``pair_ids`` and ``roles`` given) with
    its own mask (from the per-token rule :func:`rm.modelling.prefix_sharing.allowed`), and on a GPU that runs the
    varlen kernel the same segments as its sequences (:func:`varlen_layout`, copied to the device once a
    micro-batch).

    The row's ``T x T`` mask is never built: segmented SDPA reads only each segment's block (the rest would be a
    ``T^2`` fill, 9 MB and several milliseconds for a 3,000-token row, for nothing). transformers still needs a 4D
    mask, which it passes to attention as it is (without one it would read packing off the position ids, and a
    prefix-shared row's positions do not say it): an ``expand`` of one element, no memory.

    Args:
        bounds: the segments, where the ids cannot be read (the estimate's fake tensors) or were read on the host
            (:func:`rm.modelling.model.host_hints`); otherwise read off ``position_ids`` (plain packing) or
            ``pair_ids``.
        row_roles: ``roles[0]`` as a list, read on the host; otherwise read off ``roles``.

    Returns:
        The keyword arguments, or None where the row stays one SDPA call: several rows, a single segment, or fake
        ids without ``bounds``.
    """
    from torch._subclasses.fake_tensor import is_fake

    from rm.modelling.prefix_sharing import allowed, pair_mask

    if input_ids.shape[0] != 1:
        return None
    shared = pair_ids is not None
    if bounds is None and not is_fake(input_ids):
        bounds = segment_bounds(pair_ids if shared else position_ids, starts_at_zero=not shared)
    if bounds is None or len(bounds) <= 2:  # one segment (given as [0, T] by the host's reading): one call
        return None
    length = bounds[-1]
    stand_in = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device).expand(1, 1, length, length)
    row_layout = PackedRow(bounds, causal=not shared, positions=position_ids[0])
    row = None
    if shared:
        row = row_roles if row_roles is not None else None if is_fake(roles) else roles[0].tolist()  # fake: the per-token rule
        if row is None and _ESTIMATED and _ESTIMATED[-1]:  # the estimate's trace of a varlen GPU: its pairs' roles
            row = _ESTIMATED[-1]
        masks = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            mask = pair_mask(row[s:e], input_ids.device) if row is not None else None
            masks.append(mask if mask is not None else allowed(pair_ids[:, s:e], roles[:, s:e]))
        row_layout.masks = masks
    # Built where the kernel can run, whatever the model's dtype (known only inside attention, which decides per call:
    # takes_varlen); the segmented masks above stay for the calls that do not take it (fp32, dropout).
    if varlen_available(input_ids.device) and (row is not None or not shared):
        layout = varlen_layout(bounds, row)
        if layout is not None:
            row_layout.varlen = layout.to(input_ids.device)
    return {"attention_mask": stand_in, "packed_row": row_layout}


def segment_bounds(ids: torch.Tensor, starts_at_zero: bool) -> Optional[list]:
    """Where a packed row's segments start and end, read off its ids (on a GPU, a copy to the host).

    Args:
        ids: ``(1, T)``: position ids (``starts_at_zero``: a segment starts at each 0) or pair ids (a segment
            starts wherever the id changes).

    Returns:
        ``[0, ..., T]``, or None for a row of one segment (nothing to split).

    Example:
        >>> segment_bounds(torch.tensor([[0, 1, 2, 0, 1, 0]]), starts_at_zero=True)
        [0, 3, 5, 6]
        >>> segment_bounds(torch.tensor([[0, 0, 1, 1, 1, -1]]), starts_at_zero=False)
        [0, 2, 5, 6]
    """
    row = ids[0]
    starts = (row == 0) if starts_at_zero else torch.cat([row.new_ones(1, dtype=torch.bool), row[1:] != row[:-1]])
    starts[0] = True
    bounds = starts.nonzero().flatten().tolist() + [row.shape[0]]
    return bounds if len(bounds) > 2 else None


AttentionInterface.register("sdpa", segmented_sdpa)


def keep_attention_eager() -> None:
    """Register this module's attention as a boundary of ``torch.compile`` (``train.compile``): the compiled layers
    run up to it and resume after it, and it runs as it does uncompiled.

    Why: a packed row's segment bounds, and the varlen layout's lengths, are Python numbers that change every
    micro-batch; traced into a compiled layer, each new packing recompiled it (on a CPU, 5 to 23 s a micro-batch
    on the benchmark's 4-layer model; the demo reached dynamo's recompile limit). Eager, it costs one graph break a layer. Registering
    the disabled function under the same name changes nothing for an uncompiled model, so it stays registered.
    """
    AttentionInterface.register("sdpa", torch.compiler.disable(segmented_sdpa))
