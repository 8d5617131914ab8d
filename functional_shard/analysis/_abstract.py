"""Planning a step for a mesh that does not exist: `AbstractMesh`, `abstract_state`, `plan`.

A step is traced with fake tensors (`make_fx(tracing_mode="fake")`), and the fake kernels of
torch's functional collectives (`torch.ops._c10d_functional.*`) compute output shapes from the
group *size* argument alone: they never look the group *name* up (verified on torch 2.13 with
a name no process group has). So a mesh that issues those ops with the right sizes and any
name traces the same graph a real mesh of that size would, in one process, with no process
group at all. With parameters on the meta device nothing is allocated: a 7B model on 1024
ranks is planned on a laptop.

The abstract mesh plays one rank of a symmetric world (rank 0 by default): every rank of an
FSDP step runs the same graph, up to the shapes of its batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._mesh import BaseMesh, _check_axes, _shard_axis_of
from .._make_step import sharded_step
from .._step import ShardedStep, StepState
from .._tracing import record
from ..schedule._axes import abstract_group_name
from ._analyze import Analysis, analyze

__all__ = ["AbstractMesh", "abstract_state", "plan"]

_C10D = torch.ops._c10d_functional


class AbstractMesh(BaseMesh):
    """A mesh of any shape that exists only to trace and analyze steps (`step.lower`).

    Its collectives issue the same `_c10d_functional` ops as `fs.Mesh` on NCCL
    (`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`, then `wait_tensor`), with
    the group sizes of the mesh and group names that no process group holds: fake and meta
    tensors go through them (output shapes only); a real tensor raises, since there are no
    other ranks to talk to. A group's name says which axis it spans and the mesh's shape,
    `"abstract:<axis>:<name>=<size>,..."` (`<axis>` is `world` for every axis at once), so the
    analysis reads from the graph alone which axis each collective runs on and how its ranks
    lie (`functional_shard.schedule._axes`).

    Arguments:
        axes: axis name -> size, row-major, e.g. `{"fsdp": 1024}`, `{"replicate": 8, "fsdp": 128}`
            or `{"fsdp": 64, "tp": 8}`; the names mean what they mean for `fs.init_mesh`
            (`replicate`, `fsdp`, `tp`, `pp`, `cp`), and an unknown name is refused.
        rank: which rank this mesh plays (its coordinates pick its shard and its pieces; default 0).
        shard_axis: the axis parameters are sharded over (default `"fsdp"`, else none).
    """

    abstract = True

    def __init__(self, axes: dict[str, int], *, rank: int = 0, shard_axis: str | None = None):
        self.axis_names, self.axis_sizes = _check_axes(axes)
        self.world_size = math.prod(self.axis_sizes)
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"AbstractMesh rank {rank!r} is outside the world of {self.world_size} ranks of {axes}")
        self.rank = rank
        self.shard_axis = _shard_axis_of(self.axis_names, shard_axis)
        self.device = torch.device("meta")

    def _group(self, axis: str) -> str:
        return abstract_group_name(axis, self.shape)

    def _check(self, x: torch.Tensor, what: str) -> None:
        if not (x.is_meta or isinstance(x, torch._subclasses.fake_tensor.FakeTensor)):
            raise RuntimeError(
                f"{self!r} cannot run {what} on a real tensor (shape {list(x.shape)}): it has no other ranks. "
                f"Use it to trace and analyze a step (step.lower with meta tensors, fs.analysis.plan), and "
                f"fs.init_mesh to run one"
            )

    def _axis(self, axis: str) -> int:
        if axis not in self.axis_names:
            raise ValueError(f"{self!r} has no axis {axis!r}: name one of {list(self.axis_names)}")
        return self.shape[axis]

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        self._check(shard, "an all-gather")
        if self.shard_axis is None:
            return shard.clone()
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(shard, self.num_shards, self._group(self.shard_axis)))

    def reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
        self._check(full, "a reduce-scatter")
        if self.shard_axis is None:
            return full.clone()
        record("reduce_scatter")
        return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(full, "sum", self.num_shards, self._group(self.shard_axis)))

    def all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        self._check(x, "an all-reduce")
        axes = self.axis_names if axes is None else axes
        if set(axes) == set(self.axis_names) and len(self.axis_names) > 1:
            record("all_reduce")
            return _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._group("world")))
        for axis in axes:
            self._axis(axis)
            record("all_reduce")
            x = _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._group(axis)))
        return x

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, "an all-gather of the world")
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.world_size, self._group("world")))

    # Collectives over one named axis (tensor parallelism), as `fs.Mesh` issues them on NCCL.
    def all_gather_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[n] on every rank -> [size * n]: the pieces of the ranks along `axis`, in axis order."""
        self._check(x, f"an all-gather over {axis!r}")
        size = self._axis(axis)
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, size, self._group(axis)))

    def reduce_scatter_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [n]: the sum over the ranks along `axis`; this rank keeps slice `coordinates[axis]`."""
        self._check(x, f"a reduce-scatter over {axis!r}")
        size = self._axis(axis)
        record("reduce_scatter")
        return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(x, "sum", size, self._group(axis)))

    def all_to_all_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [size * n]: slice `j` to the rank at coordinate `j` of `axis`."""
        self._check(x, f"an all-to-all over {axis!r}")
        size = self._axis(axis)
        record("reduce_scatter")
        splits = [x.numel() // size] * size
        return _C10D.wait_tensor(_C10D.all_to_all_single(x, splits, splits, self._group(axis)))


def abstract_state(step: ShardedStep, params: Any) -> StepState:
    """A `StepState` for `step` whose shards and optimizer state are meta tensors: shapes and
    dtypes only, nothing allocated, no collective (for `step.lower` and `fs.analysis.analyze`).

    Arguments:
        step: a step made on an `AbstractMesh` (or any mesh: nothing is communicated).
        params: the parameter pytree, typically on the meta device (a model built under
            `torch.device("meta")`, then `fs.functionalize`); only shapes and dtypes are read.

    The state cannot be run (its tensors hold no values); `step.init` is the way to a real one.
    """
    return step.init_abstract(params)


def plan(
    loss_fn,
    params: Any,
    batch: Any,
    *,
    mesh: BaseMesh,
    optimizer,
    schedule=None,
    units=None,
    has_aux: bool = False,
    donate: bool = False,
    precision=None,
    placements=None,
    microbatches: int = 1,
    canonical_chunks: int | None = None,
) -> tuple[Analysis, Any]:
    """Trace and analyze one step of `loss_fn` on `mesh` without running it: `(analysis, compiled)`.

    Arguments:
        loss_fn / optimizer / schedule / units / has_aux / donate / precision / placements: as
            for `fs.sharded_step` (`placements`: the tensor-parallel rules, required when the
            mesh has a `tp` axis of size > 1; `loss_fn` then runs on this rank's pieces, e.g. a
            model `fs.tensor_parallel.parallelize`d on the same abstract mesh).
        microbatches / canonical_chunks: as for `fs.sharded_step` (micro-batches; a
            layout-invariant step, planned with its chunks as micro-batches).
        params: the FULL parameter pytree, on the meta device or real (only shapes and dtypes
            are read; each leaf is cut to this rank's piece as `step.init` cuts it).
        batch: one rank's batch, meta tensors (e.g. `torch.empty(b, s, dtype=torch.long, device="meta")`).
        mesh: usually an `AbstractMesh` of the size to plan for, e.g. `AbstractMesh({"fsdp": 64, "tp": 8})`.

    Returns the `Analysis` (FLOPs, collective bytes per axis, peak memory per rank:
    `analysis.fits(bytes)`) and the `CompiledStep` it was read from.
    """
    step = sharded_step(
        loss_fn, mesh, optimizer=optimizer, schedule=schedule, units=units, has_aux=has_aux, donate=donate,
        precision=precision, placements=placements, microbatches=microbatches, canonical_chunks=canonical_chunks,
    )
    compiled = step.lower(abstract_state(step, params), batch)
    return analyze(compiled), compiled
