"""`Offload` (which units live in host memory between steps, and where their update runs) and
the pass that streams the step's host <-> device copies (`stream_offload_copies`).

The copies themselves are `functional_shard::offload_copy` nodes (`functional_shard/_offload.py`
says what the step copies and when); this pass only moves them: a copy to the device right
before its first reader (the copies that feed an all-gather then move with it, `prefetch`), a
copy to the host right after the value it copies, so that the device holds a buffer's copy from
its first use to its last and no longer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import fx

from ._context import Pass, PassContext
from ._graph import _is_view, _schema, offload_copy_ops, positions
from ._remat import written_inputs

__all__ = ["Offload", "stream_offload_copies", "offload_copies", "is_offload_copy", "copies_into", "is_to_host", "copy_source"]


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which units live on the host between steps, and where their update runs.

    Attributes:
        units: True (default) for every unit, a tuple of unit names, or a function
            `unit -> bool`: those units' parameter shards (trainable and frozen) and optimizer
            state are kept in host memory; their gradient shards go there as they are reduced.
        update: "device" (default): each buffer's update runs on the compute device, streamed
            (copied there, updated, copied back): the default step's bits. "host": on the host,
            where the tensors are (fewer transfers, the host's kernels).
    """

    units: bool | tuple[str, ...] | Callable[[str], bool] = True
    update: str = "device"

    def __post_init__(self) -> None:
        if self.update not in ("device", "host"):
            raise ValueError(f"Offload.update must be 'device' or 'host'; got {self.update!r}")
        if isinstance(self.units, list):
            object.__setattr__(self, "units", tuple(self.units))
        if not (isinstance(self.units, (bool, tuple)) or callable(self.units)):
            raise ValueError(f"Offload.units must be True, a tuple of unit names or a function unit -> bool; got {self.units!r}")
        if isinstance(self.units, tuple) and not all(isinstance(u, str) for u in self.units):
            raise ValueError(f"Offload.units must name units (strings); got {self.units!r}")

    def selects(self, unit: str) -> bool:
        if isinstance(self.units, bool):
            return self.units
        if isinstance(self.units, tuple):
            return unit in self.units
        return bool(self.units(unit))



def is_offload_copy(node: fx.Node) -> bool:
    """An `offload_copy` or `offload_copy_into` node."""
    return node.target in offload_copy_ops()


def offload_copies(gm: fx.GraphModule) -> list[fx.Node]:
    """The step's host <-> device copies (`offload_copy` nodes, and `offload_copy_into` nodes:
    the donated state's results copied into its own host buffers), in graph order."""
    ops = offload_copy_ops()
    return [n for n in gm.graph.nodes if n.target in ops]


def copies_into(node: fx.Node) -> bool:
    """An `offload_copy_into` node: it writes its first argument, a host buffer, and makes none."""
    return len(node.args) == 2


def is_to_host(node: fx.Node) -> bool:
    return copies_into(node) or bool(node.args[2])


def copy_source(node: fx.Node):
    """What a copy copies (its tensor argument)."""
    return node.args[1] if copies_into(node) else node.args[0]


def _writes(gm: fx.GraphModule, source: fx.Node):
    """The nodes that write `source`'s storage in place, in graph order: an in-place operation
    on it or on a view of it (the optimizer updates its private copies in place)."""
    storage = {source}
    for node in gm.graph.nodes:
        if not set(node.all_input_nodes) & storage:
            continue
        written = set(written_inputs(node)) & storage
        if _is_view(node) or written or _returns_alias(node):
            storage.add(node)
        if written:
            yield node


def _last_write(gm: fx.GraphModule, source: fx.Node, copy: fx.Node) -> fx.Node:
    """The last node before `copy` that makes or writes `source`'s storage: `source`, or its last
    in-place write before `copy` (the copy must see the last write)."""
    order = positions(gm)
    return max((w for w in _writes(gm, source) if order[w] < order[copy]), key=order.__getitem__, default=source)


