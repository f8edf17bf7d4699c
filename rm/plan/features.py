"""Every runtime feature and its three shadows: the memory term that sizes it, the step-time term that times it and
the validation rule that refuses its bad combinations. The pre-flight promise (a run that starts fits, and
``rm.plan`` ranks layouts by speed) holds only while each feature has all three; this table says where they are.

A :class:`Feature` names its config keys (``train.packing``) or, for one value of an enumerated key, the key and
the values it covers (``model.attn_implementation`` = ``flex_attention``), and holds the real objects: functions,
constants, methods, imported here, so a rename breaks this import. A shadow that does not exist is a :class:`Gap`
that says why (evaluation is not part of a training step's time, say): a declared gap, never a silent one.

``tests/plan/test_features.py`` reads this table and fails (:func:`missing` lists why) when

- a key of ``TrainConfig``, ``ModelConfig``, ``MemoryProfileConfig`` or ``LoraConfig`` is neither in a feature nor
  in :data:`NOT_SHADOWED` (a key that changes neither memory nor speed, with why);
- a value that ``rm.settings.validate.CHOICES`` allows for an enumerated key of :data:`ENUMERATED` has no feature
  (a new attention implementation, optimizer, quantisation or precision mode);
- a feature's validation rule does not mention its key (a rule is a function, whose source is read, or a
  collection of names);
- an attention implementation's declared kernel is not the one ``rm.foundations.hardware.attention_kernel`` gives
  it, which both the step-time model and the memory estimate follow (an unknown name falls back to ``square``).

Adding an attention kernel: its name in ``CHOICES["model.attn_implementation"]``; its kernel class in
``rm.foundations.hardware`` (``MASK_SKIPPING`` or ``attention_kernel``); what the trace runs in its place
(``rm.memory.terms.traced_model``) and the rule of what it cannot take (``rm.settings.validate``); then a
``Feature`` here with ``kernel=`` set. Adding a memory profile that only combines existing settings is its YAML
alone (``rm.foundations.config.memory_profiles``); a profile that needs a new setting (an optimizer, a
quantisation) adds that setting's value to ``CHOICES``, its bytes in ``rm.memory.terms``, its traffic in
``rm.plan.steptime``, its refusals in ``rm.settings.validate._check_profile_and_distribution``, and a ``Feature``
here. A new config key is a feature here or a line of ``NOT_SHADOWED``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Dict, List, Optional, Tuple, get_type_hints

from rm.foundations.config import LoraConfig, MemoryProfileConfig, ModelConfig, TrainConfig
from rm.foundations.hardware import attention_kernel, run_attention_kernel
from rm.foundations.precision import NAMES as PRECISION_NAMES
from rm.foundations.precision import Precision
from rm.memory import terms
from rm.plan import lengths, steptime
from rm.settings import validate as rules


@dataclass(frozen=True)
class Gap:
    """A shadow the feature does not have, and why that is right (or what is not modelled yet)."""

    why: str


@dataclass(frozen=True)
class Feature:
    """One runtime feature: the keys that switch it and where its memory, step time and validation live.

    Attributes:
        name: in words, as a contributor would look for it.
        keys: dotted config keys (``train.packing``); for an enumerated key, the one key.
        memory: the term of ``rm.memory`` that sizes it (a function, constant or method), or a :class:`Gap`.
        step_time: the term of ``rm.plan`` (or what it calls) that times it, or a :class:`Gap`.
        validation: the rules of ``rm.settings.validate`` that check it (functions, or collections of names), or a
            :class:`Gap`; together they mention every key.
        values: for an enumerated key, the allowed values this feature is (empty: the keys whatever their value).
        kernel: an attention implementation's kernel class (``rm.foundations.hardware.attention_kernel``).
        measured_on: for a layout knob whose step time on a device hangs on a rate only a run there gives (a masked
            or segmented attention kernel, recomputation), the device kinds (``cpu``, ``cuda``) where runs with it
            on were timed (docs/throughput.md, docs/gpu.md); ``rm.plan`` ranks a layout using one that was never timed
            on the run's device after those that were, and marks it. None: its cost is modelled from rates the
            device's profile states, nothing of its own to measure.
    """

    name: str
    keys: Tuple[str, ...]
    memory: Any
    step_time: Any
    validation: Tuple[Any, ...]
    values: Tuple[str, ...] = ()
    kernel: Optional[str] = None
    measured_on: Optional[Tuple[str, ...]] = None


_LAYOUT_STEPS = (lengths.step_micro_batches, steptime.micro_batch)  # the micro-batches a layout forms, and their work

FEATURES: Tuple[Feature, ...] = (
    # Layouts: the same pairs and gradient, cut and laid out differently (rm.data.shapes, rm.plan.auto).
    # Packed and prefix-shared rows: timed on CPUs only. Their one GPU run (an H200, docs/gpu.md) took 6x the padded
    # row's step under cuDNN's per-shape graphs; the kernels changed since, and no GPU has timed them again.
    Feature("packing", ("train.packing",), terms.worst_case_shapes, _LAYOUT_STEPS, (rules.validate,),
            measured_on=("cpu",)),
    Feature("token budget per micro-batch", ("train.max_tokens_per_micro_batch",), terms.worst_case_shapes,
            _LAYOUT_STEPS, (rules.validate, rules.RANGES), measured_on=("cpu",)),
    Feature("prefix sharing", ("train.share_prefix",), (terms.shared_prefix_rows, terms.shared_prefix_input_bytes),
            _LAYOUT_STEPS, (rules.validate,), measured_on=("cpu",)),
    Feature("grouping by length", ("train.group_by_length",), lengths.memory_shapes, _LAYOUT_STEPS,
            Gap("true and false are valid with every other setting")),
    Feature("micro-batch and global batch", ("train.micro_batch_size", "train.global_batch_size"),
            terms.worst_case_shapes, _LAYOUT_STEPS, (rules.validate,)),
    Feature("evaluation batch", ("train.eval_batch_size",), terms.worst_case_shapes,
            Gap("evaluation is not part of an optimizer step: rm.plan times training steps"), (rules.RANGES,)),
    Feature("gradient checkpointing", ("train.gradient_checkpointing",), (terms.traced_model, terms.device_terms),
            steptime.micro_batch_flops, Gap("true and false are valid with every other setting"),
            measured_on=("cpu",)),  # docs/gpu.md: no checkpointed run's step was timed on a GPU yet
    # Numerics.
    Feature("precision modes", ("train.precision",), Precision.numerics, steptime.predict_step_seconds,
            (rules._precision, rules._precision_for_layout), values=("32-true", "bf16-mixed", "bf16-true", "16-mixed")),
    Feature("Kahan summation", ("train.optim.kahan_summation",), terms.trace_free_terms,
            Gap("not modelled: optimi's compensation buffer adds 2 bytes a trained weight to the optimizer's traffic, "
                "which steptime.adamw_traffic_bytes leaves out"),
            (rules._precision_for_layout,)),
    Feature("regional torch.compile", ("train.compile",), terms.traced_model,
            Gap("not modelled: rm.plan prices the eager layers (the CPU A/B of docs/throughput.md; no GPU has timed a "
                "compiled run), and train.layout=auto never turns it on"),
            (rules._compile_errors,)),
    Feature("reward centring", ("train.center_rewards_coefficient",), terms.traced_model,
            Gap("a few elementwise ops a pair, below the model's resolution"), (rules.RANGES,)),
    # The model and its kernels.
    Feature("model shape", ("model.model_type", "model.vocab_size", "model.hidden_size", "model.intermediate_size",
                            "model.num_hidden_layers", "model.num_attention_heads", "model.num_key_value_heads",
                            "model.head_dim", "model.max_position_embeddings", "model.tie_word_embeddings"),
            (terms.parameter_counts, terms.traced_model), steptime.model_work,
            (rules._model_shape_errors, rules.SHAPE_KEYS, rules.validate)),
    Feature("pretrained weights", ("model.pretrained",), (terms.host_bytes, terms.random_init_build_bytes),
            Gap("loading is not part of an optimizer step"), (rules._model_shape_errors,)),
    # SDPA: a packed row a segment at a time, or on CUDA in half precision one varlen flash call a layer: which one
    # runs is rm.foundations.hardware.attention_kernel's (run_attention_kernel, given the device and numerics), and
    # both shadows follow it: the trace runs the varlen call where the run would (activation_terms, through
    # TracedModel.attention_kernel), and the step time prices it one call a layer (steptime.micro_batch). The
    # varlen path's memory and time are modelled, never measured on a GPU.
    Feature("SDPA attention", ("model.attn_implementation",), (terms.traced_model, terms.activation_terms),
            (*_LAYOUT_STEPS, run_attention_kernel), (rules.validate,), values=("sdpa",), kernel="segments"),
    Feature("eager attention", ("model.attn_implementation",), terms.traced_model, _LAYOUT_STEPS,
            (rules.validate,), values=("eager",), kernel="square"),
    Feature("flash-attention 2", ("model.attn_implementation",), terms.traced_model, _LAYOUT_STEPS,
            (rules.validate, rules._model_shape_errors), values=("flash_attention_2",), kernel="skips"),
    Feature("flex-attention", ("model.attn_implementation",), terms.traced_model, _LAYOUT_STEPS,
            (rules._attention_warnings,), values=("flex_attention",), kernel="skips"),
    # Memory profiles: each profile YAML combines these settings (rm.foundations.config.memory_profiles).
    Feature("LoRA", ("memory_profile.use_lora", "lora.r", "lora.target_modules", "lora.dropout"),
            (terms.parameter_counts, terms.weight_bytes), steptime.model_work, (rules.validate, rules.RANGES)),
    Feature("AdamW", ("memory_profile.optimizer",), terms.adamw_state_bytes, steptime.adamw_traffic_bytes,
            (rules._precision_for_layout,), values=("adamw",)),
    Feature("8-bit AdamW", ("memory_profile.optimizer",), terms.adamw_state_bytes, steptime.adamw_traffic_bytes,
            (rules._check_profile_and_distribution,), values=("adamw_8bit",)),
    Feature("optimizer offload", ("memory_profile.offload_optimizer",), terms.deepspeed_terms,
            steptime.predict_step_seconds, (rules._check_profile_and_distribution,)),
    Feature("unquantised base", ("memory_profile.quantize_base",), terms.weight_bytes, steptime.model_work,
            (rules._check_profile_and_distribution,), values=("none",)),
    Feature("4-bit NF4 base (QLoRA)", ("memory_profile.quantize_base",), (terms.nf4_bytes, terms.qlora_load_bytes),
            steptime.model_work, (rules._check_profile_and_distribution,), values=("nf4",)),
)

# Keys that change neither what a step holds nor what it costs, each with why.
NOT_SHADOWED: Dict[str, str] = {
    "train.seed": "which pairs meet in a micro-batch, not a feature: the estimate reads the data's own batches",
    "train.max_steps": "the run's length; the estimate sizes the largest micro-batch over its steps (memory_shapes)",
    "train.num_train_epochs": "the run's length, as train.max_steps",
    "train.layout": "chooses among the layout features' keys (rm.plan.auto), whose shadows are theirs",
    "train.optim.learning_rate": "a number in the update, not a tensor or an op",
    "train.optim.weight_decay": "a number in the update",
    "train.optim.adam_beta1": "a number in the update",
    "train.optim.adam_beta2": "a number in the update",
    "train.optim.adam_epsilon": "a number in the update",
    "train.optim.lr_scheduler_type": "the learning rate's factor per step",
    "train.optim.warmup_ratio": "the learning rate's factor per step",
    "train.optim.max_grad_norm": "clipping: a norm over the gradients, below the step-time model's resolution",
    "train.logging.logging_steps": "between steps",
    "train.logging.eval_steps": "between steps: evaluation's memory is the evaluation batch's",
    "train.checkpoint.save_steps": "between steps, on disk",
    "train.checkpoint.save_total_limit": "on disk",
    "train.checkpoint.resume": "where the run starts",
    "train.checkpoint.resume_allow_changes": "what a resumed run accepts",
    "train.checkpoint.overwrite": "the run directory",
    "train.logging.tensorboard": "logging",
    "train.logging.track_memory": "CPU only: counts live tensors, holds none",
    "train.dataloader_num_workers": "host processes that collate, no device memory",
    "train.threads": "CPU threads of one process: no device memory; rm.plan measures a CPU at the threads it runs with",
    "model.name": "a label",
    "model.tokenizer": "the token ids, not their number (data.max_length bounds that)",
    "model.rope_theta": "a number in the rotary embedding",
    "model.rms_norm_eps": "a number in the norms",
    "model.trust_remote_code": "permission, not a feature",
    "memory_profile.name": "a label",
    "memory_profile.order": "where the profile is listed",
    "lora.alpha": "a scale, not a tensor",
    "lora.merge_on_save": "after training, on the host",
}

SCHEMAS = {"train": TrainConfig, "model": ModelConfig, "memory_profile": MemoryProfileConfig, "lora": LoraConfig}
# The enumerated keys whose every allowed value is a feature (rm.settings.validate.CHOICES). train.precision's
# allowed values also hold "auto" and aliases, which resolve to one of PRECISION_NAMES.
ENUMERATED = {"model.attn_implementation": None, "memory_profile.optimizer": None, "memory_profile.quantize_base": None,
              "train.precision": PRECISION_NAMES}


def unmeasured(train_cfg: TrainConfig, device: str) -> Tuple[str, ...]:
    """The features ``train_cfg`` turns on whose step time was never measured on ``device`` (``cpu``, ``cuda``).

        >>> unmeasured(TrainConfig(packing=True, share_prefix=False, gradient_checkpointing=False), "cuda")
        ('packing',)
        >>> unmeasured(TrainConfig(packing=True), "cpu")
        ()
    """
    out = []
    for f in FEATURES:
        if f.measured_on is None or device in f.measured_on:
            continue
        if any(key.startswith("train.") and getattr(train_cfg, key[len("train."):]) for key in f.keys):
            out.append(f.name)
    return tuple(out)


def _shadows(shadow) -> tuple:
    return shadow if isinstance(shadow, tuple) else (shadow,)


def mentions(rule, key: str) -> bool:
    """Whether ``rule`` (a function, read from its source, or a collection of names) names ``key``'s field."""
    name = key.rpartition(".")[2]
    if isinstance(rule, (tuple, list, set, frozenset, dict)):
        return name in rule or key in rule
    return name in inspect.getsource(rule)


