"""`sharded_step`: one FSDP training step as a function `(state, batch) -> (state, metrics)`.

The reference semantics (eager, `Schedule(trace=False)`), for this rank's trainable shards `s`:

    loss_r, grads = grad(lambda s: loss_fn(gather(s), batch_r))(s)   # grads = sum_r grad_r, sharded
    grads = grads / world_size                                       # mean over ranks, as DDP/FSDP
    s, opt_state = optimizer.update(grads, opt_state, s)

Frozen parameters are gathered without a gradient; module buffers are this rank's own and are
updated by the forward pass on fresh copies. The caller's state is never mutated.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import optree
import torch
import torch.utils._pytree as torch_pytree

from ._collectives import GatherFlat, gather_bytes
from ._layout import Layout, LayoutError, UnitPolicy, make_layout
from ._mesh import _MeshBase
from ._shard import Sharded, _check_shards, shard
from ._tree import NAMESPACE
from .optim import Optimizer

__all__ = ["Schedule", "StepState", "ShardedStep", "sharded_step", "StepError"]


class StepError(ValueError):
    """A step was given a state or a loss it cannot use."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `sharded_step` runs the step.

    Attributes:
        trace: False runs the eager reference: gather every unit, differentiate `loss ∘ gather`,
            reduce-scatter, update. (Traced, per-unit scheduled steps build on this reference.)
    """

    trace: bool = False

    def __post_init__(self) -> None:
        if self.trace:
            raise NotImplementedError(
                "Schedule(trace=True) (the traced, per-unit scheduled step) is not available yet; "
                "use fs.Schedule(trace=False), the eager reference"
            )


class _StepKey:
    """Identifies the `ShardedStep` that made a state (compared by identity)."""

    __slots__ = ("description",)

    def __init__(self, description: str):
        self.description = description

    def __repr__(self) -> str:
        return f"<step {self.description}>"


class StepState:
    """The state of a sharded training step on this rank (made by `ShardedStep.init`).

    Attributes:
        params: this rank's shards of the trainable and frozen parameters, and its own module
            buffers (a `Sharded`).
        opt_state: the optimizer's state over the trainable shards (a pytree whose parameter-like
            parts are dicts `buffer name -> shard`).
        step: number of steps taken (an int).

    A pytree node (optree and torch): its leaves are those of `params` and `opt_state`.
    """

    __slots__ = ("params", "opt_state", "step", "_key")

    def __init__(self, params: Sharded, opt_state: Any, step: int, key: _StepKey):
        self.params = params
        self.opt_state = opt_state
        self.step = step
        self._key = key

    def __repr__(self) -> str:
        return f"StepState(step={self.step}, params={self.params!r})"


optree.register_pytree_node(
    StepState,
    lambda s: ((s.params, s.opt_state), (s.step, s._key), ("params", "opt_state")),
    lambda aux, children: StepState(children[0], children[1], aux[0], aux[1]),
    namespace=NAMESPACE,
)
torch_pytree.register_pytree_node(
    StepState,
    lambda s: ((s.params, s.opt_state), (s.step, s._key)),
    lambda children, aux: StepState(children[0], children[1], aux[0], aux[1]),
    serialized_type_name="functional_shard.StepState",
)

_step_numbers = itertools.count()


class ShardedStep:
    """A sharded training step; make one with `fs.sharded_step`.

    `init(params) -> StepState` shards the parameters and builds the optimizer state;
    `step(state, batch) -> (new_state, metrics)` runs one step on this rank's local batch.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        mesh: _MeshBase,
        *,
        optimizer: Optimizer,
        schedule: Schedule,
        units: UnitPolicy | None,
        has_aux: bool,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
        if not isinstance(mesh, _MeshBase):
            raise TypeError(f"mesh must be a mesh made by fs.init_mesh; got {type(mesh).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an fs.optim optimizer (init, update); got {type(optimizer).__name__}")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be an fs.Schedule; got {type(schedule).__name__}")
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.optimizer = optimizer
        self.schedule = schedule
        self.units = units
        self.has_aux = has_aux
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        self._key = _StepKey(f"#{next(_step_numbers)} of {name} on {mesh!r}")

    def __repr__(self) -> str:
        return f"ShardedStep({self._key.description}, {self.schedule})"

    # --- init -----------------------------------------------------------------------------

    def init(self, params: Any) -> StepState:
        """Shard `params` over the mesh and build the optimizer state for the trainable shards.

        Arguments:
            params: a pytree of tensors, identical on every rank (e.g. from `fs.functionalize`);
                not modified. Leaves inside a `ModuleParams` take the role it gives them
                (trainable, frozen, buffer); other floating leaves are trainable, other
                non-floating leaves are carried like frozen ones.

        A collective: every rank must call it. Ranks whose pytrees differ (paths, shapes,
        dtypes) raise `MeshError` naming them, instead of exchanging mismatched buffers.
        """
        layout, _ = make_layout(params, self.mesh.num_shards, units=self.units)
        self.mesh.check_same("the parameter pytree (paths, shapes, dtypes, units)", layout.signature())
        sharded = shard(params, self.mesh, units=self.units)
        opt_state = self.optimizer.init(_trainable(sharded))
        return StepState(sharded, opt_state, 0, self._key)

    # --- the step -------------------------------------------------------------------------

    def __call__(self, state: StepState, batch: Any) -> tuple[StepState, dict[str, Any]]:
        """One training step on this rank's `batch`; returns `(new_state, metrics)`.

        metrics: `loss`, the mean over ranks of the local losses (0-d tensor, every rank);
        `local_loss`, this rank's; `aux`, what `loss_fn` returned besides the loss (with
        `has_aux=True`). `state` is never modified, whether the step succeeds or raises.
        """
        self._check_state(state)
        return self._eager_step(state, batch)

    def _check_state(self, state: StepState) -> None:
        if not isinstance(state, StepState):
            raise StepError(f"step(state, batch) expects the StepState made by step.init; got {type(state).__name__}")
        if state.params.mesh is not self.mesh:
            raise StepError(
                f"this state was made for {state.params.mesh!r}, but this step runs on {self.mesh!r}: "
                f"init the state with this step (fs.export the old one to carry its values over)"
            )
        if state._key is not self._key:
            raise StepError(
                f"this state was made by another sharded_step ({state._key.description}); this step is "
                f"{self._key.description}. A state belongs to the step that made it: call this step's "
                f"init(params), e.g. with fs.export(old_state)"
            )
        _check_shards(state.params)

    def grad(self, state: StepState, batch: Any) -> tuple[Sharded, dict[str, Any]]:
        """The gradient this step would apply, without applying it: `(grads, metrics)`.

        grads: a `Sharded` with the layout of `state.params`: this rank's shard of the mean
        over ranks of the loss gradient. Frozen parameters and module buffers, which get no
        gradient, hold zeros. `fs.gather(grads)` is the full gradient pytree on every rank.
        A collective, like the step. `state` is not modified.
        """
        self._check_state(state)
        grads, metrics, _ = self._gradients(state, batch)
        sharded = state.params
        shards = [grads.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        return sharded.replace(shards=shards, local=[torch.zeros_like(t) for t in sharded.local]), metrics

    def _gradients(self, state: StepState, batch: Any):
        """Eager reference: (mean gradient per trainable buffer name, metrics, updated local leaves)."""
        mesh, sharded = self.mesh, state.params
        layout = sharded.layout
        trainable_positions = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
        frozen_leaves: dict[int, torch.Tensor] = {}
        for spec, s in zip(layout.buffers, sharded.shards):
            if not spec.trainable:
                frozen_leaves.update(zip(spec.leaves, layout.unflatten_buffer(spec, gather_bytes(s, mesh))))
        # Fresh copies: the forward pass updates module buffers (BatchNorm statistics) in place.
        local = tuple(t.clone() for t in sharded.local)

        def local_loss(trainable_shards: tuple[torch.Tensor, ...], local: tuple[torch.Tensor, ...]):
            leaves = dict(frozen_leaves)
            for k, s in zip(trainable_positions, trainable_shards):
                spec = layout.buffers[k]
                leaves.update(zip(spec.leaves, layout.unflatten_buffer(spec, GatherFlat.apply(s, mesh))))
            out = self.loss_fn(layout.assemble(leaves, local), batch)
            loss, aux = _split_loss(out, self.has_aux, mesh)
            # torch.func.grad's aux must hold tensors only: no None when there is no aux.
            return loss, ((loss.detach(), aux) if self.has_aux else (loss.detach(),))

        trainable_shards = tuple(sharded.shards[k] for k in trainable_positions)
        grads, (loss, *aux) = torch.func.grad(local_loss, has_aux=True)(trainable_shards, local)
        names = [layout.buffers[k].name for k in trainable_positions]
        grads = {name: g / mesh.world_size for name, g in zip(names, grads)}
        mean_loss = mesh.all_reduce_flat(loss.reshape(1).float()) / mesh.world_size
        metrics: dict[str, Any] = {"loss": mean_loss.reshape(()), "local_loss": loss}
        if self.has_aux:
            metrics["aux"] = aux[0]
        return grads, metrics, local

    def _eager_step(self, state: StepState, batch: Any) -> tuple[StepState, dict[str, Any]]:
        sharded = state.params
        grads, metrics, local = self._gradients(state, batch)
        trainable = _trainable(sharded)
        new_trainable, opt_state = self.optimizer.update(grads, state.opt_state, trainable)
        shards = [new_trainable.get(spec.name, s) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        new_state = StepState(sharded.replace(shards=shards, local=local), opt_state, state.step + 1, self._key)
        return new_state, metrics


def _trainable(sharded: Sharded) -> dict[str, torch.Tensor]:
    return {spec.name: s for spec, s in zip(sharded.layout.buffers, sharded.shards) if spec.trainable}


def _split_loss(out: Any, has_aux: bool, mesh: _MeshBase) -> tuple[torch.Tensor, Any]:
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


def sharded_step(
    loss_fn: Callable[..., Any],
    mesh: _MeshBase,
    /,
    *,
    optimizer: Optimizer,
    schedule: Schedule | None = None,
    units: UnitPolicy | None = None,
    has_aux: bool = False,
) -> ShardedStep:
    """Make a fully sharded (FSDP / ZeRO-3) training step for `loss_fn`.

    Arguments:
        loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`), a pure
            function of the full (unsharded) parameter pytree and this rank's batch; `loss` a
            0-d floating tensor. Gradients are the mean over ranks of each rank's gradient.
        mesh: from `fs.init_mesh`; parameters are sharded over its shard axis.
        optimizer: an `fs.optim` optimizer, e.g. `fs.optim.adamw(lr=1e-3)`.
        schedule: an `fs.Schedule` (default: the eager reference).
        units: `path -> unit name`: how parameters are grouped into units, one flat buffer
            (hence one collective) each. Default `fs.units_by_block`: one per repeated block.
        has_aux: `loss_fn` returns `(loss, aux)`; `aux` comes back in `metrics["aux"]`.

    Returns a `ShardedStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.
    """
    return ShardedStep(loss_fn, mesh, optimizer=optimizer, schedule=schedule or Schedule(), units=units, has_aux=has_aux)
