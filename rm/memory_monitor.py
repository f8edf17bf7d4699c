"""Measured peak memory of a training run.

On CUDA the allocator keeps exact statistics (``max_memory_allocated`` and
``max_memory_reserved``). The CPU allocator keeps none, and a process's
resident size mixes in the interpreter, libraries and malloc's caching, so on
a CPU rm counts the bytes of live tensor storages itself: a dispatch mode sees
every storage an operator creates, weak references report when each one is
freed, and the tensors that exist before tracking starts (weights) are
registered up front.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Count the bytes of live tensor storages and their peak.

    Example:
        >>> with LiveTensorBytes() as tracker:
        ...     a = torch.zeros(1024)          # 4096 bytes
        ...     b = torch.zeros(2048)          # 8192 bytes
        ...     del a
        ...     c = torch.zeros(256)           # 1024 bytes
        >>> tracker.peak, tracker.live
        (12288, 9216)
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: Dict[int, int] = {}  # id of the storage's PyObject -> nbytes

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (weights, a loaded optimizer state)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)

    def _add(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # e.g. sparse or functional wrappers
            return
        key = id(storage)
        if key in self._storages:
            return
        nbytes = storage.nbytes()
        self._storages[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        # torch keeps one PyObject per live storage, so this fires when the storage itself is freed.
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live -= self._storages.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        return out


class MemoryMonitor:
    """Peak memory of this process's device, measured the best way the device allows.

    Args:
        device: the training device.
        track_cpu_tensors: on a CPU, count live tensor bytes (slows small models by
            dispatching every operator through Python); otherwise report nothing.
    """

    def __init__(self, device: torch.device, track_cpu_tensors: bool = False):
        self.device = torch.device(device)
        self.tracker: Optional[LiveTensorBytes] = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif track_cpu_tensors:
            self.tracker = LiveTensorBytes()

    def __enter__(self):
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc):
        if self.tracker is not None:
            self.tracker.__exit__(*exc)
        return False

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.tracker is not None:
            self.tracker.register(tensors)

    def snapshot(self) -> Dict[str, object]:
        """The measured peak, as written to ``memory.json``."""
        if self.device.type == "cuda":
            return {
                "method": "torch.cuda.max_memory_allocated / max_memory_reserved",
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
            }
        if self.tracker is not None:
            return {"method": "live CPU tensor storages (rm.memory_monitor.LiveTensorBytes)", "peak_allocated_bytes": self.tracker.peak}
        return {"method": "not tracked (train.track_memory=false on a CPU)"}
