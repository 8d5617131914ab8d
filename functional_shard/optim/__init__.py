"""Functional (optax-style) optimizers backed by torch.optim's own kernels.

An `Optimizer` is a NamedTuple of two pure functions:

    opt = optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(params)                              # params: any pytree of tensors
    params, state = opt.update(grads, state, params)      # inputs are never mutated

Results are bit-identical to `torch.optim.AdamW` / `torch.optim.SGD` stepping the
same tensors.
"""

from ._adamw import AdamWState, adamw
from ._base import (
    Grads,
    InitFn,
    Optimizer,
    OptState,
    Params,
    ScalarOrSchedule,
    Schedule,
    UpdateFn,
)
from ._sgd import SGDState, sgd

__all__ = [
    "Optimizer",
    "InitFn",
    "UpdateFn",
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
