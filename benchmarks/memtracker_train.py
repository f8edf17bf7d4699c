"""``rm.train`` with PyTorch's own MemTracker counting beside rm's live-tensor count, in the same process.

    python benchmarks/memtracker_train.py <rm.train overrides> train.logging.track_memory=true
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/memtracker_train.py <overrides>

``torch.distributed._tools.mem_tracker.MemTracker`` is an independent implementation of the same idea as
``rm.memory.storage.StorageTracker`` (a dispatch mode that sees every storage an operator creates, weak references
for frees), with its own module, gradient and optimizer hooks and ``UntypedStorage.resize_`` patched. It is opened
when rm's monitor starts (before the model is built), is handed every tensor rm registers (weights, engine states),
and is closed first when the monitor stops; its peak (total and by category) joins each rank's ``measured`` entry
in memory.json as ``memtracker_peak_bytes`` / ``memtracker_peak_breakdown_mib``. Used by
``benchmarks/memory_calibration.py --random N --memtracker K``; nothing in rm changes.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

# The rm of this checkout, as `python -m rm.train` run from its root imports, not an installed one elsewhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rm.memory import monitor as _monitor  # noqa: E402



def loop_memtracker():
    """MemTracker for a training loop: its module statistics are per iteration (it refuses a second forward of the
    root module: cleared instead, the global peak it reports is kept), and it hooks gradients only of parameters
    that train (it registers a hook on every parameter, which fails on LoRA's frozen base)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class LoopMemTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the next iteration's forward (or an evaluation's)
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            frozen = [p for p in module.parameters() if not p.requires_grad]
            if not frozen:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            for p in frozen:  # their storages counted, no hook
                self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
            trainable = [p for p in module.parameters() if p.requires_grad]
            param_mem, buffer_mem = 0, 0
            for p in trainable:
                self._update_and_maybe_create_winfos(p, _MemRefType.PARAM)
                if install_grad_hooks and self._param_to_grad_hook_handles.get(p, None) is None:
                    def hook(grad):
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(hook), p.register_post_accumulate_grad_hook(lambda q: hook(q.grad)))
            for b in module.buffers():
                self._update_and_maybe_create_winfos(b, _MemRefType.BUFFER)
            return param_mem, buffer_mem

    return LoopMemTracker()


_start, _stop, _register, _snapshot = (_monitor.MemoryMonitor.start, _monitor.MemoryMonitor.stop,
                                       _monitor.MemoryMonitor.register, _monitor.MemoryMonitor.snapshot)


def start(self):
    _start(self)
    self._memtracker, self._memtracker_error = None, None
    if self.tracker is not None:  # CPU with train.logging.track_memory=true: rm's tracker is the outer mode
        try:
            self._memtracker = loop_memtracker()
            self._memtracker.__enter__()
        except Exception as e:  # noqa: BLE001  (recorded, never fatal: rm's own count stands)
            self._memtracker, self._memtracker_error = None, repr(e)[:300]
    return self


def stop(self):
    mt = getattr(self, "_memtracker", None)
    if mt is not None and getattr(self, "_memtracker_open", True):
        self._memtracker_open = False
        mt.__exit__(None, None, None)  # the inner mode leaves first
    _stop(self)


def register(self, tensors):
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    _register(self, tensors)
    mt = getattr(self, "_memtracker", None)
    if mt is not None and tensors:
        mt.track_external(*tensors)


def snapshot(self):
    out = _snapshot(self)
    mt = getattr(self, "_memtracker", None)
    if mt is not None:
        # MemTracker keeps a peak per device and counts meta tensors (the model is built on the meta device first)
        # as memory of device "meta": they hold none, so only the real devices' peak is compared.
        peak = mt.get_tracker_snapshot("peak")
        out["memtracker_peak_bytes"] = sum(int(snap.get("Total", 0)) for dev, snap in peak.items() if dev.type != "meta")
        out["memtracker_peak_breakdown_mib"] = {str(getattr(k, "value", k)): v / 2**20 for dev, snap in peak.items()
                                                if dev.type != "meta" for k, v in snap.items()}
        out["memtracker_meta_peak_bytes"] = sum(int(snap.get("Total", 0)) for dev, snap in peak.items() if dev.type == "meta")
    if getattr(self, "_memtracker_error", None):
        out["memtracker_error"] = self._memtracker_error
    return out


_monitor.MemoryMonitor.start, _monitor.MemoryMonitor.stop = start, stop
_monitor.MemoryMonitor.register, _monitor.MemoryMonitor.snapshot = register, snapshot

if __name__ == "__main__":
    sys.argv = ["rm.train", *sys.argv[1:]]
    runpy.run_module("rm.train", run_name="__main__", alter_sys=True)
