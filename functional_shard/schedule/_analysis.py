"""Reading a schedule back out of a graph: events, units alive, collectives in flight, a table."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from torch import fx

from ._axes import collective_axis
from ._graph import aliases, collectives, positions, uses
from ._offload import copies_into, copy_source, is_to_host, offload_copies
from ._remat import recomputed_bytes, recomputed_units


_PREFIX = {"all_gather": "gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce"}


class ScheduleEvent(NamedTuple):
    """One event of an applied schedule, in graph order."""

    position: int  # index of the node in the final graph
    unit: str  # the unit whose buffer the collective moves ("" for the loss all-reduce)
    buffer: str  # the flat buffer (a unit may hold several: frozen, other dtypes)
    event: str  # gather_issued | gather_waited | freed | reduce_scatter_issued | reduce_scatter_waited | all_reduce_issued | all_reduce_waited | recomputed | copied_to_device | copied_to_host
    phase: str  # forward | backward | update
    node: str  # the graph node's name (for recomputed: the first recomputed node)
    nbytes: int  # bytes of the full (unsharded, padded) buffer this collective moves (recomputed: bytes the recomputed nodes allocate)
    axis: str = ""  # the mesh axis its group spans ("fsdp", "tp", "world" for every axis; "" unknown or no collective)


def analyze(gm: fx.GraphModule) -> list[ScheduleEvent]:
    """The schedule applied in `gm`: every collective's issue and wait, where each gathered
    buffer is freed (its last read through any alias), and where each rematerialized unit's
    forward is recomputed (`rematerialize`: one `recomputed` event per unit, at its first
    recomputed node, buffer ""), sorted by graph position."""
    position = positions(gm)
    events = []
    for c in collectives(gm):
        prefix = _PREFIX[c.kind]
        axis = collective_axis(c.issue).axis
        for buffer, unit, root, nbytes in c.members():

            def event(kind: str, node: fx.Node) -> ScheduleEvent:
                return ScheduleEvent(position[node], unit, buffer, kind, c.phase, node.name, nbytes, axis)

            events.append(event(f"{prefix}_issued", c.issue))
            events.append(event(f"{prefix}_waited", c.wait))
            if c.kind == "all_gather":
                last = max(uses(root) + aliases(root), key=position.__getitem__)
                events.append(event("freed", last))
    for unit, nodes in recomputed_units(gm).items():
        first = nodes[0]
        events.append(ScheduleEvent(position[first], unit, "", "recomputed", "backward", first.name, recomputed_bytes(nodes)))
    events += _copy_events(gm, position)
    return sorted(events, key=lambda e: (e.position, e.event))


def _reduced_by(node, by_wait: dict):
    """The reduce-scatter whose result `node` is: its wait, or on gloo the local sum of the
    ranks' parts (a view and a sum of the wait), up to two nodes on."""
    for _ in range(3):
        if node in by_wait:
            return by_wait[node]
        inputs = node.all_input_nodes if isinstance(node, fx.Node) else []
        if len(inputs) != 1:
            return None
        node = inputs[0]
    return None


def _copy_events(gm: fx.GraphModule, position: dict) -> list[ScheduleEvent]:
    """CPU offload's copies (`functional_shard::offload_copy`): a shard's copy to the device
    names the all-gather it feeds; a gradient shard's copy to the host the reduce-scatter it
    follows; the update's copies (`Offload(update="device")`) name neither (phase "update")."""
    by_issue = {c.issue: c for c in collectives(gm)}
    by_wait = {c.wait: c for c in collectives(gm)}
    events = []
    for node in offload_copies(gm):
        source = copy_source(node)
        value = (source if copies_into(node) else node).meta.get("val")  # `offload_copy_into` returns nothing
        nbytes = value.numel() * value.element_size() if value is not None else 0
        to_host = is_to_host(node)
        c = _reduced_by(source, by_wait) if to_host else next((by_issue[u] for u in node.users if u in by_issue), None)
        unit, buffer, phase = (c.unit, c.buffer, c.phase) if c is not None else ("", "", "update")
        kind = "copied_to_host" if to_host else "copied_to_device"
        events.append(ScheduleEvent(position[node], unit, buffer, kind, phase, node.name, nbytes))
    return events


