"""The reference computation of one sharded training step: what eager runs and the jit traces.

For this rank's trainable shards `s`, frozen shards `f`, local leaves `b` and batch `x`:

    loss_r, grads = grad(lambda s: loss_fn(gather(s, f, b), x))(s)   # grads = sum_r grad_r, sharded
    grads = grads / world_size                                       # mean over ranks, as DDP/FSDP
    s, opt_state = optimizer.apply(grads, opt_state, s, scalars)
    loss = all_reduce(loss_r) / world_size

`world_size` is the number of data-parallel ranks (`mesh.data_size`) and the sums run over the
data axes (`mesh.data_axes`): ranks of a tensor-parallel axis compute one loss together, on
their pieces of the parameters (`fs.tensor_parallel`), and hold their own pieces' gradients.

With a `WeightedLoss` (and one micro-batch), the weights are summed over ranks between the
forward and the backward, and the backward starts from `1 / sum_r w_r` instead of the gradient
being divided after it (`_weighted_seed`). `grad` runs `loss_fn` under torch.func's transform
and then the backward that `loss.backward()` runs (`_grad`).

`update` is that function, written over flat lists so that `_jit` can trace it as it is. The
collectives it issues are labelled with the buffer they move and the phase of the step they
belong to (`_tracing`), which is how the jit's schedule finds its way around the graph.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch._functorch.eager_transforms import _vjp_with_argnums

from . import _canonical, _random, _tracing
from ._collectives import ReduceScatterFlat
from ._layout import Layout
from ._mesh import BaseMesh
from ._offload import map_buffer_pairs, map_buffers, offloaded, streamed, to_device, to_host, to_host_into
from ._microbatches import cast_inputs, split_microbatches
from ._shard import gather_buffer, gather_full, gather_kept
from ._losses import StepError, WeightedLoss, check_loss, split_loss, weighted_term
from .optim import LeafLayout, global_norm

__all__ = [
    "StepError",
    "WeightedLoss",
    "StepFunction",
    "Gradients",
    "StepOutput",
    "EvalOutput",
    "gradients",
    "update",
    "evaluate",
    "split_loss",
    "check_loss",
]


class StepFunction(NamedTuple):
    """What a step computes, besides its inputs."""

    loss_fn: Callable[..., Any]  # loss_fn(params, batch) -> loss | WeightedLoss | (either, aux)
    mesh: BaseMesh  # the mesh the parameters are sharded over
    optimizer: Any  # an fs.optim.Optimizer
    has_aux: bool  # loss_fn returns (loss, aux)
    donate: bool  # the optimizer may update the shards and its state in place
    microbatches: int = 1  # the batch is split along its leading dimension into this many
    accumulate: str = "sharded"  # "sharded": reduce-scatter per micro-batch; "full": once per step
    loss_scale: Any = None  # an fs.LossScale (fp16), or None
    input_dtype: torch.dtype | None = None  # floating batch tensors are cast to it (mixed precision)
    canonical: Any = None  # a `_canonical.Canonical`: the layout-invariant step (chunks as micro-batches)
    keep: bool = False  # ZeRO-1: every buffer's full parameters are kept whole between steps (`kept`)
    offload: Any = None  # an `fs.schedule.Offload`: its units' shards and optimizer state live on the host


class Gradients(NamedTuple):
    """The gradient half of a step."""

    grads: dict[str, torch.Tensor]  # trainable buffer name -> this rank's shard of the mean gradient
    local: tuple[torch.Tensor, ...]  # the local leaves (module buffers) after the forward pass
    loss: torch.Tensor  # this rank's loss (weighted mean over its micro-batches), 0-d, detached
    mean_loss: torch.Tensor  # the loss over every rank (weighted mean), 0-d float32
    aux: Any  # what loss_fn returned besides the loss (None without has_aux; per micro-batch: a list)
    microbatch_losses: tuple  # each micro-batch's loss, where its forward ends (one with a single batch)


class StepOutput(NamedTuple):
    """Everything one step produces, on this rank."""

    shards: list[torch.Tensor]  # new shards, one per buffer of the layout (frozen ones unchanged)
    local: tuple[torch.Tensor, ...]  # new local leaves
    opt_state: Any  # new optimizer state
    loss_scale: Any  # new LossScaleState, or None
    mean_loss: torch.Tensor  # mean over ranks of the local losses, 0-d float32
    loss: torch.Tensor  # this rank's loss
    grad_norm: torch.Tensor  # 2-norm of the whole mean gradient (before any clipping); not finite: the step may skip
    aux: Any  # loss_fn's aux, or None
    microbatch_losses: tuple = ()  # each micro-batch's loss: where each forward ends
    kept: Any = None  # ZeRO-1 (`StepFunction.keep`): every buffer's full parameters for the next step


class EvalOutput(NamedTuple):
    """What a forward-only evaluation produces, on this rank."""

    local: tuple[torch.Tensor, ...]  # local leaves after the forward pass (discarded by evaluate)
    mean_loss: torch.Tensor  # the loss over every rank (weighted mean), 0-d float32
    loss: torch.Tensor  # this rank's loss
    aux: Any  # loss_fn's aux, or None


def _gather_frozen(layout: Layout, shards, mesh, fn: StepFunction | None = None) -> dict[int, torch.Tensor]:
    leaves: dict[int, torch.Tensor] = {}
    for spec, s in zip(layout.buffers, shards):
        if not spec.trainable:
            leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=False, device=offloaded(fn, spec))))
    return leaves


def _objective(fn: StepFunction, out: Any, scale) -> tuple[torch.Tensor, tuple]:
    """(what is differentiated, (loss, weight or None, [aux]) detached) from one call of loss_fn."""
    loss, aux = split_loss(out, fn.has_aux, fn.mesh)
    weight = None
    summed = False
    if isinstance(loss, WeightedLoss):
        loss, weight, summed = loss
        weight = torch.as_tensor(weight, dtype=torch.float32).detach()
    check_loss(loss, fn.has_aux, fn.mesh, out)
    if weight is None:
        objective = loss
    elif summed:
        # Differentiated as it is; reported as the mean over its items.
        objective = loss
        w = weight.to(loss.dtype)
        loss = torch.where(w > 0, loss / w, torch.zeros_like(loss))
    else:
        objective = loss * weight.to(loss.dtype)
    if scale is not None:
        objective = objective * scale.to(objective.dtype)
    # torch.func's aux must hold tensors only: a weightless loss carries an empty tuple.
    extras = (loss.detach(), () if weight is None else weight)
    return objective, ((*extras, aux) if fn.has_aux else extras)


def unscaled(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A loss-scaled gradient divided by its scale, in float32 at least and cast back: an fp16
    gradient divided by a scale cast to fp16 (65536 and above: inf) came out zero, the step
    applied it as finite. A float32 gradient: `g / scale`, as before."""
    wide = torch.promote_types(g.dtype, torch.float32)
    return (g.to(wide) / scale.to(wide)).to(g.dtype)


