"""`StepState`: the immutable state of a sharded training step on one rank, and the record of
which step made it (and which states it took in place, `donate=True`)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from ._pytree import pytree_dataclass, static_field
from ._reference import StepError
from ._shard import Sharded

__all__ = ["StepState", "check_not_donated"]


class _StepKey:
    """Identifies the `ShardedStep` that made a state (compared by identity)."""

    __slots__ = ("description", "donated", "__weakref__")

    def __init__(self, description: str):
        self.description = description
        # States the step took in place (donate=True): their tensors now hold the values of
        # the states it returned, so nothing may read them again (a step, a save, an export).
        self.donated: weakref.WeakSet[StepState] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"<step {self.description}>"


def check_is_state(state: Any, what: str) -> None:
    """Raises StepError unless `state` is a `StepState` (what `step.init` makes)."""
    if not isinstance(state, StepState):
        raise StepError(f"{what} expects the StepState made by step.init; got {type(state).__name__} "
                        "(call state = step.init(params) first, then state, metrics = step(state, batch))")


def check_seed(seed: Any) -> None:
    """Raises ValueError unless `seed` is an int a state can hold (a 0-d int64 tensor)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not -(2**63) <= seed < 2**63:
        raise ValueError(f"init(seed=...) must be an int in [-2**63, 2**63) (a state holds it as int64); got {seed!r}")


def check_not_donated(state: "StepState", what: str) -> None:
    """Raises StepError if `state` was donated to a step (`donate=True`): its tensors were
    updated in place and now hold the values of the state that step returned."""
    if state in state._key.donated:
        raise StepError(
            f"{what}: this state (step {state.step}) was donated to a step made with donate=True, which "
            f"updated its tensors in place for the state it returned (step {state.step + 1}): use the "
            "returned state"
        )


@pytree_dataclass
class StepState:
    """The state of a sharded training step on this rank (made by `ShardedStep.init`).

    Attributes:
        params: this rank's shards of the trainable and frozen parameters, and its own module
            buffers (a `Sharded`).
        opt_state: the optimizer's state over the trainable shards (a pytree whose parameter-like
            parts are dicts `buffer name -> shard`).
        loss_scale: the dynamic loss scale (`fs.LossScaleState`) with fp16 loss scaling, else None.
        rng: the seed of the step's random numbers (a 0-d int64 tensor): step `n` on rank `r`
            draws from a generator seeded by `(seed, n, r)` — reproducible, different on every
            rank, and resumed exactly with the state.
        step: number of steps taken (an int).
        gathered: with `fs.Schedule(reshard_after_update=False)` (ZeRO-1), every buffer's full
            parameters in its gather dtype, one flat tensor per buffer of the layout, kept from
            one step to the next; None otherwise. Derived from `params`: `replace(params=...)`
            without `gathered=` drops it (the next step gathers it again), so that a loaded or
            edited state never trains on stale full parameters.

    An immutable pytree node (optree and torch): its leaves are those of `params`,
    `opt_state`, `loss_scale`, `rng` and `gathered`; `step` and the step that made it are
    structure. `replace(**changes)` copies.
    It cannot be pickled (its shards are bound to a live mesh): use `fs.checkpoint`.
    """

    params: Sharded
    opt_state: Any
    loss_scale: Any
    rng: torch.Tensor
    step: int = static_field()
    _key: _StepKey = static_field(repr=False)
    gathered: Any = None

    def replace(self, **changes) -> "StepState":
        """A copy with `changes`; new `params` without a new `gathered` drop the old one."""
        if "params" in changes and "gathered" not in changes:
            changes["gathered"] = None
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        return f"StepState(step={self.step}, params={self.params!r})"

    def __reduce__(self):
        raise TypeError(
            "a StepState holds one rank's shards bound to a live mesh, so it cannot be pickled (torch.save, "
            "torch.distributed.checkpoint of the object itself): save it with fs.checkpoint.save(path, state) and "
            "load it with fs.checkpoint.load(path, step.init(params))"
        )
