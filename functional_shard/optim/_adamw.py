"""AdamW as a pair of pure functions over torch's own Adam kernel."""

from __future__ import annotations

from typing import NamedTuple, Optional

import optree
import torch
from torch.optim.adamw import adamw as _torch_adamw
from torch.optim.optimizer import _get_scalar_dtype

from ._base import (
    Grads,
    Optimizer,
    Params,
    ScalarOrSchedule,
    _check_like,
    _check_params,
    _clone,
    _kernel_choice,
    _lr_fn,
)

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

    `update` clones params and state, then runs torch's functional
    `torch.optim.adamw.adamw` (in torch 2.13: `torch.optim.adam.adam(...,
    decoupled_weight_decay=True)`, exactly what `torch.optim.AdamW.step` calls) in
    place on the clones, with the foreach/fused choice torch makes by default (on
    CPU: the single-tensor kernel).

    Arguments:
      lr: learning rate. Either a non-negative float, or a schedule: a callable
        `count -> float` where `count` is the number of updates already applied
        (0 on the first update, 1 on the second, ...). `base_lr * f(count)` matches
        `torch.optim.lr_scheduler.LambdaLR(opt, f)` stepped once after each update.
      betas: coefficients of the running averages of the gradient and its square.
      eps: term added to the denominator for numerical stability.
      weight_decay: decoupled weight decay coefficient.
      amsgrad: whether to use the AMSGrad variant (keeps `max_exp_avg_sq`).
      maximize: maximize the objective instead of minimizing it.

    Returns:
      An `Optimizer` whose state is an `AdamWState`.
    """
    lr_fn = _lr_fn(lr)
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

    def init(params: Params) -> AdamWState:
        _check_params(params)

        def zeros(tree: Params) -> Params:
            return optree.tree_map(
                lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), tree
            )

        return AdamWState(
            # Mirrors torch's non-capturable, non-fused step: hosted on CPU so reading
            # it (for the schedule and bias correction) never syncs a device.
            count=torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu"),
            exp_avg=zeros(params),
            exp_avg_sq=zeros(params),
            max_exp_avg_sq=zeros(params) if amsgrad else None,
        )

    def update(grads: Grads, state: AdamWState, params: Params) -> tuple[Params, AdamWState]:
        accessors, p_leaves, spec = _check_params(params)
        g_leaves = _check_like("grads", grads, accessors, p_leaves, spec)
        m_leaves = _check_like("state.exp_avg", state.exp_avg, accessors, p_leaves, spec)
        v_leaves = _check_like("state.exp_avg_sq", state.exp_avg_sq, accessors, p_leaves, spec)
        if amsgrad:
            if state.max_exp_avg_sq is None:
                raise ValueError("state.max_exp_avg_sq is None but amsgrad=True")
            vmax_leaves = _check_like(
                "state.max_exp_avg_sq", state.max_exp_avg_sq, accessors, p_leaves, spec
            )
        else:
            vmax_leaves = []

        count = state.count
        step_lr = lr_fn(int(count.item()))

        with torch.no_grad():
            new_p = _clone(p_leaves)
            new_m = _clone(m_leaves)
            new_v = _clone(v_leaves)
            new_vmax = _clone(vmax_leaves)
            # One step tensor per leaf, as torch keeps one per parameter: the kernels
            # increment each list entry in place, so a shared tensor would be bumped
            # once per leaf.
            steps = [count.detach().clone() for _ in new_p]
            fused, foreach = _kernel_choice(new_p)
            if fused or foreach:
                # The single-tensor kernel only reads grads; the multi-tensor and fused
                # ones are not documented to, so give them private copies.
                g_leaves = _clone(g_leaves)
            # Pass list copies: for complex leaves the kernel swaps entries of
            # max_exp_avg_sqs for real views, and we must return the tensors we own.
            # torch.optim.adamw.adamw is what AdamW.step runs: in torch 2.13 both are
            # torch.optim.adam.adam(..., decoupled_weight_decay=True); calling adamw keeps
            # older torch (own AdamW kernel, no decoupled_weight_decay flag) working too.
            _torch_adamw(
                list(new_p),
                list(g_leaves),
                list(new_m),
                list(new_v),
                list(new_vmax),
                list(steps),
                foreach=foreach,
                fused=fused,
                capturable=False,
                differentiable=False,
                has_complex=any(torch.is_complex(p) for p in new_p),
                amsgrad=amsgrad,
                beta1=beta1,
                beta2=beta2,
                lr=step_lr,
                weight_decay=weight_decay,
                eps=eps,
                maximize=maximize,
            )
            new_count = steps[0] if steps else count.detach() + 1

        unflatten = lambda leaves: optree.tree_unflatten(spec, leaves)  # noqa: E731
        new_state = AdamWState(
            count=new_count,
            exp_avg=unflatten(new_m),
            exp_avg_sq=unflatten(new_v),
            max_exp_avg_sq=unflatten(new_vmax) if amsgrad else None,
        )
        return unflatten(new_p), new_state

    return Optimizer(init=init, update=update)
