"""From `torch.optim` to `fs.optim`: `from_torch` converts a torch AdamW / Adam / SGD with its
param groups (and an lr scheduler) into the fs optimizer that computes the same bits, and
`as_optimizer` is the check `fs.sharded_step` runs on its `optimizer=`, which names the fs
equivalent of a torch object passed by mistake.
"""

from __future__ import annotations

import glob
from typing import Any

import torch

from ._adamw import adamw
from ._base import GradientTransformation, Optimizer, _keywords, make_optimizer
from ._groups import group
from ._schedules import (
    cosine_schedule,
    join_schedules,
    lambda_schedule,
    linear_schedule,
)
from ._sgd import sgd

__all__ = ["from_torch", "as_optimizer"]

_SCHEDULERS = "LambdaLR, LinearLR, CosineAnnealingLR, SequentialLR of these"


def from_torch(optimizer: torch.optim.Optimizer, model: torch.nn.Module, scheduler: Any = None) -> Optimizer:
    """The `fs.optim` optimizer that updates `model`'s parameters as `optimizer` (and
    `scheduler`) would, param groups included, bit for bit.

        model = Net()
        torch_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=3e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(torch_opt, T_max=1000)
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.from_torch(torch_opt, model, sched))

    Each torch param group becomes an `fs.optim.group` of the names of its parameters (as
    `model.named_parameters()` gives them, which are the leaf paths of `fs.functionalize(model)`)
    with its hyperparameters; the scheduler becomes each group's `lr` schedule (see
    `cosine_schedule` for the equivalences). Read once: later changes to the torch objects do
    not reach the fs optimizer.

    Arguments:
        optimizer: a `torch.optim.AdamW`, `torch.optim.Adam` (without weight decay, or with
            `decoupled_weight_decay=True`) or `torch.optim.SGD`, not yet stepped. `amsgrad`,
            `maximize` (and for Adam `decoupled_weight_decay`) must be the same in every group.
        model: the module whose parameters `optimizer` holds, the one `fs.functionalize` is
            given. Parameters with `requires_grad=False` are frozen in fs and left out; every
            other parameter must be in a group (torch would not train it, fs would).
        scheduler: None, or a fresh `LambdaLR`, `LinearLR`, `CosineAnnealingLR` or
            `SequentialLR` of these, made for `optimizer`.

    Returns an `Optimizer` (`fs.optim.adamw` or `fs.optim.sgd` with `groups=`). Raises
    `TypeError` / `ValueError` naming what cannot be converted and what to write instead.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"from_torch: optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"from_torch(optimizer, model): model must be the torch.nn.Module whose parameters the optimizer holds "
            f"(their names become the groups' rules); got {type(model).__name__}"
        )
    kind = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(
            f"from_torch: this {kind} has already stepped (it has state); convert it before training, and move "
            f"trained state with fs.checkpoint"
        )
    names = {id(p): name for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    seen: set[str] = set()
    groups, options = [], []
    for i, g in enumerate(optimizer.param_groups):
        members = []
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"from_torch: param_groups[{i}] holds a parameter of shape {list(p.shape)} that is not a parameter "
                    f"of the model given; pass the module the optimizer was made for"
                )
            if names[id(p)] in trainable:
                members.append(names[id(p)])
        seen.update(members)
        hyper = _group_options(optimizer, g, i)
        lr = _lr_of(g)
        hyper["lr"] = _schedule_of(scheduler, i, lr, optimizer) if scheduler is not None else lr
        options.append(hyper)
        if members:
            groups.append(group(*(glob.escape(n) for n in members), **hyper))
    missing = sorted(trainable - seen)
    if missing:
        raise ValueError(
            f"from_torch: the model's parameters {missing[:8]} are in no param group of the {kind}: torch would never "
            f"update them, fs would train them. Set requires_grad=False on them (fs then keeps them frozen) or add them "
            f"to a group"
        )
    if not groups:
        raise ValueError(f"from_torch: the {kind} holds no trainable parameter of the model")
    first = options[0]
    global_options = _global_options(optimizer)
    if isinstance(optimizer, torch.optim.SGD):
        return sgd(first["lr"], **{k: v for k, v in first.items() if k != "lr"}, **global_options, groups=groups)
    return adamw(first["lr"], **{k: v for k, v in first.items() if k != "lr"}, **global_options, groups=groups)


def _lr_of(g: dict) -> float:
    lr = g.get("initial_lr", g["lr"])
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def _group_options(optimizer: torch.optim.Optimizer, g: dict, i: int) -> dict:
    if isinstance(optimizer, torch.optim.SGD):
        return {k: g[k] for k in ("weight_decay", "momentum", "dampening", "nesterov")}
    if isinstance(optimizer, torch.optim.AdamW):
        return {"weight_decay": g["weight_decay"], "betas": tuple(float(b) for b in g["betas"]), "eps": g["eps"]}
    if type(optimizer) is torch.optim.Adam:
        if g["weight_decay"] != 0 and not g.get("decoupled_weight_decay", False):
            raise ValueError(
                f"from_torch: param_groups[{i}] of this torch.optim.Adam has weight_decay={g['weight_decay']} (an L2 "
                f"penalty added to the gradient), which fs.optim has no kernel for; use torch.optim.AdamW (decoupled "
                f"decay, fs.optim.adamw) or weight_decay=0"
            )
        return {"weight_decay": g["weight_decay"], "betas": tuple(float(b) for b in g["betas"]), "eps": g["eps"]}
    raise TypeError(
        f"from_torch: no fs equivalent of {type(optimizer).__module__}.{type(optimizer).__name__}; fs.optim has adamw "
        f"and sgd (torch.optim.AdamW, Adam, SGD), and fs.optim.make_optimizer writes others (see docs/training.md)"
    )


def _global_options(optimizer: torch.optim.Optimizer) -> dict:
    names = ("maximize",) if isinstance(optimizer, torch.optim.SGD) else ("amsgrad", "maximize")
    out = {}
    for name in names:
        values = {bool(g.get(name, False)) for g in optimizer.param_groups}
        if len(values) > 1:
            raise ValueError(f"from_torch: {name} differs between param groups; fs.optim takes one {name} for all leaves")
        out[name] = values.pop()
    return out


def _schedule_of(scheduler: Any, i: int, lr: float, optimizer: torch.optim.Optimizer) -> Any:
    """The fs schedule of `scheduler` for param group `i` (base learning rate `lr`)."""
    schedulers = torch.optim.lr_scheduler
    if not isinstance(scheduler, schedulers.LRScheduler):
        raise TypeError(f"from_torch: scheduler must be a torch.optim.lr_scheduler scheduler; got {type(scheduler).__name__}")
    if scheduler.optimizer is not optimizer:
        raise ValueError("from_torch: the scheduler was made for another optimizer")
    if scheduler.last_epoch != 0:
        raise ValueError(
            f"from_torch: the {type(scheduler).__name__} has been stepped {scheduler.last_epoch} times; convert a fresh "
            f"one (fs counts from the state's step)"
        )
    return _convert(scheduler, i, lr)


def _convert(scheduler: Any, i: int, lr: float) -> Any:
    schedulers = torch.optim.lr_scheduler
    kind = type(scheduler)
    if kind is schedulers.LambdaLR:
        return lambda_schedule(lr, scheduler.lr_lambdas[i])
    if kind is schedulers.LinearLR:
        return linear_schedule(
            lr, start_factor=scheduler.start_factor, end_factor=scheduler.end_factor, steps=scheduler.total_iters
        )
    if kind is schedulers.CosineAnnealingLR:
        return cosine_schedule(lr, steps=scheduler.T_max, min_lr=scheduler.eta_min)
    if kind is schedulers.SequentialLR:
        members = [_convert(s, i, lr) for s in scheduler._schedulers]
        return join_schedules(*members, boundaries=list(scheduler._milestones))
    raise TypeError(
        f"from_torch: no fs schedule for {kind.__name__}; fs.optim converts {_SCHEDULERS}. Write it as a LambdaLR "
        f"(fs.optim.lambda_schedule(lr, factor)) or any function count -> lr"
    )


def as_optimizer(value: Any) -> Optimizer:
    """`value` if it is an `fs.optim.Optimizer` (with `init` and `apply` taking `leaves=`), else a
    `TypeError` that says what to pass instead: for a `torch.optim` optimizer, its fs equivalent
    with the same hyperparameters; for an lr scheduler, where schedules go.

    Arguments:
        value: what was passed as `optimizer=` to `fs.sharded_step`.
    """
    if isinstance(value, Optimizer):
        if all(_takes_leaves(f) for f in (value.init, value.apply)):
            return value
        return make_optimizer(value.init, value.scalars, value.apply)
    got = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, torch.optim.Optimizer):
        equivalent = _equivalent(value)
        raise TypeError(
            f"optimizer must be an fs.optim optimizer (it updates the sharded parameters inside the step); got {got}. "
            f"Use {equivalent}, or fs.optim.from_torch(torch_optimizer, model) to keep its "
            f"{len(value.param_groups)} param group(s) (and from_torch(torch_optimizer, model, scheduler) for an lr "
            f"scheduler)"
        )
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(
            f"optimizer must be an fs.optim optimizer; got the lr scheduler {got}. In fs a schedule is the optimizer's "
            f"lr: fs.optim.adamw(lr=fs.optim.cosine_schedule(3e-4, steps=1000)), or fs.optim.from_torch(torch_optimizer, "
            f"model, scheduler)"
        )
    if isinstance(value, GradientTransformation):
        raise TypeError(
            "optimizer must be an fs.optim optimizer; got a GradientTransformation (it maps gradients, it does not "
            "update parameters): end it with one, e.g. fs.optim.chain(transformation, fs.optim.adamw(lr=1e-3))"
        )
    raise TypeError(f"optimizer must be an fs.optim optimizer (init, update), e.g. fs.optim.adamw(lr=1e-3); got {got}")


def _equivalent(optimizer: torch.optim.Optimizer) -> str:
    """`fs.optim.<name>(...)` with the first param group's hyperparameters, as text."""
    g = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.SGD):
        args = ", ".join(f"{k}={g[k]!r}" for k in ("momentum", "dampening", "weight_decay", "nesterov") if k in g)
        return f"fs.optim.sgd(lr={_lr_of(g)!r}, {args}) (the same update as this torch.optim.SGD, bit for bit)"
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        betas = tuple(float(b) for b in g["betas"])
        decoupled = isinstance(optimizer, torch.optim.AdamW) or g.get("decoupled_weight_decay", False)
        if not decoupled and g["weight_decay"] != 0:
            return (
                f"fs.optim.adamw(lr={_lr_of(g)!r}, betas={betas!r}, eps={g['eps']!r}, weight_decay=...) (AdamW: "
                f"fs.optim has no Adam with an L2 weight decay)"
            )
        decay = g["weight_decay"] if decoupled else 0.0
        return (
            f"fs.optim.adamw(lr={_lr_of(g)!r}, betas={betas!r}, eps={g['eps']!r}, weight_decay={decay!r}) (the same "
            f"update as this torch.optim.{type(optimizer).__name__}, bit for bit)"
        )
    return "fs.optim.adamw(...) or fs.optim.sgd(...), or your own with fs.optim.make_optimizer (docs/training.md)"



def _takes_leaves(fn: Any) -> bool:
    keywords = _keywords(fn)
    return keywords is None or "leaves" in keywords
