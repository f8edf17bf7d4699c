"""The final model directory as one verified bundle (``python -m rm.export`` checks one again).

A bundle holds what a user needs to score text the way training did:

* the weights (``model.safetensors`` + ``config.json``), or for LoRA the PEFT adapter
  with the reward head (``adapter_model.safetensors`` + ``adapter_config.json``);
* the tokenizer with its pad token, and its chat template (``chat_template.jinja``) if any, in two forms
  (:func:`rm.data.tokenizer.consumer_tokenizer`): at the top, the one whose ``tokenizer(text)`` gives the ids a
  plain text trained on (its post-processor appends the EOS training appended), which transformers, ``pipeline``
  and PEFT load; in ``trained_tokenizer/``, the tokenizer exactly as training used it (``rm.score``, RewardBench's
  ``--tokenizer``), with ``reward_tokens.json`` saying how training tokenised (:func:`bundle_tokenizer`);
* the tokenizer's pad, BOS and EOS ids in the saved model config. An adapter's
  ``adapter_config.json`` names its base (a hub id or a directory). Where the base was a random
  init (the demo, a QLoRA run from a shape), that base is saved in the bundle itself
  (``config.json`` + ``model.safetensors`` beside the adapter, 4-bit for QLoRA), so the bundle
  loads offline from wherever it is copied (:func:`save_base`);
* fields that moved between transformers 4 and 5 written for both (:func:`write_compat_fields`);
* ``reward_stats.json``: mean and standard deviation of the rewards (chosen and rejected
  together) on the eval set at the last evaluation and the max length they were computed at,
  for users who normalise rewards; the same ``mean``/``std`` go into ``config.json``, where
  OpenRLHF's ``--normalize_reward`` reads them;
* ``reward_probe.json``: a few pairs of the eval set (train set without one), padded, with
  the rewards the in-memory model gave them and the compute dtype;
* ``weights_sha256.json``: size and sha256 of each weights file, written once the bundle is verified; ``rm.score``
  checks them, and that the loaded weights are finite, before it scores (:func:`load_checked_bundle`).

After writing, :func:`verify_bundle` loads the directory into a fresh model and scores the
probe; a difference beyond the precision's ``export_tolerance`` (``rm.foundations.precision``) raises :class:`ExportMismatch`, which fails the
run. The same check runs for full, LoRA adapter, merged and ZeRO-3 outputs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rm.foundations.cache import file_digest
from rm.foundations.errors import ConfigError, NonFiniteError, StorageError
from rm.modelling.model import evaluate_4bit_as_trained, last_token_index, named_damage, sequence_rewards
from rm.foundations.precision import Precision
from rm.data.tokenizer import consumer_tokenizer, write_tokenizer_compat_fields

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

PROBE_FILE = "reward_probe.json"
STATS_FILE = "reward_stats.json"
TOKENS_FILE = "reward_tokens.json"  # how training tokenised: {"append_eos": ..., "trained_tokenizer": ...}
TRAINED_TOKENIZER = "trained_tokenizer"  # the tokenizer as training used it, beside the consumers' one
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_SUMS = "weights_sha256.json"  # {file: {"size", "sha256"}} of the bundle's *.safetensors (merged/ has its own)
BASE_DIR = "base"  # where bundles written before the base moved into the bundle itself kept it
PROBE_PAIRS = 4  # pairs of the probe batch: 8 sequences of different lengths, so padding is exercised

class ExportMismatch(StorageError):
    """The saved bundle does not give back what the in-memory model gave (exit 5: it is not the trained model)."""


@torch.no_grad()
def probe_rewards(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, autocast: Callable = nullcontext) -> torch.Tensor:
    """Rewards of a probe batch in eval mode (no dropout), as float32 on the CPU.

    Under ZeRO-3 every process must call this: the forward gathers the parameters collectively.
    """
    was_training = model.training
    model.eval()
    try:
        with autocast():
            rewards = sequence_rewards(model, input_ids, attention_mask)
    finally:
        model.train(was_training)
    return rewards.float().cpu()


def reward_stats_from_eval(metrics: Mapping[str, float], step: int, max_length: Optional[int] = None) -> Optional[Dict[str, float]]:
    """``{"mean", "std", "pairs", "step", "max_length"}`` from the last eval metrics, or None (logged) without them.

    ``max_length`` is the per-sequence token limit the eval rewards were computed at (longer
    texts lost their start), so a consumer can tell whether its inputs are comparable.
    """
    if "eval_reward_mean" not in metrics or "eval_reward_std" not in metrics:
        log.warning("no eval_reward_mean/eval_reward_std in the last eval metrics (no eval set?): %s not written", STATS_FILE)
        return None
    pairs = metrics.get("eval_pairs")
    return {"mean": metrics["eval_reward_mean"], "std": metrics["eval_reward_std"],
            "pairs": int(pairs) if pairs is not None else None, "step": step, "max_length": max_length}


def read_reward_stats(directory: Path) -> Optional[Dict[str, float]]:
    """The bundle's ``reward_stats.json``, or None when it has none."""
    path = Path(directory) / STATS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    # Renamed into place: rm.export edits a finished bundle's adapter_config.json, which a stop must not cut short.
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_compat_fields(directory: Path, reward_stats: Optional[Mapping[str, float]] = None) -> None:
    """Make a saved model directory read the same under transformers 4 and 5, and carry its reward stats.

    transformers 5 keeps the rope base only in ``rope_parameters``, where transformers 4
    does not look (it then uses 10000: silently wrong for Llama 3's 5e5), so ``rope_theta`` is also
    written at the top level (transformers 5 reads it there too). ``mean``/``std`` and ``reward_max_length``
    go into ``config.json`` for OpenRLHF's ``--normalize_reward``. The tokenizer's fields are written by
    :func:`rm.data.tokenizer.write_tokenizer_compat_fields`.
    """
    directory = Path(directory)

    def model_fields(config: dict) -> None:
        rope = config.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            config["rope_theta"] = rope["rope_theta"]
        if reward_stats is not None:
            config.update(mean=reward_stats["mean"], std=reward_stats["std"],
                          reward_max_length=reward_stats.get("max_length"))

    if (directory / "config.json").is_file():
        _edit_json(directory / "config.json", model_fields)
    write_tokenizer_compat_fields(directory)


