"""Timelines of a real step: timing marks in a copy of the scheduled graph, a Chrome trace, a Gantt chart.

`profile(step, state, batch)` (a collective: every rank calls it) copies the graph of the step,
inserts `call_function` nodes to a small recorder around every unit's forward and backward
region, every collective's issue and wait, the phases, and after every free of a gathered
buffer, runs it, and gathers every rank's timestamps with one `mesh.all_gather_world` (the
marks are the same on every rank: the same graph). Only the copy carries marks: the step's
own graph is untouched.

A mark costs one Python call and one clock read (about a microsecond); the overhead is
measured each time by timing the plain graph against the marked one (`Profile.overhead`).

Clocks: every rank reads `time.monotonic_ns`, and its zero is the moment it leaves the
all-reduce that starts the profiled step, so ranks of different hosts line up to within that
collective's skew.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, NamedTuple

import torch
from torch import fx

from .. import schedule as schedule_lib
from ._labels import name_collective
from ._regions import NodeRoles, node_roles

__all__ = ["TraceEvent", "Profile", "profile", "chrome_trace", "save_chrome_trace", "plot_gantt", "instrument"]

COMPUTE, COMMUNICATION = "compute", "communication"
# Order of marks that share a slot: outer intervals open first and close last.
_OPEN_PRIORITY = {"phase": 0, "region": 1, "op": 2}
_CLOSE_PRIORITY = {"op": 0, "region": 1, "phase": 2, "free": 3}


class TraceEvent(NamedTuple):
    """One interval (or instant) of a profiled step on one rank, in microseconds from its start."""

    name: str  # e.g. "forward", "blocks.3 backward", "wait all_gather blocks.4", "all_gather blocks.4"
    category: str  # "phase" | "region" | "issue" | "wait" | "collective" | "free"
    track: str  # "compute" (the thread running the graph) or "communication" (collectives in flight)
    start_us: float  # when it began
    duration_us: float  # how long (0 for an instant: a free)
    unit: str  # the unit it concerns ("" for none)
    phase: str  # "forward" | "backward" | "update"


class Profile(NamedTuple):
    """Timelines of one profiled step on every rank (`fs.analysis.profile`)."""

    ranks: tuple  # per rank, its TraceEvents (sorted by start)
    step_us: tuple  # per rank, the marked step's wall time
    plain_step_s: float  # mean wall time of the unmarked graph over the timed repeats (slowest rank)
    marked_step_s: float  # the same for the marked graph
    overhead: float  # marked_step_s / plain_step_s - 1: what the marks cost
    marks: int  # timing marks inserted in the graph


class _Recorder:
    """What the inserted nodes call: stores the clock into a preallocated slot (no allocation
    on the step's path). One per instrumented graph."""

    def __init__(self, count: int):
        self.times = [0] * count

    def mark(self, index: int) -> None:
        self.times[index] = time.monotonic_ns()


class _Mark(NamedTuple):
    slot: int  # 2 * position (before the node) or 2 * position + 1 (after it)
    priority: int
    kind: str  # "open" | "close" | "instant"
    key: tuple  # identifies the interval: (category, name, track, unit, phase)


def _intervals(gm: fx.GraphModule, roles: NodeRoles, mesh=None) -> list[tuple[int, int, tuple, str]]:
    """(first position, last position, key, priority class) of every interval to mark."""
    position = roles.position
    out = []
    by_phase: dict[str, list[int]] = {}
    for node, phase in roles.phase.items():
        if phase in ("forward", "backward", "update"):
            by_phase.setdefault(phase, []).append(position[node])
    bounds = {p: [min(v), max(v)] for p, v in by_phase.items()}
    # Phases as consecutive, non-overlapping spans (a stray node does not make them overlap).
    ordered = [p for p in ("forward", "backward", "update") if p in bounds]
    for a, b in zip(ordered, ordered[1:]):
        if bounds[b][0] <= bounds[a][1]:
            bounds[b][0] = bounds[a][1] + 1
    for p in ordered:
        if bounds[p][0] <= bounds[p][1]:
            out.append((bounds[p][0], bounds[p][1], ("phase", p, COMPUTE, "", p), "phase"))
    # Unit regions, clipped so that regions either nest or follow each other.
    kept: list[list[int]] = []
    for r in roles.regions:
        start, end = max(r.start, bounds.get(r.phase, [r.start])[0]), min(r.end, bounds.get(r.phase, [0, r.end])[1])
        for k in kept:
            if k[0] < start <= k[1] < end:
                start = k[1] + 1
        if start <= end:
            kept.append([start, end])
            out.append((start, end, ("region", f"{r.unit} {r.phase}", COMPUTE, r.unit, r.phase), "region"))
    for c in schedule_lib.collectives(gm):
        # FSDP's by unit ("all_gather blocks.3"); tensor parallelism's by axis and the unit it
        # serves ("tp all_reduce blocks.3"); the loss's "all_reduce loss".
        label, unit, phase, _, _ = name_collective(c, roles, mesh)
        i, w = position[c.issue], position[c.wait]
        out.append((i, i, ("issue", f"issue {label}", COMPUTE, unit, phase), "op"))
        out.append((w, w, ("wait", f"wait {label}", COMPUTE, unit, phase), "op"))
        out.append((i, w, ("collective", label, COMMUNICATION, unit, phase), "collective"))
    return out


def instrument(compiled, mesh=None) -> tuple[fx.GraphModule, list]:
    """A copy of `compiled.graph_module` with timing marks, and what each mark means (`mesh`:
    the step's, to name the axis of each collective).

    Returns `(graph_module, marks)`: the copy calls a recorder (its `times`, through
    `graph_module.fs_recorder`) at every mark; `marks[i]` is `(kind, key)` for mark `i`, kind
    "open"/"close" of an interval or "instant", key `(category, name, track, unit, phase)`."""
    gm = copy.deepcopy(compiled.graph_module)
    roles = node_roles(gm)
    nodes = list(gm.graph.nodes)
    marks: list[_Mark] = []
    for start, end, key, klass in _intervals(gm, roles, mesh):
        if klass == "collective":
            # Issued right after the issue node returns; arrived once its wait returns.
            marks.append(_Mark(2 * start + 1, -1, "open", key))
            marks.append(_Mark(2 * end + 1, 0, "close", key))
            continue
        marks.append(_Mark(2 * start, _OPEN_PRIORITY[klass], "open", key))
        marks.append(_Mark(2 * end + 1, _CLOSE_PRIORITY[klass], "close", key))
    events = [e for e in schedule_lib.analyze(gm) if e.event == "freed" and e.buffer]
    by_name = {n.name: n for n in nodes}
    for e in events:
        p = roles.position[by_name[e.node]]
        marks.append(_Mark(2 * p + 1, _CLOSE_PRIORITY["free"], "instant", ("free", f"free {e.buffer}", COMPUTE, e.unit, e.phase)))
    marks.sort(key=lambda m: (m.slot, m.priority))
    recorder = _Recorder(len(marks))
    gm.fs_recorder = recorder
    first_computation = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    for index, mark in enumerate(marks):
        # Every mark goes right before an original node (placeholders stay first); marks
        # that share that place keep their sorted order, since each is inserted last there.
        anchor = max(mark.slot // 2 + mark.slot % 2, first_computation)
        with gm.graph.inserting_before(nodes[min(anchor, len(nodes) - 1)]):
            gm.graph.call_function(recorder.mark, (index,))
    gm.graph.lint()
    gm.recompile()
    return gm, [(m.kind, m.key) for m in marks]


def _events(times: list[int], marks: list, zero: int) -> list[TraceEvent]:
    opened: dict[tuple, int] = {}
    out = []
    for t, (kind, key) in zip(times, marks):
        category, name, track, unit, phase = key
        if kind == "open":
            opened[key] = t
        elif kind == "close":
            start = opened.pop(key)
            out.append(TraceEvent(name, category, track, (start - zero) / 1e3, (t - start) / 1e3, unit, phase))
        else:
            out.append(TraceEvent(name, category, track, (t - zero) / 1e3, 0.0, unit, phase))
    return sorted(out, key=lambda e: (e.start_us, -e.duration_us))


def _flat_inputs(step, compiled, state, batch) -> list:
    return step.graph_inputs(state, batch)


def profile(step, state, batch, *, repeat: int = 3) -> Profile:
    """Run the step's graph with timing marks on every rank and gather every rank's timeline.

    Arguments:
        step: a traced `fs.sharded_step` (on a real mesh).
        state: its `StepState`; not modified (with `donate=True` the graph runs on copies).
        batch: this rank's batch.
        repeat: how many times the plain and the marked graph are timed, interleaved, to
            measure the marks' overhead (after one warm-up of each). The timeline is the last
            marked run's.

    A collective: every rank must call it, with the same `repeat`. The state is not advanced.
    """
    mesh = step.mesh
    compiled = step.lower(state, batch)
    marked, marks = instrument(compiled, mesh)
    recorder = marked.fs_recorder
    inputs = _flat_inputs(step, compiled, state, batch)

    def fresh_inputs() -> list:
        # A donating step updates its inputs in place: give it copies, keep the caller's state.
        return [t.clone() for t in inputs] if step.donate else inputs

    plain_times, marked_times = [], []
    zero = 0
    with torch.no_grad():
        for i in range(repeat + 1):
            for run, times in ((compiled.graph_module, plain_times), (marked, marked_times)):
                args = fresh_inputs()
                mesh.all_reduce_flat(torch.zeros(1, device=getattr(mesh, "device", "cpu")))  # start together
                start = time.monotonic_ns()
                run(*args)
                elapsed = torch.tensor([time.monotonic_ns() - start], dtype=torch.int64)
                slowest = int(mesh.all_gather_world(elapsed).max())
                if i > 0:
                    times.append(slowest)
                if run is marked:
                    zero = start
    mine = torch.tensor([t - zero for t in recorder.times], dtype=torch.int64)
    everyone = mesh.all_gather_world(mine.to(getattr(mesh, "device", "cpu"))).view(mesh.world_size, -1).cpu().tolist()
    ranks = tuple(tuple(_events(times, marks, 0)) for times in everyone)
    plain = sum(plain_times) / len(plain_times) / 1e9
    marked_s = sum(marked_times) / len(marked_times) / 1e9
    return Profile(
        ranks=ranks,
        step_us=tuple(max(e.start_us + e.duration_us for e in events) for events in ranks),
        plain_step_s=plain,
        marked_step_s=marked_s,
        overhead=marked_s / plain - 1,
        marks=len(marks),
    )


def chrome_trace(result: Profile) -> dict:
    """The profile in Chrome's trace event format (JSON object form; opens in Perfetto and
    chrome://tracing): one process per rank, thread 0 its compute, thread 1 its collectives
    in flight; intervals are complete events (`ph` "X", `ts`/`dur` in µs), frees instant
    events (`ph` "i")."""
    events: list[dict[str, Any]] = []
    tids = {COMPUTE: 0, COMMUNICATION: 1}
    for rank, timeline in enumerate(result.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for track, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
        for e in timeline:
            record = {
                "name": e.name,
                "cat": e.category,
                "pid": rank,
                "tid": tids[e.track],
                "ts": round(e.start_us, 3),
                "args": {"unit": e.unit, "phase": e.phase},
            }
            if e.category == "free":
                record.update(ph="i", s="t")
            else:
                record.update(ph="X", dur=round(e.duration_us, 3))
            events.append(record)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "plain_step_s": result.plain_step_s,
            "marked_step_s": result.marked_step_s,
            "overhead": result.overhead,
            "marks": result.marks,
        },
    }


def save_chrome_trace(result: Profile, path: str) -> None:
    """Write `chrome_trace(result)` to `path` (JSON)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(result), f)


def plot_gantt(result: Profile, path: str, *, title: str = "") -> None:
    """A Gantt chart of the profile as a PNG: per rank a compute row (phases shaded, unit
    regions as bars) and a communication row (collectives in flight); the time compute spends
    blocked in a wait — exposed communication — in red on the compute row. Tensor-parallel
    collectives (`tp ...`) have a colour of their own, apart from FSDP's gathers and scatters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"forward": "#4C72B0", "backward": "#55A868", "update": "#8172B2"}
    kinds = {"all_gather": "#DD8452", "reduce_scatter": "#937860", "all_reduce": "#DA8BC3", "tp": "#8C8C8C"}
    n = len(result.ranks)
    fig, ax = plt.subplots(figsize=(13, 1.6 + 1.1 * n))
    yticks, ylabels = [], []
    for rank, timeline in enumerate(result.ranks):
        base = (n - 1 - rank) * 3
        for e in timeline:
            ms, width = e.start_us / 1e3, e.duration_us / 1e3
            if e.category == "phase":
                ax.broken_barh([(ms, width)], (base + 1.55, 0.9), facecolors=colors[e.phase], alpha=0.25)
            elif e.category == "region":
                ax.broken_barh([(ms, width)], (base + 1.6, 0.8), facecolors=colors[e.phase], edgecolor="white", linewidth=0.3)
            elif e.category == "wait":
                ax.broken_barh([(ms, width)], (base + 1.55, 0.9), facecolors="#C44E52")
            elif e.category == "collective":
                kind = "tp" if e.name.startswith("tp ") else e.name.split(" ")[0]
                ax.broken_barh([(ms, width)], (base + 0.3, 0.9), facecolors=kinds.get(kind, "grey"), edgecolor="white", linewidth=0.3)
        yticks += [base + 0.75, base + 2.0]
        ylabels += [f"rank {rank} comm", f"rank {rank} compute"]
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time since the step started (ms)")
    handles = [Patch(color=c, label=p) for p, c in colors.items()] + [Patch(color="#C44E52", label="exposed communication (wait)")]
    handles += [Patch(color=c, label="tensor parallel (tp)" if k == "tp" else k.replace("_", "-")) for k, c in kinds.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1, fontsize=8, frameon=False)
    ax.set_title(title or f"profiled step: {result.marked_step_s * 1e3:.1f} ms marked, {result.plain_step_s * 1e3:.1f} ms plain")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
