"""What a resumed run must share with the run that wrote its checkpoint.

A checkpoint records the *fingerprint* of the settings that shape the training trajectory:
the model, the LoRA settings and memory profile (which weights train, how), the data and its
policies, the seed, the batch sizes and layout, the precision as resolved, the optimizer (Kahan summation
included) and the schedule. On ``train.checkpoint.resume=true``
the current settings are compared with it. A difference is refused, naming each changed key
(a resumed run that silently trains on other data or at another learning rate is a different
model under the same name), unless ``train.checkpoint.resume_allow_changes=true``; then each change is
logged and applied for real: the optimizer's hyper-parameters and the schedule's base learning
rate are restored from the checkpoint by ``load_state``, so :func:`apply_changes` writes the
new values over them afterwards.

Settings that do not change the trajectory (logging, evaluation, saving, eval data, hardware
names, health alarms) may change freely.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
import logging
from typing import Dict, List, Optional

from rm.foundations.config import MOVED_KEYS, OptimConfig, RunConfig
from rm.foundations.errors import ConfigError
from rm.settings.validate import Plan

log = logging.getLogger(__name__)

# Keys of the train group that shape the trajectory; the rest (logging, eval, saving, resume, threads: a resume keeps
# its run's count through train_state's record) do not. share_prefix computes other sums (one row per pair, a 4D
# mask), and is a layout knob that train.layout=auto reads back from the fingerprint on resume (rm.plan.auto).
TRAIN_KEYS = (
    "seed", "max_steps", "num_train_epochs", "micro_batch_size", "global_batch_size", "group_by_length",
    "packing", "max_tokens_per_micro_batch", "share_prefix", "precision", "gradient_checkpointing",
    "center_rewards_coefficient",
)
# Keys of train.optim that shape the trajectory. kahan_summation swaps torch's AdamW for optimi's, whose bf16
# compensation buffer keeps updates that rounding drops.
OPTIM_KEYS = (
    "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "lr_scheduler_type", "warmup_ratio",
    "max_grad_norm", "kahan_summation",
)
# Keys of health that change the numbers trained, not only the alarms: fp32_head keeps the reward head's weights
# and compute in fp32. (on_nonfinite stays out: resuming a stopped run with health.on_nonfinite=skip is the way on.)
HEALTH_KEYS = ("fp32_head",)
# Keys that checkpoints written by earlier versions of rm do not record (train.precision was recorded as configured,
# "auto" included, not as the run resolved it): such a checkpoint says nothing of them, so they are not compared,
# where they would read as a change from '(unset)' and refuse every older run's resume.
LATER_KEYS = frozenset({"train.share_prefix", "train.optim.kahan_summation", "health.fp32_head", "train.precision"})
# Data keys that only concern evaluation.
EVAL_DATA_KEYS = ("eval_split", "eval_files", "extra_eval_files", "max_eval_samples", "synthetic_test_size")
# Changes that apply_changes writes over the restored optimizer and schedule.
OPTIMIZER_KEYS = ("train.optim.learning_rate", "train.optim.weight_decay", "train.optim.adam_beta1", "train.optim.adam_beta2",
                  "train.optim.adam_epsilon")


def _flat(prefix: str, obj) -> Dict[str, object]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out[f"{prefix}.{f.name}"] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def fingerprint(cfg: RunConfig, plan: Plan, train_digest: Optional[str] = None) -> Dict[str, object]:
    """The settings that shape the trajectory, as ``{"group.key": value}`` (JSON-able), and the train data's
    :func:`data_digest` when given. The micro-batch and the world size are the plan's: what the run uses."""
    fp = _flat("model", cfg.model)
    if train_digest is not None:
        fp["data.train_sha256"] = train_digest
    fp.update({k: v for k, v in _flat("data", cfg.data).items() if k.split(".", 1)[1] not in EVAL_DATA_KEYS})
    fp.update({f"train.{k}": getattr(cfg.train, k) for k in TRAIN_KEYS})
    fp.update({f"train.optim.{k}": getattr(cfg.train.optim, k) for k in OPTIM_KEYS})
    fp["train.micro_batch_size"] = plan.micro_batch_size
    # As resolved: precision=auto is bf16-mixed on one machine and 32-true on another, and the run computes in it.
    fp["train.precision"] = plan.precision
    fp.update({f"health.{k}": getattr(cfg.health, k) for k in HEALTH_KEYS})
    # Its order among the profiles is where rm.plan and the suggestions list it, nothing that trains
    fp.update({k: v for k, v in _flat("memory_profile", cfg.memory_profile).items() if k != "memory_profile.order"})
    if cfg.memory_profile.use_lora:
        fp.update({k: v for k, v in _flat("lora", cfg.lora).items() if k != "lora.merge_on_save"})
    fp["world_size"] = plan.world_size  # the per-rank sampling of each step depends on it
    return fp


