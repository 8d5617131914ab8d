"""`PipelineStep`: `fs.sharded_step` on a mesh with a `pp` axis.

Each pipeline rank holds the units of its stages (FSDP shards them over `fsdp` among the ranks
of the same pipeline coordinate, tensor parallelism cuts them over `tp`); `loss_fn` is traced once
per micro-batch signature and cut into stage programs (`_stages`); the schedule — a value of
`fs.pipeline`, lowered with its transfers and FSDP actions and proved by `fs.pipeline.check`
before any rank sends anything — is walked action by action (`_pipe_run`). Then, on every rank:

    mean gradient = (summed gradient over micro-batches and data-parallel ranks) / count
                    (count = M x data ranks, or the global sum of weights of an fs.WeightedLoss)
    grad_norm     = sqrt(sum over the pipeline's stages of their sums of squares)
    shards, opt   = optimizer(mean gradient, ...)               (clipping sees the global norm)

which is the non-pipelined step's arithmetic with the micro-batches' gradients added in
micro-batch order (`fs.pipeline.check(...).accumulation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from . import _canonical, _nonfinite, _random
from ._checks import check_leaves, check_same_values
from ._jit import agree
from ._layout import leaves_in_use, make_layout
from ._mesh import BaseMesh, Mesh, MeshError, PeerError
from ._pipe_aux import aux_of
from ._pipe_figures import StageFigures
from ._pipe_mean import mean_of
from ._pipe_run import PointToPoint, run_actions
from ._pipe_saved import Recorder
from ._placed import CheckedLoss, place, resolve_placements
from ._pytree import tree_flatten, tree_map, tree_paths
from .initialize import shard_from
from ._microbatches import split_microbatches
from ._reference import StepError, StepOutput
from ._shard import Sharded, _check_shards, shard_leaves
from ._stage_assign import assign_stages
from ._stage_remat import StageRemat
from ._stages import Cut, cut_stages
from ._state import StepState, _StepKey, check_is_state, check_not_donated, check_seed
from ._tree import BUFFER, FROZEN, TRAINABLE, ModuleParams
from .optim import LeafLayout, global_norm
from .pipeline import Action, Pipeline, PipelineSchedule, ScheduleError, build_schedule, check, with_communication
from .pipeline._runnable import check_metas, check_runnable
from .pipeline import explain as pipeline_explain
from .pipeline._actions import ActionKind
from .pipeline._peaks import stage_peak_bytes
from .schedule._remat import RematPolicy

__all__ = ["PipelineStep", "PipelineProfile"]


class PipelineStep(StageFigures):
    """A pipelined (and sharded) training step; made by `fs.sharded_step(..., pipeline=...)` on a
    mesh with a `pp` axis. `init(params)`, `step(state, batch)`, `evaluate(state, batch)`,
    `explain()`, as `ShardedStep`'s."""

    def __init__(self, loss_fn: Callable, mesh: BaseMesh, *, optimizer, pipeline: Pipeline, microbatches: int,
                 trace: bool, remat: Any = False, compile: bool = False, canonical_chunks: int | None = None, units, has_aux: bool, donate: bool, precision, nonfinite, placements):  # fmt: skip
        self.loss_scale = precision.loss_scale if precision is not None else None  # an fs.LossScale (fp16), or None
        if not mesh.abstract and not isinstance(mesh, Mesh):
            raise MeshError(
                f"the model-parallel axis 'pp' (size {mesh.shape['pp']}) of the {mesh.describe()} needs point-to-point "
                f"transfers between processes, which a {type(mesh).__name__} (ranks as threads) has none of: run the "
                f"pipeline on fs.init_mesh (fs.launch, fs.testing.LocalWorld, torchrun), or plan it on an "
                f"fs.analysis.AbstractMesh"
            )
        split = [a for a in mesh.model_axes if a not in ("tp", "pp")]
        if split:
            raise MeshError(f"fs.sharded_step does not apply the model-parallel axis {split[0]!r} of the {mesh.describe()}")
        if "tp" in mesh.model_axes and placements is None:
            raise MeshError(f"the {mesh.describe()} has a 'tp' axis but no placements= were given (docs/parallelism.md)")
        self.loss_fn, self.mesh, self.optimizer = CheckedLoss(loss_fn), mesh, optimizer
        self.canonical = _canonical.resolve(canonical_chunks, mesh, microbatches)  # ValueError: not invariant here
        if self.canonical is not None:
            microbatches = self.canonical.per_rank
            if getattr(mesh, "device", torch.device("cpu")).type != "cpu":
                raise StepError("canonical_chunks with a pipeline carries the CPU generator's state between stages: CPU meshes only for now")
        self.pipeline, self.microbatches, self.trace = pipeline, microbatches, trace
        if remat is not False and not (remat is True or isinstance(remat, (tuple, RematPolicy)) or callable(remat)):
            raise StepError(
                f"a pipelined step rematerializes whole stages (remat=True, a tuple of unit names or a function "
                f"unit -> bool: a stage is recomputed if any of its units is chosen) or, under a RematPolicy, each "
                f"chosen unit on its own; got {remat!r}"
            )
        if isinstance(remat, RematPolicy) and compile:
            raise StepError("a pipelined step's RematPolicy runs each stage node by node: not with compile=True")
        self.remat, self.compile, self.has_aux = remat, compile, has_aux
        self._remat_stages: frozenset = frozenset()
        self.units, self.donate, self.precision, self.placements = units, donate, precision, placements
        self.nonfinite = _nonfinite.resolve(nonfinite, donate=donate, loss_scale=self.loss_scale)
        self.num_ranks = mesh.shape["pp"]
        self.pp_rank = mesh.coordinates["pp"]
        base = build_schedule(pipeline, self.num_ranks, microbatches)
        if base.num_ranks != self.num_ranks or base.num_microbatches != microbatches:
            raise ScheduleError(
                f"the pipeline schedule {base.name!r} is for {base.num_ranks} pipeline rank(s) and {base.num_microbatches} "
                f"micro-batch(es), but the mesh has pp={self.num_ranks} and the step microbatches={microbatches}"
            )
        lowered = base if base.has_communication() or any(not a.is_compute for r in base.actions for a in r) else (
            with_communication(base, fsdp=True, reduce_grad=True))  # fmt: skip
        sends = "nonblocking" if trace else "rendezvous"
        self.check = check(lowered, sends=sends, num_ranks=self.num_ranks, num_microbatches=microbatches)
        if self.canonical is not None and any(tuple(a) != tuple(range(microbatches)) for a in self.check.accumulation):
            raise ScheduleError(
                f"canonical_chunks adds each stage's chunk gradients in chunk order; the schedule {base.name!r} backs them "
                f"out in the order {self.check.accumulation}: use a built-in or reorder its B/W actions"
            )
        if compile:
            _check_compile(base, trace, self.canonical)
        if not self.check.backward:
            raise ScheduleError(f"the pipeline schedule {base.name!r} has no backward actions: a training step needs them")
        check_runnable(lowered, training=True)
        self.schedule: PipelineSchedule = lowered
        self.num_stages = lowered.num_stages
        forward = PipelineSchedule(tuple(tuple(a for a in row if a.kind.value == "F") for row in base.compute_only().actions),
                                   microbatches, base.stages_per_rank, base.placement, name=f"{base.name} (forward)")  # fmt: skip
        self.eval_schedule = with_communication(forward, fsdp=True, reduce_grad=False)
        input_dtype = precision.input_dtype() if precision is not None else None
        self._input_dtype = input_dtype
        self._cuts: dict[str, Cut] = {}
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        self._key = _StepKey(f"{name} at 0x{id(self):x} on {mesh!r} (pipeline {base.name})")
        self._facts = (f"pipeline {base.name}: {self.schedule.to_text()}", f"microbatches={microbatches}", f"trace={trace}",
                       f"compile={compile}")

    def __repr__(self) -> str:
        return f"PipelineStep({self._key.description})"

    # --- init -----------------------------------------------------------------------------

    def init(self, params: Any, *, seed: int = 0, values: str = "check", initialize: Any = None) -> StepState:
        """Cut `params` into stages, keep this rank's stages' units (sharded over `fsdp`, cut over
        `tp`), build the optimizer state. A collective; see `ShardedStep.init`."""
        if values not in ("check", "trust"):
            raise ValueError(f"a pipelined step's init(values=...) is 'check' or 'trust'; got {values!r}")
        check_seed(seed)
        error = None
        try:
            full_layout, leaves = make_layout(params, 1, units=self.units)
            check_leaves(full_layout, leaves, self.mesh, meta_ok=initialize is not None or self.mesh.abstract)
            paths, roles = full_layout.paths, full_layout.roles
            unit_names = {paths[i]: spec.unit for spec in full_layout.buffers for i in spec.leaves}
            # units in the order of use (a frozen embedding still first)
            order = list(dict.fromkeys(unit_names[paths[i]] for i in leaves_in_use(params) if roles[i] != BUFFER))
            stage_of_unit = assign_stages(order, self.num_stages, self.pipeline.stages)
            mine = set(self.schedule.stages_of(self.pp_rank))
            parts: dict[str, dict] = {TRAINABLE: {}, FROZEN: {}, BUFFER: {}}
            for path, role, leaf in zip(paths, roles, leaves):
                if role == BUFFER or stage_of_unit[unit_names[path]] in mine:
                    parts[role][path] = leaf
            names = {*parts[TRAINABLE], *parts[FROZEN], *parts[BUFFER]}
            extra = {}
            if isinstance(params, ModuleParams):  # tied names (export), non-persistent buffers, BatchNorm leaves
                extra = dict(
                    aliases=tuple((a, n) for a, n in params.aliases if n in names),
                    non_persistent=tuple(n for n in params.non_persistent if n in names),
                    batch_norm=tuple(n for n in params.batch_norm if n in names),
                    order=tuple(n for n in params.order if n in names),
                )
            sub = ModuleParams(parts[TRAINABLE], parts[FROZEN], parts[BUFFER], **extra)
            unit_of = lambda path: unit_names[path]  # noqa: E731 - the full tree's units
            # Placements are resolved on the whole tree (a rule may name another stage's leaves), then read per leaf.
            meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), params)
            every = resolve_placements(meta, self.placements, self.mesh)
            self.loss_fn.place(meta, self.placements, every, self.mesh)
            by_path = dict(zip(paths, every)) if every is not None else {}
            placements = tuple(by_path.get(p) for p in tree_paths(sub)) if every is not None else None
            with torch.no_grad():
                if placements is None:
                    layout, pieces = make_layout(sub, self.mesh.num_shards, units=unit_of, precision=self.precision,
                                                 blocks=self._blocks)  # fmt: skip
                else:
                    layout, pieces = place(sub, placements, self.mesh, units=unit_of, precision=self.precision,
                                           blocks=self._blocks)  # fmt: skip
                # What every stage program takes (the pieces' shapes, the gather dtypes), from the meta copy;
                # and the whole model's trainable buffers, in order: a layout-invariant norm adds them in it.
                computed = place(meta, every, self.mesh, units=self.units, precision=self.precision)[0]
                self._model_buffers = [b.name for b in computed.buffers if b.trainable]
        except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
            error = e
        self._together("step.init", error, "refused their parameters or pipeline cut in step.init")
        if values == "check" and initialize is None and not self.mesh.abstract:
            check_same_values(full_layout, [leaf.detach() for leaf in leaves], self.mesh)
        # What every stage program takes: per leaf of the full tree, its stage, its computed shape and dtype.
        index_of = {p: i for i, p in enumerate(layout.paths)}
        self._leaf_index = {i: index_of[p] for i, p in enumerate(paths) if p in index_of}
        self._stage_of_leaf = [None if r == BUFFER else stage_of_unit[unit_names[p]] for p, r in zip(paths, roles)]
        self._units, position = tuple(order), {u: k for k, u in enumerate(order)}  # what a cut search cuts (fs.analysis)
        self._unit_of_leaf = [None if r == BUFFER else position[unit_names[p]] for p, r in zip(paths, roles)]
        gather = {i: spec.gather_dtype for spec in computed.buffers for i in spec.leaves}
        shapes, dtypes = computed.shapes, [gather.get(i, leaf.dtype) for i, leaf in enumerate(leaves)]
        self._treedef = tree_flatten(params)[1]
        self._meta = [torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes)]
        chosen = (lambda u: True) if self.remat is True else (lambda u: False) if self.remat is False or isinstance(self.remat, RematPolicy) else (
            (lambda u: u in self.remat) if isinstance(self.remat, tuple) else self.remat)  # fmt: skip
        self._remat_stages = frozenset(s for u, s in stage_of_unit.items() if chosen(u))
        with torch.no_grad():
            if initialize is not None:  # this rank's stages' leaves, made one at a time
                sub_full = make_layout(sub, self.mesh.num_shards, units=unit_of, precision=self.precision, blocks=self._blocks)
                sharded = shard_from(initialize.for_part(full_layout), layout, sub_full[1], self.mesh, full_layout=sub_full[0])
            else:
                sharded = shard_leaves(layout, [p.detach() for p in pieces], self.mesh)
            trainable = {spec.name: s for spec, s in zip(layout.buffers, sharded.shards) if spec.trainable}
            opt_state = self.optimizer.init(trainable, leaves=self._leaf_layout(layout))
        scale = self.loss_scale.init() if self.loss_scale is not None else None
        return StepState(sharded, opt_state, scale, torch.tensor(seed, dtype=torch.int64), 0, self._key)

    @property
    def _blocks(self) -> int:
        return self.canonical.chunks if self.canonical is not None else 0

    def _leaf_layout(self, layout) -> LeafLayout:
        """What the optimizer reads of this rank's buffers; with canonical_chunks, where they stand
        among the whole model's (in the optimizer's order: sorted names) for a layout-invariant norm."""
        leaves = LeafLayout.of_shards(layout, self.mesh.shard_index)
        if self.canonical is None:
            return leaves
        ordered = sorted(self._model_buffers)
        mine = sorted(spec.name for spec in layout.buffers if spec.trainable)
        return dataclasses.replace(leaves, positions=tuple(ordered.index(n) for n in mine), count=len(ordered))

    def init_abstract(self, params: Any) -> StepState:
        """A state of meta tensors (nothing allocated, no collective) for planning on a mesh that
        need not exist (`fs.analysis.AbstractMesh`): `fs.analysis.plan_pipeline(step, state, batch)`.

        Arguments:
            params: the full parameter tree, typically on the meta device."""
        meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), params)
        if not self.mesh.abstract:
            raise StepError("init_abstract plans on an fs.analysis.AbstractMesh; on a real mesh call init(params)")
        return self.init(meta, values="trust")

    # --- the step -------------------------------------------------------------------------

    def _micro(self, batch: Any) -> list[list[torch.Tensor]]:
        micro = split_microbatches(batch, self.microbatches, self._input_dtype)
        return micro

    def _cut(self, micro: Any) -> Cut:
        leaves = tree_flatten(micro)[0]
        signature = ";".join(f"{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor) else repr(t) for t in leaves)
        cut = self._cuts.get(signature)
        if cut is None:
            error = None
            try:
                cut = cut_stages(self.loss_fn, self._treedef, self._meta, self._stage_of_leaf, micro, self.num_stages, self.mesh,
                                 has_aux=self.has_aux)  # fmt: skip
                check_metas(self.schedule, self.pp_rank, cut.stages)
            except Exception as e:  # noqa: BLE001
                error = e
            self._together("a training step", error, "could not trace and cut loss_fn into pipeline stages")
            if not self.mesh.abstract:
                self.mesh.check_same("the pipeline's stage cut", cut.describe())
            if self.canonical is not None and list(cut.random_stages) != sorted(cut.random_stages):
                raise StepError(
                    f"canonical_chunks carries each chunk's random stream from stage to stage, which needs loss_fn's random "
                    f"operations in stage order; here they come from stages {list(cut.random_stages)} in the order loss_fn "
                    f"draws them. Cut the stages elsewhere (Pipeline(stages=...)) or draw in order"
                )
            if self.canonical is not None:  # the canonical tree sums each micro-batch's gradients whole
                cut = cut.relaying()
            if isinstance(self.remat, RematPolicy):  # each chosen unit's activations recomputed in its backward
                last = self.num_stages - 1
                remats = [StageRemat(p.module, [self._unit_of_leaf[i] for i in p.params], self._units, self.remat, p.index == last)
                          for p in cut.stages]  # fmt: skip
                cut = cut._replace(stages=tuple(p._replace(call=r.run, remat=r) for p, r in zip(cut.stages, remats)))
            if self.compile:  # each stage's forward (and, through AOTAutograd, its backward) fused by inductor
                cut = cut._replace(stages=tuple(p._replace(call=torch.compile(p.module, backend="inductor", fullgraph=True, dynamic=False))
                                                for p in cut.stages))  # fmt: skip
            self._cuts[signature] = cut
        return cut

    def _run(self, state: StepState, batch: Any, recorder: Recorder | None = None, forward_only: bool = False,
             count: int | None = None):  # fmt: skip
        """This rank's actions on `batch` (the step's schedule, or with `forward_only` its forward
        actions in GPipe's order over `count` micro-batches, no autograd graph): (cut, RunResult)."""
        sharded = state.params
        operation = "step.evaluate" if forward_only else "a training step"
        error, micro = None, None
        count = self.microbatches if count is None else count
        try:
            micro = split_microbatches(batch, count, self._input_dtype)
        except StepError as e:
            error = e
        self._together(operation, error, "refused their batch")
        # an evaluation's count follows its batch's rows: ranks with other rows would run other schedules
        counted = (f"step.evaluate cuts the batch into {count} micro-batches (the ranks' batches must have rows that cut alike)",)
        agree(self.mesh, operation, (*self._facts, *(counted if forward_only else ())) if self.mesh.world_size > 1 else ())
        cut = self._cut(micro[0])
        flat = [tree_flatten(m)[0] for m in micro]
        local = {i: sharded.local[k] for k, i in enumerate(_local_full(self._leaf_index, sharded.layout))}
        schedule = self._eval_schedule(count) if forward_only else self.schedule
        seed = state.loss_scale.scale if state.loss_scale is not None and not forward_only else None
        with self._random_stream(state), torch.set_grad_enabled(not forward_only):
            result = run_actions(schedule, schedule.actions[self.pp_rank], cut, sharded.layout, sharded.shards, local,
                                 self._leaf_index, flat, self.mesh, PointToPoint(self.mesh, self.trace),
                                 backward=not forward_only, recorder=recorder, remat=self._remat_stages,
                                 canonical=self.canonical, seed=seed)  # fmt: skip
        return cut, result

    def __call__(self, state: StepState, batch: Any) -> tuple[StepState, dict[str, Any]]:
        """One training step on this rank's batch (every pipeline rank of a data-parallel rank
        passes the same batch). Returns `(new_state, metrics)` as `ShardedStep` does."""
        self._check_state(state)
        sharded = state.params
        scalars = self.optimizer.scalars(state.opt_state)
        cut, result = self._run(state, batch)
        with torch.no_grad():
            out = self._update(cut, result, sharded, state, scalars)
        if self.donate:
            self._key.donated.add(state)
        skip = _nonfinite.skip_update(self.nonfinite, out, step=state.step, rank=self.mesh.rank, loss_scale=self.loss_scale,
                                      donated=self.donate)  # fmt: skip
        params = sharded if skip else sharded.replace(shards=out.shards)
        opt_state = state.opt_state if skip else out.opt_state
        new_state = StepState(params, opt_state, out.loss_scale, state.rng, state.step + 1, self._key)
        metrics = {"loss": out.mean_loss, "local_loss": out.loss, "grad_norm": out.grad_norm, "skipped": torch.tensor(skip)}
        if state.loss_scale is not None:
            metrics["loss_scale"] = state.loss_scale.scale  # the scale this step used
        return new_state, self._aux(metrics, cut, result)

    def grad(self, state: StepState, batch: Any) -> tuple[Sharded, dict[str, Any]]:
        """The mean gradient this step would apply, without applying it: `(grads, metrics)`;
        `grads` has the layout of `state.params` (this rank's stages; frozen leaves and module
        buffers hold zeros). A collective, like the step."""
        self._check_state(state, "step.grad(state, batch)")
        sharded = state.params
        cut, result = self._run(state, batch)
        with torch.no_grad():
            mean_loss, loss, grads = self._mean(cut, result, state.loss_scale)
        shards = [grads.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        out = sharded.replace(shards=shards, local=[torch.zeros_like(t) for t in sharded.local])
        return out, self._aux({"loss": mean_loss, "local_loss": loss}, cut, result)

    def _mean(self, cut: Cut, result, loss_scale=None, count: int | None = None):
        """(mean loss over everything, this rank's loss, mean gradient shards by buffer name) over
        `count` micro-batches (default: the step's): `_pipe_mean`."""
        return mean_of(cut, result, self.mesh, self.microbatches if count is None else count, self.canonical, loss_scale)

    def _update(self, cut: Cut, result, sharded: Sharded, state: StepState, scalars) -> StepOutput:
        layout, mesh = sharded.layout, self.mesh
        mean_loss, loss, grads = self._mean(cut, result, state.loss_scale)
        trainable = {spec.name: s for spec, s in zip(layout.buffers, sharded.shards) if spec.trainable}
        whole = layout.replicated_buffers
        replicated = [name in whole for name in grads] if whole else None
        if self.canonical is not None:  # per canonical block, every buffer in the whole model's order
            blocks = layout.blocks // layout.num_shards
            positions = ([self._model_buffers.index(n) for n in grads], len(self._model_buffers))
            norm = global_norm(list(grads.values()), mesh, replicated=replicated, blocks=blocks, positions=positions)
        elif grads:
            norm = global_norm(list(grads.values()), mesh, replicated=replicated)
        else:  # a rank with no trainable leaf still takes part in the norm's all-reduce
            norm = global_norm([torch.zeros(1)], mesh)
        new, opt_state = self.optimizer.apply(grads, state.opt_state, trainable, scalars, inplace=self.donate, mesh=mesh,
                                              leaves=self._leaf_layout(layout))  # fmt: skip
        shards = [new.get(spec.name, s) for spec, s in zip(layout.buffers, sharded.shards)]
        # the norm is all-reduced: every rank reads the same verdict (the scale backs off or grows)
        scale = self.loss_scale.next(state.loss_scale, torch.isfinite(norm)) if self.loss_scale is not None else None
        return StepOutput(shards, sharded.local, opt_state, scale, mean_loss, loss, norm, None, ())

    def evaluate(self, state: StepState, batch: Any) -> dict[str, Any]:
        """The loss on `batch` without training: the forward actions of the schedule (GPipe's
        order), every stage gathered once. Returns `loss` (mean over data ranks) and `local_loss`."""
        self._check_state(state, "step.evaluate(state, batch)")
        count = self._eval_count(batch)
        cut, result = self._run(state, batch, forward_only=True, count=count)
        with torch.no_grad():
            mean = self._mean(cut, result, count=count)[0].reshape(())
        return self._aux({"loss": mean, "local_loss": mean}, cut, result, count)

    def _eval_count(self, batch: Any) -> int:
        """The micro-batches an evaluation cuts `batch` into: the step's, or, for a batch they do
        not divide (a short last batch), the most, up to the step's, that cut its rows into equal
        parts. The loss is the mean of the micro-batches' losses (weighted with `fs.WeightedLoss`:
        then the whole batch's weighted mean exactly; a plain mean over padded tokens is not)."""
        if self.canonical is not None:
            return self.microbatches
        rows = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(rows) != 1 or next(iter(rows)) == 0:
            return self.microbatches  # split_microbatches says what is wrong
        (n,) = rows
        return max(d for d in range(1, self.microbatches + 1) if n % d == 0)

    def _eval_schedule(self, count: int) -> PipelineSchedule:
        """The forward actions for `count` micro-batches: the step's (GPipe's order) for its own
        count, else each rank's stages in order, each over the micro-batches in order."""
        if count == self.microbatches:
            return self.eval_schedule
        rows = tuple(tuple(Action.parse(f"{s}F{m}") for s in sorted(self.schedule.stages_of(r)) for m in range(count))
                     for r in range(self.num_ranks))  # fmt: skip
        forward = PipelineSchedule(rows, count, self.schedule.stages_per_rank, self.schedule.placement,
                                   name=f"{self.schedule.name} (forward, {count} micro-batches)")  # fmt: skip
        return with_communication(forward, fsdp=True, reduce_grad=False)

    def _aux(self, metrics: dict, cut: Cut, result, count: int | None = None) -> dict:
        """`metrics` with `aux` (has_aux=True) on every pipeline rank (`_pipe_aux`). A collective."""
        if self.has_aux:
            last = self.schedule.rank_of(self.num_stages - 1)
            metrics["aux"] = aux_of(cut, result.losses, self.mesh, last, self.microbatches if count is None else count)
        return metrics

    def profile(self, state: StepState, batch: Any) -> "PipelineProfile":
        """Run the step's actions on `batch` once (no update: as `grad`), timing each action and
        measuring the activations each stage holds, against the prediction. A collective.

        The measured in-flight bytes are the storages autograd saves for each micro-batch's
        backward, added at its F and released at its B (or W; from an I to its W, the saved
        storages still alive and the gradients kept for W); the predicted ones walk the schedule
        (`fs.pipeline.peak_in_flight(schedule)` times the bytes one forward of the stage saves,
        without I/W) at the bytes computed on fake tensors (no memory)."""
        self._check_state(state, "step.profile(state, batch)")
        recorder = Recorder()
        cut, _ = self._run(state, batch, recorder)
        held = None
        if any(a.kind is ActionKind.I for row in self.schedule.actions for a in row):
            sizes = self.split_bytes_per_microbatch(cut, batch)  # one fake forward per stage for both figures
            per_mb = {s: saved for s, (saved, _) in sizes.items()}
            held = [per_mb[s] if s in self._remat_stages else sizes[s][1] for s in range(self.num_stages)]
        else:
            per_mb = self.saved_per_microbatch(cut, batch)
        predicted = stage_peak_bytes(self.schedule, [per_mb[s] for s in range(self.num_stages)], held)
        mine = self.schedule.stages_of(self.pp_rank)
        compute = sum(e - b for a, b, e in recorder.events if Action.parse(a).is_compute)
        return PipelineProfile(
            self.pp_rank, tuple(recorder.events), compute, dict(recorder.peak_count), dict(recorder.peak),
            {s: predicted[s] for s in mine}, {s: per_mb[s] for s in mine},
        )

    # --- what fs.analysis reads (plan_pipeline, tune_pipeline): local, no collective --------

    def stage_cut(self, state: StepState, batch: Any) -> Cut:
        """The stage programs for `batch`'s micro-batch signature (traced now if new; when new, a
        collective: the ranks compare their cuts)."""
        self._check_state(state, "step.stage_cut(state, batch)")
        return self._cut(self._micro(batch)[0])

    def explain(self) -> str:
        """The lowered schedule rank by rank, its grid and bubble at unit costs (F = 1, B = 2), and
        the stage cut of the most recent micro-batch signature (nodes, parameters, what crosses)."""
        lines = [self.schedule.to_text(), "", pipeline_explain(self.schedule.compute_only())]
        if self._cuts:
            lines += ["", next(reversed(self._cuts.values())).describe()]
        return "\n".join(lines)

    def _together(self, operation: str, error: BaseException | None, what: str) -> None:
        """Every rank learns whether any failed `operation` (its own error, or `PeerError` naming
        the ranks that did); on an abstract mesh, with no ranks to tell, the error alone."""
        if self.mesh.abstract:
            if error is not None:
                raise error
            return
        self.mesh.succeed_together(operation, error, lambda failed: PeerError(
            f"ranks {failed} {what} (see their errors)", failed[0]))  # fmt: skip

    def _random_stream(self, state: StepState):
        """The step's random stream: per data-parallel rank and step (every pipeline rank of a data
        rank alike), or, with canonical_chunks, reseeded per chunk (`_random.reseed`)."""
        rank = None if self.canonical is not None else self.mesh.data_rank
        return _random.stream(int(state.rng), state.step, rank, getattr(self.mesh, "device", torch.device("cpu")))

    def _check_state(self, state: StepState, what: str = "step(state, batch)") -> None:
        check_is_state(state, what)
        if state._key is not self._key:
            raise StepError(f"this state was made by another step ({state._key.description}); this step is {self._key.description}")
        check_not_donated(state, what)
        _check_shards(state.params)


def _check_compile(schedule: PipelineSchedule, trace: bool, canonical) -> None:
    """compile=True's conditions, before anything runs."""
    if not trace:
        raise StepError("compile=True with trace=False: the untraced pipeline is the oracle and runs every stage eagerly")
    if canonical is not None:
        raise StepError("compile=True with canonical_chunks: inductor's kernels do not give the layout-invariant bits")
    split = next((a for row in schedule.actions for a in row if a.kind in (ActionKind.I, ActionKind.W)), None)
    if split is not None:
        raise StepError(
            f"compile=True with the pipeline schedule {schedule.name!r}, which splits a backward into I and W ({split}): "
            f"a compiled stage's backward is one compiled function that cannot be split; use a schedule with whole "
            f"backwards (gpipe, 1f1b, interleaved_1f1b) or compile=False"
        )


def _local_full(leaf_index: dict[int, int], layout) -> list[int]:
    """Full-tree indices of the layout's local leaves (module buffers), in `layout.local` order."""
    back = {v: k for k, v in leaf_index.items()}
    return [back[i] for i in layout.local]


class PipelineProfile(NamedTuple):
    """One profiled pipelined step on this rank (`PipelineStep.profile`)."""

    rank: int  # the pipeline rank
    events: tuple[tuple[str, int, int], ...]  # (action, start ns, end ns), time.perf_counter_ns (one clock per machine)
    compute_ns: int  # time in F/B/I/W actions (waits for received tensors left out)
    in_flight_peak: dict  # stage -> most micro-batches forwarded and not yet through B/W, measured
    in_flight_bytes: dict  # stage -> most bytes of saved activations held at once, measured
    predicted_bytes: dict  # stage -> the same, predicted: the schedule walked at bytes per micro-batch (fake tensors)
    saved_per_microbatch: dict  # stage -> bytes one micro-batch's forward saves, predicted on fake tensors
