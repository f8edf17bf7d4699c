"""Batches of pairs for one forward pass."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch


class PairCollator:
    """Stacks B pairs into one batch of 2B sequences: the B chosen rows, then the B rejected rows.

    Scoring both sides in one forward pass halves the number of kernel launches
    and lets the loss pair row ``i`` with row ``i + B``. Rows are right-padded
    with ``pad_token_id`` to the longest sequence of the batch (rounded up to
    ``pad_to_multiple_of``); the attention mask marks real tokens.

    Args:
        pad_token_id: id written into padding positions. rm reads the reward at
            the last 1 of the attention mask (``rm.model.sequence_rewards``); plain
            transformers reads it at the last token that is not the pad id, which
            agrees only while the pad id does not end a sequence.
        pad_to_multiple_of: round the padded length up to a multiple of this
            (8 suits tensor cores); ``None`` pads to the longest row only.

    Example:
        >>> collate = PairCollator(pad_token_id=0)
        >>> batch = collate([
        ...     {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [5, 8], "margin": 0.0},
        ...     {"chosen_input_ids": [5], "rejected_input_ids": [5, 9, 9, 9], "margin": 1.5},
        ... ])
        >>> batch["input_ids"]
        tensor([[5, 6, 7, 0],
                [5, 0, 0, 0],
                [5, 8, 0, 0],
                [5, 9, 9, 9]])
        >>> batch["attention_mask"]
        tensor([[1, 1, 1, 0],
                [1, 0, 0, 0],
                [1, 1, 0, 0],
                [1, 1, 1, 1]])
        >>> batch["margin"]
        tensor([0.0000, 1.5000])
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None):
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        rows: List[List[int]] = [f["chosen_input_ids"] for f in features]
        rows += [f["rejected_input_ids"] for f in features]
        length = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "margin": margin}


class PackedPairCollator:
    """Concatenates B pairs into one row of real tokens: the B chosen sequences, then the B rejected ones.

    No pad token is computed. Position ids restart at 0 for each sequence, which is how
    transformers recognises packed sequences when no attention mask is given: SDPA and
    eager get a block-diagonal causal mask, flash-attention 2 its varlen kernel
    (cumulative sequence lengths), so no token attends across a boundary and every
    sequence sees exactly what it would see alone in a padded batch. ``ends`` holds the
    position of each sequence's last token, where its reward is read
    (``rm.model.sequence_rewards``).

    Example:
        >>> collate = PackedPairCollator()
        >>> batch = collate([
        ...     {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [5, 8], "margin": 0.0},
        ...     {"chosen_input_ids": [5], "rejected_input_ids": [5, 9, 9, 9], "margin": 1.5},
        ... ])
        >>> batch["input_ids"]
        tensor([[5, 6, 7, 5, 5, 8, 5, 9, 9, 9]])
        >>> batch["position_ids"]
        tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
        >>> batch["ends"]
        tensor([2, 3, 5, 9])
        >>> batch["margin"]
        tensor([0.0000, 1.5000])
    """

    def __call__(self, features: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        rows: List[List[int]] = [f["chosen_input_ids"] for f in features]
        rows += [f["rejected_input_ids"] for f in features]
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        input_ids = torch.tensor([token for row in rows for token in row], dtype=torch.long).unsqueeze(0)
        position_ids = torch.cat([torch.arange(n) for n in lengths.tolist()]).unsqueeze(0)
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        return {"input_ids": input_ids, "position_ids": position_ids, "ends": lengths.cumsum(0) - 1, "margin": margin}
