"""AdamW as pure functions mirroring torch's single-tensor Adam kernel."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.optim.optimizer import _get_scalar_dtype

from . import _exact
from ._base import Optimizer, Params, ScalarOrSchedule, Scalars, make_optimizer
from ._blocks import apply_per_tensor, as_schedule, check_params, zeros_like
from ._groups import LeafLayout, ParamGroup, check_options, cut, merge, options_per_group, resolve, runs_of

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
    groups: Sequence[ParamGroup] = (),
    fused: bool = False,
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

      With `groups`, a tuple of such dicts: the optimizer's own (group 0), then one per group.
    * `apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None)`
      (traceable): tensor ops only, consuming the scalars above as tensors; `betas`, `eps`,
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

    Parameter groups: `groups=[fs.optim.group(rules..., lr=, weight_decay=, betas=, eps=)]`
    gives the leaves a rule matches their own hyperparameters, as torch's param groups do
    (`torch.optim.AdamW([{"params": ..., "weight_decay": 0.0}, ...])`), bit for bit. Within a
    flat shard, the weight decay runs over each stretch of leaves that share `(lr,
    weight_decay)`, the rest of the update over each stretch that shares `(lr, betas, eps)`:
    a mask on weight decay alone costs one multiplication per decayed stretch, and a shard in
    one group is updated whole, as without groups. See `group` for the rules.

    Arguments:
        lr: learning rate: a non-negative float, or a schedule `count -> float` (see
            `as_schedule` and `cosine_schedule`; `count` is the number of updates already applied).
        betas: coefficients of the running averages of the gradient and its square.
        eps: term added to the denominator for numerical stability.
        weight_decay: decoupled weight decay coefficient.
        amsgrad: whether to use the AMSGrad variant (keeps `max_exp_avg_sq`).
        maximize: maximize the objective instead of minimizing it.
        groups: `fs.optim.group(...)`s: per-leaf `lr`, `weight_decay`, `betas`, `eps`; a leaf
            takes the first group that matches it, other leaves the arguments above.
        fused: run torch's fused AdamW kernel (`torch._fused_adamw_`, what
            `torch.optim.AdamW(fused=True)` runs) once per flat shard (per group's stretch of
            it) instead of the single-tensor kernel's ~10 elementwise operations: one pass over
            the parameters, gradients and moments, the update's cost on a GPU (where the
            single-tensor form reads and writes the 1.1B parameters of a Llama ~10 times a
            step). The bits are then those of `torch.optim.AdamW(fused=True)` (bit for bit on
            CPU and on an H200, tests/test_optim.py and tests/test_cuda.py), not those of the
            default kernel: it computes the bias corrections
            in float32 from the step count. Real floating params only (float32, bfloat16,
            float16); the traced step replays it like any other operation.

    Returns an `Optimizer` whose state is an `AdamWState`.
    """
    groups = check_options(groups, ("lr", "weight_decay", "betas", "eps"), "fs.optim.adamw")
    hyper = [
        _hyperparameters(**o)
        for o in options_per_group(groups, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
    ]
    _exact.warm_up()

    def init(params: Params, *, leaves: Optional[LeafLayout] = None) -> AdamWState:
        check_params(params)
        if groups:  # fails now for a rule that matches no leaf
            resolve(groups, leaves if leaves is not None else LeafLayout.of_tree(params), "fs.optim.adamw")
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
        per_group = tuple(h.scalars(int(count.item()), step) for h in hyper)
        return per_group if groups else per_group[0]

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None):  # an ApplyFn
        if amsgrad and state.max_exp_avg_sq is None:
            raise ValueError("state.max_exp_avg_sq is None but amsgrad=True")
        per_group = scalars if groups else (scalars,)
        plan = None
        if groups:
            plan = resolve(groups, leaves if leaves is not None else LeafLayout.of_tree(params), "fs.optim.adamw")

        def step_tensor(name, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq) -> None:
            # torch's loop body for one parameter (non-capturable, non-differentiable
            # branch), in place on our private copies, over each run of one group.
            runs = runs_of(plan, name, param.numel())
            if fused:
                _fused_step(name, runs, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, state.count)
                return
            if maximize:
                grad = -grad
            for run in merge(runs, lambda g: hyper[g].decay_key):
                if hyper[run.group].weight_decay != 0:
                    piece = cut(param, run)
                    piece.mul_(_exact.operand(per_group[run.group]["decay"], piece))
            for run in merge(runs, lambda g: hyper[g].moments_key):
                h, sc = hyper[run.group], per_group[run.group]
                _moments_and_step(
                    h, sc, *(cut(t, run) for t in (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq))
                )

        def _fused_step(name, runs, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, count) -> None:
            if torch.is_complex(param) or not param.is_floating_point():
                raise ValueError(f"fs.optim.adamw(fused=True): {name!r} is {param.dtype}; the fused kernel takes real floating params")
            # torch's fused path: the step tensor (float32), incremented first, and the lr as
            # a tensor on the params' device.
            step = (count.detach() + 1).to(param.device, torch.float32)
            for run in merge(runs, lambda g: (hyper[g].decay_key, hyper[g].moments_key)):
                h = hyper[run.group]
                # torch.optim passes a float lr, which the CPU kernel reads as a double and the
                # GPU kernel as a float: the same value as a float64 / float32 tensor
                lr = per_group[run.group]["lr"].to(param.device, torch.float64 if param.device.type == "cpu" else torch.float32)
                if param.device.type == "meta":  # a planned step (fs.analysis.plan): the tensor-lr
                    lr = 0.0  # overload has no meta kernel; the float one does, with the same shapes
                pieces = [cut(t, run) for t in (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq)]
                torch._fused_adamw_(
                    [pieces[0]], [pieces[1]], [pieces[2]], [pieces[3]], [pieces[4]] if amsgrad else [], [step],
                    lr=lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay, eps=h.eps,
                    amsgrad=amsgrad, maximize=maximize,
                )  # fmt: skip

        states = {
            "exp_avg": state.exp_avg,
            "exp_avg_sq": state.exp_avg_sq,
            "max_exp_avg_sq": state.max_exp_avg_sq if amsgrad else None,
        }
        new_params, new = apply_per_tensor(step_tensor, grads, params, states, inplace=inplace)
        new_state = AdamWState(count=state.count.detach() + 1, **new)
        return new_params, new_state

    return make_optimizer(init, scalars, apply)


