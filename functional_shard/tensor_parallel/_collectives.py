"""Tensor- and sequence-parallel collectives, as conjugate pairs of `torch.autograd.Function`s.

Each Function's backward calls its dual Function (never a raw op), and context is saved in
`setup_context`: so `torch.func.grad`, `torch.func.vjp` and `make_fx` go through them, and a
traced step holds their collectives as `_c10d_functional` nodes (see `functional_shard/_collectives.py`).

- `copy_to` (f):          forward identity; backward all-reduce over `axis`
                          (Megatron `copy_to_tensor_model_parallel_region`).
- `reduce_from` (g):      forward all-reduce over `axis`; backward identity
                          (`reduce_from_tensor_model_parallel_region`).
- `gather_along`:         forward all-gather along `dim`; backward reduce-scatter along `dim`
                          (`gather_from_sequence_parallel_region`).
- `reduce_scatter_along`: forward reduce-scatter along `dim`; backward all-gather along `dim`
                          (`reduce_scatter_to_sequence_parallel_region`).
- `scatter_along`:        forward this rank's slice along `dim` (no communication); backward
                          all-gather along `dim` (`scatter_to_tensor_model_parallel_region`).
- `gather_along(grad="split")`: forward all-gather along `dim`; backward this rank's slice
                          (`gather_from_tensor_model_parallel_region`).

Which backward is right is a statement about how the output is used: `gather_along`'s default
treats the gathered tensor's gradient as *partial* (each rank holds a part of it, e.g. it feeds
a column-parallel matmul: sequence parallelism), so the gradients are summed and scattered;
`grad="split"` treats it as *replicated* (every rank computes the same thing from it, e.g. the
loss on gathered logits), so each rank keeps its slice. Likewise `copy_to`'s input is
replicated and its output feeds rank-local work (the gradient is partial: all-reduce), and
`reduce_from` turns partial sums into a replicated value.

"Rank order" below is the order of the ranks along `axis` (their coordinate on it).
"""

from __future__ import annotations

import torch

from .._mesh import BaseMesh
from ._placement import Placement, Replicated, join_pieces
from .._tracing import adjoint_ops_enabled, carried, note_collective, note_model_axis
from ._adjoint_ops import issue

__all__ = [
    "CopyTo",
    "ReduceFrom",
    "GatherAlong",
    "ReduceScatterAlong",
    "ScatterAlong",
    "GatherSplitGrad",
    "copy_to",
    "reduce_from",
    "gather_along",
    "reduce_scatter_along",
    "scatter_along",
    "gather_leaf",
    "axis_size",
]


