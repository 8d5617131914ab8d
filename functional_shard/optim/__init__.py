"""Functional (optax-style) optimizers, bit-identical to torch.optim's own kernels.

An `Optimizer` is a NamedTuple of pure functions:

    opt = optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)                              # params: any pytree of tensors
    params, state = opt.update(grads, state, params)      # inputs are never mutated

`update` is `apply(grads, state, params, scalars(state))`: `scalars` computes the
per-step values (learning rate, bias corrections, ...) eagerly as 0-d float64 tensors,
and `apply` is a traceable tensor program taking them as inputs, so a training step
can be traced once (e.g. `make_fx(..., tracing_mode="fake")`) and replayed:

    sc = opt.scalars(state)                               # eager, every step
    params, state = traced_apply(grads, state, params, sc)

Results are bit-identical to `torch.optim.AdamW` / `torch.optim.SGD` stepping the
same tensors on CPU.
"""

from ._adamw import AdamWState, adamw
from ._base import (
    ApplyFn,
    Grads,
    InitFn,
    Optimizer,
    OptState,
    Params,
    ScalarOrSchedule,
    Scalars,
    ScalarsFn,
    Schedule,
    UpdateFn,
)
from ._sgd import SGDState, sgd

__all__ = [
    "Optimizer",
    "InitFn",
    "UpdateFn",
    "ScalarsFn",
    "ApplyFn",
    "Scalars",
    "Params",
    "Grads",
    "OptState",
    "Schedule",
    "ScalarOrSchedule",
    "AdamWState",
    "adamw",
    "SGDState",
    "sgd",
]
