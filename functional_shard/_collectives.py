"""The differentiable collectives, as adjoint pairs of `torch.autograd.Function`s.

All three work on flat, contiguous 1-D buffers and take the mesh as a non-tensor argument.
They use `setup_context` (not `ctx` in `forward`), which is what lets `torch.func.grad`,
`torch.func.vjp` and `make_fx` go through them; a backward calls the dual *Function* (not a
raw op) so that higher-order and traced gradients keep working.

- `GatherFlat`:        forward all-gather over the shard axis;
                       backward reduce-scatter (sum) over the shard axis, then all-reduce (sum)
                       over the replicate axes (the gradient of a replicated parameter).
- `ReduceScatterFlat`: forward reduce-scatter (sum) over the shard axis, then all-reduce over the
                       replicate axes; backward all-gather over the shard axis.
- `AllReduceFlat`:     forward all-reduce (sum) over the given axes; backward the same
                       all-reduce (sum over ranks is self-adjoint).
"""

from __future__ import annotations

import torch

from ._mesh import BaseMesh
from ._offload import to_device, to_host
from ._tracing import carried, moving

__all__ = ["GatherFlat", "ReduceScatterFlat", "AllReduceFlat", "gather_bytes"]


# Dtypes gloo has no kernels for: data movement moves their bytes instead.
_MOVE_AS_BYTES = {torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex32, torch.complex64, torch.complex128}


@carried
class GatherFlat(torch.autograd.Function):
    """All-gather in forward; reduce-scatter (+ replicate all-reduce) in backward.

    Arguments:
        shard: this rank's slice, `[shard_numel]`, contiguous.
        mesh: the mesh; gathers over its shard axis.
        buffer: the `BufferSpec` it moves (a label for the jit's schedule), or None.
        gather_dtype: cast the shard to this dtype before gathering it (mixed precision: the
            all-gather moves the cast bytes); None: no cast.
        reduce_dtype: cast the incoming gradient to this dtype before reduce-scattering it;
            the reduced shard is cast back to `shard`'s dtype. None: the gradient's dtype.
        device: CPU offload: `shard` is in host memory; it is copied to `device` (in
            `gather_dtype`: one `offload_copy` node in place of the cast) before the gather,
            and the reduced gradient shard is copied back to the host (in `shard`'s dtype).

    Returns `[num_shards * shard_numel]`: every rank's slice, in shard order, on every rank.
    """

    @staticmethod
    def forward(shard: torch.Tensor, mesh: BaseMesh, buffer=None, gather_dtype=None, reduce_dtype=None, device=None) -> torch.Tensor:
        if device is not None:
            shard = to_device(shard, device, gather_dtype)
        elif gather_dtype is not None and gather_dtype != shard.dtype:
            shard = shard.to(gather_dtype)
        with moving(buffer):
            return mesh.all_gather_flat(shard)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh = inputs[1]
        ctx.buffer = inputs[2] if len(inputs) > 2 else None
        ctx.reduce_dtype = inputs[4] if len(inputs) > 4 else None
        ctx.offloaded = len(inputs) > 5 and inputs[5] is not None
        ctx.shard_dtype = inputs[0].dtype

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        if ctx.reduce_dtype is not None and ctx.reduce_dtype != grad_full.dtype:
            grad_full = grad_full.to(ctx.reduce_dtype)
        grad = ReduceScatterFlat.apply(grad_full.contiguous(), ctx.mesh, ctx.buffer)
        if ctx.offloaded:  # back to the host as soon as it is reduced, in the shard's dtype
            grad = to_host(grad, ctx.shard_dtype)
        elif grad.dtype != ctx.shard_dtype:
            grad = grad.to(ctx.shard_dtype)
        return grad, None, None, None, None, None


@carried
class ReduceScatterFlat(torch.autograd.Function):
    """Reduce-scatter (sum over every rank, this rank keeps its shard-axis slice) in forward;
    all-gather over the shard axis in backward.

    Arguments:
        full: `[num_shards * n]` on every rank, contiguous.
        mesh: the mesh.

    Returns `[n]`: slice `shard_index` of the sum of `full` over all ranks of the mesh.
    """

    @staticmethod
    def forward(full: torch.Tensor, mesh: BaseMesh, buffer=None) -> torch.Tensor:
        with moving(buffer):
            out = mesh.reduce_scatter_flat(full)
            if mesh.replicate_axes:
                out = mesh.all_reduce_flat(out, mesh.replicate_axes)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh = inputs[1]
        ctx.buffer = inputs[2] if len(inputs) > 2 else None

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        return GatherFlat.apply(grad_shard.contiguous(), ctx.mesh, ctx.buffer), None, None


@carried
class AllReduceFlat(torch.autograd.Function):
    """Sum over the ranks along `axes` (all axes when None) in forward; the same sum in backward.

    Arguments:
        x: any contiguous tensor, same shape on every rank.
        mesh: the mesh.
        axes: names of the axes to sum over, or None for every axis.
    """

    @staticmethod
    def forward(x: torch.Tensor, mesh: BaseMesh, axes: tuple[str, ...] | None) -> torch.Tensor:
        return mesh.all_reduce_flat(x, axes)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh, ctx.axes = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllReduceFlat.apply(grad.contiguous(), ctx.mesh, ctx.axes), None, None


def gather_bytes(shard: torch.Tensor, mesh: BaseMesh, buffer=None) -> torch.Tensor:
    """Non-differentiable all-gather of any dtype: dtypes the backend cannot reduce are moved
    as raw bytes (an all-gather only moves data, so their bits arrive unchanged)."""
    if shard.requires_grad:  # (a detach of a tensor that needs none would sit between a cast and its gather)
        shard = shard.detach()
    with moving(buffer):
        if shard.dtype in _MOVE_AS_BYTES:
            return mesh.all_gather_flat(shard.view(torch.uint8)).view(shard.dtype)
        return mesh.all_gather_flat(shard)