def _set_special_ids(config, tokenizer) -> None:
    """The tokenizer's pad/BOS/EOS ids into a model config (a config built from shape keeps the class defaults)."""
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id


def save_bundle(
    model,
    tokenizer,
    directory: Path,
    *,
    state_dict: Optional[Dict[str, torch.Tensor]] = None,
    reward_stats: Optional[Mapping[str, float]] = None,
    probe: Optional[Mapping[str, torch.Tensor]] = None,
    precision: str = "32-true",
    append_eos: bool = True,
    card: Optional[str] = None,
) -> Path:
    """Write a model directory (one process).

    Args:
        model: the unwrapped model: a transformers ``*ForSequenceClassification`` or a PEFT model,
            whose ``save_pretrained`` writes the adapter with the reward head.
        tokenizer: its tokenizer as training used it; it must have a pad token.
        directory: where to write.
        state_dict: the weights to write instead of ``model.state_dict()`` (ZeRO-3's gathered shards).
        reward_stats: written as ``reward_stats.json`` when given (see :func:`reward_stats_from_eval`).
        probe: ``input_ids``, ``attention_mask`` and ``rewards`` (the in-memory model's), written as
            ``reward_probe.json`` for :func:`verify_bundle`.
        precision: ``train.precision`` the rewards were computed in; picks the tolerance.
        append_eos: ``data.append_eos`` of the run: plain-text sides trained with the EOS appended.
        card: the ``README.md`` (:func:`model_card`); None leaves none (PEFT's empty template is removed).

    Returns:
        ``directory``.

    Raises:
        ValueError: the tokenizer has no pad token.
        ExportMismatch: a tokenizer does not reload with the same pad token, chat template and vocabulary.
    """
    directory = Path(directory)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token: set one before saving (rm.data.tokenizer.build_tokenizer does)")
    _set_special_ids(model.config, tokenizer)  # for PEFT this is the base config, which is not written
    model.save_pretrained(directory, safe_serialization=True, **({"state_dict": state_dict} if state_dict is not None else {}))
    if card is not None:
        (directory / CARD_FILE).write_text(card)  # over PEFT's template, whose every field says "More Information Needed"
    else:
        (directory / CARD_FILE).unlink(missing_ok=True)
    for where, form in ((directory, consumer_tokenizer(tokenizer, append_eos)), (directory / TRAINED_TOKENIZER, tokenizer)):
        form.save_pretrained(where)
        write_tokenizer_compat_fields(where)
        _check_reloads(where, form)
    (directory / TOKENS_FILE).write_text(json.dumps({"append_eos": append_eos, "trained_tokenizer": TRAINED_TOKENIZER},
                                                    indent=2) + "\n")
    write_compat_fields(directory, reward_stats)
    if reward_stats is not None:
        (directory / STATS_FILE).write_text(json.dumps(dict(reward_stats), indent=2) + "\n")
    if probe is not None:
        record = {k: probe[k].tolist() for k in ("input_ids", "attention_mask", "rewards")}
        record["compute_dtype"] = Precision.of(precision).dtype_name
        (directory / PROBE_FILE).write_text(json.dumps(record) + "\n")
    return directory


