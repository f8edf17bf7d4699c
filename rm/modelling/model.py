"""Build the reward model and score batches with it (its tokenizer is :mod:`rm.data.tokenizer`'s)."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import types
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from filelock import FileLock
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

from rm.foundations.cache import cache_root
from rm.foundations.config import LoraConfig, MemoryProfileConfig, ModelConfig, OptimConfig
from rm.foundations.errors import named_hub_source
from rm.foundations.launch_env import launch_env
from rm.foundations.precision import Numerics, fp32_head_enabled  # noqa: F401  (callers build with it)

HEAD = "score"  # the one-output reward head of transformers' *ForSequenceClassification decoders

log = logging.getLogger(__name__)


def _config_from_shape(model_cfg: ModelConfig, pad_token_id: int):
    return AutoConfig.for_model(
        model_cfg.model_type,
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_hidden_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_key_value_heads,
        head_dim=model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_attention_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        rope_theta=model_cfg.rope_theta,
        rms_norm_eps=model_cfg.rms_norm_eps,
        tie_word_embeddings=model_cfg.tie_word_embeddings,
        num_labels=1,
        pad_token_id=pad_token_id,
    )


def random_init_cache() -> Path:
    """Where random-init models saved for quantisation live: ``$RM_CACHE/random_init`` (default ``~/.cache/rm``)."""
    return cache_root() / "random_init"


def random_init_path(model_cfg: ModelConfig, pad_token_id: int) -> Path:
    """Where :func:`saved_random_init` keeps the shape's random init at the current seed (``torch.initial_seed()``,
    what ``set_seed`` set): keyed by the shape and the seed, so that a run, its resume and the export's rebuilt base
    load the same weights."""
    config = _config_from_shape(model_cfg, pad_token_id)
    key = hashlib.sha256(f"{config.to_json_string()}|{torch.initial_seed()}".encode()).hexdigest()[:16]
    return random_init_cache() / f"{model_cfg.model_type}-{key}"


def random_init_saved(model_cfg: ModelConfig, pad_token_id: int) -> bool:
    """Whether :func:`saved_random_init` will find the init saved (a run that finds none builds it first: the memory
    estimate counts that, ``rm.memory.terms.random_init_build_bytes``)."""
    return (random_init_path(model_cfg, pad_token_id) / "config.json").is_file()


# How long a process that is not local rank 0 waits for local rank 0 to save the random init (a 7B shape takes
# minutes on a CPU); torchrun stops the waiting processes sooner if local rank 0 fails.
RANDOM_INIT_WAIT_S = 3600


def saved_random_init(model_cfg: ModelConfig, pad_token_id: int) -> Path:
    """A model built from ``model_cfg``'s shape at the current seed, saved once at :func:`random_init_path`.

    The process of local rank 0 builds it (one per node; the memory estimate counts the fp32 model there) under a
    file lock, which serialises runs sharing the cache; it writes under a temporary name and renames, so that no
    process reads a half-written one. The other processes of the launch wait for it and load what it wrote.
    """
    path = random_init_path(model_cfg, pad_token_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    if launch_env().local_rank != 0:
        deadline = time.monotonic() + RANDOM_INIT_WAIT_S
        while not (path / "config.json").is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {RANDOM_INIT_WAIT_S} s for local rank 0 to save the random init of "
                                   f"model={model_cfg.name} at {path}")
            time.sleep(0.1)
        return path
    config = _config_from_shape(model_cfg, pad_token_id)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").is_file():
            return path
        with torch.random.fork_rng(devices=[]):  # the run's own draws go on as if nothing was drawn here
            model = AutoModelForSequenceClassification.from_config(config, attn_implementation=model_cfg.attn_implementation)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        # Written here, not with save_pretrained, which writes nothing on a process whose torch.distributed rank is
        # not 0 (transformers' should_save_on_this_rank): when rank 1 took the lock first it renamed an empty
        # directory into place and failed to load it ("Unrecognized model ... config.json"; local rank 0 of a second
        # node is such a process too). The files are save_pretrained's, byte for byte (tests/memory/test_profiles.py).
        config.architectures = [type(model).__name__]
        config.dtype = "float32"
        config.save_pretrained(tmp)
        save_file(model.state_dict(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model
        os.rename(tmp, path)
        log.info("saved the random init of model=%s to %s to load it quantised", model_cfg.name, path)
    return path


@contextmanager
def named_damage(directory: Path, fix: str = "copy it again, or export the run again from a checkpoint"):
    """A weights file under ``directory`` that cannot be read back is named as damaged (exit 5), with ``fix``, not
    reported as a full disk: the library's own error (safetensors' "Error while deserializing header") names no file."""
    from rm.foundations.errors import RmError, StorageError, is_storage_failure

    try:
        yield
    except Exception as err:  # noqa: BLE001  (re-raised unless it is a damaged file's)
        if isinstance(err, RmError) or not is_storage_failure(err):
            raise
        damaged = damaged_weights(directory)
        if not damaged:
            raise
        raise StorageError("; ".join(f"{path} cannot be read back ({why}): the file is damaged or cut short (a disk that "
                                     f"filled during a save, an interrupted copy); {fix}" for path, why in damaged)) from err


def damaged_weights(directory: Path) -> List[Tuple[Path, str]]:
    """The safetensors files under ``directory`` whose header safetensors cannot read, with its reason."""
    from safetensors import safe_open

    damaged = []
    for path in sorted(Path(directory).rglob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                f.keys()
        except Exception as err:  # noqa: BLE001  (whatever safetensors raises for this file is the reason)
            damaged.append((path, f"{type(err).__name__}: {err}"))
    return damaged


def check_pretrained_source(model_cfg: ModelConfig) -> None:
    """Where ``model.pretrained`` is a Hub id, its config is fetched now (a few KB, the file the model's load reads
    first, cached for it): a Hub that cannot be reached here, or a repository that does not exist, is named before the
    data pass, which on HH-RLHF takes minutes, instead of after it. A local directory is checked by
    :mod:`rm.settings.validate`; a model built from its shape (no ``model.pretrained``) needs nothing.

    Raises:
        StorageError: the id cannot be fetched (``named_hub_source``'s message, exit 5).
    """
    pretrained = model_cfg.pretrained
    if not pretrained or Path(pretrained).expanduser().is_dir():
        return
    with named_hub_source("model.pretrained", pretrained):
        AutoConfig.from_pretrained(pretrained, trust_remote_code=model_cfg.trust_remote_code)


def build_model(
    model_cfg: ModelConfig, pad_token_id: int, dtype: str, gradient_checkpointing: bool, quantize_base: str = "none",
    device: Optional[torch.device] = None,
) -> PreTrainedModel:
    """A one-output ``AutoModelForSequenceClassification`` with its weights in ``dtype``.

    Args:
        model_cfg: the ``model`` group.
        pad_token_id: the tokenizer's pad id, stored in the model config so plain
            transformers finds the reward token the same way after saving.
        dtype: torch's name of the dtype the weights are stored in (``float32``, ``bfloat16``, ``float16``);
            under 4-bit quantisation, the dtype of the other weights and of each 4-bit matmul.
        gradient_checkpointing: recompute activations during backward.
        quantize_base: ``nf4`` loads the weights in 4-bit NF4 through bitsandbytes (QLoRA).
        device: where a model built from its shape (no ``model.pretrained``) draws its random init; ``None``: the
            default device. On a GPU this is seconds for a 7B shape where the CPU takes minutes.

    Returns:
        The model, in training mode.
    """
    dtype = getattr(torch, dtype)
    tracing = torch.get_default_device().type == "meta"  # rm.memory.trace builds the model with no weights
    pretrained = model_cfg.pretrained
    if quantize_base != "none" and pretrained is None and not tracing:
        # bitsandbytes quantises as weights load: a model built from its shape is saved first, so that the
        # quantising path a pretrained model takes is the one that runs.
        pretrained = str(saved_random_init(model_cfg, pad_token_id))
    if pretrained and not tracing:
        quantization = None
        if quantize_base == "nf4":
            from transformers import BitsAndBytesConfig

            quantization = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype,
            )
        # A local directory's weights file cut short (an interrupted download or copy) is named, with its key.
        with named_damage(Path(pretrained), fix=f"copy or download it again (model.pretrained={model_cfg.pretrained})"), \
                named_hub_source("model.pretrained", pretrained):
            model = AutoModelForSequenceClassification.from_pretrained(
                pretrained,
                num_labels=1,
                dtype=dtype,
                attn_implementation=model_cfg.attn_implementation,
                trust_remote_code=model_cfg.trust_remote_code,
                quantization_config=quantization,
                # bitsandbytes' 4-bit layers quantise where they are placed: on a machine without CUDA, the CPU backend
                **({"device_map": "cpu"} if quantization is not None and not torch.cuda.is_available() else {}),
            )
        model.config.pad_token_id = pad_token_id
        if quantization is not None:
            keep_4bit_weights_on_load(model)
            evaluate_4bit_as_trained(model)
    else:
        config = _config_from_shape(model_cfg, pad_token_id)
        # Build directly in the target dtype: casting afterwards briefly holds two copies.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device) if device is not None else nullcontext():
                model = AutoModelForSequenceClassification.from_config(config, attn_implementation=model_cfg.attn_implementation)
        finally:
            torch.set_default_dtype(previous)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    # The KV cache is useless for scoring and incompatible with gradient checkpointing.
    model.config.use_cache = False
    model.train()
    return model


def keep_4bit_weights_on_load(model: torch.nn.Module) -> None:
    """Make a checkpoint's ``load_state_dict`` keep each 4-bit layer's frozen weight as loaded here.

    Why: a module's state dict holds a 4-bit weight with its quantisation state as extra keys (``weight.absmax``,
    ``weight.quant_map``, ...), which ``load_state_dict`` does not take back (transformers' quantiser does, at
    ``from_pretrained``), and bitsandbytes repacks the weight in place at a CPU evaluation (another layout, same
    values). The frozen base is rebuilt from the same weights at every start, so the saved copy is passed over.
    """
    def keep(module, state_dict, prefix, *args):
        for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
            del state_dict[key]
        if prefix + "weight" in state_dict:
            state_dict[prefix + "weight"] = module.weight

    for module in model.modules():
        if type(module).__name__ == "Linear4bit":  # bitsandbytes' class, without importing bitsandbytes here
            module.register_load_state_dict_pre_hook(keep)


def evaluate_4bit_as_trained(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off bitsandbytes' CPU inference kernel in every 4-bit layer, so that evaluation computes as training does.

    Why: on a CPU with AVX512-BF16 bitsandbytes evaluates a 4-bit layer through a bf16 kernel after repacking its
    weight in place, which needs out_features divisible by 32 (an intermediate size of 504 fails the evaluation with
    "N must be divisible by block_n") and scores in bf16 what trained in fp32.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer's activations in backward, non-reentrant: that works with frozen inputs (LoRA)
    without ``enable_input_require_grads``. transformers 5 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name warns on every call, from 5.2x) and the kwargs with it;
    the old name stays for the transformers 5 releases without the new one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder layer in place (``train.compile``): regional compilation, as torchtitan and
    transformers do it, rather than the whole model. Returns how many layers it compiled.

    Why regional: every layer has the same code and shapes, so one compile serves them all (dynamo inlines the
    modules and guards on their parameters as inputs), where a whole-model compile takes as many times longer as
    there are layers. ``Module.compile`` keeps the module and its parameter names (``torch.compile(module)`` would
    wrap it and prefix every key of its state dict), so checkpoints, PEFT, export and the engine see the same model.
    The attention call inside each layer stays eager (:func:`rm.modelling.attention.keep_attention_eager`), and so
    does the reward head. The layers are the modules of the classes the model names in ``_no_split_modules``
    (transformers' own list of its decoder-layer classes; under PEFT, the base model's).
    """
    from rm.modelling.attention import keep_attention_eager

    layer_classes = set()
    for module in model.modules():
        layer_classes.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise TypeError(f"train.compile: {type(model).__name__} names no decoder-layer class (_no_split_modules) to compile")
    keep_attention_eager()
    # Sequence lengths change every micro-batch: compiled for any length from the first call (dynamic), rather than
    # for the first length, then again for any. What is left to recompile for is finite (training and evaluation,
    # each layout's keyword arguments, the two calls around the attention's graph break, checkpointing's recompute):
    # the demo's busiest frame takes 6 graphs, near dynamo's default limit of 8, past which a frame runs uncompiled.
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before torch 2.6
    setattr(config, limit, max(getattr(config, limit), 32))
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


