"""`Mesh`: the mesh contract (`_basemesh.BaseMesh`) over torch.distributed, `init_mesh`, `shutdown`.

Every collective here works on flat, contiguous 1-D tensors and is written as torch's functional
collectives (`torch.ops._c10d_functional.*` followed by `wait_tensor`), so traced graphs hold them
as nodes. Process groups per axis come from torch's `DeviceMesh`. What the axis names mean is
`_basemesh`'s.
"""

from __future__ import annotations

import collections
import datetime
import os
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - see below
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._agreement import Agreement, digest as _digest  # noqa: F401 - _digest: _jit reads it here
from ._heartbeat import stop_heartbeats
from ._basemesh import (  # noqa: F401 - re-exported: the mesh's public home
    AXIS_NAMES,
    DATA_PARALLEL_AXES,
    MODEL_PARALLEL_AXES,
    OPERATIONS,
    BaseMesh,
    _check_axes,
    _check_product,
    _coordinates,
    _shard_axis_of,
)
from ._failures import MeshError, PeerError
from ._loopback import gloo_on_loopback
from ._parent import die_with_torchrun_agent
from ._tracing import record

__all__ = ["BaseMesh", "Mesh", "init_mesh", "shutdown", "MeshError", "PeerError"]

_C10D = torch.ops._c10d_functional
# `torch.distributed.nn.functional` is imported above, before any process group exists: its
# functions' defaults (`group=group.WORLD`) are evaluated when it is first imported, which a
# `torch.func.grad` through a collective does, and would keep that default group (its gloo
# threads and listening socket) alive after `destroy_process_group()`, to interpreter shutdown.


