"""What `loss_fn` may return to a step, and how the step checks it: a 0-d floating loss, an
`fs.WeightedLoss`, or either with an aux value (`has_aux=True`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ._basemesh import BaseMesh

__all__ = ["StepError", "WeightedLoss", "split_loss", "check_loss", "weighted_term"]


class StepError(ValueError):
    """A step was given a state, a batch or a loss it cannot use."""


class WeightedLoss(NamedTuple):
    """What `loss_fn` returns when ranks' losses weigh differently (e.g. by token count).

    The step then trains on `sum_r weight_r * loss_r / sum_r weight_r` over ranks (and
    micro-batches) — single-process training on the concatenated batch when `loss` is the
    mean over `weight` items (non-ignored tokens, say) — instead of the plain mean of the
    ranks' losses.

    `summed=True`: `loss` is the sum over the items (`reduction="sum"`), and the step trains on
    `sum_r loss_r / sum_r weight_r` (Hugging Face's `num_items_in_batch` convention). The same
    training, one rounding fewer: the sum is differentiated as it is, so with one micro-batch
    each rank's backward starts from exactly `1 / sum_r weight_r`, as single-process training
    on `sum / total` and DDP on `sum * world / total` do, and each rank's gradient is theirs
    bit for bit (the mean form divides by `weight` in the forward and multiplies it back in the
    objective: `(w * (1 / W)) / w` is not always `1 / W` in floating point). Metrics report
    the mean, `loss / weight` (0 where the weight is 0).

    A weight of 0 (a micro-batch or rank with no items) weighs nothing in the reported mean, even
    where `loss` is NaN (the mean form of cross-entropy over all-ignored labels is 0/0). Its
    gradient must be finite too: `F.cross_entropy`'s is (0), but a hand-written mean such as
    `(per * mask).sum() / mask.sum()` divides by 0 in its backward as well, so its gradient is
    NaN and the step is skipped (never applied); write it with `summed=True` (the sum over the
    items and their count), which trains on such a batch as single-process training does.
    """

    loss: torch.Tensor  # 0-d floating: this rank's loss, a mean over `weight` items (or their sum)
    weight: torch.Tensor | float  # 0-d (or a number): how much it weighs; not differentiated
    summed: bool = False  # True: `loss` is the sum over the `weight` items, not their mean


def weighted_term(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`weight * loss` in float32 (a term of the weighted mean's numerator), 0 where the weight is
    0: a mean over no items (cross-entropy of a micro-batch whose labels are all ignored) is NaN,
    and it weighs nothing; `0 * nan` made the reported loss NaN."""
    term = loss.float() * weight
    return torch.where(torch.as_tensor(weight, device=term.device) == 0, torch.zeros_like(term), term)


def split_loss(out: Any, has_aux: bool, mesh: BaseMesh) -> tuple[Any, Any]:
    """`(loss, aux)` from what `loss_fn` returned (the loss a tensor or a `WeightedLoss`)."""
    if has_aux:
        if isinstance(out, WeightedLoss) or not (isinstance(out, tuple) and len(out) == 2):
            raise StepError(
                f"with has_aux=True, loss_fn must return (loss, aux); it returned {type(out).__name__} on rank {mesh.rank}"
            )
        return out
    return out, None


def check_loss(loss: Any, has_aux: bool, mesh: BaseMesh, out: Any) -> None:
    """Raise `StepError` unless `loss` is a 0-d floating tensor."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        got = (
            f"a tensor of shape {list(loss.shape)} and dtype {str(loss.dtype).removeprefix('torch.')}"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        hint = (
            " (return (loss, aux) with has_aux=True to carry other values, or fs.WeightedLoss(loss, weight))"
            if not has_aux and isinstance(out, tuple)
            else ""
        )
        raise StepError(
            f"loss_fn must return a scalar: a 0-d floating tensor, e.g. loss.mean(); on rank {mesh.rank} it "
            f"returned {got}{hint}"
        )
