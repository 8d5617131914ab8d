"""`analyze(compiled)`: what a traced step will cost, read from its graph before it runs.

Everything is read from a `CompiledStep` (`step.lower(state, batch)`): FLOPs per unit and phase,
the bytes of every collective, and the peak memory per rank. Nothing runs; the graph may have
been traced with fake tensors for a mesh that does not exist (`fs.analysis.AbstractMesh`).
"""

from __future__ import annotations

from typing import NamedTuple

from .. import schedule as schedule_lib
from ..schedule._axes import GroupAxis, collective_axis
from ._costs import node_cost
from ._fusion import compiled_intermediates
from ._memory import MemoryEstimate, estimate_memory
from ._labels import serving_unit
from ._regions import NodeRoles, node_roles

__all__ = ["UnitCost", "CollectiveCost", "Analysis", "analyze"]


class UnitCost(NamedTuple):
    """FLOPs and memory traffic of one unit's computation, per phase ("" is the rest of the step)."""

    unit: str  # the unit ("" for nodes outside every unit's region: the loss, glue)
    forward_flops: int  # in its forward region
    backward_flops: int  # in its backward region
    update_flops: int  # the optimizer's update of its shard
    forward_bytes: int  # bytes read and written by its forward nodes
    backward_bytes: int  # ... by its backward nodes
    update_bytes: int  # ... by its update nodes
    forward_ops: int = 0  # elementwise arithmetic in its forward region (FLOPs the registry does not count)
    backward_ops: int = 0  # ... in its backward region
    update_ops: int = 0  # ... in the optimizer's update of its shard (AdamW: ~15 per element)


