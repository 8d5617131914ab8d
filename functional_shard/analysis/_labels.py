"""How the analyses name a collective: its axis, the unit it serves, its phase and its label.

FSDP's collectives move a parameter buffer and carry its unit (`blocks.3`); a tensor-parallel
collective moves activations (no buffer) and is named by its axis and the unit whose
computation it serves: `tp all_reduce model.layers.3` in the timeline, the Chrome trace, the
Gantt chart and the simulator, never as a unit's buffer or as the loss. The loss's
all-reduce (and the grad norm's) stay `all_reduce loss`.
"""

from __future__ import annotations

from typing import NamedTuple

from ..schedule._axes import GroupAxis, collective_axis
from ._regions import NodeRoles

__all__ = ["CollectiveName", "name_collective", "serving_unit", "MODEL_AXES"]

# The model-parallel axes (`fs.Mesh`'s meaning of the names): their collectives move
# activations, on the critical path.
MODEL_AXES = ("tp", "pp", "cp")


class CollectiveName(NamedTuple):
    """What the analyses call one collective."""

    label: str  # "all_gather blocks.3", "tp all_reduce model.layers.3", "all_reduce loss"
    unit: str  # the unit it moves or serves ("" for the loss)
    phase: str  # "forward" | "backward" | "update"
    group: GroupAxis  # the axis of its group, its size and stride
    model_parallel: bool  # whether it runs on a model-parallel axis (tensor parallelism: activations)


def serving_unit(issue, roles: NodeRoles, depth: int = 8) -> str:
    """The unit a collective that moves no parameter buffer serves: that of its issue node, or
    else of the nearest computation its input comes from (a row-parallel product's output,
    through views), up to `depth` nodes back; "" if none (the loss's all-reduce)."""
    if roles.unit.get(issue):
        return roles.unit[issue]
    frontier = list(issue.all_input_nodes)
    for _ in range(depth):
        found = [roles.unit[n] for n in frontier if roles.unit.get(n)]
        if found:
            return found[0]
        frontier = [a for n in frontier if n.op == "call_function" for a in n.all_input_nodes]
        if not frontier:
            break
    return ""


def name_collective(c, roles: NodeRoles, mesh=None) -> CollectiveName:
    """The name of collective `c` (an `fs.schedule.Collective` of the graph `roles` describe).

    Arguments:
        c: the collective.
        roles: `node_roles` of its graph.
        mesh: the `fs.Mesh` its step ran on (optional; see `schedule._axes.collective_axis`).
    """
    group = collective_axis(c.issue, mesh)
    model_parallel = not c.buffer and group.axis in MODEL_AXES
    if model_parallel:
        unit = serving_unit(c.issue, roles)
        label = f"{group.axis} {c.kind} {unit}".rstrip()
        return CollectiveName(label, unit, c.phase, group, True)
    phase = c.phase if c.kind == "all_gather" else ("backward" if c.kind == "reduce_scatter" else "update")
    return CollectiveName(f"{c.kind} {c.unit or 'loss'}", c.unit, phase, group, False)
