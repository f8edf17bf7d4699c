"""The data's token lengths, and the micro-batches each layout cuts them into, step by step, as the run does.

The lengths are the run's own where they can be read here: the configured data, tokenised by the run's
tokenizer (what ``rm.train`` audits). Data on the Hub or a pretrained tokenizer that is not on this machine
cannot be read without a download, so a synthetic stand-in takes their place (``plan.stand_in_pairs`` of rm's
synthetic HH-style pairs, multi-turn as HH-RLHF is, counted in the synthetic data's word-level
tokenizer's pieces, cut to ``data.max_length``), and the plan says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

from rm.foundations.config import DataConfig, ModelConfig, TrainConfig
from rm.plan.steptime import MicroBatch, micro_batch

# The word-level tokenizer's pieces (tokenizers' Whitespace pre-tokenizer, each piece one id): counting them
# needs neither transformers nor a tokenizer object.
WORDS = re.compile(r"\w+|[^\w\s]+")


@dataclass(frozen=True)
class PairLengths:
    """Per training pair: its chosen and rejected token lengths and the tokens they share at their start.

    Attributes:
        eval: per evaluation set, ``(chosen, rejected)`` lengths (what the evaluation forward is sized by).
        source: where the lengths come from, in words.
        stand_in: the configured data could not be read here; synthetic pairs stand in.
    """

    chosen: np.ndarray
    rejected: np.ndarray
    prefix: np.ndarray
    eval: Tuple[Tuple[List[int], List[int]], ...] = ()
    source: str = ""
    stand_in: bool = False

    @property
    def shared(self) -> np.ndarray:
        """Per pair, its prefix-shared row: prompt + chosen answer + rejected answer."""
        return self.chosen + self.rejected - self.prefix

    @classmethod
    def of(cls, chosen: Sequence[int], rejected: Sequence[int], prefix: Sequence[int], **kw) -> "PairLengths":
        return cls(np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64),
                   np.asarray(prefix, dtype=np.int64), **kw)


def readable_here(data_cfg: DataConfig, model_cfg: ModelConfig) -> Optional[str]:
    """``None`` where the configured data and tokenizer can be read without a download, else why not."""
    from rm.data.tokenizer import tokenizer_kind

    from pathlib import Path

    if data_cfg.source == "hub":
        return f"data={data_cfg.name} is on the Hub ({data_cfg.path})"
    if tokenizer_kind(model_cfg) == "pretrained":
        name = model_cfg.tokenizer or model_cfg.pretrained
        if not Path(str(name)).expanduser().is_dir():
            return f"the tokenizer of model={model_cfg.name} ({name}) is on the Hub"
    return None


def data_lengths(data_cfg: DataConfig, model_cfg: ModelConfig, stand_in_pairs: int) -> PairLengths:
    """The training pairs' lengths of ``data_cfg``'s data as ``model_cfg``'s tokenizer tokenises it, or where it
    cannot be read here those of a synthetic stand-in of ``stand_in_pairs`` pairs (``plan.stand_in_pairs``)."""
    why = readable_here(data_cfg, model_cfg)
    if why is not None:
        return stand_in_lengths(data_cfg.max_length, stand_in_pairs, why)
    from rm.data.build import build_datasets, build_extra_eval_sets, train_pairs
    from rm.data.tokenizer import run_tokenizer

    tokenizer = run_tokenizer(model_cfg, train_pairs(data_cfg))
    train, evaluation, _ = build_datasets(data_cfg, tokenizer)
    extra = build_extra_eval_sets(data_cfg, tokenizer)
    return lengths_of(train, [evaluation, *extra.values()],
                      f"data={data_cfg.name}: {len(train):,} training pairs, tokenised as the run tokenises them")


def lengths_of(train, eval_sets: Sequence, source: str) -> PairLengths:
    """The lengths of tokenised pair sets (``chosen_input_ids``/``rejected_input_ids`` columns); ``None`` eval sets
    are passed over."""
    from rm.data.collator import common_prefix_length
    from rm.data.tokenise import pair_lengths

    chosen, rejected = pair_lengths(train)
    prefix = [common_prefix_length(c, r) for c, r in zip(train["chosen_input_ids"], train["rejected_input_ids"])]
    evals = tuple(pair_lengths(ds) for ds in eval_sets if ds is not None)
    return PairLengths.of(chosen, rejected, prefix, eval=evals, source=source)


def stand_in_lengths(max_length: int, pairs: int, why: str, seed: int = 0) -> PairLengths:
    """Lengths of ``pairs`` synthetic multi-turn pairs in words, each side cut to its last ``max_length`` tokens
    (``data.truncation=truncate``, which cuts the prompt's start: the shared prefix shrinks by what is cut)."""
    from rm.data.collator import common_prefix_length
    from rm.data.synthetic import generate_pairs

    def lengths(split: str, n: int):
        rows = generate_pairs(n, seed, split, multi_turn=True)
        c, r = ([WORDS.findall(row[side]) for row in rows] for side in ("chosen", "rejected"))
        cl, rl = np.array([len(x) for x in c]), np.array([len(x) for x in r])
        prefix = np.array([common_prefix_length(a, b) for a, b in zip(c, r)])
        cut = np.maximum(cl - max_length, rl - max_length).clip(min=0)
        return np.minimum(cl, max_length), np.minimum(rl, max_length), (prefix - cut).clip(min=0)

    chosen, rejected, prefix = lengths("train", pairs)
    eval_c, eval_r, _ = lengths("test", max(1, pairs // 8))
    return PairLengths(chosen, rejected, prefix, eval=((eval_c.tolist(), eval_r.tolist()),),
                       source=f"synthetic stand-in: {pairs:,} multi-turn pairs in words ({why}; not read here)",
                       stand_in=True)


def batching(lengths: PairLengths, layout: str, micro_batch_size: int, world_size: int, global_batch_size: int,
             seed: int, group_by_length: bool, max_tokens: int):
    """The run's :class:`rm.data.batching.StepBatches` (rank 0) for these lengths, as ``StepBatches.of`` builds it."""
    from rm.data.batching import StepBatches

    if layout in ("shared", "packed+shared"):
        sort, tokens = lengths.shared, lengths.shared
    else:
        sort, tokens = np.maximum(lengths.chosen, lengths.rejected), lengths.chosen + lengths.rejected
    return StepBatches(len(lengths.chosen), global_batch_size, micro_batch_size, world_size, 0, seed,
                       sort_lengths=sort.tolist() if group_by_length else None,
                       pair_tokens=tokens.tolist() if max_tokens else None, max_tokens=max_tokens or None)


def step_micro_batches(lengths: PairLengths, layout: str, micro_batch_size: int, world_size: int,
                       global_batch_size: int, seed: int, group_by_length: bool, max_tokens: int, steps: int,
                       kernel: str) -> List[List[List[MicroBatch]]]:
    """Per step (the run's first ``steps``), per rank, the micro-batches that rank runs (:func:`micro_batch`).

    Example: 4 pairs, one step of 4 on one process, micro-batches of 2 in the shuffled order (seed 0 takes pairs
    0, 1 | 3, 2), and packed into one row:
        >>> lengths = PairLengths.of([5, 4, 3, 8], [3, 4, 3, 2], [2, 3, 1, 1])
        >>> [(m.rows, m.length) for m in step_micro_batches(lengths, "padded", 2, 1, 4, 0, False, 0, 1, "square")[0][0]]
        [(4, 5), (4, 8)]
        >>> [(m.rows, m.length) for m in step_micro_batches(lengths, "packed", 4, 1, 4, 0, False, 0, 1, "square")[0][0]]
        [(1, 32)]
    """
    batches = batching(lengths, layout, micro_batch_size, world_size, global_batch_size, seed, group_by_length,
                       max_tokens)
    c, r, p = lengths.chosen.tolist(), lengths.rejected.tolist(), lengths.prefix.tolist()
    per_epoch = len(c) // global_batch_size
    out = []
    for step in range(min(steps, max(per_epoch, 1))):
        ranks = []
        for rank in range(world_size):
            cut = replace(batches, rank=rank).for_step(step)
            ranks.append([micro_batch(layout, [c[i] for i in ids], [r[i] for i in ids], [p[i] for i in ids],
                                      kernel) for ids in cut])
        out.append(ranks)
    return out


def memory_shapes(train_cfg: TrainConfig, plan, lengths: PairLengths):
    """Per rank, the largest micro-batches the run would form over all its steps: what ``rm.train``'s memory
    verdict is sized by (:func:`rm.data.shapes.data_shapes`, :func:`rm.memory.preflight.data_preflight`)."""
    from rm.data.batching import total_training_steps
    from rm.data.shapes import data_shapes, layout_of

    t = train_cfg
    layout = layout_of(t.packing, t.share_prefix)
    batches = batching(lengths, layout, plan.micro_batch_size, plan.world_size, t.global_batch_size, t.seed,
                       t.group_by_length, t.max_tokens_per_micro_batch)
    steps = total_training_steps(t, len(lengths.chosen))
    return data_shapes(batches, steps, layout, lengths.chosen.tolist(), lengths.rejected.tolist(),
                       lengths.shared.tolist() if t.share_prefix else None, list(lengths.eval), t.eval_batch_size)
