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
    params, state = traced_apply(grads, state, params, sc, inplace=False, mesh=mesh)

In a sharded step `apply` sees this rank's shards; `mesh` (the step's mesh) lets it
reduce over the whole model with `global_sum` / `global_norm`.

Optimizers compose with gradient transformations (updates -> updates):

    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))

Parameter groups (per-leaf hyperparameters, by rules on the leaves' paths) and
learning-rate schedules are values too:

    opt = optim.adamw(optim.warmup_cosine_schedule(3e-4, warmup_steps=100, steps=1000),
                      weight_decay=0.1, groups=[optim.group("*.bias", "*norm*", weight_decay=0.0)])

and `from_torch(torch_optimizer, model, scheduler)` converts a `torch.optim` AdamW / SGD with
its param groups and lr scheduler.

Writing one: `make_optimizer(init, scalars, apply)` from the blocks `check_params`,
`check_like`, `as_schedule`, `scalar`, `zeros_like`, `clone`, `apply_per_leaf` and, for
parameter groups, `apply_per_group` (an example is in `functional_shard/optim/_blocks.py`).

Results are bit-identical to `torch.optim.AdamW` / `torch.optim.SGD` (with the same param
groups and `torch.optim.lr_scheduler`) stepping the same tensors on CPU.
"""

from ._adamw import AdamWState as AdamWState
from ._adamw import adamw as adamw
from ._base import ApplyFn as ApplyFn
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import Grads as Grads
from ._base import InitFn as InitFn
from ._base import LRSchedule as LRSchedule
from ._base import Optimizer as Optimizer
from ._base import OptState as OptState
from ._base import Params as Params
from ._base import ScalarOrSchedule as ScalarOrSchedule
from ._base import Scalars as Scalars
from ._base import ScalarsFn as ScalarsFn
from ._base import UpdateFn as UpdateFn
from ._base import Updates as Updates
from ._base import make_optimizer as make_optimizer
from ._base import make_transformation as make_transformation
from ._blocks import apply_per_leaf as apply_per_leaf
from ._blocks import as_schedule as as_schedule
from ._blocks import check_like as check_like
from ._blocks import check_params as check_params
from ._blocks import clone as clone
from ._blocks import zeros_like as zeros_like
from ._chain import chain as chain
from ._clip import clip_by_global_norm as clip_by_global_norm
from ._exact import scalar as scalar
from ._global import global_norm as global_norm
from ._global import global_sum as global_sum
from ._groups import LeafLayout as LeafLayout
from ._groups import LeafRange as LeafRange
from ._groups import ParamGroup as ParamGroup
from ._groups import apply_per_group as apply_per_group
from ._groups import group as group
from ._schedules import constant_schedule as constant_schedule
from ._schedules import cosine_schedule as cosine_schedule
from ._schedules import join_schedules as join_schedules
from ._schedules import lambda_schedule as lambda_schedule
from ._schedules import linear_schedule as linear_schedule
from ._schedules import warmup_cosine_schedule as warmup_cosine_schedule
from ._schedules import warmup_linear_schedule as warmup_linear_schedule
from ._torch import as_optimizer as as_optimizer
from ._torch import from_torch as from_torch
from ._sgd import SGDState as SGDState
from ._sgd import sgd as sgd

__all__ = [
    "AdamWState",
    "ApplyFn",
    "EmptyState",
    "GradientTransformation",
    "Grads",
    "InitFn",
    "LRSchedule",
    "LeafLayout",
    "LeafRange",
    "OptState",
    "Optimizer",
    "ParamGroup",
    "Params",
    "SGDState",
    "ScalarOrSchedule",
    "Scalars",
    "ScalarsFn",
    "UpdateFn",
    "Updates",
    "adamw",
    "apply_per_group",
    "apply_per_leaf",
    "as_optimizer",
    "as_schedule",
    "chain",
    "check_like",
    "check_params",
    "clip_by_global_norm",
    "clone",
    "constant_schedule",
    "cosine_schedule",
    "from_torch",
    "global_norm",
    "global_sum",
    "group",
    "join_schedules",
    "lambda_schedule",
    "linear_schedule",
    "make_optimizer",
    "make_transformation",
    "scalar",
    "sgd",
    "warmup_cosine_schedule",
    "warmup_linear_schedule",
    "zeros_like",
]
