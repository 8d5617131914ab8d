"""A mesh of other axes over a rank's world, made once per axes in a rank process (the world's
group is reused; every test of the process that asks for the same axes gets the same mesh)."""

from __future__ import annotations

import functional_shard as fs

_MESHES: dict[tuple, fs.Mesh] = {}


def mesh_of(world_mesh, axes: dict[str, int]):
    """`world_mesh` itself when it has `axes`, else the process's mesh of `axes`."""
    if dict(world_mesh.shape) == axes:
        return world_mesh
    key = tuple(axes.items())
    if key not in _MESHES:
        _MESHES[key] = fs.init_mesh(axes)
    return _MESHES[key]
