"""`simulate(compiled, machine)`: replay a scheduled step on a compute stream and a communication stream.

The graph is walked in its order, as the step runs it:

- the step's call costs `machine.step_overhead_s` before its graph starts (the ranks'
  agreement on what runs, guards, packing);
- a computing node runs on the compute stream for `machine.compute_seconds(...)` of its
  FLOPs, bytes, kernel class and elements;
- a collective's issue costs the compute stream `issue_overhead_s` plus
  `issue_seconds_per_byte` × its bytes, and queues the collective
  on the communication stream, which runs one collective at a time in issue order (what the
  schedules guarantee: one collective in flight) for `machine.collective_seconds(...)`;
- a wait blocks the compute stream until its collective has finished: the blocked time is
  the step's exposed communication;
- while a collective is in flight, computation loses `overlap_penalty` of the overlapping
  time (the two contend for the cores, the memory, or the link's engines).

Peak memory comes from `analyze` (the lifetimes do not depend on time); the predicted step
time is when the compute stream finishes the last node.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import schedule as schedule_lib
from ._analyze import analyze
from ._costs import COLLECTIVE_OPS, is_view, node_cost
from ._machine import Machine
from ._memory import MemoryEstimate
from ._regions import node_roles
from ._timeline import COMMUNICATION, COMPUTE, Profile, TraceEvent

__all__ = ["Simulation", "simulate"]


class Simulation(NamedTuple):
    """A predicted step on one rank (`fs.analysis.simulate`)."""

    step_s: float  # predicted wall time of the step
    compute_s: float  # time the compute stream spends computing (overheads and penalties included)
    communication_s: float  # time the communication stream is busy
    exposed_s: float  # time the compute stream waits for collectives
    phases: dict  # "forward" / "backward" / "update" -> seconds of the compute stream in it
    memory: MemoryEstimate  # predicted peak memory (from the lifetimes)
    timeline: tuple  # TraceEvents of the predicted step (same shape as a measured profile's)

    def as_profile(self) -> Profile:
        """The prediction as a one-rank `Profile`, for `chrome_trace` and `plot_gantt`."""
        return Profile((self.timeline,), (self.step_s * 1e6,), self.step_s, self.step_s, 0.0, 0)


def simulate(compiled, machine: Machine, *, world_size: int | None = None) -> Simulation:
    """Predict the step time, timeline and peak memory of a traced step on `machine`.

    Arguments:
        compiled: a `CompiledStep` (`step.lower(state, batch)`), for a real or an abstract mesh.
        machine: a `Machine` (`fs.analysis.calibrate(mesh)`, `load_machine`, `h100_sxm()`).
        world_size: ranks of the collectives whose group size is not in the graph (all-reduce);
            default: the shard count of the step's layout.
    """
    gm = compiled.graph_module
    roles = node_roles(gm)
    world = world_size or compiled.key.layout.num_shards
    collectives = {c.issue: c for c in schedule_lib.collectives(gm)}
    waits = {c.wait: c for c in collectives.values()}
    finish: dict = {}
    t = machine.step_overhead_s  # compute stream
    comm_free = 0.0  # communication stream
    compute_s = exposed = comm_busy = 0.0
    phases = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    events: list[TraceEvent] = []
    spans: dict[str, list[float]] = {}
    for node in gm.graph.nodes:
        phase = roles.phase[node]
        if node in collectives:
            c = collectives[node]
            t += machine.issue_overhead_s + machine.issue_seconds_per_byte * c.nbytes
            group = world if c.kind == "all_reduce" else _group(c, world)
            duration = machine.collective_seconds(c.kind, c.nbytes, group)
            start = max(t, comm_free)
            comm_free = finish[c.issue] = start + duration
            comm_busy += duration
            label = f"{c.kind} {c.unit or 'loss'}"
            events.append(TraceEvent(label, "collective", COMMUNICATION, start * 1e6, duration * 1e6, c.unit, c.phase))
        elif node in waits:
            c = waits[node]
            blocked = max(0.0, finish[c.issue] - t)
            if blocked > 0:
                label = f"wait {c.kind} {c.unit or 'loss'}"
                events.append(TraceEvent(label, "wait", COMPUTE, t * 1e6, blocked * 1e6, c.unit, c.phase))
            exposed += blocked
            t += blocked
        elif node.op == "call_function" and node.target not in COLLECTIVE_OPS:
            cost = node_cost(node)
            seconds = machine.compute_seconds(cost.flops, cost.bytes, view=is_view(node), kind=cost.kind, numel=cost.numel)
            overlap = min(seconds, max(0.0, comm_free - t))
            seconds += machine.overlap_penalty * overlap
            if phase in phases:
                phases[phase] += seconds
                span = spans.setdefault(phase, [t, t])
                span[1] = t + seconds
            t += seconds
            compute_s += seconds
    for phase, (start, end) in spans.items():
        events.append(TraceEvent(phase, "phase", COMPUTE, start * 1e6, (end - start) * 1e6, "", phase))
    return Simulation(
        step_s=t,
        compute_s=compute_s,
        communication_s=comm_busy,
        exposed_s=exposed,
        phases=phases,
        memory=analyze(compiled, roles=roles).memory,
        timeline=tuple(sorted(events, key=lambda e: (e.start_us, -e.duration_us))),
    )


def _group(c, world: int) -> int:
    args = c.issue.args
    if c.kind == "all_gather":
        return int(args[1])
    if c.kind == "reduce_scatter":
        return int(args[2]) if isinstance(args[2], int) else len(args[1])
    return world
