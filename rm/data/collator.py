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
            the last 1 of the attention mask (``rm.modelling.model.sequence_rewards``); plain
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
    (``rm.modelling.model.sequence_rewards``).

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


# Roles of the tokens of a prefix-shared row (``PrefixSharedCollator``), read by ``rm.modelling.prefix_sharing``.
PAD, PREFIX, CHOSEN, REJECTED = -1, 0, 1, 2


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Example:
        >>> common_prefix_length([2, 5, 6, 7], [2, 5, 8])
        2
        >>> common_prefix_length([1], [2])
        0
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def shared_pair_length(chosen: Sequence[int], rejected: Sequence[int]) -> int:
    """Tokens one pair takes in a prefix-shared row: prefix + chosen suffix + rejected suffix.

    Example:
        >>> shared_pair_length([2, 5, 6, 7], [2, 5, 8])
        5
    """
    return len(chosen) + len(rejected) - common_prefix_length(chosen, rejected)


class PrefixSharedCollator:
    """Scores each pair's shared prompt once (``train.share_prefix``): one sequence per pair,
    ``prefix + chosen_suffix + rejected_suffix``.

    The prefix is the longest common prefix of the two tokenised sequences. Under causal attention a
    prefix token sees only earlier prefix tokens, so its hidden states are the same in both sequences
    and computing them once is exact by construction. The rejected suffix must see the prefix and
    itself but not the chosen suffix that sits between them, and its position ids continue from the
    prefix end, so that every rejected token sees exactly the keys and positions it would see alone.
    That attention pattern is not expressible with position ids alone: the batch carries, per token,
    the pair it belongs to (``pair_ids``, -1 on padding) and its role (``roles``: ``PREFIX``,
    ``CHOSEN``, ``REJECTED`` or ``PAD``), from which ``rm.modelling.prefix_sharing.shared_prefix_mask`` builds
    the 4D mask (or flex-attention BlockMask) on the model's device.

    Rewards are read at the last token of each side: the chosen suffix's last token, the rejected
    suffix's last token, or the prefix's last token for a side with an empty suffix (one sequence is
    a prefix of the other). ``ends`` holds them as flat indices into the ``(rows x length)`` batch,
    the B chosen ends then the B rejected ends, as ``rm.modelling.model.pair_rewards`` expects.

    Args:
        packed: True puts all pairs of the micro-batch into one row (with ``train.packing``);
            False gives one row per pair, right-padded with ``pad_token_id``.
        pad_token_id: id written into padding positions (``packed=False`` only).

    Example:
        >>> collate = PrefixSharedCollator()
        >>> batch = collate([
        ...     {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [5, 6, 8, 9], "margin": 0.0},
        ...     {"chosen_input_ids": [4], "rejected_input_ids": [3, 3], "margin": 1.5},
        ... ])
        >>> batch["input_ids"]
        tensor([[5, 6, 7, 8, 9, 4, 3, 3]])
        >>> batch["position_ids"]
        tensor([[0, 1, 2, 2, 3, 0, 0, 1]])
        >>> batch["roles"]
        tensor([[0, 0, 1, 2, 2, 1, 2, 2]])
        >>> batch["pair_ids"]
        tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
        >>> batch["ends"]
        tensor([2, 5, 4, 7])
        >>> int(batch["num_pair_tokens"])  # chosen + rejected tokens, what an unshared batch computes
        10
        >>> PrefixSharedCollator(packed=False, pad_token_id=0)([
        ...     {"chosen_input_ids": [5, 6, 7], "rejected_input_ids": [5, 6, 8, 9]},
        ...     {"chosen_input_ids": [4], "rejected_input_ids": [4]},
        ... ])["ends"]  # row 1 is identical: both rewards at its only token, flat index 1 * 5 + 0
        tensor([2, 5, 4, 5])
    """

    def __init__(self, packed: bool = True, pad_token_id: int = 0):
        self.packed = packed
        self.pad_token_id = pad_token_id

    def __call__(self, features: Sequence[Dict]) -> Dict[str, torch.Tensor]:
        rows: List[Dict[str, List[int]]] = []
        chosen_ends: List[int] = []
        rejected_ends: List[int] = []
        num_pair_tokens = 0
        for pair, f in enumerate(features):
            chosen, rejected = list(f["chosen_input_ids"]), list(f["rejected_input_ids"])
            num_pair_tokens += len(chosen) + len(rejected)
            n = common_prefix_length(chosen, rejected)
            if not self.packed or not rows:
                rows.append({"ids": [], "pos": [], "role": [], "pair": []})
            row, start = rows[-1], len(rows[-1]["ids"])
            suffix_c, suffix_r = chosen[n:], rejected[n:]
            row["ids"] += chosen[:n] + suffix_c + suffix_r
            row["pos"] += list(range(len(chosen))) + list(range(n, len(rejected)))
            row["role"] += [PREFIX] * n + [CHOSEN] * len(suffix_c) + [REJECTED] * len(suffix_r)
            row["pair"] += [pair] * (len(chosen) + len(suffix_r))
            # An empty suffix reads its reward at the prefix's last token (start + n - 1).
            chosen_ends.append(start + len(chosen) - 1)
            rejected_ends.append(start + (len(chosen) + len(suffix_r) if suffix_r else n) - 1)
        length = max(len(r["ids"]) for r in rows)
        shape = (len(rows), length)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        roles = torch.full(shape, PAD, dtype=torch.long)
        pair_ids = torch.full(shape, -1, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["ids"])
            input_ids[i, :n] = torch.tensor(r["ids"], dtype=torch.long)
            position_ids[i, :n] = torch.tensor(r["pos"], dtype=torch.long)
            roles[i, :n] = torch.tensor(r["role"], dtype=torch.long)
            pair_ids[i, :n] = torch.tensor(r["pair"], dtype=torch.long)
        ends = torch.tensor(chosen_ends + rejected_ends, dtype=torch.long)
        if not self.packed:  # one row per pair: pair b's ends lie b rows further into the flattened batch
            ends = ends + torch.arange(len(features)).repeat(2) * length
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        return {"input_ids": input_ids, "position_ids": position_ids, "pair_ids": pair_ids, "roles": roles,
                "ends": ends, "margin": margin, "num_pair_tokens": torch.tensor(num_pair_tokens)}
