"""SGD (with optional momentum / Nesterov) as pure functions mirroring torch's kernel."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch

from . import _exact
from ._base import Optimizer, Params, ScalarOrSchedule, Scalars, make_optimizer
from ._blocks import apply_per_tensor, as_schedule, check_params, zeros_like
from ._groups import LeafLayout, ParamGroup, check_options, cut, merge, options_per_group, resolve, runs_of

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
    groups: Sequence[ParamGroup] = (),
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

      With `groups`, a tuple of such dicts: the optimizer's own (group 0), then one per group.
    * `apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None)`
      (traceable): tensor ops only, consuming the scalars above as tensors; `momentum`,
      `dampening`, `weight_decay`, `nesterov` and `maximize` never change and are baked in
      as Python constants; `mesh` is not used (the update is elementwise). The new `count` is
      `state.count + 1`. `param.add_(grad, alpha=-lr)` becomes its exact tensor form
      (`param.addcmul_(grad, neg_lr)` for float32/float64/complex; for bfloat16/float16
      torch's vectorized and scalar-tail roundings are reproduced slice by slice, see
      `functional_shard/optim/_exact.py`).
    * `update(grads, state, params)` is `apply(grads, state, params, scalars(state))`.

    Results match torch.optim.SGD bit for bit on CPU for float32, float64, complex and
    (contiguous) bfloat16/float16 params.

    Parameter groups: `groups=[fs.optim.group(rules..., lr=, weight_decay=, momentum=,
    dampening=, nesterov=)]`, as torch's param groups; within a flat shard, each stretch of
    leaves that share all five is updated as one tensor. With momentum in any group, every
    leaf has a momentum buffer (unused where the group's momentum is 0).

    Arguments:
        lr: learning rate: a non-negative float, or a schedule `count -> float` (see
            `as_schedule` and `cosine_schedule`; `count` is the number of updates already applied).
        momentum: momentum factor; 0 disables momentum and its buffers.
        dampening: dampening applied to the gradient when accumulating momentum.
        weight_decay: L2 penalty, added to the gradient (coupled, as in torch).
        nesterov: use Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
        maximize: maximize the objective instead of minimizing it.
        groups: `fs.optim.group(...)`s: per-leaf `lr`, `weight_decay`, `momentum`,
            `dampening`, `nesterov`; a leaf takes the first group that matches it, other
            leaves the arguments above.

    Returns an `Optimizer` whose state is an `SGDState`.
    """
    groups = check_options(groups, ("lr", "weight_decay", "momentum", "dampening", "nesterov"), "fs.optim.sgd")
    defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "dampening": dampening, "nesterov": nesterov}
    hyper = [_hyperparameters(**o) for o in options_per_group(groups, defaults)]
    use_momentum = any(h.momentum != 0 for h in hyper)
    _exact.warm_up()

    def init(params: Params, *, leaves: Optional[LeafLayout] = None) -> SGDState:
        check_params(params)
        if groups:  # fails now for a rule that matches no leaf
            resolve(groups, leaves if leaves is not None else LeafLayout.of_tree(params), "fs.optim.sgd")
        return SGDState(
            count=torch.zeros((), dtype=torch.int64, device="cpu"),
            momentum_buffer=zeros_like(params) if use_momentum else None,
        )

    def scalars(state: SGDState) -> Scalars:
        count = int(state.count.item())
        per_group = tuple(h.scalars(count) for h in hyper)
        return per_group if groups else per_group[0]

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None):  # an ApplyFn
        if use_momentum and state.momentum_buffer is None:
            raise ValueError("state.momentum_buffer is None but momentum != 0")
        per_group = scalars if groups else (scalars,)
        plan = None
        if groups:
            plan = resolve(groups, leaves if leaves is not None else LeafLayout.of_tree(params), "fs.optim.sgd")
        first = per_group[0]["first"] != 0 if use_momentum else None  # the same in every group

        def step_tensor(name, param, grad, buf) -> None:
            # torch's loop body for one parameter, in place on our private copies, over
            # each run of one group.
            for run in merge(runs_of(plan, name, param.numel()), lambda g: hyper[g].key):
                h, neg_lr = hyper[run.group], per_group[run.group]["neg_lr"]
                buf_run = cut(buf, run) if h.momentum != 0 else None
                _step(h, first, neg_lr, cut(param, run), cut(grad, run), buf_run, maximize)

        momentum_buffer = state.momentum_buffer if use_momentum else None
        new_params, new = apply_per_tensor(step_tensor, grads, params, {"momentum_buffer": momentum_buffer}, inplace=inplace)
        return new_params, SGDState(count=state.count.detach() + 1, **new)

    return make_optimizer(init, scalars, apply)


class _Hyper(NamedTuple):
    """One group's hyperparameters, checked."""

    lr: Any  # the value given (float or schedule): compared to tell groups apart
    lr_at: Any  # count -> float
    weight_decay: float
    momentum: float
    dampening: float
    nesterov: bool

    @property
    def key(self) -> tuple:
        return (self.lr, self.weight_decay, self.momentum, self.dampening, self.nesterov)

    def scalars(self, count: int) -> dict:
        step_lr = self.lr_at(count)
        return {
            "lr": _exact.scalar(step_lr),
            "neg_lr": _exact.scalar(-step_lr),
            "first": _exact.scalar(1.0 if count == 0 else 0.0),
        }


def _hyperparameters(lr, weight_decay, momentum, dampening, nesterov) -> _Hyper:
    lr_at = as_schedule(lr)
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
    return _Hyper(lr, lr_at, weight_decay, momentum, dampening, bool(nesterov))


def _step(h: _Hyper, first, neg_lr, param, grad, buf, maximize: bool) -> None:
    """torch's loop body for one parameter (or elements of one group), in place."""
    if maximize:
        grad = -grad
    if h.weight_decay != 0:
        grad = grad.add(param, alpha=h.weight_decay)
    if buf is not None:
        # First step: torch sets `buf = grad.detach().clone()`; later steps:
        # `buf.mul_(momentum).add_(grad, alpha=1 - dampening)`. Both computed,
        # the right one selected, so no branch depends on the count.
        decayed = buf.mul(h.momentum).add(grad, alpha=1 - h.dampening)
        torch.where(_exact.on_device(first, decayed), grad, decayed, out=buf)
        grad = grad.add(buf, alpha=h.momentum) if h.nesterov else buf
    # param.add_(grad, alpha=-lr)
    _exact.add_scaled_(param, grad, neg_lr)