class CollectiveCost(NamedTuple):
    """One collective of the step."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    unit: str  # the unit it moves ("a+b" for a bucket); for one that moves no buffer (a tensor-parallel
    # all-reduce of activations), the unit whose computation it serves; "" for the loss's all-reduce
    buffer: str  # the flat buffer(s) it moves ("" for activations and scalars)
    phase: str  # "forward" | "backward" | "update"
    nbytes: int  # bytes of the full buffer: the all-gather's output, the reduce-scatter's and all-reduce's input
    group_size: int  # ranks taking part (0: unknown)
    issue: str  # name of the node that issues it
    wait: str  # name of the node that waits for it
    axis: str = ""  # the mesh axis its group spans: "fsdp", "tp", ...; "world" for every axis; "" unknown


class Analysis(NamedTuple):
    """What one traced step costs on one rank (`fs.analysis.analyze`)."""

    units: tuple  # UnitCost per unit, in order of first computation, then ""
    collectives: tuple  # CollectiveCost per collective, in issue order
    flops: int  # total FLOPs of the step on this rank (torch's flop registry: matrix products, ...)
    all_gather_bytes: int  # full bytes all-gathered per step (sum of `nbytes`)
    reduce_scatter_bytes: int  # full bytes reduce-scattered per step
    all_reduce_bytes: int  # bytes all-reduced per step
    memory: MemoryEstimate  # predicted peak memory per rank, with its breakdown and timeline
    num_nodes: int  # nodes of the graph
    ops: int = 0  # total elementwise arithmetic of the step on this rank (`UnitCost.*_ops`)

    def bytes_per_axis(self) -> dict:
        """Bytes of the step's collectives per mesh axis and kind: `{axis: {kind: bytes}}`
        (`CollectiveCost.nbytes` summed; "world" for collectives over every axis at once)."""
        out: dict = {}
        for c in self.collectives:
            per_kind = out.setdefault(c.axis, {})
            per_kind[c.kind] = per_kind.get(c.kind, 0) + c.nbytes
        return out

    def fits(self, bytes_per_device: int) -> bool:
        """Whether the predicted peak stays within `bytes_per_device`."""
        return self.memory.peak <= bytes_per_device

    def summary(self) -> str:
        """A readable account: FLOPs per phase, bytes per collective kind, peak memory and its parts."""
        gib = 2**30
        f = sum(u.forward_flops for u in self.units)
        b = sum(u.backward_flops for u in self.units)
        o = sum(u.update_flops for u in self.units)
        ops = [sum(getattr(u, f"{phase}_ops") for u in self.units) for phase in ("forward", "backward", "update")]
        lines = [
            f"{self.num_nodes} nodes, {len(self.units)} units, {len(self.collectives)} collectives",
            f"FLOPs per rank: forward {f / 1e12:.3f} T, backward {b / 1e12:.3f} T, update {o / 1e12:.4f} T",
            "elementwise operations per rank: " + ", ".join(f"{p} {n / 1e9:.3f} G" for p, n in zip(("forward", "backward", "update"), ops)),
            f"per step: all-gather {self.all_gather_bytes / gib:.3f} GiB, reduce-scatter "
            f"{self.reduce_scatter_bytes / gib:.3f} GiB, all-reduce {self.all_reduce_bytes / gib:.6f} GiB",
            *(
                f"  over {axis or 'an unknown group'}: "
                + ", ".join(f"{kind.replace('_', '-')} {n / gib:.6f} GiB" for kind, n in kinds.items())
                for axis, kinds in self.bytes_per_axis().items()
            ),
            f"peak memory per rank {self.memory.peak / gib:.3f} GiB at {self.memory.peak_node}: "
            + ", ".join(f"{name} {value / gib:.3f}" for name, value in self.memory.breakdown._asdict().items()),
        ]
        if self.memory.host_peak:
            lines.append(
                f"host memory per rank (CPU offload): peak {self.memory.host_peak / gib:.3f} GiB, of which the "
                f"offloaded state {self.memory.host_resident / gib:.3f} GiB; the peak above is the device's"
            )
        return "\n".join(lines)


def analyze(compiled, *, roles: NodeRoles | None = None, mesh=None) -> Analysis:
    """FLOPs, collective bytes and peak memory of a traced step, without running it.

    Arguments:
        compiled: a `CompiledStep`, from `step.lower(state, batch)` (or `step.cache`). Its
            graph may hold fake tensors of any size: only shapes and dtypes are read.
        roles: `node_roles(compiled.graph_module)` if already computed (it is what takes time
            on large graphs).
        mesh: the `fs.Mesh` the step runs on, to name the axis of each collective whose group
            is torch's (optional: an `AbstractMesh`'s graph names its axes itself, and a live
            process group is found by its name).

    Returns an `Analysis` for one rank (every rank runs the same graph, up to batch shapes).
    """
    gm = compiled.graph_module
    roles = roles or node_roles(gm)
    costs: dict[str, list[int]] = {}
    for node in gm.graph.nodes:
        phase = roles.phase[node]
        if phase not in ("forward", "backward", "update"):
            continue
        cost = node_cost(node)
        row = costs.setdefault(roles.unit[node], [0] * 9)
        column = ("forward", "backward", "update").index(phase)
        row[column] += cost.flops
        row[3 + column] += cost.bytes
        row[6 + column] += cost.ops
    order = [r.unit for r in roles.regions if r.phase == "forward"]
    units = [u for u in dict.fromkeys(order + list(costs)) if u in costs and u != ""]
    if "" in costs:
        units.append("")
    collectives = []
    for c in schedule_lib.collectives(gm):
        group = collective_axis(c.issue, mesh)
        collectives.append(
            CollectiveCost(
                kind=c.kind,
                unit=c.unit or serving_unit(c.issue, roles),
                buffer=c.buffer,
                phase=c.phase,
                nbytes=c.nbytes,
                group_size=_group_size(c, group),
                issue=c.issue.name,
                wait=c.wait.name,
                axis=group.axis,
            )
        )
    collectives = tuple(collectives)
    return Analysis(
        units=tuple(UnitCost(u, *costs[u]) for u in units),
        collectives=collectives,
        flops=sum(sum(costs[u][:3]) for u in costs),
        all_gather_bytes=sum(c.nbytes for c in collectives if c.kind == "all_gather"),
        reduce_scatter_bytes=sum(c.nbytes for c in collectives if c.kind == "reduce_scatter"),
        all_reduce_bytes=sum(c.nbytes for c in collectives if c.kind == "all_reduce"),
        memory=estimate_memory(gm, roles, compiled.io, compiled_intermediates(gm)),
        num_nodes=len(gm.graph.nodes),
        ops=sum(sum(costs[u][6:]) for u in costs),
    )


def _group_size(c, group: GroupAxis) -> int:
    """Ranks in a collective's group: its axis's size when known, else from its arguments
    (all_gather / reduce_scatter: group size; all_to_all: its number of splits; all_reduce:
    not in the op, reported as 0)."""
    if group.size:
        return group.size
    args = c.issue.args
    if c.kind == "all_gather":
        return int(args[1])
    if c.kind == "reduce_scatter":
        return int(args[2]) if isinstance(args[2], int) else len(args[1])
    return 0
