"""`ShardedStep`: one FSDP training step, `(state, batch) -> (state, metrics)` (`fs.sharded_step` makes it).

The step object owns what is per step: the state it made (`init`), the checks on what it is
given, donation, and the metrics. What a step computes is `_reference.update`, run eagerly
(`fs.Schedule(trace=False)`) or traced, scheduled and replayed by `_jit.Jit` — a
rearrangement of the same operations, hence the same bits. The caller's state is never
mutated (unless donated).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import _canonical, _nonfinite, _random, _reference
from ._jit import Jit, agree
from ._layout import Layout, make_layout
from ._mesh import BaseMesh, MeshError, PeerError
from ._placed import CheckedLoss, check_same_layout, place, resolve_placements, split_leaves
from ._state import StepState, _StepKey, check_is_state, check_not_donated, check_seed  # noqa: F401 - re-exported (checkpoint, export)
from ._checks import (
    batch_facts, broadcast_from_rank0, check_leaves, check_same_values, optimizer_facts, refused_batch, scalar_facts,
    step_facts,
)
from ._offload import keep_pinned, map_buffers, place_on_host
from ._reference import StepError, StepFunction
from .initialize import shard_from
from ._nonfinite import NonFinite
from .precision import Precision
from ._shard import Sharded, _check_shards, gather_kept, shard_leaves
from ._units import Units
from .optim import LeafLayout, Optimizer, as_optimizer
from .schedule import Schedule
from .schedule._graph import check_units_named

__all__ = ["StepState", "ShardedStep", "StepError"]


class ShardedStep:
    """A sharded training step; make one with `fs.sharded_step`.

    `init(params) -> StepState` shards the parameters and builds the optimizer state;
    `step(state, batch) -> (new_state, metrics)` runs one step on this rank's local batch.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        mesh: BaseMesh,
        *,
        optimizer: Optimizer,
        schedule: Schedule,
        units: Units,
        has_aux: bool,
        donate: bool = False,
        max_traces: int = 8,
        precision: Precision | None = None,
        microbatches: int = 1,
        nonfinite: NonFinite | str | None = None,
        placements: Any = None,
        canonical_chunks: int | None = None,
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable; got {type(loss_fn).__name__}")
        if not isinstance(mesh, BaseMesh):
            raise TypeError(f"mesh must be a mesh made by fs.init_mesh (an fs.BaseMesh); got {type(mesh).__name__}")
        mesh.check_model_axes("fs.sharded_step", supported=("tp",))
        if placements is None and mesh.model_axes:
            raise MeshError(
                f"the {mesh.describe()} has a tensor-parallel axis {mesh.model_axes[0]!r} but fs.sharded_step was given "
                f"no placements: every leaf would be whole on every rank of it and its ranks would compute the same "
                f"thing. Pass placements=fs.tensor_parallel.hf_rules(model) (or gpt_rules(config), or your own rules), "
                f"and run the model through fs.tensor_parallel.parallelize (docs/parallelism.md)"
            )
        optimizer = as_optimizer(optimizer)  # a torch.optim object: a TypeError naming its fs equivalent
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be an fs.Schedule; got {type(schedule).__name__}")
        if not isinstance(max_traces, int) or max_traces < 1:
            raise ValueError(f"max_traces must be an int >= 1; got {max_traces!r}")
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(f"precision must be an fs.Precision or None; got {type(precision).__name__}")
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1; got {microbatches!r}")
        canonical = _canonical.resolve(canonical_chunks, mesh, microbatches)  # ValueError: not invariant here
        if canonical is not None and schedule.offload is not None:
            raise ValueError(
                "Schedule(offload=...) and canonical_chunks cannot be combined yet: the layout-invariant step's "
                "canonical reduction runs on the device; use one or the other"
            )
        if canonical is not None and not schedule.reshard_after_update:
            raise ValueError(
                "Schedule(reshard_after_update=False) (ZeRO-1) and canonical_chunks cannot be combined: the "
                "layout-invariant step reduces in its own tree; use one or the other"
            )
        microbatches = canonical.per_rank if canonical is not None else microbatches
        loss_scale = precision.loss_scale if precision is not None else None
        self.nonfinite = _nonfinite.resolve(nonfinite, donate=donate, loss_scale=loss_scale)
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
        self.precision = precision
        self.microbatches = microbatches
        self.placements = placements
        self.canonical = canonical
        input_dtype = precision.input_dtype() if precision is not None else None
        self._loss = CheckedLoss(loss_fn)  # a model split by styled rules must have been parallelized
        self._fn = StepFunction(
            self._loss, mesh, optimizer, has_aux, donate, microbatches,
            "full" if canonical is not None else schedule.accumulate, loss_scale, input_dtype, canonical,
            not schedule.reshard_after_update, schedule.offload,
        )  # fmt: skip
        self._jit = Jit(self._train, "a training step", mesh, schedule, max_traces=max_traces)
        self._eval_jit = Jit(self._evaluate, "step.evaluate", mesh, schedule, max_traces=max_traces)
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        self._key = _StepKey(f"{name} at 0x{id(self):x} on {mesh!r}")
        # What ranks agree on before each step, with the optimizer's per-step scalars (`_jit.agree`).
        self._facts = step_facts(schedule, self.nonfinite, microbatches, loss_scale)
        if canonical is not None:  # threads change how kernels split their sums: every rank alike
            self._facts += (
                f"canonical_chunks={canonical.chunks}, torch threads={torch.get_num_threads()} (call "
                f"torch.set_num_threads with the same count on every rank, before fs.sharded_step)",
            )
        self._optimizer_facts = optimizer_facts(optimizer)

    @property
    def _blocks(self) -> int:
        """Canonical blocks per buffer (`Layout.blocks`): G with canonical_chunks, else 0."""
        return self.canonical.chunks if self.canonical is not None else 0

    def __repr__(self) -> str:
        return f"ShardedStep({self._key.description}, {self.schedule})"

    # --- init -----------------------------------------------------------------------------

    def init(self, params: Any, *, seed: int = 0, values: str = "check", initialize: Any = None) -> StepState:
        """Shard `params` over the mesh and build the optimizer state for the trainable shards.

        Arguments:
            params: a pytree of tensors, identical on every rank (e.g. from `fs.functionalize`);
                not modified. Leaves inside a `ModuleParams` take the role it gives them
                (trainable, frozen, buffer); other floating leaves are trainable, other
                non-floating leaves are carried like frozen ones.
            seed: the seed of the step's random numbers (dropout): step `n` on rank `r` draws
                from a generator seeded by `(seed, n, r)` (with `canonical_chunks`, each chunk `c`
                by `(seed, n, c)`). The caller's own RNG is left as it was.
            values: what to do about the ranks' parameter values. `"check"` (default): compare
                a hash of every buffer's values across ranks and raise `MeshError` naming the
                ranks and the first buffer that differ (ranks seeded differently would
                otherwise train a silent mixture). `"broadcast"`: take rank 0's values, as DDP
                does. `"trust"`: neither (no extra collective). Not used with `initialize`.
            initialize: an `fs.initialize.Initializer` (`fs.initialize.from_module(model, seed=0)`,
                `fs.initialize.from_function(fn)`, `fs.checkpoint.from_safetensors(path)`): make
                each rank's shards leaf by leaf instead of slicing `params`, whose leaves may then
                be on the meta device (only their paths, shapes and dtypes are read). Peak memory:
                the shards plus one leaf's owner; see `fs.initialize`.

        A collective: every rank must call it. Ranks whose pytrees differ (paths, shapes,
        dtypes) raise `MeshError` naming them, instead of exchanging mismatched buffers. The
        state's tensors never require grad and carry no autograd history.
        """
        if values not in ("check", "broadcast", "trust"):
            raise ValueError(f"init(values=...) must be 'check', 'broadcast' or 'trust'; got {values!r}")
        check_seed(seed)
        error = None
        try:
            placements = resolve_placements(params, self.placements, self.mesh)
            self._loss.place(params, self.placements, placements, self.mesh)
            full_layout, leaves = make_layout(
                params, self.mesh.num_shards, units=self.units, precision=self.precision, blocks=self._blocks
            )
            check_leaves(full_layout, leaves, self.mesh, meta_ok=initialize is not None)
            if placements is None:
                layout, pieces = full_layout, leaves
            else:
                with torch.no_grad():  # this rank's pieces: cut once, kept for the shards below
                    layout, pieces = place(params, placements, self.mesh, units=self.units, precision=self.precision, blocks=self._blocks)
        except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
            error = e
        # A rank whose params or plan are refused raises its error; its peers name it at once.
        self.mesh.succeed_together("step.init", error, lambda failed: PeerError(
            f"ranks {failed} refused their parameters or placement rules in step.init (see their errors), so no "
            f"rank initialized: every rank of the {self.mesh.describe()} must pass the same params and the same "
            f"placements= rules", failed[0]))  # fmt: skip
        check_same_layout(layout, self.mesh)
        with torch.no_grad():
            leaves = [leaf.detach() for leaf in leaves]
            if initialize is not None:
                sharded = shard_from(initialize, layout, leaves, self.mesh, full_layout=full_layout)
            else:
                if values == "broadcast":
                    leaves = broadcast_from_rank0(full_layout, leaves, self.mesh)
                    pieces = split_leaves(leaves, placements, self.mesh)  # of rank 0's values
                elif values == "check":
                    check_same_values(full_layout, leaves, self.mesh)
                sharded = shard_leaves(layout, [piece.detach() for piece in pieces], self.mesh)
            opt_state = self.optimizer.init(sharded.trainable(), leaves=LeafLayout.of_shards(layout, self.mesh.shard_index))
        loss_scale = self._fn.loss_scale.init() if self._fn.loss_scale is not None else None
        state = StepState(sharded, opt_state, loss_scale, torch.tensor(seed, dtype=torch.int64), 0, self._key)
        if self.schedule.offload is not None:
            error, placed = None, state
            try:
                placed = self._to_host(state)
            except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
                error = e
            self.mesh.succeed_together("step.init (CPU offload)", error, lambda failed: PeerError(
                f"ranks {failed} could not place their offloaded state in host memory (see their errors), so no rank "
                f"initialized", failed[0]))  # fmt: skip
            state = placed
        return state.replace(gathered=self._gathered(state)) if self._fn.keep else state

    def init_abstract(self, params: Any) -> StepState:
        """A state whose shards and optimizer state are meta tensors: shapes and dtypes only,
        nothing allocated and no collective — for planning a step (`step.lower`,
        `fs.analysis`) on a mesh that need not exist. It cannot be run.

        Arguments:
            params: the parameter pytree, typically on the meta device (a model built under
                `torch.device("meta")`, then `fs.functionalize`); only shapes and dtypes are read.
        """
        placements = resolve_placements(params, self.placements, self.mesh)
        self._loss.place(params, self.placements, placements, self.mesh)
        layout, leaves = place(params, placements, self.mesh, units=self.units, precision=self.precision, blocks=self._blocks)
        shards = [torch.empty(spec.shard_numel, dtype=spec.dtype, device="meta") for spec in layout.buffers]
        local = [torch.empty(leaves[i].shape, dtype=leaves[i].dtype, device="meta") for i in layout.local]
        sharded = Sharded(layout, self.mesh, shards, local)
        loss_scale = self._fn.loss_scale.init() if self._fn.loss_scale is not None else None
        opt_state = self.optimizer.init(sharded.trainable(), leaves=LeafLayout.of_shards(layout, self.mesh.shard_index))
        state = StepState(sharded, opt_state, loss_scale, torch.tensor(0), 0, self._key)
        if self._fn.keep:  # ZeRO-1: the full buffers, as meta tensors
            state = state.replace(gathered=tuple(torch.empty(spec.padded_numel, dtype=spec.gather_dtype, device="meta") for spec in layout.buffers))
        return state

    # --- the step -------------------------------------------------------------------------

    def __call__(self, state: StepState, batch: Any) -> tuple[StepState, dict[str, Any]]:
        """One training step on this rank's `batch`; returns `(new_state, metrics)`.

        metrics: `loss`, the mean over ranks of the local losses (0-d tensor, every rank);
        `local_loss`, this rank's; `aux`, what `loss_fn` returned besides the loss (with
        `has_aux=True`); `all_gather_bytes` / `reduce_scatter_bytes`, bytes of the full
        buffers the step's collectives moved; `grad_norm`, the 2-norm of the whole mean
        gradient (what `torch.nn.utils.clip_grad_norm_` reports); `skipped` (0-d bool: the
        gradient was not finite and nothing was updated, see `fs.NonFinite`); with loss
        scaling, `loss_scale` (the scale this step used). `state` is never modified, whether
        the step succeeds or raises, unless the step was made with `donate=True`.

        Before any collective of the step, ranks agree on what it is — traced or eager, the
        optimizer, its hyperparameters and this step's learning rate, micro-batches, loss
        scale, non-finite policy — and raise `MeshError` together, naming the ranks and what
        differs, instead of training a silent mixture (within the agreement every step opens
        with, `mesh.agree`, which also compares the traced graphs: no other round trip).

        Ranks may pass batches of different shapes (a traced step then runs a graph per
        shape, and checks that every rank issues the same collectives before any runs).
        """
        self._check_state(state)
        sharded = state.params
        scalars = self.optimizer.scalars(state.opt_state)
        problem, cut = batch_facts(batch, self.microbatches, self.canonical)
        facts = () if self.mesh.world_size == 1 else (
            *self._facts, self._optimizer_facts[0], *scalar_facts(scalars), *self._optimizer_facts[1:], *cut
        )
        rest = self._rest(state, scalars, gather=True)
        with self._random_stream(state), refused_batch(problem):
            if not self.schedule.trace:
                agree(self.mesh, "a training step", facts)
                with torch.no_grad():
                    out = self._train(sharded.layout, sharded.shards, rest, batch)
                moved = sharded.layout.eager_bytes(self.microbatches, self._fn.accumulate, self._fn.keep)
            else:
                out, compiled = self._jit.run(sharded.layout, sharded.shards, rest, batch, facts)
                moved = compiled.all_gather_bytes, compiled.reduce_scatter_bytes
        if self.donate:
            self._key.donated.add(state)
        skip = _nonfinite.skip_update(
            self.nonfinite, out, step=state.step, rank=self.mesh.rank, loss_scale=self._fn.loss_scale, donated=self.donate
        )
        # Skipped: the state given, as it was (parameters, module buffers, optimizer state).
        params = sharded if skip else sharded.replace(shards=out.shards, local=out.local)
        opt_state = state.opt_state if skip else out.opt_state
        if self.schedule.offload is not None and not skip:  # new host tensors come back pageable
            shards, opt_state = keep_pinned((params.shards, opt_state), getattr(self.mesh, "device", "cpu"))
            params = params.replace(shards=shards)
        new_state = StepState(params, opt_state, out.loss_scale, state.rng, state.step + 1, self._key)
        if self._fn.keep:
            new_state = new_state.replace(gathered=rest[-1] if skip else tuple(out.kept))
        metrics = self._metrics(out.mean_loss, out.loss, out.aux, *moved)
        metrics["grad_norm"] = out.grad_norm
        metrics["skipped"] = torch.tensor(skip)
        if out.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale
        return new_state, metrics

    def evaluate(self, state: StepState, batch: Any) -> dict[str, Any]:
        """The loss on `batch` without training: a forward pass with the same per-unit
        gathering and prefetch as the step (never the whole model on one rank), traced per
        batch signature and per train/eval mode of the model (`model.eval()` retraces).

        Returns metrics: `loss` (the mean over ranks, weighted with `fs.WeightedLoss`),
        `local_loss`, and `aux` with `has_aux=True`. A collective. `state` is not modified;
        module buffers the forward updates (BatchNorm in train mode) are discarded.
        """
        self._check_state(state, "step.evaluate(state, batch)")
        sharded = state.params
        chunks = self.canonical.per_rank if self.canonical is not None else 1
        problem, cut = batch_facts(batch, chunks, self.canonical)
        facts = (*self._facts[:1], *cut)
        with self._random_stream(state), refused_batch(problem):
            if not self.schedule.trace:
                agree(self.mesh, "step.evaluate", facts)
                with torch.no_grad():
                    out = self._evaluate(sharded.layout, sharded.shards, (sharded.local,), batch)
                moved = sum(b.nbytes for b in sharded.layout.buffers), 0
            else:
                out, compiled = self._eval_jit.run(sharded.layout, sharded.shards, (sharded.local,), batch, facts)
                moved = compiled.all_gather_bytes, compiled.reduce_scatter_bytes
        return self._metrics(out.mean_loss, out.loss, out.aux, *moved)

    # What the jit traces (and eager runs): the reference computation with the state unpacked.
    def _train(self, layout: Layout, shards, rest, batch):
        local, opt_state, loss_scale, scalars, *kept = rest
        return _reference.update(self._fn, layout, shards, local, opt_state, loss_scale, scalars, batch, *kept)

    def _to_host(self, state: StepState) -> StepState:
        """CPU offload: the offloaded units' shards and optimizer state moved to host memory."""
        layout = state.params.layout
        chosen = [self.schedule.offload.selects(spec.unit) for spec in layout.buffers]
        units = sorted({spec.unit for spec in layout.buffers})
        if isinstance(self.schedule.offload.units, tuple):
            check_units_named(f"Schedule(offload={self.schedule.offload!r})", self.schedule.offload.units, units, StepError)
        if not any(chosen):
            raise StepError(
                f"Schedule(offload={self.schedule.offload!r}) selects none of this step's units ({units}): name some, or "
                f"leave offload out"
            )

        def host(t: torch.Tensor, where: str) -> torch.Tensor:
            try:
                return place_on_host(t)
            except RuntimeError as error:  # pinning fails when the host has no page-locked memory left
                raise StepError(
                    f"CPU offload: could not place {where} ({t.numel() * t.element_size() / 2**20:.1f} MiB, {t.dtype}) "
                    f"in host memory on rank {self.mesh.rank}: {str(error).strip().splitlines()[0][:200]}. Offload fewer "
                    f"units (fs.schedule.Offload(units=(...))) or free host memory; nothing was moved"
                ) from error

        shards = [host(s, f"the shard of buffer {spec.name!r}") if c else s for s, spec, c in zip(state.params.shards, layout.buffers, chosen)]
        names = frozenset(spec.name for spec, c in zip(layout.buffers, chosen) if c and spec.trainable)
        opt_state = map_buffers(state.opt_state, names, lambda t: host(t, "optimizer state"))
        return state.replace(params=state.params.replace(shards=shards), opt_state=opt_state)

    def _rest(self, state: StepState, scalars, *, gather: bool = False) -> tuple:
        """The state the traced step takes besides the shards: local leaves, optimizer state,
        loss scale, this step's scalars, and with ZeRO-1 the kept full buffers (a state without
        them, loaded from a checkpoint: gathered now when `gather`, else refused)."""
        rest = (state.params.local, state.opt_state, state.loss_scale, scalars)
        if not self._fn.keep:
            return rest
        if state.gathered is None:
            if not gather:
                raise StepError(
                    "this ZeRO-1 state (Schedule(reshard_after_update=False)) holds no full parameters (a loaded or "
                    "edited state): run a step with it first, which gathers them, or plan with step.init_abstract"
                )
            return (*rest, self._gathered(state))
        return (*rest, state.gathered)

    def _gathered(self, state: StepState) -> tuple:
        """ZeRO-1's full buffers of `state`'s shards (a collective, eager): after `init`, or for
        a state that has none (loaded from a checkpoint)."""
        self.mesh.agree("ZeRO-1: gather the full parameters")
        with torch.no_grad():
            return tuple(gather_kept(state.params.layout, state.params.shards, self.mesh))

    def _evaluate(self, layout: Layout, shards, rest, batch):
        return _reference.evaluate(self._fn, layout, shards, rest[0], batch)

    def _random_stream(self, state: StepState):
        """This step's random stream (`_random.stream`): per data-parallel rank, or per chunk."""
        rank = None if self.canonical is not None else self.mesh.data_rank
        return _random.stream(int(state.rng), state.step, rank, getattr(self.mesh, "device", torch.device("cpu")))

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

    def _check_state(self, state: StepState, what: str = "step(state, batch)") -> None:
        check_is_state(state, what)
        if state.params.mesh is not self.mesh:
            raise StepError(
                f"this state was made for another mesh object ({state.params.mesh!r}, id 0x{id(state.params.mesh):x}) "
                f"than this step's ({self.mesh!r}, id 0x{id(self.mesh):x}): init the state with this step, or "
                f"load it with fs.checkpoint.load(path, step.init(params))"
            )
        if state._key is not self._key:
            raise StepError(
                f"this state was made by another sharded_step ({state._key.description}); this step is "
                f"{self._key.description}. A state belongs to the step that made it: call this step's "
                f"init(params), e.g. with fs.export(old_state)"
            )
        check_not_donated(state, what)
        _check_shards(state.params)

    def grad(self, state: StepState, batch: Any) -> tuple[Sharded, dict[str, Any]]:
        """The gradient this step would apply, without applying it: `(grads, metrics)`, eagerly.

        grads: a `Sharded` with the layout of `state.params`: this rank's shard of the mean
        over ranks of the loss gradient. Frozen parameters and module buffers, which get no
        gradient, hold zeros. `fs.gather(grads)` is the full gradient pytree on every rank.
        A collective, like the step. `state` is not modified.
        """
        self._check_state(state, "step.grad(state, batch)")
        sharded = state.params
        self.mesh.agree("step.grad")
        with self._random_stream(state), torch.no_grad():
            grads, _, loss, mean_loss, aux, _ = _reference.gradients(
                self._fn, sharded.layout, sharded.shards, sharded.local, batch, state.loss_scale
            )
        shards = [grads.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        grads_sharded = sharded.replace(shards=shards, local=[torch.zeros_like(t) for t in sharded.local])
        return grads_sharded, self._metrics(mean_loss, loss, aux, *sharded.layout.eager_bytes(self.microbatches, self._fn.accumulate))

    # --- what the jit did ----------------------------------------------------------------------

    def lower(self, state: StepState, batch: Any):
        """The traced and scheduled step for `state` and `batch`, without running it: a
        `CompiledStep` (its `graph_module`, `events`, bytes per step, `explain()`).

        Local to this rank: no collective runs and nothing is cached. `state` and `batch` may
        hold fake tensors or tensors on the meta device (for planning a step that does not fit
        here); only their shapes and dtypes are read.
        """
        if not self.schedule.trace:
            raise StepError("lower() traces the step: it needs a schedule with trace=True")
        sharded = state.params
        scalars = self.optimizer.scalars(state.opt_state)
        return self._jit.lower(sharded.layout, sharded.shards, self._rest(state, scalars), batch)

    @property
    def cache(self) -> dict:
        """Traced steps by `CacheKey` (`CompiledStep`s: graph, schedule, bytes), least recently used first."""
        return {key: steps[-1] for key, steps in self._jit.cache.items()}

    @property
    def traces(self) -> int:
        """How many graphs this step has traced (a graph traced again after eviction counts again)."""
        return self._jit.traces

    @property
    def schedule_events(self) -> list:
        """The schedule of the most recently run traced step, as `fs.schedule.ScheduleEvent`s."""
        return list(self._last().events)

    def explain(self, program: str = "step") -> str:
        """The schedule of the most recently run traced step (`program="step"`) or evaluation
        (`"evaluate"`), as a readable table."""
        return self._last(program).explain()

    def graph_inputs(self, state: StepState, batch: Any) -> list:
        """The flat list of tensors the traced step's graph takes for `state` and `batch`
        (`last_traced().graph_module(*step.graph_inputs(state, batch))` runs one step's graph
        by hand, e.g. to profile it). Local: no collective."""
        sharded = state.params
        return self._jit.graph_inputs(sharded.layout, sharded.shards, self._rest(state, self.optimizer.scalars(state.opt_state)), batch)

    def last_traced(self, program: str = "step"):
        """The `CompiledStep` most recently run by the step (`"step"`) or by `evaluate` (`"evaluate"`):
        its graph, schedule `events`, bytes per call."""
        return self._last(program)

    def _last(self, program: str = "step"):
        if program not in ("step", "evaluate"):
            raise ValueError(f"program must be 'step' or 'evaluate'; got {program!r}")
        jit = self._jit if program == "step" else self._eval_jit
        if jit.last is None:
            raise StepError(f"no traced {program} has run yet: call it once (schedule.trace must be True)")
        return jit.last

