"""Schedules: where in the traced step each collective is issued, waited and freed.

A traced step is one `torch.fx` graph: per-unit all-gathers, forward, backward (with a
reduce-scatter per unit), optimizer update. A *pass* is a function `GraphModule -> GraphModule`
that moves collective nodes (never the computation), so every schedule computes the same bits.
The built-in passes are written with the public tools of this module:

- `collectives(gm)`: the collectives of a graph, with the buffer and unit each one moves;
- `aliases(wait)` / `first_use` / `last_use`: the views of a gathered buffer and where they are read;
- `move_before(nodes, anchor)`: move nodes, keeping their order, right before `anchor`.

`analyze(gm)` reads the applied schedule back out of the final graph as `ScheduleEvent`s.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterable, NamedTuple, Sequence

import torch
from torch import fx

__all__ = [
    "Schedule",
    "ScheduleEvent",
    "Collective",
    "collectives",
    "aliases",
    "uses",
    "move_before",
    "move_early",
    "reshard_after_forward",
    "prefetch",
    "late_reduce_scatter_waits",
    "bucket_gathers",
    "one_collective_in_flight",
    "analyze",
    "explain",
    "max_units_alive",
]

_C10D = torch.ops._c10d_functional
ISSUE_OPS = {
    _C10D.all_gather_into_tensor.default: "all_gather",
    _C10D.reduce_scatter_tensor.default: "reduce_scatter",
    # On gloo a reduce-scatter is an all-to-all and a local sum (see Mesh.reduce_scatter_flat).
    _C10D.all_to_all_single.default: "reduce_scatter",
    _C10D.all_reduce.default: "all_reduce",
}
WAIT_OP = _C10D.wait_tensor.default

Pass = Callable[[fx.GraphModule], fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `sharded_step` runs a step.

    Attributes:
        trace: True (default) traces the step once per input signature into one graph,
            applies the passes below, and replays the graph; False runs the eager reference
            (gather everything, `grad(loss ∘ gather)`, update) — slower, same bits.
        prefetch: a unit's all-gather is issued `prefetch` units ahead of its first use and
            waited right before it (0: gathered on demand). In forward and in backward.
        reshard_after_forward: True frees a unit's full parameters after its last forward use
            and gathers them again for its backward (ZeRO-3: 1.5x the bytes, far less memory);
            False keeps them from forward to backward. A dict `unit -> bool` overrides it per
            unit (units not in it take `default_reshard`).
        default_reshard: the value for units a dict `reshard_after_forward` leaves out.
        reduce_scatters_in_flight: None waits each reduce-scatter as late as possible (right
            before the optimizer reads its result); an int k waits it once k later ones have
            been issued, which bounds how many full-size gradients are alive at once.
        bucket_bytes: 0 gathers each unit with its own collective; more merges the all-gathers
            of units next to each other in issue order (same pass, same dtype) into one
            collective of at most this many bytes (full buffers): fewer, larger messages for
            many small units. Bits are unchanged (an all-gather only moves data).
        passes: extra passes `GraphModule -> GraphModule`, run after the built-in ones.
        compile: hand the scheduled graph to `torch.compile` (inductor); results then agree
            with the eager reference to fp32 rounding instead of bit for bit.
    """

    trace: bool = True
    prefetch: int = 1
    reshard_after_forward: bool | dict = True
    default_reshard: bool = True
    reduce_scatters_in_flight: int | None = None
    bucket_bytes: int = 0
    passes: tuple[Pass, ...] = ()
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"Schedule.prefetch must be an int >= 0; got {self.prefetch!r}")
        if isinstance(self.reshard_after_forward, dict):
            # Frozen dataclasses should hold hashable values: keep the mapping as sorted pairs.
            object.__setattr__(self, "reshard_after_forward", _FrozenMapping(self.reshard_after_forward))
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 0:
            raise ValueError(f"Schedule.bucket_bytes must be an int >= 0; got {self.bucket_bytes!r}")
        if self.reduce_scatters_in_flight is not None and self.reduce_scatters_in_flight < 1:
            raise ValueError("Schedule.reduce_scatters_in_flight must be None or >= 1")
        object.__setattr__(self, "passes", tuple(self.passes))
        for p in self.passes:
            if not callable(p):
                raise TypeError(f"Schedule.passes must hold callables GraphModule -> GraphModule; got {p!r}")

    def reshards(self, unit: str) -> bool:
        """Whether `unit` is freed after forward and gathered again for backward."""
        if isinstance(self.reshard_after_forward, _FrozenMapping):
            return self.reshard_after_forward.get(unit, self.default_reshard)
        return bool(self.reshard_after_forward)


