"""Lost updates: optimizer updates that rounded to nothing in the weights' own dtype.

Pure-bf16 training (torch AdamW stepping bf16 weights, ``train.precision=bf16-true``) rounds every update smaller than half a unit in the last place of the weight to nothing:
bf16 keeps 8 significant bits, so a weight of 0.02 moves only by steps of about 1.2e-4. With AdamW at a
learning rate of 1e-5 most updates are below that and the weight never changes (on a 1024 x 1024 bf16
weight from N(0, 0.02), 10 steps at 1e-5 change 15% of the weights at all, at 1e-4 84%). fp32 master
weights (``bf16-mixed``) keep them.

:class:`LostUpdateProbe` measures it on a small fixed sample of the trainable elements, chosen once:
just before the optimizer step it copies the sampled values and whether their gradient is nonzero; just
after, it compares the values bit for bit. An element whose gradient was nonzero was meant to move (an
Adam update of a nonzero gradient is nonzero); if its bits are the same, the update was lost. The counts
stay on the device: nothing here waits for it.

The probe only makes sense where the tensors it watches are the ones the optimizer writes into (torch's
optimizer on the module's parameters: accelerate, one process or DDP). Under DeepSpeed ZeRO the
optimizer steps fp32 master partitions and the module holds copies (in bf16 under bf16), so an unchanged
copy is no lost update; ``rm.distributed.engine`` gives no parameters to watch there.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

SAMPLE_SIZE = 4096  # elements watched: a binomial fraction's standard error is at most 0.8% at this size

# A tensor's bits as integers of its width: equal bits mean the value did not change at all (this also
# tells -0.0 from 0.0 and sees a NaN equal to itself, which a float comparison would not).
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sample_positions(numels: Sequence[int], k: int, seed: int) -> List[Tuple[int, torch.Tensor]]:
    """A seeded choice of up to ``k`` distinct flat positions, uniform over all elements of the tensors.

    Args:
        numels: the element count of each tensor, in a fixed order.
        k: how many positions; all of them when the tensors hold fewer.
        seed: the same seed and sizes give the same positions (every DDP rank, a resumed run).

    Returns:
        ``(tensor index, sorted flat positions in it)`` for each tensor with at least one position.

    Example:
        >>> [(i, p.tolist()) for i, p in sample_positions([3, 2], 10, seed=0)]
        [(0, [0, 1, 2]), (1, [0, 1])]
    """
    total = sum(numels)
    if total == 0 or k <= 0:
        return []
    if total <= k:
        flat = torch.arange(total)
    else:
        # Drawn with replacement and deduplicated: k << total, so a few duplicates at most, and no
        # permutation of billions of elements is ever built.
        generator = torch.Generator().manual_seed(seed)
        flat = torch.unique(torch.randint(total, (k,), generator=generator))  # sorted
    ends = torch.tensor(numels, dtype=torch.int64).cumsum(0)
    owner = torch.searchsorted(ends, flat, right=True)
    starts = ends - torch.tensor(numels, dtype=torch.int64)
    return [(int(i), flat[owner == i] - starts[i]) for i in owner.unique().tolist()]


def lost_updates(before: torch.Tensor, after: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """How many elements were meant to move and did not: ``[lost, counted]``, on the values' device.

    Args:
        before: the sampled values just before the optimizer step.
        after: the same elements just after it, in the same dtype.
        gradient: their gradients at the step; only elements with a nonzero gradient are counted.

    Returns:
        An int64 tensor ``[lost, counted]``: ``counted`` elements had a nonzero gradient, ``lost`` of them
        have the same bits after the step as before.

    Example:
        >>> w = torch.tensor([0.02, 0.02, 0.0], dtype=torch.bfloat16)
        >>> lost_updates(w, w - 1e-5, torch.tensor([1.0, 1.0, 0.0])).tolist()  # 1e-5 is below bf16's spacing at 0.02
        [2, 2]
        >>> w = w.float()
        >>> lost_updates(w, w - 1e-5, torch.tensor([1.0, 1.0, 0.0])).tolist()
        [0, 2]
    """
    if before.dtype != after.dtype or before.shape != after.shape:
        raise ValueError(f"before {before.dtype} {tuple(before.shape)} and after {after.dtype} {tuple(after.shape)} differ")
    bits = _BITS[before.element_size()]
    meant = gradient != 0
    same = before.view(bits) == after.view(bits)
    return torch.stack([(same & meant).sum(), meant.sum()])


def lost_fraction(counts: Sequence[float]) -> Optional[float]:
    """``lost / counted`` of :func:`lost_updates`' counts (summed over steps), ``None`` when none counted.

    >>> lost_fraction([3, 4]), lost_fraction([0, 0])
    (0.75, None)
    """
    lost, counted = counts
    return float(lost) / float(counted) if counted else None


class LostUpdateProbe:
    """Watches a fixed sample of the elements the optimizer updates; see the module docstring.

    Call :meth:`snapshot` after the step's last backward (gradients in place) and just before the
    optimizer step, then :meth:`compare` just after it. Each costs one gather per watched tensor
    (``torch.take`` of its sampled positions) and one concatenation, all on the device.

    Args:
        parameters: the tensors the optimizer writes its updates into, in a fixed order (the same on
            every rank).
        seed: chooses the sample (:func:`sample_positions`).
        sample_size: how many elements to watch.
    """

    def __init__(self, parameters: Sequence[torch.Tensor], seed: int, sample_size: int = SAMPLE_SIZE):
        params = list(parameters)
        positions = sample_positions([p.numel() for p in params], sample_size, seed)
        self.watched = [(params[i], idx.to(params[i].device)) for i, idx in positions]
        self.size = sum(len(idx) for _, idx in self.watched)
        self._before: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def zeros(self, n: int) -> torch.Tensor:
        """``n`` zero counts where :meth:`compare`'s are (the watched tensors' device)."""
        device = self.watched[0][1].device if self.watched else torch.device("cpu")
        return torch.zeros(n, dtype=torch.int64, device=device)

    def _values(self) -> torch.Tensor:
        # torch.cat promotes mixed dtypes (a bf16 body with an fp32 head) to the widest: bf16 and fp16 widen
        # to fp32 exactly, so equal bits after widening are equal bits before.
        return torch.cat([torch.take(p.detach(), idx) for p, idx in self.watched])

    def snapshot(self) -> None:
        """Just before the optimizer step: the sampled values and their gradients."""
        if not self.watched:
            return
        grads = [torch.take(p.grad.detach(), idx) if p.grad is not None else torch.zeros(len(idx), device=idx.device)
                 for p, idx in self.watched]
        self._before = (self._values(), torch.cat(grads))

    def compare(self) -> Optional[torch.Tensor]:
        """Just after the optimizer step: :func:`lost_updates` against the last snapshot (``None``: none taken)."""
        if self._before is None:
            return None
        (before, gradient), self._before = self._before, None
        return lost_updates(before, self._values(), gradient)

    def discard(self) -> None:
        """Forget the snapshot: the update it was taken for was not applied."""
        self._before = None
