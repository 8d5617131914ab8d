"""The types of `functional_shard.optim`: `Optimizer`, `GradientTransformation`, and the
helpers that build them from their `init`, `scalars` and `apply` functions.

An optimizer is a set of pure functions, in the style of optax:

    opt = optim.adamw(1e-3)
    state = opt.init(params)
    params, state = opt.update(grads, state, params)

`update` is split in two so that a whole training step can be traced once and
replayed: `scalars(state)` computes, in Python, every value that changes from step to
step (learning rate, bias corrections, ...) as 0-d float64 tensors, and
`apply(grads, state, params, scalars, *, inplace, mesh, leaves)` is the traceable tensor
program that consumes them. `update(g, s, p)` is exactly `apply(g, s, p, scalars(s))`.

`leaves` (a `LeafLayout`, passed by a sharded step to `init` and `apply`) says which leaf of
the model each element of the flat shards belongs to: what per-leaf hyperparameters
(parameter groups) need. Functions that do not take it are wrapped by `make_optimizer`.

A `GradientTransformation` has the same four functions but maps gradients to new
gradients ("updates") instead of params to new params; `chain` runs transformations
before an optimizer.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, Union

if TYPE_CHECKING:  # annotations only: the mesh's class is the core's business
    from .._mesh import BaseMesh
    from ._groups import LeafLayout

__all__ = [
    "Params",
    "Grads",
    "Updates",
    "OptState",
    "LRSchedule",
    "ScalarOrSchedule",
    "InitFn",
    "UpdateFn",
    "Scalars",
    "ScalarsFn",
    "ApplyFn",
    "Optimizer",
    "GradientTransformation",
    "EmptyState",
    "make_optimizer",
    "make_transformation",
]

# Any optree pytree whose leaves are tensors, e.g. a dict of flat 1-D shard buffers.
Params = Any
# A pytree with exactly the structure of `Params`, leaf for leaf the same shape and dtype.
Grads = Any
# Gradients on their way through a chain of transformations: like `Grads`.
Updates = Any
# A pytree of tensors (a NamedTuple for the built-in optimizers, a tuple for `chain`).
OptState = Any
# Maps `count`, the number of updates already applied (0 on the first update), to a
# learning rate. (Not to be confused with `fs.Schedule`, the schedule of collectives.)
LRSchedule = Callable[[int], float]
ScalarOrSchedule = Union[float, LRSchedule]
# The per-step values `apply` consumes: a pytree of 0-d float64 CPU tensors (a
# `dict[str, Tensor]` for the built-in optimizers, a tuple of those for `chain`).
Scalars = Any

ScalarsFn = Callable[[OptState], Scalars]


class InitFn(Protocol):
    """`init(params, *, leaves=None) -> state` (a function `init(params)` is accepted too)."""

    def __call__(self, params: Params, /, *, leaves: Optional[LeafLayout] = None) -> OptState: ...


class UpdateFn(Protocol):
    """`update(grads, state, params, *, mesh=None, leaves=None) -> (new_params, new_state)`."""

    def __call__(
        self,
        grads: Grads,
        state: OptState,
        params: Params,
        /,
        *,
        mesh: Optional[BaseMesh] = None,
        leaves: Optional[LeafLayout] = None,
    ) -> tuple[Params, OptState]: ...


class ApplyFn(Protocol):
    """`apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None) -> (out, new_state)`.

    `out` is the new params for an `Optimizer`, the new updates for a
    `GradientTransformation`. `inplace`, `mesh` and `leaves` are keyword-only; every apply
    must accept `inplace` and `mesh`, even if it ignores them; `make_optimizer` adds
    `leaves` to one that does not take it.
    """

    def __call__(
        self,
        grads: Grads,
        state: OptState,
        params: Params,
        scalars: Scalars,
        /,
        *,
        inplace: bool = False,
        mesh: Optional[BaseMesh] = None,
        leaves: Optional[LeafLayout] = None,
    ) -> tuple[Any, OptState]: ...


class Optimizer(NamedTuple):
    """The pure functions that together define an optimizer (params -> new params).

    Build one with `make_optimizer(init, scalars, apply)`, which writes `update`.

    Arguments:
        init: `init(params, *, leaves=None) -> state`; builds the initial optimizer state for
            `params`. `leaves` (a `LeafLayout`, from a sharded step) says which leaf of the
            model each element of `params` belongs to; an optimizer with parameter groups
            checks its rules against it.
        update: `update(grads, state, params, *, mesh=None, leaves=None) -> (new_params,
            new_state)`; applies one optimizer step. It never mutates `grads`, `state` or
            `params`: the returned params and state are freshly allocated tensors. Exactly
            `apply(grads, state, params, scalars(state), mesh=mesh, leaves=leaves)`.
        scalars: `scalars(state) -> Scalars`; everything that changes from step to step (the
            scheduled learning rate and what derives from it and from the step count),
            computed in Python double precision exactly as torch's kernel computes it,
            each value a 0-d float64 CPU tensor. It reads the step count with `.item()`,
            so call it eagerly, outside any trace, once per step.
        apply: `apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None)
            -> (new_params, new_state)`; the update itself, written to be traced once (e.g.
            with `make_fx(..., tracing_mode="fake")`) and replayed every step: tensor ops
            only, no `.item()`, no branching on tensor values; the per-step values come in
            as the `scalars` tensors, while hyperparameters that never change are baked in
            as Python constants. It never mutates its inputs, unless called with
            `inplace=True`: then the caller donates `grads`, `params` and the state's
            tensors, and the update may overwrite them (as `torch.optim` does) instead of
            copying them. `mesh` is the mesh of the sharded step that calls it (None
            outside one): `grads` and `params` are then this rank's shards, and a
            reduction over the whole model is `global_sum(x, mesh)`. `leaves` is the
            `LeafLayout` of `params` (None: each tensor is a leaf of its own).
    """

    init: InitFn
    update: UpdateFn
    scalars: ScalarsFn
    apply: ApplyFn


class GradientTransformation(NamedTuple):
    """The pure functions of a gradient transformation (updates -> new updates).

    Like `Optimizer`, but `apply` returns transformed updates (same structure, shapes and
    dtypes as params) instead of new params; `chain(t1, ..., optimizer)` feeds them to
    an optimizer. Build one with `make_transformation(init, scalars, apply)`.

    Arguments:
        init: `init(params, *, leaves=None) -> state`.
        update: `update(updates, state, params, *, mesh=None, leaves=None) -> (new_updates,
            new_state)`; `apply(updates, state, params, scalars(state), mesh=mesh, leaves=leaves)`.
        scalars: `scalars(state) -> Scalars`, as for `Optimizer` (`{}` when there are none).
        apply: `apply(updates, state, params, scalars, *, inplace=False, mesh=None,
            leaves=None) -> (new_updates, new_state)`; traceable, as for `Optimizer`. `params`
            is read only. With `inplace=True` the caller donates `updates` and the state's tensors.
    """

    init: InitFn
    update: UpdateFn
    scalars: ScalarsFn
    apply: ApplyFn


class EmptyState(NamedTuple):
    """The state of a stateless transformation: no leaves."""


def make_optimizer(init: InitFn, scalars: ScalarsFn, apply: ApplyFn) -> Optimizer:
    """An `Optimizer` from its three functions; writes `update = apply(..., scalars(state))`.

    Arguments:
        init: `init(params) -> state`, or `init(params, *, leaves=None) -> state` to see
            the `LeafLayout` (which leaf each element of params belongs to).
        scalars: `scalars(state) -> Scalars` (eager).
        apply: `apply(grads, state, params, scalars, *, inplace=False, mesh=None) ->
            (new_params, new_state)` (traceable); must accept `inplace` and `mesh` by keyword,
            and may accept `leaves` (a `LeafLayout` or None) to apply per-leaf hyperparameters
            (see `apply_per_group`).

    Returns an `Optimizer` whose `init` and `apply` accept `leaves` (and ignore it where the
    given functions do not take it).
    """
    init, apply = _with_leaves(init, "init"), _with_leaves(apply, "apply")
    return Optimizer(init=init, update=_update_of(scalars, apply), scalars=scalars, apply=apply)


def make_transformation(init: InitFn, scalars: ScalarsFn, apply: ApplyFn) -> GradientTransformation:
    """A `GradientTransformation` from its three functions, as `make_optimizer`.

    Arguments:
        init: `init(params) -> state` (or with `leaves=`, as for `make_optimizer`).
        scalars: `scalars(state) -> Scalars` (eager; return `{}` if there are none).
        apply: `apply(updates, state, params, scalars, *, inplace=False, mesh=None) ->
            (new_updates, new_state)` (traceable); must accept `inplace` and `mesh` by keyword;
            may accept `leaves`.

    Returns a `GradientTransformation`.
    """
    init, apply = _with_leaves(init, "init"), _with_leaves(apply, "apply")
    return GradientTransformation(init=init, update=_update_of(scalars, apply), scalars=scalars, apply=apply)


def _update_of(scalars: ScalarsFn, apply: ApplyFn) -> UpdateFn:
    def update(grads: Grads, state: OptState, params: Params, *, mesh: Optional[BaseMesh] = None, leaves=None):
        return apply(grads, state, params, scalars(state), mesh=mesh, leaves=leaves)

    return update


def _keywords(fn: Callable) -> Optional[set[str]]:
    """The keyword names `fn` accepts; None when it takes any (`**kwargs`) or cannot be read."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins, some C callables: trust them
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return {n for n, p in parameters.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def _with_leaves(fn: Callable, role: str) -> Callable:
    """`fn` itself if it takes `leaves=`, else `fn` wrapped to accept and ignore it. For an
    apply, first checks that it takes `inplace` and `mesh` (fails now, not mid-step)."""
    keywords = _keywords(fn)
    if role == "apply" and keywords is not None:
        missing = [name for name in ("inplace", "mesh") if name not in keywords]
        if missing:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"apply {name} must accept the keyword arguments `inplace` and `mesh` (missing: "
                f"{', '.join(missing)}); write it as `def apply(grads, state, params, scalars, *, "
                "inplace=False, mesh=None)` and ignore the ones it does not use"
            )
    if keywords is None or "leaves" in keywords:
        return fn

    @functools.wraps(fn)
    def without_leaves(*args, leaves=None, **kwargs):
        return fn(*args, **kwargs)

    return without_leaves
