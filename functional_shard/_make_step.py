"""`sharded_step`: which step object a configuration makes — a `ShardedStep` (`_step.py`), or on a
mesh with a `pp` axis a `PipelineStep` (`_pipe_step.py`) — and the defaults it fills in."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ._mesh import BaseMesh, MeshError
from ._nonfinite import NonFinite
from ._pipe_step import PipelineStep
from ._reference import StepError
from ._step import ShardedStep
from ._units import Units
from .optim import Optimizer, as_optimizer
from .pipeline import Pipeline
from .precision import Precision
from .schedule import Schedule

__all__ = ["sharded_step"]


def _default_schedule(canonical_chunks: int | None) -> Schedule:
    """`Schedule()`; a layout-invariant step's chunks share each gathered unit instead (gathered
    once per step: one pass of all-gathers, not one per chunk and again in its backward)."""
    if canonical_chunks is None:
        return Schedule()
    return Schedule(reshard_after_forward=False, reshard_after_backward=False)



def sharded_step(
    loss_fn: Callable[..., Any],
    mesh: BaseMesh,
    /,
    *,
    optimizer: Optimizer,
    schedule: Schedule | None = None,
    units: Units = None,
    has_aux: bool = False,
    donate: bool = False,
    max_traces: int = 8,
    precision: Precision | None = None,
    microbatches: int = 1,
    nonfinite: NonFinite | str | None = None,
    placements: Any = None,
    canonical_chunks: int | None = None,
    pipeline: Any = None,
) -> ShardedStep:
    """Make a fully sharded (FSDP / ZeRO-3) training step for `loss_fn`.

    Arguments:
        loss_fn: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with `has_aux=True`), a pure
            function of the full (unsharded) parameter pytree and this rank's batch; `loss` a
            0-d floating tensor. Gradients are the mean over ranks of each rank's gradient.
        mesh: from `fs.init_mesh`; parameters are sharded over its shard axis.
        optimizer: an `fs.optim` optimizer, e.g. `fs.optim.adamw(lr=1e-3)`.
        schedule: an `fs.Schedule` (default: traced, prefetch 1, reshard after forward).
        units: how parameters are grouped into units, one flat buffer (hence one collective)
            each: an `fs.UnitPolicy` or a function `path -> unit name`. Default
            `fs.BlockUnits()`: one per repeated block, `input` and `output` for the leaves
            before and after the blocks.
        has_aux: `loss_fn` returns `(loss, aux)`; `aux` comes back in `metrics["aux"]`.
        donate: the step may update the state's parameter shards and optimizer state in place
            (as FSDP and `torch.optim` do) instead of copying them: about 12 bytes per
            parameter and rank less peak memory. The state passed in is then used up: a
            step, `evaluate`, `grad`, `fs.export` or `fs.checkpoint.save` given it raises.
            An error before the update (in `loss_fn`, say) still leaves it untouched;
            without donation no error can touch it.
        max_traces: traced graphs kept (one per batch signature: shapes, dtypes, static
            values); past it the least recently used is dropped and a warning names what in
            the batch keeps changing (pad or bucket variable lengths to a few sizes).
        precision: mixed precision (`fs.Precision`): the dtype units are gathered and
            computed in, the dtype gradients are reduced in, loss scaling for fp16.
        microbatches: split each batch along its leading dimension into this many
            micro-batches, run one after the other within the step (one micro-batch's
            activations alive at a time), and accumulate their gradients as the schedule's
            `accumulate` says. The loss is the mean over micro-batches (or weighted).
        nonfinite: what to do with a step whose gradient is not finite (a NaN or an Inf in
            any rank's batch or gradient; `metrics["grad_norm"]` not finite): an
            `fs.NonFinite` or its value. `"skip"` (the default): keep the state as it was
            (parameters, module buffers, optimizer state) on every rank, set
            `metrics["skipped"]` and warn; `"raise"` (the default with `donate=True`, which
            cannot keep the old state): `fs.NonFiniteError` on every rank; `"apply"`: apply
            it anyway. fp16 loss scaling always skips (see `fs.LossScale`).
        placements: with a `tp` axis in the mesh, the tensor-parallel placement rules of the
            leaves (`fs.tensor_parallel.hf_rules(model)`, `gpt_rules(config)`, rules of your own,
            or a dict pattern -> `Split`/`Replicated`; first match wins): `init` cuts each leaf
            by its placement and FSDP shards the pieces over `fsdp`; `loss_fn` receives this
            rank's pieces and applies the tensor-parallel collectives (`fs.tensor_parallel`:
            `parallelize(model, rules, mesh)` does it for a module). Required with `tp` > 1.
        canonical_chunks: make training bitwise independent of the data-parallel layout
            (docs/reproducibility.md): the global batch is cut into this many chunks `G`, each
            computed alone (data-parallel rank `r` of `D` runs chunks `r*G/D ... (r+1)*G/D - 1`
            as its micro-batches), their gradients and losses added in one fixed tree, the
            gradient norm summed per canonical block, dropout drawn per chunk. `D` must be a
            power of two dividing `G`; gradients accumulate in full and are reduced once per
            step (whatever the schedule's `accumulate`); without a `schedule`, each unit is
            gathered once per step and shared by the chunks (`Schedule(reshard_after_forward=
            False, reshard_after_backward=False)`; pass `schedule=fs.Schedule()` to gather per
            chunk with less memory). None (default): off.

    `loss_fn` may return `fs.WeightedLoss(loss, weight)` (e.g. its count of non-ignored
    tokens) to weigh ranks and micro-batches: the step then trains on the weighted mean,
    exactly like single-process training on the concatenated batch.

        pipeline: with a `pp` axis in the mesh, how to run it: an `fs.pipeline.Pipeline` (or a
            built-in schedule's name, "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv");
            default "1f1b" on a mesh with `pp` > 1. `microbatches` is the pipeline's M. The
            units are cut into `pp x stages_per_rank` stages, `loss_fn` is traced and cut
            with them, and the schedule is proved by `fs.pipeline.check` before anything is
            sent (docs/pipelining.md). Returns a `PipelineStep`.

    Returns a `ShardedStep`: `state = step.init(params)`, then `state, metrics = step(state, batch)`.
    """
    if isinstance(loss_fn, torch.nn.Module):
        raise TypeError(
            f"sharded_step takes loss_fn(params, batch) -> loss, a function; got the module {type(loss_fn).__name__}: "
            "write apply_fn, params = fs.functionalize(model) and a loss_fn that calls apply_fn(params, ...)"
        )
    if not isinstance(mesh, BaseMesh):
        raise TypeError(
            f"sharded_step's mesh must be a mesh made by fs.init_mesh({{...}}) (or fs.analysis.AbstractMesh to plan); "
            f"got {type(mesh).__name__} {mesh!r:.60}"
        )
    if pipeline is not None or mesh.shape.get("pp", 1) > 1:
        return _pipeline_step(loss_fn, mesh, optimizer, schedule, units, has_aux, donate, precision, microbatches,
                              nonfinite, placements, canonical_chunks, pipeline)  # fmt: skip
    return ShardedStep(
        loss_fn,
        mesh,
        optimizer=optimizer,
        schedule=schedule if schedule is not None else _default_schedule(canonical_chunks),
        units=units,
        has_aux=has_aux,
        donate=donate,
        max_traces=max_traces,
        precision=precision,
        microbatches=microbatches,
        nonfinite=nonfinite,
        placements=placements,
        canonical_chunks=canonical_chunks,
    )


def _pipeline_step(loss_fn, mesh, optimizer, schedule, units, has_aux, donate, precision, microbatches, nonfinite,
                   placements, canonical_chunks, pipeline):  # fmt: skip
    if mesh.shape.get("pp", 1) < 1 or "pp" not in mesh.shape:
        raise MeshError(f"pipeline= needs a 'pp' axis in the mesh; the {mesh.describe()} has none")
    if schedule is not None and (not isinstance(schedule, Schedule) or dataclasses.replace(schedule, trace=True, remat=False, compile=False) != Schedule()):
        raise StepError(
            "a pipelined step takes fs.Schedule(), fs.Schedule(trace=False) (the oracle: every transfer waited where "
            f"its action stands), remat= and compile=; its other fields do not apply to a pipeline yet; got {schedule!r}"
        )
    if pipeline is None:
        pipeline = Pipeline()
    elif isinstance(pipeline, str):
        pipeline = Pipeline(pipeline)
    elif not isinstance(pipeline, Pipeline):
        raise TypeError(f"pipeline= takes an fs.pipeline.Pipeline or a schedule's name; got {type(pipeline).__name__}")
    return PipelineStep(loss_fn, mesh, optimizer=as_optimizer(optimizer), pipeline=pipeline, microbatches=microbatches,
                        trace=schedule is None or schedule.trace, remat=False if schedule is None else schedule.remat,
                        compile=schedule is not None and schedule.compile, canonical_chunks=canonical_chunks, units=units, has_aux=has_aux, donate=donate,
                        precision=precision, nonfinite=nonfinite, placements=placements)  # fmt: skip