class _FrozenMapping(tuple):
    """An immutable, hashable `unit -> bool` mapping (sorted pairs)."""

    def __new__(cls, mapping: dict):
        return super().__new__(cls, sorted((str(k), bool(v)) for k, v in dict(mapping).items()))

    def get(self, key: str, default: bool) -> bool:
        return dict(self).get(key, default)

    def __repr__(self) -> str:
        return repr(dict(self))


class ScheduleEvent(NamedTuple):
    """One event of an applied schedule, in graph order."""

    position: int  # index of the node in the final graph
    unit: str  # the unit whose buffer the collective moves ("" for the loss all-reduce)
    buffer: str  # the flat buffer (a unit may hold several: frozen, other dtypes)
    event: str  # gather_issued | gather_waited | freed | reduce_scatter_issued | reduce_scatter_waited | all_reduce_issued | all_reduce_waited
    phase: str  # forward | backward | update
    node: str  # the graph node's name
    nbytes: int  # bytes of the full (unsharded, padded) buffer this collective moves


@dataclasses.dataclass
class Collective:
    """A collective of a traced graph.

    Attributes:
        kind: "all_gather", "reduce_scatter" or "all_reduce".
        issue: the node that starts it (`_c10d_functional.<kind>`).
        wait: the `wait_tensor` node that waits for it.
        buffer / unit: what it moves ("" for collectives that move no parameter buffer).
        phase: "forward" or "backward" for gathers (which pass they feed), "backward" for
            reduce-scatters, "update" for the loss all-reduce.
        nbytes: bytes of the full (unsharded, padded) buffer.
    """

    kind: str
    issue: fx.Node
    wait: fx.Node
    buffer: str
    unit: str
    phase: str
    nbytes: int

    def members(self) -> list[tuple[str, str, fx.Node, int]]:
        """(buffer, unit, node its views start from, bytes) of each buffer it moves: one, or
        several for a bucket (`bucket_gathers`)."""
        return self.issue.meta.get("fs_members") or [(self.buffer, self.unit, self.wait, self.nbytes)]


def _full_nbytes(node: fx.Node, kind: str) -> int:
    """Bytes of the full buffer: the all-gather's output, the reduce-scatter's input."""
    if "fs_nbytes" in node.meta:  # made by a pass (a bucket), not by the trace
        return node.meta["fs_nbytes"]
    value = (node if kind == "all_gather" else node.args[0]).meta.get("val")
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size()


def collectives(gm: fx.GraphModule) -> list[Collective]:
    """Every collective of `gm` in graph order. Nodes carry `meta["fs_buffer"]`, `["fs_unit"]`
    and `["fs_phase"]` from tracing; a pass that creates collectives must copy them."""
    out = []
    for node in gm.graph.nodes:
        kind = ISSUE_OPS.get(node.target)
        if kind is None:
            continue
        waits = [u for u in node.users if u.target is WAIT_OP]
        if len(waits) != 1:
            raise RuntimeError(f"collective {node.name} must have exactly one wait_tensor user; has {len(waits)}")
        out.append(
            Collective(
                kind=kind,
                issue=node,
                wait=waits[0],
                buffer=node.meta.get("fs_buffer", ""),
                unit=node.meta.get("fs_unit", ""),
                phase=node.meta.get("fs_phase", "update"),
                nbytes=_full_nbytes(node, kind),
            )
        )
    return out


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


_CHEAP = {torch.ops.aten.cat.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default}


def _is_cheap(node: fx.Node) -> bool:
    """Views, concatenations and constants: moving them moves no computation."""
    return _is_pure(node) and (_is_view(node) or node.target in _CHEAP or not node.all_input_nodes)


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


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _forward_end(gm: fx.GraphModule) -> fx.Node:
    for node in gm.graph.nodes:
        if node.meta.get("fs_forward_end"):
            return node
    raise RuntimeError("the graph has no node marked as the end of the forward pass (meta 'fs_forward_end')")