def _keys(prefix: str, schema) -> List[str]:
    """The dotted keys of a schema, a nested group's (``train.optim``) each under its own name."""
    hints = get_type_hints(schema)
    out: List[str] = []
    for field in fields(schema):
        kind = hints[field.name]
        out += _keys(f"{prefix}.{field.name}", kind) if is_dataclass(kind) else [f"{prefix}.{field.name}"]
    return out


def missing(choices: Optional[Dict[str, tuple]] = None) -> List[str]:
    """What the table lacks, one line each (empty: every feature has its shadows).

    Args:
        choices: the allowed values of enumerated keys; default ``rm.settings.validate.CHOICES``.
    """
    choices = rules.CHOICES if choices is None else choices
    problems: List[str] = []
    covered = {key for f in FEATURES for key in f.keys}
    for group, schema in SCHEMAS.items():
        for key in _keys(group, schema):
            if key not in covered and key not in NOT_SHADOWED:
                problems.append(f"{key}: in no feature of rm.plan.features and not in NOT_SHADOWED")
    for key, names in ENUMERATED.items():
        registered = {v for f in FEATURES if f.keys == (key,) for v in f.values}
        for value in names if names is not None else choices[key]:
            if value not in registered:
                problems.append(f"{key}={value}: allowed (rm.settings.validate.CHOICES) but no feature registers it")
    for f in FEATURES:
        for what in ("memory", "step_time"):
            for shadow in _shadows(getattr(f, what)):
                if not (isinstance(shadow, Gap) and shadow.why) and not callable(shadow):
                    problems.append(f"{f.name}: {what} shadow {shadow!r} is neither a term nor a Gap with a reason")
        checks = _shadows(f.validation)
        if not (len(checks) == 1 and isinstance(checks[0], Gap) and checks[0].why):
            for key in f.keys:
                if not any(mentions(rule, key) for rule in checks):
                    problems.append(f"{f.name}: no validation rule of it mentions {key}")
        if f.keys == ("model.attn_implementation",):
            for value in f.values:
                if f.kernel is None or attention_kernel(value) != f.kernel:
                    problems.append(f"{f.name}: declares kernel {f.kernel!r}, rm.foundations.hardware.attention_kernel"
                                    f"({value!r}) gives {attention_kernel(value)!r}")
    return problems
