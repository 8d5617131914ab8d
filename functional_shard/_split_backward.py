"""A stage's backward in two halves for zero-bubble schedules: I (the inputs' gradients, now) and
W (the weights' gradients, later), each autograd node's backward run once across the two.

The idea is torch.distributed.pipelining's (`torch/distributed/pipelining/_backward.py`:
`stage_backward_input` / `stage_backward_weight`, after Qi et al., "Zero Bubble Pipeline
Parallelism", 2023), written again for fs's stages. The *input closure* is every node from which
a stage input's gradient node is reached. Walking up from a parameter's `AccumulateGrad`, the
first closure nodes met are its *intermediates*, where its path joins the input path (a matmul:
input side on the path, weight side not). I registers prehooks on them that keep the gradients
reaching them and runs `autograd.grad(roots, inputs, retain_graph=True)`: the engine runs the
closure only, each intermediate computing its input side (the weight-gradient matmuls skipped).
W feeds the kept gradients back in, `autograd.grad(GradientEdge(intermediate, i), GradientEdge(
acc, 0))`: each intermediate computes its weight side, then the weight side of the graph runs.

Beyond torch's: roots that reach a parameter outside the input closure (stage 0, whose inputs
need no gradient; an output made of parameters alone) are kept with their cotangents for W;
parameters that share an intermediate, a weight-side node or such a root form one group (a
union-find: a parameter is never in two); groups run in parameter order (the same on every rank).

The bits are the full backward's. A node's result depends on the gradients reaching it and its
saved tensors, not on which of its outputs are asked for; the engine runs the ready node with the
highest sequence number first, and a node is ready once its needed predecessors ran, so it runs
the nodes it needs in decreasing sequence number: gradients reach every input buffer in the same
order in I and W as in the full backward, and a parameter used several times adds its
contributions in the same order. Where a group has several intermediates, one may lie below
another on the input path: W then recomputes the path between them, and torch's prehook clamp
replaces what reaches the lower one with what I kept (no double counting).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["Split", "backward_input", "backward_weight"]


class _Group:
    """Parameters whose gradients W computes in one `autograd.grad`."""

    def __init__(self, params=(), accs=()):
        self.params: list[int] = list(params)  # indices into the stage's parameter list
        self.accs: list[Node] = list(accs)  # their AccumulateGrad nodes
        self.inters: list[Node] = []  # closure nodes where their paths join the input path
        self.roots: list = []  # roots that reach them outside the input closure (nodes, then indices)


class Split:
    """What I leaves for W (freed by W): per group its intermediates and the gradients that
    reached them in I, the roots and cotangents W starts from where no input path leads."""

    def __init__(self, num_params: int, groups: list[_Group], roots: dict, owners: list):
        self.num_params, self.groups, self._roots, self._owners = num_params, groups, roots, owners
        self.retain = any(len(g.inters) > 1 for g in groups)  # W may run a closure node twice
        self.kept: dict[Node, tuple] = {}  # intermediate -> the gradients that reached it in I
        self.whole: tuple | None = None  # no input path: (roots, cotangents, indices, parameters)

    def kept_bytes(self) -> int:
        """Bytes of the gradients kept for W (distinct storages)."""
        storages = {g.untyped_storage()._cdata: g.untyped_storage().nbytes()
                    for grads in self.kept.values() for g in grads if g is not None}  # fmt: skip
        return sum(storages.values())


def _python_node(node: Node) -> bool:  # a custom Function's node: its Python object does not own it
    return isinstance(node, torch._C._FunctionBase)


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node reached from `roots`, with the nodes that have an edge to it."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is not None:
                if child not in parents:
                    parents[child] = []
                    stack.append(child)
                parents[child].append(node)
    return parents


def _up(start: list[Node], parents: dict) -> set[Node]:
    """`start` and every node above it (toward the roots)."""
    seen, stack = set(start), list(start)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _owners(node: Node, parents: dict, root_index: dict, edges: list) -> list:
    """What keeps a custom Function's node alive once the outputs are dropped: the C++ nodes
    above it, or the root's edge (which holds a token)."""
    out, seen, stack = [], {node}, [node]
    while stack:
        n = stack.pop()
        if n in root_index:
            out.append(edges[root_index[n]])
        for q in parents.get(n, ()):
            if q not in seen:
                seen.add(q)
                (stack.append if _python_node(q) else out.append)(q)
    return out


