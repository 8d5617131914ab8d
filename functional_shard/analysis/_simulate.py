"""`simulate(compiled, machine)`: replay a scheduled step on a compute stream and a communication stream.

The graph is walked in its order, as the step runs it:

- the step's call costs `machine.step_overhead_s` before its graph starts (the ranks'
  agreement on what runs, guards, packing);
- a computing node runs on the compute stream for `machine.compute_seconds(...)` of its
  FLOPs, bytes, kernel class and elements;
- a collective's issue costs the compute stream `issue_overhead_s` plus
  `issue_seconds_per_byte` × its bytes, and queues the collective
  on the communication stream, which runs one collective at a time in issue order (what the
  schedules guarantee: one collective in flight) for `machine.collective_seconds(...)`, on
  the group of the mesh axis it spans (its size, and its stride: a `tp` group of a
  `{"fsdp": 64, "tp": 8}` mesh lies in one node, NVLink; each `fsdp` group spans 64 nodes);
  a tensor-parallel collective (on a model-parallel axis: activations, no buffer) has a
  stream of its own per axis, as NCCL gives each communicator its own stream, so it never
  queues behind FSDP's prefetched gathers;
- a wait blocks the compute stream until its collective has finished: the blocked time is
  the step's exposed communication;
- while a collective is in flight, computation loses `overlap_penalty` of the overlapping
  time (the two contend for the cores, the memory, or the link's engines);
- a node whose inputs were touched recently runs at the speed of cached data: each tensor's
  reuse distance (the bytes the rank's nodes read and wrote since it was last produced or
  read, a view counting as its base) is compared with `machine.cache_bytes`, and the share
  of the node's input bytes within it moves its time from the machine's cold curve toward its
  hot one (`Machine.compute_seconds(cached=...)`). An optimizer's update of a gradient just
  reduce-scattered, or a mask applied to scores just multiplied, costs a fraction of the same
  kernel on data from memory.

Peak memory comes from the lifetimes, as `analyze` reads them (they do not depend on time); the predicted step
time is when the compute stream finishes the last node.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import fx

from .. import schedule as schedule_lib
from ..schedule._remat import written_inputs
from ._costs import COLLECTIVE_OPS, node_cost, tensors_of
from ._fusion import block_nodes, fuse, runs_compiled
from ._labels import name_collective
from ._machine import Machine
from ._memory import MemoryEstimate, estimate_memory
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
    reserved: int = 0  # peak memory as the CUDA caching allocator reserves it: memory.peak x (1 + machine.allocator_overhead)

    def as_profile(self) -> Profile:
        """The prediction as a one-rank `Profile`, for `chrome_trace` and `plot_gantt`."""
        return Profile((self.timeline,), (self.step_s * 1e6,), self.step_s, self.step_s, 0.0, 0)


def simulate(
    compiled, machine: Machine, *, world_size: int | None = None, mesh=None, fused: bool | str | None = None
) -> Simulation:
    """Predict the step time, timeline and peak memory of a traced step on `machine`.

    Arguments:
        compiled: a `CompiledStep` (`step.lower(state, batch)`), for a real or an abstract mesh.
        machine: a `Machine` (`fs.analysis.calibrate(mesh)`, `load_machine`, `h100_sxm()`).
        world_size: ranks of the collectives whose group is unknown and whose size is not in
            the graph (an all-reduce on a group the analysis cannot name); default: the shard
            count of the step's layout.
        mesh: the `fs.Mesh` the step runs on, to name each collective's axis when its group is
            torch's (optional: an `AbstractMesh`'s graph names its axes itself).
        fused: price the graph as `torch.compile` runs it (`analysis._fusion`: memory-bound
            chains fused into one kernel each, their intermediates never allocated); default:
            whether the step runs compiled (`Schedule(compile=True)`). `"blocks"`: only the
            blocks' nodes compiled, as torchtitan compiles each TransformerBlock alone.
    """
    gm = compiled.graph_module
    roles = node_roles(gm)
    world = world_size or compiled.key.layout.num_shards
    collectives = {c.issue: c for c in schedule_lib.collectives(gm)}
    waits = {c.wait: c for c in collectives.values()}
    names = {issue: name_collective(c, roles, mesh) for issue, c in collectives.items()}
    groups = {
        issue: names[issue].group.size or (world if c.kind == "all_reduce" else _group(c, world)) for issue, c in collectives.items()
    }
    _check_machine_world(machine, groups, names)
    finish: dict = {}
    t = machine.step_overhead_s  # compute stream
    streams: dict[str, float] = {}  # communication stream ("" for the data axes', one per model axis) -> free at
    comm_free = 0.0  # the latest any stream is busy to (computation overlapping it pays the penalty)
    compute_s = exposed = comm_busy = 0.0
    phases = {"forward": 0.0, "backward": 0.0, "update": 0.0}
    events: list[TraceEvent] = []
    spans: dict[str, list[float]] = {}
    costs = {n: node_cost(n) for n in gm.graph.nodes if n.op == "call_function" and n.target not in COLLECTIVE_OPS}
    if fused not in (None, True, False, "blocks"):
        raise ValueError(f"simulate(fused={fused!r}): expected None, True, False or 'blocks'")
    compiled_nodes = block_nodes(gm, roles) if fused == "blocks" else None
    fusion = fuse(gm, costs, compiled_nodes) if (runs_compiled(gm) if fused is None else fused) else None
    priced = fusion.costs if fusion is not None else costs  # what runs: a fused kernel's cost on its last node
    touches = sum(len(n.all_input_nodes) + 1 for n in gm.graph.nodes)
    recency = _Recency(machine.cache_bytes, 2 * touches)
    for node in gm.graph.nodes:  # the step before: when the state it hands on was last touched
        recency.visit(node, collectives, waits, costs)
    for node in gm.graph.nodes:
        phase = roles.phase[node]
        cached = recency.visit(node, collectives, waits, costs)
        if node in collectives:
            c = collectives[node]
            name = names[c.issue]
            t += machine.issue_overhead_s + machine.issue_seconds_per_byte * c.nbytes
            duration = machine.collective_seconds(c.kind, c.nbytes, groups[c.issue], stride=name.group.stride or 1)
            stream = name.group.axis if name.model_parallel else ""
            start = max(t, streams.get(stream, 0.0))
            streams[stream] = finish[c.issue] = start + duration
            comm_free = max(comm_free, start + duration)
            comm_busy += duration
            events.append(TraceEvent(name.label, "collective", COMMUNICATION, start * 1e6, duration * 1e6, name.unit, c.phase))
        elif node in waits:
            c = waits[node]
            blocked = max(0.0, finish[c.issue] - t)
            if blocked > 0:
                name = names[c.issue]
                events.append(TraceEvent(f"wait {name.label}", "wait", COMPUTE, t * 1e6, blocked * 1e6, name.unit, c.phase))
            exposed += blocked
            t += blocked
        elif node in priced:
            cost = priced[node]
            seconds = machine.compute_seconds(
                cost.flops, cost.bytes, view=cost.kind == "view", kind=cost.kind, numel=cost.numel, cached=cached,
                dtype=cost.dtype, attention=cost.attention, causal=cost.causal,
            )
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
    memory = estimate_memory(gm, roles, compiled.io, fusion.unmaterialized if fusion else frozenset())
    return Simulation(
        step_s=t,
        compute_s=compute_s,
        communication_s=comm_busy,
        exposed_s=exposed,
        phases=phases,
        memory=memory,
        timeline=tuple(sorted(events, key=lambda e: (e.start_us, -e.duration_us))),
        reserved=round(memory.peak * (1 + machine.allocator_overhead)),
    )


class _Recency:
    """Which tensors are still in a rank's caches as the graph runs, by their reuse distance:
    the distinct bytes touched since a storage (a node's output; a view's or an in-place
    result's is its base's) was last produced or read (an LRU stack, kept as a Fenwick tree
    of bytes over touch times). The graph is walked twice: a step's inputs are what the step
    before it last touched (the state it updated), so the first walk only sets those times."""

    def __init__(self, cache_bytes: int, touches: int):
        self.cache_bytes = cache_bytes
        self.tree = [0] * (touches + 2)  # bytes touched at each time, as a Fenwick tree
        self.now = 0
        self.stamp: dict = {}  # root node -> (time of its last touch, bytes then)
        self.root: dict = {}  # node -> the node whose storage its output is

    def _add(self, i: int, value: int) -> None:
        while i < len(self.tree):
            self.tree[i] += value
            i += i & -i

    def _before(self, i: int) -> int:
        total = 0
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total

    def _touch(self, root: fx.Node, nbytes: int) -> None:
        if root in self.stamp:
            then, size = self.stamp[root]
            self._add(then, -size)
        self.now += 1
        self._add(self.now, nbytes)
        self.stamp[root] = (self.now, nbytes)

    def _cached(self, root: fx.Node, nbytes: int) -> bool:
        if not self.cache_bytes or root not in self.stamp:
            return False
        since = self._before(self.now) - self._before(self.stamp[root][0])
        return since + nbytes <= self.cache_bytes

    def _root(self, node: fx.Node) -> fx.Node:
        return self.root.get(node, node)

    def visit(self, node: fx.Node, collectives: dict, waits: dict, costs: dict) -> float:
        """Account for `node` running; the share of its input bytes that was cached."""
        if node in waits:
            self.root[node] = self._root(waits[node].issue)
        elif node in collectives:  # its output buffer, written by the communication thread
            self._touch(node, _nbytes(node))
        elif node in costs:
            return self._run(node, costs[node].kind == "view")
        return 0.0

    def _run(self, node: fx.Node, view: bool) -> float:
        inputs = [a for a in node.all_input_nodes if tensors_of(a.meta.get("val"))]
        if view:
            if inputs:
                self.root[node] = self._root(inputs[0])
            return 0.0
        sizes = [_nbytes(a) for a in inputs]
        hot = sum(size for a, size in zip(inputs, sizes) if self._cached(self._root(a), size))
        for a, size in zip(inputs, sizes):
            self._touch(self._root(a), size)
        written = written_inputs(node)
        if len(written) == 1:  # an in-place op's result is the tensor it wrote (`mul_`, `mm.out`)
            self.root[node] = self._root(written[0])
        self._touch(self._root(node), _nbytes(node))
        total = sum(sizes)
        return hot / total if total else 0.0


def _nbytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(node.meta.get("val")))


def _check_machine_world(machine: Machine, groups: dict, names: dict) -> None:
    """Refuse a step with a collective over more ranks than `machine` was built for: its links
    (NVLink within a node, the network beyond) were chosen for that many (`h100_sxm(world_size=)`,
    `cluster_machine(world_size=)`)."""
    if not machine.world_size or not groups:
        return
    issue, size = max(groups.items(), key=lambda kv: kv[1])
    if size > machine.world_size:
        raise ValueError(
            f"simulate: the step's {names[issue].label} spans {size} ranks, but the machine was built for "
            f"{machine.world_size} ({machine.name}); build it for the run's world size (e.g. "
            f"fs.analysis.cluster_machine(gpu, world_size={size}) or fs.analysis.h100_sxm(world_size={size}))"
        )


def _group(c, world: int) -> int:
    args = c.issue.args
    if c.kind == "all_gather":
        return int(args[1])
    if c.kind == "reduce_scatter":
        return int(args[2]) if isinstance(args[2], int) else len(args[1])
    return world