CARD_FILE = "README.md"


def model_card(*, name: str, base: str, profile: str, data: str, steps: int, pairs: Optional[int],
               eval_accuracy: Optional[float], eval_pairs: Optional[int], precision: str, adapter: bool,
               merged: bool) -> str:
    """The bundle's ``README.md``: what trained, on what, how well, and how to load it. It replaces the empty
    template PEFT's ``save_pretrained`` writes beside an adapter.

    Args:
        name: the model group's name; base: the pretrained id or directory, or what a random init was built from.
        profile: ``memory_profile``; data: the data group and its files; steps, pairs: the run's length.
        eval_accuracy, eval_pairs: the last evaluation (None: the run had no eval set).
        adapter: ``final/`` holds a LoRA adapter; merged: ``final/merged/`` holds it folded into the base.
    """
    accuracy = (f"{eval_accuracy:.4f} pairwise accuracy on {eval_pairs} held-out pairs (chosen scored above rejected)"
                if eval_accuracy is not None else "no evaluation (the run had no eval set)")
    load = ("from transformers import AutoModelForSequenceClassification, AutoTokenizer\n\n"
            'model = AutoModelForSequenceClassification.from_pretrained("<this directory>").eval()\n'
            'tokenizer = AutoTokenizer.from_pretrained("<this directory>")')
    adapter_note = ""
    if adapter:
        adapter_note = ("\nThis directory is a LoRA adapter with its reward head; `adapter_config.json` names its base. "
                        "transformers (>= 5.4) and `python -m rm.score` load it as it is; PEFT's "
                        "`AutoPeftModelForSequenceClassification` follows the base path as written (after moving the "
                        "directory, run `python -m rm.export <new place>`)."
                        + (" `merged/` holds the adapter folded into the base: a plain model." if merged else "") + "\n")
    return (f"---\nlibrary_name: transformers\ntags:\n- reward-model\n- rm\n---\n\n"
            f"# Reward model: {name}\n\n"
            f"A pairwise (Bradley-Terry) reward model trained with `rm`: one scalar reward per text, read at its last "
            f"token; a higher reward means preferred.\n\n"
            f"| | |\n| --- | --- |\n| base model | {base} |\n| memory profile | {profile} |\n"
            f"| precision | {precision} |\n| data | {data} |\n"
            f"| training | {steps} optimizer steps" + (f", {pairs:,} training pairs" if pairs else "") + " |\n"
            f"| evaluation | {accuracy} |\n{adapter_note}\n"
            f"## Load\n\n```python\n{load}\n```\n\n"
            "Score as training tokenised (the tokenizer's special tokens and the EOS appended to a plain text; "
            "`trained_tokenizer/` and `reward_tokens.json` say how): `python -m rm.score --model <this directory> "
            "--input texts.jsonl`. `reward_stats.json` holds the evaluation rewards' mean and std.\n")


