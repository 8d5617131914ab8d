"""SGD (with optional momentum / Nesterov) as pure functions mirroring torch's kernel."""

from __future__ import annotations

from typing import NamedTuple, Optional

import optree
import torch

from . import _exact
from ._base import (
    Grads,
    Optimizer,
    Params,
    Scalars,
    ScalarOrSchedule,
    _check_like,
    _check_params,
    _clone,
    _lr_fn,
)

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of `sgd`.

    Every field is either a tensor or a tree with the structure of params, so the
    whole state is a pytree of tensors that can be sharded like params.
    """

    # Number of updates applied so far: a 0-d int64 CPU tensor. `scalars` reads it for
    # the lr schedule and to tell the first update apart, on which torch builds the
    # momentum buffer from the gradient instead of decaying an existing one.
    count: torch.Tensor
    # Momentum buffers (same structure, shapes and dtypes as params) when
    # `momentum != 0`, otherwise None (an empty pytree node). Zeros until the first
    # update, which ignores them: torch has no buffer at that point.
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

    The update is torch's single-tensor SGD kernel (`torch.optim.sgd._single_tensor_sgd`,
    what `torch.optim.SGD.step` runs on CPU) transcribed op for op, with the values that
    change from step to step taken from tensors instead of Python values, so that the
    update can be traced once and replayed:

    * `scalars(state)` (eager, Python): with `count = state.count.item()` (updates
      already applied) and `lr` the schedule's value at `count`, returns 0-d float64
      CPU tensors holding:

        - "lr": `lr` (not read by `apply`; there for logging).
        - "neg_lr": `-lr`, the `alpha` of torch's final `param.add_(grad, alpha=-lr)`.
        - "first": 1.0 on the first update (`count == 0`), else 0.0. torch creates the
          momentum buffer on the first step as a copy of the (decayed, possibly negated)
          gradient instead of decaying an existing buffer; `apply` selects between the
          two with `torch.where(first, grad, buf.mul(momentum).add(grad, alpha=1 -
          dampening))` rather than branching on the count.

    * `apply(grads, state, params, scalars)` (traceable): tensor ops only, consuming the
      scalars above as tensors; `momentum`, `dampening`, `weight_decay`, `nesterov` and
      `maximize` never change and are baked in as Python constants. The new `count` is
      `state.count + 1`. `param.add_(grad, alpha=-lr)` becomes its exact tensor form
      (`param.addcmul_(grad, neg_lr)` for float32/float64/complex; for bfloat16/float16
      torch's vectorized and scalar-tail roundings are reproduced slice by slice, see
      `functional_shard/optim/_exact.py`).
    * `update(grads, state, params)` is `apply(grads, state, params, scalars(state))`.

    Results match torch.optim.SGD bit for bit on CPU for float32, float64, complex and
    (contiguous) bfloat16/float16 params.

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
    _exact.warm_up()

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

    def scalars(state: SGDState) -> Scalars:
        count = int(state.count.item())
        step_lr = lr_fn(count)
        return {
            "lr": _exact.scalar(step_lr),
            "neg_lr": _exact.scalar(-step_lr),
            "first": _exact.scalar(1.0 if count == 0 else 0.0),
        }

    def apply(
        grads: Grads, state: SGDState, params: Params, scalars: Scalars, *, inplace: bool = False
    ) -> tuple[Params, SGDState]:
        accessors, p_leaves, spec = _check_params(params)
        g_leaves = _check_like("grads", grads, accessors, p_leaves, spec)
        if use_momentum:
            if state.momentum_buffer is None:
                raise ValueError("state.momentum_buffer is None but momentum != 0")
            buf_leaves = _check_like(
                "state.momentum_buffer", state.momentum_buffer, accessors, p_leaves, spec
            )
        else:
            buf_leaves = [None] * len(p_leaves)
        neg_lr = scalars["neg_lr"]
        first = scalars["first"] != 0 if use_momentum else None

        def step_leaf(param, grad, buf):
            # torch's loop body for one parameter. `param` is our private clone, updated
            # in place; 0-d leaves are viewed as shape (1,) so the 0-d float64 scalars
            # lose type promotion to them (_exact).
            param, grad = _exact.as_1d(param), _exact.as_1d(grad)
            if maximize:
                grad = -grad
            if weight_decay != 0:
                grad = grad.add(param, alpha=weight_decay)
            new_buf = None
            if buf is not None:
                # First step: torch sets `buf = grad.detach().clone()`; later steps:
                # `buf.mul_(momentum).add_(grad, alpha=1 - dampening)`. Both computed,
                # the right one selected, so no branch depends on the count.
                decayed = _exact.as_1d(buf).mul(momentum).add(grad, alpha=1 - dampening)
                new_buf = torch.where(_exact.on_device(first, decayed), grad, decayed)
                grad = grad.add(new_buf, alpha=momentum) if nesterov else new_buf
            # param.add_(grad, alpha=-lr)
            _exact.add_scaled_(param, grad, neg_lr)
            return new_buf

        with torch.no_grad():
            new_p = _clone(p_leaves, inplace)
            new_bufs = []
            for p, g, buf, orig in zip(new_p, g_leaves, buf_leaves, p_leaves):
                new_buf = step_leaf(p, g.detach(), None if buf is None else buf.detach())
                if new_buf is not None:
                    new_bufs.append(new_buf.reshape(orig.shape))
            new_count = state.count.detach() + 1

        new_buffers = optree.tree_unflatten(spec, new_bufs) if use_momentum else None
        return optree.tree_unflatten(spec, new_p), SGDState(
            count=new_count, momentum_buffer=new_buffers
        )

    def update(grads: Grads, state: SGDState, params: Params) -> tuple[Params, SGDState]:
        return apply(grads, state, params, scalars(state))

    return Optimizer(init=init, update=update, scalars=scalars, apply=apply)
