"""Building blocks for writing an optimizer: checks, learning-rate schedules, copies, and
the per-leaf skeleton every built-in `apply` runs.

An optimizer written from these blocks (here Lion, state `(count, exp_avg)`):

    def lion(lr, *, betas=(0.9, 0.99), weight_decay=0.0):
        lr_at = optim.as_schedule(lr)

        def init(params):
            optim.check_params(params)
            return LionState(torch.zeros((), dtype=torch.int64), optim.zeros_like(params))

        def scalars(state):
            lr = lr_at(int(state.count))
            return {"lr": optim.scalar(lr), "decay": optim.scalar(1 - lr * weight_decay)}

        def apply(grads, state, params, scalars, *, inplace=False, mesh=None):
            def step_leaf(param, grad, exp_avg):  # param, exp_avg: private, update in place
                c = exp_avg * betas[0] + grad * (1 - betas[0])
                param.mul_(scalars["decay"]).sub_(torch.sign(c) * scalars["lr"])
                exp_avg.mul_(betas[1]).add_(grad * (1 - betas[1]))

            new_params, new = optim.apply_per_leaf(
                step_leaf, grads, params, {"exp_avg": state.exp_avg}, inplace=inplace)
            return new_params, LionState(state.count + 1, new["exp_avg"])

        return optim.make_optimizer(init, scalars, apply)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import optree
import torch

from .._pytree import path_string
from . import _exact
from ._base import Grads, LRSchedule, Params, ScalarOrSchedule

__all__ = ["check_params", "check_like", "as_schedule", "clone", "zeros_like", "apply_per_leaf"]


def as_schedule(lr: ScalarOrSchedule) -> LRSchedule:
    """Normalizes a learning rate (a float or a schedule) into a schedule.

    Arguments:
        lr: a non-negative float, or a callable `count -> float` where `count` is the
            number of updates already applied (0 on the first update, 1 on the second,
            ...). `base_lr * f(count)` matches `torch.optim.lr_scheduler.LambdaLR(opt, f)`
            stepped once after each update.

    Returns a callable `count -> float`. A negative float raises `ValueError`, as in
    torch.optim's constructors.
    """
    if callable(lr):
        return lambda count: float(lr(count))
    value = float(lr)
    if not 0.0 <= value:
        raise ValueError(f"Invalid learning rate: {lr}")
    return lambda count: value


def check_params(params: Params) -> tuple[list[Any], list[torch.Tensor], optree.PyTreeSpec]:
    """Flattens `params` and checks that every leaf is a dense float or complex tensor.

    Arguments:
        params: a pytree of tensors.

    Returns `(accessors, leaves, treespec)` of `params` (optree's accessors print as
    `params['w'][0]` in error messages). Raises `TypeError` naming the first bad leaf.
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(params)
    for acc, leaf in zip(accessors, leaves):
        where = acc.codify("params")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where}: params leaves must be torch.Tensor, got {type(leaf).__name__}")
        if leaf.layout != torch.strided:
            raise TypeError(f"{where}: only strided (dense) tensors are supported, got {leaf.layout}")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{where}: params leaves must have a floating point (or complex) dtype, "
                f"got {leaf.dtype} with shape {tuple(leaf.shape)}"
            )
    return accessors, leaves, spec


def check_like(name: str, tree: Any, params: Params) -> list[torch.Tensor]:
    """Checks that `tree` matches `params` leaf for leaf: structure, shape, dtype, device.

    Arguments:
        name: how to call `tree` in error messages, e.g. "grads" or "state.exp_avg".
        tree: the pytree to check.
        params: the reference pytree (its leaves are not checked here: see `check_params`).

    Returns the leaves of `tree`, in the params' leaf order. Raises `ValueError` (or
    `TypeError` for a leaf that is not a tensor) naming the first leaf that differs.
    """
    return _check_like(name, tree, *optree.tree_flatten_with_accessor(params))


def _check_like(
    name: str, tree: Any, accessors: Sequence[Any], ref_leaves: Sequence[torch.Tensor], ref_spec: optree.PyTreeSpec
) -> list[torch.Tensor]:
    tree_accessors, leaves, spec = optree.tree_flatten_with_accessor(tree)
    if spec != ref_spec:
        want = [a.codify(name) for a in accessors]
        got = [a.codify(name) for a in tree_accessors]
        missing = [p for p in want if p not in set(got)]
        extra = [p for p in got if p not in set(want)]
        detail = []
        if missing:
            detail.append(f"missing leaves {missing[:5]}")
        if extra:
            detail.append(f"unexpected leaves {extra[:5]}")
        detail = "; ".join(detail) or "same leaf paths but different container types"
        raise ValueError(f"{name} structure does not match params: {detail}.\n  params: {ref_spec}\n  {name}: {spec}")
    for acc, ref, leaf in zip(accessors, ref_leaves, leaves):
        where = acc.codify(name)
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor, got {type(leaf).__name__}")
        if leaf.shape != ref.shape or leaf.dtype != ref.dtype:
            raise ValueError(
                f"{where} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}, but the "
                f"matching params leaf has shape {tuple(ref.shape)} and dtype {ref.dtype}"
            )
        if leaf.device != ref.device:
            raise ValueError(f"{where} is on device {leaf.device}, but the matching params leaf is on {ref.device}")
        if leaf.layout != torch.strided:
            raise TypeError(f"{where}: only strided (dense) tensors are supported, got {leaf.layout}")
    return leaves