def _check_reloads(directory: Path, tokenizer) -> None:
    """The tokenizer saved in ``directory`` reloads with the same pad token, chat template and vocabulary."""
    reloaded = AutoTokenizer.from_pretrained(directory)
    if (reloaded.pad_token_id, reloaded.chat_template) != (tokenizer.pad_token_id, tokenizer.chat_template):
        raise ExportMismatch(
            f"{directory}: the tokenizer reloads with pad id {reloaded.pad_token_id} and "
            f"{'a' if reloaded.chat_template else 'no'} chat template; saved: pad id {tokenizer.pad_token_id} and "
            f"{'a' if tokenizer.chat_template else 'no'} chat template"
        )
    if reloaded.get_vocab() != tokenizer.get_vocab():  # e.g. a tokenizer trained for the run, saved incompletely
        raise ExportMismatch(f"{directory}: the tokenizer reloads with another vocabulary ({len(reloaded)} tokens; "
                             f"saved: {len(tokenizer)})")


def bundle_tokenizer(directory: Path) -> Tuple["PreTrainedTokenizerBase", bool]:
    """The tokenizer a bundle was trained with and whether its plain-text sides had the EOS appended: what
    ``rm.score`` tokenises with (:func:`rm.data.tokenizer.encode_sides`), so it gives the ids training gave.

    A bundle written before ``reward_tokens.json`` existed trained on text alone, with a tokenizer that adds
    nothing: its top-level tokenizer, no EOS.
    """
    directory = Path(directory)
    record = json.loads((directory / TOKENS_FILE).read_text()) if (directory / TOKENS_FILE).is_file() else None
    if record is None:
        return AutoTokenizer.from_pretrained(directory), False
    return AutoTokenizer.from_pretrained(directory / record["trained_tokenizer"]), bool(record["append_eos"])


def load_bundle(directory: Path, base_model: Union[torch.nn.Module, str, None] = None, device="cpu"):
    """Load a bundle into a fresh model, in eval mode.

    Args:
        directory: a bundle written by :func:`save_bundle`.
        base_model: for an adapter, the base to load it onto: a freshly built model, or a hub id /
            directory; default: ``base_model_name_or_path`` of ``adapter_config.json``. Ignored
            for a full model.
        device: where to put the model.

    Raises:
        ConfigError: an adapter whose base is not on disk (a random init, or a directory that was moved)
            and no ``base_model``, or a ``base_model`` path that does not exist.
    """
    directory = Path(directory)
    with named_damage(directory):
        return _load_bundle(directory, base_model, device)


def write_weight_sums(directory: Path) -> None:
    """Record the size and sha256 of each weights file at the top of ``directory`` (:data:`WEIGHT_SUMS`), once it
    is verified: what :func:`load_checked_bundle` compares before it loads."""
    directory = Path(directory)
    sums = {p.name: {"size": p.stat().st_size, "sha256": file_digest(p)} for p in sorted(directory.glob("*.safetensors"))}
    (directory / WEIGHT_SUMS).write_text(json.dumps(sums, indent=2, sort_keys=True) + "\n")


