"""`early_update`: each unit's optimizer update as soon as its gradient is reduced.

The trace puts the whole update after the whole backward (the reference's order): every unit's
reduced gradient then stays alive until the end of the step, beside the last unit's leaf
gradients and flat buffer — more than plain torch keeps. Where the update runs in place
(`sharded_step(..., donate=True)`), nothing stops a unit's update from running as soon as its
gradient is reduced: it reads its own gradient, its own shards and optimizer state, and shared
scalars. This pass moves it there, past the next collective's issue so that it overlaps that
collective, and each reduced gradient is freed a unit after it is made instead of at the end.
It needs the reduce-scatters waited inside the backward (gloo's one collective in flight, or
`reduce_scatters_in_flight=k`): waited right before the update reads them, they leave nothing
to move.

It moves computation, unlike the other passes, but the same computation: every node keeps its
inputs, and a node that writes a tensor in place (`lerp_`, `addcdiv_`, ...) stays after every
node that read or wrote that tensor before it in the trace (a collective reads its input until
its wait), and every node stays after the nodes that wrote what it reads. So the values, and
the bits, are those of the trace's order. What never moves: collectives and their waits (the
gradient norm's all-reduce stays where it is, so what depends on it — clipping — stays after
it), the forward and backward (everything a reduce-scatter reads), and any node whose result
(other than a scalar: the step count, a unit's squared norm) would then live longer (with an
out-of-place update the new state is allocated, not written in place: moving it early would
keep it alive through the backward, so that update stays at the end).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from ._context import Pass, PassContext
from ._graph import ISSUE_OPS, WAIT_OP, _is_building_copy, _is_view, _schema, ancestors, copy_graph, positions, pre_collective_cast
from ._offload import copies_into, offload_copies
from ._remat import written_inputs


@dataclasses.dataclass(frozen=True)
class early_update(Pass):
    """Run each unit's part of the optimizer update as soon as its gradient is reduced (see the
    module docstring): the same computation, the same bits, each reduced gradient freed early,
    and the update's compute overlapping the next collective instead of following the
    backward. A no-op where the update is out of place (no `donate=True`), needs every
    gradient first (clipping by the global norm, loss scaling), or runs on the device for a
    CPU-offloaded state (`offload_copy_into`: the state would come to the device during the backward).

    Arguments:
        units: move the updates of only the first `units` units whose gradients are reduced
            (the last layers: the backward runs the model backwards); None: every unit's.
        guided: on a world of one rank, where there is no collective for an update to overlap
            and the move's one gain is memory, move the fewest units (first ones first) that
            bring the predicted peak as low as moving every unit does. An update run inside the
            backward costs time there (its passes over the optimizer state evict the backward's
            operands from the caches: 3 % at batch 1 on the benchmark GPT with every unit
            moved); the benchmark GPT needs 3 of its 10 units for the same peak.
    """

    units: int | None = None
    guided: bool = True

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        if any(copies_into(n) for n in offload_copies(gm)):
            # CPU offload's device update writing back into the donated host state: moved into
            # the backward, each unit's state would come to the device while the backward's
            # activations are alive (the gradients are on the host already: nothing to free).
            return gm
        plan = _plan(gm, context, self.units)
        if plan is None:
            return gm
        if self.guided and self.units is None and context.world_size == 1:
            return _fewest_units(self, gm, context)
        nodes, floor, same, constraints, movable = plan
        followers = _followers(nodes, constraints, movable, same)
        placed_after: dict[fx.Node, fx.Node] = {}
        for node in nodes:
            if node not in movable or node in followers:
                continue
            position = positions(gm)
            anchors = [a for a in constraints[node] if a not in followers] + [floor]
            anchor = _past_next_issue(max(anchors, key=position.__getitem__))
            after = placed_after.get(anchor, anchor)
            if position[after] < position[node]:
                after.append(node)
                placed_after[anchor] = node
            _pull_followers(gm, node, followers)
        _sink_temporaries(gm, movable, same)
        gm.graph.lint()
        return gm


def _plan(gm: fx.GraphModule, context: PassContext, units: int | None):
    """(nodes, the forward's end, `_identity_storages`, `_ordering`, the movable nodes) of
    `gm`, or None where nothing moves."""
    nodes = list(gm.graph.nodes)
    marks = [n for n in nodes if n.meta.get("fs_forward_end")]
    if not marks:
        return None
    floor = marks[-1]
    same = _identity_storages(nodes) if context.world_size == 1 else {}
    constraints = _ordering(nodes, same)
    movable = _movable(nodes, positions(gm)[floor], constraints, _first_units(nodes, units))
    return (nodes, floor, same, constraints, movable) if movable else None


def _fewest_units(update: early_update, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
    """`gm` with the updates of the fewest first units moved that give the predicted peak of
    moving every unit's (`early_update.guided`), the peak read from the graph as the step will
    run it on one rank (collectives dropped, `drop_collectives`), found by bisection over the
    number of units. Whatever count it returns has that peak (every unit's, if no fewer has)."""
    from ._liveness import memory_timeline
    from ._lower import drop_collectives

    def peak(count: int | None) -> int:
        candidate = _Unbuilt(copy_graph(gm))
        dataclasses.replace(update, units=count, guided=False)(candidate, context)
        drop_collectives(candidate)
        return max(memory_timeline(candidate), default=0)

    floor = peak(None)
    high = sum(1 for n in gm.graph.nodes if ISSUE_OPS.get(n.target) == "reduce_scatter")
    if peak(0) <= floor:  # the usual case where the backward's start is the peak: nothing moves
        high = 0
    low = min(1, high)
    while low < high:  # the smallest count whose peak is the floor (or one, if not monotonic)
        middle = (low + high) // 2
        if peak(middle) <= floor:
            high = middle
        else:
            low = middle + 1
    return dataclasses.replace(update, units=high, guided=False)(gm, context)


class _Unbuilt:
    """A graph with the surface of `fx.GraphModule` that the pass, `drop_collectives` and
    `memory_timeline` use, and no Python generated for it: a GraphModule generates and compiles
    its code whenever it is built or changed (0.15 s for the benchmark GPT's graph), and the
    bisection only reads each candidate's memory."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph

    def recompile(self) -> None:
        pass


def _pull_followers(gm, node: fx.Node, followers: set[fx.Node]) -> None:
    """Put the followers `node` reads (and theirs) right before it where they come later."""
    for follower in (a for a in node.all_input_nodes if a in followers):
        position = positions(gm)
        if position[follower] > position[node]:
            node.prepend(follower)
            _pull_followers(gm, follower, followers)


def _sink_temporaries(gm: fx.GraphModule, movable: set[fx.Node], same: dict) -> None:
    """Move each large temporary of the update (AdamW's `lr * m`) to right before its first
    reader, where nothing between writes what it reads: fewer of them alive at once."""
    for node in [n for n in gm.graph.nodes if n in movable]:
        if not _allocates(node) or not node.users:
            continue
        position = positions(gm)
        first = min(node.users, key=position.__getitem__)
        reads = _storages_of(node.all_input_nodes, same)
        between = list(gm.graph.nodes)[position[node] + 1 : position[first]]
        if any(reads & _storages_of(written_inputs(b), same) for b in between):
            continue
        if any(b.op != "call_function" or b.target in ISSUE_OPS or b.target is WAIT_OP for b in between):
            continue
        first.prepend(node)


def _first_units(nodes: list[fx.Node], count: int | None):
    """A predicate on nodes: whether a node reads (through any chain of nodes) only the reduced
    gradients of the first `count` reduce-scatters in graph order — the units whose backward
    ends first — or none; every node when `count` is None."""
    if count is None:
        return lambda node: True
    issues = [n for n in nodes if ISSUE_OPS.get(n.target) == "reduce_scatter"]
    allowed, every = set(issues[:count]), set(issues)
    reduced: dict[fx.Node, frozenset] = {}
    for node in nodes:
        own = frozenset((node,)) if node in every else frozenset()
        reduced[node] = own.union(*(reduced[a] for a in node.all_input_nodes))
    return lambda node: reduced[node] <= allowed


def _movable(nodes: list[fx.Node], floor: int, constraints: dict, allowed=lambda node: True) -> set[fx.Node]:
    """The update's nodes that may move earlier: after the (last) forward, no ancestor of a
    reduce-scatter, no collective, an aten op or getitem, `allowed`, and no new tensor (other
    than a scalar) that would then be alive past the place it was made at — where a reader of
    it cannot move as early (it waits for a new tensor of the out-of-place update), it stays."""
    gradient = ancestors(n for n in nodes if ISSUE_OPS.get(n.target) == "reduce_scatter")
    movable = {
        n for i, n in enumerate(nodes)
        if i > floor and n.op == "call_function" and n not in gradient and n.target not in ISSUE_OPS
        and n.target is not WAIT_OP and (n.target is operator.getitem or _schema(n) is not None) and allowed(n)
    }
    index = {n: i for i, n in enumerate(nodes)}
    readers = {n: _readers_of_result(n) for n in movable if _allocates(n)}
    while True:
        # Where each node would land: right after the last of what it must follow.
        landing: dict[fx.Node, float] = {}
        for n in nodes:
            follow = [landing[a] for a in constraints[n]]
            landing[n] = max(follow + [float(floor)]) + 1e-6 if n in movable else float(index[n])
        stay = {n for n, rs in readers.items() if n in movable and max((landing[r] for r in rs), default=0.0) > index[n]}
        if not stay:
            return movable
        movable -= stay


def _readers_of_result(node: fx.Node) -> set[fx.Node]:
    """Every node that reads `node`'s storage: through views of it and through the results of
    in-place ops on it (`clone` then `mul_` is how an out-of-place update starts)."""
    found, frontier = set(), [node]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            if user not in found:
                found.add(user)
                if _is_view(user) or current in written_inputs(user):
                    frontier.append(user)
    return {n for n in found if not _is_view(n)}


def _allocates(node: fx.Node) -> bool:
    """Whether `node`'s result is a new tensor of more than one element (not a scalar, not a
    view or an in-place result, which alias an input)."""
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.numel() > 1 and not _is_view(node) and not written_inputs(node)


def _followers(nodes: list[fx.Node], constraints: dict, movable: set[fx.Node], same: dict) -> set[fx.Node]:
    """The movable nodes made from the step's inputs alone (`zeros`, the learning rate cast to
    the state's dtype, a view of a shard): each follows its first reader rather than moving to
    the top of the graph, where it would be alive through the backward. Following its reader
    may move it later, so one that computes must read nothing the step writes in place."""
    written = _storages_of((w for node in nodes for w in written_inputs(node)), same)
    followers: set[fx.Node] = set()
    for node in nodes:
        if node in movable and all(a.op == "placeholder" or a in followers for a in constraints[node]):
            if _is_view(node) or not _storages_of(node.all_input_nodes, same) & written:
                followers.add(node)
    return followers


def _storages(node: fx.Node, same: dict | None = None) -> set:
    """The storages of `node`'s result (`same` maps a storage to the ones it will be)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    found = {StorageWeakRef(v.untyped_storage()) for v in values if isinstance(v, torch.Tensor)}
    return {t for s in found for t in (same or {}).get(s, {s})}


def _storages_of(nodes, same: dict) -> set:
    """The storages of all `nodes`' results."""
    return set().union(*(_storages(n, same) for n in nodes))


def _identity_storages(nodes: list[fx.Node]) -> dict:
    """For a world of one rank, where the step drops every collective after the passes
    (`drop_collectives`): each collective's result storage -> its input's storages. The
    backward then reads a unit's parameter shard where the graph shows a gathered copy, so a
    read of the result is a read of the input. A mixed-precision gather's input is a cast of
    the shard (`pre_collective_cast`) that `drop_collectives` moves to right before the
    gathered copy's first reader: a read of the result is then a read of the shard too (else an
    update moved early could write the shard before the cast reads it)."""
    same: dict = {}
    for node in nodes:
        if node.target is WAIT_OP and isinstance(node.args[0], fx.Node) and node.args[0].args:
            issue = node.args[0]
            source = issue.args[0]
            if isinstance(source, fx.Node):
                storages = _storages(source, same)
                cast = pre_collective_cast(issue)
                if cast is not None:
                    storages = storages | _storages_of(cast.all_input_nodes, same)
                for s in _storages(node):
                    same[s] = storages
    return same


def _ordering(nodes: list[fx.Node], same: dict) -> dict[fx.Node, list[fx.Node]]:
    """Per node, the nodes it must follow: its inputs, the last earlier writer of each storage
    it reads or writes, and, for a writer, every earlier reader of what it writes (a collective
    reads its input until its wait). `same`: storages that will be others (`_identity_storages`)."""
    last_writer: dict = {}
    readers_since: dict = {}
    must_follow: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        reads = _storages_of(node.all_input_nodes, same)
        if node.target is WAIT_OP and isinstance(node.args[0], fx.Node):
            reads |= _storages_of(node.args[0].all_input_nodes, same)
        writes = _storages_of(written_inputs(node), same)
        follow = list(node.all_input_nodes)
        follow += [last_writer[s] for s in reads | writes if s in last_writer]
        for s in writes:
            follow += readers_since.get(s, [])
        must_follow[node] = follow
        for s in reads:
            readers_since.setdefault(s, []).append(node)
        for s in writes:
            last_writer[s] = node
            readers_since[s] = []
    return must_follow


def _past_next_issue(anchor: fx.Node) -> fx.Node:
    """`anchor`, or the next collective's issue when only the copies building its buffer (and
    the previous collective's wait) come between: placed after it, the update overlaps it."""
    node = anchor.next
    while node.op == "call_function" and (node.target is WAIT_OP or _is_building_copy(node)):
        node = node.next
    return node if node.target in ISSUE_OPS else anchor