def axis_size(mesh: BaseMesh, axis: str) -> int:
    """The size of `axis` on `mesh`; a clear error if the mesh has no such axis."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh {mesh.shape} has no axis {axis!r}: name one of {list(mesh.axis_names)}")
    note_model_axis(axis)
    return mesh.shape[axis]


def _all_gather(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order."""
    size = mesh.shape[axis]
    moved = x.movedim(dim, 0).contiguous()
    full = mesh.all_gather_axis_flat(moved.view(-1), axis)
    return full.view(size * moved.shape[0], *moved.shape[1:]).movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
    """Slice `coordinate` (of `size` along `dim`) of the sum of every rank's `x`."""
    size = mesh.shape[axis]
    moved = x.movedim(dim, 0).contiguous()
    part = mesh.reduce_scatter_axis_flat(moved.view(-1), axis)
    return part.view(moved.shape[0] // size, *moved.shape[1:]).movedim(0, dim)


def _slice(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
    size = mesh.shape[axis]
    piece = x.shape[dim] // size
    out = x.narrow(dim, mesh.coordinates[axis] * piece, piece).contiguous()
    note_collective(out, (axis,), "split")  # this rank's piece: it varies over the axis (`_split_values`)
    return out


def _all_reduce(x: torch.Tensor, mesh: BaseMesh, axis: str) -> torch.Tensor:
    return mesh.all_reduce_flat(x.contiguous().view(-1), (axis,)).view(x.shape)


@carried
class CopyTo(torch.autograd.Function):
    """Megatron's f: identity in forward; all-reduce (sum) over `axis` in backward.

    Arguments:
        x: a tensor replicated over `axis` (the same on every rank of it).
        mesh, axis: the mesh and the axis (e.g. `"tp"`).
    """

    @staticmethod
    def forward(x: torch.Tensor, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh, ctx.axis = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ReduceFrom.apply(grad, ctx.mesh, ctx.axis), None, None


@carried
class ReduceFrom(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) over `axis` in forward; identity in backward.

    Arguments:
        x: this rank's partial sum (same shape on every rank of `axis`).
        mesh, axis: the mesh and the axis.
    """

    @staticmethod
    def forward(x: torch.Tensor, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _all_reduce(x, mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh, ctx.axis = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return CopyTo.apply(grad, ctx.mesh, ctx.axis), None, None


@carried
class GatherAlong(torch.autograd.Function):
    """All-gather along `dim` over `axis` in forward; reduce-scatter (sum) along `dim` in backward
    (the gathered tensor's gradient is partial: sequence parallelism)."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _all_gather(x, dim, mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim, ctx.mesh, ctx.axis = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ReduceScatterAlong.apply(grad, ctx.dim, ctx.mesh, ctx.axis), None, None, None


@carried
class ReduceScatterAlong(torch.autograd.Function):
    """Reduce-scatter (sum over `axis`, this rank keeps its slice along `dim`) in forward;
    all-gather along `dim` in backward."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _reduce_scatter(x, dim, mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim, ctx.mesh, ctx.axis = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return GatherAlong.apply(grad, ctx.dim, ctx.mesh, ctx.axis), None, None, None


@carried
class ScatterAlong(torch.autograd.Function):
    """This rank's slice along `dim` in forward (no communication); all-gather along `dim` in
    backward (the gathered gradient is replicated)."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _slice(x, dim, mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim, ctx.mesh, ctx.axis = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return GatherSplitGrad.apply(grad, ctx.dim, ctx.mesh, ctx.axis), None, None, None


@carried
class GatherSplitGrad(torch.autograd.Function):
    """All-gather along `dim` in forward; this rank's slice of the gradient in backward (the
    gathered tensor is used replicated: every rank computes the same from it)."""

    @staticmethod
    def forward(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _all_gather(x, dim, mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.dim, ctx.mesh, ctx.axis = inputs[1], inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ScatterAlong.apply(grad, ctx.dim, ctx.mesh, ctx.axis), None, None, None


def copy_to(x: torch.Tensor, mesh: BaseMesh, axis: str = "tp") -> torch.Tensor:
    """Megatron's f: `x` unchanged; its gradient is all-reduced (summed) over `axis`.

    Put it where a replicated activation enters rank-local (column-parallel) work: each rank's
    gradient of it is a partial sum, and the backward adds them up.

    Arguments:
        x: any tensor, the same on every rank of `axis`.
        mesh: the mesh.
        axis: the tensor-parallel axis (default `"tp"`).

    Returns `x` (a view). Size-1 axis: `x`, no collective.
    """
    if axis_size(mesh, axis) == 1:
        return x
    if adjoint_ops_enabled():
        return issue(x, "copy", 0, mesh, axis)
    out = CopyTo.apply(x, mesh, axis)
    note_collective(out, (axis,), "copy")  # its gradient is summed: no longer a whole leaf's alone (`_split_values`)
    return out


def reduce_from(x: torch.Tensor, mesh: BaseMesh, axis: str = "tp") -> torch.Tensor:
    """Megatron's g: the sum of `x` over the ranks of `axis`; the gradient passes unchanged.

    Put it after rank-local (row-parallel) work whose outputs are partial sums.

    Arguments:
        x: this rank's partial sum; the same shape and dtype on every rank of `axis`.
        mesh: the mesh.
        axis: the tensor-parallel axis.

    Returns the sum (same shape), replicated over `axis`.
    """
    if axis_size(mesh, axis) == 1:
        return x
    if adjoint_ops_enabled():
        return issue(x, "reduce", 0, mesh, axis)
    return ReduceFrom.apply(x, mesh, axis)


def _check_dim(x: torch.Tensor, dim: int, what: str) -> int:
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim {dim} is outside a tensor of shape {list(x.shape)}")
    return dim % x.dim()


def gather_along(
    x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str = "tp", *, grad: str = "reduce_scatter"
) -> torch.Tensor:
    """All-gather `x` along dimension `dim` over `axis` (rank order).

    Arguments:
        x: this rank's slice; the same shape on every rank of `axis`.
        dim: the dimension to concatenate along (e.g. the sequence dimension).
        mesh: the mesh.
        axis: the axis to gather over.
        grad: what the backward does with the gathered tensor's gradient. `"reduce_scatter"`
            (default): it is partial (each rank's work used a part of it, e.g. a column-parallel
            matmul after a sequence-parallel norm): sum over `axis`, keep this rank's slice.
            `"split"`: it is replicated (every rank computed the same from it): keep this
            rank's slice, no communication.

    Returns a tensor with `dim` `mesh.shape[axis]` times longer, the same on every rank of `axis`.
    """
    dim = _check_dim(x, dim, "gather_along")
    if grad not in ("reduce_scatter", "split"):
        raise ValueError(f"gather_along(grad=...) is 'reduce_scatter' or 'split'; got {grad!r}")
    if axis_size(mesh, axis) == 1:
        return x
    if adjoint_ops_enabled():
        return issue(x, "gather" if grad == "reduce_scatter" else "gather_split", dim, mesh, axis)
    return (GatherAlong if grad == "reduce_scatter" else GatherSplitGrad).apply(x, dim, mesh, axis)


def reduce_scatter_along(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str = "tp") -> torch.Tensor:
    """Sum `x` over `axis` and keep this rank's slice along `dim`; the backward all-gathers.

    Arguments:
        x: this rank's partial sum; `x.shape[dim]` divisible by `mesh.shape[axis]`.
        dim: the dimension to scatter along (e.g. the sequence dimension).
        mesh: the mesh.
        axis: the axis.

    Returns slice `mesh.coordinates[axis]` (of `mesh.shape[axis]` equal ones) of the sum.
    """
    dim = _check_dim(x, dim, "reduce_scatter_along")
    size = axis_size(mesh, axis)
    if x.shape[dim] % size:
        raise ValueError(
            f"reduce_scatter_along: dimension {dim} of shape {list(x.shape)} is not divisible by the size {size} of "
            f"axis {axis!r}: pad it to a multiple of {size}"
        )
    if size == 1:
        return x
    if adjoint_ops_enabled():
        return issue(x, "reduce_scatter", dim, mesh, axis)
    return ReduceScatterAlong.apply(x, dim, mesh, axis)


def scatter_along(x: torch.Tensor, dim: int, mesh: BaseMesh, axis: str = "tp") -> torch.Tensor:
    """This rank's slice of `x` along `dim` (no communication); the backward all-gathers.

    Arguments:
        x: a tensor replicated over `axis`; `x.shape[dim]` divisible by `mesh.shape[axis]`.
        dim: the dimension to cut.
        mesh: the mesh.
        axis: the axis.

    Returns slice `mesh.coordinates[axis]` of `mesh.shape[axis]` equal ones (contiguous).
    """
    dim = _check_dim(x, dim, "scatter_along")
    size = axis_size(mesh, axis)
    if x.shape[dim] % size:
        raise ValueError(
            f"scatter_along: dimension {dim} of shape {list(x.shape)} is not divisible by the size {size} of "
            f"axis {axis!r}: pad it to a multiple of {size}"
        )
    if size == 1:
        return x
    if adjoint_ops_enabled():
        return issue(x, "scatter", dim, mesh, axis)
    return ScatterAlong.apply(x, dim, mesh, axis)


def gather_leaf(local: torch.Tensor, placement: Placement, mesh: BaseMesh) -> torch.Tensor:
    """The full leaf from every rank's piece of it (the inverse of `split_tensor` over the mesh).

    Arguments:
        local: this rank's piece, as `split_tensor` cuts it for its coordinate on the axis.
        placement: the leaf's `Split(...)` or `Replicated()` (then `local` is returned).
        mesh: the mesh.

    Returns the full leaf on every rank of the placement's axis; its gradient is this rank's
    piece of the full leaf's gradient (the full leaf is used replicated).
    """
    if isinstance(placement, Replicated) or axis_size(mesh, placement.axis) == 1:
        return local
    dim = placement.dim % local.dim()
    full = gather_along(local, dim, mesh, placement.axis, grad="split")
    if placement.chunks == 1:
        return full
    return join_pieces(list(full.chunk(mesh.shape[placement.axis], dim)), placement)
