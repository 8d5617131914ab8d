"""Which mesh axis a collective of a traced graph runs on, read from its process group's name.

Every `_c10d_functional` collective names its process group (its `group_name` argument), and
the name says where it runs:

- on an `fs.analysis.AbstractMesh`, `"abstract:<axis>:<name>=<size>,..."`: the axis (`world`
  for every axis at once) and the mesh's shape, so the group's size and how its ranks lie
  (its stride: the distance in ranks between neighbours, 1 for the mesh's last axis) are
  known from the graph alone;
- on an `fs.Mesh`, torch's name of the group: its axis is read from the mesh when one is
  given (the groups it made per axis), else from the process group itself while it exists
  (`DeviceMesh` describes the group of axis `a` as `mesh_<a>`; its ranks give size and stride).

A collective whose group cannot be resolved has axis "" (and size, stride 0): the analyses
then fall back to what they did before axes existed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import fx

__all__ = ["GroupAxis", "abstract_group_name", "group_name", "collective_axis"]

_ABSTRACT = "abstract"
WORLD = "world"


class GroupAxis(NamedTuple):
    """The mesh axis of one collective's process group, and how the group's ranks lie."""

    axis: str  # the mesh axis it spans ("fsdp", "tp", ...); "world" for every axis at once; "" unknown
    size: int  # ranks in the group (0: unknown)
    stride: int  # distance in global ranks between consecutive members (1: neighbours; 0: unknown)


def abstract_group_name(axis: str, shape: dict[str, int]) -> str:
    """The group name an abstract mesh of `shape` (axis -> size) gives its collectives over
    `axis` ("world" for every axis): `"abstract:<axis>:<name>=<size>,..."`."""
    return f"{_ABSTRACT}:{axis}:" + ",".join(f"{a}={n}" for a, n in shape.items())


def group_name(issue: fx.Node) -> str | None:
    """The `group_name` argument of a collective's issue node, or None."""
    schema = getattr(issue.target, "_schema", None)
    if schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name == "group_name":
            value = issue.args[i] if i < len(issue.args) else issue.kwargs.get("group_name")
            return value if isinstance(value, str) else None
    return None


def _from_shape(axis: str, shape: dict[str, int]) -> GroupAxis:
    if axis == WORLD:
        return GroupAxis(WORLD, math.prod(shape.values()), 1)
    if axis not in shape:
        return GroupAxis(axis, 0, 0)
    names = list(shape)
    stride = math.prod(shape[a] for a in names[names.index(axis) + 1 :])
    return GroupAxis(axis, shape[axis], stride)


def _abstract(name: str) -> GroupAxis | None:
    parts = name.split(":")
    if parts[0] != _ABSTRACT or len(parts) < 2:
        return None
    axis = parts[1]
    shape: dict[str, int] = {}
    for item in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
        a, _, n = item.partition("=")
        if not n.isdigit():
            return GroupAxis(axis, 0, 0)
        shape[a] = int(n)
    return _from_shape(axis, shape) if shape else GroupAxis(axis, 0, 0)


def _of_mesh(name: str, mesh) -> GroupAxis | None:
    """`name` among the groups of an `fs.Mesh` (read from its private tables: the groups it made)."""
    if name == getattr(mesh, "_world_group_name", None):
        return _from_shape(WORLD, mesh.shape)
    for table in ("_group_names", "_gather_group_names", "_reduce_group_names"):
        for axis, group in getattr(mesh, table, {}).items():
            if group == name:
                return _from_shape(axis, mesh.shape)
    return None


def _of_process_group(name: str) -> GroupAxis | None:
    """`name` resolved to a live process group of this process (its description and ranks)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.distributed_c10d._resolve_process_group(name)
        ranks = sorted(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a name no live group holds: unknown, as documented
        return None
    description = getattr(group, "group_desc", "") or ""
    if len(ranks) == dist.get_world_size():
        axis = WORLD if not description.startswith("mesh_") else description.removeprefix("mesh_")
    else:
        axis = description.removeprefix("mesh_") if description.startswith("mesh_") else ""
    stride = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    return GroupAxis(axis, len(ranks), stride)


def collective_axis(issue: fx.Node, mesh=None) -> GroupAxis:
    """The axis of the process group the collective issued by `issue` runs on (see the module
    docstring).

    Arguments:
        issue: a collective's issue node (`_c10d_functional.all_gather_into_tensor`, ...).
        mesh: the `fs.Mesh` the step ran on, when the graph's group names are torch's (optional:
            without it they are looked up among this process's live process groups).
    """
    name = group_name(issue)
    if name is None:
        return GroupAxis("", 0, 0)
    found = _abstract(name)
    if found is None and mesh is not None:
        found = _of_mesh(name, mesh)
    if found is None:
        found = _of_process_group(name)
    return found or GroupAxis("", 0, 0)
