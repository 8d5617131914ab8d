"""What `torch.compile` (inductor) makes of a traced step, as the analysis prices it.

A step run with `Schedule(compile=True)` hands its scheduled graph to inductor, which fuses the
memory-bound operations between two kernels it does not generate (matrix products, fused
attention, collectives) into one kernel each: the chain reads its inputs once and writes only
what is read after it, and the tensors in between never exist. `fuse(gm, costs)` models that:

- a node is *fusable* when its kernel is memory bound (elementwise, transcendental, select,
  reduction, normalization, copy; views pass through): not a product, attention, collective,
  wait, CPU offload copy or allocation;
- fusable nodes joined by an edge form one kernel when no non-fusable call runs between them
  in the step's order (each node's *epoch* counts the non-fusable calls before it; only
  fusable neighbours of one epoch join). A kernel is then one stretch of the step: convex (a
  path that left it and came back would cross a non-fusable node, which lies between two of
  its nodes in the order), and never spanning the forward and the backward (inductor compiles
  them as two graphs: a forward value a recomputation reads stays allocated until then);
- a kernel reads each tensor from outside it once (the largest read of each storage) and
  writes the outputs that something outside it reads, the graph returns, or an in-place
  operation writes; its cost is one memory-bound call of those bytes, carried by its last node;
- its other outputs are never allocated (`FusedGraph.unmaterialized`, what `estimate_memory`
  leaves out of the peak).

What inductor does that this does not model: its partitioner's choice of what a compiled
backward recomputes (the graph's own remat policy stays as scheduled), fusing reductions of
different shapes into one kernel or splitting one (a kernel here may hold a row reduction and a
column reduction that inductor runs as two), the templates it may choose for products, and the
host overhead it removes (each call here still costs what the machine's curves say).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import fx

from ..schedule._remat import written_inputs
from ._costs import _UNANNOTATED_VIEWS, COLLECTIVE_OPS, NodeCost, is_view, node_cost, tensors_of
from ._regions import node_roles

__all__ = ["FusedGraph", "block_nodes", "compiled_intermediates", "fuse", "runs_compiled"]

# Kernel classes (`op_class`) inductor generates itself, and so fuses.
_FUSABLE_KINDS = frozenset(("elementwise", "transcendental", "select", "reduction", "normalization", "copy", "view"))


class FusedGraph(NamedTuple):
    """A step's graph as inductor would run it (`fuse`)."""

    kernels: tuple  # tuple of tuples of nodes (graph order): each fused kernel of two or more nodes
    costs: dict  # node -> NodeCost: every node of `costs` not in a kernel, and each kernel's cost on its last node
    unmaterialized: frozenset  # nodes whose outputs a fused kernel never writes to memory


def runs_compiled(gm: fx.GraphModule) -> bool:
    """Whether the step of `gm` runs under `torch.compile` (`Schedule(compile=True)`)."""
    return bool(gm.meta.get("inductor", False))


def block_nodes(gm: fx.GraphModule, roles=None) -> frozenset:
    """The nodes of the step's blocks (units other than `input` and `output`: forward, backward
    and their recomputation), what compiling each block alone compiles (torchtitan's
    `apply_compile`: every TransformerBlock; the embedding, the output layer, the loss and the
    optimizer stay eager)."""
    unit = (roles or node_roles(gm)).unit
    return frozenset(n for n in gm.graph.nodes if unit.get(n, "") not in ("", "input", "output"))


def compiled_intermediates(gm: fx.GraphModule) -> frozenset:
    """The nodes whose outputs `torch.compile` never allocates in the step of `gm` (none when
    it does not run compiled): what the memory model leaves out."""
    if not runs_compiled(gm):
        return frozenset()
    costs = {n: node_cost(n) for n in gm.graph.nodes if n.op == "call_function" and n.target not in COLLECTIVE_OPS}
    return fuse(gm, costs).unmaterialized


def _fusable(node: fx.Node, cost: NodeCost | None) -> bool:
    if node.op != "call_function" or node.target in COLLECTIVE_OPS or cost is None:
        return False
    if cost.flops or cost.attention or cost.kind not in _FUSABLE_KINDS:
        return False
    if cost.kind == "view":  # a view passes through a kernel; an allocation or a release is not one
        return is_view(node) or node.target in _UNANNOTATED_VIEWS
    return True


def _nbytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(node.meta.get("val")))


def fuse(gm: fx.GraphModule, costs: dict, only=None) -> FusedGraph:
    """Group the memory-bound nodes of `gm` into the kernels inductor would make (module
    docstring). `costs`: node -> `NodeCost` (`analysis._costs.node_cost`) of its computing nodes;
    `only`: the nodes that are compiled (default: all; `block_nodes` for torchtitan's per-block
    compile), the others run as they are."""
    nodes = list(gm.graph.nodes)
    fusable = {n for n in nodes if _fusable(n, costs.get(n)) and (only is None or n in only)}
    epoch: dict = {}  # node -> the non-fusable calls before it in the graph's order
    count = 0
    for n in nodes:
        epoch[n] = count
        count += n.op == "call_function" and n not in fusable
    parent = {n: n for n in fusable}

    def find(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in fusable:
        for i in n.all_input_nodes:
            if i in fusable and epoch[i] == epoch[n]:
                a, b = find(i), find(n)
                if a is not b:
                    parent[b] = a
    members: dict = {}
    for n in nodes:  # graph order
        if n in fusable:
            members.setdefault(find(n), []).append(n)
    kernels = tuple(tuple(group) for group in members.values() if sum(costs[n].kind != "view" for n in group) >= 2)
    fused_costs = dict(costs)
    unmaterialized: set = set()
    for kernel in kernels:
        cost, internal = _kernel_cost(kernel, costs)
        for n in kernel:
            fused_costs.pop(n, None)
        fused_costs[kernel[-1]] = cost
        unmaterialized |= internal
    return FusedGraph(kernels, fused_costs, frozenset(unmaterialized))


def _kernel_cost(kernel: tuple, costs: dict) -> tuple[NodeCost, set]:
    """The cost of one fused kernel, and the nodes whose outputs it never writes."""
    inside = set(kernel)
    base: dict = {}  # a view inside the kernel -> the node (inside or out) whose storage it reads

    def root(n: fx.Node) -> fx.Node:
        return base.get(n, n)

    reads: dict = {}  # node outside the kernel -> the most bytes of it read
    written, internal = 0, set()
    for n in kernel:
        cost = costs[n]
        if cost.kind == "view":
            inputs = [i for i in n.all_input_nodes if tensors_of(i.meta.get("val"))]
            if inputs:
                base[n] = root(inputs[0])
            continue
        for i in n.all_input_nodes:
            r = root(i)
            if r not in inside and tensors_of(i.meta.get("val")):
                reads[r] = max(reads.get(r, 0), _nbytes(i))
        outside = any(u not in inside or u.op == "output" for u in _readers(n, inside))
        if outside or written_inputs(n):
            written += _nbytes(n)
        else:
            internal.add(n)
    numel = max((costs[n].numel for n in kernel), default=0)
    ops = sum(costs[n].ops for n in kernel)
    dtype = next((costs[n].dtype for n in reversed(kernel) if costs[n].dtype), "")
    return NodeCost(0, sum(reads.values()) + written, False, numel, "fused", ops, dtype), internal


def _readers(node: fx.Node, inside: set) -> list:
    """The nodes that read `node`'s output, through the views of it inside the kernel."""
    found, stack = [], list(node.users)
    while stack:
        u = stack.pop()
        if u in inside and is_view(u):
            stack.extend(u.users)
        else:
            found.append(u)
    return found
