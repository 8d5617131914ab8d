"""What a step does when its gradient is not finite: the policy (`NonFinite`) and the decision.

A NaN or an Inf anywhere in one rank's batch or gradient reaches every rank's gradient through
the reduce-scatter, and an update would write it into every parameter. The step already
all-reduces the global gradient norm (`metrics["grad_norm"]`), which is not finite exactly when
some gradient element is not (or the norm overflows its dtype), and the mean loss over every
rank (`metrics["loss"]`: a non-finite loss whose gradient is finite, a term no parameter
reaches, is refused too): every rank reads the same verdict, `isfinite(grad_norm) and
isfinite(loss)`, at no extra collective and no extra pass over the gradient.
fp16 loss scaling (`fs.LossScale`) skips on the same verdict — one mechanism for every dtype.

The decision is taken on the host after the step ran, from the norm the step returns anyway
(one 0-d read; eager and traced alike, so the traced step keeps the eager bits, and its graph
is unchanged): to skip, the step returns the state it was given (parameters, module buffers and
optimizer state), with the next loss scale and `step + 1`. Nothing is selected on the device,
so a clean step costs nothing more.
"""

from __future__ import annotations

import enum
import math
import warnings
from typing import Any

from ._reference import StepError, StepOutput

__all__ = ["NonFinite", "NonFiniteError", "resolve", "skip_update"]


class NonFinite(str, enum.Enum):
    """What `fs.sharded_step` does with a step whose gradient is not finite (a NaN or an Inf in
    any rank's batch, loss or gradient, seen as `metrics["grad_norm"]` not finite).

    Pass a member or its value: `sharded_step(..., nonfinite="skip")`.

    - `SKIP` ("skip", the default): the update is skipped on every rank — parameters, module
      buffers (BatchNorm statistics) and optimizer state stay as they were, as with fp16
      under `torch.amp.GradScaler` or DeepSpeed — and reported: `metrics["skipped"]` is True,
      rank 0 warns (`RuntimeWarning`) and so does every rank whose own loss was not finite
      (naming itself). `state.step` counts the step (it counts calls, and seeds the step's
      random numbers); the optimizer's own count does not (no update was applied, so a
      learning rate schedule does not advance). Needs the old state: not with `donate=True`.
    - `RAISE` ("raise"; the default with `donate=True`): `fs.NonFiniteError` on every rank;
      the state passed in is untouched (with `donate=True` it was updated in place and is
      used up: restore a checkpoint).
    - `APPLY` ("apply"): apply the update anyway (NaN parameters from then on), silently.

    With fp16 loss scaling (`fs.LossScale`) a non-finite gradient is how the scale finds its
    level: it is always skipped (the scale backs off), and `LossScale.max_consecutive_skips`
    skipped steps in a row raise `fs.NonFiniteError`.
    """

    SKIP = "skip"
    RAISE = "raise"
    APPLY = "apply"


class NonFiniteError(StepError):
    """A step's gradient was not finite and the step stops: `nonfinite="raise"`, or fp16 loss
    scaling skipped `LossScale.max_consecutive_skips` steps in a row. Raised on every rank
    (the verdict is global); the state passed to the step is untouched unless it was donated."""


def resolve(policy: Any, *, donate: bool, loss_scale: Any) -> NonFinite:
    """The policy a step runs with: `policy` checked, None resolved (skip; raise with donate).
    Loss scaling (`loss_scale`) with `donate` is refused: a skipped step needs the old parameters."""
    if loss_scale is not None and donate:
        raise StepError(
            "loss scaling skips the update of a step whose gradient is not finite, which needs the old "
            "parameters: it cannot be combined with donate=True"
        )
    if policy is None:
        policy = NonFinite.RAISE if donate else NonFinite.SKIP
    try:
        policy = NonFinite(policy)
    except ValueError:
        raise ValueError(f"nonfinite must be 'skip', 'raise' or 'apply' (an fs.NonFinite); got {policy!r}") from None
    if loss_scale is not None and policy is not NonFinite.SKIP:
        raise StepError(
            f"loss scaling skips the update of a step whose gradient is not finite (that is how the scale "
            f"finds its level), so nonfinite must be 'skip' with fs.LossScale; got {policy.value!r}. "
            f"LossScale(max_consecutive_skips=...) raises when steps keep being skipped"
        )
    if policy is NonFinite.SKIP and donate:
        raise StepError(
            "nonfinite='skip' returns the old state when a gradient is not finite, but donate=True updates it in "
            "place: pass nonfinite='raise' (the default with donate=True) or donate=False"
        )
    return policy