def gradients(fn: StepFunction, layout: Layout, shards, local, batch, loss_scale=None, kept=None) -> Gradients:
    """This rank's shard of the mean gradient over ranks (and micro-batches), and the forward's results.

    `kept` (ZeRO-1): every buffer's full parameters, kept from the last step: the forward reads
    them instead of gathering, and each micro-batch's gradient is taken with respect to them
    (`_full_gradients`), then reduce-scattered — per micro-batch and summed into shards
    (`accumulate="sharded"`, the ops GatherFlat's backward runs) or summed and reduce-scattered
    once (`"full"`): the bits of the step that gathers."""
    mesh = fn.mesh
    trainable = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
    names = [layout.buffers[k].name for k in trainable]
    scale = loss_scale.scale if loss_scale is not None else None
    if kept is not None:
        frozen_leaves = {
            i: leaf for spec, full in zip(layout.buffers, kept) if not spec.trainable
            for i, leaf in zip(spec.leaves, layout.unflatten_buffer(spec, full))
        }  # fmt: skip
    else:
        with _tracing.phase("forward"):
            frozen_leaves = _gather_frozen(layout, shards, mesh, fn)
    # Fresh copies: the forward pass updates module buffers (BatchNorm statistics) in place.
    local = tuple(t.clone() for t in local)
    total: list[torch.Tensor] | None = None
    losses, weights, auxes = [], [], []
    # One micro-batch with a WeightedLoss: the weights are summed over ranks between the forward
    # and the backward, whose seed is then 1 / (sum of weights) (`_weighted_seed`).
    seeded: list[torch.Tensor] = []
    canon = fn.canonical  # chunks: full gradients summed in the canonical tree (`_canonical`)
    seed = (lambda extras: _weighted_seed(extras, mesh, seeded)) if fn.microbatches == 1 and canon is None else None
    tree = _canonical.TreeSum(fn.microbatches) if canon is not None else None
    for index, micro in enumerate(split_microbatches(batch, fn.microbatches, fn.input_dtype, fn.canonical)):
        with _tracing.microbatch(index if fn.microbatches > 1 else None):
            if canon is not None:
                _random.reseed(canon.first + index, getattr(mesh, "device", torch.device("cpu")))
            if kept is not None:
                fulls = [kept[k] for k in trainable]
                grads, local, extras = _full_gradients(fn, layout, shards, trainable, frozen_leaves, local, micro, scale, seed, fulls)
                if fn.accumulate != "full":
                    grads = _reduce_full(layout, trainable, shards, grads, mesh)
            elif fn.accumulate == "full":
                grads, local, extras = _full_gradients(fn, layout, shards, trainable, frozen_leaves, local, micro, scale, seed)
            else:
                grads, extras = _sharded_gradients(fn, layout, shards, trainable, frozen_leaves, local, micro, scale, seed)
        if tree is not None:
            tree.add(grads)
        else:
            total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
        losses.append(extras[0])
        weights.append(extras[1] if isinstance(extras[1], torch.Tensor) else None)
        if fn.has_aux:
            auxes.append(extras[2])
    if tree is not None:
        total = _reduce_full(layout, trainable, shards, tree.result(), mesh, canonical=True)
    elif fn.accumulate == "full":
        total = _reduce_full(layout, trainable, shards, total, mesh)  # kept or gathered: summed full gradients
        if fn.offload is not None:  # reduced once: to the host, as the per-micro-batch ones go
            total = [to_host(g) if offloaded(fn, layout.buffers[k]) else g for k, g in zip(trainable, total)]
    assert total is not None
    if len({w is None for w in weights}) > 1:
        raise StepError("loss_fn returned a WeightedLoss for some micro-batches and a plain loss for others")
    with _tracing.phase("update"):
        if weights[0] is None:
            # The plain mean over ranks and micro-batches: divided by a count.
            count = mesh.data_size * fn.microbatches
            loss_total = losses[0].reshape(1).float()
            for l in losses[1:]:
                loss_total = loss_total + l.float()
            loss = losses[0] if len(losses) == 1 else (loss_total / len(losses)).reshape(()).to(losses[0].dtype)
            if canon is not None:  # each chunk's loss, added in the canonical tree
                every = _canonical.chunk_values(torch.stack([l.float() for l in losses]), mesh)
                mean_loss = (_canonical.tree_sum(every) / count).reshape(())
            else:
                mean_loss = (mesh.all_reduce_flat(loss_total, mesh.data_axes) / count).reshape(())
            # x / 1 is x, bit for bit: one rank and one micro-batch skip a pass over the gradients.
            mean = {name: g / count if count != 1 else g for name, g in zip(names, total)}
        else:
            loss_sum = sum((weighted_term(l, w) for l, w in zip(losses[1:], weights[1:])), weighted_term(losses[0], weights[0]))
            weight_sum = sum(weights[1:], weights[0])
            if seeded:  # the backward was seeded with 1 / sums[1]: the gradient is the mean already
                sums = seeded[0]
                mean = dict(zip(names, total))
            elif canon is not None:  # [w * loss, w] of each chunk, added in the canonical tree
                pairs = torch.stack([torch.stack([weighted_term(l, w), w]) for l, w in zip(losses, weights)])
                sums = _canonical.tree_sum(_canonical.chunk_values(pairs, mesh))
                mean = {name: g / sums[1].to(g.dtype) for name, g in zip(names, total)}
            else:
                # One collective for both: [sum over ranks and micro-batches of w * loss, of w].
                sums = mesh.all_reduce_flat(torch.stack([loss_sum, weight_sum]), mesh.data_axes)
                mean = {name: g / sums[1].to(g.dtype) for name, g in zip(names, total)}
            mean_loss = (sums[0] / sums[1]).reshape(())
            loss = (loss_sum / weight_sum).to(losses[0].dtype)
        if scale is not None:
            mean = {name: unscaled(g, scale) for name, g in mean.items()}
    aux = (auxes[0] if fn.microbatches == 1 else auxes) if fn.has_aux else None
    return Gradients(mean, local, loss, mean_loss, aux, tuple(losses))