def load_checked_bundle(directory: Path, device="cpu"):
    """:func:`load_bundle`, after each weights file matched its recorded sha256 (:data:`WEIGHT_SUMS`; a bundle written
    before it was recorded is read as it is), and with every loaded weight finite. A model that does not hold the
    weights that were verified, or holds NaN, would score without a word of warning.

    Raises:
        StorageError: a weights file is missing, or its size or sha256 differs from the recorded one (exit 5).
        NonFiniteError: a loaded weight is NaN or infinite (exit 4), naming the first tensors.
    """
    directory = Path(directory)
    record = directory / WEIGHT_SUMS
    for name, entry in (json.loads(record.read_text()) if record.is_file() else {}).items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry["size"] or file_digest(path) != entry["sha256"]:
            raise StorageError(f"{path} does not match the sha256 in {record} (missing, cut short or changed since "
                               "the model was written and verified): copy the model again, or export it again")
    model = load_bundle(directory, device=device)
    bad = [name for name, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        raise NonFiniteError(f"{directory}: {len(bad)} weight tensor(s) hold NaN or inf ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}): this model cannot score; export an earlier checkpoint")
    return model


def _load_bundle(directory: Path, base_model, device):
    if not (directory / ADAPTER_CONFIG).is_file():
        return AutoModelForSequenceClassification.from_pretrained(directory).to(device).eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(adapter_base_model(directory, base_model), directory).to(device).eval()


def adapter_base_model(directory: Path, base_model: Union[torch.nn.Module, str, None] = None) -> torch.nn.Module:
    """The base an adapter bundle loads onto, without the adapter: ``base_model`` (a module is returned as it
    is), the base saved in the bundle, or the one ``adapter_config.json`` names (see :func:`load_bundle`)."""
    directory = Path(directory)
    if isinstance(base_model, torch.nn.Module):
        return base_model
    name = base_model or adapter_base(directory)
    if not name:
        raise ConfigError(
            f"{directory} is an adapter whose base model is not on disk (adapter_config.json names none "
            "and the bundle holds none): pass the base, or train with lora.merge_on_save=true"
        )
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        # transformers would try the path as a Hub id: "Repo id must be in the form ...".
        named = "given as the base" if base_model else f"named by {directory / ADAPTER_CONFIG}"
        raise ConfigError(
            f"{directory} is an adapter whose base model {name} ({named}) does not exist: put the base "
            "back there, or give where it is now (python -m rm.export <final/> --merge --base <base directory> "
            "folds the adapter into a plain model that loads on its own)"
        )
    pad_token_id = AutoTokenizer.from_pretrained(directory).pad_token_id
    with _without_adapter(Path(name)) as path:
        # Hub checkpoints default to two labels and, for Mistral/Llama, no pad id.
        # A 4-bit base (QLoRA) evaluates as it trained (rm.modelling.model.evaluate_4bit_as_trained)
        return evaluate_4bit_as_trained(
            AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=pad_token_id))


@contextmanager
def _without_adapter(path: Path):
    """``path``, or for a bundle that holds its base beside the adapter a temporary view of the base's own files:
    transformers (>= 5.4) loading such a directory applies the adapter itself, and PEFT would then add it again."""
    if not (path / ADAPTER_CONFIG).is_file():
        yield str(path)
        return
    with tempfile.TemporaryDirectory(prefix="rm-base-") as view:
        for file in path.iterdir():
            if file.name == "config.json" or (file.name.startswith("model") and ".safetensors" in file.name):
                os.symlink(file.resolve(), Path(view) / file.name)
        yield view


def bundle_holds_base(directory: Path) -> bool:
    """An adapter bundle with its base model saved beside the adapter (a random-init base)."""
    directory = Path(directory)
    return (directory / ADAPTER_CONFIG).is_file() and (directory / "config.json").is_file()