class _Hyper(NamedTuple):
    """One group's hyperparameters, checked, and what the update's steps depend on."""

    lr: Any  # the value given (float or schedule): compared to tell groups apart
    lr_at: Any  # count -> float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float

    @property
    def decay_key(self) -> tuple:
        return (None,) if self.weight_decay == 0 else (self.lr, self.weight_decay)

    @property
    def moments_key(self) -> tuple:
        return (self.lr, self.beta1, self.beta2, self.eps)

    def scalars(self, count: int, step: float) -> dict:
        step_lr = self.lr_at(count)
        bias_correction1 = 1 - self.beta1**step
        bias_correction2 = 1 - self.beta2**step
        step_size = step_lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        return {
            "lr": _exact.scalar(step_lr),
            "decay": _exact.scalar(1 - step_lr * self.weight_decay),
            "neg_step_size": _exact.scalar(-step_size),
            "bias_correction2_sqrt": _exact.scalar(bias_correction2_sqrt),
        }


def _hyperparameters(lr, weight_decay, betas, eps) -> _Hyper:
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
    return _Hyper(lr, lr_at, weight_decay, beta1, beta2, eps)


def _moments_and_step(h: _Hyper, sc: dict, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq) -> None:
    """torch's loop body after the weight decay, in place, for elements of one group."""
    if torch.is_complex(param):
        grad = torch.view_as_real(grad)
        exp_avg = torch.view_as_real(exp_avg)
        exp_avg_sq = torch.view_as_real(exp_avg_sq)
        if max_exp_avg_sq is not None:
            max_exp_avg_sq = torch.view_as_real(max_exp_avg_sq)
        param = torch.view_as_real(param)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction2_sqrt = _exact.operand(sc["bias_correction2_sqrt"], exp_avg_sq)
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    # param.addcdiv_(exp_avg, denom, value=-step_size)
    _exact.addcdiv_scaled_(param, exp_avg, denom, sc["neg_step_size"])
