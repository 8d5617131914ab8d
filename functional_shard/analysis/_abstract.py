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

from .._mesh import BaseMesh, _shard_axis_of
from .._step import ShardedStep, StepState, sharded_step
from .._tracing import record
from ._analyze import Analysis, analyze

__all__ = ["AbstractMesh", "abstract_state", "plan"]

_C10D = torch.ops._c10d_functional


class AbstractMesh(BaseMesh):
    """A mesh of any shape that exists only to trace and analyze steps (`step.lower`).

    Its flat collectives issue the same `_c10d_functional` ops as `fs.Mesh` on NCCL
    (`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_reduce`, then `wait_tensor`), with
    the group sizes of the mesh and group names `"abstract:<axis>"` that no process group
    holds: fake and meta tensors go through them (output shapes only); a real tensor raises,
    since there are no other ranks to talk to.

    Arguments:
        axes: axis name -> size, e.g. `{"fsdp": 1024}` or `{"replicate": 8, "fsdp": 128}`.
        rank: which rank this mesh plays (its coordinates pick its shard; default 0).
        shard_axis: the axis parameters are sharded over (default `"fsdp"`, else none).
    """

    def __init__(self, axes: dict[str, int], *, rank: int = 0, shard_axis: str | None = None):
        if not isinstance(axes, dict) or not axes:
            raise ValueError(f"AbstractMesh axes must be a non-empty dict name -> size, e.g. {{'fsdp': 1024}}; got {axes!r}")
        for name, size in axes.items():
            if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"AbstractMesh axis {name!r} must map a str to a positive int; got {size!r} in {axes!r}")
        self.axis_names = tuple(axes)
        self.axis_sizes = tuple(axes.values())
        self.world_size = math.prod(self.axis_sizes)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"AbstractMesh rank {rank} is outside the world of {self.world_size} ranks of {axes}")
        self.rank = rank
        self.shard_axis = _shard_axis_of(self.axis_names, shard_axis)
        self.device = torch.device("meta")

    def _group(self, axis: str) -> str:
        return f"abstract:{axis}"

    def _check(self, x: torch.Tensor, what: str) -> None:
        if not (x.is_meta or isinstance(x, torch._subclasses.fake_tensor.FakeTensor)):
            raise RuntimeError(
                f"{self!r} cannot run {what} on a real tensor (shape {list(x.shape)}): it has no other ranks. "
                f"Use it to trace and analyze a step (step.lower with meta tensors, fs.analysis.plan), and "
                f"fs.init_mesh to run one"
            )

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
            record("all_reduce")
            x = _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._group(axis)))
        return x

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x, "an all-gather of the world")
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.world_size, self._group("world")))


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
) -> tuple[Analysis, Any]:
    """Trace and analyze one step of `loss_fn` on `mesh` without running it: `(analysis, compiled)`.

    Arguments:
        loss_fn / optimizer / schedule / units / has_aux / donate / precision: as for `fs.sharded_step`.
        params: the parameter pytree, on the meta device or real (only shapes and dtypes are read).
        batch: one rank's batch, meta tensors (e.g. `torch.empty(b, s, dtype=torch.long, device="meta")`).
        mesh: usually an `AbstractMesh` of the size to plan for.

    Returns the `Analysis` (FLOPs, collective bytes, peak memory per rank: `analysis.fits(bytes)`)
    and the `CompiledStep` it was read from.
    """
    step = sharded_step(
        loss_fn, mesh, optimizer=optimizer, schedule=schedule, units=units, has_aux=has_aux, donate=donate, precision=precision
    )
    compiled = step.lower(abstract_state(step, params), batch)
    return analyze(compiled), compiled
