"""Reductions over the whole model from inside an `apply`: `global_sum`, `global_norm`.

Inside a sharded step an optimizer sees only this rank's shard of each flat buffer. A
quantity of the whole model (a gradient norm, a count of non-finite values) is a sum of
per-rank partial values over the ranks that hold *distinct* shards: the ranks along the
mesh's shard axis. The replicate axes of a hybrid mesh hold copies of the same shards
(their gradients are already summed over them), so summing over them too would count
every value once per replica.

Flat shard buffers are zero in their padding (padding gets zero gradient and zero
updates), so a sum of squares over the shards is the full model's sum of squares.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import optree
import torch

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
    axis (an all-reduce over that axis only: replicas of a hybrid mesh are not counted
    twice). `x` itself when `mesh` is None or the shard axis has size 1.
    """
    if mesh is None or mesh.num_shards == 1:
        return x
    return all_reduce(x, mesh, axes=(mesh.shard_axis,))


def global_norm(tree: Any, mesh: Optional[BaseMesh]) -> torch.Tensor:
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
    squares = [torch.linalg.vector_norm(leaf, dtype=_norm_dtype(leaf)).double().square() for leaf in leaves]
    total = global_sum(torch.stack(squares).sum(), mesh)
    return total.sqrt().to(dtype)


def _norm_dtype(leaf: torch.Tensor) -> Optional[torch.dtype]:
    # A norm rounded to 8 or 11 bits would throw away most of the accuracy of the result.
    return torch.float32 if leaf.dtype in (torch.float16, torch.bfloat16) else None
