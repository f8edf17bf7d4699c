"""Activation memory of a training step, measured by tracing the real model with fake tensors.

Weights, gradients and optimizer states are plain arithmetic; activations are not.
What autograd keeps for backward depends on the exact transformers code path
(the fp32 upcast inside RMSNorm, SDPA's choice between ``enable_gqa`` and
``repeat_kv``, the reward head scoring every position, peft's dropout and dtype
casts, non-reentrant checkpointing), so a closed formula such as the paper's
``34*s*b*h`` bytes per layer is wrong by a wide margin for Hugging Face models:
bf16 Mistral-7B keeps ``49.03*s*b*h`` per layer without padding (SDPA ``is_causal``
with ``enable_gqa``), ``52.28*s*b*h`` with padding (a 4D mask, K/V repeated to all
heads) and ``54.03*s*b*h`` once ``seq_len`` reaches the default 4096 sliding
window. Instead we *run* one training step of a
two-layer copy of the model under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(tensors carry shapes and dtypes but no memory and no data), record every storage
allocated and freed, and extrapolate to ``num_layers``.

Why two layers and not one: layer 0 is special. ``MistralModel.forward`` keeps the
embedding output alive in its ``inputs_embeds`` local for the whole forward, and
under LoRA the embedding output does not require grad so layer 0's first norm
saves nothing. Layer 1 of the traced model is a steady-state layer: its input is
the previous layer's output and is released by the caller's reassignment, exactly
like layers ``1..L-1`` of the real model. Every quantity that happens "while
layer j is live" is then a steady-layer quantity plus ``(j-1)`` times the
per-layer increment, which makes the extrapolation exact (the tests compare it
with a real step).

Accounting: the number returned is the peak over the step of the bytes of live
tensor storages allocated during the step, excluding parameter gradients (the
caller adds weights and gradients itself). Pre-existing tensors (weights,
buffers, the token ids) are not counted. The transient peak inside one kernel
(cuBLAS / SDPA workspaces, a contiguous copy made inside a CPU matmul) is
invisible to tensor-level tracking and is not included; on the CPU the allocator
saw at most 1% more than the tensors (bf16 LoRA), and none in fp32.

Limits: the trace runs the CPU kernels (fake CUDA tensors abort on CPU-only torch
builds). Only SDPA's kernel choice differs by device in what it saves: the CPU
flash kernel and CUDA's flash / memory-efficient kernels all keep the output and
an fp32 log-sum-exp of ``B*H*T`` (CUDA's efficient kernel pads ``T`` to 32), so
the difference is a few bytes per token. ``flash_attention_2`` cannot be traced.

Public API: :class:`LayerShape`, :class:`LayerMemory`, :func:`measure_layer`,
:func:`estimate_activations`, :func:`shape_from_model_config`.
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_SUPPORTED_ATTN = ("sdpa", "eager")


@dataclass(frozen=True)
class LayerShape:
    """The numbers that fix a decoder layer's activation memory; hashable, so traces can be cached.

    Attributes:
        model_type: transformers ``model_type``: ``mistral`` | ``llama`` | ``qwen2``.
        hidden_size: model width ``h``.
        intermediate_size: MLP width.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA when fewer than the query heads).
        head_dim: per-head width; ``None`` means ``hidden_size // num_attention_heads``.
        vocab_size: only sizes the (fake) embedding; it does not change activations.
        rms_norm_eps: RMSNorm epsilon (no effect on memory, kept for a faithful config).
        rope_theta: RoPE base (no effect on memory).
        extra: further ``(key, value)`` config entries passed to ``AutoConfig.for_model``
            as they are, e.g. ``(("sliding_window", None),)``. Left empty, the config
            takes transformers' defaults for the model type, as ``rm.model`` does.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: Optional[int] = None
    vocab_size: int = 32000
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    extra: Tuple[Tuple[str, Any], ...] = ()

    def config(self, num_layers: int, attn_implementation: str, pad_token_id: int = 0):
        """A transformers config of this shape with ``num_layers`` layers, one output, no KV cache."""
        from transformers import AutoConfig

        config = AutoConfig.for_model(
            self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            num_labels=1,
            pad_token_id=pad_token_id,
            use_cache=False,
            **dict(self.extra),
        )
        config._attn_implementation = attn_implementation
        return config


