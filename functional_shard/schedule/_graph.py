"""Graph tools: what the tracer knows about each collective, and how passes find and move nodes.

The tracer tags every collective's issue node with one typed record (`CollectiveTag`, under
one `node.meta` key) and marks the node that ends the forward pass (`mark_forward_end`). A pass
reads them back with `collectives(gm)` and `forward_end(gm)`; a pass that creates a collective
(a copy for the backward, a bucket) tags it with a record derived from the ones it replaces.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Iterable, NamedTuple

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor


_C10D = torch.ops._c10d_functional
ISSUE_OPS = {
    _C10D.all_gather_into_tensor.default: "all_gather",
    # A cast gathered in place (`gather_casts_in_place`): its output is the `out` it was given.
    _C10D.all_gather_into_tensor_out.default: "all_gather",
    _C10D.reduce_scatter_tensor.default: "reduce_scatter",
    # On gloo a reduce-scatter is an all-to-all and a local sum (see Mesh.reduce_scatter_flat).
    _C10D.all_to_all_single.default: "reduce_scatter",
    _C10D.all_reduce.default: "all_reduce",
}
WAIT_OP = _C10D.wait_tensor.default

# The two `node.meta` keys this library writes: a collective's record, the forward's last node.
_TAG_KEY = "fs_collective"
_FORWARD_END_KEY = "fs_forward_end"


class Member(NamedTuple):
    """One buffer a collective moves (a bucket moves several)."""

    buffer: str  # the flat buffer's name
    unit: str  # the unit it belongs to
    root: fx.Node  # the node its full value is read from (its views start there)
    nbytes: int  # bytes of the full (unsharded, padded) buffer


@dataclasses.dataclass(frozen=True)
class CollectiveTag:
    """What the tracer knows about one collective, stored on its issue node (`tag`, `tag_of`).

    Attributes:
        kind: "all_gather", "reduce_scatter" or "all_reduce".
        buffer / unit: the flat buffer it moves and that buffer's unit ("" for collectives that
            move no parameter buffer, e.g. the loss all-reduce); a bucket joins its members'
            names with "+".
        phase: "forward" or "backward" for gathers (the pass they feed), "backward" for
            reduce-scatters, "update" for the loss all-reduce.
        nbytes: bytes of the full (unsharded, padded) buffer: the all-gather's output, the
            reduce-scatter's input; a bucket's sum of its members'.
        members: for a bucket, each buffer it moves (`Member`s); empty otherwise.
    """

    kind: str
    buffer: str
    unit: str
    phase: str
    nbytes: int
    members: tuple[Member, ...] = ()

    @classmethod
    def for_node(cls, node: fx.Node, *, buffer: str = "", unit: str = "", phase: str = "update") -> "CollectiveTag":
        """The record of the collective issued by `node`, its kind and bytes read off the node."""
        kind = ISSUE_OPS[node.target]
        value = (node if kind == "all_gather" else node.args[0]).meta.get("val")
        nbytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        return cls(kind=kind, buffer=buffer, unit=unit, phase=phase, nbytes=nbytes)


def tag(node: fx.Node, record: CollectiveTag) -> None:
    """Store `record` on the collective issue `node` (replacing any record it had)."""
    node.meta[_TAG_KEY] = record


def tag_of(node: fx.Node) -> CollectiveTag | None:
    """The record stored on `node` by `tag`, or None."""
    return node.meta.get(_TAG_KEY)


def mark_forward_end(node: fx.Node) -> None:
    """Mark `node` (the local loss) as the last node of the forward pass."""
    node.meta[_FORWARD_END_KEY] = True


def forward_end(gm: fx.GraphModule, after: fx.Node | None = None) -> fx.Node:
    """The first node `mark_forward_end` marked (after `after`, when given): what runs after it
    is a backward. A step with micro-batches has one mark per micro-batch (each micro-batch's
    loss), so the forward a collective feeds ends at the first mark after it."""
    seen = after is None
    for node in gm.graph.nodes:
        if node is after:
            seen = True
        elif seen and node.meta.get(_FORWARD_END_KEY):
            return node
    raise RuntimeError("the graph has no node marked as the end of the forward pass (fs.schedule.mark_forward_end)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective of a traced graph: its issue and wait nodes and its record.

    Attributes:
        issue: the node that starts it (`_c10d_functional.<kind>`).
        wait: the `wait_tensor` node that waits for it.
        tag: its `CollectiveTag` (from the tracer or the pass that made it; for an untagged
            node, one read off the node with phase "update" and no buffer).
    kind, buffer, unit, phase and nbytes read the tag.
    """

    issue: fx.Node
    wait: fx.Node
    tag: CollectiveTag

    kind = property(lambda self: self.tag.kind)
    buffer = property(lambda self: self.tag.buffer)
    unit = property(lambda self: self.tag.unit)
    phase = property(lambda self: self.tag.phase)
    nbytes = property(lambda self: self.tag.nbytes)

    def members(self) -> tuple[Member, ...]:
        """Each buffer it moves: one, or several for a bucket (`bucket_gathers`)."""
        return self.tag.members or (Member(self.buffer, self.unit, self.wait, self.nbytes),)