# --- built-in passes ------------------------------------------------------------------------


def reshard_after_forward(gm: fx.GraphModule, *, reshard: Callable[[str], bool]) -> fx.GraphModule:
    """Gather again, for the backward, every buffer of a unit with `reshard(unit)` that the
    backward reads: the backward's reads are redirected to a copy of the all-gather (and of
    the views it went through), so the forward's copy dies after its last forward use."""
    forward_end = _forward_end(gm)
    for c in collectives(gm):
        if c.kind != "all_gather" or c.phase != "forward" or not reshard(c.unit):
            continue
        position = _positions(gm)
        end = position[forward_end]
        alias_list = aliases(c.wait)
        alias_set = set(alias_list)
        # Reads from the backward, through aliases made in the forward (an alias made in the
        # backward reads its forward input, so redirecting that input covers it).
        backward_reads = [
            (user, a) for a in alias_list if position[a] <= end for user in list(a.users) if position[user] > end
        ]
        if not backward_reads:
            continue
        first = min((user for user, _ in backward_reads), key=position.__getitem__)
        copies: dict[fx.Node, fx.Node] = {}

        def copy_of(node: fx.Node) -> fx.Node:
            if node in copies:
                return copies[node]
            if node is c.wait:
                with gm.graph.inserting_before(first):
                    issue = gm.graph.node_copy(c.issue)
                    issue.meta = {**c.issue.meta, "fs_phase": "backward"}
                    wait = gm.graph.node_copy(c.wait, lambda n: issue)
                    wait.meta = dict(c.wait.meta)
                copies[node] = wait
                return wait
            args = {a: copy_of(a) for a in node.all_input_nodes if a in alias_set}
            with gm.graph.inserting_before(first):
                new = gm.graph.node_copy(node, lambda n: args.get(n, n))
            copies[node] = new
            return new

        for user, read in backward_reads:
            user.replace_input_with(read, copy_of(read))
    gm.graph.lint()
    return gm


def prefetch(gm: fx.GraphModule, *, distance: int) -> fx.GraphModule:
    """Issue each unit's all-gather `distance` units ahead of its first use, in forward and in
    backward separately, and wait for it (and build its views) right before its first use."""
    for phase in ("forward", "backward"):
        gathers = [c for c in collectives(gm) if c.kind == "all_gather" and c.phase == phase]
        if not gathers:
            continue
        position = _positions(gm)
        first_use: dict[str, fx.Node] = {}
        for c in gathers:
            readers = uses(c.wait)
            if readers:
                node = min(readers, key=position.__getitem__)
                if c.unit not in first_use or position[node] < position[first_use[c.unit]]:
                    first_use[c.unit] = node
        order = sorted(first_use, key=lambda u: position[first_use[u]])
        # Wait (and view) right before the first use, then issue `distance` units earlier.
        # Moving one unit's nodes never reorders another unit's nodes relative to each other,
        # so the positions taken once before the moves still order each unit against its anchor.
        for c in gathers:
            if c.unit in first_use:
                anchor = first_use[c.unit]
                move_before([n for n in aliases(c.wait) if position[n] < position[anchor]], anchor)
        position = _positions(gm)
        block_start = {u: min((c.wait for c in gathers if c.unit == u), key=position.__getitem__) for u in order}
        for c in gathers:
            if c.unit not in first_use:
                continue
            index = order.index(c.unit)
            move_before([c.issue], block_start[order[max(0, index - distance)]])
    gm.graph.lint()
    return gm


def late_reduce_scatter_waits(gm: fx.GraphModule, *, in_flight: int | None = None) -> fx.GraphModule:
    """Issue every reduce-scatter as soon as its gradient is complete, wait for it right before
    its result is read — or, with `in_flight=k`, once k later reduce-scatters have been issued.

    The autograd engine runs the backward of the flattening (the `cat` of a unit's leaf
    gradients) late, after every other ready node, so the gradient buffer is first moved, with
    its pure ancestors, to right after the last leaf gradient it needs."""
    scatters = [c for c in collectives(gm) if c.kind == "reduce_scatter"]
    for c in scatters:
        producer = c.issue.args[0]
        if isinstance(producer, fx.Node) and producer.op != "placeholder":
            move_early(producer)
            producer.append(c.issue)
        readers = list(c.wait.users)
        if readers:
            position = _positions(gm)
            move_before([c.wait], min(readers, key=position.__getitem__))
    if in_flight is not None:
        position = _positions(gm)
        for i, c in enumerate(scatters):
            if i + in_flight < len(scatters):
                limit = scatters[i + in_flight].issue
                if position[c.wait] > position[limit]:
                    move_before([c.wait], limit)
                    position = _positions(gm)
    gm.graph.lint()
    return gm


