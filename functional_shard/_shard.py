"""The sharding transforms on pytrees: `shard`, `gather`, `reduce_scatter`, `all_reduce`.

    gather(shard(tree, mesh)) == tree                      (bit-exact, every rank)
    reduce_scatter(tree, mesh) == shard(all_reduce(tree, mesh), mesh)
    sum_ranks <gather(s), y> == sum_ranks <s, reduce_scatter(y)>     (adjoint, 1-D meshes)

`gather` and `reduce_scatter` are differentiable and each is the other's gradient, so
`torch.func.grad(lambda s: loss(gather(s)))(shard(params))` is this rank's slice of the
gradient summed over ranks: the reduce-scattered gradient of FSDP.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._collectives import AllReduceFlat, GatherFlat, ReduceScatterFlat, gather_bytes
from ._layout import BufferSpec, Layout, LayoutError, make_layout
from ._mesh import BaseMesh
from ._offload import to_device
from ._pytree import pytree_dataclass, static_field, tree_flatten
from ._placed import place, resolve_placements
from ._units import Units
from .tensor_parallel._collectives import gather_leaf

__all__ = ["Sharded", "shard", "gather", "reduce_scatter", "all_reduce", "gather_buffer", "gather_full"]


@pytree_dataclass
class Sharded:
    """This rank's part of a sharded pytree (made by `fs.shard` or `fs.reduce_scatter`).

    Attributes:
        layout: where each leaf lives (`Layout`); identical on every rank.
        mesh: the mesh it is sharded over.
        shards: one 1-D tensor `[spec.shard_numel]` per flat buffer (`layout.buffers`), this
            rank's slice.
        local: the leaves kept whole on every rank (module buffers), in layout order.

    An immutable pytree node (optree and torch): its leaves are `shards` then `local`; layout
    and mesh are static, so `torch.func.grad` of a function of a `Sharded` returns a `Sharded`
    of gradients.
    """

    layout: Layout = static_field()
    mesh: BaseMesh = static_field()
    shards: tuple = ()
    local: tuple = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(self.shards))
        object.__setattr__(self, "local", tuple(self.local))

    def __repr__(self) -> str:
        units = ", ".join(f"{b.name}: {str(b.dtype).removeprefix('torch.')}[{b.shard_numel}]" for b in self.layout.buffers)
        return f"Sharded({units}; {len(self.local)} local leaves; {self.mesh!r})"

    def __reduce__(self):
        raise TypeError(
            "a Sharded holds one rank's shards bound to a live mesh, so it cannot be pickled: save a step's "
            "state with fs.checkpoint.save(path, state), and gather a Sharded with fs.gather to pickle its values"
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        """Buffer name -> this rank's shard."""
        return {spec.name: s for spec, s in zip(self.layout.buffers, self.shards)}

    def trainable(self) -> dict[str, torch.Tensor]:
        """Buffer name -> this rank's shard, of the trainable buffers (what an optimizer holds state for)."""
        return {spec.name: s for spec, s in zip(self.layout.buffers, self.shards) if spec.trainable}

    def replace(self, shards=None, local=None) -> "Sharded":
        """A copy with other shards and/or local leaves (same layout and mesh)."""
        return Sharded(
            self.layout, self.mesh, self.shards if shards is None else shards, self.local if local is None else local
        )


def shard(tree: Any, mesh: BaseMesh, *, units: Units = None, placements: Any = None) -> Sharded:
    """Cut a pytree into flat per-unit buffers and keep this rank's slice of each.

    Arguments:
        tree: a pytree of tensors, the same (values, shapes, dtypes) on every rank. A
            `ModuleParams` in it keeps its buffers whole (each rank its own) and marks frozen
            parameters.
        mesh: the mesh; slices are taken along its shard axis.
        units: the unit policy, an `fs.UnitPolicy` or a function `path -> unit name` (default
            `fs.BlockUnits()`: one unit per repeated block, `input` and `output` around them).
        placements: tensor-parallel placement rules (`fs.tensor_parallel`), required on a mesh
            with a `tp` axis: each leaf is first cut by its placement, and the flat buffers of
            this rank's pieces are sharded over the shard axis.

    Returns a `Sharded`; `gather` of it gives `tree` back exactly (`gather(..., full=True)`
    with placements: `gather` alone gives this rank's pieces).
    """
    mesh.check_model_axes("fs.shard", supported=("tp",) if placements is not None else ())
    resolved = resolve_placements(tree, placements, mesh)
    layout, pieces = place(tree, resolved, mesh, units=units)
    return shard_leaves(layout, pieces, mesh)


