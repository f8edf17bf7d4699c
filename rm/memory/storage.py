"""Bytes of live tensor storages, counted as aten operators create them and as they are freed.

One tracker serves both users of the fact: the activation trace (``rm.memory.trace``), which needs the
timeline of a step with phase marks, and the training run's CPU memory monitor (``rm.memory.monitor``),
which needs only the running peak and must not grow with the length of the run.

A new storage is seen on the output of the operator that created it (a dispatch mode sees every aten
op, for real and fake tensors alike), its death through a weak reference: torch keeps one Python
storage object per live C++ storage, so the callback fires exactly when the memory is released.
Storages are keyed by their C++ address (``_cdata``); views share their base's storage and count once.
"""

from __future__ import annotations

import functools
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    """Count the bytes of live tensor storages and their peak; with ``timeline=True`` also record every
    allocation and release in order, so that phases can be marked and read back.

    Tensors that exist before tracking either count (:meth:`register`: a run's weights) or are
    ignored (:meth:`ignore`: a traced step's weights and inputs, which are not activations).

    Args:
        timeline: keep the event list (:meth:`mark`, :meth:`exclude`, :meth:`live_after_each_event`).
            Off for a training run, whose count must stay a few numbers however long it runs.

    Example:
        >>> with StorageTracker() as tracker:
        ...     a = torch.zeros(1024)          # 4096 bytes
        ...     b = torch.zeros(2048)          # 8192 bytes
        ...     del a
        ...     c = torch.zeros(256)           # 1024 bytes
        >>> tracker.peak, tracker.live
        (12288, 9216)
    """

    def __init__(self, timeline: bool = False):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.active = False
        self.marks: Dict[str, int] = {}  # name -> number of events before it
        self._storages: Dict[int, Tuple[int, int, weakref.ref]] = {}  # _cdata -> (storage id, bytes or -1, weakref)
        self._next_id = 0
        self._events: Optional[List[Tuple[int, int]]] = [] if timeline else None  # (storage id, +bytes or -bytes)
        self._excluded: set = set()

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def _add(self, tensor: torch.Tensor, counted: bool) -> None:
        if tensor.device.type == "meta":  # holds no memory
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse or functional wrappers: none occur in these models
            return
        key = storage._cdata
        if key in self._storages:
            return
        sid, nbytes = self._next_id, storage.nbytes() if counted else -1
        self._next_id += 1
        if counted:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if self._events is not None:
                self._events.append((sid, nbytes))
        # The weakref must itself be kept alive or its callback never runs.
        self._storages[key] = (sid, nbytes, weakref.ref(storage, functools.partial(self._freed, key, sid, nbytes)))

    def _freed(self, key: int, sid: int, nbytes: int, _ref) -> None:
        entry = self._storages.get(key)
        if entry is not None and entry[0] == sid:  # else the address already belongs to a storage registered since
            del self._storages[key]
        if nbytes >= 0:
            self.live -= nbytes
            if self._events is not None:
                self._events.append((sid, -nbytes))

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count tensors that already exist (weights, a loaded optimizer state)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, counted=True)

    def ignore(self, tensors: Iterable[torch.Tensor]) -> None:
        """Treat the storages of ``tensors`` as existing before the step: never counted."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, counted=False)

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Leave these storages (parameter gradients) out of :meth:`live_after_each_event`, over the whole timeline."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                entry = self._storages.get(tensor.untyped_storage()._cdata)
                if entry is not None:
                    self._excluded.add(entry[0])

    def mark(self, name: str) -> None:
        """Note a phase boundary at the current point of the timeline."""
        self.marks[name] = len(self._timeline())

    def reset_peak(self) -> None:
        self.peak = self.live

    def live_after_each_event(self, excluded: bool = False) -> List[int]:
        """Counted live bytes after each event, prepended with 0: index ``marks[name]`` is the value at that
        mark. The excluded storages are left out, or with ``excluded=True`` are all that is counted."""
        out, current = [0], 0
        for sid, delta in self._timeline():
            if (sid in self._excluded) == excluded:
                current += delta
            out.append(current)
        return out

    def _timeline(self) -> List[Tuple[int, int]]:
        if self._events is None:
            raise RuntimeError("StorageTracker(timeline=False) keeps no events")
        return self._events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, counted=True)
        return out
