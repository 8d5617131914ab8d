"""Peak memory of a scheduled step, from the lifetimes of its tensors' storages.

A traced step runs its graph node by node, and the generated code drops each value right after
its last use; a storage is freed when the last of its aliases (views, splits, in-place results,
a collective's waited result) is dropped. So, in graph order:

- a storage is allocated by the node that first produces it (a collective's output buffer by
  the node that *issues* it: the output exists from the issue on, even before the wait);
- it is alive until the last node that reads any of its aliases; storages the step returns
  are alive to the end;
- the step's inputs (parameter shards, optimizer state, batch) are alive the whole step: the
  caller holds them. With donation the optimizer updates them in place, so the new state
  shares their storages and is not counted twice.

Storages are identified as the fake tensors in `node.meta["val"]` identify them (views share
their base's storage), which is exact for the graph as traced. Not counted: memory an operator
allocates internally and frees before it returns, the allocator's own overhead, and the
communication library's buffers.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..schedule._graph import pre_collective_cast
from ._costs import COLLECTIVE_OPS, is_view, tensors_of
from ._regions import GRADIENT_PLUMBING, NodeRoles, gradient_sources

__all__ = ["MemoryBreakdown", "MemoryEstimate", "estimate_memory", "memory_timeline", "CATEGORIES"]

_C10D = torch.ops._c10d_functional
_ISSUE = COLLECTIVE_OPS - {_C10D.wait_tensor.default}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "gathered", "activations", "update_temporaries", "batch")


class MemoryBreakdown(NamedTuple):
    """Bytes alive on one rank at one point of the step, by what they hold."""

    parameters: int  # parameter shards (the state's, and the new ones the step returns) and module buffers
    gradients: int  # leaf gradients of a unit, its flat full-size gradient, the reduce-scattered shard
    optimizer_state: int  # optimizer state (the state's, and the new one the step returns), its scalars
    gathered: int  # full (all-gathered) parameters of units, and shards cast to the gather dtype
    activations: int  # forward values kept for the backward, and the backward's temporaries
    update_temporaries: int  # the optimizer's intermediate values
    batch: int  # this rank's batch

    @property
    def total(self) -> int:
        return sum(self)


class MemoryEstimate(NamedTuple):
    """The predicted memory of one step on one rank."""

    peak: int  # bytes alive at the worst point of the step
    peak_node: str  # the node at which the peak is reached (its output allocated, its inputs not yet freed)
    peak_position: int  # its position in the graph
    breakdown: MemoryBreakdown  # the peak, by category
    resident: int  # bytes alive before the first node runs (the step's inputs)
    timeline: tuple  # bytes alive while each node runs, in graph order


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


def estimate_memory(gm: fx.GraphModule, roles: NodeRoles, io) -> MemoryEstimate:
    """Peak bytes per rank of the scheduled step `gm`, broken down (see the module docstring).

    Arguments:
        gm: the `graph_module` of a `CompiledStep`.
        roles: `node_roles(gm)`.
        io: the `CompiledStep.io` (`FlatIO`): which inputs and outputs are shards, optimizer
            state, scalars and batch.
    """
    nodes = list(gm.graph.nodes)
    storage_of, first, last, size, root = _lifetimes(nodes)
    category = _categories(nodes, storage_of, root, roles, io)
    per_category = {c: [0] * (len(nodes) + 1) for c in CATEGORIES}
    for key, start in first.items():
        per_category[category[key]][start] += size[key]
        per_category[category[key]][last[key] + 1] -= size[key]
    timeline = _timeline(len(nodes), first, last, size)
    peak_position = max(range(len(nodes)), key=timeline.__getitem__) if nodes else 0
    breakdown = MemoryBreakdown(**{c: sum(per_category[c][: peak_position + 1]) for c in CATEGORIES})
    resident = sum(size[k] for k in first if root[k].op == "placeholder")
    return MemoryEstimate(
        peak=timeline[peak_position] if nodes else 0,
        peak_node=nodes[peak_position].name if nodes else "",
        peak_position=peak_position,
        breakdown=breakdown,
        resident=resident,
        timeline=tuple(timeline),
    )


def memory_timeline(gm: fx.GraphModule) -> list[int]:
    """Bytes alive at each node of `gm`, in graph order (the timeline `estimate_memory`
    takes its peak from, without the breakdown by category, which needs `node_roles`)."""
    nodes = list(gm.graph.nodes)
    _, first, last, size, _ = _lifetimes(nodes)
    return _timeline(len(nodes), first, last, size)


def _timeline(n: int, first: dict, last: dict, size: dict) -> list[int]:
    deltas = [0] * (n + 1)
    for key, start in first.items():
        deltas[start] += size[key]
        deltas[last[key] + 1] -= size[key]
    timeline, alive = [], 0
    for i in range(n):
        alive += deltas[i]
        timeline.append(alive)
    return timeline


def _lifetimes(nodes: list) -> tuple[dict, dict, dict, dict, dict]:
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


def _categories(nodes: list, storage_of: dict, root: dict, roles: NodeRoles, io) -> dict:
    """What each storage holds, from the node that allocated it and where it goes."""
    by_input: dict = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for node, kind in zip(placeholders, io.input_kinds()):
        for key in storage_of[node]:
            by_input[key] = kind
    output = nodes[-1]
    by_output: dict = {}
    for value, kind in zip(output.args[0], io.output_kinds()):
        if not isinstance(value, fx.Node) or kind is None:
            continue
        for key in storage_of.get(value, []):
            by_output.setdefault(key, kind)
    gathered_roots, gradient_roots = set(), set()
    for node in nodes:
        if node.op == "call_function" and node.target in _ISSUE:
            if node.target is _C10D.all_gather_into_tensor_out.default:
                gathered_roots.add(node.kwargs["out"])  # a cast gathered in place: the buffer it was given
            elif node.target is _C10D.all_gather_into_tensor.default:
                gathered_roots.add(node)
                cast = pre_collective_cast(node)
                if cast is not None:
                    gathered_roots.add(cast)  # the shard cast to the gather dtype (mixed precision)
            else:
                # The flat full-size gradient it sends, and the leaf gradients it is made of.
                gradient_roots.add(node)
                gradient_roots.update(gradient_sources(node))
    category = {}
    for key, node in root.items():
        if key in by_input:
            category[key] = by_input[key]
        elif key in by_output:
            category[key] = by_output[key]
        elif node in gathered_roots or (
            node.target in GRADIENT_PLUMBING and any(root.get(k) in gathered_roots for a in node.all_input_nodes for k in storage_of[a])
        ):
            category[key] = "gathered"  # a bucket's member copied out of the bucket's gathered buffer
        elif node in gradient_roots or (node.target is torch.ops.aten.sum.dim_IntList and _reads(node, gradient_roots, root, storage_of)):
            category[key] = "gradients"  # the last: a gloo reduce-scatter's local sum of received slices
            gradient_roots.add(node)
        elif roles.phase.get(node) == "update":
            if node.target is torch.ops.aten.div.Tensor and _reads(node, gradient_roots, root, storage_of, first_only=True):
                category[key] = "gradients"  # the mean over ranks of a reduced gradient shard
                gradient_roots.add(node)
            else:
                category[key] = "update_temporaries"
        else:
            category[key] = "activations"
    return category


def _reads(node: fx.Node, roots: set, root: dict, storage_of: dict, *, first_only: bool = False) -> bool:
    """Whether `node` reads (its first input only, with `first_only`) a storage allocated by one of `roots`."""
    inputs = node.all_input_nodes[:1] if first_only else node.all_input_nodes
    return any(root.get(k) in roots for a in inputs for k in storage_of[a])