def _weighted_seed(extras: tuple, mesh: BaseMesh, seeded: list) -> torch.Tensor | None:
    """The seed of a WeightedLoss's backward, between its forward and its backward: with
    `W = sum_r weight_r` (one all-reduce of `[weight * loss, weight]`, appended to `seeded`;
    the step's mean loss reads it), `1 / W` in the loss's dtype. None for a plain loss (the
    backward starts from 1).

    So a rank's gradient is that of `weight * loss / W` as `loss.backward()` computes it
    (the cotangent of `loss` is `weight * (1 / W)`, of a token sum `loss = s / n` with
    `weight = n` that times `1 / n`): the single-process token mean `S / W` seeds its
    backward with `1 / W` too, and so does DDP with `s * world / W`. Scaling the summed
    gradient by `1 / W` after the backward instead gives other (valid) roundings, which
    AdamW magnifies where a gradient is ~0: 3-4x further from single-process training
    than DDP on Llama after 5 steps.

    Only for a float32 or float64 loss: `1 / W` in float16 is subnormal from W = 16385 on
    (bfloat16 keeps 8 bits of it); a 16-bit loss keeps the division after the backward."""
    loss, weight = extras[0], extras[1]
    if not isinstance(weight, torch.Tensor) or loss.dtype not in (torch.float32, torch.float64):
        return None
    with _tracing.phase("forward"):
        sums = mesh.all_reduce_flat(torch.stack([weighted_term(loss, weight), weight]), mesh.data_axes)
    seeded.append(sums)
    return (1 / sums[1]).to(loss.dtype)