def shape_from_model_config(model_cfg) -> LayerShape:
    """The :class:`LayerShape` of an ``rm.config.ModelConfig`` (or any object with the same fields)."""
    return LayerShape(
        model_type=model_cfg.model_type,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim,
        vocab_size=model_cfg.vocab_size,
        rms_norm_eps=model_cfg.rms_norm_eps,
        rope_theta=model_cfg.rope_theta,
    )


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer's activation memory, and the parts of the step outside the layers, in bytes.

    Attributes:
        saved_bytes: what one steady-state layer adds to live memory between its
            forward and its backward (what accumulates per layer in a stack). With
            gradient checkpointing this is (about) the layer's input only.
        first_layer_saved_bytes: the same for layer 0, which differs (see module doc).
        forward_transient_bytes: peak inside one layer's forward above what was live
            before it.
        backward_transient_bytes: peak inside one layer's backward (with checkpointing:
            its recompute plus backward) above what was live when all of this layer's
            saved tensors still were.
        pre_layers_bytes: live before layer 0 runs: embedding output, RoPE cos/sin,
            position ids, the 4D mask when one is built; alive for the whole forward.
        head_saved_bytes: what the final norm, the score head (all positions), the
            reward gather and the loss keep from the end of forward to their backward.
        head_transient_bytes: the peak from the final norm to the start of the last
            layer's backward above ``head_saved_bytes`` (forward of the head and loss,
            and their backward).
        last_backward_bytes: peak from layer 0's backward to the end of the step (it
            never sets the peak of a deep model; kept for completeness).
        traced_layers: layers in the model that was traced (2, or 1 for a one-layer model).
    """

    saved_bytes: int
    first_layer_saved_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int
    pre_layers_bytes: int
    head_saved_bytes: int
    head_transient_bytes: int
    last_backward_bytes: int
    traced_layers: int

    @property
    def checkpointed_saved_bytes(self) -> int:
        """Alias of ``saved_bytes``, to read naturally for a checkpointed measurement."""
        return self.saved_bytes

    @property
    def recompute_peak_bytes(self) -> int:
        """Alias of ``backward_transient_bytes``: with checkpointing, the recompute + backward peak of one layer."""
        return self.backward_transient_bytes


class StorageTimeline(TorchDispatchMode):
    """Records every tensor storage created by an aten op and when it is freed.

    Works the same for real and fake tensors: a new storage is noticed on the output
    of the op that created it, its death through a weak reference (torch keeps the
    Python storage object alive as long as the C++ storage lives, so the callback
    fires exactly when the memory would be released). Views share their base's
    storage and are not counted twice.

    Usage: :meth:`ignore` the tensors that exist before the step, run the step inside
    ``with timeline:``, :meth:`mark` phase boundaries, then :meth:`exclude` the
    storages that are not activations (parameter gradients) and read :meth:`live`.
    """

    def __init__(self):
        super().__init__()
        self._live: Dict[int, Tuple[int, weakref.ref]] = {}  # storage _cdata -> (storage id, weakref)
        self._sizes: List[int] = []  # storage id -> bytes; -1 for pre-existing storages
        self._events: List[Tuple[int, int]] = []  # (storage id, +bytes or -bytes), in order
        self.marks: Dict[str, int] = {}  # name -> number of events before it
        self._excluded: set = set()

    def _register(self, t: torch.Tensor, counted: bool) -> None:
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # e.g. sparse tensors: none occur in these models
            return
        key = st._cdata
        if key in self._live:
            return
        sid = len(self._sizes)
        nbytes = st.nbytes() if counted else -1
        self._sizes.append(nbytes)
        if counted:
            self._events.append((sid, nbytes))
        # The weakref must be kept alive itself or its callback never runs.
        self._live[key] = (sid, weakref.ref(st, functools.partial(self._freed, key, sid)))

    def _freed(self, key: int, sid: int, _ref) -> None:
        if self._live.get(key, (None,))[0] == sid:
            del self._live[key]
        if self._sizes[sid] >= 0:
            self._events.append((sid, -self._sizes[sid]))

    def ignore(self, tensors) -> None:
        """Treat the storages of ``tensors`` (weights, buffers, inputs) as existing before the step: never counted."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._register(t, counted=False)

    def exclude(self, tensors) -> None:
        """Remove storages (parameter gradients) from the count, over the whole timeline."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                entry = self._live.get(t.untyped_storage()._cdata)
                if entry is not None:
                    self._excluded.add(entry[0])

    def mark(self, name: str) -> None:
        """Note a phase boundary at the current point of the timeline."""
        self.marks[name] = len(self._events)

    def live(self) -> List[int]:
        """Counted live bytes after each event; ``live()[i]`` is the value once ``i+1`` events happened.

        Prepended with 0, so that index ``marks[name]`` is the value at that mark.
        """
        out, cur = [0], 0
        for sid, delta in self._events:
            if sid not in self._excluded:
                cur += delta
            out.append(cur)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._register(t, counted=True)
        return out


def _no_packed_sequences(position_ids):
    """Stand-in for ``transformers.masking_utils.find_packed_sequence_indices``: the step has no packing.

    transformers treats fake tensors as tracing and then cannot read the position ids,
    so it assumes they may be packed and builds a packed-sequence mask (about 17% more
    memory than the real step). Our batches are padded, never packed.
    """
    return None


def _shared_prefix_masker(shared_prefix: bool, attn_implementation: str, dtype: torch.dtype, pair_ids, roles):
    """Adds the prefix-shared 4D mask to the model inputs, built the way ``rm.model`` builds it; identity otherwise."""
    if not shared_prefix:
        return lambda inputs: inputs
    from rm.prefix_sharing import shared_prefix_mask

    return lambda inputs: {**inputs, "attention_mask": shared_prefix_mask(pair_ids, roles, attn_implementation, dtype)}


def _peft_wrap(model, lora_r: int, lora_targets: Tuple[str, ...], lora_alpha: int, lora_dropout: float):
    """Wrap with LoRA exactly as ``rm.model.apply_memory_profile`` does (peft defaults, task SEQ_CLS).

    peft's default ``autocast_adapter_dtype=True`` keeps bf16/fp16 adapters in fp32,
    which makes every adapted linear cast its input to fp32: part of what we measure.
    """
    from peft import LoraConfig, TaskType, get_peft_model

    cfg = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(lora_targets),
    )
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, cfg)


def _build(shape, num_layers, dtype, gradient_checkpointing, attn_implementation, lora_r, lora_targets, lora_alpha,
           lora_dropout):
    """The reward model as the trainer builds it; call inside FakeTensorMode for a weightless copy."""
    from transformers import AutoModelForSequenceClassification

    config = shape.config(num_layers, attn_implementation)
    previous = torch.get_default_dtype()
    # Built directly in the compute dtype: a fake model cannot be cast with .to() afterwards.
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(previous)
    if gradient_checkpointing:
        # The call rm.model makes (non-reentrant); its deprecation warning is transformers' business.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    if lora_r > 0:
        model = _peft_wrap(model, lora_r, lora_targets, lora_alpha, lora_dropout)
    return model


def _materialize_fake(model: torch.nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor (call inside FakeTensorMode).

    Shared tensors stay shared; ``requires_grad`` is kept, so frozen LoRA bases stay frozen.
    """
    memo: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad)
                module._parameters[name] = memo[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
                module._buffers[name] = memo[id(b)]


def _layers_of(model) -> torch.nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def _final_norm_of(model) -> torch.nn.Module:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.norm


def pairwise_loss(rewards: torch.Tensor) -> torch.Tensor:
    """The training loss on a micro-batch laid out ``[chosen..., rejected...]`` (``rm.loss``'s Bradley-Terry).

    An odd batch (not a pairwise layout) uses ``-logsigmoid(r).mean()``: the loss
    touches only ``batch`` numbers, so its memory is negligible either way.
    """
    from rm.loss import bradley_terry_loss

    if rewards.shape[0] % 2 == 0:
        half = rewards.shape[0] // 2
        return bradley_terry_loss(rewards[:half], rewards[half:])
    return -torch.nn.functional.logsigmoid(rewards.float()).mean()


@dataclass(frozen=True)
class _Trace:
    """Live activation bytes at the phase boundaries of one traced step, and the peak of each phase."""

    num_layers: int
    at: Dict[str, int]  # live bytes at each mark
    peak: Dict[str, int]  # peak live bytes within each phase (from its mark to the next)


_PHASES_2 = ("start", "layer0", "layer1", "norm", "backward", "layer1_bwd", "layer0_bwd", "end")
_PHASES_1 = ("start", "layer0", "norm", "backward", "layer0_bwd", "end")


@functools.lru_cache(maxsize=256)
def _trace(shape: LayerShape, num_layers: int, batch: int, seq_len: int, dtype: torch.dtype,
           gradient_checkpointing: bool, attn_implementation: str, lora_r: int, lora_targets: Tuple[str, ...],
           lora_alpha: int, lora_dropout: float, padded: bool, accumulating: bool = False, packed: bool = False,
           shared_prefix: bool = False) -> _Trace:
    """Run one forward+backward of a ``num_layers``-layer fake model and time-stamp its phases.

    ``packed``: one row of ``seq_len`` tokens holding several sequences (``train.packing``): no
    mask, position ids restarting per sequence, from which transformers builds a block-diagonal
    (1,1,T,T) mask. Under fake tensors it cannot read the position ids and takes that packed
    path anyway, which here is the real one.

    ``shared_prefix``: ``batch`` rows of prefix-shared pairs (``train.share_prefix``): the 4D mask is
    built from per-token pair ids and roles inside the step, as ``rm.model.sequence_rewards`` does,
    so it and its intermediates are counted; transformers passes it to attention as it is.
    """
    import contextlib
    from unittest import mock

    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    if attn_implementation not in _SUPPORTED_ATTN:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} cannot be traced on the CPU; supported: {_SUPPORTED_ATTN}"
        )
    timeline = StorageTimeline()
    # Built on the meta device, then given fake CPU tensors: peft moves its fresh adapters with
    # ``.to()``, which cannot swap fake parameters, but works on meta ones.
    with torch.device("meta"):
        model = _build(shape, num_layers, dtype, gradient_checkpointing, attn_implementation, lora_r, lora_targets,
                       lora_alpha, lora_dropout)
    no_packing = mock.patch.object(masking_utils, "find_packed_sequence_indices", _no_packed_sequences)
    with FakeTensorMode(), contextlib.nullcontext() if packed else no_packing:
        _materialize_fake(model)
        # pad id 0 never appears in the ids, so the reward is read at the last position (as with right
        # padding and one pad token, the cost of the gather does not depend on where it reads).
        input_ids = torch.ones(batch, seq_len, dtype=torch.long)
        # No mask and a mask of all ones take the same path (transformers drops an all-ones mask and
        # SDPA runs is_causal with enable_gqa). With padding the mask cannot be dropped: transformers
        # builds a (B,1,T,T) boolean mask and SDPA repeats K/V to all heads, which costs more. Under
        # fake tensors transformers cannot read the mask, so passing one reproduces the padded path.
        attention_mask = torch.ones(batch, seq_len, dtype=torch.long) if padded and not packed else None
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if packed:
            inputs = {"input_ids": input_ids, "position_ids": torch.arange(seq_len).unsqueeze(0)}
        pair_ids = roles = None
        if shared_prefix:
            inputs = {"input_ids": input_ids, "position_ids": torch.arange(seq_len).expand(batch, -1)}
            pair_ids, roles = torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch, seq_len, dtype=torch.long)
        with_mask = _shared_prefix_masker(shared_prefix, attn_implementation, dtype, pair_ids, roles)
        if accumulating:
            # A first micro-batch leaves .grad allocated; in the next one autograd adds each new
            # gradient into it and frees the new one, a transient we want on the timeline.
            pairwise_loss(model(**with_mask(inputs)).logits.squeeze(-1)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        timeline.ignore(list(model.parameters()) + list(model.buffers()) + grads + list(inputs.values())
                        + [t for t in (pair_ids, roles) if t is not None])
        del grads

        layers = _layers_of(model)
        handles = []

        def on_layer_start(index):
            return lambda module, args: timeline.mark(f"layer{index}")

        def on_layer_end(index):
            # The gradient of layer i's output arrives when layer i's backward starts.
            def hook(module, args, output):
                out = output[0] if isinstance(output, tuple) else output
                if out.requires_grad:
                    out.register_hook(lambda grad: timeline.mark(f"layer{index}_bwd"))

            return hook

        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(on_layer_start(index)))
            handles.append(layer.register_forward_hook(on_layer_end(index)))
        handles.append(_final_norm_of(model).register_forward_pre_hook(lambda module, args: timeline.mark("norm")))
        # No cyclic collection in the middle of the step: a tensor caught in a reference cycle then
        # stays alive until the step ends, the worst case of what a real run may see.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with timeline:
                timeline.mark("start")
                rewards = model(**with_mask(inputs)).logits.squeeze(-1)
                loss = pairwise_loss(rewards)
                del rewards
                timeline.mark("backward")
                loss.backward()
                del loss
                timeline.mark("end")
        finally:
            for handle in handles:
                handle.remove()
            if gc_was_enabled:
                gc.enable()
        timeline.exclude([p.grad for p in model.parameters() if p.grad is not None])
        live = timeline.live()
        del model
    phases = _PHASES_2 if num_layers == 2 else _PHASES_1
    missing = [name for name in phases if name not in timeline.marks]
    if missing:
        raise RuntimeError(f"trace lacks phase marks {missing}: the model's code path is not the one expected")
    bounds = [timeline.marks[name] for name in phases] + [len(live) - 1]
    at = {name: live[timeline.marks[name]] for name in phases}
    peak = {name: max(live[lo : hi + 1]) for name, lo, hi in zip(phases, bounds[:-1], bounds[1:])}
    at["final"] = live[-1]
    return _Trace(num_layers=num_layers, at=at, peak=peak)