def bucket_gathers(gm: fx.GraphModule, *, bucket_bytes: int) -> fx.GraphModule:
    """Merge all-gathers of the same pass and dtype, next to each other in issue order, into
    buckets of at most `bucket_bytes` (full buffers): one collective gathers the concatenated
    shards, issued where the first member was, waited where the first member was waited; each
    member's full buffer is then copied out of the rank-major result, and its readers read the
    copy. Members are recorded in `meta["fs_members"]`, so `analyze` reports them one by one."""
    if bucket_bytes <= 0:
        return gm
    aten = torch.ops.aten
    for phase in ("forward", "backward"):
        gathers = [c for c in collectives(gm) if c.kind == "all_gather" and c.phase == phase]
        buckets: list[list[Collective]] = []
        for c in gathers:
            last = buckets[-1] if buckets else None
            fits = (
                last is not None
                and sum(m.nbytes for m in last) + c.nbytes <= bucket_bytes
                and c.issue.args[1:] == last[0].issue.args[1:]
                and c.issue.args[0].meta["val"].dtype == last[0].issue.args[0].meta["val"].dtype
                and not c.issue.meta.get("fs_members")
            )
            if fits:
                last.append(c)
            else:
                buckets.append([c])
        for bucket in buckets:
            if len(bucket) > 1:
                _merge_gathers(gm, bucket, aten)
    gm.graph.lint()
    return gm


def _merge_gathers(gm: fx.GraphModule, bucket: list[Collective], aten) -> None:
    position = _positions(gm)
    shards = [c.issue.args[0] for c in bucket]
    lengths = [s.meta["val"].numel() for s in shards]
    num_shards = bucket[0].issue.args[1]
    first_issue = min((c.issue for c in bucket), key=position.__getitem__)
    first_wait = min((c.wait for c in bucket), key=position.__getitem__)
    with gm.graph.inserting_before(first_issue):
        joined = gm.graph.call_function(aten.cat.default, (shards,))
        issue = gm.graph.call_function(bucket[0].issue.target, (joined, *bucket[0].issue.args[1:]))
    with gm.graph.inserting_before(first_wait):
        wait = gm.graph.call_function(WAIT_OP, (issue,))
        rows = gm.graph.call_function(aten.view.default, (wait, [num_shards, sum(lengths)]))
        members, offset = [], 0
        for c, length in zip(bucket, lengths):
            part = gm.graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + length))
            copy = gm.graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            full = gm.graph.call_function(aten.view.default, (copy, [num_shards * length]))
            c.wait.replace_all_uses_with(full)
            members.append((c.buffer, c.unit, full, c.nbytes))
            offset += length
    for c in bucket:
        gm.graph.erase_node(c.wait)
        gm.graph.erase_node(c.issue)
    issue.meta.update(
        fs_buffer="+".join(m[0] for m in members),
        fs_unit="+".join(dict.fromkeys(m[1] for m in members)),
        fs_phase=bucket[0].phase,
        fs_members=members,
        fs_nbytes=sum(m[3] for m in members),
    )


def one_collective_in_flight(gm: fx.GraphModule) -> fx.GraphModule:
    """Wait for each collective before the next one is issued (moving waits earlier only).

    gloo runs a process group's collectives on two worker threads that share one context;
    with two collectives in flight at once, ranks were seen to deadlock inside gloo (one rank
    spinning in a ring all-reduce's buffer teardown, the other waiting for a later
    collective), about once in a few thousand steps. With one in flight, the worker threads
    never run two at once; compute still overlaps the collective in flight. Prefetching k > 1
    units then means: unit i+k's gather is issued while unit i computes, once unit i+k-1's
    has arrived."""
    previous = None
    for c in collectives(gm):  # graph order of the issues
        if previous is not None:
            position = _positions(gm)
            if position[previous.wait] > position[c.issue]:
                move_before([previous.wait], c.issue)
        previous = c
    _finish_local_sums(gm)
    gm.graph.lint()
    return gm


