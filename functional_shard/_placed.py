"""Placing a parameter tree on a mesh: tensor-parallel placements first, FSDP's flat buffers of
what is left.

    placements = resolve_placements(params, rules, mesh)   # per leaf: a Split, or None (whole)
    layout, local_leaves = place(params, placements, mesh)  # each rank's pieces, laid out for FSDP

The rules are those of `fs.tensor_parallel` (`rule`, `hf_rules`, `gpt_rules`, or a dict pattern
-> placement). Everything is checked before any tensor moves, and the error names the leaf, its
shape, the dimension and the axis: a split dimension not divisible by the axis size (or by whole
heads), a rule that matches nothing, an axis the mesh does not have, a split of a module buffer
or over a data-parallel axis. Ranks that resolved different placements (different plans) are
told apart by their layouts, which the step compares across ranks before sharding
(`check_same_layout`: the message names the ranks and the first leaf they lay out differently).

Ranks may also hold different leaves on purpose: a pipelined step's ranks hold the units of their
own stages. `layout_groups` tells which ranks share a layout (one digest each), and `layouts_say`
(over `gather_texts`) lets the first rank of each group describe its own to the others (what a
checkpoint or an export of the whole model needs from ranks that do not hold it).
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any, Sequence

import torch

from . import _tracing
from ._agreement import digest
from ._basemesh import gather_texts  # noqa: F401 - re-exported: checkpoints and export read it here
from ._layout import Layout, make_layout
from ._split_values import SplitValues, WholeLeafError
from ._mesh import BaseMesh, MeshError
from ._pytree import tree_flatten, tree_paths, tree_unflatten
from ._tree import BUFFER, TRAINABLE, leaf_roles
from ._units import Units
from .tensor_parallel._placement import PlacementError, Split, placements_for, split_tensor

__all__ = ["resolve_placements", "place", "split_leaves", "check_same_layout", "layout_groups", "layouts_say", "gather_texts"]


def styled_axes(params: Any, rules: Any, placements: tuple | None) -> dict[str, tuple[str, str]]:
    """Model axis -> (the first leaf, its style) of the leaves `rules` split (`placements`:
    `resolve_placements`'s) with a style that changes their module's forward (`colwise`,
    `rowwise`, `embedding_rowwise`, ...): a step over such leaves must issue tensor-parallel
    collectives over that axis (`check_parallelized`)."""
    from .tensor_parallel._modules import _NO_FORWARD, _style_of
    from .tensor_parallel._placement import _as_rules

    if rules is None or placements is None:
        return {}
    rules = _as_rules(rules)
    out: dict[str, tuple[str, str]] = {}
    for path, leaf, placement in zip(tree_paths(params), tree_flatten(params)[0], placements):
        if placement is None or placement.axis in out:
            continue
        style = _style_of(path, tuple(leaf.shape), rules)
        if style is not None and style not in _NO_FORWARD:
            out[placement.axis] = (path, style)
    return out


def check_parallelized(styled: dict[str, tuple[str, str]], seen: set, where: str) -> None:
    """Raise `PlacementError` when `loss_fn` worked over none of the model axes `styled` names
    (`_tracing.recording_model_axes`): its modules ran unparallelized on the split pieces."""
    for axis, (path, style) in styled.items():
        if axis not in seen:
            raise PlacementError(
                f"{where}: the placements give {path!r} the tensor-parallel style {style!r} over {axis!r}, but loss_fn "
                f"issued no tensor-parallel collective over {axis!r}: the model's modules ran unparallelized on the "
                f"split pieces, which computes the wrong values without an error. Call "
                f"fs.tensor_parallel.parallelize(model, rules, mesh) before fs.functionalize(model)"
            )


class CheckedLoss:
    """`loss_fn`, checked on every call that the model axes its styled placements need
    (`styled`, set by the step's `init`) saw tensor-parallel collectives (`check_parallelized`),
    and, where leaves are split over a model axis, with what varies over it followed
    (`SplitValues`: dropout on split activations drawn per rank, a whole trainable leaf used with
    one refused); `loss_fn` itself where nothing is split."""

    def __init__(self, loss_fn: Any):
        self.loss_fn = loss_fn
        self.styled: dict[str, tuple[str, str]] = {}
        self.split: tuple[str, ...] = ()  # the model axes leaves are split over
        self.split_leaves: tuple[int, ...] = ()  # those leaves (flatten order of the parameters)
        self.whole_leaves: tuple[tuple[int, str], ...] = ()  # the trainable leaves kept whole: (index, path)
        self.mesh: BaseMesh | None = None
        functools.update_wrapper(self, loss_fn, updated=())

    def place(self, params: Any, rules: Any, placements: tuple | None, mesh: BaseMesh) -> None:
        """Set what is checked from the step's `rules` and their `placements` on `params`."""
        self.styled = styled_axes(params, rules, placements)
        self.split = tuple(dict.fromkeys(p.axis for p in placements or () if p is not None))
        self.split_leaves = tuple(i for i, p in enumerate(placements or ()) if p is not None)
        if placements is not None:
            paths, roles = tree_paths(params), leaf_roles(params)
            self.whole_leaves = tuple((i, paths[i]) for i, p in enumerate(placements) if p is None and roles[i] == TRAINABLE)
        self.mesh = mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.styled and not self.split:
            return self.loss_fn(*args, **kwargs)
        followed = contextlib.nullcontext()
        if self.split and args:
            leaves = tree_flatten(args[0])[0]
            followed = SplitValues(
                self.mesh, self.split, [leaves[i] for i in self.split_leaves if i < len(leaves)],
                [(path, leaves[i]) for i, path in self.whole_leaves if i < len(leaves)],
            )  # fmt: skip
        with _tracing.recording_model_axes() as seen:
            try:
                with followed:
                    out = self.loss_fn(*args, **kwargs)
            except WholeLeafError:
                check_parallelized(self.styled, seen, "loss_fn")  # a model never parallelized: that is the fault
                raise
        check_parallelized(self.styled, seen, "loss_fn")
        return out


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
        # `placements_for` refused an axis the mesh lacks and a data axis (`_checked_split`).
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
    params: Any, placements: tuple | None, mesh: BaseMesh, *, units: Units = None, precision: Any = None, blocks: int = 0
) -> tuple[Layout, list[torch.Tensor]]:
    """The layout of this rank's pieces of `params` and those pieces (flatten order): each leaf
    cut by its placement (`resolve_placements`), then laid out in flat buffers sharded over the
    mesh's shard axis (`make_layout`; `blocks`: canonical blocks per buffer). No collective."""
    if placements is None:
        return make_layout(params, mesh.num_shards, units=units, precision=precision, blocks=blocks)
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
        blocks=blocks,
    )