def measure_layer(
    shape: LayerShape,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    gradient_checkpointing: bool,
    attn_implementation: str = "sdpa",
    lora_r: int = 0,
    lora_targets: tuple = (),
    *,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    padded: bool = False,
    accumulating: bool = False,
    packed: bool = False,
    shared_prefix: bool = False,
) -> LayerMemory:
    """Measure one decoder layer (and the parts outside the layers) by tracing a fake two-layer model.

    Args:
        shape: the model's shape.
        batch: sequences per micro-batch (a pairwise micro-batch of P pairs is 2P).
        seq_len: padded sequence length.
        dtype: compute dtype of weights and activations.
        gradient_checkpointing: non-reentrant checkpointing of every layer, as ``rm.model`` enables it.
        attn_implementation: ``sdpa`` or ``eager``.
        lora_r: LoRA rank; 0 means full fine-tuning.
        lora_targets: module names that get adapters, e.g. ``("q_proj", "v_proj")``.
        lora_alpha: LoRA alpha (no effect on memory).
        lora_dropout: LoRA dropout; above 0 each adapter keeps a dropped copy of its input and a mask.
        padded: whether some sequences are padded. False (no pad token in the batch)
            lets transformers drop the mask and SDPA use ``is_causal`` + ``enable_gqa``;
            True builds a (B,1,T,T) mask and repeats K and V to all heads (more memory).
        accumulating: gradients are already allocated by an earlier micro-batch of the
            same optimizer step (gradient accumulation). Autograd then materialises each
            new parameter gradient, adds it in place and frees it: a transient of up to a
            few parameter-sized tensors that the first micro-batch does not have (there the
            new gradient becomes ``.grad`` itself and is excluded as a gradient).
        packed: ``batch`` 1 row of ``seq_len`` tokens holding several sequences (``train.packing``):
            position ids restart per sequence and transformers builds a block-diagonal mask.
        shared_prefix: ``batch`` rows of prefix-shared pairs (``train.share_prefix``) with their 4D mask.

    Returns:
        A :class:`LayerMemory`; cached per distinct arguments.
    """
    args = (shape, 2, batch, seq_len, dtype, gradient_checkpointing, attn_implementation, lora_r,
            tuple(lora_targets), lora_alpha, lora_dropout, padded, accumulating, packed, shared_prefix)
    trace = _trace(*args)
    at, peak = trace.at, trace.peak
    saved = at["norm"] - at["layer1"]
    return LayerMemory(
        saved_bytes=saved,
        first_layer_saved_bytes=at["layer1"] - at["layer0"],
        forward_transient_bytes=peak["layer1"] - at["layer1"],
        backward_transient_bytes=peak["layer1_bwd"] - at["norm"],
        pre_layers_bytes=at["layer0"],
        head_saved_bytes=at["backward"] - at["norm"],
        head_transient_bytes=max(peak["norm"], peak["backward"]) - at["backward"],
        last_backward_bytes=max(peak["layer0_bwd"], peak["end"]),
        traced_layers=2,
    )


