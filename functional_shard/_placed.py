"""Placing a parameter tree on a mesh: tensor-parallel placements first, FSDP's flat buffers of
what is left.

    placements = resolve_placements(params, rules, mesh)   # per leaf: a Split, or None (whole)
    layout, local_leaves = place(params, placements, mesh)  # each rank's pieces, laid out for FSDP

The rules are those of `fs.tensor_parallel` (`rule`, `hf_rules`, `gpt_rules`, or a dict pattern
-> placement). Everything is checked before any tensor moves, and the error names the leaf, its
shape, the dimension and the axis: a split dimension not divisible by the axis size (or by whole
heads), a rule that matches nothing, an axis the mesh does not have, a split of a module buffer
or over a data-parallel axis. Ranks that resolved different placements (different plans) are
told apart by the layout's signature, which the step compares across ranks before sharding.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ._layout import Layout, make_layout
from ._mesh import BaseMesh
from ._pytree import tree_flatten, tree_paths, tree_unflatten
from ._tree import BUFFER, leaf_roles
from ._units import Units
from .tensor_parallel._placement import PlacementError, Split, placements_for, split_tensor

__all__ = ["resolve_placements", "place", "split_leaves"]


def resolve_placements(params: Any, rules: Any, mesh: BaseMesh) -> tuple | None:
    """Per leaf of `params` (flatten order), its placement on `mesh`: a `Split` with a
    non-negative dim over a model-parallel axis of more than one rank, or None for a leaf every
    rank of the model axes holds whole. None when `rules` is None or nothing is split.

    Raises `PlacementError` (before any collective) naming the leaf and what to do."""
    if rules is None:
        return None
    leaves, _ = tree_flatten(params)
    paths = tree_paths(params)
    roles = leaf_roles(params)
    shapes = [tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else () for leaf in leaves]
    resolved = placements_for(list(zip(paths, shapes)), rules, mesh)
    out: list = []
    for path, shape, role in zip(paths, shapes, roles):
        placement = resolved[path]
        if not isinstance(placement, Split):
            out.append(None)
            continue
        if placement.axis not in mesh.shape or placement.axis in mesh.data_axes:
            raise PlacementError(
                f"leaf {path!r} (shape {list(shape)}) is split over axis {placement.axis!r}: a placement splits a leaf "
                f"over a model-parallel axis ('tp'); the data-parallel axes {list(mesh.data_axes)} of the "
                f"{mesh.describe()} shard the flat buffers on their own (FSDP). Use Split(dim, 'tp')"
            )
        if mesh.shape[placement.axis] == 1:
            out.append(None)
            continue
        if role == BUFFER:
            raise PlacementError(
                f"leaf {path!r} (shape {list(shape)}) is a module buffer (every rank keeps its own copy whole) but a "
                f"rule splits it ({placement.describe()}): narrow the rule's pattern to parameters"
            )
        out.append(placement)
    return tuple(out) if any(p is not None for p in out) else None


def split_leaves(leaves: Sequence[torch.Tensor], placements: Sequence | None, mesh: BaseMesh) -> list[torch.Tensor]:
    """This rank's piece of every leaf (views where a placement has one block; leaves that are
    not split are returned as they are)."""
    if placements is None:
        return list(leaves)
    coordinates, sizes = mesh.coordinates, mesh.shape
    return [
        leaf if p is None else split_tensor(leaf, p, coordinates[p.axis], sizes[p.axis])
        for leaf, p in zip(leaves, placements)
    ]


def place(
    params: Any, placements: tuple | None, mesh: BaseMesh, *, units: Units = None, precision: Any = None
) -> tuple[Layout, list[torch.Tensor]]:
    """The layout of this rank's pieces of `params` and those pieces (flatten order): each leaf
    cut by its placement (`resolve_placements`), then laid out in flat buffers sharded over the
    mesh's shard axis (`make_layout`). No collective."""
    if placements is None:
        return make_layout(params, mesh.num_shards, units=units, precision=precision)
    leaves, treedef = tree_flatten(params)
    pieces = split_leaves(leaves, placements, mesh)
    local_tree = tree_unflatten(treedef, pieces)
    return make_layout(
        local_tree,
        mesh.num_shards,
        units=units,
        precision=precision,
        placements=placements,
        full_shapes=[tuple(leaf.shape) for leaf in leaves],
    )