def adapter_base(directory: Path) -> Optional[str]:
    """The base an adapter bundle loads onto: the bundle itself when it holds its base, else
    ``base_model_name_or_path`` (or the ``base/`` of a bundle written before the base moved into it,
    when that path is gone)."""
    directory = Path(directory)
    if bundle_holds_base(directory):
        return str(directory.resolve())
    name = json.loads((directory / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    saved = directory / BASE_DIR
    if (not name or (Path(name).is_absolute() and not Path(name).exists())) and (saved / "config.json").is_file():
        return str(saved.resolve())
    return name


def save_base(base_model: torch.nn.Module, tokenizer, directory: Path, final_dir: Optional[Path] = None) -> Path:
    """Save an adapter's random-init base in the bundle ``directory`` itself, beside the adapter.

    Why there: PEFT and transformers read ``base_model_name_or_path`` as written, a relative path
    against the working directory (not the adapter's), so no path in ``adapter_config.json`` survives
    a move. transformers >= 5.4 (``AutoModel*`` and ``pipeline``) loads a directory that holds both
    ``config.json`` and ``adapter_config.json`` as a base with its adapter, wherever it is. The path
    is still written (absolute) for PEFT's ``AutoPeftModel*`` and older transformers, which follow it;
    ``python -m rm.export`` rewrites it after a move (:func:`rehome`). ``final_dir``: where
    ``directory`` will be renamed to (rm.train writes ``final/`` in a temporary directory first).

    transformers 4 without PEFT (RewardBench's environment) ignores ``adapter_config.json`` and would load this
    base alone, an untrained model, without a word: the base's weight files are marked (:func:`mark_adapter_base`)
    so that it refuses them instead.

    Returns:
        ``directory``.
    """
    directory = Path(directory)
    _set_special_ids(base_model.config, tokenizer)
    base_model.save_pretrained(directory, safe_serialization=True)
    mark_adapter_base(directory)
    write_compat_fields(directory, read_reward_stats(directory))
    named = Path(final_dir if final_dir is not None else directory).resolve()
    _edit_json(directory / ADAPTER_CONFIG, lambda c: c.update(base_model_name_or_path=str(named)))
    return directory


# The safetensors "format" of an adapter bundle's base: transformers 4 loads only files whose format is pt, tf, flax or
# mlx ("does not contain the valid metadata"); transformers 5, PEFT and safetensors itself do not look at it.
ADAPTER_BASE_FORMAT = "pt-base-of-a-lora-adapter-load-with-peft-or-use-final-merged"


def mark_adapter_base(directory: Path) -> None:
    """Rewrite the base weight files in ``directory`` with :data:`ADAPTER_BASE_FORMAT` as their format, so that a
    reader that would skip the adapter (transformers 4 without PEFT) fails on them rather than scoring the base."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(Path(directory).glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        save_file(tensors, str(path), metadata={**metadata, "format": ADAPTER_BASE_FORMAT})


def rehome(directory: Path) -> Optional[str]:
    """Point a moved bundle's ``adapter_config.json`` at the base it holds; returns the old path if it was stale."""
    directory = Path(directory)
    if not bundle_holds_base(directory):
        return None
    old = json.loads((directory / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    here = str(directory.resolve())
    if old == here:
        return None
    _edit_json(directory / ADAPTER_CONFIG, lambda c: c.update(base_model_name_or_path=here))
    return old


def verify_bundle(directory: Path, *, base_model: Union[torch.nn.Module, str, None] = None, device="cpu") -> float:
    """Reload ``directory`` in a fresh model and compare its rewards on the probe with the recorded ones.

    Args:
        directory: a bundle with ``reward_probe.json``.
        base_model: for an adapter, see :func:`load_bundle`.
        device: where to run the reloaded model.

    Returns:
        The largest absolute reward difference.

    Raises:
        ExportMismatch: a reward differs by more than ``export_tolerance * (1 + |reward|)`` of the recorded precision, or the
            saved config's pad id is not the tokenizer's.
    """
    directory = Path(directory)
    probe = json.loads((directory / PROBE_FILE).read_text())
    precision = Precision.of_dtype_name(probe["compute_dtype"])
    dtype = precision.dtype
    input_ids, attention_mask = torch.tensor(probe["input_ids"]), torch.tensor(probe["attention_mask"])
    expected = torch.tensor(probe["rewards"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = load_bundle(directory, base_model, device)
    if model.config.pad_token_id != tokenizer.pad_token_id:
        raise ExportMismatch(f"{directory}: config pad_token_id {model.config.pad_token_id} != tokenizer's {tokenizer.pad_token_id}")
    device = torch.device(device)
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731
    got = probe_rewards(model, input_ids.to(device), attention_mask.to(device), autocast)
    diff = (got - expected).abs()
    tol = precision.export_tolerance
    worst = float(diff.max())
    if not torch.isfinite(got).all() or (diff > tol * (1 + expected.abs())).any():
        raise ExportMismatch(
            f"{directory} does not reproduce the in-memory rewards: max abs difference {worst:.6g} on "
            f"{len(expected)} probe sequences (tolerance {tol:g} x (1 + |reward|) in {probe['compute_dtype']});\n"
            f"  in memory: {[round(x, 5) for x in expected.tolist()]}\n  reloaded:  {[round(x, 5) for x in got.tolist()]}"
        )
    ends_in_pad = int((input_ids.gather(1, last_token_index(attention_mask)[:, None]) == tokenizer.pad_token_id).sum())
    if ends_in_pad:
        log.warning("%d probe sequences end in the pad id (pad == eos?): plain transformers' `.logits` reads their reward "
                    "at another token; read rewards with rm.modelling.model.sequence_rewards", ends_in_pad)
    log.info("export verified: %s reloads with rewards within %.3g of the in-memory model (%d probe sequences, %s)",
             directory, worst, len(expected), probe["compute_dtype"])
    return worst


def merge_adapter(adapter_dir: Path, out_dir: Path, *, base_model: Union[torch.nn.Module, str, None] = None,
                  device="cpu") -> Path:
    """Fold a LoRA adapter into its base: a plain ``AutoModelForSequenceClassification`` directory, verified.

    The merged bundle keeps the adapter's probe and reward statistics, so it is checked against the
    rewards of the in-memory model that trained the adapter. A quantised base (QLoRA) is dequantised
    first and the adapter folded into those weights, in the compute dtype: PEFT's own merge into a 4-bit
    layer quantises the sum again. Its probe is then scored afresh by the unmerged adapter on the
    dequantised base, the model the merge must reproduce; how far that is from the 4-bit model's recorded
    rewards is logged as the merge error (on a CPU with AVX512-BF16, bitsandbytes' inference kernel computes
    the 4-bit matmul in bf16: docs/export.md, "Use your reward model").

    Returns:
        ``out_dir``.

    Raises:
        ConfigError: the base is quantised in a way that cannot be dequantised.
    """
    from peft import PeftModel

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    with named_damage(adapter_dir):
        base = adapter_base_model(adapter_dir, base_model)
        quantised = bool(getattr(base, "is_quantized", False))
        if quantised:
            base = dequantised(base, adapter_dir)
        model = PeftModel.from_pretrained(base, adapter_dir).to(device).eval()
    probe = json.loads((adapter_dir / PROBE_FILE).read_text()) if (adapter_dir / PROBE_FILE).is_file() else None
    if quantised and probe is not None:
        recorded = torch.tensor(probe["rewards"])
        unmerged = probe_rewards(model, torch.tensor(probe["input_ids"]).to(device), torch.tensor(probe["attention_mask"]).to(device))
        log.info("merge of a quantised base: the adapter on the dequantised base scores the probe within %.3g of the "
                 "4-bit model's recorded rewards", float((unmerged - recorded).abs().max()))
        probe["rewards"] = unmerged.tolist()
    merged = model.merge_and_unload()
    tokenizer, append_eos = bundle_tokenizer(adapter_dir)
    save_bundle(merged, tokenizer, out_dir, reward_stats=read_reward_stats(adapter_dir), append_eos=append_eos)
    if probe is not None:
        (out_dir / PROBE_FILE).write_text(json.dumps(probe) + "\n")
    verify_bundle(out_dir, device=device)
    write_weight_sums(out_dir)
    return out_dir


def dequantised(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """A quantised base with plain linear layers holding its dequantised weights (transformers' ``dequantize``).

    Raises:
        ConfigError: the quantisation method has no dequantisation (the message names the method and the error).
    """
    method = getattr(getattr(base.config, "quantization_config", None), "quant_method", None) or "unknown"
    method = getattr(method, "value", method)  # an enum in transformers 5
    try:
        base = base.dequantize()
    except Exception as err:  # noqa: BLE001  (whatever the quantiser raises is the reason the merge cannot be done)
        raise ConfigError(
            f"cannot merge {adapter_dir}: its base is quantised ({method}) and transformers cannot dequantise it "
            f"({type(err).__name__}: {err}); load the adapter on its base instead (transformers or PEFT), or merge "
            "onto the unquantised base with python -m rm.export <final/> --merge --base <base>"
        ) from err
    return base


def export_final(
    engine,
    model,
    tokenizer,
    directory: Path,
    *,
    probe: Mapping[str, torch.Tensor],
    reward_stats: Optional[Mapping[str, float]],
    precision: str,
    merge: bool = False,
    base_factory: Optional[Callable[[], torch.nn.Module]] = None,
    base_is_random: bool = False,
    final_dir: Optional[Path] = None,
    append_eos: bool = True,
    card: Optional[str] = None,
) -> Path:
    """Save the trained model as a bundle and verify it; every process calls this.

    ``final_dir``: where the caller will rename ``directory`` once it is verified (an adapter names
    its saved base there).

    Every process gathers the weights (ZeRO-3) and scores the probe in memory; the main process
    writes, reloads and compares (and with ``merge`` writes and verifies ``merged/``); the verdict
    is shared, so every process fails on a mismatch or a failed write rather than waiting for rank 0.

    Args:
        engine: an ``rm.distributed.engine`` engine.
        model: the prepared model the training loop calls.
        tokenizer: its tokenizer.
        directory: the bundle's directory (the run's ``final/``).
        probe: a collated batch (``input_ids``, ``attention_mask``), the same on every process.
        reward_stats: for ``reward_stats.json``; None writes none.
        precision: ``train.precision`` (resolved): the dtype the run computes in.
        merge: also write ``directory/merged``, the adapter folded into the base.
        base_factory: builds a fresh base for an adapter (needed when the base was a random init
            or is quantised); None loads the one named in ``adapter_config.json``.
        base_is_random: the adapter's base was a random init: it is saved as ``base/`` and the
            adapter is verified by loading it from there, as a consumer would.
        append_eos: ``data.append_eos`` (:func:`save_bundle`).
        card: the bundle's ``README.md`` (:func:`model_card`).

    Raises:
        ExportMismatch: on the main process, when a reload does not give the in-memory rewards.
        StorageError: on the other processes when the main one failed (a mismatch, a failed write);
            the main process raises its own error (``OSError``, a safetensors error, ...).
    """
    directory = Path(directory)
    state_dict = engine.model_state_dict()
    input_ids, attention_mask = probe["input_ids"].to(engine.device), probe["attention_mask"].to(engine.device)
    expected = probe_rewards(model, input_ids, attention_mask, engine.autocast)
    error: Optional[BaseException] = None
    if engine.is_main_process:
        try:
            save_bundle(
                engine.unwrapped_model(), tokenizer, directory, state_dict=state_dict, reward_stats=reward_stats,
                probe={"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"], "rewards": expected},
                precision=precision, append_eos=append_eos, card=card,
            )
            del state_dict
            adapter = (directory / ADAPTER_CONFIG).is_file()
            if adapter and base_is_random and base_factory is not None:
                save_base(base_factory(), tokenizer, directory, final_dir)
            # The reload runs on the CPU: on the training device it would sit beside the trained model and its
            # optimizer states (a second copy of the weights, 14 GB at 7B), a peak the run never needed.
            # rm.estimate counts it in host RAM instead.
            from_factory = adapter and base_factory is not None and not base_is_random
            verify_bundle(directory, base_model=base_factory() if from_factory else None, device="cpu")
            write_weight_sums(directory)
            if merge:
                merge_adapter(directory, directory / "merged", device="cpu",
                              base_model=base_factory() if base_factory else None)
        except Exception as err:  # noqa: BLE001  (kept until every process has heard of it, then raised)
            error = err
    # The main process's verdict is shared: a mismatch or a failed write (a full disk) fails the export on
    # every process, rather than leaving the others at the next barrier.
    failed = engine.reduce(torch.tensor(float(error is not None), device=engine.device)).item()
    if error is not None:
        raise error
    if failed:
        raise StorageError(f"the main process could not write or verify {directory} (its message says why)")
    return directory
