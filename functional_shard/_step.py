"""`sharded_step`: one FSDP training step as a function `(state, batch) -> (state, metrics)`.

The reference semantics, for this rank's trainable shards `s`:

    loss_r, grads = grad(lambda s: loss_fn(gather(s), batch_r))(s)   # grads = sum_r grad_r, sharded
    grads = grads / world_size                                       # mean over ranks, as DDP/FSDP
    s, opt_state = optimizer.update(grads, opt_state, s)

Frozen parameters are gathered without a gradient; module buffers are this rank's own and are
updated by the forward pass on fresh copies. The caller's state is never mutated.

`Schedule(trace=False)` runs that composition eagerly. The default traces the same function
once per input signature (`_trace.py`), moves its collectives (`schedule.py`) and replays the
graph: a rearrangement of the same operations, hence the same bits.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import optree
import torch
import torch.utils._pytree as torch_pytree

from . import _trace
from . import schedule as schedule_lib
from ._collectives import GatherFlat, TraceTag, gather_bytes
from ._layout import Layout, UnitPolicy, make_layout
from ._mesh import _MeshBase
from ._shard import Sharded, _check_shards, shard_leaves
from ._tree import NAMESPACE, flatten
from .optim import Optimizer
from .schedule import Schedule

__all__ = ["StepState", "ShardedStep", "sharded_step", "StepError"]


class StepError(ValueError):
    """A step was given a state or a loss it cannot use."""


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

    __slots__ = ("params", "opt_state", "step", "_key", "_donated")

    def __init__(self, params: Sharded, opt_state: Any, step: int, key: _StepKey):
        self.params = params
        self.opt_state = opt_state
        self.step = step
        self._key = key
        # Set when a step with donate=True has taken this state's tensors for its result.
        self._donated = False

    def __repr__(self) -> str:
        return f"StepState(step={self.step}, params={self.params!r})"

    def replace(self, **changes):
        return StepState(changes.get("params", self.params), changes.get("opt_state", self.opt_state), changes.get("step", self.step), self._key)

    def __reduce__(self):
        raise TypeError("a StepState holds one rank's shards bound to a live mesh; save it with fs.checkpoint.save(path, state) and load it with fs.checkpoint.load(path, step.init(params))")


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
        donate: bool = False,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
        if not isinstance(mesh, _MeshBase):
            raise TypeError(f"mesh must be a mesh made by fs.init_mesh; got {type(mesh).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an fs.optim optimizer (init, update); got {type(optimizer).__name__}")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be an fs.Schedule; got {type(schedule).__name__}")
        if schedule.trace and not mesh.supports_tracing:
            raise StepError(
                f"{mesh!r} cannot trace a step (its ranks are threads, and make_fx traces one thread at a "
                f"time): pass schedule=fs.Schedule(trace=False) to run the eager reference on it"
            )
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.optimizer = optimizer
        self.schedule = schedule
        self.units = units
        self.has_aux = has_aux
        self.donate = donate
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        self._key = _StepKey(f"#{next(_step_numbers)} of {name} on {mesh!r}")
        self._cache: dict[tuple, _trace.CompiledStep] = {}
        self._last: _trace.CompiledStep | None = None

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
        layout, leaves = make_layout(params, self.mesh.num_shards, units=self.units)
        self.mesh.check_same("the parameter pytree (paths, shapes, dtypes, units)", layout.signature())
        sharded = shard_leaves(layout, leaves, self.mesh)
        opt_state = self.optimizer.init(_trainable(sharded))
        return StepState(sharded, opt_state, 0, self._key)

    # --- the step -------------------------------------------------------------------------

    def __call__(self, state: StepState, batch: Any) -> tuple[StepState, dict[str, Any]]:
        """One training step on this rank's `batch`; returns `(new_state, metrics)`.

        metrics: `loss`, the mean over ranks of the local losses (0-d tensor, every rank);
        `local_loss`, this rank's; `aux`, what `loss_fn` returned besides the loss (with
        `has_aux=True`); `all_gather_bytes` / `reduce_scatter_bytes`, bytes of the full
        buffers the step's collectives moved. `state` is never modified, whether the step
        succeeds or raises, unless the step was made with `donate=True`.
        """
        self._check_state(state)
        sharded = state.params
        scalars = self.optimizer.scalars(state.opt_state)
        if not self.schedule.trace:
            shards, local, opt_state, mean_loss, loss, aux = self._update(
                sharded.layout, sharded.shards, sharded.local, state.opt_state, scalars, batch
            )
            metrics = self._metrics(mean_loss, loss, aux, *_eager_bytes(sharded.layout))
        else:
            shards, local, opt_state, metrics = self._traced_update(state, scalars, batch)
        new_state = StepState(sharded.replace(shards=shards, local=local), opt_state, state.step + 1, self._key)
        state._donated = self.donate
        return new_state, metrics

    def _metrics(self, mean_loss, loss, aux, all_gather_bytes: int, reduce_scatter_bytes: int) -> dict[str, Any]:
        metrics: dict[str, Any] = {
            "loss": mean_loss,
            "local_loss": loss,
            "all_gather_bytes": all_gather_bytes,
            "reduce_scatter_bytes": reduce_scatter_bytes,
        }
        if self.has_aux:
            metrics["aux"] = aux
        return metrics

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
        if state._donated:
            raise StepError(
                "this state was donated to a step made with donate=True, which updated its tensors in place "
                "for the state it returned: use the returned state"
            )
        _check_shards(state.params)

    def grad(self, state: StepState, batch: Any) -> tuple[Sharded, dict[str, Any]]:
        """The gradient this step would apply, without applying it: `(grads, metrics)`, eagerly.

        grads: a `Sharded` with the layout of `state.params`: this rank's shard of the mean
        over ranks of the loss gradient. Frozen parameters and module buffers, which get no
        gradient, hold zeros. `fs.gather(grads)` is the full gradient pytree on every rank.
        A collective, like the step. `state` is not modified.
        """
        self._check_state(state)
        sharded = state.params
        grads, _, loss, aux = self._gradients(sharded.layout, sharded.shards, sharded.local, batch)
        mean_loss = self._mean_loss(loss)
        shards = [grads.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        grads_sharded = sharded.replace(shards=shards, local=[torch.zeros_like(t) for t in sharded.local])
        return grads_sharded, self._metrics(mean_loss, loss, aux, *_eager_bytes(sharded.layout))

    # --- the computation (eager, and traced as it is) ---------------------------------------

    def _gradients(self, layout: Layout, shards, local, batch, log: list | None = None):
        """(mean gradient per trainable buffer name, updated local leaves, local loss, aux)."""
        mesh = self.mesh

        def tag(spec):
            return None if log is None else TraceTag(spec, log)

        trainable_positions = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
        frozen_leaves: dict[int, torch.Tensor] = {}
        for spec, s in zip(layout.buffers, shards):
            if not spec.trainable:
                frozen_leaves.update(zip(spec.leaves, layout.unflatten_buffer(spec, gather_bytes(s, mesh, tag(spec)))))
        # Fresh copies: the forward pass updates module buffers (BatchNorm statistics) in place.
        local = tuple(t.clone() for t in local)

        def local_loss(trainable_shards: tuple[torch.Tensor, ...], local: tuple[torch.Tensor, ...]):
            leaves = dict(frozen_leaves)
            for k, s in zip(trainable_positions, trainable_shards):
                spec = layout.buffers[k]
                leaves.update(zip(spec.leaves, layout.unflatten_buffer(spec, GatherFlat.apply(s, mesh, tag(spec)))))
            out = self.loss_fn(layout.assemble(leaves, local), batch)
            loss, aux = _split_loss(out, self.has_aux, mesh)
            # torch.func.grad's aux must hold tensors only: no None when there is no aux.
            return loss, ((loss.detach(), aux) if self.has_aux else (loss.detach(),))

        trainable_shards = tuple(shards[k] for k in trainable_positions)
        grads, (loss, *aux) = torch.func.grad(local_loss, has_aux=True)(trainable_shards, local)
        names = [layout.buffers[k].name for k in trainable_positions]
        grads = {name: g / mesh.world_size for name, g in zip(names, grads)}
        return grads, local, loss, (aux[0] if self.has_aux else None)

    def _mean_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return (self.mesh.all_reduce_flat(loss.reshape(1).float()) / self.mesh.world_size).reshape(())

    def _update(self, layout: Layout, shards, local, opt_state, scalars, batch, log: list | None = None):
        """One step: (new shards (all), new local leaves, new optimizer state, mean loss, local loss, aux)."""
        grads, local, loss, aux = self._gradients(layout, shards, local, batch, log)
        trainable = {spec.name: s for spec, s in zip(layout.buffers, shards) if spec.trainable}
        new_trainable, opt_state = self.optimizer.apply(grads, opt_state, trainable, scalars, inplace=self.donate)
        new_shards = [new_trainable.get(spec.name, s) for spec, s in zip(layout.buffers, shards)]
        return new_shards, local, opt_state, self._mean_loss(loss), loss, aux

    # --- the jit ------------------------------------------------------------------------------

    @property
    def cache(self) -> dict:
        """Traced steps by input signature (`CompiledStep`s: graph, schedule, bytes)."""
        return dict(self._cache)

    @property
    def schedule_events(self) -> list:
        """The schedule of the most recently run traced step, as `fs.schedule.ScheduleEvent`s."""
        if self._last is None:
            raise StepError("no traced step has run yet: call the step once (schedule.trace must be True)")
        return list(self._last.events)

    def explain(self) -> str:
        """The schedule of the most recently run traced step, as a readable table."""
        if self._last is None:
            raise StepError("no traced step has run yet: call the step once (schedule.trace must be True)")
        return self._last.explain()

    def _traced_update(self, state: StepState, scalars: dict, batch: Any):
        sharded = state.params
        layout = sharded.layout
        opt_leaves, opt_spec = flatten(state.opt_state)
        batch_leaves, batch_spec, tensor_positions = _trace.flatten_batch(batch)
        scalar_names = tuple(scalars)
        state_key = (
            id(layout),
            opt_spec,
            tuple((tuple(t.shape), t.dtype) for t in opt_leaves),
            scalar_names,
        )
        signature = _trace.signature_of(batch_leaves, batch_spec, state_key)
        compiled = self._cache.get(signature)
        batch_tensors = [batch_leaves[i] for i in tensor_positions]
        inputs = [*sharded.shards, *sharded.local, *opt_leaves, *scalars.values(), *batch_tensors]
        if compiled is None:
            compiled = self._compile(layout, state, opt_spec, scalar_names, batch_leaves, batch_spec, tensor_positions, inputs, signature)
            self._cache[signature] = compiled
        self._last = compiled
        outputs = compiled.run(*inputs)
        n = compiled.num_outputs
        trainable_positions = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
        shards = list(sharded.shards)
        for k, t in zip(trainable_positions, outputs[: n["trainable"]]):
            shards[k] = t
        rest = outputs[n["trainable"] :]
        local, rest = list(rest[: n["local"]]), rest[n["local"] :]
        opt_state = opt_spec.unflatten(rest[: n["opt"]])
        mean_loss, loss = rest[n["opt"]], rest[n["opt"] + 1]
        aux = compiled.aux_spec.unflatten(rest[n["opt"] + 2 :]) if self.has_aux else None
        metrics = self._metrics(mean_loss, loss, aux, compiled.all_gather_bytes, compiled.reduce_scatter_bytes)
        return shards, local, opt_state, metrics

    def _compile(self, layout, state, opt_spec, scalar_names, batch_leaves, batch_spec, tensor_positions, inputs, signature):
        sharded = state.params
        counts = [len(sharded.shards), len(sharded.local), opt_spec.num_leaves, len(scalar_names), len(tensor_positions)]
        trainable_positions = [k for k, spec in enumerate(layout.buffers) if spec.trainable]
        log: list = []
        aux_spec_box: list = []

        def flat_step(*flat):
            pieces, start = [], 0
            for count in counts:
                pieces.append(list(flat[start : start + count]))
                start += count
            shards, local, opt_leaves, scalar_values, batch_tensors = pieces
            leaves = list(batch_leaves)
            for i, t in zip(tensor_positions, batch_tensors):
                leaves[i] = t
            batch = batch_spec.unflatten(leaves)
            new_shards, new_local, new_opt, mean_loss, loss, aux = self._update(
                layout, shards, local, opt_spec.unflatten(opt_leaves), dict(zip(scalar_names, scalar_values)), batch, log
            )
            aux_leaves, aux_spec = flatten(aux)
            aux_spec_box.append(aux_spec)
            new_opt_leaves, _ = flatten(new_opt)
            return [
                *(new_shards[k] for k in trainable_positions),
                *new_local,
                *new_opt_leaves,
                mean_loss,
                loss,
                *aux_leaves,
            ]

        num_outputs = {"trainable": len(trainable_positions), "local": len(sharded.local), "opt": opt_spec.num_leaves}
        loss_output = num_outputs["trainable"] + num_outputs["local"] + num_outputs["opt"] + 1
        gm = _trace.trace_step(flat_step, inputs, log=log, forward_end_output=loss_output, schedule=self.schedule)
        events = schedule_lib.analyze(gm)
        kinds = {"gather_issued": "all_gather", "reduce_scatter_issued": "reduce_scatter", "all_reduce_issued": "all_reduce"}
        sequence = [f"{kinds[e.event]} of {e.buffer or 'the loss'} ({e.nbytes} bytes)" for e in events if e.event in kinds]
        self.mesh.check_same_sequence("the traced step's collectives", sequence)
        run = gm
        if self.schedule.compile:
            run = torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)
        return _trace.CompiledStep(
            signature=signature,
            graph_module=gm,
            events=events,
            all_gather_bytes=sum(e.nbytes for e in events if e.event == "gather_issued"),
            reduce_scatter_bytes=sum(e.nbytes for e in events if e.event == "reduce_scatter_issued"),
            run=run,
            num_outputs=num_outputs,
            aux_spec=aux_spec_box[0] if aux_spec_box else None,
            layout=layout,
        )


def _eager_bytes(layout: Layout) -> tuple[int, int]:
    """Bytes the eager reference moves: every buffer gathered once, every trainable one
    reduce-scattered once."""
    return sum(b.nbytes for b in layout.buffers), sum(b.nbytes for b in layout.buffers if b.trainable)


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
    donate: bool = False,
) -> ShardedStep:
    """Make a fully sharded (FSDP / ZeRO-3) training step for `loss_fn`.

    Arguments:
        loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`), a pure
            function of the full (unsharded) parameter pytree and this rank's batch; `loss` a
            0-d floating tensor. Gradients are the mean over ranks of each rank's gradient.
        mesh: from `fs.init_mesh`; parameters are sharded over its shard axis.
        optimizer: an `fs.optim` optimizer, e.g. `fs.optim.adamw(lr=1e-3)`.
        schedule: an `fs.Schedule` (default: traced, prefetch 1, reshard after forward).
        units: `path -> unit name`: how parameters are grouped into units, one flat buffer
            (hence one collective) each. Default `fs.units_by_block`: one per repeated block.
        has_aux: `loss_fn` returns `(loss, aux)`; `aux` comes back in `metrics["aux"]`.
        donate: the step may update the state's parameter shards and optimizer state in place
            (as FSDP and `torch.optim` do) instead of copying them: about 12 bytes per
            parameter and rank less peak memory. The state passed in is then used up: it
            raises if passed again. An error before the update (in `loss_fn`, say) still
            leaves it untouched; without donation no error can touch it.

    Returns a `ShardedStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.
    """
    return ShardedStep(
        loss_fn, mesh, optimizer=optimizer, schedule=schedule or Schedule(), units=units, has_aux=has_aux, donate=donate
    )
