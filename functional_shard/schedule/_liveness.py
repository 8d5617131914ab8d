"""Which storages a scheduled graph holds alive at each node, and how many bytes: the graph's
memory timeline, read from the nodes' fake values (`meta["val"]`) in graph order.

The rules (`fs.analysis`'s memory model is built on them, and the schedule's passes that weigh
memory, `early_update` and `gradients_in_place`, read the same timeline):

- a storage is allocated by the node that first produces it (a collective's output buffer by
  the node that *issues* it: the output exists from the issue on, even before the wait);
- it is alive until the last node that reads any of its aliases (views, splits, in-place
  results, a collective's waited result); storages the step returns are alive to the end;
- the step's inputs are alive the whole step (the caller holds them);
- a collective holds its input until it is waited for (gloo keeps the tensors it sends from).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ._graph import _is_view as is_view

__all__ = ["memory_timeline", "lifetimes", "timeline_of", "tensors_of"]

_C10D = torch.ops._c10d_functional


def tensors_of(value) -> list[torch.Tensor]:
    """The tensors in a node's `meta["val"]` (a tensor, or a tuple/list of them for ops such as split)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_of(v)]
    return []


def _storages(node: fx.Node, storage_of: dict) -> list | None:
    """The storages `node`'s outputs alias, or None when it allocates new ones.

    Read from the graph, not from the fake tensors' storages: a schedule pass that copies
    nodes (the re-gather for the backward) copies their `meta["val"]` too, so a copy's fake
    value shares the original's storage although at run time it has its own."""
    if node.op != "call_function":
        return None
    if node.target is _C10D.wait_tensor.default:
        # wait_tensor hands back the buffer its collective allocated when it was issued.
        return list(storage_of.get(node.args[0], []))
    if node.target is operator.getitem:
        source, index = node.args
        keys = storage_of.get(source, [])
        if is_view(source):  # split and friends: every piece is a view of the input
            return list(keys[:1])
        return [keys[index]] if isinstance(index, int) and index < len(keys) else []
    if is_view(node):  # view ops alias their first tensor argument (`self`)
        source = next((a for a in node.args if isinstance(a, fx.Node)), None)
        return list(storage_of.get(source, [])[:1]) if source is not None else []
    schema = getattr(node.target, "_schema", None)
    if schema is not None:  # in-place and out= ops return the argument they write
        aliased = [r.alias_info for r in schema.returns if r.alias_info is not None]
        if aliased:
            sets = set().union(*(a.before_set for a in aliased))
            for argument, value in zip(schema.arguments, node.args):
                if argument.alias_info is not None and argument.alias_info.before_set & sets and isinstance(value, fx.Node):
                    return list(storage_of.get(value, [])[:1])
    # Ops that return a view without saying so in their schema (`_unsafe_view`): the output's
    # fake storage is one of its inputs'.
    outputs = tensors_of(node.meta.get("val"))
    if len(outputs) == 1:
        mine = StorageWeakRef(outputs[0].untyped_storage())
        for source in node.all_input_nodes:
            for t, key in zip(tensors_of(source.meta.get("val")), storage_of.get(source, [])):
                if StorageWeakRef(t.untyped_storage()) == mine:
                    return [key]
    return None


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
        return t.numel() * t.element_size()


def memory_timeline(gm: fx.GraphModule) -> list[int]:
    """Bytes alive at each node of `gm`, in graph order (the timeline `fs.analysis`'s
    `estimate_memory` takes its peak from, without its breakdown by category)."""
    nodes = list(gm.graph.nodes)
    _, first, last, size, _ = lifetimes(nodes)
    return timeline_of(len(nodes), first, last, size)


def timeline_of(n: int, first: dict, last: dict, size: dict) -> list[int]:
    """Bytes alive at each of `n` nodes from `lifetimes`' first and last positions and sizes."""
    deltas = [0] * (n + 1)
    for key, start in first.items():
        deltas[start] += size[key]
        deltas[last[key] + 1] -= size[key]
    timeline, alive = [], 0
    for i in range(n):
        alive += deltas[i]
        timeline.append(alive)
    return timeline


def lifetimes(nodes: list) -> tuple[dict, dict, dict, dict, dict]:
    """For each storage (key): the position of its first and last node, its bytes and the node
    that allocated it; and for each node the keys of the storages its outputs alias."""
    end = len(nodes) - 1
    storage_of: dict[fx.Node, list] = {}
    first: dict = {}
    last: dict = {}
    size: dict = {}
    root: dict = {}
    for i, node in enumerate(nodes):
        keys = _storages(node, storage_of)
        if keys is None:  # a new storage per tensor output
            keys = []
            for index, t in enumerate(tensors_of(node.meta.get("val"))):
                key = (node, index)
                keys.append(key)
                first[key], size[key], root[key] = i, _nbytes(t), node
        storage_of[node] = keys
        for key in keys:
            last[key] = max(last.get(key, i), i)
        for source in node.all_input_nodes:
            for key in storage_of.get(source, []):
                last[key] = max(last[key], end if node.op == "output" else i)
        if node.target is _C10D.wait_tensor.default and isinstance(node.args[0], fx.Node):
            # The collective's work holds its input until it is waited for (gloo keeps the
            # tensors it sends from): e.g. a mixed-precision cast shard, a full gradient.
            for source in node.args[0].all_input_nodes:
                for key in storage_of.get(source, []):
                    last[key] = max(last[key], i)
    for node in nodes:
        if node.op == "placeholder":
            for key in storage_of[node]:
                first[key], last[key] = 0, end
    return storage_of, first, last, size, root
