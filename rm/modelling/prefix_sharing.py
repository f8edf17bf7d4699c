"""The attention mask of prefix-shared pairs (``train.share_prefix``), for each attention implementation.

A row built by :class:`~rm.data.collator.PrefixSharedCollator` holds, per pair, ``prefix + chosen
suffix + rejected suffix`` (and, when packed, several pairs one after another). A query may attend
to a key when all of these hold:

* causal: the key is not after the query;
* same pair: the key belongs to the query's pair (padding is a pair of its own, ``-1``, so a pad
  query still sees itself and its softmax stays finite);
* the rejected suffix does not see the chosen suffix that sits between it and the prefix.

Every token then sees exactly the tokens it would see in its own unshared sequence, with the same
position ids (the collator continues the rejected suffix's positions from the prefix end), so the
rewards are those of the unshared computation up to floating-point summation order.

A model with a sliding window (Mistral's ``sliding_window``; Qwen2's on its ``sliding_attention`` layers) adds a
fourth rule, as its own mask does on an unshared sequence: the key is fewer than ``window`` positions before the
query. The position ids are the unshared ones, so the rule reads them (:func:`within_window`). A window no row
reaches (Mistral-7B's 4,096 with ``data.max_length`` at most that) adds nothing, and is not built.

One rule, three forms, chosen by the model's ``attn_implementation``:

* ``sdpa``: a boolean ``(rows, 1, T, T)`` mask, True where attention is allowed; transformers passes
  a 4D mask to the kernel as it is. A packed row never builds it: its pairs go to SDPA one at a time, each with its
  own block of the mask, or on CUDA in half precision to one varlen flash call a layer, two causal sequences a pair
  (``rm.modelling.attention``);
* ``eager``: the same as an additive float mask (0 allowed, the dtype's minimum elsewhere), since
  eager attention adds the mask to the scores;
* ``flex_attention``: a ``BlockMask`` built from the rule itself (``create_block_mask``), which
  lets the kernel skip every fully masked 128 x 128 block (other pairs, and the rejected suffix
  against the chosen one): the route of Wang & Hegde (arXiv 2410.20305). It needs a GPU to be fast;
  on a CPU it is compiled through inductor and far slower than SDPA.

flash-attention 2 takes no arbitrary mask; ``rm.settings.validate`` refuses it with ``train.share_prefix``.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from rm.data.collator import CHOSEN, PREFIX, REJECTED

MASKABLE = ("sdpa", "eager", "flex_attention")


def allowed(pair_ids: torch.Tensor, roles: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
            window: Optional[int] = None) -> torch.Tensor:
    """Boolean ``(rows, 1, T, T)``: may query ``q`` (dim 2) attend to key ``k`` (dim 3).

    Args:
        pair_ids: ``(rows, T)`` pair index of each token, -1 on padding.
        roles: ``(rows, T)`` ``PREFIX``, ``CHOSEN``, ``REJECTED`` or ``PAD`` per token.
        position_ids, window: the model's sliding window and the row's (unshared) positions; None: no window.

    Example (one pair: prefix 2 tokens, chosen suffix 1, rejected suffix 2):
        >>> allowed(torch.tensor([[0, 0, 0, 0, 0]]), torch.tensor([[0, 0, 1, 2, 2]]))[0, 0].int()
        tensor([[1, 0, 0, 0, 0],
                [1, 1, 0, 0, 0],
                [1, 1, 1, 0, 0],
                [1, 1, 0, 1, 0],
                [1, 1, 0, 1, 1]], dtype=torch.int32)
    """
    length = pair_ids.shape[-1]
    positions = torch.arange(length, device=pair_ids.device)
    causal = positions[None, :] <= positions[:, None]  # (q, k)
    same_pair = pair_ids[:, :, None] == pair_ids[:, None, :]
    rejected_sees_chosen = (roles[:, :, None] == REJECTED) & (roles[:, None, :] == CHOSEN)
    rule = (causal & same_pair & ~rejected_sees_chosen).unsqueeze(1)
    return rule if window is None else rule & within_window(position_ids, window).unsqueeze(1)


def within_window(position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """Boolean ``(..., T, T)``: key ``k`` is fewer than ``window`` positions before query ``q`` (transformers' sliding
    window: ``q - window < k``, with causality left to the other rules). On a prefix-shared row the positions are
    each token's in its own unshared sequence, so where the other rules allow a key this is the unshared distance.

    >>> within_window(torch.tensor([0, 1, 2, 1, 2]), 2).int()  # a prompt of 1 token, then two 2-token answers
    tensor([[1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1],
            [1, 1, 1, 1, 1],
            [0, 1, 1, 1, 1]], dtype=torch.int32)
    """
    return position_ids[..., :, None] - position_ids[..., None, :] < window


def mask_windows(config) -> Dict[Optional[str], Optional[int]]:
    """The sliding windows a model's layers take, keyed as its forward takes their masks: ``{None: window}`` where
    one mask serves every layer (Llama: no window; Mistral: ``sliding_window`` on every layer, or none), and
    ``{"full_attention": None, "sliding_attention": window}`` where the layers differ (Qwen2's ``layer_types``
    with ``use_sliding_window``), whose model takes a dict of masks by layer type.

    >>> from transformers import MistralConfig, Qwen2Config
    >>> mask_windows(MistralConfig(sliding_window=8)), mask_windows(MistralConfig(sliding_window=None))
    ({None: 8}, {None: None})
    >>> mask_windows(Qwen2Config(use_sliding_window=True, sliding_window=8, num_hidden_layers=4, max_window_layers=2))
    {'full_attention': None, 'sliding_attention': 8}
    """
    window = getattr(config, "sliding_window", None)
    types = set(getattr(config, "layer_types", None) or ())
    if not window or (types and "sliding_attention" not in types):
        return {None: None}
    if types and types != {"sliding_attention"}:
        return {layer_type: window if layer_type == "sliding_attention" else None for layer_type in sorted(types)}
    return {None: window}


def pair_mask(roles: Sequence[int], device) -> Optional[torch.Tensor]:
    """The ``(1, 1, n, n)`` mask of one prefix-shared pair from its roles (prompt, chosen answer, rejected answer, in
    that order; an answer may be empty): the causal triangle less the rejected answer's view of the chosen one. What
    :func:`allowed` gives it, in two passes over ``n^2`` instead of its several. None where the
    roles are not in that order (a row's padding): the per-token rule decides there.

    >>> pair_mask([0, 1, 2, 2], "cpu")[0, 0].int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 0, 1, 0],
            [1, 0, 1, 1]], dtype=torch.int32)
    """
    parts = pair_parts(roles)
    if parts is None:
        return None
    prompt, chosen, _ = parts
    mid = prompt + chosen
    mask = torch.ones((1, 1, len(roles), len(roles)), dtype=torch.bool, device=device).tril_()
    mask[:, :, mid:, prompt:mid] = False
    return mask


def pair_parts(roles: Sequence[int]) -> Optional[Tuple[int, int, int]]:
    """The lengths of one prefix-shared pair's prompt, chosen answer and rejected answer, read off its roles; None
    where the roles are not those of one pair in that order (or there are none).

    >>> pair_parts([0, 0, 1, 2, 2]), pair_parts([1, 2]), pair_parts([0, 0]), pair_parts([0, 2, 1])
    ((2, 1, 2), (0, 1, 1), (2, 0, 0), None)
    """
    prompt = next((i for i, r in enumerate(roles) if r != PREFIX), len(roles))
    mid = next((i for i in range(prompt, len(roles)) if roles[i] != CHOSEN), len(roles))
    if not roles or any(r != REJECTED for r in roles[mid:]):
        return None
    return prompt, mid - prompt, len(roles) - mid


def shared_prefix_mask(
    pair_ids: torch.Tensor, roles: torch.Tensor, attn_implementation: str, dtype: torch.dtype,
    position_ids: Optional[torch.Tensor] = None, windows: Optional[Dict[Optional[str], Optional[int]]] = None,
) -> Union[torch.Tensor, "torch.nn.attention.flex_attention.BlockMask", Dict[str, object]]:
    """The mask of prefix-shared rows in the form ``attn_implementation`` takes, on the ids' device.

    Args:
        pair_ids: ``(rows, T)`` pair index of each token, -1 on padding.
        roles: ``(rows, T)`` role of each token (``rm.data.collator`` constants).
        attn_implementation: the model's: ``sdpa``, ``eager`` or ``flex_attention``.
        dtype: the model's compute dtype (the additive mask of eager attention is in it).
        position_ids: ``(rows, T)``, the collator's (unshared) positions; read only where a window binds.
        windows: the model's :func:`mask_windows`; None: no window.

    Returns:
        A boolean or additive ``(rows, 1, T, T)`` tensor, or a flex-attention ``BlockMask``; where the model's layers
        take different windows, one of them per layer type, in a dict (the form such a model's forward takes).

    Raises:
        ValueError: an attention implementation that takes no custom mask (flash-attention 2).
    """
    if attn_implementation not in MASKABLE:
        raise ValueError(f"attn_implementation={attn_implementation!r} takes no custom attention mask; "
                         f"prefix sharing needs one of {', '.join(MASKABLE)}")
    length = pair_ids.shape[-1]
    # A window no row reaches is the plain rule: build that once, for every layer type
    windows = {key: w if w is not None and w < length else None for key, w in (windows or {None: None}).items()}
    built: Dict[Optional[int], object] = {}
    for window in windows.values():
        if window in built:
            continue
        if attn_implementation == "flex_attention":
            built[window] = block_mask(pair_ids, roles, position_ids, window)
            continue
        rule = allowed(pair_ids, roles, position_ids, window)
        if attn_implementation == "eager":
            rule = torch.zeros(rule.shape, dtype=dtype, device=pair_ids.device).masked_fill_(~rule, torch.finfo(dtype).min)
        built[window] = rule
    if None in windows:
        return built[windows[None]]
    return {layer_type: built[window] for layer_type, window in windows.items()}


def block_mask(pair_ids: torch.Tensor, roles: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
               window: Optional[int] = None):
    """A flex-attention ``BlockMask`` of the same rule; blocks in which nothing is allowed are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = pair_ids.shape

    def rule(b, h, q, k):
        return (k <= q) & (pair_ids[b, q] == pair_ids[b, k]) & ~((roles[b, q] == REJECTED) & (roles[b, k] == CHOSEN))

    def windowed(b, h, q, k):
        return rule(b, h, q, k) & (position_ids[b, q] - position_ids[b, k] < window)

    # Two functions, not one that branches on the window: one that holds no window compiles as it did without
    # (inductor's CPU code for flex attention failed to compile from the branching one, torch 2.13)
    return create_block_mask(rule if window is None else windowed, B=rows, H=None, Q_LEN=length, KV_LEN=length,
                             device=pair_ids.device)


def attn_implementation_of(model: torch.nn.Module) -> str:
    """The attention implementation of a model, through DDP, DeepSpeed and PEFT wrappers."""
    return base_config(model)._attn_implementation


def base_config(model: torch.nn.Module):
    """The transformers config of a model, through DDP, DeepSpeed and PEFT wrappers."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model.config


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (the compute dtype of its layers)."""
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def prefix_ratio(chosen_lengths, rejected_lengths, prefix_lengths) -> float:
    """Shared prefix tokens : suffix tokens over a set of pairs (each prefix counted once).

    Example:
        >>> prefix_ratio([10, 8], [12, 8], [6, 8])  # suffixes 4 + 6 and 0 + 0; prefixes 6 + 8
        1.4
    """
    prefix = sum(prefix_lengths)
    suffix = sum(chosen_lengths) + sum(rejected_lengths) - 2 * prefix
    return prefix / suffix if suffix else float("inf")