def shard_leaves(layout: Layout, leaves: list[torch.Tensor], mesh: BaseMesh) -> Sharded:
    """`shard` for a tree already flattened into `leaves` with its `layout`."""
    shards = [layout.shard_of(layout.flatten_buffer(spec, leaves), spec, mesh.shard_index) for spec in layout.buffers]
    return Sharded(layout, mesh, shards, [leaves[i] for i in layout.local])


def gather(sharded: Sharded, *, full: bool = False) -> Any:
    """All-gather every buffer of a `Sharded` and rebuild the full pytree, on every rank.

    Differentiable in the shards of floating dtype: the gradient is `reduce_scatter` of the
    cotangent (summed over ranks). Leaves of other dtypes are moved bit for bit.

    Arguments:
        sharded: made by `shard` or `reduce_scatter` (or a `torch.func` transform of one).
        full: with tensor-parallel placements, also join every split leaf over its axis
            (`fs.tensor_parallel.gather_leaf`): the original tree on every rank. Default: this
            rank's pieces (what a tensor-parallel `loss_fn` computes with).
    """
    if not isinstance(sharded, Sharded):
        raise TypeError(f"gather expects a Sharded (made by fs.shard); got {type(sharded).__name__}")
    layout, mesh = sharded.layout, sharded.mesh
    _check_shards(sharded)
    leaves: dict[int, torch.Tensor] = {}
    for spec, s in zip(layout.buffers, sharded.shards):
        leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=spec.dtype.is_floating_point)))
    if full and layout.is_split:
        leaves = {i: t if layout.placements[i] is None else gather_leaf(t, layout.placements[i], mesh) for i, t in leaves.items()}
    return layout.assemble(leaves, sharded.local)


def gather_buffer(
    layout: Layout, spec: BufferSpec, shard: torch.Tensor, mesh: BaseMesh, *, differentiable: bool, alias: bool = False,
    device=None,
) -> list[torch.Tensor]:
    """All-gather one flat buffer and return its leaves (views of the full buffer, in `spec.leaves` order).

    Arguments:
        layout / spec: the layout and the buffer.
        shard: this rank's slice `[spec.shard_numel]`.
        mesh: the mesh.
        differentiable: gather with `GatherFlat` (its gradient is a reduce-scatter); else move
            the bytes without a gradient (any dtype).
        alias: where the gather is the identity (a mesh with no shard axis and no replicate
            axis, e.g. `{"tp": 2}`, and no cast), return views of `shard` itself instead of a
            copy; the gradient flows to it unchanged. The step's use: no second copy of the
            parameters alive through the step. Not for what is handed to the user, who may keep
            it past a step that updates the shards in place.

    The buffer is gathered in `spec.gather_dtype` (mixed precision), its gradient reduced in
    `spec.reduce_dtype`.
    """
    return layout.unflatten_buffer(spec, gather_full(spec, shard, mesh, differentiable=differentiable, alias=alias, device=device))


def gather_full(
    spec: BufferSpec, shard: torch.Tensor, mesh: BaseMesh, *, differentiable: bool, alias: bool = False, device=None
) -> torch.Tensor:
    """All-gather one flat buffer in `spec.gather_dtype`: `[spec.padded_numel]` on every rank
    (see `gather_buffer`, which returns its leaves, and says what `alias` does). `device`: the
    shard is in host memory (CPU offload) and is copied there first, cast on the way."""
    shard = shard.contiguous()
    if device is not None:
        if differentiable:
            return GatherFlat.apply(shard, mesh, spec, spec.gather_dtype, spec.reduce_dtype, device)
        return gather_bytes(to_device(shard.detach() if shard.requires_grad else shard, device, spec.gather_dtype), mesh, spec)
    if alias and mesh.shard_axis is None and not mesh.replicate_axes and spec.gather_dtype == spec.reduce_dtype == shard.dtype:
        return shard  # GatherFlat would copy it, and its backward copy the gradient: both the identity
    if differentiable:
        return GatherFlat.apply(shard, mesh, spec, spec.gather_dtype, spec.reduce_dtype)
    return gather_bytes(shard if spec.gather_dtype == shard.dtype else shard.to(spec.gather_dtype), mesh, spec)