def estimate_activations(
    shape: LayerShape,
    num_layers: int,
    batch: int,
    seq_len: int,
    dtype: torch.dtype,
    gradient_checkpointing: bool,
    attn_implementation: str = "sdpa",
    lora_r: int = 0,
    lora_targets: tuple = (),
    *,
    lora_alpha: int = 32,
    lora_dropout: float = 0.05,
    padded: bool = False,
    accumulating: bool = False,
    packed: bool = False,
    shared_prefix: bool = False,
) -> Dict[str, Any]:
    """Peak activation bytes of one forward+backward of the whole reward model.

    The step's live activations, phase by phase, for ``L = num_layers``:

    * up to the end of layer 0's forward: as traced (nothing depends on ``L``);
    * layer ``j >= 1`` forward, the head and loss, layer ``j`` backward: as traced for
      layer 1 plus ``(j-1) * saved_bytes``; the maximum is at ``j = L-1``;
    * layer 0's backward and the embedding's: as traced.

    Args:
        shape, batch, seq_len, dtype, gradient_checkpointing, attn_implementation,
        lora_r, lora_targets, lora_alpha, lora_dropout, padded, accumulating, packed, shared_prefix: as for
        :func:`measure_layer`.
        num_layers: decoder layers of the real model.

    Returns:
        ``peak_bytes`` (the number to add to weights + gradients + optimizer states),
        ``peak_phase`` (where it happens), ``end_of_forward_bytes`` (live activations when
        the loss is computed), ``per_layer_saved_bytes``, ``first_layer_saved_bytes``,
        ``layers_saved_bytes`` (all layers), ``pre_layers_bytes``, ``head_saved_bytes``,
        ``transient_bytes`` (peak minus the live bytes the peak phase started from),
        and ``layer`` (the :class:`LayerMemory` as a dict; ``None`` for a one-layer model).
    """
    if num_layers < 1:
        raise ValueError("num_layers must be at least 1")
    targets = tuple(lora_targets)
    if num_layers == 1:
        trace = _trace(shape, 1, batch, seq_len, dtype, gradient_checkpointing, attn_implementation, lora_r, targets,
                       lora_alpha, lora_dropout, padded, accumulating, packed, shared_prefix)
        at, peak = trace.at, trace.peak
        phases = {
            "forward": max(peak["start"], peak["layer0"]),
            "head": max(peak["norm"], peak["backward"]),
            "layer_backward": max(peak["layer0_bwd"], peak["end"]),
        }
        phase = max(phases, key=phases.get)
        return {
            "peak_bytes": phases[phase],
            "peak_phase": phase,
            "end_of_forward_bytes": at["backward"],
            "per_layer_saved_bytes": at["norm"] - at["layer0"],
            "first_layer_saved_bytes": at["norm"] - at["layer0"],
            "layers_saved_bytes": at["norm"] - at["layer0"],
            "pre_layers_bytes": at["layer0"],
            "head_saved_bytes": at["backward"] - at["norm"],
            "transient_bytes": phases[phase] - (at["backward"] if phase != "forward" else at["layer0"]),
            "phase_peaks": phases,
            "layer": None,
        }

    layer = measure_layer(shape, batch, seq_len, dtype, gradient_checkpointing, attn_implementation, lora_r, targets,
                          lora_alpha=lora_alpha, lora_dropout=lora_dropout, padded=padded,
                          accumulating=accumulating, packed=packed, shared_prefix=shared_prefix)
    trace = _trace(shape, 2, batch, seq_len, dtype, gradient_checkpointing, attn_implementation, lora_r, targets,
                   lora_alpha, lora_dropout, padded, accumulating, packed, shared_prefix)
    at, peak = trace.at, trace.peak
    shift = (num_layers - 2) * layer.saved_bytes  # the layers the traced model lacks, all steady-state
    layers_saved = layer.first_layer_saved_bytes + (num_layers - 1) * layer.saved_bytes
    phases = {
        "first_layer_forward": max(peak["start"], peak["layer0"]),
        "layer_forward": peak["layer1"] + shift,
        "head_and_loss": max(peak["norm"], peak["backward"]) + shift,
        "layer_backward": peak["layer1_bwd"] + shift,
        "first_layer_backward": layer.last_backward_bytes,
    }
    phase = max(phases, key=phases.get)
    end_of_forward = at["backward"] + shift
    reference = {  # what was live when the phase began, to report the transient part of the peak
        "first_layer_forward": at["layer0"],
        "layer_forward": at["layer1"] + shift,
        "head_and_loss": end_of_forward,
        "layer_backward": at["norm"] + shift,
        "first_layer_backward": at["layer1"],
    }[phase]
    return {
        "peak_bytes": phases[phase],
        "peak_phase": phase,
        "end_of_forward_bytes": end_of_forward,
        "per_layer_saved_bytes": layer.saved_bytes,
        "first_layer_saved_bytes": layer.first_layer_saved_bytes,
        "layers_saved_bytes": layers_saved,
        "pre_layers_bytes": layer.pre_layers_bytes,
        "head_saved_bytes": layer.head_saved_bytes,
        "transient_bytes": phases[phase] - reference,
        "phase_peaks": phases,
        "layer": asdict(layer),
    }


