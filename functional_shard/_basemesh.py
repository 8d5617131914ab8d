"""The mesh contract: named axes of ranks, what each axis name means, and `BaseMesh`.

A mesh names the axes of the world's ranks, row-major, e.g. `{"fsdp": 4}`,
`{"replicate": 2, "fsdp": 4}` or `{"fsdp": 2, "tp": 2}`. Each axis name means one thing:

- the *data-parallel* axes split the batch: `fsdp` shards the parameters' flat buffers over its
  ranks (the *shard axis*), `replicate` keeps a copy on each (hybrid sharding);
- the *model-parallel* axes split the model, and their ranks see the same samples: `tp` splits
  leaves along a dimension (`fs.tensor_parallel`), `pp` into pipeline stages, `cp` the sequence.

FSDP is one placement among others: a leaf is first split by its tensor-parallel placement,
then the flat buffers of what each rank holds are sharded over the shard axis. A mesh without
an `fsdp` axis shards nothing (`shard_axis` None, `num_shards` 1).

`Mesh` (`_mesh.py`, over torch.distributed) and `SimulatedMesh` (`_simulated.py`, threads) fulfil
this contract.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._agreement import digest as _digest
from ._failures import MeshError

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


def _shard_axis_of(names: Sequence[str], shard_axis: str | None) -> str | None:
    """The axis parameters' flat buffers are sharded over: `shard_axis` if given (a data-parallel
    axis of the mesh), else `"fsdp"` if the mesh has it, else None (nothing sharded)."""
    if shard_axis is None:
        return "fsdp" if "fsdp" in names else None
    if shard_axis not in names:
        raise ValueError(f"shard_axis {shard_axis!r} is not one of the mesh axes {list(names)}")
    if shard_axis not in DATA_PARALLEL_AXES:
        raise ValueError(
            f"shard_axis {shard_axis!r} splits the model, not the batch: the flat buffers of FSDP are sharded over a "
            f"data-parallel axis ({' or '.join(repr(a) for a in DATA_PARALLEL_AXES)})"
        )
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
        shard_axis: the data-parallel axis the parameters' flat buffers are sharded over
            (`"fsdp"`), or None when nothing is sharded; the other data-parallel axes replicate
            them, the model-parallel axes split the leaves themselves (placements).
        supports_tracing: whether a step on this mesh can be traced.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    rank: int
    world_size: int
    shard_axis: str | None
    # Whether a step on this mesh can be traced (make_fx patches module globals while it
    # traces, so thread-ranks of a simulated mesh cannot trace at the same time).
    supports_tracing: bool = True
    # A mesh of no real ranks, for planning (`fs.analysis.AbstractMesh`): steps trace on it and
    # skip the ranks' agreements, which it cannot hold.
    abstract: bool = False
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
        """Size of the shard axis: into how many slices each parameter buffer is cut (1 without one)."""
        return 1 if self.shard_axis is None else self.shape[self.shard_axis]

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's index along every axis (row-major over `axis_names`)."""
        return _coordinates(self, self.rank)

    @property
    def shard_index(self) -> int:
        """Which slice of each buffer this rank keeps: its coordinate on the shard axis (0 without one)."""
        return 0 if self.shard_axis is None else self.coordinates[self.shard_axis]

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes that split the batch (`replicate`, `fsdp`), in mesh order."""
        return tuple(a for a in self.axis_names if a in DATA_PARALLEL_AXES)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The axes that split the model (`tp`, `pp`, `cp`) and have more than one rank, in mesh order."""
        return tuple(a for a, n in zip(self.axis_names, self.axis_sizes) if a in MODEL_PARALLEL_AXES and n > 1)

    @property
    def data_size(self) -> int:
        """How many ranks see different samples: the product of the data axes' sizes."""
        size = 1
        for a in self.data_axes:
            size *= self.shape[a]
        return size

    @property
    def data_rank(self) -> int:
        """This rank's index among the data-parallel ranks (row-major over `data_axes`): ranks that
        differ only on model-parallel axes share it (they see the same samples). `rank` itself on
        a mesh of data axes only."""
        coordinates, index = self.coordinates, 0
        for a in self.data_axes:
            index = index * self.shape[a] + coordinates[a]
        return index

    @property
    def replicate_axes(self) -> tuple[str, ...]:
        """The data-parallel axes other than the shard axis: a gradient is summed over them (a
        replicated parameter's copies), never over a model-parallel axis."""
        return tuple(a for a in self.data_axes if a != self.shard_axis)

    def check_model_axes(self, what: str, supported: tuple[str, ...] = ("tp",)) -> None:
        """Raises `MeshError` if an axis of this mesh splits the model in a way `what` does not
        apply (`pp`, `cp` of size > 1 for `fs.sharded_step`, anything but data axes for `fs.shard`),
        rather than treating it as a silent replica."""
        split = [f"{a!r} (size {self.shape[a]})" for a in self.model_axes if a not in supported]
        if split:
            can = f"{what} applies the data-parallel axes" + (f" and {', '.join(map(repr, supported))}" if supported else "")
            raise MeshError(
                f"{what} does not apply the model-parallel axis {split[0]} of the {self.describe()} yet: it would "
                f"replicate the parameters over it and average the gradients, which is data parallelism, not what "
                f"the axis asks for. {can}; fs.sharded_step(..., pipeline=...) runs a 'pp' axis "
                f"(docs/pipelining.md)"
            )

    def check_data_parallel(self, what: str) -> None:
        """`check_model_axes` with no model-parallel axis supported (for the pytree transforms
        `fs.shard` and `fs.reduce_scatter`, which know no placements)."""
        self.check_model_axes(what, supported=())

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

    def all_to_all_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        """[size * n] -> [size * n]: slice `j` of `x` goes to the rank at coordinate `j` of
        `axis`; the result holds the slices the ranks along `axis` sent this rank, in axis order
        (a reduce-scatter whose sum is left to the caller: `fs`'s canonical summation tree)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

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
        lists = [text.split("\n") for text in gather_texts(self, "\n".join(items))]
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



def gather_texts(mesh: BaseMesh, text: str) -> list[str]:
    """Every rank's `text` (any length, empty for nothing to say), in rank order. A collective:
    two all-gathers (the lengths, then the bytes padded to the longest)."""
    device = getattr(mesh, "device", None)
    data = torch.tensor(list(text.encode()), dtype=torch.uint8)
    lengths = mesh.all_gather_world(torch.tensor([data.numel()], dtype=torch.int64, device=device)).tolist()
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)
    padded[: data.numel()] = data
    everyone = mesh.all_gather_world(padded.to(device)).view(mesh.world_size, -1).cpu()
    return [bytes(everyone[rank, :n].tolist()).decode() for rank, n in enumerate(lengths)]


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