def apply_memory_profile(model: PreTrainedModel, profile: MemoryProfileConfig, lora_cfg: LoraConfig) -> PreTrainedModel:
    """Make the weights the profile trains trainable; wrap with PEFT LoRA when it asks for it."""
    if not profile.use_lora:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType, get_peft_model, prepare_model_for_kbit_training

    if profile.quantize_base != "none":
        # Casts norms and the head to fp32 for stable 4-bit training; keeps our checkpointing choice.
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=(model.is_activation_checkpointing if hasattr(model, "is_activation_checkpointing")
                                        else model.is_gradient_checkpointing),
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    peft_cfg = PeftLoraConfig(
        task_type=TaskType.SEQ_CLS,  # also trains and saves the reward head ("score")
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
    )
    return get_peft_model(model, peft_cfg)


def build_reward_model(model_cfg: ModelConfig, profile: MemoryProfileConfig, lora_cfg: LoraConfig, *, numerics: Numerics,
                       gradient_checkpointing: bool, fp32_head: bool, pad_token_id: int,
                       device: Optional[torch.device] = None) -> torch.nn.Module:
    """The reward model a run trains: the backbone, the reward head in fp32 where asked, the memory profile.

    The estimate traces this same function (``rm.memory.trace``): on the meta device, with two layers
    and no pretrained weights, so that what it measures cannot drift from what trains.

    Args:
        model_cfg, profile, lora_cfg: the ``model``, ``memory_profile`` and ``lora`` groups.
        numerics: the dtypes of the run's precision under its engine (``Plan.numerics``): a trained model is
            stored in ``numerics.weights``, a LoRA base (frozen) in ``numerics.frozen``.
        gradient_checkpointing: ``train.gradient_checkpointing``.
        fp32_head: keep the reward head's weights and computation in fp32 (:func:`fp32_head_enabled`).
        pad_token_id: the tokenizer's pad id.
        device: where a model built from its shape is initialised (:func:`build_model`).
    """

    dtype = numerics.frozen if profile.use_lora else numerics.weights
    model = build_model(model_cfg, pad_token_id, dtype, gradient_checkpointing, profile.quantize_base, device)
    if fp32_head:
        keep_head_in_fp32(model)  # before PEFT copies the head, so that its trained copy is fp32 too
    model = apply_memory_profile(model, profile, lora_cfg)
    if numerics.master is not None and numerics.weights != "float32":
        # DeepSpeed's bf16/fp16 casts every floating-point parameter (PEFT's fp32 adapters, the fp32 head; under QLoRA
        # the embedding and norms prepare_model_for_kbit_training made fp32, not bitsandbytes' packed uint8 weights)
        # to its compute dtype at initialize (engine.py, _cast_module_mixed_precision; buffers such as RoPE's stay
        # fp32): cast them here, so that the model traced for the estimate is the one DeepSpeed trains.
        for param in model.parameters():
            if param.dtype.is_floating_point:
                param.data = param.data.to(numerics.dtype("weights"))
    return model