class Mesh(BaseMesh):
    """A named mesh of ranks over `torch.distributed`, built on `DeviceMesh`. Make one with `init_mesh`.

    Attributes:
        axis_names / axis_sizes / shape: the mesh's axes.
        rank / world_size: this process in the world.
        shard_axis: the axis parameters are sharded over; the other axes replicate them.
        device: where this rank's tensors live (`cpu`, or `cuda:<local rank>` with NCCL).
        device_mesh: the underlying `torch.distributed.device_mesh.DeviceMesh`.
    """

    def __init__(
        self,
        device_mesh: DeviceMesh,
        *,
        shard_axis: str | None = None,
        split_groups: bool = False,
        timeout: float | None = None,
    ):
        names = device_mesh.mesh_dim_names
        assert names is not None, "the DeviceMesh must have named dimensions"
        # A DeviceMesh keeps its process groups alive (a registry for torch.compile). Weakly
        # here: then `destroy_process_group()` ends the groups, their gloo threads and their
        # listening socket at once, whoever calls it, instead of at interpreter shutdown, where
        # a gloo thread releasing its last collective aborts the process (docs/launching.md).
        device_mesh._pg_registry = weakref.WeakValueDictionary(device_mesh._pg_registry)
        self.device_mesh = device_mesh
        self.axis_names = tuple(names)
        self.axis_sizes = tuple(device_mesh.mesh.shape)
        self.shard_axis = _shard_axis_of(self.axis_names, shard_axis)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device_mesh.device_type, torch.cuda.current_device()) if device_mesh.device_type == "cuda" else torch.device("cpu")
        self._group_names = {a: device_mesh.get_group(a).group_name for a in self.axis_names}
        self._gloo = dist.get_backend() == "gloo"
        self._world_group_name = dist.group.WORLD.group_name
        # All-gathers on one group, reduce-scatters and all-reduces on another: on gloo each
        # group has its own context and worker threads, so a unit's reduce-scatter can be in
        # flight while the next unit's all-gather is, one collective per group at a time.
        # Opt-in (split_groups=True): a 20,000-step soak with two in flight passed once and
        # crashed once (SIGSEGV in a rank, not a hang), so one group and one collective in
        # flight stay the default on gloo.
        self._gather_group_names = dict(self._group_names)
        self._reduce_group_names = dict(self._group_names)
        if self._gloo:
            self.max_collectives_in_flight = 1
            self.max_collectives_in_flight_per_group = 1
            if split_groups:
                self._gather_group_names = _new_axis_groups(device_mesh, self.axis_names)
                self._reduce_group_names = _new_axis_groups(device_mesh, self.axis_names)
        # Pipeline transfers on a process group of their own: point-to-point operations count in
        # a group's sequence numbers, which the agreement's heartbeat compares across ranks, and
        # a middle stage posts twice the transfers of an end stage — not a missing collective.
        self.p2p_group = dist.new_group() if dict(zip(self.axis_names, self.axis_sizes)).get("pp", 1) > 1 else None
        # The ranks' agreement before each collective operation, on the store (`_agreement`);
        # None for a world of one. `_entered` counts this mesh's operations, for its messages.
        names = {*self._group_names.values(), *self._gather_group_names.values(), *self._reduce_group_names.values()}
        groups = [dist.distributed_c10d._resolve_process_group(name) for name in sorted(names)]
        self._agreement = Agreement.of_world(groups, timeout)
        self._entered: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> "Mesh":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After an error, no barrier: the peers may be waiting for this rank in another collective.
        shutdown(barrier=exc_type is None)

    def _all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        if self.shard_axis is None:
            return shard.clone()  # nothing is sharded: the full buffer is the shard (a buffer of its own)
        record("all_gather")
        return _C10D.wait_tensor(
            _C10D.all_gather_into_tensor(shard, self.num_shards, self._gather_group_names[self.shard_axis])
        )

    def _reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
        if self.shard_axis is None:
            return full.clone()
        group = self._reduce_group_names[self.shard_axis]
        record("reduce_scatter")
        if not self._gloo:
            return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(full, "sum", self.num_shards, group))
        # gloo's reduce-scatter (torch 2.13) all-reduces the whole buffer and keeps a slice:
        # twice the bytes a reduce-scatter needs, and as slow as an all-reduce. An all-to-all
        # sends each slice straight to the rank that keeps it, which sums the ranks' slices in
        # rank order (the same order on every run and in every schedule).
        # One shard: the slice is the buffer itself (no local sum, which would also turn -0.0
        # into +0.0), so a world of one rank's traced step is left with no pass at all here.
        splits = [full.numel() // self.num_shards] * self.num_shards
        parts = _C10D.wait_tensor(_C10D.all_to_all_single(full, splits, splits, group))
        return parts if self.num_shards == 1 else parts.view(self.num_shards, -1).sum(0)

    def _all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        axes = self.axis_names if axes is None else axes
        if set(axes) == set(self.axis_names) and len(self.axis_names) > 1:
            record("all_reduce")
            return _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._world_group_name))
        for axis in axes:
            record("all_reduce")
            x = _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._reduce_group_names[axis]))
        return x

    def _all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.world_size, self._world_group_name))

    # Collectives over one named axis (tensor parallelism: fs.tensor_parallel moves a tensor
    # dimension onto dimension 0 around them). Flat, contiguous 1-D tensors, as above.
    def _all_gather_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[n] on every rank -> [size * n]: the pieces of the ranks along `axis`, in axis order."""
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.shape[axis], self._gather_group_names[axis]))

    def _reduce_scatter_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [n]: the sum over the ranks along `axis`; this rank keeps slice
        `coordinates[axis]`. On gloo an all-to-all plus a rank-order sum, as `reduce_scatter_flat`."""
        size, group = self.shape[axis], self._reduce_group_names[axis]
        record("reduce_scatter")
        if not self._gloo:
            return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(x, "sum", size, group))
        splits = [x.numel() // size] * size
        parts = _C10D.wait_tensor(_C10D.all_to_all_single(x, splits, splits, group))
        return parts if size == 1 else parts.view(size, -1).sum(0)

    def _all_to_all_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """`BaseMesh.all_to_all_axis_flat`: recorded as the reduce-scatter it is part of."""
        size = self.shape[axis]
        record("reduce_scatter")
        splits = [x.numel() // size] * size
        return _C10D.wait_tensor(_C10D.all_to_all_single(x, splits, splits, self._reduce_group_names[axis]))

    # The collectives take tensors where the backend wants them: NCCL only moves CUDA tensors,
    # and the library's small exchanges (agreement, layout digests, metrics) are made on the
    # CPU. A tensor on another device than the mesh's goes there and its result comes back; the
    # step's own buffers are already on the mesh's device and pass straight through.
    def _moved(self, op, x: torch.Tensor, *args) -> torch.Tensor:
        if x.device == self.device or self._gloo:
            return op(x, *args)
        return op(x.to(self.device), *args).to(x.device)

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        return self._moved(self._all_gather_flat, shard)

    def reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
        return self._moved(self._reduce_scatter_flat, full)

    def all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        return self._moved(self._all_reduce_flat, x, axes)

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        return self._moved(self._all_gather_world, x)

    def all_gather_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[n] on every rank -> [size * n]: the pieces of the ranks along `axis`, in axis order."""
        return self._moved(self._all_gather_axis_flat, x, axis)

    def reduce_scatter_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [n]: the sum over the ranks along `axis`; this rank keeps slice
        `coordinates[axis]`. On gloo an all-to-all plus a rank-order sum, as `reduce_scatter_flat`."""
        return self._moved(self._reduce_scatter_axis_flat, x, axis)

    def all_to_all_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """`BaseMesh.all_to_all_axis_flat`: recorded as the reduce-scatter it is part of."""
        return self._moved(self._all_to_all_axis_flat, x, axis)

    def agree(self, operation: str, value: int = 0) -> list[int]:
        """`BaseMesh.agree`, kept on the rendezvous store before any collective (`_agreement`):
        ranks in different operations, a rank that issued a collective of its own (say one
        extra `all_reduce`) and a rank that exited are named within seconds, never paired."""
        if self._agreement is None:
            return super().agree(operation, value)
        self._entered[operation] += 1
        return self._agreement.enter(operation, value, self._entered[operation], self.all_gather_world, self.describe())


def _new_axis_groups(device_mesh: DeviceMesh, axis_names: Sequence[str]) -> dict[str, str]:
    """A new process group per axis for this rank (every rank creates every group, in the same
    order, as `new_group` requires): axis name -> group name."""
    mine = {}
    ranks = device_mesh.mesh
    for dim, axis in enumerate(axis_names):
        rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        for row in rows:
            group = dist.new_group(row)
            if dist.get_rank() in row:
                mine[axis] = group.group_name
    return mine


def init_mesh(
    axes: dict[str, int],
    *,
    shard_axis: str | None = None,
    backend: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    split_groups: bool = False,
) -> Mesh:
    """Join (or create) the default process group and name its ranks' axes.

    Arguments:
        axes: axis name -> size, in row-major order; their product must equal the world size.
            `{"fsdp": N}` shards over all N ranks; `{"replicate": R, "fsdp": S}` shards over S
            ranks and replicates over R (hybrid sharding).
        shard_axis: the axis to shard over (default `"fsdp"`, else the last axis).
        backend: `"nccl"` when CUDA is available, else `"gloo"` (default).
        timeout: seconds (or a timedelta) a collective may wait for the other ranks before it
            raises; a rank that dies thus never leaves the others hanging forever. Default 600 s.
        split_groups: gloo only, experimental: all-gathers and reduce-scatters on process groups
            of their own (their own gloo contexts and threads), so that a schedule may keep one
            of each in flight (set `mesh.max_collectives_in_flight = 2`). Off by default: see
            docs/benchmarks.md for the soak that has not yet proved it.

    Works under `torchrun` and `fs.launch` (both set `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    `MASTER_PORT`, `LOCAL_RANK`), and in a process whose default group already exists (then
    `backend` and `timeout` are those of that group). A single process with none of these
    variables becomes a world of one, on an in-memory store (no rendezvous server, no port),
    and `os.environ` is left as it was.

    Use it as a context manager (`with fs.init_mesh(...) as mesh:`) to leave the process group
    at the end (`fs.shutdown()`); that ends the default group even if another part of the
    program created it.
    """
    names, sizes = _check_axes(axes)
    if isinstance(timeout, (int, float)):
        timeout = datetime.timedelta(seconds=timeout)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_torchrun_agent()
    created = not dist.is_initialized()
    world = (int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else 1) if created else dist.get_world_size()
    _check_product(names, sizes, world)
    with gloo_on_loopback(world):
        if created:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            timeout = timeout or datetime.timedelta(seconds=600)
            if world > 1:
                dist.init_process_group(backend, timeout=timeout)
            else:
                # A world of one needs no rendezvous: an in-memory store, no port.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        device_mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names)
        seconds = timeout.total_seconds() if created else None
        return Mesh(device_mesh, shard_axis=shard_axis, split_groups=split_groups, timeout=seconds)


def shutdown(*, barrier: bool = True) -> None:
    """Leave the default process group: agree, a barrier, then `destroy_process_group`.

    First every rank states that it is shutting down, as every collective operation of the
    library does (`Mesh.agree`): a rank that shuts down while another is still in a step (one
    step more on one rank) makes both raise `MeshError` within seconds, naming each rank and what
    it is in, instead of pairing the barrier with the step's collectives until the collective
    timeout. The barrier then makes every rank's last collective complete before any rank tears
    its group down. Call it at the end of a script run by `torchrun` (or use the mesh as a
    context manager); `fs.launch` calls it for you. Safe to call twice, or with no group. The
    group is destroyed whatever happens.

    Arguments:
        barrier: agree and wait for the other ranks first (default). Pass False after an error:
            the peers may be blocked in another collective and never come.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier and dist.get_world_size() > 1:
            agreement = Agreement.of_world(heartbeat=False)
            if agreement is not None:
                world = dist.group.WORLD
                where = "world of the default process group"
                agreement.enter("fs.shutdown", 0, 0, lambda x: _gather_world(x, world), where)
            dist.barrier()
            if agreement is not None:
                stop_heartbeats()  # before its key goes: none may publish it again
                agreement.leave()
    finally:
        stop_heartbeats()
        dist.destroy_process_group()


def _gather_world(x: torch.Tensor, group) -> torch.Tensor:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else x.device
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype, device=device)
    dist.all_gather_into_tensor(out, x.to(device), group=group)
    return out.to(x.device)