def parameter_collectives(gm: fx.GraphModule) -> list[Collective]:
    """The collectives of `gm` that move a parameter buffer (FSDP's all-gathers and
    reduce-scatters, tagged with their buffer), in graph order: what the schedule's passes move.
    The others (a tensor-parallel all-reduce or gather of activations, the loss's all-reduce)
    stay where the computation put them."""
    return [c for c in collectives(gm) if c.buffer]


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """Every collective of `gm`, in the graph order of their issue nodes."""
    out = []
    for node in gm.graph.nodes:
        if node.target not in ISSUE_OPS:
            continue
        waits = [u for u in node.users if u.target is WAIT_OP]
        if len(waits) != 1:
            raise RuntimeError(f"collective {node.name} must have exactly one wait_tensor user; has {len(waits)}")
        out.append(Collective(node, waits[0], tag_of(node) or CollectiveTag.for_node(node)))
    return out


def fill_values(gm: fx.GraphModule) -> None:
    """Give every computing node that a pass created without one a `meta["val"]` (the fake
    tensor tracing gives every node), computed in graph order from its inputs' values under
    their fake mode. The analyses read shapes, bytes and storages from it: a bucket's
    gathered buffer or its members' copies without one would count for nothing. Only torch
    operators (and `getitem`) are run, never a Python function a pass inserted (it may have
    effects); a node whose value cannot be computed keeps none."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue
        if not isinstance(node.target, torch._ops.OpOverload) and node.target is not operator.getitem:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        mode = next((v.fake_mode for v in _tensors((args, kwargs)) if isinstance(v, FakeTensor)), None)
        if mode is None:
            continue
        try:
            with mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001, S112 - a value the analyses go without, as before
            continue


def _tensors(tree) -> list:
    found: list = []
    fx.node.map_aggregate(tree, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


def copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of `gm`'s graph (the nodes' fake values shared, not copied: passes replace meta
    entries, never mutate them)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Each node's index in the graph."""
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _schema(node: fx.Node):
    """The schema of the op a node calls; None for placeholders, Python functions, getitem."""
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _is_view(node: fx.Node) -> bool:
    """Its output aliases an input without writing it (view, t, split, getitem of a split)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def aliases(wait: fx.Node) -> list[fx.Node]:
    """`wait` and every node that views its output (split, getitem, view, t, ...), graph order."""
    found = {wait}
    frontier = [wait]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in found and _is_view(user):
                found.add(user)
                frontier.append(user)
    return [n for n in wait.graph.nodes if n in found]


def uses(wait: fx.Node) -> list[fx.Node]:
    """The nodes that read a gathered buffer through any of its aliases (not views), graph order."""
    alias_set = set(aliases(wait))
    readers = {u for a in alias_set for u in a.users if u not in alias_set}
    return [n for n in wait.graph.nodes if n in readers]


def move_before(nodes: Iterable[fx.Node], anchor: fx.Node) -> None:
    """Move `nodes` (in the order given) so that they sit right before `anchor`."""
    for node in nodes:
        if node is not anchor:
            anchor.prepend(node)


def _is_pure(node: fx.Node) -> bool:
    """A call that writes none of its inputs and is no collective: moving it changes no value."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    return schema is not None and not schema.is_mutable and node.target not in ISSUE_OPS and node.target is not WAIT_OP


def ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """`roots` and every node they read, directly or not."""
    found: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in found:
            found.add(node)
            stack.extend(node.all_input_nodes)
    return found


_CHEAP = {torch.ops.aten.cat.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default}


def _is_cheap(node: fx.Node) -> bool:
    """Views, concatenations and constants: moving them moves no computation."""
    return _is_pure(node) and (_is_view(node) or node.target in _CHEAP or not node.all_input_nodes)


def pre_collective_cast(issue: fx.Node) -> fx.Node | None:
    """The dtype cast a collective moves, when its input is one (mixed precision casts a
    shard to the gather dtype before the all-gather; CPU offload copies the shard to the device,
    `_is_copy_to_device`) made from the step's inputs alone: it can be recomputed anywhere, and
    read by this collective only it should sit right before it."""
    source = issue.args[0] if issue.args else None
    if (
        isinstance(source, fx.Node)
        and (source.target is torch.ops.aten._to_copy.default or _is_copy_to_device(source))
        and all(i.op == "placeholder" for i in source.all_input_nodes)
    ):
        return source
    return None


def offload_copy_ops() -> tuple:
    """The CPU-offload copy operators (`functional_shard::offload_copy`, `offload_copy_into`;
    `functional_shard/_offload.py`), those of them registered."""
    ns = getattr(torch.ops, "functional_shard", None)
    return tuple(getattr(ns, name).default for name in ("offload_copy", "offload_copy_into") if hasattr(ns, name))