def _sharded_gradients(fn: StepFunction, layout: Layout, shards, trainable, frozen_leaves, local, micro, scale, seed=None):
    """One micro-batch's gradient with respect to this rank's trainable shards: `grad` of
    `loss ∘ gather`, whose backward reduce-scatters (the "sharded" strategy, and k = 1)."""
    mesh = fn.mesh

    def local_loss(trainable_shards, local):
        leaves = dict(frozen_leaves)
        with _tracing.phase("forward"):
            for k, s in zip(trainable, trainable_shards):
                spec = layout.buffers[k]
                leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=True, alias=True, device=offloaded(fn, spec))))
            with _tracing.graph_semantics():
                out = fn.loss_fn(layout.assemble(leaves, local), micro)
        return _objective(fn, out, scale)

    return _grad(local_loss, tuple(shards[k] for k in trainable), local, seed)


def _grad(local_loss, diff: tuple, local, seed=None) -> tuple[tuple, Any]:
    """`(gradient of the objective with respect to diff, extras)` from `local_loss(diff, local)
    -> (objective, extras)`: what `torch.func.grad(local_loss, has_aux=True)(diff, local)`
    returns, but with the backward that `objective.backward(seed(extras))` runs. `seed(extras)`
    is called between the forward and the backward; None, or no `seed`: the backward starts
    from 1.

    The forward runs under torch.func's transform, as in `torch.func.grad` (`local` may be
    updated in place; saved-tensor hooks and autograd Functions without `setup_context`, i.e.
    `torch.utils.checkpoint`, are refused: `_no_torch_checkpoint`). The backward does not:
    `torch.func.grad` runs it with `create_graph=True` (so that transforms can nest), and with
    grad mode on autograd picks other formulas for some ops (`silu`'s backward becomes
    `grad * s * (1 + x * (1 - s))`, `s = sigmoid(x)`, instead of the `silu_backward` kernel;
    `mish` likewise): valid gradients, rounded differently from what `loss.backward()` in
    single-process or DDP training computes. The step is the outermost transform; it needs
    no graph of its backward.
    """
    with _no_torch_checkpoint():
        # torch.func.vjp with argnums: `local` is an input of the transformed function (so it
        # may be written in place), not differentiated.
        checked = _reaching(local_loss)
        objective, vjp_fn, extras = _vjp_with_argnums(checked, diff, local, argnums=0, has_aux=True)
        cotangent = seed(extras) if seed is not None else None
        grads = vjp_fn(torch.ones_like(objective) if cotangent is None else cotangent, retain_graph=False, create_graph=False)
    return grads, extras


