"""`clip_by_global_norm`: scale the gradients so that their norm over the whole model is bounded."""

from __future__ import annotations

import math

import optree
import torch

from . import _exact
from ._base import EmptyState, GradientTransformation, Params, Scalars, make_transformation
from ._blocks import _check_like, check_params
from ._global import global_norm

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates by `min(max_norm / (norm + 1e-6), 1)`, as `torch.nn.utils.clip_grad_norm_`.

    `norm` is `global_norm(updates, mesh)`: the 2-norm of the whole model's gradient,
    summed over the shard axis when run in a sharded step (see `global_sum`), so every
    rank scales its shard by the same factor. Then, in torch's own op order and dtype
    (the dtype of the total norm, float32 for float32 gradients):

        clip_coef = max_norm / (norm + 1e-6)        # torch: reciprocal, then multiply
        updates = updates * torch.clamp(clip_coef, max=1.0)

    So the result equals `clip_grad_norm_(parameters, max_norm)` up to the rounding of
    the total norm (see `global_norm`: the leaves here are flat shard buffers, so the
    norm is summed in another order than torch's norm of per-parameter norms); given
    the same norm, every following operation is torch's, bit for bit. No branch
    depends on the norm, so the transformation traces once and replays. Stateless (its
    state is an `EmptyState`), no per-step scalars (`{}`).

    Arguments:
        max_norm: the largest norm the updates may have; a positive float (`inf`
            disables clipping).

    Returns a `GradientTransformation`, to put before an optimizer in `chain`, e.g.
    `chain(clip_by_global_norm(1.0), adamw(1e-3))`. With `inplace=True` it scales the
    donated updates in place.
    """
    try:
        limit = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"clip_by_global_norm: max_norm must be a positive number, got {max_norm!r}") from None
    if math.isnan(limit) or limit <= 0.0:
        raise ValueError(
            f"clip_by_global_norm: max_norm must be positive, got {max_norm!r}; "
            "to turn clipping off, leave the transformation out of the chain"
        )

    def init(params: Params) -> EmptyState:
        check_params(params)
        return EmptyState()

    def scalars(state: EmptyState) -> Scalars:
        return {}

    def apply(updates, state, params, scalars, *, inplace=False, mesh=None, leaves=None):  # an ApplyFn
        accessors, p_leaves, spec = check_params(params)
        tensors = _check_like("updates", updates, accessors, p_leaves, spec)
        replicated = None
        if leaves is not None and leaves.replicated:  # a tensor-parallel step: whole leaves count once
            replicated = [len(p) == 1 and p[0] in leaves.replicated for p in optree.tree_paths(updates)]
        with torch.no_grad():
            positions = (leaves.positions, leaves.count) if leaves is not None and leaves.count else None
            norm = global_norm(tensors, mesh, replicated=replicated, blocks=leaves.blocks if leaves is not None else 0,
                               positions=positions)  # fmt: skip
            coef = torch.clamp(limit / (norm + 1e-6), max=1.0)

            def scale(u: torch.Tensor) -> torch.Tensor:
                # A 1-D view: a 0-d coefficient must not promote a 0-d leaf (bfloat16 * float32).
                flat, c = _exact.as_1d(u.detach()), coef.to(u.device)
                return (flat.mul_(c) if inplace else flat.mul(c)).view(u.shape)

            scaled = [scale(u) for u in tensors]
        return optree.tree_unflatten(spec, scaled), state

    return make_transformation(init, scalars, apply)
