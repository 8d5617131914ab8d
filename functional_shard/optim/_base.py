"""Base types and shared helpers for `functional_shard.optim`.

An optimizer is a set of pure functions, in the style of optax:

    opt = optim.adamw(1e-3)
    state = opt.init(params)
    params, state = opt.update(grads, state, params)

`update` is split in two so that a whole training step can be traced once and
replayed: `scalars(state)` computes, in Python, every value that changes from step to
step (learning rate, bias corrections, ...) as 0-d float64 tensors, and
`apply(grads, state, params, scalars)` is the traceable tensor program that consumes
them. `update(g, s, p)` is exactly `apply(g, s, p, scalars(s))`.

`apply` mirrors torch's own single-tensor kernels (`torch.optim.adam._single_tensor_adam`,
`torch.optim.sgd._single_tensor_sgd`) op for op, keeping their constant Python scalars
and feeding the varying ones as tensors through the exact forms in `_exact`, so results
are bit-identical to `torch.optim` on CPU.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import optree
import torch

__all__ = [
    "Params",
    "Grads",
    "OptState",
    "Schedule",
    "ScalarOrSchedule",
    "InitFn",
    "UpdateFn",
    "Scalars",
    "ScalarsFn",
    "ApplyFn",
    "Optimizer",
]

# Any optree pytree whose leaves are tensors, e.g. a dict or tuple of flat 1-D buffers.
Params = Any
# A pytree with exactly the structure of `Params`, leaf for leaf the same shape and dtype.
Grads = Any
# A NamedTuple of tensors and `Params`-like trees; each optimizer defines its own.
OptState = Any
# Maps `count`, the number of updates already applied (0 on the first update), to a value.
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]

InitFn = Callable[[Params], OptState]
UpdateFn = Callable[[Grads, OptState, Params], tuple[Params, OptState]]
# The per-step values `apply` consumes, each a 0-d float64 CPU tensor.
Scalars = dict[str, torch.Tensor]
ScalarsFn = Callable[[OptState], Scalars]
ApplyFn = Callable[[Grads, OptState, Params, Scalars], tuple[Params, OptState]]


class Optimizer(NamedTuple):
    """The pure functions that together define an optimizer.

    Arguments:
      init: `init(params) -> state`; builds the initial optimizer state for `params`.
      update: `update(grads, state, params) -> (new_params, new_state)`; applies one
        optimizer step. It never mutates `grads`, `state` or `params`: the returned
        params and state are freshly allocated tensors. Exactly
        `apply(grads, state, params, scalars(state))`.
      scalars: `scalars(state) -> dict[str, Tensor]`; everything that changes from step
        to step (the scheduled learning rate and what derives from it and from the step
        count), computed in Python double precision exactly as torch's kernel computes
        it, each value a 0-d float64 CPU tensor. It reads the step count with `.item()`,
        so call it eagerly, outside any trace, once per step.
      apply: `apply(grads, state, params, scalars) -> (new_params, new_state)`; the
        update itself, written to be traced once (e.g. with
        `make_fx(..., tracing_mode="fake")`) and replayed every step: tensor ops only,
        no `.item()`, no branching on tensor values; the per-step values come in as the
        `scalars` tensors, while hyperparameters that never change are baked in as
        Python constants. It never mutates its inputs, unless called with
        `inplace=True`: then the caller donates `params` and the state's tensors, and
        the update overwrites them (as `torch.optim` does) instead of copying them.
    """

    init: InitFn
    update: UpdateFn
    scalars: ScalarsFn
    apply: ApplyFn


def _lr_fn(lr: ScalarOrSchedule) -> Schedule:
    """Normalizes `lr` (a float or a schedule) into a schedule.

    Arguments:
      lr: a non-negative float, or a callable `count -> float`.

    Returns:
      A callable `count -> float`.
    """
    if callable(lr):
        return lambda count: float(lr(count))
    value = float(lr)
    # Same check (and message) as torch.optim's constructors.
    if not 0.0 <= value:
        raise ValueError(f"Invalid learning rate: {lr}")
    return lambda count: value


def _flatten(tree: Any) -> tuple[list[Any], list[Any], optree.PyTreeSpec]:
    # Accessors rather than raw paths: they print as `params['w'][0]`, keeping the
    # container type (dict key vs. namedtuple field) visible in error messages.
    return optree.tree_flatten_with_accessor(tree)


def _check_params(tree: Params) -> tuple[list[Any], list[torch.Tensor], optree.PyTreeSpec]:
    """Flattens `params` and checks that every leaf is a float or complex tensor.

    Arguments:
      tree: the params pytree.

    Returns:
      `(accessors, leaves, treespec)` of `tree`.
    """
    accessors, leaves, spec = _flatten(tree)
    for acc, leaf in zip(accessors, leaves):
        where = acc.codify("params")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{where}: params leaves must be torch.Tensor, got {type(leaf).__name__}"
            )
        if leaf.layout != torch.strided:
            raise TypeError(f"{where}: only strided (dense) tensors are supported, got {leaf.layout}")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{where}: params leaves must have a floating point (or complex) dtype, "
                f"got {leaf.dtype} with shape {tuple(leaf.shape)}"
            )
    return accessors, leaves, spec


def _check_like(
    name: str,
    tree: Any,
    accessors: Sequence[Any],
    ref_leaves: Sequence[torch.Tensor],
    ref_spec: optree.PyTreeSpec,
) -> list[torch.Tensor]:
    """Checks that `tree` matches params leaf for leaf: structure, shape, dtype, device.

    Arguments:
      name: how to call `tree` in error messages, e.g. "grads" or "state.exp_avg".
      tree: the pytree to check.
      accessors: accessors of the params leaves, from `_check_params`.
      ref_leaves: the params leaves.
      ref_spec: the params treespec.

    Returns:
      The leaves of `tree`, in the params' leaf order.
    """
    tree_accessors, leaves, spec = _flatten(tree)
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
        raise ValueError(
            f"{name} structure does not match params: {detail}.\n"
            f"  params: {ref_spec}\n  {name}: {spec}"
        )
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
            raise ValueError(
                f"{where} is on device {leaf.device}, but the matching params leaf "
                f"is on {ref.device}"
            )
        if leaf.layout != torch.strided:
            raise TypeError(f"{where}: only strided (dense) tensors are supported, got {leaf.layout}")
    return leaves


def _clone(leaves: Sequence[torch.Tensor], inplace: bool = False) -> list[torch.Tensor]:
    # detach: outputs must not join the autograd graph of nn.Parameter inputs;
    # clone keeps torch's preserve_format, like the zeros_like torch uses for state.
    # inplace: the caller donates these tensors, so the update may overwrite them.
    return [t.detach() if inplace else t.detach().clone() for t in leaves]