def clear_cache() -> None:
    """Forget cached traces (they hold only a few integers each)."""
    _trace.cache_clear()


def _timing_check() -> None:
    """Print how long estimates for Mistral-7B take (``python -m rm.activations``); not a test."""
    import time

    t0 = time.perf_counter()
    import transformers.models.mistral.modeling_mistral  # noqa: F401  (the trainer has it imported anyway)

    print(f"import transformers + Mistral: {time.perf_counter() - t0:.2f} s (once per process, not counted below)")
    mistral_7b = LayerShape("mistral", 4096, 14336, 32, 8, 128, 32000, 1e-5, 10000.0)
    batch, seq = 8, 512
    sbh = batch * seq * mistral_7b.hidden_size
    for ckpt in (False, True):
        for attempt in ("first", "cached"):
            t0 = time.perf_counter()
            est = estimate_activations(mistral_7b, 32, batch, seq, torch.bfloat16, ckpt)
            dt = time.perf_counter() - t0
            print(f"Mistral-7B bf16 {batch}x{seq} checkpointing={ckpt!s:5} {attempt:6} call {dt * 1000:7.1f} ms: "
                  f"peak {est['peak_bytes'] / 2**30:6.2f} GiB at {est['peak_phase']}, "
                  f"per layer {est['per_layer_saved_bytes'] / sbh:.2f}*s*b*h")