def _reaching(local_loss):
    """`local_loss`, raising StepError where its objective depends on none of the differentiated
    inputs (inside torch.func's transform, `requires_grad` says exactly that, traced or not)."""

    def checked(diff, local):
        objective, extras = local_loss(diff, local)
        if diff and isinstance(objective, torch.Tensor) and not objective.requires_grad:
            raise StepError(
                "loss_fn's loss does not depend on any trainable parameter of the params it is given, so the step "
                "would train nothing (every gradient 0). Compute it from that argument: apply_fn(params, x) with the "
                "apply_fn of fs.functionalize(model), not model(x) (the module's own tensors, which the step neither "
                "gathers nor updates); and do not detach the parameters or compute them under torch.no_grad()"
            )
        return objective, extras

    return checked


_TORCH_CHECKPOINT = os.path.join("torch", "utils", "checkpoint.py")


@contextlib.contextmanager
def _no_torch_checkpoint() -> Iterator[None]:
    """`torch.utils.checkpoint` in `loss_fn` fails under `torch.func`'s transforms (saved tensor hooks,
    or an autograd.Function without setup_context): re-raise its error as one that names the
    way that works, rematerialization on the traced graph."""
    try:
        yield
    except RuntimeError as error:
        if not any(f.filename.endswith(_TORCH_CHECKPOINT) for f in traceback.extract_tb(error.__traceback__)):
            raise
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        raise StepError(
            f"torch.utils.checkpoint cannot run inside loss_fn: the step differentiates loss_fn with "
            f"torch.func (vjp), which does not support it (RuntimeError: {detail}). Call the function without "
            f"checkpoint and let the step rematerialize instead: sharded_step(..., schedule=fs.Schedule(remat=True)) "
            f"recomputes every unit's forward right before its backward (or remat=('blocks.0', ...) for some "
            f"units, or a function unit -> bool), with the same bits; it applies to traced steps (trace=True)"
        ) from error


