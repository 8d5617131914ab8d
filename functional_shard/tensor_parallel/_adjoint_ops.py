"""Tensor-parallel collectives as custom operators that carry their adjoint.

`make_fx` traces below autograd: an `autograd.Function` (`CopyTo`, `ReduceFrom`, ...) leaves only
its forward's aten operations in a graph, and a graph replayed under autograd would differentiate
those by their own formulas (`copy_to`'s identity would get no all-reduce in its backward). A
pipeline stage is such a graph (`_stages`), so while a stage is traced (`_tracing.adjoint_ops()`)
the tensor-parallel collectives are issued as one operator, `functional_shard::tp_collective`,
whose backward is registered: the conjugate collective (copy <-> reduce, gather <-> reduce-scatter
along a dimension, scatter <-> gather with a split gradient). Replaying the graph then runs the same
collectives, forward and backward, as the Functions do.

The operator reaches the process groups by name (the mesh's own groups for the axis), so a graph
holding it replays on the ranks that traced it.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from .._tracing import carry_into_backward

__all__ = ["ADJOINT", "tp_collective", "issue"]

_C10D = torch.ops._c10d_functional

# kind -> the kind its backward issues
ADJOINT = {
    "copy": "reduce",
    "reduce": "copy",
    "gather": "reduce_scatter",
    "reduce_scatter": "gather",
    "scatter": "gather_split",
    "gather_split": "scatter",
}


def _gather(x: torch.Tensor, dim: int, size: int, group: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    full = _C10D.wait_tensor(_C10D.all_gather_into_tensor(moved.view(-1), size, group))
    return full.view(size * moved.shape[0], *moved.shape[1:]).movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, size: int, group: str, gloo: bool) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    flat = moved.view(-1)
    if gloo:  # as Mesh.reduce_scatter_axis_flat: an all-to-all and a rank-order sum
        splits = [flat.numel() // size] * size
        part = _C10D.wait_tensor(_C10D.all_to_all_single(flat, splits, splits, group)).view(size, -1).sum(0)
    else:
        part = _C10D.wait_tensor(_C10D.reduce_scatter_tensor(flat, "sum", size, group))
    return part.view(moved.shape[0] // size, *moved.shape[1:]).movedim(0, dim).contiguous()


@custom_op("functional_shard::tp_collective", mutates_args=())
def tp_collective(
    x: torch.Tensor, kind: str, dim: int, gather_group: str, reduce_group: str, size: int, coordinate: int, gloo: bool
) -> torch.Tensor:
    """One tensor-parallel collective of `kind` over an axis of `size` ranks (this one at
    `coordinate`), along `dim` where it has one; see `ADJOINT` for its backward."""
    if kind == "copy":
        return x.clone()
    if kind == "reduce":
        return _C10D.wait_tensor(_C10D.all_reduce(x.contiguous().view(-1), "sum", reduce_group)).view(x.shape).clone()
    if kind in ("gather", "gather_split"):
        return _gather(x, dim, size, gather_group)
    if kind == "reduce_scatter":
        return _reduce_scatter(x, dim, size, reduce_group, gloo)
    if kind == "scatter":
        piece = x.shape[dim] // size
        return x.narrow(dim, coordinate * piece, piece).contiguous()
    raise ValueError(f"unknown tensor-parallel collective {kind!r}")


@tp_collective.register_fake
def _(x, kind, dim, gather_group, reduce_group, size, coordinate, gloo):
    shape = list(x.shape)
    if kind in ("gather", "gather_split"):
        shape[dim] *= size
    elif kind in ("reduce_scatter", "scatter"):
        shape[dim] //= size
    return x.new_empty(shape)


def _setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _backward(ctx, grad):
    kind, *rest = ctx.args
    return (tp_collective(grad.contiguous(), ADJOINT[kind], *rest),) + (None,) * 7


_carried_setup, _carried_backward = carry_into_backward(_setup, _backward)
tp_collective.register_autograd(_carried_backward, setup_context=_carried_setup)


def issue(x: torch.Tensor, kind: str, dim: int, mesh, axis: str) -> torch.Tensor:
    """`kind` over `axis` of `mesh` as the operator (the mesh's process groups by name)."""
    # A mesh with no process groups (an abstract one, planning on fake tensors) never runs the operator.
    gather_group = getattr(mesh, "_gather_group_names", {}).get(axis, f"abstract:{axis}")
    reduce_group = getattr(mesh, "_reduce_group_names", {}).get(axis, f"abstract:{axis}")
    return tp_collective(
        x, kind, dim, gather_group, reduce_group, mesh.shape[axis], mesh.coordinates[axis], bool(getattr(mesh, "_gloo", False))
    )
