"""Where each node of a scheduled step belongs: its phase (forward, backward, update) and its unit.

A traced step is one flat graph; the schedule's labels sit on the collectives only. The rest
is read from the graph's structure, with the public tools of `fs.schedule`:

- phase: nodes up to the node marked as the end of the forward pass (`meta["fs_forward_end"]`)
  are forward; after it, nodes that read the result of a parameter buffer's reduce-scatter or
  of the update's all-reduces (the loss's, the grad norm's), directly or through other nodes,
  are the update (the optimizer reads the reduced gradients; the backward never does); the
  rest is backward. A tensor-parallel collective of activations (no buffer) is part of the
  forward or backward it sits in (`reduces_for_update`).
- unit: a unit's *region* in a phase runs from the first to the last node that reads its
  gathered parameters there (through any view). A node takes the unit of the innermost
  region that contains it (a model whose first unit is also read at the end, as GPT's tied
  embedding and head, holds the other units' regions nested inside its own). Update nodes
  take the unit of the reduce-scatter they descend from. Other nodes have unit "".
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import fx

from .. import schedule as schedule_lib
from ..schedule._graph import ancestors
from ._costs import is_view

__all__ = ["Region", "NodeRoles", "node_roles", "gradient_sources", "reduces_for_update", "GRADIENT_PLUMBING"]

PHASES = ("forward", "backward", "update")
_LOCAL_SUM = (torch.ops.aten.view.default, torch.ops.aten.sum.dim_IntList)


class Region(NamedTuple):
    """The span of graph positions in which one unit computes, in one phase."""

    unit: str  # the unit whose gathered parameters are read in it
    phase: str  # "forward" or "backward"
    start: int  # position of the first node reading the unit's parameters in this phase
    end: int  # position of the last one (inclusive)


class NodeRoles(NamedTuple):
    """Phase and unit of every node of a graph, and the unit regions they came from."""

    phase: dict  # fx.Node -> "forward" | "backward" | "update" ("input" for placeholders, "output")
    unit: dict  # fx.Node -> unit name, or "" for nodes outside every region
    regions: tuple  # Region per (unit, phase), sorted by start (outer regions before inner ones)
    position: dict  # fx.Node -> index in the graph


# Nodes between a unit's leaf gradients and the flat buffer its reduce-scatter sends.
GRADIENT_PLUMBING = (torch.ops.aten.cat.default, torch.ops.aten.clone.default, torch.ops.aten.zeros.default, torch.ops.aten.constant_pad_nd.default)


def gradient_sources(issue: fx.Node) -> list[fx.Node]:
    """The nodes a reduce-scatter's flat gradient is made of: the flattening (`cat`, views,
    padding) and the nodes computing the leaf gradients it concatenates, graph order."""
    found: dict[fx.Node, None] = {}
    frontier = list(issue.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in found or node.op != "call_function":
            continue
        found[node] = None
        # Through `add` too: a parameter used twice (tied weights) has its leaf gradient summed.
        if is_view(node) or node.target in GRADIENT_PLUMBING or node.target is torch.ops.aten.add.Tensor:
            frontier.extend(node.all_input_nodes)
    return list(found)


def reduces_for_update(c) -> bool:
    """Whether the optimizer reads collective `c`'s result: a reduce-scatter of a parameter
    buffer's gradient, or an all-reduce of the update phase (the loss, the grad norm). Not the
    collectives of activations inside the forward and backward (tensor parallelism's
    all-reduces and reduce-scatters, which move no buffer) nor the sum of a `WeightedLoss`'s
    weights between the forward and the backward (it seeds the backward): what reads those is
    still the forward or the backward."""
    return (c.kind == "reduce_scatter" and bool(c.buffer)) or (c.kind == "all_reduce" and c.phase == "update")


def _forward_end(gm: fx.GraphModule, position: dict) -> int:
    marked = [position[n] for n in gm.graph.nodes if n.meta.get("fs_forward_end")]
    if not marked:
        raise ValueError(
            "the graph has no node marked as the end of the forward pass (meta 'fs_forward_end'): analyze the "
            "graph_module of a CompiledStep from step.lower(state, batch), not a graph traced some other way"
        )
    return marked[0]


def node_roles(gm: fx.GraphModule) -> NodeRoles:
    """Phase and unit of every node of the scheduled step `gm` (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    forward_end = _forward_end(gm, position)
    collectives = schedule_lib.collectives(gm)

    # Update: everything downstream of a reduced gradient (or the reduced loss).
    update_root_unit: dict[fx.Node, str] = {}
    local_sum: dict[fx.Node, str] = {}
    for c in collectives:
        if reduces_for_update(c):
            root = c.wait
            # On gloo a reduce-scatter ends with a local sum of the received slices (view, sum):
            # part of the collective's work in the backward, not of the optimizer.
            while len(root.users) == 1 and next(iter(root.users)).target in _LOCAL_SUM:
                root = next(iter(root.users))
                local_sum[root] = c.unit
            update_root_unit[root] = c.unit
    unit: dict[fx.Node, str] = {}
    phase: dict[fx.Node, str] = {}
    update_unit: dict[fx.Node, str] = {}
    for node in nodes:
        if node in update_root_unit:
            update_unit[node] = update_root_unit[node]
            continue
        parents = [update_unit[a] for a in node.all_input_nodes if a in update_unit]
        if parents and node.op != "output":
            named = [p for p in parents if p]
            update_unit[node] = named[0] if len(set(named)) == 1 else ""
    # Nodes after the forward that no reduce-scatter depends on and that run once the update
    # has begun (the loss's sum over micro-batches, constants of the update) belong to it.
    gradient_ancestors = ancestors(c.issue for c in collectives if c.kind == "reduce_scatter")
    update_start = min((position[n] for n in update_root_unit), default=len(nodes))
    for node in nodes:
        i = position[node]
        if node.op == "placeholder":
            phase[node] = "input"
        elif node.op == "output":
            phase[node] = "output"
        elif node in local_sum:
            phase[node] = "backward"
        elif i <= forward_end:
            phase[node] = "forward"
        elif node in update_unit and node not in update_root_unit:
            phase[node] = "update"
        elif i > update_start and node not in gradient_ancestors:
            phase[node] = "update"
        else:
            phase[node] = "backward"

    # Regions: the first and last reader of each unit's gathered parameters, per phase.
    spans: dict[tuple[str, str], list[int]] = {}
    for c in collectives:
        if c.kind != "all_gather":
            continue
        for _, member_unit, root, _ in c.members():
            for reader in schedule_lib.uses(root):
                reader_phase = phase.get(reader)
                if reader_phase not in ("forward", "backward"):
                    continue
                span = spans.setdefault((member_unit, reader_phase), [position[reader], position[reader]])
                span[0] = min(span[0], position[reader])
                span[1] = max(span[1], position[reader])
    # A unit's backward also computes its parameters' gradients, which need not read its
    # parameters (dW = x^T dy): its region reaches the nodes producing the leaf gradients.
    for c in collectives:
        if c.kind != "reduce_scatter" or not c.unit:
            continue
        for producer in gradient_sources(c.issue):
            if phase.get(producer) == "backward":
                span = spans.setdefault((c.unit, "backward"), [position[producer], position[producer]])
                span[0] = min(span[0], position[producer])
                span[1] = max(span[1], position[producer])
    regions = sorted(
        (Region(u, p, s, e) for (u, p), (s, e) in spans.items()), key=lambda r: (r.start, -r.end)
    )
    for node in nodes:
        i = position[node]
        if node in local_sum:
            unit[node] = local_sum[node]
            continue
        if phase[node] == "update":
            unit[node] = update_unit.get(node, "")
            continue
        inner = ""
        width = None
        for r in regions:
            if r.phase == phase[node] and r.start <= i <= r.end and (width is None or r.end - r.start < width):
                inner, width = r.unit, r.end - r.start
        unit[node] = inner
    # An update step that does not read the reduced gradient (AdamW's decay of the parameter
    # and of its second moment) belongs to the unit whose update consumes its result.
    for node in reversed(nodes):
        if phase[node] == "update" and not unit[node]:
            owners = {unit[u] for u in node.users if phase.get(u) == "update" and unit.get(u)}
            if len(owners) == 1:
                unit[node] = owners.pop()
    return NodeRoles(phase, unit, tuple(regions), position)
