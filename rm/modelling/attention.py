"""SDPA one packed sequence at a time.

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
function is transformers' own SDPA unless the caller passes ``segment_bounds`` (only
:func:`rm.modelling.model.sequence_rewards` does, for packed rows). On a GPU a plain packed sequence's call is SDPA's
causal one, which takes its flash kernel; finding the segments reads the row's ids on the host (one small copy
a micro-batch).

On a GPU every call, a segment's or a whole padded or prefix-shared row's, keeps off cuDNN's SDPA kernel
(:func:`sdpa_kernels`); :func:`rm.modelling.model.sequence_rewards` registers this module whatever the layout, so that
padded rows get that too.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward


def segmented_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                   is_causal: Optional[bool] = None, segment_bounds: Optional[Sequence[int]] = None,
                   segments_causal: bool = False, segment_masks: Optional[Sequence[torch.Tensor]] = None, **kwargs):
    """transformers' SDPA attention, one segment of the (single) row at a time when ``segment_bounds`` is given.

    Args:
        query, key, value: ``(1, heads, T, head_dim)`` (key and value with the model's key-value heads).
        attention_mask: the row's ``(1, 1, T, T)`` mask, or None; with ``segment_bounds``, not read.
        segment_bounds: ``0 = b_0 < b_1 < ... < b_n = T``: segment ``i`` is tokens ``b_i .. b_{i+1} - 1``; no
            query attends outside its segment.
        segment_masks: per segment, its own ``(1, 1, n, n)`` mask (a prefix-shared pair's), where the segments are
            not causal sequences.
        segments_causal: every segment is one causal sequence (plain packing), so each call takes SDPA's
            ``is_causal`` (the triangle) instead of a mask (the square); a segment longer than the
            model's ``sliding_window`` (Mistral's, passed by its attention) gets the windowed triangle instead, as
            transformers' own mask would give it.

    Returns:
        ``(attention output (1, T, heads, head_dim), None)``, as transformers' attention functions do.
    """
    if segment_bounds is None or query.shape[0] != 1:
        with sdpa_kernels(query.device):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, is_causal=is_causal, **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    window = kwargs.get("sliding_window")
    # One split of each tensor, not a slice per segment: a slice's backward writes its gradient into a zero tensor
    # of the whole row, so n slices cost n row-sized fills and adds per tensor and layer (on a GPU, kernel launches
    # a segment and layer); a split's backward is one concatenation.
    sizes = [end - start for start, end in zip(segment_bounds[:-1], segment_bounds[1:])]
    parts = zip(query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2))
    outputs = []
    with sdpa_kernels(query.device):
        for i, (q, k, v) in enumerate(parts):
            n = sizes[i]
            if segments_causal:
                mask = windowed_causal(n, window, query.device) if window and n > window else None
            else:
                mask = segment_masks[i]
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None and n > 1))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


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
                     roles: Optional[torch.Tensor] = None, bounds: Optional[Sequence[int]] = None) -> Optional[Dict]:
    """The model inputs beyond ids and positions that make :func:`segmented_sdpa` take a packed row a segment at a
    time: its ``segment_bounds``, whether each segment is one causal sequence (plain packing) or a prefix-shared pair
    (``pair_ids`` and ``roles`` given) with its own mask (``segment_masks``, from the per-token rule
    :func:`rm.modelling.prefix_sharing.allowed`), and a stand-in for the row's mask.

    The row's ``T x T`` mask is never built: segmented SDPA reads only each segment's block (the rest would be a
    ``T^2`` fill, 9 MB and several milliseconds for a 3,000-token row, for nothing). transformers still needs a 4D
    mask, which it passes to attention as it is (without one it would read packing off the position ids, and a
    prefix-shared row's positions do not say it): an ``expand`` of one element, no memory.

    Args:
        bounds: the segments, where the ids cannot be read (the estimate's fake tensors); otherwise read off
            ``position_ids`` (plain packing) or ``pair_ids``.

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
    if bounds is None:
        return None
    length = bounds[-1]
    stand_in = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device).expand(1, 1, length, length)
    out = {"attention_mask": stand_in, "segment_bounds": list(bounds), "segments_causal": not shared}
    if shared:
        row = None if is_fake(roles) else roles[0].tolist()  # fake ids (the estimate's trace): the per-token rule
        masks = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            mask = pair_mask(row[s:e], input_ids.device) if row is not None else None
            masks.append(mask if mask is not None else allowed(pair_ids[:, s:e], roles[:, s:e]))
        out["segment_masks"] = masks
    return out


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