def _finish_local_sums(gm: fx.GraphModule) -> None:
    """Sum a gloo reduce-scatter's received slices right after its wait (Mesh.reduce_scatter_flat:
    all-to-all, then view + sum): the received buffer is full-size, the sum a shard."""
    finishing = {torch.ops.aten.view.default, torch.ops.aten.sum.dim_IntList}
    for c in collectives(gm):
        if c.issue.target is not _C10D.all_to_all_single.default:
            continue
        anchor = c.wait
        while len(anchor.users) == 1 and next(iter(anchor.users)).target in finishing:
            user = next(iter(anchor.users))
            if anchor.next is not user:
                anchor.append(user)
            anchor = user


def apply_schedule(gm: fx.GraphModule, schedule: Schedule) -> fx.GraphModule:
    """The built-in passes a `Schedule` asks for, then its own passes, then (always) one
    collective in flight at a time; recompiles `gm`."""
    gm = reshard_after_forward(gm, reshard=schedule.reshards)
    gm = prefetch(gm, distance=schedule.prefetch)
    gm = late_reduce_scatter_waits(gm, in_flight=schedule.reduce_scatters_in_flight)
    gm = bucket_gathers(gm, bucket_bytes=schedule.bucket_bytes)
    for user_pass in schedule.passes:
        result = user_pass(gm)
        gm = gm if result is None else result
        gm.graph.lint()
    gm = one_collective_in_flight(gm)
    gm.recompile()
    return gm


# --- reading a schedule back ------------------------------------------------------------------


def analyze(gm: fx.GraphModule) -> list[ScheduleEvent]:
    """The schedule applied in `gm`: every collective's issue and wait, and where each gathered
    buffer is freed (its last read through any alias), sorted by graph position."""
    position = _positions(gm)
    events = []
    for c in collectives(gm):
        prefix = {"all_gather": "gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}[c.kind]
        for buffer, unit, root, nbytes in c.members():

            def event(kind: str, node: fx.Node) -> ScheduleEvent:
                return ScheduleEvent(position[node], unit, buffer, kind, c.phase, node.name, nbytes)

            events.append(event(f"{prefix}_issued", c.issue))
            events.append(event(f"{prefix}_waited", c.wait))
            if c.kind == "all_gather":
                last = max(uses(root) + aliases(root), key=position.__getitem__)
                events.append(event("freed", last))
    return sorted(events, key=lambda e: (e.position, e.event))


def max_units_alive(events: Sequence[ScheduleEvent]) -> int:
    """The most units whose full parameters are alive at once: a gathered buffer is alive from
    its issue (its output is allocated then) to its last read."""
    alive: dict[tuple[str, str, int], tuple[int, int]] = {}
    issued: dict[tuple[str, str], list[int]] = {}
    for e in events:
        key = (e.unit, e.buffer)
        if e.event == "gather_issued":
            issued.setdefault(key, []).append(e.position)
        elif e.event == "freed":
            start = issued[key].pop(0)
            alive[(e.unit, e.buffer, start)] = (start, e.position)
    points = sorted({p for interval in alive.values() for p in interval})
    best = 0
    for p in points:
        units = {unit for (unit, _, _), (start, end) in alive.items() if start <= p <= end}
        best = max(best, len(units))
    return best


def explain(events: Sequence[ScheduleEvent], *, title: str = "") -> str:
    """A readable table of a schedule: one row per event, in graph order."""
    rows = [("pos", "phase", "event", "unit", "buffer", "MiB", "node")]
    for e in events:
        rows.append((str(e.position), e.phase, e.event, e.unit, e.buffer, f"{e.nbytes / 2**20:.3f}", e.node))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    gathered = sum(e.nbytes for e in events if e.event == "gather_issued")
    scattered = sum(e.nbytes for e in events if e.event == "reduce_scatter_issued")
    lines.append(
        f"all-gather {gathered / 2**20:.3f} MiB, reduce-scatter {scattered / 2**20:.3f} MiB per step; "
        f"at most {max_units_alive(events)} units' full parameters alive at once"
    )
    return "\n".join(lines)