def reduce_scatter(tree: Any, mesh: BaseMesh, *, units: Units = None) -> Sharded:
    """Sum a pytree over every rank of the mesh; each rank keeps its slice of each flat buffer.

    Differentiable: the gradient is `gather` of the cotangent. Leaves a `ModuleParams` marks as
    buffers are not sliced: each rank gets the whole sum.

    Arguments:
        tree: a pytree of tensors with the same structure, shapes and dtypes on every rank
            (values may differ). Bool leaves are refused: a sum of bools is not a bool.
        mesh: the mesh.
        units: as for `shard`; the same policy gives the same layout as `shard`.
    """
    mesh.check_data_parallel("fs.reduce_scatter")
    layout, leaves = make_layout(tree, mesh.num_shards, units=units)
    shards = []
    for spec in layout.buffers:
        if spec.dtype == torch.bool or spec.dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64):
            culprit = layout.describe_leaf(spec.leaves[0])
            raise LayoutError(f"reduce_scatter cannot sum {culprit}: the backend has no sum for {spec.dtype}")
        shards.append(ReduceScatterFlat.apply(layout.flatten_buffer(spec, leaves), mesh))
    local = [_all_reduce_leaf(leaves[i], mesh) for i in layout.local]
    return Sharded(layout, mesh, shards, local)


def all_reduce(tree: Any, mesh: BaseMesh, *, axes: tuple[str, ...] | None = None) -> Any:
    """Sum every leaf of a pytree over the ranks along `axes` (default: all), on every rank.

    Differentiable; the gradient is the same sum of the cotangent (self-adjoint).
    One collective per dtype: leaves of a dtype travel together in one flat buffer.
    """
    leaves, treedef = tree_flatten(tree)
    out: list[Any] = list(leaves)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise LayoutError(f"all_reduce: leaf {i} is a {type(leaf).__name__}, not a tensor")
        by_dtype.setdefault(leaf.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        if dtype == torch.bool:
            raise LayoutError(f"all_reduce cannot sum bool leaves (leaf {members[0]}); cast them first")
        sizes = [leaves[i].numel() for i in members]
        flat = torch.cat([leaves[i].reshape(-1) for i in members] + [leaves[members[0]].new_zeros(1)])
        summed = AllReduceFlat.apply(flat, mesh, axes)
        for i, piece in zip(members, torch.split(summed, sizes + [1])):
            out[i] = piece.view(leaves[i].shape)
    return optree.tree_unflatten(treedef, out)


def _all_reduce_leaf(leaf: torch.Tensor, mesh: BaseMesh) -> torch.Tensor:
    return all_reduce([leaf], mesh)[0]


def _check_shards(sharded: Sharded) -> None:
    layout = sharded.layout
    if len(sharded.shards) != len(layout.buffers):
        raise LayoutError(f"Sharded holds {len(sharded.shards)} shards but its layout has {len(layout.buffers)} buffers")
    for spec, s in zip(layout.buffers, sharded.shards):
        if not isinstance(s, torch.Tensor) or tuple(s.shape) != (spec.shard_numel,) or s.dtype != spec.dtype:
            got = f"{type(s).__name__}" if not isinstance(s, torch.Tensor) else f"shape {list(s.shape)} {s.dtype}"
            raise LayoutError(
                f"shard of buffer {spec.name!r} (leaves {[layout.paths[i] for i in spec.leaves][:4]}...) must be "
                f"[{spec.shard_numel}] {spec.dtype} on {sharded.mesh.describe()}; got {got}"
            )


def gather_kept(layout: Layout, shards, mesh: BaseMesh, kept=None) -> list[torch.Tensor]:
    """ZeRO-1's full buffers: each trainable shard all-gathered in its gather dtype (what the
    step that gathers computes with); a frozen buffer's from `kept` when given (it never
    changes). The all-gathers move no parameter for the schedule's passes (no buffer label):
    they stay after the update, where the computation puts them."""
    out = []
    for k, (spec, shard) in enumerate(zip(layout.buffers, shards)):
        if kept is not None and not spec.trainable:
            out.append(kept[k])
            continue
        if spec.gather_dtype != shard.dtype:
            cast = shard.to(spec.gather_dtype)
        elif layout.num_shards == 1:  # the gather of one is the shard itself: the kept buffer gets its own memory,
            cast = shard.clone()  # which a donated step's next update (writing the shard in place) must not change
        else:
            cast = shard.contiguous()
        out.append(gather_bytes(cast, mesh, None))
    return out