def _next_write(gm: fx.GraphModule, source, copy: fx.Node, order: dict) -> fx.Node | None:
    """The first node after `copy` (`order`: the graph's positions) that writes `source`'s storage
    in place, or None."""
    if not isinstance(source, fx.Node):
        return None
    return next((w for w in _writes(gm, source) if order[w] > order[copy]), None)


def _returns_alias(node: fx.Node) -> bool:
    """An in-place operation returns the tensor it wrote (`mul_` returns its `self`)."""
    schema = _schema(node)
    return schema is not None and any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)


@dataclasses.dataclass(frozen=True)
class stream_offload_copies(Pass):
    """Each copy to the device right before its first reader; each copy to the host right
    after what it copies. Moves no collective; the bits do not change (copies are exact)."""

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        _norms_on_the_device(gm)
        for node in offload_copies(gm):
            if is_to_host(node):
                source = copy_source(node)
                if isinstance(source, fx.Node) and source.op != "placeholder":
                    after = _last_write(gm, source, node)
                    if after.next is not node:
                        after.append(node)
                    for reader in list(source.users):  # the gradient's norm, read before it left
                        if reader.meta.get("offload_norm_of") == node.name and node.next is not reader:
                            node.append(reader)
            elif node.users:
                _before_first_reader(gm, node)
        return gm


_VECTOR_NORM = torch.ops.aten.linalg_vector_norm.default


def _copy_dtype(copy: fx.Node):
    return copy.args[3] if len(copy.args) > 3 else copy.kwargs.get("dtype")


def _norms_on_the_device(gm: fx.GraphModule) -> None:
    """A gradient's norm (its part of the global gradient norm) read from the gradient on the
    device, right after it was copied to the host, instead of from its copy back for the
    update: the same values through the same operator (the same bits), and the copy back then
    waits for the buffer's own update; else every gradient comes back to the device for the
    norm before the first update (on a 1.1B Llama, 4.4 GB at the update's peak)."""
    for copy in offload_copies(gm):
        source = copy.args[0]
        if is_to_host(copy) or not (isinstance(source, fx.Node) and source.target is copy.target and is_to_host(source)):
            continue
        gradient = source.args[0]
        same = lambda d, of: d is None or d == getattr(of.meta.get("val"), "dtype", None)  # noqa: E731
        if not isinstance(gradient, fx.Node) or not same(_copy_dtype(source), gradient) or not same(_copy_dtype(copy), source):
            continue
        for reader in list(copy.users):
            if reader.target is _VECTOR_NORM and reader.args[0] is copy:
                reader.replace_input_with(copy, gradient)
                reader.meta["offload_norm_of"] = source.name  # it follows its copy to the host
                source.append(reader)


def _before_first_reader(gm: fx.GraphModule, copy: fx.Node) -> None:
    """Move a copy to the device right before the first node that computes with it, with the
    views of it (detach, slices of a flat buffer) that the trace made early: the optimizer
    detaches every state tensor first and computes buffer by buffer later, and a copy placed
    before its first view would make every buffer's state live on the device at once."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    chain, frontier = set(), [copy]
    while frontier:
        for user in frontier.pop().users:
            if user not in chain and _is_view(user):
                chain.add(user)
                frontier.append(user)
    readers = [u for a in (copy, *chain) for u in a.users if u not in chain]
    if not readers:
        return
    first = min(readers, key=order.__getitem__)
    write = _next_write(gm, copy_source(copy), copy, order)
    if write is not None and order[write] < order[first]:
        first = write  # an in-place write of what it copies (a hoisted weight decay): the copy reads before it
    inputs_ready = all(
        order[i] < order[first] for a in chain for i in a.all_input_nodes if i is not copy and i not in chain
    )
    moved = [copy, *sorted(chain, key=order.__getitem__)] if inputs_ready else [copy]
    if not inputs_ready:
        first = min(copy.users, key=order.__getitem__)
    for node in moved:
        first.prepend(node)