def layout_lines(layout: Layout) -> list[str]:
    """What ranks must agree on, one line each: every leaf (path, its piece or whole shape and
    placement, dtype, role), every buffer (leaves, gather and reduce dtypes), the shards and the
    tree structure. Two ranks' lists are equal exactly when their `signature()`s are."""
    lines = []
    for i, path in enumerate(layout.paths):
        placement, shape = layout.placement(i), list(layout.shapes[i])
        full = list(layout.full_shape(i))
        where = f"whole {shape}" if placement is None else f"piece {shape} of {full} by {placement!r}"
        lines.append(f"leaf {path!r}: {where}, {str(layout.dtypes[i]).removeprefix('torch.')}, {layout.roles[i]}")
    for b in layout.buffers:
        lines.append(f"buffer {b.name!r}: leaves {list(b.leaves)}, in {b.gather_dtype} / {b.reduce_dtype}")
    lines.append(f"{layout.num_shards} shard(s) of the tree {layout.treedef}")
    return lines


def check_same_layout(layout: Layout, mesh: BaseMesh) -> None:
    """Raise `MeshError` on every rank unless every rank laid out the same tree the same way
    (paths, shapes, dtypes, roles, units, placements). The message names the groups of ranks and
    what each holds where they first differ: a leaf split on some ranks and whole on others
    (plans that differ across ranks), a leaf of another shape. A collective: one small
    all-gather when they agree."""
    try:
        mesh.check_same_sequence("the parameter pytree", layout_lines(layout))
    except MeshError as error:
        if not error.differences:
            raise
        groups: dict[str, list[int]] = {}
        for rank, line in sorted(error.differences.items()):
            groups.setdefault(line, []).append(rank)
        held = "; ".join(f"ranks {ranks} hold {line}" for line, ranks in groups.items())
        raise MeshError(
            f"ranks disagree on the parameter pytree (paths, shapes, dtypes, units, placements) in step.init: {held} "
            f"(the first difference). Every rank of the {mesh.describe()} must pass the same params and the same "
            f"placements= rules: is the model or the plan built from something that differs across ranks?",
            error.differences,
        ) from None


def layout_groups(layout: Layout, mesh: BaseMesh) -> tuple[int, ...]:
    """Per rank (rank order), the lowest rank whose layout equals its own (`Layout.signature`):
    ranks of one group hold the same leaves laid out the same way (all ranks of a step without a
    pipeline; the ranks of one pipeline coordinate with one). A collective: one all-gather of a
    digest per rank."""
    if mesh.world_size == 1:
        return (0,)
    mine = torch.tensor([digest(layout.signature())], dtype=torch.int64, device=getattr(mesh, "device", None))
    first: dict[int, int] = {}
    return tuple(first.setdefault(d, rank) for rank, d in enumerate(mesh.all_gather_world(mine).tolist()))


def layouts_say(mesh: BaseMesh, groups: tuple[int, ...], value: Any) -> dict[int, Any]:
    """What the first rank of each layout group says (`value`, anything JSON holds; the other
    ranks' is not sent), by that rank, in rank order (`groups`: `layout_groups`). A collective:
    `gather_texts`, on every rank."""
    said = gather_texts(mesh, json.dumps(value) if mesh.rank == groups[mesh.rank] else "")
    return {g: json.loads(said[g]) for g in sorted(set(groups))}
