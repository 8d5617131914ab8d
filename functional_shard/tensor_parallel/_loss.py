"""Loss parallelism: cross-entropy over logits whose vocabulary is split over a mesh axis."""

from __future__ import annotations

import torch

from .._mesh import BaseMesh
from ._collectives import axis_size, reduce_from

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    mesh: BaseMesh,
    axis: str = "tp",
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy` of logits split along the vocabulary over `axis`, without gathering them.

    Rank i of `axis` holds vocabulary entries `[i * V_local, (i + 1) * V_local)` (a head
    placed `Split(0, axis)`, a vocabulary-parallel embedding). In fp32, as Megatron-core's
    `vocab_parallel_cross_entropy`: the largest logit per token (an all-gather of one float per
    token and rank: it only keeps `exp` finite and gets no gradient), then one all-reduce of
    two floats per token: the sum of `exp(logit - max)` and the target's logit (from the rank
    that holds it). No rank ever holds more than its `[..., V_local]` logits; the gradient is
    each rank's slice of `softmax - one_hot`, computed locally.

    Arguments:
        local_logits: `[..., V_local]`, any float dtype, this rank's slice of the vocabulary;
            the same shape on every rank of `axis`.
        targets: `[...]` int64 class indices in `[0, V_local * mesh.shape[axis])`, the same on
            every rank of `axis`; `ignore_index` marks tokens left out.
        mesh: the mesh.
        axis: the axis the vocabulary is split over (default `"tp"`).
        ignore_index: targets with this value add nothing (default -100, as torch).
        reduction: `"mean"` over the tokens not ignored (NaN when all are, as torch), `"sum"`,
            or `"none"` (per token, 0 at ignored ones).

    Returns fp32, the same on every rank of `axis` (a scalar, or `[...]` for `"none"`).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy(reduction=...) is 'mean', 'sum' or 'none'; got {reduction!r}")
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits of shape {list(local_logits.shape)} need targets of shape "
            f"{list(local_logits.shape[:-1])}; got {list(targets.shape)}"
        )
    shifted, picked = shifted_logits(local_logits, targets, mesh, axis)
    sums = reduce_from(torch.stack([shifted.exp().sum(-1), picked]), mesh, axis)
    loss = sums[0].log() - sums[1]
    return reduce_loss(loss, targets, ignore_index, reduction)


def shifted_logits(local_logits: torch.Tensor, targets: torch.Tensor, mesh: BaseMesh, axis: str) -> tuple:
    """`(shifted, picked)`: this rank's fp32 logits minus the row maximum over every rank of
    `axis`, and the shifted logit of each target this rank's slice of the vocabulary holds (0
    for the others)."""
    size = axis_size(mesh, axis)
    local_vocab = local_logits.shape[-1]
    start = (mesh.coordinates[axis] if size > 1 else 0) * local_vocab
    logits = local_logits.float()
    # The max only keeps exp() in range: the loss does not depend on it, so no gradient flows.
    local_max = logits.detach().amax(-1)
    if size > 1:
        everyone = mesh.all_gather_axis_flat(local_max.contiguous().view(-1), axis)
        largest = everyone.view(size, -1).amax(0).view(local_max.shape)
    else:
        largest = local_max
    shifted = logits - largest.unsqueeze(-1)
    mine = (targets >= start) & (targets < start + local_vocab)
    index = torch.where(mine, targets - start, torch.zeros_like(targets))
    picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return shifted, torch.where(mine, picked, torch.zeros_like(picked))


def reduce_loss(loss: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """Per-token `loss` zeroed at ignored targets, then `reduction`: "none", "sum", or "mean"
    over the tokens kept."""
    kept = targets != ignore_index
    loss = torch.where(kept, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / kept.sum()