def stored_fingerprint(saved: Optional[Dict]) -> Optional[Dict]:
    """A fingerprint read from a checkpoint, under today's key names: one written before a key moved into a group
    (:data:`rm.foundations.config.MOVED_KEYS`, ``train.learning_rate`` -> ``train.optim.learning_rate``) names it
    by its old name, and would otherwise read as one key removed and another added."""
    if not saved:
        return saved
    renamed = {MOVED_KEYS.get(key, key): value for key, value in saved.items()}
    if renamed.get("train.precision") == "auto":  # recorded as configured, before rm recorded what it resolved to
        del renamed["train.precision"]
    return renamed


def data_digest(train_set) -> str:
    """sha256 of the train set's token ids in order (chosen, then rejected, pair by pair): the data that shapes
    the trajectory, whatever its config keys say. A data file edited in place between a run and its resume
    changes it, as does a changed tokenizer."""
    digest = hashlib.sha256()
    for batch in train_set.select_columns(["chosen_input_ids", "rejected_input_ids"]).iter(batch_size=4096):
        for chosen, rejected in zip(batch["chosen_input_ids"], batch["rejected_input_ids"]):
            digest.update(array("i", chosen).tobytes() + b"|" + array("i", rejected).tobytes() + b";")
    return digest.hexdigest()


def changed_keys(saved: Optional[Dict], current: Dict) -> List[str]:
    """``key: old -> new`` for every key whose value differs (a key only one side has counts too, except one of
    :data:`LATER_KEYS` that the checkpoint does not record)."""
    if not saved:
        return []
    missing = object()
    return [
        f"{key}: {saved.get(key, '(unset)')!r} -> {current.get(key, '(unset)')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, missing) != current.get(key, missing) and not (key in LATER_KEYS and key not in saved)
    ]


def check_resume(saved: Optional[Dict], current: Dict, checkpoint, allow_changes: bool) -> List[str]:
    """Compare fingerprints; return the changes (allowed and logged) or raise naming them.

    Raises:
        ConfigError: settings that shape the trajectory differ and ``train.checkpoint.resume_allow_changes`` is false.
    """
    changes = changed_keys(saved, current)
    if not changes:
        return []
    if not allow_changes:
        raise ConfigError(
            f"train.checkpoint.resume=true, but these settings differ from those that wrote {checkpoint}:\n  - "
            + "\n  - ".join(changes)
            + "\nRestore them, or apply them from this step on with train.checkpoint.resume_allow_changes=true"
        )
    log.warning("train.checkpoint.resume_allow_changes=true: resuming from %s with these changes applied from here on:\n  - %s",
                checkpoint, "\n  - ".join(changes))
    return changes


def apply_changes(optimizer, scheduler, optim_cfg: OptimConfig, changes: List[str]) -> None:
    """Write the new optimizer settings and base learning rate over those restored from the checkpoint.

    The learning rate of the current step becomes ``new base lr x schedule factor at this step``,
    where the factor comes from the new schedule (warmup, total steps and type are rebuilt from the
    current config; ``LambdaLR`` saves no lambda functions, only its step and base rates).
    """
    keys = {change.split(":", 1)[0] for change in changes}
    if not keys & set(OPTIMIZER_KEYS):
        return
    t = optim_cfg
    groups = optimizer.param_groups
    for group in groups:
        group["betas"] = (t.adam_beta1, t.adam_beta2)
        group["eps"] = t.adam_epsilon
        group["initial_lr"] = t.learning_rate
    if len(groups) == 2:  # rm.modelling.model.build_optimizer: decayed weights, then biases and norms without decay
        groups[0]["weight_decay"] = t.weight_decay
    scheduler.base_lrs = [t.learning_rate for _ in groups]
    factors = [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
    for group, factor in zip(groups, factors):
        group["lr"] = t.learning_rate * factor
    scheduler._last_lr = [group["lr"] for group in groups]
