"""Reductions over the whole model from inside an `apply`: `global_sum`, `global_norm`.

Inside a sharded step an optimizer sees only this rank's shard of each flat buffer. A
quantity of the whole model (a gradient norm, a count of non-finite values) is a sum of
per-rank partial values over the ranks that hold *distinct* shards: the ranks along the
mesh's shard axis, and along its tensor-parallel axis (each holds its own pieces of the split
leaves). The replicate axes of a hybrid mesh hold copies of the same shards (their gradients
are already summed over them), so summing over them too would count every value once per
replica; so would leaves that every tensor-parallel rank holds whole (norms), which
`global_norm(..., replicated=)` counts on one of those ranks only.

Flat shard buffers are zero in their padding (padding gets zero gradient and zero
updates), so a sum of squares over the shards is the full model's sum of squares.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional, Sequence

import optree
import torch

from .._canonical import tree_sum
from .._shard import all_reduce

if TYPE_CHECKING:  # annotations only: the mesh's class is the core's business
    from .._mesh import BaseMesh

__all__ = ["global_sum", "global_norm"]


def global_sum(x: Any, mesh: Optional[BaseMesh]) -> Any:
    """The sum of a per-rank partial value over the ranks holding distinct shards.

    Call it inside an `apply` with the `mesh` the step passed in. Every rank of the mesh
    must call it at the same point with the same structure, shapes and dtypes (it is a
    collective). Differentiable (the gradient is the same sum) and traceable.

    Arguments:
        x: a tensor or a pytree of tensors, e.g. this rank's sum of squares as a 0-d
            float64 tensor. Same structure, shapes and dtypes on every rank.
        mesh: the step's mesh, or None outside a sharded step (a single process holding
            whole tensors).

    Returns a pytree like `x` with, on every rank, the sum of `x` over the mesh's shard
    axis and its model-parallel axes (`mesh.model_axes`: the tensor-parallel ranks hold
    different pieces), not over the replicate axes (replicas of a hybrid mesh are not counted
    twice). `x` itself when `mesh` is None or there is no such axis of more than one rank.
    """
    if mesh is None:
        return x
    axes = tuple(a for a in mesh.axis_names if (a == mesh.shard_axis and mesh.num_shards > 1) or a in mesh.model_axes)
    if not axes:
        return x
    return all_reduce(x, mesh, axes=axes)


def global_norm(
    tree: Any, mesh: Optional[BaseMesh], *, replicated: Optional[Sequence[bool]] = None, blocks: int = 0,
    positions: Optional[tuple[Sequence[int], int]] = None,
) -> torch.Tensor:
    """The 2-norm of all the tensors of a sharded pytree, as one vector (the whole model).

    What `torch.nn.utils.clip_grad_norm_` computes as its total norm, up to rounding:
    torch takes each tensor's norm (`_foreach_norm`, accumulated in the tensor's op-math
    type and rounded to its dtype), then the norm of those norms in that dtype. Here the
    leaves are flat shard buffers, not torch's parameters, so the same order of
    operations is not available; instead each leaf's norm is taken in its dtype (float32
    for float16/bfloat16), then squared, summed over leaves and over the shard axis
    (`global_sum`) and square-rooted in float64, and rounded once to torch's result dtype.
    The result is thus within one or two roundings of the exact norm, and equals torch's
    total norm to float32 rounding (relative difference ~1e-7).

    Arguments:
        tree: a pytree of float or complex tensors, this rank's shards (or whole tensors
            when `mesh` is None), e.g. the gradients an `apply` receives.
        mesh: the step's mesh, or None.
        replicated: per leaf of `tree` (flatten order), whether every rank of the mesh's
            model-parallel axes holds the same values (a tensor-parallel step's buffers of
            whole leaves, `Layout.replicated_buffers`): their squares are counted on the
            ranks at coordinate 0 of those axes only. None: every leaf is this rank's own
            piece.
        blocks: the canonical blocks of every leaf (a layout-invariant step's shards,
            `LeafLayout.blocks`), or 0. With blocks, each block's sum of squares is taken
            alone, the blocks of the shard axis are gathered, and every leaf's blocks are added
            in the canonical tree: the same bits at any number of shards.
        positions: with `blocks`, on a mesh with a `pp` axis: `(where each leaf stands among the
            whole model's, how many the whole model has)`. The leaves' squares are placed in a
            vector of the whole model's, summed over `pp` (each entry has one rank's value and
            zeros: exact) and added in that order: the bits of one rank holding every leaf.

    Returns a 0-d tensor on the leaves' device, of the dtype torch's total norm has: the
    promotion of the leaves' real dtypes (float32 for float32 grads). An empty tree gives
    `torch.tensor(0.0)`, as in torch.
    """
    leaves = optree.tree_leaves(tree)
    if not leaves:
        return torch.tensor(0.0)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            what = f"a {leaf.dtype} tensor" if isinstance(leaf, torch.Tensor) else f"a {type(leaf).__name__}"
            raise TypeError(f"global_norm: leaf {i} is {what}; every leaf must be a float or complex tensor")
    dtype = functools.reduce(torch.promote_types, (leaf.dtype.to_real() for leaf in leaves))
    if blocks:
        squares = list(_block_squares(leaves, mesh, blocks))
    else:
        squares = [torch.linalg.vector_norm(leaf, dtype=_norm_dtype(leaf)).double().square() for leaf in leaves]
    if replicated is not None and mesh is not None and mesh.model_axes:
        if len(replicated) != len(leaves):
            raise ValueError(f"global_norm: replicated has {len(replicated)} flags for {len(leaves)} leaves")
        # Whole on every rank of the axes that cut leaves (tp, cp); the pipeline's ranks hold different leaves.
        counted = all(mesh.coordinates[a] == 0 for a in mesh.model_axes if a != "pp")
        squares = [sq for sq, rep in zip(squares, replicated) if counted or not rep] or [squares[0].new_zeros(())]
    if blocks and positions is not None and mesh is not None and "pp" in mesh.model_axes:
        where, count = positions
        full = torch.zeros(count, dtype=torch.float64, device=leaves[0].device)
        full[list(where)] = torch.stack(squares)
        total = all_reduce(full, mesh, axes=("pp",)).sum()
        rest = tuple(a for a in mesh.model_axes if a != "pp")
        return (all_reduce(total, mesh, axes=rest) if rest else total).sqrt().to(dtype)
    total = torch.stack(squares).sum()
    if blocks and mesh is not None:  # summed over the shard axis already: the model axes remain
        total = all_reduce(total, mesh, axes=mesh.model_axes) if mesh.model_axes else total
    else:
        total = global_sum(total, mesh)
    return total.sqrt().to(dtype)


def _block_squares(leaves: list[torch.Tensor], mesh: Optional[BaseMesh], blocks: int) -> torch.Tensor:
    """Per leaf, its sum of squares over the whole shard axis, as the canonical tree adds its
    blocks' sums (float64, `[len(leaves)]`)."""
    rows = torch.stack(
        [torch.linalg.vector_norm(leaf.reshape(blocks, -1), dim=1, dtype=_norm_dtype(leaf)).double().square() for leaf in leaves]
    )  # [leaves, blocks]
    shards = mesh.num_shards if mesh is not None and mesh.shard_axis is not None else 1
    if shards > 1:
        every = mesh.all_gather_axis_flat(rows.reshape(-1), mesh.shard_axis).view(shards, len(leaves), blocks)
        rows = every.permute(1, 0, 2).reshape(len(leaves), shards * blocks)
    return tree_sum(rows.t())


def _norm_dtype(leaf: torch.Tensor) -> Optional[torch.dtype]:
    # A norm rounded to 8 or 11 bits would throw away most of the accuracy of the result.
    return torch.float32 if leaf.dtype in (torch.float16, torch.bfloat16) else None
