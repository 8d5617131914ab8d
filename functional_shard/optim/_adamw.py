"""AdamW as pure functions mirroring torch's single-tensor Adam kernel."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.optim.optimizer import _get_scalar_dtype

from . import _exact
from ._base import Optimizer, Params, ScalarOrSchedule, Scalars, make_optimizer
from ._blocks import apply_per_leaf, as_schedule, check_params, zeros_like

__all__ = ["AdamWState", "adamw"]


class AdamWState(NamedTuple):
    """State of `adamw`.

    Every field is either a tensor or a tree with the structure of params, so the
    whole state is a pytree of tensors that can be sharded like params.
    """

    # Number of updates applied so far, as torch.optim.AdamW stores its per-parameter
    # `step`: a 0-d CPU tensor of dtype float32 (float64 if that is torch's default
    # dtype). One counter serves all leaves because every leaf is stepped together.
    count: torch.Tensor
    # First-moment running average; same structure, shapes and dtypes as params.
    exp_avg: Params
    # Second-moment running average; same structure, shapes and dtypes as params.
    exp_avg_sq: Params
    # Running maximum of exp_avg_sq when `amsgrad=True`, otherwise None (an empty
    # pytree node, so it contributes no leaves).
    max_exp_avg_sq: Optional[Params]


def adamw(
    lr: ScalarOrSchedule,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
) -> Optimizer:
    """AdamW (decoupled weight decay), bit-identical to `torch.optim.AdamW`.

    The update is torch's single-tensor Adam kernel
    (`torch.optim.adam._single_tensor_adam` with `decoupled_weight_decay=True`, what
    `torch.optim.AdamW.step` runs on CPU) transcribed op for op, with the values that
    change from step to step taken from tensors instead of Python floats, so that the
    update can be traced once and replayed:

    * `scalars(state)` (eager, Python): with `count = state.count.item()` (updates
      already applied), `step = count + 1` (torch increments its step tensor first, in
      the count's dtype) and `lr` the schedule's value at `count`, returns 0-d float64
      CPU tensors holding, computed in Python floats exactly as the kernel does:

        - "lr": `lr` (not read by `apply`; there for logging).
        - "decay": `1 - lr * weight_decay`, the decoupled decay factor of params.
        - "neg_step_size": `-(lr / (1 - beta1 ** step))`.
        - "bias_correction2_sqrt": `(1 - beta2 ** step) ** 0.5`.

    * `apply(grads, state, params, scalars, *, inplace=False, mesh=None)` (traceable):
      tensor ops only, consuming the scalars above as tensors; `betas`, `eps`,
      `weight_decay`, `amsgrad` and `maximize` never change and are baked in as Python
      constants; `mesh` is not used (the update is elementwise). The new `count` is
      `state.count + 1`. Each op with a varying Scalar argument is replaced by its exact
      tensor form (see `functional_shard/optim/_exact.py`); e.g.
      `param.addcdiv_(exp_avg, denom, value=-step_size)` becomes
      `param + (exp_avg * neg_step_size) / denom`, evaluated in the kernel's op-math
      type (float for bfloat16/float16, rounded once).
    * `update(grads, state, params)` is `apply(grads, state, params, scalars(state))`.

    Results match torch.optim.AdamW bit for bit on CPU, for float32, float64,
    bfloat16/float16 and complex params (updated, as torch does, on real views).

    Arguments:
        lr: learning rate: a non-negative float, or a schedule `count -> float` (see
            `as_schedule`; `count` is the number of updates already applied).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: decoupled weight decay coefficient.
        amsgrad: whether to use the AMSGrad variant (keeps `max_exp_avg_sq`).
        maximize: maximize the objective instead of minimizing it.

    Returns an `Optimizer` whose state is an `AdamWState`.
    """
    lr_at = as_schedule(lr)
    beta1, beta2 = (float(b) for b in betas)
    eps = float(eps)
    weight_decay = float(weight_decay)
    # Same validation as torch.optim.Adam.__init__, so bad values fail at build time.
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    _exact.warm_up()

    def init(params: Params) -> AdamWState:
        check_params(params)
        return AdamWState(
            # Mirrors torch's non-capturable, non-fused step: hosted on CPU so reading
            # it (for the schedule and bias correction) never syncs a device.
            count=torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"),
            exp_avg=zeros_like(params),
            exp_avg_sq=zeros_like(params),
            max_exp_avg_sq=zeros_like(params) if amsgrad else None,
        )

    def scalars(state: AdamWState) -> Scalars:
        count = state.count.detach()
        # torch: `step_t += 1` on its step tensor, then `step = step_t.item()`.
        step = (count + 1).item()
        step_lr = lr_at(int(count.item()))
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = step_lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        return {
            "lr": _exact.scalar(step_lr),
            "decay": _exact.scalar(1 - step_lr * weight_decay),
            "neg_step_size": _exact.scalar(-step_size),
            "bias_correction2_sqrt": _exact.scalar(bias_correction2_sqrt),
        }

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None):  # an ApplyFn
        if amsgrad and state.max_exp_avg_sq is None:
            raise ValueError("state.max_exp_avg_sq is None but amsgrad=True")
        decay = scalars["decay"]
        neg_step_size = scalars["neg_step_size"]
        bias_correction2_sqrt = scalars["bias_correction2_sqrt"]

        def step_leaf(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq) -> None:
            # torch's loop body for one parameter (non-capturable, non-differentiable
            # branch), in place on our private copies.
            if maximize:
                grad = -grad
            if weight_decay != 0:
                param.mul_(_exact.operand(decay, param))
            if torch.is_complex(param):
                grad = torch.view_as_real(grad)
                exp_avg = torch.view_as_real(exp_avg)
                exp_avg_sq = torch.view_as_real(exp_avg_sq)
                if max_exp_avg_sq is not None:
                    max_exp_avg_sq = torch.view_as_real(max_exp_avg_sq)
                param = torch.view_as_real(param)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            if max_exp_avg_sq is not None:
                torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
                denom = (max_exp_avg_sq.sqrt() / _exact.operand(bias_correction2_sqrt, exp_avg_sq)).add_(eps)
            else:
                denom = (exp_avg_sq.sqrt() / _exact.operand(bias_correction2_sqrt, exp_avg_sq)).add_(eps)
            # param.addcdiv_(exp_avg, denom, value=-step_size)
            _exact.addcdiv_scaled_(param, exp_avg, denom, neg_step_size)

        states = {
            "exp_avg": state.exp_avg,
            "exp_avg_sq": state.exp_avg_sq,
            "max_exp_avg_sq": state.max_exp_avg_sq if amsgrad else None,
        }
        new_params, new = apply_per_leaf(step_leaf, grads, params, states, inplace=inplace)
        new_state = AdamWState(count=state.count.detach() + 1, **new)
        return new_params, new_state

    return make_optimizer(init, scalars, apply)