def quantization_state_tensors(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    """The tensors bitsandbytes keeps beside each 4-bit weight (block scales, their double-quantised scales, the
    code book), which are not parameters: the memory count registers them with the weights."""
    def tensors(state):
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif hasattr(value, "absmax"):  # the nested state of double quantisation
                yield from tensors(value)

    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        if state is not None:
            yield from tensors(state)


def count_parameters(model: torch.nn.Module) -> Tuple[int, int]:
    """(trainable, total) parameter counts; under ZeRO-3 the full sizes, not the local shards."""

    def size(p):
        return getattr(p, "ds_numel", p.numel())

    trainable = sum(size(p) for p in model.parameters() if p.requires_grad)
    total = sum(size(p) for p in model.parameters())
    return trainable, total


def build_optimizer(model: torch.nn.Module, profile: MemoryProfileConfig, optim: OptimConfig) -> torch.optim.Optimizer:
    """The profile's optimizer over the trainable parameters.

    Biases and norm weights get no weight decay, as in every transformers recipe.
    torch AdamW runs ``fused=True``: one kernel for all tensors and, unlike
    ``foreach``, no parameter-sized scratch buffer at the step (the peak of a
    full fine-tune). The 8-bit profile uses bitsandbytes' AdamW8bit (block-wise
    quantised states), paged on CUDA so that state pages can spill to host RAM
    under pressure instead of failing. ``optim.kahan_summation`` (``bf16-true``) takes optimi's AdamW, which adds each
    update to a bf16 weight with Kahan compensation: what rounding drops is kept in a bf16 buffer and added back
    at the next step, so small updates accumulate. Its loop over tensors (``foreach=False``) keeps its scratch to
    one tensor's worth.
    """
    lr, weight_decay, betas, eps = optim.learning_rate, optim.weight_decay, (optim.adam_beta1, optim.adam_beta2), optim.adam_epsilon
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if profile.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if torch.cuda.is_available() else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps)
    if optim.kahan_summation:
        from optimi import AdamW

        return AdamW(groups, lr=lr, betas=betas, eps=eps, kahan_sum=True, foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of the last real token (the last 1 of the mask) in each row, whatever the padding side.

    Example:
        >>> last_token_index(torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([2, 3, 3])
    """
    # argmax returns the first maximum, so on the flipped mask it finds the last 1.
    return attention_mask.shape[-1] - 1 - attention_mask.flip(-1).argmax(-1)


def reward_head(model: torch.nn.Module) -> torch.nn.Module:
    """The ``score`` head (:data:`HEAD`) of a sequence-classification model, through DDP, DeepSpeed and PEFT wrappers.

    Under PEFT it is the ``ModulesToSaveWrapper`` whose output is that of the trained copy.

    Raises:
        TypeError: the model has no ``score`` head (encoder models pool before their head).
    """
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, DeepSpeed's engine
        model = model.module
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    head = getattr(model, HEAD, None)
    if not isinstance(head, torch.nn.Module):
        raise TypeError(f"{type(model).__name__} has no `score` head: rm reads per-token rewards from decoder models")
    return head


def sequence_rewards(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    position_ids: Optional[torch.Tensor] = None,
    ends: Optional[torch.Tensor] = None,
    pair_ids: Optional[torch.Tensor] = None,
    roles: Optional[torch.Tensor] = None,
    segment_bounds: Optional[List[int]] = None,
    segment_roles: Optional[List[int]] = None,
) -> torch.Tensor:
    """One reward per row, read at its last real token (by the attention mask), in one forward pass.

    transformers' sequence-classification models pool at the rightmost token whose id is not
    the pad id, which skips a final EOS when EOS doubles as the pad token. So the per-token
    output of the ``score`` head is caught with a forward hook and read at the last 1 of the
    mask instead. The model itself is called as usual, so DeepSpeed ZeRO-3's module hooks
    gather the parameters and PEFT's wrappers run. Left-padded rows get positions counted
    from their first real token, so their rewards equal those of right padding (models with
    absolute position embeddings need it; rotary ones only change by rounding).

    A packed batch (:class:`~rm.data.collator.PackedPairCollator`: one row, position ids
    restarting per sequence, no mask) is read at ``ends``; with no mask transformers keeps
    attention within each sequence (a block-diagonal mask, or flash-attention's varlen). SDPA takes
    such a row one sequence (or prefix-shared pair) at a time, on CUDA in half precision in one varlen flash call a
    layer, and on a GPU keeps every row layout off cuDNN's kernel (:mod:`rm.modelling.attention`).

    A prefix-shared batch (:class:`~rm.data.collator.PrefixSharedCollator`) also gives ``pair_ids``
    and ``roles``, from which the 4D mask is built here, on the device and in the form the model's
    attention takes (:func:`rm.modelling.prefix_sharing.shared_prefix_mask`); its ``ends`` are flat indices into
    the ``(rows x T)`` batch.

    Args:
        model: a ``*ForSequenceClassification`` model with a ``score`` head, possibly wrapped.
        input_ids: ``(N, T)`` token ids; ``(1, T)`` when packed.
        attention_mask: ``(N, T)``, 1 on real tokens; ``None`` when packed.
        position_ids: packed only: ``(1, T)``, restarting at 0 at each sequence.
        ends: packed only: ``(S,)`` position of each sequence's last token (flat index).
        pair_ids: prefix-shared only: ``(rows, T)`` pair of each token, -1 on padding.
        roles: prefix-shared only: ``(rows, T)`` prefix / chosen / rejected / pad per token.
        segment_bounds: packed only: where the row's sequences (pairs) start, ``[0, ..., T]``, for the estimate's
            trace, whose fake ids cannot be read, and for the training loop, which reads them on the host before the
            batch moves (:func:`host_hints`); otherwise read off the ids, on a GPU a copy that waits for the device.
        segment_roles: prefix-shared and packed only: ``roles`` of the row as a host list (:func:`host_hints`);
            otherwise read off ``roles``, on a GPU a copy that waits for the device.

    Returns:
        ``(N,)`` rewards, or ``(S,)`` when packed; differentiable.
    """
    if (ends is None) == (attention_mask is None):
        raise ValueError("give attention_mask for a padded batch, or position_ids and ends for a packed one")
    from rm.modelling.prefix_sharing import attn_implementation_of

    attn_implementation = attn_implementation_of(model)
    if attn_implementation == "sdpa":
        # rm's SDPA, registered under transformers' name on import: packed rows a segment at a time, and on a GPU
        # no cuDNN kernel for any row (rm.modelling.attention.sdpa_kernels)
        from rm.modelling.attention import segmented_inputs
    caught = []
    handle = reward_head(model).register_forward_hook(lambda module, args, output: caught.append(output))
    kwargs = {"attention_mask": attention_mask}
    if ends is not None:
        kwargs = {"position_ids": position_ids}  # no mask: transformers derives the sequence boundaries from these
        segmented = None
        if attn_implementation == "sdpa":  # a packed row's SDPA one sequence (or pair) at a time
            segmented = segmented_inputs(input_ids, position_ids, pair_ids, roles, segment_bounds, segment_roles)
        if segmented:
            kwargs.update(segmented)
        elif pair_ids is not None:  # prefix-shared: a 4D mask, which transformers passes to the kernel as it is
            from rm.modelling.prefix_sharing import base_config, mask_windows, model_dtype, shared_prefix_mask

            kwargs["attention_mask"] = shared_prefix_mask(pair_ids, roles, attn_implementation, model_dtype(model),
                                                          position_ids, mask_windows(base_config(model)))
    elif _left_padded(attention_mask):
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    try:
        model(input_ids=input_ids, **kwargs)
    finally:
        handle.remove()
    if len(caught) != 1 or caught[0].dim() != 3:
        raise TypeError(f"expected one per-token (N, T, 1) output of the reward head, got {[tuple(o.shape) for o in caught]}")
    if ends is not None:
        return caught[0].flatten(0, 1)[ends.to(caught[0].device)].squeeze(-1)
    rows = torch.arange(input_ids.shape[0], device=caught[0].device)
    return caught[0][rows, last_token_index(attention_mask).to(caught[0].device)].squeeze(-1)


def host_hints(batch: Dict[str, torch.Tensor]) -> Dict[str, object]:
    """What :func:`sequence_rewards` would otherwise read off a packed batch's tensors once they are on the device,
    read here from the collated batch while it is still on the host: the row's segments, and a prefix-shared row's
    roles. On a GPU each such read copies to the host and waits for every kernel queued before it: one wait a
    micro-batch, where the host would otherwise queue the next micro-batch's kernels while the device runs this
    one's. (A padded batch has none here; transformers itself reads its mask once a forward, to skip it where
    nothing is padded.)

        >>> from rm.data.collator import PackedPairCollator
        >>> host_hints(PackedPairCollator()([{"chosen_input_ids": [5, 6], "rejected_input_ids": [7]}]))
        {'segment_bounds': [0, 2, 3]}
    """
    from rm.modelling.attention import segment_bounds

    if "attention_mask" in batch or batch["input_ids"].shape[0] != 1:  # padded, or prefix-shared rows: not packed
        return {}
    shared = "pair_ids" in batch
    bounds = segment_bounds(batch["pair_ids"] if shared else batch["position_ids"], not shared)
    hints = {"segment_bounds": bounds or [0, batch["input_ids"].shape[1]]}  # [0, T]: one segment, nothing to read
    if shared:
        hints["segment_roles"] = batch["roles"][0].tolist()
    return hints


def _left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether some row starts with padding. A fake tensor (the estimate's trace) holds no values: it takes
    the right-padded path, the one rm's collators produce."""
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(attention_mask) and not bool(attention_mask[:, 0].all())


def pair_rewards(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
                 position_ids: Optional[torch.Tensor] = None, ends: Optional[torch.Tensor] = None,
                 pair_ids: Optional[torch.Tensor] = None, roles: Optional[torch.Tensor] = None,
                 segment_bounds: Optional[List[int]] = None, segment_roles: Optional[List[int]] = None):
    """Score a :class:`~rm.data.collator.PairCollator`, :class:`~rm.data.collator.PackedPairCollator`
    or :class:`~rm.data.collator.PrefixSharedCollator` batch in one forward pass (:func:`sequence_rewards`).

    Returns:
        ``(chosen_rewards, rejected_rewards)``, each of shape ``(B,)``.
    """
    rewards = sequence_rewards(model, input_ids, attention_mask, position_ids=position_ids, ends=ends,
                               pair_ids=pair_ids, roles=roles, segment_bounds=segment_bounds,
                               segment_roles=segment_roles)
    half = rewards.shape[0] // 2
    return rewards[:half], rewards[half:]


def _fp32_linear(self, hidden: torch.Tensor) -> torch.Tensor:
    # Autocast would cast a linear back to bf16/fp16 whatever its weights: turn it off here.
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        bias = self.bias.float() if self.bias is not None else None
        return F.linear(hidden.float(), self.weight.float(), bias)


def keep_head_in_fp32(model: torch.nn.Module, head: str = HEAD) -> torch.nn.Module:
    """Store the reward head's weights in fp32 and compute it in fp32, in place (``health.fp32_head``).

    The reward is one dot product over the hidden size: in bf16 (8 significant bits) two
    close rewards round to the same value, and their difference is all the loss sees.
    The head's state-dict keys do not change, so saved models load as before. Call it
    before PEFT wraps the model: the trained copy PEFT makes of the head keeps both
    (``copy.deepcopy`` rebinds the fp32 forward to the copy). DeepSpeed casts every
    weight to bf16/fp16 at ``initialize`` (its fp32 master copy is what it updates);
    the forward still computes in fp32 there.

    Args:
        model: a ``*ForSequenceClassification`` model, not yet wrapped.
        head: the head's attribute name.

    Returns:
        ``model``.
    """
    module = getattr(model, head)
    if type(module) is not torch.nn.Linear:  # e.g. a bitsandbytes Linear4bit, whose weight is packed
        log.warning("health.fp32_head: `%s` is a %s, not a plain Linear: left as it is", head, type(module).__name__)
        return model
    module.float()
    module.forward = types.MethodType(_fp32_linear, module)
    return model