def skip_update(policy: NonFinite, out: StepOutput, *, step: int, rank: int, loss_scale: Any, donated: bool) -> bool:
    """Whether the step that produced `out` (on this rank, numbered `step`) must be skipped;
    warns (skip) or raises `NonFiniteError` (raise, or too many skipped steps in a row under
    loss scaling). `loss_scale` is the step's `fs.LossScale` or None. Reads `out.grad_norm`
    on the host, unless `policy` is apply. Every rank decides the same: the norm is global."""
    if policy is NonFinite.APPLY:
        return False
    norm, mean = float(out.grad_norm), float(out.mean_loss)
    if math.isfinite(norm) and math.isfinite(mean):
        return False
    # the loss itself (its mean over every rank: all-reduced, the same verdict on each), for a
    # non-finite loss whose gradient is finite (a term no parameter reaches)
    what = f"grad_norm {norm}" if not math.isfinite(norm) else f"its gradient is finite, but the loss is {mean}"
    own = float(out.loss)
    mine = "" if math.isfinite(own) else f"; rank {rank}'s own loss is {own}: its batch or loss_fn produced it"
    if loss_scale is not None:
        skips = loss_scale.consecutive_skips(out.loss_scale)
        if loss_scale.max_consecutive_skips is not None and skips >= loss_scale.max_consecutive_skips:
            raise NonFiniteError(
                f"fp16 loss scaling skipped {skips} steps in a row (steps {step - skips + 1} to {step}; "
                f"LossScale(max_consecutive_skips={loss_scale.max_consecutive_skips})): the gradient was not finite "
                f"({what}) at every scale down to {float(out.loss_scale.scale)} "
                f"(min_scale={loss_scale.min_scale}){mine}. No scale fixes that: look for a NaN or an Inf in the "
                f"batches or the model (metrics['local_loss'] per rank), lower the learning rate, or train in "
                f"bfloat16. The state passed to the step is unchanged"
            )
        if mine:  # the loss comes before the scale: no scale fixes it
            warnings.warn(f"step {step}: the update was skipped{mine}", RuntimeWarning, stacklevel=3)
        return True  # the scale backs off: an expected part of loss scaling, reported in the metrics
    if policy is NonFinite.RAISE:
        kept = (
            "the state passed in was donated (donate=True) and now holds the non-finite update: restore it from "
            "a checkpoint"
            if donated
            else "the state passed in is unchanged"
        )
        raise NonFiniteError(
            f"step {step} is not finite ({what}){mine}. Stopped, as nonfinite='raise' "
            f"asks: {kept}. Look for a NaN or an Inf in the batches (metrics['local_loss'] per rank) or the "
            f"model, or lower the learning rate; nonfinite='skip' skips such steps instead"
        )
    if rank == 0:
        warnings.warn(
            f"step {step} is not finite ({what}): fs skipped the update of step {step} on "
            f"every rank (parameters, module buffers and optimizer state unchanged; metrics['skipped'] is True). "
            f"A NaN or an Inf in a batch or in the model; ranks whose own loss was not finite say so. Pass "
            f"nonfinite='raise' to stop instead",
            RuntimeWarning,
            stacklevel=3,
        )
    if mine:
        warnings.warn(
            f"step {step}: rank {rank}'s own loss is {own}: its batch or loss_fn produced it; the update of step "
            f"{step} was skipped on every rank",
            RuntimeWarning,
            stacklevel=3,
        )
    return True
