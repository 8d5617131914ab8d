"""Meshes: named axes of ranks, and the three collectives the library is built from.

A mesh names the axes of the world's ranks, e.g. `{"fsdp": 4}` or `{"replicate": 2, "fsdp": 4}`.
Parameters are sharded over one axis (the *shard axis*: `"fsdp"` if present, else the last one)
and replicated over the others (hybrid sharding). Every collective here works on flat,
contiguous 1-D tensors and is written as torch's functional collectives
(`torch.ops._c10d_functional.*` followed by `wait_tensor`), so traced graphs hold them as nodes.

`SimulatedMesh` (`_simulated.py`) has the same interface for ranks that are threads of one process.
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

from ._agreement import Agreement, digest as _digest, stop_heartbeats
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

# The collective operations of the library, by the names `BaseMesh.agree` reports.
OPERATIONS = (
    "a training step",
    "step.init",
    "step.grad",
    "step.evaluate",
    "fs.export",
    "fs.checkpoint.save",
    "fs.checkpoint.load",
    "fs.checkpoint.load_full",
    "fs.checkpoint.load_dcp",
    "fs.checkpoint.save_dcp",
    "fs.analysis.autotune",
    "fs.data.DataParallelSampler",
    "fs.shutdown",
)


# What each axis name means: one thing each. The data-parallel axes split the batch (`fsdp`
# shards the parameters over its ranks, `replicate` keeps a copy on each); the model-parallel axes
# split the model (`tp`: tensors, `fs.tensor_parallel`; `pp`: stages, `fs.pipeline`; `cp`: the
# sequence), and their ranks see the same samples. A name outside these is refused, never
# treated as a replica axis.
DATA_PARALLEL_AXES = ("replicate", "fsdp")
MODEL_PARALLEL_AXES = ("tp", "pp", "cp")
AXIS_NAMES = DATA_PARALLEL_AXES + MODEL_PARALLEL_AXES


def _check_axes(axes: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not isinstance(axes, dict) or not axes:
        raise ValueError(f"mesh axes must be a non-empty dict name -> size, e.g. {{'fsdp': 2}}; got {axes!r}")
    unknown = [name for name in axes if name not in AXIS_NAMES]
    if unknown:
        raise ValueError(
            f"unknown mesh axis name {unknown[0]!r} in {axes!r}: each axis name means one thing, and fs knows "
            f"'replicate' (data parallel, parameters replicated), 'fsdp' (data parallel, parameters sharded), "
            f"'tp' (tensor parallel), 'pp' (pipeline stages) and 'cp' (context parallel); rename it to the one "
            f"you mean"
        )
    for name, size in axes.items():
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name!r} must map a str to a positive int; got size {size!r} in {axes!r}")
    return tuple(axes), tuple(axes.values())


def _shard_axis_of(names: Sequence[str], shard_axis: str | None) -> str:
    if shard_axis is None:
        return "fsdp" if "fsdp" in names else names[-1]
    if shard_axis not in names:
        raise ValueError(f"shard_axis {shard_axis!r} is not one of the mesh axes {list(names)}")
    return shard_axis


class BaseMesh:
    """What every mesh offers: names, sizes, this rank's coordinates, and flat collectives.

    The contract a mesh fulfils for the library (`Mesh` over torch.distributed, `SimulatedMesh`
    over threads): subclass it and implement `all_gather_flat`, `reduce_scatter_flat`,
    `all_reduce_flat` and `all_gather_world`, each issuing its collective on every rank in
    the same order (SPMD), and set the attributes below.

    Attributes:
        axis_names / axis_sizes: the axes, in row-major order.
        rank / world_size: this rank in the world.
        shard_axis: the axis parameters are sharded over; the others replicate them.
        supports_tracing: whether a step on this mesh can be traced.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    rank: int
    world_size: int
    shard_axis: str
    # Whether a step on this mesh can be traced (make_fx patches module globals while it
    # traces, so thread-ranks of a simulated mesh cannot trace at the same time).
    supports_tracing: bool = True
    # The most collectives the backend may have issued and not yet waited at once (None: no
    # limit), in all and on any one process group; `fs.schedule.limit_in_flight` reads both.
    # gloo: one per group (two on one group deadlocked, rarely), and `Mesh` gives all-gathers
    # and reduce-scatters groups of their own.
    max_collectives_in_flight: int | None = None
    max_collectives_in_flight_per_group: int | None = None

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(zip(self.axis_names, self.axis_sizes))

    @property
    def num_shards(self) -> int:
        """Size of the shard axis: into how many slices each parameter buffer is cut."""
        return self.shape[self.shard_axis]

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along every axis (row-major over `axis_names`)."""
        return _coordinates(self, self.rank)

    @property
    def shard_index(self) -> int:
        """Which slice of each buffer this rank keeps: its coordinate on the shard axis."""
        return self.coordinates[self.shard_axis]

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axis_names if a != self.shard_axis)

    def check_data_parallel(self, what: str) -> None:
        """Raises `MeshError` if an axis of this mesh splits the model (`tp`, `pp`, `cp` of size > 1):
        `what` (e.g. `fs.sharded_step`) shards parameters over `fsdp` and replicates them over the
        other axes, which would treat such an axis as a silent replica."""
        split = [f"{a!r} (size {n})" for a, n in zip(self.axis_names, self.axis_sizes) if a in MODEL_PARALLEL_AXES and n > 1]
        if split:
            raise MeshError(
                f"{what} does not apply the model-parallel axis {split[0]} of the {self.describe()} yet: it would "
                f"replicate the parameters over it and average the gradients, which is data parallelism, not what "
                f"the axis asks for. Use a mesh of 'replicate' and 'fsdp' axes for {what}; fs.tensor_parallel's "
                f"collectives and fs.pipeline's schedules work on such axes on their own (docs/parallelism.md)"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.shape}, shard_axis={self.shard_axis!r}, rank={self.rank})"

    def describe(self) -> str:
        return f"mesh {self.shape} (shard axis {self.shard_axis!r}) at rank {self.rank} of {self.world_size}"

    # Collectives on flat contiguous tensors. Subclasses implement the three primitives.
    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """[shard_numel] on every rank -> [num_shards * shard_numel], concatenated in shard order."""
        raise NotImplementedError

    def reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
        """[num_shards * n] -> [n]: sum over the shard axis, this rank keeps its slice."""
        raise NotImplementedError

    def all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        """Sum of `x` over the ranks along `axes` (default: every axis). No-op for no axes."""
        raise NotImplementedError

    def succeed_together(self, operation: str, error: BaseException | None, failure) -> None:
        """Every rank states whether its part of `operation` succeeded: raise this rank's own
        `error`, or `failure(ranks that failed)` when only others failed, so that no rank goes
        on alone. A collective.

        Arguments:
            operation: the operation's name, as given to `agree`.
            error: this rank's exception, or None.
            failure: `list of failed ranks -> exception` raised on the ranks that succeeded.
        """
        flags = self.agree(operation, 0 if error is not None else 1)
        if error is not None:
            raise error
        failed = [r for r, ok in enumerate(flags) if not ok]
        if failed:
            raise failure(failed)

    def check_same(self, what: str, value: str) -> None:
        """Raise `MeshError` on every rank unless every rank passes the same `value`.

        `value` is hashed to 63 bits and all-gathered; the message names the ranks that differ."""
        mine = torch.tensor([_digest(value)], dtype=torch.int64)
        everyone = self.all_gather_world(mine).tolist()
        if len(set(everyone)) > 1:
            groups: dict[int, list[int]] = {}
            for rank, h in enumerate(everyone):
                groups.setdefault(h, []).append(rank)
            parts = "; ".join(f"ranks {ranks}" for ranks in groups.values())
            raise MeshError(
                f"ranks disagree on {what}: {parts} hold different values. Every rank of the "
                f"{self.describe()} must pass the same structure, shapes and dtypes (this rank's: {value[:400]})"
            )

    def check_same_sequence(self, what: str, items: list[str]) -> None:
        """Raise `MeshError` on every rank unless every rank passes the same list of items; the
        message names the first position where they differ and what each rank has there."""
        try:
            self.check_same(what, "\n".join(items))
            return
        except MeshError:
            pass
        # They differ: exchange the lists themselves to say where.
        data = torch.tensor(list("\n".join(items).encode()), dtype=torch.uint8)
        lengths = self.all_gather_world(torch.tensor([data.numel()], dtype=torch.int64)).tolist()
        padded = torch.zeros(max(lengths) or 1, dtype=torch.uint8)
        padded[: data.numel()] = data
        everyone = self.all_gather_world(padded).view(self.world_size, -1)
        lists = [bytes(everyone[r, : lengths[r]].tolist()).decode().split("\n") for r in range(self.world_size)]
        index = next(
            i
            for i in range(max(len(x) for x in lists) + 1)
            if len({x[i] if i < len(x) else "<nothing>" for x in lists}) > 1
        )
        differences = {r: x[index] if index < len(x) else "<nothing>" for r, x in enumerate(lists)}
        per_rank = "; ".join(f"rank {r}: {item}" for r, item in differences.items())
        raise MeshError(
            f"ranks disagree on {what}: the first difference is at position {index}: {per_rank}. Every rank must "
            f"run the same collectives in the same order (does the model's structure depend on the rank?)",
            differences,
        )

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        """[n] on every rank -> [world_size * n] in rank order (all axes)."""
        raise NotImplementedError

    def agree(self, operation: str, value: int = 0) -> list[int]:
        """Every rank states which collective operation it is entering and an int; returns
        every rank's int, in rank order.

        The library's collective entry points (a step, `init`, `grad`, `fs.export`, checkpoints)
        call it first: ranks that entered different operations (say rank 0 `fs.export`, rank 1
        its next step) meet in this one small all-gather instead of pairing one's collectives
        with the other's, and raise `MeshError` on every rank, naming what each rank called.
        """
        if self.world_size == 1:
            return [value]  # no one to disagree with (and no collective to pair wrongly)
        everyone = self.all_gather_world(torch.tensor([_digest(operation), value], dtype=torch.int64))
        codes, values = everyone.view(self.world_size, 2).t().tolist()
        if len(set(codes)) > 1:
            names = {_digest(name): name for name in (*OPERATIONS, operation)}
            doing = "; ".join(f"rank {r}: {names.get(c, 'an unknown operation')}" for r, c in enumerate(codes))
            raise MeshError(
                f"ranks entered different collective operations ({doing}). Every rank of the {self.describe()} "
                f"must call the same collective operations in the same order: call it on every rank"
            )
        return values


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

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        record("all_gather")
        return _C10D.wait_tensor(
            _C10D.all_gather_into_tensor(shard, self.num_shards, self._gather_group_names[self.shard_axis])
        )

    def reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
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

    def all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        axes = self.axis_names if axes is None else axes
        if set(axes) == set(self.axis_names) and len(self.axis_names) > 1:
            record("all_reduce")
            return _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._world_group_name))
        for axis in axes:
            record("all_reduce")
            x = _C10D.wait_tensor(_C10D.all_reduce(x, "sum", self._reduce_group_names[axis]))
        return x

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.world_size, self._world_group_name))

    # Collectives over one named axis (tensor parallelism: fs.tensor_parallel moves a tensor
    # dimension onto dimension 0 around them). Flat, contiguous 1-D tensors, as above.
    def all_gather_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[n] on every rank -> [size * n]: the pieces of the ranks along `axis`, in axis order."""
        record("all_gather")
        return _C10D.wait_tensor(_C10D.all_gather_into_tensor(x, self.shape[axis], self._gather_group_names[axis]))

    def reduce_scatter_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [n]: the sum over the ranks along `axis`; this rank keeps slice
        `coordinates[axis]`. On gloo an all-to-all plus a rank-order sum, as `reduce_scatter_flat`."""
        size, group = self.shape[axis], self._reduce_group_names[axis]
        record("reduce_scatter")
        if not self._gloo:
            return _C10D.wait_tensor(_C10D.reduce_scatter_tensor(x, "sum", size, group))
        splits = [x.numel() // size] * size
        parts = _C10D.wait_tensor(_C10D.all_to_all_single(x, splits, splits, group))
        return parts if size == 1 else parts.view(size, -1).sum(0)

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
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _check_product(names, sizes, world: int) -> None:
    product = 1
    for s in sizes:
        product *= s
    if product != world:
        raise ValueError(
            f"mesh axes {dict(zip(names, sizes))} hold {product} ranks but the world has {world}: "
            f"the product of the axis sizes must equal the world size"
        )


def _coordinates(mesh: BaseMesh, rank: int) -> dict[str, int]:
    """`rank`'s index along every axis of `mesh` (row-major, the last axis varies fastest)."""
    out, rest = {}, rank
    for name, size in reversed(list(zip(mesh.axis_names, mesh.axis_sizes))):
        out[name] = rest % size
        rest //= size
    return {name: out[name] for name in mesh.axis_names}