def _full_gradients(fn: StepFunction, layout: Layout, shards, trainable, frozen_leaves, local, micro, scale, seed=None, fulls=None):
    """One micro-batch's gradient with respect to the full (gathered) trainable buffers, in each
    buffer's reduce dtype: the "full" accumulation strategy sums these over micro-batches and
    reduce-scatters the sum once per step (`_reduce_full`). `fulls`: the full buffers kept
    from the last step (ZeRO-1), else gathered here."""
    mesh = fn.mesh
    if fulls is None:
        with _tracing.phase("forward"):
            fulls = [gather_full(layout.buffers[k], shards[k], mesh, differentiable=False, device=offloaded(fn, layout.buffers[k])) for k in trainable]

    def local_loss(fulls, local):
        leaves = dict(frozen_leaves)
        with _tracing.phase("forward"):
            for k, full in zip(trainable, fulls):
                leaves.update(zip(layout.buffers[k].leaves, layout.unflatten_buffer(layout.buffers[k], full)))
            with _tracing.graph_semantics():
                out = fn.loss_fn(layout.assemble(leaves, local), micro)
        return _objective(fn, out, scale)

    grads, extras = _grad(local_loss, tuple(fulls), local, seed)
    return [g.to(layout.buffers[k].reduce_dtype) for k, g in zip(trainable, grads)], local, extras


def _reduce_full(layout: Layout, trainable, shards, fulls, mesh, canonical: bool = False) -> list[torch.Tensor]:
    """Reduce-scatter accumulated full gradients (`canonical`: in the canonical tree), each back
    to its shard's dtype."""
    out = []
    for k, full in zip(trainable, fulls):
        if canonical:
            with _tracing.moving(layout.buffers[k]):
                grad = _canonical.reduce(full, mesh)
        else:
            grad = ReduceScatterFlat.apply(full.contiguous(), mesh, layout.buffers[k])
        out.append(grad if grad.dtype == shards[k].dtype else grad.to(shards[k].dtype))
    return out


def update(fn: StepFunction, layout: Layout, shards, local, opt_state, loss_scale, scalars, batch, kept=None) -> StepOutput:
    """One whole step: gradients, the global gradient norm, the optimizer's update, the mean
    loss. Whether the update is kept is the step's decision, on the host, from the norm
    (`_nonfinite`); the loss scale backs off here, on the same verdict. With `kept` (ZeRO-1:
    `StepFunction.keep`), the forward reads the kept full buffers and each updated trainable
    shard is all-gathered once, after the update, for the next step (`gather_kept`)."""
    grads, local, loss, mean, aux, microbatch_losses = gradients(fn, layout, shards, local, batch, loss_scale, kept)
    trainable = {spec.name: s for spec, s in zip(layout.buffers, shards) if spec.trainable}
    moved = streamed(fn, layout)
    host_trainable, host_opt_state = trainable, opt_state
    if moved:  # CPU offload, update on the device: its inputs copied there (`stream_offload_copies` places them)
        device = getattr(fn.mesh, "device", torch.device("cpu"))
        grads = {name: to_device(g, device) if name in moved else g for name, g in grads.items()}
        trainable = {name: to_device(s, device) if name in moved else s for name, s in trainable.items()}
        opt_state = map_buffers(opt_state, moved, lambda t: to_device(t, device))
    with _tracing.phase("update"):
        # Leaves every rank of the tensor-parallel axis holds whole count once in the norm.
        whole = layout.replicated_buffers  # a property that walks the buffers: read it once
        replicated = [name in whole for name in grads] if whole else None
        blocks = layout.blocks // layout.num_shards if layout.blocks else 0  # canonical blocks per shard
        norm = global_norm(list(grads.values()), fn.mesh, replicated=replicated, blocks=blocks) if grads else torch.zeros(())
        new_trainable, new_opt_state = fn.optimizer.apply(
            grads, opt_state, trainable, scalars, inplace=fn.donate, mesh=fn.mesh,
            leaves=LeafLayout.of_shards(layout, fn.mesh.shard_index),
        )
    if fn.loss_scale is not None:
        # The norm is all-reduced: every rank reads the same verdict, with no collective of its
        # own. Not finite exactly when some element of the gradient is not (or the norm overflows).
        loss_scale = fn.loss_scale.next(loss_scale, torch.isfinite(norm))
    if moved and fn.donate:  # ... and its results back to the host: into the donated buffers
        new_trainable = {name: to_host_into(host_trainable[name], s) if name in moved else s for name, s in new_trainable.items()}
        new_opt_state = map_buffer_pairs(host_opt_state, new_opt_state, moved, to_host_into)
    elif moved:  # ... or into new ones
        new_trainable = {name: to_host(s) if name in moved else s for name, s in new_trainable.items()}
        new_opt_state = map_buffers(new_opt_state, moved, to_host)
    new_shards = [new_trainable.get(spec.name, s) for spec, s in zip(layout.buffers, shards)]
    new_kept = None
    if kept is not None:
        with _tracing.phase("update"):
            new_kept = gather_kept(layout, new_shards, fn.mesh, kept)
    return StepOutput(new_shards, local, new_opt_state, loss_scale, mean, loss, norm, aux, microbatch_losses, new_kept)


