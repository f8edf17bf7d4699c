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
window. Instead we *run* one training step of a two-layer copy of the model under
:class:`~torch._subclasses.fake_tensor.FakeTensorMode` (tensors carry shapes and dtypes
but no memory and no data), record every storage allocated and freed
(:class:`rm.memory.storage.StorageTracker`), and extrapolate to ``num_layers``.

The copy is built by the function that builds the model a run trains
(:func:`rm.modelling.model.build_reward_model`: LoRA wrap, fp32 reward head, QLoRA's preparation)
on the meta device, and scored by the trainer's own reward read
(:func:`rm.modelling.model.pair_rewards`) and loss (the run's :class:`rm.modelling.loss.PairLoss`, its margins and centring included). Under QLoRA the copy has no 4-bit weights to
quantise, so its linears are the fp32 linears ``prepare_model_for_kbit_training`` leaves
behind; bitsandbytes' ``Linear4bit`` also returns its input's dtype (fp32 there), so the
saved tensors agree, and the weight dequantised inside each 4-bit matmul (a transient) is
not seen.

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
builds). Where a CUDA kernel keeps other tensors for the backward, the trace of a CUDA
run reproduces the CUDA kernel (:func:`_target_kernels`): dropout (peft's, on every
LoRA input) keeps a bool mask on CUDA and an input-dtype noise tensor on the CPU,
measured on an H100. SDPA's kernels differ by a few bytes per token: the CPU flash
kernel and CUDA's flash / memory-efficient kernels all keep the output and an fp32
log-sum-exp of ``B*H*T`` (CUDA's efficient kernel pads ``T`` to 32).
``flash_attention_2`` cannot be traced. A packed row on CUDA in half precision takes torch's varlen flash call
(``rm.modelling.attention``); the trace of such a run takes it too (:func:`_varlen_device`), through the op's own fake
implementation, so its saved tensors are the varlen call's (k and v with the key-value heads only, no ``repeat_kv``;
a prefix-shared pair's prompt keys gathered again). That path is modelled, not measured on a GPU.

Each trace is kept in memory for the process and on disk under ``$RM_CACHE/trace`` (:mod:`rm.foundations.cache`), keyed by its
arguments (the model's shape, profile, LoRA settings, numerics, checkpointing, attention, device, micro-batch shape),
the versions of the libraries whose code it runs and the source of the rm modules it runs (:data:`TRACE_SOURCES`):
a run of a shape traced before, in any process, reads a few integers instead of tracing (seconds for a tiny model,
a minute for a 7B LoRA shape), and the estimate is the same number.

Public API: :class:`TracedModel`, :class:`LayerMemory`, :func:`measure_layer`,
:func:`estimate_activations`, :func:`inference_peak_bytes`, :func:`cached_only`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from rm.foundations import cache
from rm.foundations.config import ALL_LINEAR, LoraConfig, MemoryProfileConfig, ModelConfig
from rm.modelling.loss import PairLoss
from rm.memory.storage import StorageTracker
from rm.foundations.precision import Numerics

_SUPPORTED_ATTN = ("sdpa", "eager")

# The rm modules a trace runs: this one, and every module it imports at any depth (tests/foundations/test_startup_cache.py holds
# the list to the import graph). Their source is part of a cached trace's key, so an edit to any of them is a miss.
TRACE_SOURCES = ("rm.memory.trace", "rm.memory.storage", "rm.modelling.model", "rm.modelling.loss", "rm.foundations.precision", "rm.modelling.prefix_sharing",
                 "rm.modelling.attention", "rm.data.collator", "rm.foundations.config", "rm.foundations.cache", "rm.foundations.launch_env",
                 "rm.foundations.errors", "rm.foundations.cli", "rm.foundations.hardware")
# The libraries whose code a trace runs: the model's (transformers), the adapters' (peft), the kernels' saved tensors
# (torch), ZeRO-3's linear (deepspeed). Another version of any of them is a miss.
TRACE_LIBRARIES = ("torch", "transformers", "peft", "deepspeed")

Items = Tuple[Tuple[str, Any], ...]


def _items(group) -> Items:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in asdict(group).items())


def _group(cls, items: Items):
    return cls(**{k: list(v) if isinstance(v, tuple) else v for k, v in items})


@dataclass(frozen=True)
class TracedModel:
    """The arguments of :func:`rm.modelling.model.build_reward_model` for one run, and the loss its step computes, hashable so
    traces can be cached.

    ``model.pretrained`` is dropped: the trace builds from the shape numbers, which are the
    pretrained model's own (``rm.foundations.config.ModelConfig``).
    """

    model: Items
    profile: Items
    lora: Items
    numerics: Numerics
    gradient_checkpointing: bool
    fp32_head: bool
    loss: PairLoss  # what the loss keeps for its backward is part of the head's activations
    device: str = "cpu"  # the device whose kernels' saved tensors the trace reproduces (see _target_kernels)
    zero3_linear: bool = False  # DeepSpeed ZeRO-3 replaces F.linear (see _target_kernels)

    @classmethod
    def of(cls, model_cfg: ModelConfig, profile: MemoryProfileConfig, lora_cfg: LoraConfig, *, numerics: Numerics,
           gradient_checkpointing: bool, fp32_head: bool, loss: PairLoss, device: str = "cpu",
           zero3_linear: bool = False) -> "TracedModel":
        """The model a run with these groups trains (the same keyword arguments as the factory) and its ``loss``, on
        ``device``, with DeepSpeed ZeRO-3's linear where ``zero3_linear``."""
        shape_only = replace(model_cfg, pretrained=None, tokenizer=None, trust_remote_code=False)
        return cls(_items(shape_only), _items(profile), _items(lora_cfg), numerics, gradient_checkpointing, fp32_head,
                   loss, device, zero3_linear)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast, as the engine enters it (``bf16-mixed``, ``16-mixed`` under accelerate): its casts
        of the fp32 weights are kept for the backward (and in autocast's cache until the forward ends)."""
        if self.numerics.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.numerics.dtype("autocast"))

    def attention_kernel(self) -> str:
        """How the run's attention computes a packed row on its device (:func:`rm.foundations.hardware.attention_kernel`):
        ``varlen`` where the trace takes torch's varlen call (:func:`_varlen_device`)."""
        from rm.foundations.hardware import attention_kernel

        m = self.model_cfg
        quantized = _group(MemoryProfileConfig, self.profile).quantize_base != "none"
        return attention_kernel(m.attn_implementation, self.device, self.numerics, quantized,
                                m.head_dim or m.hidden_size // m.num_attention_heads)

    @property
    def model_cfg(self) -> ModelConfig:
        return _group(ModelConfig, self.model)

    def build(self, num_layers: int) -> torch.nn.Module:
        """The run's reward model with ``num_layers`` layers on the meta device (no memory, no weights)."""
        from rm.modelling.model import build_reward_model

        if self.model_cfg.attn_implementation not in _SUPPORTED_ATTN:
            raise ValueError(f"model.attn_implementation={self.model_cfg.attn_implementation!r} cannot be traced on "
                             f"the CPU; supported: {_SUPPORTED_ATTN}")
        profile = _group(MemoryProfileConfig, self.profile)
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft reads transformers' deprecated checkpointing flag
            model = build_reward_model(
                replace(self.model_cfg, num_hidden_layers=num_layers), profile,
                _group(LoraConfig, self.lora), numerics=self.numerics,
                gradient_checkpointing=self.gradient_checkpointing, fp32_head=self.fp32_head, pad_token_id=0,
            )
        if profile.quantize_base != "none":
            # On CUDA under autocast PEFT keeps the adapter's output in autocast's dtype; elsewhere it casts it to
            # the 4-bit layer's output dtype (torch.is_autocast_enabled() asks about CUDA only).
            cast_lora_output = not (self.device == "cuda" and self.numerics.autocast is not None)
            _as_4bit_linears(model, getattr(torch, self.numerics.frozen), cast_lora_output)
        return model


class _Dequantised4bitMatmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` with an unquantised weight standing in for the packed one: the weight is
    dequantised into a fresh ``compute_dtype`` tensor for the forward's matmul and again for the backward's, and
    nothing is saved but the weight (bitsandbytes/autograd/_functions.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, compute_dtype):
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(compute_dtype, copy=True), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype, copy=True), None, None, None


def _as_4bit_linears(model: torch.nn.Module, compute_dtype: torch.dtype, cast_lora_output: bool) -> None:
    """Make the decoder's linears compute as bitsandbytes' ``Linear4bit`` does (``forward``): in the dtype of the
    input (fp32 from the fp32 norms ``prepare_model_for_kbit_training`` leaves, whatever ``bnb_4bit_compute_dtype``
    says), the weight dequantised inside the matmul (a transient of the weight's size; autocast casts both inside),
    the output cast back to the input's dtype: under autocast fp32, not autocast's bf16 (measured: a QLoRA
    evaluation under bf16-mixed 28% above the trace that ran plain linears, 8% with the configured compute dtype).

    A targeted linear's LoRA wrapper runs as PEFT's 4-bit one does (peft/tuners/lora/bnb.py, ``Linear4bit.forward``),
    not as its plain one: the base output cloned, and with ``cast_lora_output`` the adapter's output cast to the base
    output's dtype before the sum (measured: a bf16-mixed QLoRA evaluation on the CPU held the fp32 cast of each
    adapter output beside its sum, 8% above the trace that added autocast's bf16 output)."""
    names = set(ALL_LINEAR)  # the decoder's linears, which bitsandbytes quantises (not the reward head)

    def forward(module, x):
        # Linear4bit.set_compute_type: an fp32 or bf16 input sets the compute dtype (over bnb_4bit_compute_dtype)
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else compute_dtype
        return _Dequantised4bitMatmul.apply(x.to(dtype), module.weight, module.bias, dtype).to(x.dtype)

    def lora_forward(layer, x, *args, **kwargs):
        result = layer.base_layer(x, *args, **kwargs).clone()  # PEFT clones a 4-bit output "defensively"
        for name in layer.active_adapters:
            if name not in layer.lora_A.keys():
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            if cast_lora_output:
                x = x.to(lora_a.weight.dtype)
            output = lora_b(lora_a(layer.lora_dropout[name](x))) * layer.scaling[name]
            if cast_lora_output:
                output = output.to(result.dtype)  # the uncast output is freed before the sum, as in PEFT
            result = result + output
        return result

    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, torch.nn.Linear) and parts[-1] in names:
            module.forward = functools.partial(forward, module)
        elif parts[-1] in names and isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
            module.base_layer.forward = functools.partial(forward, module.base_layer)  # PEFT's wrapper of a target
            module.forward = functools.partial(lora_forward, module)


@dataclass(frozen=True)
class LayerMemory:
    """One decoder layer's activation memory, and the parts of the step outside the layers, in bytes.

    Attributes:
        saved_bytes: what one steady-state layer adds to live memory between its
            forward and its backward (what accumulates per layer in a stack). With
            gradient checkpointing this is (about) the layer's input only.
        backward_saved_bytes: what one steady-state layer still holds when the backward starts: ``saved_bytes``
            less what autocast's cache of weight casts held only until the forward ended.
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
    backward_saved_bytes: int
    first_layer_saved_bytes: int
    forward_transient_bytes: int
    backward_transient_bytes: int
    pre_layers_bytes: int
    head_saved_bytes: int
    head_transient_bytes: int
    last_backward_bytes: int
    traced_layers: int

    @property
    def recompute_peak_bytes(self) -> int:
        """With checkpointing, ``backward_transient_bytes`` is the recompute + backward peak of one layer."""
        return self.backward_transient_bytes


def _no_packed_sequences(position_ids):
    """Stand-in for ``transformers.masking_utils.find_packed_sequence_indices`` when the step has no packing.

    transformers treats fake tensors as tracing and then cannot read the position ids,
    so it assumes they may be packed and builds a packed-sequence mask (about 17% more
    memory than the real step). Row-per-pair batches are padded, never packed.
    """
    return None


def _materialize_fake(model: torch.nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor (call inside FakeTensorMode).

    Shared tensors stay shared; ``requires_grad`` is kept, so frozen LoRA bases stay frozen.
    """
    memo: Dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in memo:
                    memo[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"),
                                                     requires_grad=p.requires_grad)
                module._parameters[name] = memo[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                if id(b) not in memo:
                    memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
                module._buffers[name] = memo[id(b)]


def _base(model) -> torch.nn.Module:
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).model


def _batch(batch: int, seq_len: int, packed: bool, shared_prefix: bool, segment: int = 0) -> Dict[str, torch.Tensor]:
    """The inputs of :func:`rm.modelling.model.pair_rewards` for a micro-batch of this layout (inside FakeTensorMode).

    Row per pair: every row padded, so transformers builds the (B,1,T,T) mask and SDPA repeats K/V to all
    heads, the costlier path (under fake tensors it cannot read the mask, so passing one takes that path), unless
    :func:`_fake_mode` is told the rows are not padded.
    Packed: one row, position ids restarting per sequence, no mask. Prefix-shared: rows of pairs with the
    per-token pair ids and roles from which the trainer builds the 4D mask inside the step. Two rewards
    per row are read: where they are read does not change what the step keeps. ``segment``: a packed row
    is split into sequences (or pairs) of this many tokens for SDPA (``rm.modelling.attention``; fake ids cannot say where).
    """
    if not (packed or shared_prefix):
        # pad id 0 never appears in the ids: the reward is read at the last position.
        return {"input_ids": torch.ones(batch, seq_len, dtype=torch.long),
                "attention_mask": torch.ones(batch, seq_len, dtype=torch.long)}
    rows = 1 if packed and not shared_prefix else batch
    ends = torch.arange(rows).repeat_interleave(2) * seq_len + torch.tensor([seq_len - 2, seq_len - 1]).repeat(rows)
    inputs = {"input_ids": torch.ones(rows, seq_len, dtype=torch.long),
              "position_ids": torch.arange(seq_len).expand(rows, -1), "ends": ends}
    if shared_prefix:
        inputs["pair_ids"] = torch.zeros(rows, seq_len, dtype=torch.long)
        inputs["roles"] = torch.zeros(rows, seq_len, dtype=torch.long)
    if packed and 0 < segment < seq_len:
        inputs["segment_bounds"] = list(range(0, seq_len, segment)) + [seq_len]
    return inputs


def _loss(model, inputs, loss: PairLoss) -> torch.Tensor:
    """The training step's loss, computed as ``rm.training.trainer`` computes it: the run's loss of the rewards, with the
    batch's margins (zeros here: what the loss keeps depends on their shape, not their values)."""
    from rm.modelling.model import pair_rewards

    margin = inputs.pop("margin")
    chosen, rejected = pair_rewards(model, **inputs)
    return loss(chosen, rejected, margin)


@dataclass(frozen=True)
class _Trace:
    """Live activation bytes at the phase boundaries of one traced step, and the peak of each phase."""

    num_layers: int
    at: Dict[str, int]  # live bytes at each mark
    peak: Dict[str, int]  # peak live bytes within each phase (from its mark to the next)
    # The parameter gradients this step creates, left out of ``at`` and ``peak``: their bytes at each mark, and
    # each phase's peak of activations and those gradients together.
    grads_at: Dict[str, int]
    peak_with_grads: Dict[str, int]


# embed_bwd: the embedding's backward, after every layer's (at "end" where the embedding trains nothing).
_PHASES_2 = ("start", "layer0", "layer1", "norm", "backward", "layer1_bwd", "layer0_bwd", "embed_bwd", "end")
_PHASES_1 = ("start", "layer0", "norm", "backward", "layer0_bwd", "embed_bwd", "end")


def _fake_mode(packed: bool, padded: bool = True):
    """Fake tensors, with transformers told the truth about packing and padding (which it cannot read from fake
    ids and masks). Not ``padded``: the mask is all ones, and transformers decides whether SDPA may run
    ``is_causal`` without a mask as it does for a real all-ones mask, which says nothing a missing one does not."""
    from unittest import mock

    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    stack = contextlib.ExitStack()
    stack.enter_context(FakeTensorMode())
    if not packed:
        stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices", _no_packed_sequences))
    if not padded:
        decide = masking_utils._ignore_causal_mask_sdpa
        stack.enter_context(mock.patch.object(masking_utils, "_ignore_causal_mask_sdpa",
                                              lambda padding_mask, *args, **kwargs: decide(None, *args, **kwargs)))
    return stack


def _cuda_dropout(dropout):
    """``F.dropout`` as CUDA runs it: the fused ``native_dropout``, which keeps a one-byte bool mask for the backward.
    The CPU kernel multiplies by a noise tensor of the input's dtype and keeps that (2 or 4 bytes an element): under
    LoRA, whose adapters drop out the input of every targeted linear, the CPU trace counted 25-27% more activation
    memory than an H100 allocated (benchmarks/results/memory_calibration_gpu.md)."""

    def cuda_like(input, p=0.5, training=True, inplace=False):
        if not training or inplace or not 0.0 < p < 1.0:
            return dropout(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    return cuda_like


@contextlib.contextmanager
def _target_kernels(device: str, zero3_linear: bool = False):
    """Trace with the saved tensors of the run's kernels where they differ from the CPU's plain ones: CUDA's dropout
    (a bool mask), and DeepSpeed ZeRO-3's ``F.linear``. ZeRO-3 replaces ``torch.nn.functional.linear`` with its
    ``LinearFunctionForZeroStage3`` (``memory_efficient_linear``, on by default), which saves every linear's input
    for the backward, also where the weight is frozen and torch's linear saves none (LoRA's base layers): a random
    calibration point (LoRA, ZeRO-3 offload) was 6% under without it. The trace runs DeepSpeed's own function."""
    from unittest import mock

    import torch.nn.functional as F

    with contextlib.ExitStack() as stack:
        if device == "cuda":
            stack.enter_context(mock.patch.object(F, "dropout", _cuda_dropout(F.dropout)))
        if zero3_linear:
            from deepspeed.runtime.zero.linear import zero3_linear_wrap

            stack.enter_context(mock.patch.object(F, "linear", zero3_linear_wrap))
        yield


def _varlen_device(traced: TracedModel, packed: bool, shared_prefix: bool, seq_len: int, segment: int):
    """Where the run's device takes the varlen flash call for a packed row (:meth:`TracedModel.attention_kernel` is
    ``varlen``: CUDA, attention in half precision), the trace takes it too
    (:func:`rm.modelling.attention.estimated_varlen_device`): the row's segments become varlen sequences and the trace
    keeps what ``varlen_attn`` keeps for its backward (torch's fake implementation of the op gives its output and
    log-sum-exp): q, k and v with the key-value heads only (no ``repeat_kv``), the output, an fp32 log-sum-exp of
    ``heads x T``, and the layout's offsets and key index. Elsewhere (a CPU, fp32, a row of one segment) nothing changes.

    A prefix-shared row's keys are ``T`` plus each pair's prompt again (its rejected answer's keys are
    ``[prompt ; rejected]``, gathered). Fake roles hold no prompt lengths and the shapes carry none, so the trace
    takes the most a row can gather (:func:`_varlen_roles`): a bound, reached only by pairs that are all prompt
    but a one-token rejected answer (real pairs gather less, by their answers' length)."""
    if not (packed and 0 < segment < seq_len and traced.attention_kernel() == "varlen"):
        return contextlib.nullcontext()
    from rm.modelling.attention import estimated_varlen_device

    return estimated_varlen_device(_varlen_roles(seq_len, segment) if shared_prefix else None)


def _varlen_roles(seq_len: int, segment: int) -> list:
    """The roles the trace gives a prefix-shared packed row of ``segment``-token pairs under varlen: each pair all
    prompt but one rejected token (no chosen answer), which gathers ``n - 1`` prompt keys for a pair of ``n`` tokens,
    the most one can (its rejected answer needs a token): ``T - ceil(T / segment)`` keys more than the row's ``T``.
    Pairs with answers of ``d`` tokens gather ``d - 1`` fewer each; a row of pairs shorter than ``segment`` gathers
    at most as many (every pair's ``n - 1``, and fewer pairs the longer they are).

    >>> _varlen_roles(7, 3)  # pairs of 3, 3 and 1 tokens: 2 + 2 + 0 prompt keys gathered again
    [0, 0, 2, 0, 0, 2, 2]
    """
    from rm.data.collator import PREFIX, REJECTED

    roles = []
    for start in range(0, seq_len, segment):
        n = min(segment, seq_len - start)
        roles += [PREFIX] * (n - 1) + [REJECTED]
    return roles


def _mark_phases(model, tracker: StorageTracker) -> list:
    """Hooks that mark each layer's forward and backward and the final norm; returns their handles."""
    handles = []

    def first(name):
        # Where checkpointing recomputes a layer by calling the module again (transformers 5.17 does; 5.24 recomputes
        # inside the layer's own call), its hooks fire a second time, in the backward: the phase began at the first.
        if name not in tracker.marks:
            tracker.mark(name)

    def on_layer_start(index):
        return lambda module, args: first(f"layer{index}")

    def on_layer_end(index):
        # The gradient of layer i's output arrives when layer i's backward starts.
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.requires_grad:
                out.register_hook(lambda grad: tracker.mark(f"layer{index}_bwd"))

        return hook

    for index, layer in enumerate(_base(model).layers):
        handles.append(layer.register_forward_pre_hook(on_layer_start(index)))
        handles.append(layer.register_forward_hook(on_layer_end(index)))
    handles.append(_base(model).norm.register_forward_pre_hook(lambda module, args: first("norm")))

    def on_embedding_end(module, args, output):  # its output's gradient arrives once every layer's backward is done
        if output.requires_grad:
            output.register_hook(lambda grad: tracker.mark("embed_bwd"))

    handles.append(_base(model).embed_tokens.register_forward_hook(on_embedding_end))
    return handles


@functools.lru_cache(maxsize=1)
def _environment() -> Dict[str, Any]:
    """What every trace depends on besides its arguments: the code it runs, rm's and the libraries'."""
    return {"rm": cache.source_digest(TRACE_SOURCES), "libraries": cache.versions(*TRACE_LIBRARIES)}


def _entry(kind: str, traced: TracedModel, *args) -> Path:
    return cache.cache_root() / "trace" / f"{cache.key({'kind': kind, 'traced': asdict(traced), 'args': list(args), **_environment()})}.json"


def _stored_trace(value: Any) -> "Optional[_Trace]":
    """A cached :class:`_Trace`, or None where the entry does not hold one (a corrupt entry is traced again)."""
    if not isinstance(value, dict) or set(value) != {f.name for f in fields(_Trace)} or type(value["num_layers"]) is not int:
        return None
    marks = [value[name] for name in ("at", "peak", "grads_at", "peak_with_grads")]
    if not all(isinstance(m, dict) and all(type(v) is int for v in m.values()) for m in marks):
        return None
    return _Trace(**value)


class NotTraced(LookupError):
    """Raised inside :func:`cached_only` by a trace that has not been run before (in this process or on disk)."""


_CACHED_ONLY = [False]


@contextlib.contextmanager
def cached_only():
    """Inside, a trace not found in the caches raises :class:`NotTraced` instead of running: a caller with the model's
    code not yet imported (``rm.plan``'s search) takes what is cached here and sends the rest to processes that have."""
    before = _CACHED_ONLY[0]
    _CACHED_ONLY[0] = True
    try:
        yield
    finally:
        _CACHED_ONLY[0] = before


@functools.lru_cache(maxsize=256)
def _trace(traced: TracedModel, num_layers: int, batch: int, seq_len: int, accumulating: bool = False,
           packed: bool = False, shared_prefix: bool = False, padded: bool = True, segment: int = 0) -> _Trace:
    """:func:`_run_trace`, read from the disk cache where this trace was run before (module doc)."""
    args = (num_layers, batch, seq_len, accumulating, packed, shared_prefix, padded, segment)
    path = _entry("train_step", traced, *args)
    trace = _stored_trace(cache.read_json(path))
    if trace is None:
        if _CACHED_ONLY[0]:
            raise NotTraced(path)
        trace = _run_trace(traced, *args)
        cache.write_json(path, asdict(trace))
    return trace


def _run_trace(traced: TracedModel, num_layers: int, batch: int, seq_len: int, accumulating: bool = False,
               packed: bool = False, shared_prefix: bool = False, padded: bool = True, segment: int = 0) -> _Trace:
    """Run one forward+backward of a ``num_layers``-layer fake model and time-stamp its phases.

    ``packed``: one row of ``seq_len`` tokens holding several sequences (``train.packing``): no
    mask, position ids restarting per sequence, from which transformers builds a block-diagonal
    (1,1,T,T) mask. Under fake tensors it cannot read the position ids and takes that packed
    path anyway, which here is the real one.

    ``shared_prefix``: ``batch`` rows of prefix-shared pairs (``train.share_prefix``): the 4D mask is
    built from per-token pair ids and roles inside the step, as ``rm.modelling.model.sequence_rewards`` does,
    so it and its intermediates are counted; transformers passes it to attention as it is.
    """
    tracker = StorageTracker(timeline=True)
    # Built on the meta device, then given fake CPU tensors: peft moves its fresh adapters with
    # ``.to()``, which cannot swap fake parameters, but works on meta ones.
    model = traced.build(num_layers)
    with _fake_mode(packed, padded), _target_kernels(traced.device, traced.zero3_linear), \
            _varlen_device(traced, packed, shared_prefix, seq_len, segment):
        _materialize_fake(model)
        inputs = _batch(batch, seq_len, packed, shared_prefix, segment)
        pairs = inputs["ends"].numel() // 2 if "ends" in inputs else batch // 2  # two rewards read per pair
        inputs["margin"] = torch.zeros(pairs)  # fp32, as the collators make it; a real batch's input, not counted
        if accumulating:
            # A first micro-batch leaves .grad allocated; in the next one autograd adds each new
            # gradient into it and frees the new one, a transient we want on the timeline. Allocating the
            # gradients as the first backward leaves them (the parameter's dtype and strides) gives the same
            # timeline as running that backward (tests/memory/test_activations.py) at half the cost of the trace.
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tracker.ignore(list(model.parameters()) + list(model.buffers()) + grads +
                       [v for v in inputs.values() if isinstance(v, torch.Tensor)])
        del grads
        handles = _mark_phases(model, tracker)
        # No cyclic collection in the middle of the step: a tensor caught in a reference cycle then
        # stays alive until the step ends, the worst case of what a real run may see.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with tracker:
                tracker.mark("start")
                with traced.autocast():
                    loss = _loss(model, dict(inputs), traced.loss)
                tracker.mark("backward")
                loss.backward()
                del loss
                if "embed_bwd" not in tracker.marks:
                    tracker.mark("embed_bwd")
                tracker.mark("end")
        finally:
            for handle in handles:
                handle.remove()
            if gc_was_enabled:
                gc.enable()
        tracker.exclude([p.grad for p in model.parameters() if p.grad is not None])
        live = tracker.live_after_each_event()
        grads = tracker.live_after_each_event(excluded=True)
        del model
    phases = _PHASES_2 if num_layers == 2 else _PHASES_1
    missing = [name for name in phases if name not in tracker.marks]
    if missing:
        raise RuntimeError(f"trace lacks phase marks {missing}: the model's code path is not the one expected")
    bounds = [tracker.marks[name] for name in phases] + [len(live) - 1]
    spans = list(zip(phases, bounds[:-1], bounds[1:]))
    at = {name: live[tracker.marks[name]] for name in phases}
    peak = {name: max(live[lo : hi + 1]) for name, lo, hi in spans}
    at["final"] = live[-1]
    grads_at = {name: grads[tracker.marks[name]] for name in phases}
    grads_at["final"] = grads[-1]
    peak_with_grads = {name: max(a + g for a, g in zip(live[lo : hi + 1], grads[lo : hi + 1])) for name, lo, hi in spans}
    return _Trace(num_layers=num_layers, at=at, peak=peak, grads_at=grads_at, peak_with_grads=peak_with_grads)


def measure_layer(traced: TracedModel, batch: int, seq_len: int, *, accumulating: bool = False, packed: bool = False,
                  shared_prefix: bool = False, padded: bool = True, segment: int = 0) -> LayerMemory:
    """Measure one decoder layer (and the parts outside the layers) by tracing a fake two-layer model.

    Args:
        traced: the run's model (:meth:`TracedModel.of`).
        batch: sequences per micro-batch (a pairwise micro-batch of P pairs is 2P), even; rows when
            ``shared_prefix``.
        seq_len: padded sequence length (packed: the row's length).
        accumulating: gradients are already allocated by an earlier micro-batch of the
            same optimizer step (gradient accumulation). Autograd then materialises each
            new parameter gradient, adds it in place and frees it: a transient of up to a
            few parameter-sized tensors that the first micro-batch does not have (there the
            new gradient becomes ``.grad`` itself and is excluded as a gradient).
        packed: one row of ``seq_len`` tokens holding several sequences (``train.packing``):
            position ids restart per sequence and transformers builds a block-diagonal mask.
        shared_prefix: ``batch`` rows of prefix-shared pairs (``train.share_prefix``) with their 4D mask.
        padded: row per pair, some row is padded (:attr:`rm.data.shapes.BatchShape.padded`).
        segment: packed, SDPA a ``segment``-token sequence (or pair) at a time (``rm.modelling.attention``); 0: the
            row in one call.

    Returns:
        A :class:`LayerMemory`; cached per distinct arguments.
    """
    trace = _trace(traced, 2, batch, seq_len, accumulating, packed, shared_prefix, padded, segment)
    at, peak = trace.at, trace.peak
    return LayerMemory(
        saved_bytes=at["norm"] - at["layer1"],
        # Layer 1's backward frees what it still held when the backward started (its output's gradient is
        # replaced by its input's, of the same size). Equal to the difference between a two- and a one-layer
        # trace at the start of the last layer's backward on every case of tests/memory/test_activations.py.
        backward_saved_bytes=at["layer1_bwd"] - at["layer0_bwd"],
        first_layer_saved_bytes=at["layer1"] - at["layer0"],
        forward_transient_bytes=peak["layer1"] - at["layer1"],
        backward_transient_bytes=peak["layer1_bwd"] - at["norm"],
        pre_layers_bytes=at["layer0"],
        head_saved_bytes=at["backward"] - at["norm"],
        head_transient_bytes=max(peak["norm"], peak["backward"]) - at["backward"],
        last_backward_bytes=max(peak["layer0_bwd"], peak["embed_bwd"], peak["end"]),
        traced_layers=2,
    )


def estimate_activations(traced: TracedModel, num_layers: int, batch: int, seq_len: int, *, accumulating: bool = False,
                         packed: bool = False, shared_prefix: bool = False, padded: bool = True,
                         segment: int = 0) -> Dict[str, Any]:
    """Peak activation bytes of one forward+backward of the whole reward model.

    The step's live activations, phase by phase, for ``L = num_layers``:

    * up to the end of layer 0's forward: as traced (nothing depends on ``L``);
    * layer ``j >= 1`` forward, the head and loss, layer ``j`` backward: as traced for
      layer 1 plus ``(j-1) * saved_bytes``; the maximum is at ``j = L-1``;
    * layer 0's backward and the embedding's: as traced.

    Args:
        traced, batch, seq_len, accumulating, packed, shared_prefix, padded, segment: as for :func:`measure_layer`.
        num_layers: decoder layers of the real model.

    Returns:
        ``peak_bytes`` (the number to add to weights + gradients + optimizer states),
        ``backward_with_gradients_bytes`` (the backward's peak of activations and the parameter gradients it
        creates, for layouts that keep them in ``.grad`` until the step), ``gradient_bytes`` (those gradients),
        ``embedding_backward_bytes`` (the activations left for the embedding's backward, after every layer's),
        ``peak_phase`` (where it happens), ``end_of_forward_bytes`` (live activations when
        the loss is computed), ``per_layer_saved_bytes``, ``first_layer_saved_bytes``,
        ``layers_saved_bytes`` (all layers), ``pre_layers_bytes``, ``head_saved_bytes``,
        ``transient_bytes`` (peak minus the live bytes the peak phase started from),
        and ``layer`` (the :class:`LayerMemory` as a dict; ``None`` for a one-layer model).
    """
    if num_layers < 1:
        raise ValueError("num_layers must be at least 1")
    if num_layers == 1:
        trace = _trace(traced, 1, batch, seq_len, accumulating, packed, shared_prefix, padded, segment)
        at, peak = trace.at, trace.peak
        phases = {
            "forward": max(peak["start"], peak["layer0"]),
            "head": max(peak["norm"], peak["backward"]),
            "layer_backward": max(peak["layer0_bwd"], peak["embed_bwd"], peak["end"]),
        }
        phase = max(phases, key=phases.get)
        with_grads = trace.peak_with_grads
        return {
            "backward_with_gradients_bytes": max(with_grads["backward"], with_grads["layer0_bwd"], with_grads["embed_bwd"],
                                                 with_grads["end"]),
            "embedding_backward_bytes": max(peak["embed_bwd"], peak["end"]),
            "gradient_bytes": trace.grads_at["final"],
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

    layer = measure_layer(traced, batch, seq_len, accumulating=accumulating, packed=packed, shared_prefix=shared_prefix,
                          padded=padded, segment=segment)
    trace = _trace(traced, 2, batch, seq_len, accumulating, packed, shared_prefix, padded, segment)
    at, peak = trace.at, trace.peak
    shift = (num_layers - 2) * layer.saved_bytes  # the layers the traced model lacks, all steady-state
    # Under autocast, its cache keeps each weight's cast until the forward ends: a layer holds more during the
    # forward than it still holds when the backward starts (with checkpointing, only its input).
    backward_shift = (num_layers - 2) * layer.backward_saved_bytes
    layers_saved = layer.first_layer_saved_bytes + (num_layers - 1) * layer.saved_bytes
    phases = {
        "first_layer_forward": max(peak["start"], peak["layer0"]),
        "layer_forward": peak["layer1"] + shift,
        "head_and_loss": max(peak["norm"] + shift, peak["backward"] + backward_shift),
        "layer_backward": peak["layer1_bwd"] + backward_shift,
        "first_layer_backward": layer.last_backward_bytes,
    }
    phase = max(phases, key=phases.get)
    # The backward with the gradients it creates (where they stay in .grad until the step): layer k's backward
    # holds the activations of layers 0..k and the gradients of the head and layers k+1..L-1, both linear in k,
    # so the ends bound it: layer L-1 (activations shifted as above) and layer 1 (the gradients of L-2 more
    # layers than traced), then layer 0 and the embedding with every layer's gradients.
    with_grads, grads_at = trace.peak_with_grads, trace.grads_at
    layer_grads = grads_at["layer0_bwd"] - grads_at["layer1_bwd"]  # layer 1's backward made them
    more_grads = (num_layers - 2) * layer_grads
    backward_with_gradients = max(with_grads["backward"] + backward_shift, with_grads["layer1_bwd"] + backward_shift,
                                  with_grads["layer1_bwd"] + more_grads,
                                  max(with_grads["layer0_bwd"], with_grads["embed_bwd"], with_grads["end"]) + more_grads)
    end_of_forward = at["backward"] + backward_shift  # marked after the forward's autocast has ended
    reference = {  # what was live when the phase began, to report the transient part of the peak
        "first_layer_forward": at["layer0"],
        "layer_forward": at["layer1"] + shift,
        "head_and_loss": end_of_forward,
        "layer_backward": at["norm"] + backward_shift,
        "first_layer_backward": at["layer1"],
    }[phase]
    return {
        "backward_with_gradients_bytes": backward_with_gradients,
        "embedding_backward_bytes": max(peak["embed_bwd"], peak["end"]),
        "gradient_bytes": grads_at["final"] + more_grads,
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
    """Forget the traces this process holds (a few integers each); the disk cache keeps its own (a fresh
    ``RM_CACHE`` directory traces everything again)."""
    _trace.cache_clear()
    inference_peak_bytes.cache_clear()


@functools.lru_cache(maxsize=256)
def inference_peak_bytes(traced: TracedModel, batch: int, seq_len: int) -> int:
    """Peak bytes above the weights of one scoring forward under ``torch.no_grad`` (evaluation), padded rows.

    Nothing is kept for backward: each layer's output replaces the last. Under autocast (``bf16-mixed``) its cache
    still keeps the cast of every trainable weight until the forward ends, so each layer leaves those bytes behind
    and the peak grows with depth (:func:`_run_inference_trace`). Read from the disk cache where this forward was
    traced before (module doc).
    """
    path = _entry("inference", traced, batch, seq_len)
    stored = cache.read_json(path)
    if type(stored) is int:
        return stored
    if _CACHED_ONLY[0]:
        raise NotTraced(path)
    peak = _run_inference_trace(traced, batch, seq_len)
    cache.write_json(path, peak)
    return peak


def _run_inference_trace(traced: TracedModel, batch: int, seq_len: int) -> int:
    """The model's own depth where it has one or two layers; deeper, two layers (as the training trace, module doc)
    and every layer after the first a steady-state layer 1 that leaves what layer 1 left: what was live at the final
    norm less what was live at layer 1's start, autocast's casts of its trainable weights (none in fp32). Measured
    (issue 48): a 6-layer bf16-mixed full fine-tune whose peak is its evaluation was 6.8% under while a 2-layer
    trace stood for every depth, and 1-layer models 5-11% over."""
    from rm.modelling.model import pair_rewards

    num_layers = traced.model_cfg.num_hidden_layers
    tracker = StorageTracker(timeline=True)
    model = traced.build(min(num_layers, 2))
    with _fake_mode(packed=False):
        _materialize_fake(model)
        model.eval()
        inputs = _batch(batch, seq_len, packed=False, shared_prefix=False)
        tracker.ignore(list(model.parameters()) + list(model.buffers()) + list(inputs.values()))
        handles = _mark_phases(model, tracker)
        try:
            with torch.no_grad(), tracker, traced.autocast():
                pair_rewards(model, **inputs)
        finally:
            for handle in handles:
                handle.remove()
        del model
    live = tracker.live_after_each_event()
    if num_layers <= 2:
        return max(live)
    steady, norm = tracker.marks["layer1"], tracker.marks["norm"]
    left_per_layer = live[norm] - live[steady]
    return max(max(live[: steady + 1]), max(live[steady:]) + (num_layers - 2) * left_per_layer)
