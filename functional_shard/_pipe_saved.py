"""What a pipelined stage's micro-batch holds for its backward: the bytes autograd saves as a
stage's forward runs (`saved_bytes`), what stays alive from its I to its W (`split_bytes`, the
predictions' figures), and a profiled run's record of both per action (`Recorder`)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from . import _split_backward

__all__ = ["Recorder", "saved_bytes", "alive_bytes", "split_bytes"]


class Recorder:
    """What a profiled run records on this rank: each action's start and end (`time.perf_counter_ns`,
    one clock for every process of the machine), and per stage the bytes autograd saves for each
    micro-batch's backward (its activations, counted once per storage) and their peak in flight.
    A micro-batch's bytes change at its I: the saved storages still alive (I frees the graph above
    the parameters) and the gradients its W needs (`Split.kept_bytes`)."""

    def __init__(self):
        self.events: list[tuple[str, int, int]] = []  # (action, start ns, end ns)
        self.saved: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> bytes held now (from its F)
        self.refs: dict[tuple[int, int], dict] = {}  # (stage, micro-batch) -> its saved storages (weak)
        self.live: dict[int, int] = {}  # stage -> bytes in flight now
        self.peak: dict[int, int] = {}  # stage -> most bytes in flight
        self.live_count: dict[int, int] = {}
        self.peak_count: dict[int, int] = {}  # stage -> most micro-batches in flight

    def forward(self, stage: int, microbatch: int, nbytes: int, refs: dict | None = None) -> None:
        self.saved[stage, microbatch] = nbytes
        self.refs[stage, microbatch] = refs or {}
        self.live[stage] = self.live.get(stage, 0) + nbytes
        self.peak[stage] = max(self.peak.get(stage, 0), self.live[stage])
        self.live_count[stage] = self.live_count.get(stage, 0) + 1
        self.peak_count[stage] = max(self.peak_count.get(stage, 0), self.live_count[stage])

    def input_done(self, stage: int, microbatch: int, kept_bytes: int) -> None:
        held = alive_bytes(self.refs.pop((stage, microbatch))) + kept_bytes
        self.live[stage] += held - self.saved[stage, microbatch]
        self.saved[stage, microbatch] = held
        self.peak[stage] = max(self.peak[stage], self.live[stage])

    def backward_done(self, stage: int, microbatch: int) -> None:
        self.live[stage] -= self.saved[stage, microbatch]
        self.live_count[stage] -= 1


def saved_bytes(run, refs: dict | None = None, persistent=()):
    """`(run(), bytes of the distinct storages autograd saves while it runs)`; `refs`, a dict, gets
    a weak reference and the bytes of each (for `alive_bytes`). Storages of the `persistent`
    tensors (the stage's parameters, buffers and batch: alive for the whole step whatever the
    micro-batches do) are not counted: a micro-batch's forward that saves a weight for its
    backward holds no bytes of its own for it."""
    storages: dict[int, int] = {}
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in persistent if isinstance(t, torch.Tensor)}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if StorageWeakRef(storage).cdata in skip:
                return t.detach()
            storages[StorageWeakRef(storage).cdata] = storage.nbytes()
            if refs is not None:
                refs[StorageWeakRef(storage).cdata] = (StorageWeakRef(storage), storage.nbytes())
            # detached: an output saved with its own grad_fn would make a cycle through C++ (node ->
            # packed tensor -> node) that keeps a node no backward runs (an I's input path after W) alive
            return t.detach()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(storages.values())


def alive_bytes(refs: dict) -> int:
    """The bytes of the storages of `saved_bytes`'s `refs` still alive."""
    return sum(n for ref, n in refs.values() if not ref.expired())


def split_bytes(run, received: list, params: list, last: bool, sent, storages: dict | None = None,
                persistent=()) -> tuple[int, int]:  # fmt: skip
    """A stage's forward `run()` (from `received`, with `params`) then its I, seeded with ones (on
    fake tensors: the predictions): (bytes the forward saves, bytes its micro-batch holds from I
    to W — the saved storages I leaves alive and the gradients it keeps for W). `storages`, a
    dict, gets each saved storage's id -> (bytes, alive after I); `persistent`: as `saved_bytes`."""
    refs: dict = {}
    outputs, nbytes = saved_bytes(run, refs, persistent)
    roots = [outputs[0]] if last else [o for o, b in zip(outputs, sent) if b.differentiable]
    roots = [r for r in roots if r.requires_grad]
    del outputs
    inputs = [t for t in received if t.requires_grad]
    _, split = _split_backward.backward_input(roots, [torch.ones_like(r) for r in roots], inputs, params)
    del roots
    if storages is not None:
        storages.update({k: (n, not ref.expired()) for k, (ref, n) in refs.items()})
    return nbytes, alive_bytes(refs) + split.kept_bytes()
