"""The reference computation of one sharded training step: what eager runs and the jit traces.

For this rank's trainable shards `s`, frozen shards `f`, local leaves `b` and batch `x`:

    loss_r, grads = grad(lambda s: loss_fn(gather(s, f, b), x))(s)   # grads = sum_r grad_r, sharded
    grads = grads / world_size                                       # mean over ranks, as DDP/FSDP
    s, opt_state = optimizer.apply(grads, opt_state, s, scalars)
    loss = all_reduce(loss_r) / world_size

`update` is that function, written over flat lists so that `_jit` can trace it as it is. The
collectives it issues are labelled with the buffer they move and the phase of the step they
belong to (`_tracing`), which is how the jit's schedule finds its way around the graph.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from . import _tracing
from ._layout import Layout
from ._mesh import BaseMesh
from ._shard import gather_buffer

__all__ = ["StepFunction", "Gradients", "StepOutput", "gradients", "update", "mean_loss", "split_loss", "StepError"]


class StepError(ValueError):
    """A step was given a state, a batch or a loss it cannot use."""


class StepFunction(NamedTuple):
    """What a step computes, besides its inputs."""

    loss_fn: Callable[..., Any]  # loss_fn(params, batch) -> loss | (loss, aux)
    mesh: BaseMesh  # the mesh the parameters are sharded over
    optimizer: Any  # an fs.optim.Optimizer
    has_aux: bool  # loss_fn returns (loss, aux)
    donate: bool  # the optimizer may update the shards and its state in place


class Gradients(NamedTuple):
    """The gradient half of a step."""

    grads: dict[str, torch.Tensor]  # trainable buffer name -> this rank's shard of the mean gradient
    local: tuple[torch.Tensor, ...]  # the local leaves (module buffers) after the forward pass
    loss: torch.Tensor  # this rank's loss, 0-d, detached
    aux: Any  # what loss_fn returned besides the loss (None without has_aux)


class StepOutput(NamedTuple):
    """Everything one step produces, on this rank."""

    shards: list[torch.Tensor]  # new shards, one per buffer of the layout (frozen ones unchanged)
    local: tuple[torch.Tensor, ...]  # new local leaves
    opt_state: Any  # new optimizer state
    mean_loss: torch.Tensor  # mean over ranks of the local losses, 0-d float32
    loss: torch.Tensor  # this rank's loss
    aux: Any  # loss_fn's aux, or None


def gradients(fn: StepFunction, layout: Layout, shards, local, batch) -> Gradients:
    """This rank's shard of the mean gradient over ranks, and the forward pass's other results."""
    mesh = fn.mesh
    trainable_positions = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
    frozen_leaves: dict[int, torch.Tensor] = {}
    with _tracing.phase("forward"):
        for spec, s in zip(layout.buffers, shards):
            if not spec.trainable:
                frozen_leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=False)))
    # Fresh copies: the forward pass updates module buffers (BatchNorm statistics) in place.
    local = tuple(t.clone() for t in local)

    def local_loss(trainable_shards: tuple[torch.Tensor, ...], local: tuple[torch.Tensor, ...]):
        leaves = dict(frozen_leaves)
        with _tracing.phase("forward"):
            for k, s in zip(trainable_positions, trainable_shards):
                spec = layout.buffers[k]
                leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=True)))
            out = fn.loss_fn(layout.assemble(leaves, local), batch)
        loss, aux = split_loss(out, fn.has_aux, mesh)
        # torch.func.grad's aux must hold tensors only: no None when there is no aux.
        return loss, ((loss.detach(), aux) if fn.has_aux else (loss.detach(),))

    trainable_shards = tuple(shards[k] for k in trainable_positions)
    grads, (loss, *aux) = torch.func.grad(local_loss, has_aux=True)(trainable_shards, local)
    names = [layout.buffers[k].name for k in trainable_positions]
    mean = {name: g / mesh.world_size for name, g in zip(names, grads)}
    return Gradients(mean, local, loss, aux[0] if fn.has_aux else None)


def update(fn: StepFunction, layout: Layout, shards, local, opt_state, scalars, batch) -> StepOutput:
    """One whole step: gradients, the optimizer's update, the mean loss."""
    grads, local, loss, aux = gradients(fn, layout, shards, local, batch)
    trainable = {spec.name: s for spec, s in zip(layout.buffers, shards) if spec.trainable}
    with _tracing.phase("update"):
        new_trainable, opt_state = fn.optimizer.apply(grads, opt_state, trainable, scalars, inplace=fn.donate)
        mean = mean_loss(fn.mesh, loss)
    new_shards = [new_trainable.get(spec.name, s) for spec, s in zip(layout.buffers, shards)]
    return StepOutput(new_shards, local, opt_state, mean, loss, aux)


def mean_loss(mesh: BaseMesh, loss: torch.Tensor) -> torch.Tensor:
    """The mean over every rank of the mesh of a 0-d loss, as float32."""
    return (mesh.all_reduce_flat(loss.reshape(1).float()) / mesh.world_size).reshape(())


def split_loss(out: Any, has_aux: bool, mesh: BaseMesh) -> tuple[torch.Tensor, Any]:
    """`(loss, aux)` from what `loss_fn` returned, checked: a 0-d floating loss."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise StepError(f"with has_aux=True, loss_fn must return (loss, aux); it returned {type(out).__name__} on rank {mesh.rank}")
        loss, aux = out
    else:
        loss, aux = out, None
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        got = (
            f"a tensor of shape {list(loss.shape)} and dtype {str(loss.dtype).removeprefix('torch.')}"
            if isinstance(loss, torch.Tensor)
            else f"a {type(loss).__name__}"
        )
        hint = " (return (loss, aux) with has_aux=True to carry other values)" if not has_aux and isinstance(out, tuple) else ""
        raise StepError(
            f"loss_fn must return a scalar: a 0-d floating tensor, e.g. loss.mean(); on rank {mesh.rank} it "
            f"returned {got}{hint}"
        )
    return loss, aux