def _groups(params: list, parents: dict, closure: set, root_index: dict) -> list[_Group]:
    """Each parameter walked up to the closure; a node two walks reach joins their groups."""
    uf: list[int] = []  # union-find over the walks
    walks: list[_Group] = []

    def find(k: int) -> int:
        while uf[k] != k:
            uf[k] = uf[uf[k]]
            k = uf[k]
        return k

    owner: dict[Node, int] = {}  # a weight-side node or an intermediate -> the walk that reached it first
    for j, p in enumerate(params):
        acc = get_gradient_edge(p).node if p.requires_grad else None
        if acc not in parents:  # frozen, or not used by this micro-batch
            continue
        k = len(walks)
        uf.append(k)
        walks.append(walk := _Group([j], [acc]))
        seen, stack = {acc}, [acc]
        while stack:
            node = stack.pop()
            if node in owner:
                uf[find(owner[node])] = find(k)
                continue
            owner[node] = k
            if node in closure:  # an intermediate: the walk stops at the input path
                walk.inters.append(node)
                continue
            if node in root_index:
                walk.roots.append(node)
            for q in parents[node]:
                if q not in seen:
                    seen.add(q)
                    stack.append(q)
    groups: dict[int, _Group] = {}
    for k, walk in enumerate(walks):
        g = groups.setdefault(find(k), _Group())
        g.params, g.accs = g.params + walk.params, g.accs + walk.accs
        g.inters, g.roots = g.inters + walk.inters, g.roots + walk.roots
    for g in groups.values():
        g.inters.sort(key=lambda n: -n._sequence_nr())
        g.roots = sorted(i for n in set(g.roots) for i in root_index[n])
    return sorted(groups.values(), key=lambda g: min(g.params))


def backward_input(roots: list, cotangents: list, inputs: list, params: list) -> tuple[list, Split]:
    """I: the gradients of `inputs` (tensors that require grad) from `roots` seeded with
    `cotangents`, and the `Split` that `backward_weight` finishes for `params` (leaves; those
    that do not require grad get None). The caller drops its references to `roots` afterwards."""
    if not inputs:  # nothing for I to compute: W is the whole backward, from the roots
        split = Split(len(params), [], {}, [])
        split.whole = (list(roots), list(cotangents), [j for j, p in enumerate(params) if p.requires_grad], params)
        return [], split
    edges = [get_gradient_edge(r) for r in roots]
    root_index: dict[Node, list[int]] = {}
    for i, e in enumerate(edges):
        root_index.setdefault(e.node, []).append(i)
    parents = _parents(list(root_index))
    closure = _up([get_gradient_edge(x).node for x in inputs], parents) & parents.keys()
    groups = _groups(params, parents, closure, root_index)
    owners = [o for g in groups for n in g.inters if _python_node(n)
              for o in _owners(n, parents, {r: i[0] for r, i in root_index.items()}, edges)]  # fmt: skip
    split = Split(len(params), groups, {i: (edges[i], cotangents[i]) for g in groups for i in g.roots}, owners)

    def keep(node):
        def hook(grad_outputs):
            split.kept[node] = grad_outputs

        return hook

    handles = [n.register_prehook(keep(n)) for g in groups for n in g.inters]
    try:
        wanted = [i for i, e in enumerate(edges) if e.node in closure]
        got = (None,) * len(inputs)
        if wanted:
            got = torch.autograd.grad([roots[i] for i in wanted], inputs, [cotangents[i] for i in wanted],
                                      retain_graph=bool(handles), allow_unused=True)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    return list(got), split


def backward_weight(split: Split) -> list:
    """W: the parameters' gradients (None where a parameter does not require grad or is not
    reached), one `autograd.grad` per group; frees what `backward_input` kept."""
    out: list = [None] * split.num_params
    if split.whole is not None:
        roots, cotangents, indices, params = split.whole
        split.whole = None
        if roots and indices:
            got = torch.autograd.grad(roots, [params[j] for j in indices], cotangents, allow_unused=True)
            for j, t in zip(indices, got):
                out[j] = t
    while split.groups:
        g = split.groups.pop(0)
        edges, grads = [], []
        for n in g.inters:
            for i, t in enumerate(split.kept.get(n, ())):
                if t is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(t)
        for i in g.roots:
            edge, cotangent = split._roots.pop(i)
            edges.append(edge)
            grads.append(cotangent)
        handles = []
        if len(g.inters) > 1:  # what reaches an intermediate is what I kept, not a second copy
            handles = [n.register_prehook(lambda _, kept=split.kept.get(n): kept) for n in g.inters]
        try:
            if edges:
                retain = split.retain and bool(split.groups)  # a later group may run a closure node again
                got = torch.autograd.grad(edges, [GradientEdge(a, 0) for a in g.accs], grads, retain_graph=retain,
                                          allow_unused=True)  # fmt: skip
                for j, t in zip(g.params, got):
                    out[j] = t
        finally:
            for h in handles:
                h.remove()
        for n in g.inters:
            split.kept.pop(n, None)
    split._owners.clear()
    return out
