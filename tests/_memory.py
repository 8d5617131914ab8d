"""Measuring memory in a rank: bytes of tensor storages alive, counted by a TorchDispatchMode,
and the resident set's high-water mark (Linux: /proc/self/clear_refs resets it)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AliveBytes(TorchDispatchMode):
    """The most bytes of storages made by ops under this mode that were alive at once.

    After every op, each output's storage (once, however many views) is recorded with a weak
    reference; storages that died since are dropped, the rest summed. The storages of
    `existing` (this rank's shards, say) are never counted, even when an op returns them."""

    def __init__(self, existing=()):
        super().__init__()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.existing = {t.untyped_storage()._cdata for t in existing}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage._cdata in self.existing:
                    continue
                self.alive.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def peak_with(existing, run) -> int:
    """The most bytes alive at once while `run()` runs: the distinct storages of the `existing`
    tensors (a step's state and batch) and the most storages made under `AliveBytes` at once."""
    distinct = {t.untyped_storage()._cdata: t for t in existing if isinstance(t, torch.Tensor)}
    with AliveBytes(distinct.values()) as tracker:
        run()
    return tracker.peak + sum(t.untyped_storage().nbytes() for t in distinct.values())


def reset_peak_rss() -> int:
    """Reset the resident set's high-water mark; return the current resident set (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_rss() -> int:
    """The resident set's high-water mark since the last reset (bytes)."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
