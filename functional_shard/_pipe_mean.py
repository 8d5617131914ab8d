"""What a pipelined step's ranks make of the last stage's losses and the stages' summed gradients:
the mean loss over micro-batches, pipeline stages and data-parallel ranks (plain, weighted, or a
layout-invariant step's canonical tree), each rank's own loss, and the mean gradient shards (with
fp16 loss scaling, divided by the scale after the mean, as the plain step does)."""

from __future__ import annotations

import torch

from . import _canonical
from ._losses import weighted_term
from ._reference import unscaled
from ._stages import Cut

__all__ = ["mean_of"]


def _sums(cut: Cut, losses: list, mesh) -> torch.Tensor:
    """[sum of losses, sum of weight * loss, sum of weights] over micro-batches, pipeline
    stages (only the last has any) and data-parallel ranks: one all-reduce."""
    local = torch.zeros(3, dtype=torch.float32, device=getattr(mesh, "device", torch.device("cpu")))
    if losses:
        total = losses[0][1].reshape(1).float()
        for values in losses[1:]:
            total = total + values[1].float()
        local[0] = total[0]
        if cut.weighted:
            local[1] = sum((weighted_term(v[1], v[2]) for v in losses[1:]), weighted_term(losses[0][1], losses[0][2]))
            local[2] = sum((v[2] for v in losses[1:]), losses[0][2])
    axes = (*mesh.data_axes, "pp")
    return mesh.all_reduce_flat(local, axes)


def _canonical_sums(cut: Cut, losses: list, mesh, canonical) -> torch.Tensor:
    """A layout-invariant step's [mean loss, sum of weights] (weighted: [sum of weight x loss,
    sum of weights]): the last stage's chunk values met over the data axes and added in the
    canonical tree, as the plain step adds them; every pipeline rank gets them (one all-reduce
    over `pp` where the other stages add zeros: exact)."""
    device = getattr(mesh, "device", torch.device("cpu"))
    out = torch.zeros(2, dtype=torch.float32, device=device)
    if losses:
        if cut.weighted:
            pairs = torch.stack([torch.stack([weighted_term(v[1], v[2]), v[2]]) for v in losses])
            out = _canonical.tree_sum(_canonical.chunk_values(pairs, mesh))
        else:
            every = _canonical.chunk_values(torch.stack([v[1].float() for v in losses]), mesh)
            out = torch.stack([(_canonical.tree_sum(every) / canonical.chunks).reshape(()), out[1]])
    return mesh.all_reduce_flat(out.contiguous(), ("pp",))


def mean_of(cut: Cut, result, mesh, microbatches: int, canonical, loss_scale=None):
    """(mean loss over everything, this rank's loss, mean gradient shards by buffer name);
    with fp16 loss scaling (`loss_scale`: the state's) the gradients divided by the scale the
    backward was seeded with, after the mean, as the plain step does."""
    scale = loss_scale.scale if loss_scale is not None else None
    unscale = (lambda g: unscaled(g, scale)) if scale is not None else (lambda g: g)  # noqa: E731
    if canonical is not None:
        sums = _canonical_sums(cut, result.losses, mesh, canonical)
        if cut.weighted:
            mean_loss, grads = (sums[0] / sums[1]).reshape(()), _divided(result.grads, lambda g: unscale(g / sums[1].to(g.dtype)))
        else:
            count = canonical.chunks
            mean_loss, grads = sums[0].reshape(()), _divided(result.grads, lambda g: unscale(g / count if count != 1 else g))
        return mean_loss, _own_loss(result.losses, mean_loss), grads
    sums = _sums(cut, result.losses, mesh)
    if cut.weighted:
        mean_loss = (sums[1] / sums[2]).reshape(())
        grads = _divided(result.grads, lambda g: unscale(g / sums[2].to(g.dtype)))
    else:
        count = mesh.data_size * microbatches
        mean_loss = (sums[0] / count).reshape(())
        grads = _divided(result.grads, lambda g: unscale(g / count if count != 1 else g))
    return mean_loss, _own_loss(result.losses, mean_loss), grads


def _own_loss(losses: list, mean_loss: torch.Tensor) -> torch.Tensor:
    """This rank's loss: the mean of its micro-batches' (the last stage's ranks), else the mean."""
    return (sum(v[1].float() for v in losses) / len(losses)).reshape(()) if losses else mean_loss


def _divided(sums: dict, divide) -> dict:
    """`{name: divide(sum)}`, emptying `sums` as it goes: each summed gradient is let go as soon as
    its mean exists, so the update holds one gradient per buffer, not the sums beside the means."""
    return {name: divide(sums.pop(name)) for name in list(sums)}