def max_units_alive(events: Sequence[ScheduleEvent]) -> int:
    """The most units whose full parameters are alive at once: a gathered buffer is alive from
    its issue (its output is allocated then) to its last read. Gathers of no parameter buffer
    (tensor-parallel activations) are no unit's."""
    alive: dict[tuple[str, str, int], tuple[int, int]] = {}
    issued: dict[tuple[str, str], list[int]] = {}
    for e in events:
        if not e.buffer:
            continue
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


def in_flight_intervals(events: Sequence[ScheduleEvent], kind: str | None = None) -> list[tuple[int, str, int]]:
    """(issue position, issue node, wait position) of each collective (of `kind`, e.g.
    "reduce_scatter"; None: every kind), in issue order; a bucket counts once."""
    prefixes = {_PREFIX[kind]} if kind is not None else set(_PREFIX.values())
    issued: dict[tuple, list[ScheduleEvent]] = {}
    found: dict[str, tuple[int, str, int]] = {}
    for e in events:  # graph order: a collective's issue comes before its wait
        prefix, _, what = e.event.rpartition("_")
        if prefix not in prefixes:
            continue
        key = (prefix, e.unit, e.buffer, e.phase)
        if what == "issued":
            issued.setdefault(key, []).append(e)
        else:
            issue = issued[key].pop(0)
            found[issue.node] = (issue.position, issue.node, e.position)
    return sorted(found.values())


def max_in_flight(events: Sequence[ScheduleEvent], kind: str | None = None) -> int:
    """The most collectives (of `kind`: "all_gather", "reduce_scatter", "all_reduce"; None:
    every kind) issued and not yet waited at once, counted at each issue."""
    intervals = in_flight_intervals(events, kind)
    return max((sum(start <= p < end for start, _, end in intervals) for p, _, _ in intervals), default=0)


def rematerialized(events: Sequence[ScheduleEvent]) -> list[str]:
    """The units whose forward the backward recomputes (`rematerialize`), in graph order."""
    return [e.unit for e in events if e.event == "recomputed"]


def explain(events: Sequence[ScheduleEvent], *, title: str = "") -> str:
    """A readable table of a schedule: one row per event, in graph order. A collective that
    moves no parameter buffer (a tensor-parallel all-reduce or gather of activations, the
    loss's all-reduce) names its axis in the event, e.g. `tp all_reduce_issued`, and the last
    lines count them per axis."""
    rows = [("pos", "phase", "event", "unit", "buffer", "MiB", "node")]
    for e in events:
        event = f"{e.axis} {e.event}" if e.axis and not e.buffer and e.event != "recomputed" else e.event
        rows.append((str(e.position), e.phase, event, e.unit, e.buffer, f"{e.nbytes / 2**20:.3f}", e.node))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [title] if title else []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    copies = {kind: [e.nbytes for e in events if e.event == kind] for kind in ("copied_to_device", "copied_to_host")}
    gathered = sum(e.nbytes for e in events if e.event == "gather_issued" and e.buffer)
    scattered = sum(e.nbytes for e in events if e.event == "reduce_scatter_issued" and e.buffer)
    lines.append(
        f"all-gather {gathered / 2**20:.3f} MiB, reduce-scatter {scattered / 2**20:.3f} MiB per step; "
        f"at most {max_units_alive(events)} units' full parameters alive at once, "
        f"at most {max_in_flight(events)} collectives in flight"
    )
    if copies["copied_to_device"] or copies["copied_to_host"]:
        lines.append(
            f"CPU offload: {len(copies['copied_to_device'])} copies to the device "
            f"({sum(copies['copied_to_device']) / 2**20:.3f} MiB), {len(copies['copied_to_host'])} to the host "
            f"({sum(copies['copied_to_host']) / 2**20:.3f} MiB) per step"
        )
    others: dict[tuple[str, str], list[int]] = {}
    for e in events:
        if not e.buffer and e.event.endswith("_issued"):
            count = others.setdefault((e.axis or "?", e.event.removesuffix("_issued").replace("gather", "all_gather")), [0, 0])
            count[0] += 1
            count[1] += e.nbytes
    if others:
        lines.append(
            "activations and scalars (no parameter buffer), per axis: "
            + ", ".join(f"{axis} {kind} x{n} {b / 2**20:.3f} MiB" for (axis, kind), (n, b) in others.items())
        )
    recomputed = rematerialized(events)
    if recomputed:
        lines.append(f"rematerialized (forward recomputed before the backward): {', '.join(recomputed)}")
    return "\n".join(lines)