if __name__ == "__main__":
    _timing_check()


@functools.lru_cache(maxsize=256)
def inference_peak_bytes(shape: LayerShape, batch: int, seq_len: int, dtype: torch.dtype,
                         attn_implementation: str = "sdpa", lora_r: int = 0, lora_targets: tuple = (),
                         lora_alpha: int = 32, lora_dropout: float = 0.05, padded: bool = True) -> int:
    """Peak bytes above the weights of one scoring forward under ``torch.no_grad`` (evaluation).

    Nothing is kept for backward, so each layer's output replaces the last and the peak does not
    grow with depth: a 2-layer trace gives it for any number of layers.
    """
    from unittest import mock

    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    timeline = StorageTimeline()
    with torch.device("meta"):
        model = _build(shape, 2, dtype, False, attn_implementation, lora_r, tuple(lora_targets), lora_alpha, lora_dropout)
    with FakeTensorMode(), mock.patch.object(masking_utils, "find_packed_sequence_indices", _no_packed_sequences):
        _materialize_fake(model)
        model.eval()
        input_ids = torch.ones(batch, seq_len, dtype=torch.long)
        attention_mask = torch.ones(batch, seq_len, dtype=torch.long) if padded else None
        timeline.ignore(list(model.parameters()) + list(model.buffers()) + [input_ids, attention_mask])
        with torch.no_grad(), timeline:
            timeline.mark("start")
            model(input_ids=input_ids, attention_mask=attention_mask)
        live = timeline.live()
        del model
    return max(live) if live else 0
