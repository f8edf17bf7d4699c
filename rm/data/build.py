"""Turn the ``data`` group into tokenised train and eval sets."""

from __future__ import annotations

import logging
from typing import Dict, Tuple

import datasets

from rm.config import DataConfig
from rm.data.preference import format_counts, load_preference_split, normalise_pairs, tokenize_pairs
from rm.data.synthetic import generate_pairs

log = logging.getLogger(__name__)


def _raw_split(data_cfg: DataConfig, split: str) -> datasets.Dataset:
    train = split == "train"
    limit = data_cfg.max_train_samples if train else data_cfg.max_eval_samples
    if data_cfg.source == "synthetic":
        size = data_cfg.synthetic_train_size if train else data_cfg.synthetic_test_size
        ds = datasets.Dataset.from_list(generate_pairs(size, seed=data_cfg.synthetic_seed, split="train" if train else "test"))
        return ds.select(range(min(limit, len(ds)))) if limit is not None else ds
    files = data_cfg.train_files if train else data_cfg.eval_files
    return load_preference_split(
        data_cfg.source,
        path=data_cfg.path,
        subsets=tuple(data_cfg.subsets),
        split=data_cfg.train_split if train else data_cfg.eval_split,
        files=tuple(files),
        max_samples=limit,
        files_key="data.train_files" if train else "data.eval_files",
    )


def build_split(data_cfg: DataConfig, tokenizer, split: str) -> Tuple[datasets.Dataset, Dict]:
    """Load, normalise and tokenise one split; log what was dropped and why.

    Returns:
        The tokenised dataset (``chosen_input_ids``, ``rejected_input_ids``,
        ``margin``) and the merged counts of normalisation and tokenisation.
    """
    raw = _raw_split(data_cfg, split)
    pairs, norm_counts = normalise_pairs(
        raw, data_cfg.format, tokenizer, margin_column=data_cfg.margin_column, on_malformed=data_cfg.on_malformed
    )
    tokenised, tok_counts = tokenize_pairs(
        pairs, tokenizer, data_cfg.max_length, truncation=data_cfg.truncation, on_malformed=data_cfg.on_malformed
    )
    counts = {**norm_counts, **tok_counts}
    log.info("data %s [%s]: %s", data_cfg.name, split, format_counts(counts))
    if len(tokenised) == 0:
        raise ValueError(f"data {data_cfg.name} [{split}]: no usable pairs left ({format_counts(counts)})")
    return tokenised, counts


def build_datasets(data_cfg: DataConfig, tokenizer):
    """The train set and, when one is configured, the eval set (else ``None``)."""
    train, train_counts = build_split(data_cfg, tokenizer, "train")
    has_eval = data_cfg.source in ("hub", "synthetic") or bool(data_cfg.eval_files)
    if not has_eval:
        return train, None, {"train": train_counts}
    evaluation, eval_counts = build_split(data_cfg, tokenizer, "eval")
    return train, evaluation, {"train": train_counts, "eval": eval_counts}