def _is_copy_to_device(node: fx.Node) -> bool:
    """A CPU-offloaded shard's copy to the device (in its gather dtype: the cast and the copy
    in one `functional_shard::offload_copy` node), which moves with its all-gather as a cast does."""
    return node.target in offload_copy_ops() and len(node.args) > 2 and not node.args[2]


def preparation(issue: fx.Node) -> fx.Node:
    """The first node of the run of copies right before `issue` that only build its buffer
    (a flat gradient's `cat`, its cast to the reduce dtype, padding, views), or `issue` itself.

    A collective that must be waited before `issue` is waited before these instead: they are
    cheap, and the buffers it frees (a full gradient sent, the slices received) are then gone
    before the new buffer is made, instead of alive beside it."""
    feeds = {issue}
    start = issue
    node = issue.prev
    while node.op == "call_function" and node.users and all(u in feeds for u in node.users) and (
        _is_building_copy(node)
    ):
        feeds.add(node)
        start = node
        node = node.prev
    return start


def _is_building_copy(node: fx.Node) -> bool:
    return node.target in (torch.ops.aten.cat.default, torch.ops.aten._to_copy.default, torch.ops.aten.zeros.default) or (
        _is_cheap(node)
    )


def move_issue_before(issue: fx.Node, anchor: fx.Node) -> None:
    """Move a collective's `issue` right before `anchor`, with the cheap nodes it reads (views,
    concatenations, constants: e.g. a bucket's `cat` of shards) that sit at or after `anchor`.
    Where one of its inputs computes and sits after `anchor`, the issue goes right after the
    last such input instead (as early as the computation allows). A cast of the step's inputs
    that only this collective reads (`pre_collective_cast`) moves with it, so that the cast
    copy lives from right before the issue, not from wherever the trace made it."""
    cast = pre_collective_cast(issue)
    own_cast = cast if cast is not None and len(cast.users) == 1 else None
    while True:
        order = {n: i for i, n in enumerate(issue.graph.nodes)}
        late: set[fx.Node] = set()
        frontier = [issue]
        while frontier:
            for i in frontier.pop().all_input_nodes:
                if i not in late and order[i] >= order[anchor]:
                    late.add(i)
                    frontier.append(i)
        blocking = [n for n in late if not _is_cheap(n) and n is not own_cast]
        if not blocking:
            break
        anchor = max(blocking, key=order.__getitem__).next
    move_before([*sorted(late, key=order.__getitem__), issue], anchor)
    if own_cast is not None:
        issue.prepend(own_cast)


def move_early(node: fx.Node) -> None:
    """Move `node`, and first its cheap ancestors (views, concatenations, constants), as early
    as their inputs allow: each right after its last input. Computation stays where the trace
    put it, so only the order of the bookkeeping around it changes, never a value."""
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    visited: set[fx.Node] = set()
    # Inputs before users: a depth-first post-order over the cheap ancestors, without recursion.
    post_order: list[fx.Node] = []
    stack: list[tuple[fx.Node, bool]] = [(node, False)]
    while stack:
        n, expanded = stack.pop()
        if expanded:
            post_order.append(n)
            continue
        if n in visited or not (_is_cheap(n) or n is node):
            continue
        visited.add(n)
        stack.append((n, True))
        stack.extend((i, False) for i in n.all_input_nodes)
    for n in post_order:
        # Constants read only here follow n; n follows the last of its other inputs.
        followers = [i for i in n.all_input_nodes if _is_cheap(i) and not i.all_input_nodes and len(i.users) == 1]
        anchors = [i for i in n.all_input_nodes if i not in followers]
        if anchors:
            last = max(anchors, key=order.__getitem__)
            if last.next is not n:
                last.append(n)
        for i in followers:
            n.prepend(i)
        order = {m: k for k, m in enumerate(node.graph.nodes)}


# With micro-batches each one gathers its own copy of a unit: the tracer labels unit u's
# gathers for micro-batch i `u@mb<i>`.
def microbatch_label(unit: str, microbatch: int) -> str:
    """Unit `unit`'s label in micro-batch `microbatch`: `<unit>@mb<microbatch>`."""
    return f"{unit}@mb{microbatch}"


def unit_of_label(label: str) -> str:
    """The unit a gather's label names (`u@mb<i>` -> `u`; a label without one is the unit)."""
    return label.split("@mb")[0]


def check_units_named(what: str, named, known, error: type[Exception] = ValueError) -> None:
    """Raises `error` naming the units in `named` that `known` (the step's units) lacks: an option
    naming a unit the step does not have (a stale name, a typo) would be silently ignored."""
    unknown = [unit for unit in named if unit not in known]
    if unknown:
        raise error(f"{what}: no unit named {unknown} in this step; its units are {list(known)}")


def microbatch_of_label(label: str) -> str:
    """The micro-batch a gather's label names (`u@mb<i>` -> "i"; "" without micro-batches)."""
    return label.rpartition("@mb")[2] if "@mb" in label else ""
