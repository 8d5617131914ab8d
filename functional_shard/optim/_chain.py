"""`chain`: gradient transformations composed, optionally ending in an optimizer."""

from __future__ import annotations

from typing import Any, Union

from ._base import GradientTransformation, Optimizer, OptState, Params, make_optimizer, make_transformation

__all__ = ["chain"]

Component = Union[GradientTransformation, Optimizer]


def chain(*components: Component) -> Component:
    """Compose gradient transformations, optionally followed by one optimizer.

    `chain(t1, t2, ..., opt)` runs `t1` on the gradients, `t2` on what `t1` returned, and
    so on, then `opt` with the transformed gradients: an `Optimizer` that
    `fs.sharded_step(..., optimizer=...)` accepts, e.g.

        fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-3))

    Without a final optimizer the chain is itself a `GradientTransformation`.

    * `init(params, *, leaves=None)` is the tuple of the components' states, in order.
    * `scalars(state)` is the tuple of the components' scalars (each computed from its
      own state), a pytree of 0-d float64 tensors.
    * `apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None)` calls
      each component's `apply` with its own state and scalars, the same `params`, and the
      chain's `inplace`, `mesh` and `leaves` (with `inplace=True` the caller donates the grads
      too: a transformation may scale them in place). Returns the last component's
      output and the tuple of the new states.

    Arguments:
        *components: `GradientTransformation`s, the last of which may be an `Optimizer`
            (an optimizer anywhere else raises `TypeError`: it returns params, not updates).

    Returns an `Optimizer` if the last component is one, else a `GradientTransformation`.
    """
    if not components:
        raise ValueError("chain needs at least one component, e.g. chain(clip_by_global_norm(1.0), adamw(1e-3))")
    for i, component in enumerate(components):
        last = i == len(components) - 1
        if isinstance(component, Optimizer) and not last:
            raise TypeError(
                f"chain: component {i} is an Optimizer (it returns new params, not updates); "
                f"only the last component may be one. Put it at the end."
            )
        if not isinstance(component, (GradientTransformation, Optimizer)):
            raise TypeError(
                f"chain: component {i} is a {type(component).__name__}; expected an "
                "fs.optim.GradientTransformation (or, last, an fs.optim.Optimizer)"
            )

    def init(params: Params, *, leaves=None) -> tuple:
        return tuple(c.init(params, leaves=leaves) for c in components)

    def scalars(state: OptState) -> tuple:
        _check_tuple("state", state, len(components))
        return tuple(c.scalars(s) for c, s in zip(components, state))

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None):  # an ApplyFn
        _check_tuple("state", state, len(components))
        _check_tuple("scalars", scalars, len(components))
        out, new_states = grads, []
        for c, s, sc in zip(components, state, scalars):
            out, s = c.apply(out, s, params, sc, inplace=inplace, mesh=mesh, leaves=leaves)
            new_states.append(s)
        return out, tuple(new_states)

    make = make_optimizer if isinstance(components[-1], Optimizer) else make_transformation
    return make(init, scalars, apply)


def _check_tuple(name: str, value: Any, n: int) -> None:
    if not isinstance(value, tuple) or len(value) != n:
        got = f"a tuple of {len(value)}" if isinstance(value, tuple) else f"a {type(value).__name__}"
        raise ValueError(f"chain of {n} components: {name} must be a tuple of {n} (one per component), got {got}")