def clone(tree: Any, *, inplace: bool = False) -> Any:
    """Private copies of a pytree's tensors, for an `apply` to update in place.

    Arguments:
        tree: a pytree of tensors (a list of leaves is one).
        inplace: the caller donated these tensors (`apply(..., inplace=True)`): return
            them (detached) instead of copies, so the update overwrites them.

    Returns a pytree of the same structure whose tensors are detached (outputs must not
    join the autograd graph of `nn.Parameter` inputs) and, unless `inplace`, new memory
    in the same memory format (`preserve_format`, as the `zeros_like` torch uses for state).
    """
    return optree.tree_map(lambda t: t.detach() if inplace else t.detach().clone(), tree)


def zeros_like(params: Params) -> Params:
    """Zeros with the structure, shapes, dtypes, devices and memory formats of `params`.

    Arguments:
        params: a pytree of tensors.

    Returns a new pytree, as torch.optim creates its state (`zeros_like(p,
    memory_format=torch.preserve_format)`).
    """
    return optree.tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)


def apply_per_leaf(
    step_leaf: Callable[..., None],
    grads: Grads,
    params: Params,
    states: Mapping[str, Optional[Params]] = {},  # noqa: B006 (never mutated)
    *,
    inplace: bool = False,
) -> tuple[Params, dict[str, Optional[Params]]]:
    """Runs `step_leaf` on each params leaf and the matching leaves of grads and states.

    The skeleton of a per-parameter update (torch's `_single_tensor_*` loops): checks
    every tree against params, makes private copies of params and of the state trees
    (none with `inplace=True`: the caller donated them), and calls, under `torch.no_grad()`,

        step_leaf(param, grad, *state_leaves)       # state leaves in the order of `states`

    for every leaf, where `param` and the state leaves are the private copies, to be
    updated in place, and `grad` is read only. A 0-d leaf is passed as a shape-(1,) view
    so that a 0-d float64 scalar in a binary op loses type promotion to it, as a Python
    float would (see `_exact`); a tree given as None (an optional state, e.g. AdamW's
    `max_exp_avg_sq` without amsgrad) gives None leaves and stays None. For hyperparameters
    that differ from leaf to leaf (parameter groups), see `apply_per_group`.

    Arguments:
        step_leaf: `(param, grad, *state_leaves) -> None`, updating in place.
        grads: the gradients, a pytree like `params`.
        params: the params pytree (float or complex tensors).
        states: state name -> pytree like `params` or None; names appear in errors as
            `state.<name>`.
        inplace: update `params` and the state trees' tensors in place (donated).

    Returns `(new_params, new_states)`, `new_states` a dict with the keys of `states`.
    """
    return apply_per_tensor(lambda _, *tensors: step_leaf(*tensors), grads, params, states, inplace=inplace)


def apply_per_tensor(
    step_tensor: Callable[..., None],
    grads: Grads,
    params: Params,
    states: Mapping[str, Optional[Params]] = {},  # noqa: B006 (never mutated)
    *,
    inplace: bool = False,
) -> tuple[Params, dict[str, Optional[Params]]]:
    """`apply_per_leaf`, calling `step_tensor(path, param, grad, *state_leaves)`, where `path`
    is the params leaf's path as `fs.tree_paths` writes it (in a step: the buffer name)."""
    accessors, p_leaves, spec = check_params(params)
    g_leaves = _check_like("grads", grads, accessors, p_leaves, spec)
    state_leaves = {
        name: None if tree is None else _check_like(f"state.{name}", tree, accessors, p_leaves, spec)
        for name, tree in states.items()
    }
    names = [path_string(a.path) for a in accessors]
    with torch.no_grad():
        new_params = clone(p_leaves, inplace=inplace)
        new_states = {name: None if leaves is None else clone(leaves, inplace=inplace) for name, leaves in state_leaves.items()}
        columns = [leaves or [None] * len(p_leaves) for leaves in new_states.values()]
        for name, param, grad, *state in zip(names, new_params, g_leaves, *columns):
            step_tensor(name, *(None if t is None else _exact.as_1d(t) for t in (param, grad.detach(), *state)))
    unflatten = lambda leaves: None if leaves is None else optree.tree_unflatten(spec, leaves)  # noqa: E731
    return unflatten(new_params), {name: unflatten(leaves) for name, leaves in new_states.items()}
