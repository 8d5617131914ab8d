"""SGD (with optional momentum / Nesterov) as a pair of pure functions over torch's kernel."""

from __future__ import annotations

from typing import NamedTuple, Optional

import optree
import torch
from torch.optim.sgd import sgd as _torch_sgd

from ._base import (
    Grads,
    Optimizer,
    Params,
    ScalarOrSchedule,
    _check_like,
    _check_params,
    _clone,
    _kernel_choice,
    _lr_fn,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of `sgd`.

    Every field is either a tensor or a tree with the structure of params, so the
    whole state is a pytree of tensors that can be sharded like params.
    """

    # Number of updates applied so far: a 0-d int64 CPU tensor. It feeds the lr
    # schedule and tells the first update apart, on which torch builds the momentum
    # buffer from the gradient instead of decaying an existing one.
    count: torch.Tensor
    # Momentum buffers (same structure, shapes and dtypes as params) when
    # `momentum != 0`, otherwise None (an empty pytree node). Zeros until the first
    # update, whose kernel call ignores them: torch has no buffer at that point.
    momentum_buffer: Optional[Params]


def sgd(
    lr: ScalarOrSchedule,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, bit-identical to `torch.optim.SGD`.

    `update` clones params and momentum buffers, then runs `torch.optim.sgd.sgd` on
    the clones, exactly as `torch.optim.SGD.step` does, with the foreach/fused choice
    torch makes by default (on CPU: the single-tensor kernel).

    Arguments:
      lr: learning rate. Either a non-negative float, or a schedule: a callable
        `count -> float` where `count` is the number of updates already applied
        (0 on the first update, 1 on the second, ...). `base_lr * f(count)` matches
        `torch.optim.lr_scheduler.LambdaLR(opt, f)` stepped once after each update.
      momentum: momentum factor; 0 disables momentum and its buffers.
      dampening: dampening applied to the gradient when accumulating momentum.
      weight_decay: L2 penalty, added to the gradient (coupled, as in torch).
      nesterov: use Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
      maximize: maximize the objective instead of minimizing it.

    Returns:
      An `Optimizer` whose state is an `SGDState`.
    """
    lr_fn = _lr_fn(lr)
    momentum = float(momentum)
    dampening = float(dampening)
    weight_decay = float(weight_decay)
    # Same validation as torch.optim.SGD.__init__, so bad values fail at build time.
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    use_momentum = momentum != 0

    def init(params: Params) -> SGDState:
        _check_params(params)
        buffers = None
        if use_momentum:
            buffers = optree.tree_map(
                lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params
            )
        return SGDState(
            count=torch.zeros((), dtype=torch.int64, device="cpu"),
            momentum_buffer=buffers,
        )

    def update(grads: Grads, state: SGDState, params: Params) -> tuple[Params, SGDState]:
        accessors, p_leaves, spec = _check_params(params)
        g_leaves = _check_like("grads", grads, accessors, p_leaves, spec)
        if use_momentum:
            if state.momentum_buffer is None:
                raise ValueError("state.momentum_buffer is None but momentum != 0")
            buf_leaves = _check_like(
                "state.momentum_buffer", state.momentum_buffer, accessors, p_leaves, spec
            )

        count = int(state.count.item())
        step_lr = lr_fn(count)

        with torch.no_grad():
            new_p = _clone(p_leaves)
            if not use_momentum:
                bufs = []
            elif count == 0:
                # torch creates each buffer lazily as `grad.detach().clone()` (after
                # weight decay / maximize); handing it None reproduces that exactly.
                bufs = [None] * len(new_p)
            else:
                bufs = _clone(buf_leaves)
            fused, foreach = _kernel_choice(new_p)
            if fused or foreach:
                # torch's multi-tensor kernel can write into the grads it was given
                # (Nesterov without weight decay or maximize); only the single-tensor
                # kernel, torch's CPU default, is read-only on them.
                g_leaves = _clone(g_leaves)
            # The kernel fills None entries of this list with the new buffers.
            _torch_sgd(
                new_p,
                list(g_leaves),
                bufs,
                has_sparse_grad=False,
                foreach=foreach,
                fused=fused,
                weight_decay=weight_decay,
                momentum=momentum,
                lr=step_lr,
                dampening=dampening,
                nesterov=nesterov,
                maximize=maximize,
            )
            new_count = state.count.detach() + 1

        new_buffers = optree.tree_unflatten(spec, bufs) if use_momentum else None
        return optree.tree_unflatten(spec, new_p), SGDState(
            count=new_count, momentum_buffer=new_buffers
        )

    return Optimizer(init=init, update=update)