def evaluate(fn: StepFunction, layout: Layout, shards, local, batch) -> EvalOutput:
    """The forward pass only: every buffer gathered (no gradient), the loss, the mean loss."""
    mesh = fn.mesh
    with _tracing.phase("forward"):
        leaves = dict(_gather_frozen(layout, shards, mesh, fn))
        for spec, s in zip(layout.buffers, shards):
            if spec.trainable:
                leaves.update(zip(spec.leaves, gather_buffer(layout, spec, s, mesh, differentiable=False, device=offloaded(fn, spec))))
        local = tuple(t.clone() for t in local)
        if fn.canonical is not None:
            return _evaluate_chunks(fn, layout, leaves, local, batch)
        with _tracing.graph_semantics():
            out = fn.loss_fn(layout.assemble(leaves, local), cast_inputs(batch, fn.input_dtype))
    _, (loss, weight, *aux) = _objective(fn, out, None)
    with _tracing.phase("update"):
        if isinstance(weight, torch.Tensor):
            sums = mesh.all_reduce_flat(torch.stack([weighted_term(loss, weight), weight]), mesh.data_axes)
            mean = (sums[0] / sums[1]).reshape(())
        else:
            mean = (mesh.all_reduce_flat(loss.reshape(1).float(), mesh.data_axes) / mesh.data_size).reshape(())
    return EvalOutput(local, mean, loss, aux[0] if fn.has_aux else None)


def _evaluate_chunks(fn: StepFunction, layout: Layout, leaves, local, batch) -> EvalOutput:
    """`evaluate` of a layout-invariant step: each canonical chunk alone, the losses added in the
    canonical tree (the mean, weighted or not, over every chunk of the global batch)."""
    canon, mesh, outs = fn.canonical, fn.mesh, []
    for index, micro in enumerate(split_microbatches(batch, canon.per_rank, fn.input_dtype, canon)):
        _random.reseed(canon.first + index, getattr(mesh, "device", torch.device("cpu")))
        with _tracing.graph_semantics():
            out = fn.loss_fn(layout.assemble(leaves, local), micro)
        outs.append(_objective(fn, out, None)[1])
    with _tracing.phase("update"):
        losses = [o[0] for o in outs]
        if isinstance(outs[0][1], torch.Tensor):
            # a chunk of weight 0 (every label ignored) adds 0, not its NaN mean (as the training step)
            pairs = torch.stack([torch.stack([weighted_term(o[0], o[1]), o[1]]) for o in outs])
            sums = _canonical.tree_sum(_canonical.chunk_values(pairs, mesh))
            mean = (sums[0] / sums[1]).reshape(())
            w = sum(o[1] for o in outs[1:]) + outs[0][1]
            loss = (sum((weighted_term(l, o[1]) for l, o in zip(losses[1:], outs[1:])), weighted_term(losses[0], outs[0][1])) / w)
            loss = loss.to(losses[0].dtype)
        else:
            mean = (_canonical.tree_sum(_canonical.chunk_values(torch.stack([l.float() for l in losses]), mesh)) / canon.chunks).reshape(())
            loss = (sum(l.float() for l in losses) / len(losses)).to(losses[0].dtype)
    aux = [o[2] for o in outs] if fn.has_aux else None
    return EvalOutput(local, mean, loss, aux if fn.has_aux and len(outs) > 1 else (aux[0] if aux else None))
