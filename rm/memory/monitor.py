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

import os
import resource
from typing import Dict, Iterable, List, Optional

import torch

from rm.memory.storage import StorageTracker


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc``; 0 where it is not available)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """The largest resident set size this process has had (``ru_maxrss``, kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class MemoryMonitor:
    """Peak memory of this process's device, measured the best way the device allows.

    Started before the model is built, so that what the engine allocates while wrapping it (DDP's
    gradient buckets, DeepSpeed's flat partitions) counts as well as the loop's own tensors.

    Args:
        device: the training device.
        track_cpu_tensors: on a CPU, count live tensor bytes (slows small models by
            dispatching every operator through Python); otherwise report nothing.
    """

    def __init__(self, device: torch.device, track_cpu_tensors: bool = False):
        self.device = torch.device(device)
        self.tracker: Optional[StorageTracker] = None
        self.rss_start = current_rss_bytes()
        self.cuda_used_start: Optional[int] = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self.cuda_used_start = total - free  # the context and other processes, before this run allocates
            torch.cuda.reset_peak_memory_stats(self.device)
        elif track_cpu_tensors:
            self.tracker = StorageTracker()

    def start(self) -> "MemoryMonitor":
        if self.tracker is not None:
            self.tracker.__enter__()
        return self

    def stop(self) -> None:
        if self.tracker is not None and self.tracker.active:
            self.tracker.__exit__(None, None, None)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    def register(self, tensors: Iterable[torch.Tensor]) -> None:
        if self.tracker is not None:
            self.tracker.register(tensors)

    def snapshot(self) -> Dict[str, object]:
        """The measured peak, as written to ``memory.json``.

        Besides the exact count, the growth of the process's peak resident size since the monitor
        started: an independent measure (it sees every byte malloc hands out, tensors or not), coarser
        since it also holds the allocator's caching and whatever the libraries allocate outside torch.
        On CUDA, the device's own view (``mem_get_info``): used memory when the monitor started and
        now, which holds the allocator's reserve, the CUDA context and communication buffers.
        """
        rss = {"rss_start_bytes": self.rss_start, "peak_rss_growth_bytes": max(peak_rss_bytes() - self.rss_start, 0)}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return {
                "method": "torch.cuda.max_memory_allocated / max_memory_reserved",
                "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                "device_used_start_bytes": self.cuda_used_start,
                "device_used_bytes": total - free,  # the caching allocator keeps its peak reserve until emptied
                "device_total_bytes": total,
                **rss,
            }
        if self.tracker is not None:
            return {"method": "live CPU tensor storages (rm.memory.storage.StorageTracker)",
                    "peak_allocated_bytes": self.tracker.peak, **rss}
        return {"method": "not tracked (train.logging.track_memory=false on a CPU)", **rss}


def gather_snapshots(snapshot: Dict[str, object]) -> List[Dict[str, object]]:
    """Every rank's snapshot, in rank order (a collective when several processes run; every rank calls)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [snapshot]
    out: List[Optional[Dict[str, object]]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, snapshot)
    return out  # type: ignore[return-value]
