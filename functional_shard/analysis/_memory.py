"""Peak memory of a scheduled step, from the lifetimes of its tensors' storages
(`schedule._liveness`, which the schedule's memory-guided passes read too), by category.

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

from typing import NamedTuple

import torch
from torch import fx

from ..schedule._graph import pre_collective_cast
from ..schedule._offload import copies_into, is_offload_copy, is_to_host
from ..schedule._liveness import lifetimes, memory_timeline, timeline_of  # noqa: F401 - memory_timeline: re-exported
from ._costs import COLLECTIVE_OPS
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
    resident_breakdown: MemoryBreakdown | None = None  # `resident` by category: this rank's parameter
    # shards and pieces, its optimizer state (and scalars), its batch; what MemTracker sees before the step
    host_peak: int = 0  # CPU offload: bytes alive in host memory at its worst point (the fields above are the device's)
    host_resident: int = 0  # ... of which the step's inputs (offloaded shards and optimizer state)


def estimate_memory(gm: fx.GraphModule, roles: NodeRoles, io, unmaterialized: frozenset = frozenset()) -> MemoryEstimate:
    """Peak bytes per rank of the scheduled step `gm`, broken down (see the module docstring).

    Arguments:
        gm: the `graph_module` of a `CompiledStep`.
        roles: `node_roles(gm)`.
        io: the `CompiledStep.io` (`FlatIO`): which inputs and outputs are shards, optimizer
            state, scalars and batch.
        unmaterialized: nodes whose outputs are never allocated (inside a kernel `torch.compile`
            fuses: `analysis._fusion`).
    """
    nodes = list(gm.graph.nodes)
    storage_of, first, last, size, root = lifetimes(nodes)
    if unmaterialized:
        first, last, size = ({k: v for k, v in d.items() if root[k] not in unmaterialized} for d in (first, last, size))
    host = host_storages(nodes, storage_of, root)
    host_timeline = timeline_of(len(nodes), *({k: v for k, v in d.items() if k in host} for d in (first, last, size)))
    host_inputs = sum(size[k] for k in host if root[k].op == "placeholder")
    first, last, size = ({k: v for k, v in d.items() if k not in host} for d in (first, last, size))
    category = _categories(nodes, storage_of, root, roles, io)
    per_category = {c: [0] * (len(nodes) + 1) for c in CATEGORIES}
    for key, start in first.items():
        per_category[category[key]][start] += size[key]
        per_category[category[key]][last[key] + 1] -= size[key]
    timeline = timeline_of(len(nodes), first, last, size)
    peak_position = max(range(len(nodes)), key=timeline.__getitem__) if nodes else 0
    breakdown = MemoryBreakdown(**{c: sum(per_category[c][: peak_position + 1]) for c in CATEGORIES})
    inputs = [k for k in first if root[k].op == "placeholder"]
    resident = sum(size[k] for k in inputs)
    by_category = {c: 0 for c in CATEGORIES}
    for k in inputs:
        by_category[category[k]] += size[k]
    return MemoryEstimate(
        peak=timeline[peak_position] if nodes else 0,
        peak_node=nodes[peak_position].name if nodes else "",
        peak_position=peak_position,
        breakdown=breakdown,
        resident=resident,
        timeline=tuple(timeline),
        resident_breakdown=MemoryBreakdown(**by_category),
        host_peak=max(host_timeline, default=0),
        host_resident=host_inputs,
    )


def host_storages(nodes: list, storage_of: dict, root: dict) -> set:
    """The storages in host memory under CPU offload (none without it). A copy's output lives on
    its side (`offload_copy`'s `to_host`); a step input copied to the device is the host's (an
    offloaded shard or optimizer tensor); any other operation runs where its tensors are, so it
    and its inputs are the host's when any of its inputs or readers is (`Offload(update="host")`:
    the optimizer, its state and its scalars, reached from the gradients copied to the host)."""
    copies = {n for n in nodes if is_offload_copy(n)}
    if not copies:
        return set()
    host_nodes: set = set()
    changed = True
    while changed:
        changed = False
        for node in nodes:
            if node in host_nodes or node.op == "output":
                continue
            if node in copies:  # its output on its side; `offload_copy_into` writes a host buffer and makes none
                on_host = is_to_host(node) and not copies_into(node)
            else:  # an operation runs where its tensors are: any of its inputs, or any reader's
                feeds_host = any(u in host_nodes and u not in copies for u in node.users)
                reads_host = node.op == "call_function" and any(a in host_nodes for a in node.all_input_nodes)
                copied_out = node.op == "placeholder" and any(u in copies and not is_to_host(u) for u in node.users)
                on_host = feeds_host or reads_host or copied_out
            if on_host:
                host_nodes.add(node)
                changed = True
    return {k for k, n in root.items() if n in host_nodes}


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
