"""Data per rank: each data-parallel rank's part of a dataset's global batches, or of one global batch.

A step consumes one **global batch** of `batch_size` samples, split over the data-parallel ranks
in contiguous parts of `batch_size // size` samples: data-parallel rank `i` holds rows
`[i * b, (i + 1) * b)`. Which ranks are data-parallel is read from the mesh's axes:

- the **data axes** are every mesh axis except the model-parallel ones (`MODEL_PARALLEL_AXES`:
  `tp`, `pp`, `cp`), which split the model rather than the batch. Today that is every axis the
  library knows (`replicate` and `fsdp`, whose ranks each train on their own samples: the step
  averages gradients over all of them), so on `{"replicate": 2, "fsdp": 2}` the data-parallel
  index is the rank. A `tp` or `pp` axis, when a mesh has one, gets no index: the ranks along it
  receive the same samples. `axes=` names the data axes explicitly.
- a rank's **data-parallel index** is its coordinates on the data axes read row-major (the last
  data axis varies fastest), and the **data-parallel size** is the product of their sizes.

`DataParallelSampler` gives the parts of every global batch of a map-style
`torch.utils.data.Dataset`, deterministically (a seeded shuffle per epoch, as
`DistributedSampler`'s) and from any step (to resume mid-epoch from a checkpoint's `state.step`);
`local_batch` cuts one global batch (a pytree of tensors) into this rank's part.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sized
from typing import Any, NamedTuple

import torch

from .. import _mesh
from .._mesh import BaseMesh
from .._pytree import tree_flatten, tree_paths, tree_unflatten

__all__ = ["MODEL_PARALLEL_AXES", "DataRank", "DataParallelSampler", "data_rank", "local_batch"]

# Mesh axes that split the model rather than the batch (`fs.init_mesh`'s meaning of the names):
# ranks along them are fed the same samples.
MODEL_PARALLEL_AXES = _mesh.MODEL_PARALLEL_AXES


class DataRank(NamedTuple):
    """Where this rank sits among the data-parallel ranks of a mesh."""

    index: int  # this rank's data-parallel index: its coordinates on `axes`, row-major
    size: int  # how many data-parallel ranks there are: the product of the sizes of `axes`
    axes: tuple[str, ...]  # the mesh axes the data is split over, in mesh order


def data_rank(mesh: BaseMesh, axes: tuple[str, ...] | list[str] | None = None) -> DataRank:
    """This rank's data-parallel index and the data-parallel size on `mesh`. No collective.

    Arguments:
        mesh: the mesh (`fs.init_mesh`, a `SimulatedMesh`, ...).
        axes: the data axes (default: every axis of `mesh` except `MODEL_PARALLEL_AXES`).

    Returns a `DataRank`. On `{"replicate": 2, "fsdp": 2}`, rank 3 is `DataRank(3, 4,
    ("replicate", "fsdp"))`; on `{"fsdp": 2, "tp": 2}`, ranks 2 and 3 are both index 1 of 2.
    """
    names = tuple(mesh.axis_names)
    if axes is None:
        axes = tuple(a for a in names if a not in MODEL_PARALLEL_AXES)
    else:
        axes = tuple(axes)
        unknown = [a for a in axes if a not in names]
        if unknown or len(set(axes)) != len(axes):
            raise ValueError(f"data axes {list(axes)} must be distinct axes of the mesh {mesh.shape}; not axes of it: {unknown}")
        split = [a for a in axes if a in MODEL_PARALLEL_AXES]
        if split:  # its ranks hold parts of one model: each must see the samples the others see
            raise ValueError(
                f"data axes {list(axes)} name model-parallel axes {split} of the mesh {mesh.shape}: the ranks along "
                f"them split the model and must get the same samples; name data axes only (default: every axis "
                f"but {list(MODEL_PARALLEL_AXES)})"
            )
        axes = tuple(a for a in names if a in axes)  # mesh order, whatever order they were given in
    coordinates, sizes = mesh.coordinates, mesh.shape
    index, size = 0, 1
    for axis in axes:
        index = index * sizes[axis] + coordinates[axis]
        size *= sizes[axis]
    return DataRank(index, size, axes)


def _int(name: str, value: Any) -> int:
    """`value` as an int (any integer type: numpy's, a one-element integer tensor), or a TypeError."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int; got {value!r}") from None


def _describe(rank: DataRank, mesh: BaseMesh) -> str:
    if not rank.axes:
        return f"1 data-parallel rank (the mesh {mesh.shape} has no data axis)"
    axes = " x ".join(f"{a}={mesh.shape[a]}" for a in rank.axes)
    return f"{rank.size} data-parallel ranks (mesh axes {axes})"


def local_batch(batch: Any, mesh: BaseMesh, *, axes: tuple[str, ...] | list[str] | None = None) -> Any:
    """This rank's part of a global batch: rows `[i * b, (i + 1) * b)` of every tensor leaf, where
    `i` is this rank's data-parallel index and `b` the global batch divided by the data-parallel
    size (`data_rank`). No collective; every rank must pass the same global batch.

    Arguments:
        batch: a pytree (tuple, dict, dataclass, ...) whose tensor leaves share their leading
            (batch) dimension, of any dtype; leaves that are not tensors are returned as they are.
        mesh: the mesh.
        axes: the data axes (default: every axis except `MODEL_PARALLEL_AXES`; see `data_rank`).

    Returns a pytree of the same structure whose tensor leaves are views of rows of `batch`'s.
    The parts of the data-parallel ranks, concatenated in index order, are the global batch;
    ranks with the same index (along `tp` or `pp`) get the same part. Raises `ValueError`
    naming the leaf, its shape and the mesh axes when a leaf is 0-d, when the leading
    dimensions differ, or when one is not a multiple of the data-parallel size.
    """
    rank = data_rank(mesh, axes)
    leaves, structure = tree_flatten(batch)
    paths = tree_paths(batch)
    rows = None
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.ndim == 0:
            raise ValueError(
                f"batch leaf {path!r} is a 0-d tensor: it has no batch dimension to split over the "
                f"{_describe(rank, mesh)}; give it a leading batch dimension, or pass it as a Python number"
            )
        if rows is None:
            rows = (path, leaf.shape[0])
        elif leaf.shape[0] != rows[1]:
            raise ValueError(
                f"batch leaves {rows[0]!r} and {path!r} have leading dimensions {rows[1]} and {leaf.shape[0]} "
                f"(shape {list(leaf.shape)}): every tensor of a global batch must have the same batch size"
            )
        if leaf.shape[0] % rank.size:
            raise ValueError(
                f"batch leaf {path!r} has shape {list(leaf.shape)}: its batch dimension {leaf.shape[0]} does not "
                f"divide over {_describe(rank, mesh)}; use a global batch size that is a multiple of {rank.size}"
            )
    if rows is None:
        return batch
    part = rows[1] // rank.size
    start = rank.index * part
    return tree_unflatten(
        structure, [leaf[start : start + part] if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    )


class DataParallelSampler(torch.utils.data.Sampler):
    """This rank's part of every global batch of a dataset, by step: a batch sampler for
    `torch.utils.data.DataLoader(dataset, batch_sampler=sampler)`.

    Epoch `e` orders the dataset by `torch.randperm(len(dataset))` seeded with `seed + e` (the
    order of `DistributedSampler(shuffle=True, seed=seed)` after `set_epoch(e)`; without
    shuffling, `0, 1, 2, ...`) and cuts it into global batches of `batch_size`; global batch
    `k` of the epoch is the run's step `e * steps_per_epoch + k`. Each data-parallel rank gets
    a contiguous part of `batch_size // size` samples (`local_batch`'s rows), so a step's
    samples depend on neither the world size nor the rank layout: a run resumed at another world
    size with the same `batch_size` sees the same global batches.

    Arguments:
        dataset: a map-style dataset (anything with `len`), or its length as an int.
        mesh: the mesh; only its axes and this rank's coordinates are read (see `data_rank`).
        batch_size: the global batch size: samples per step over all data-parallel ranks (a
            multiple of the data-parallel size). Micro-batches (`Schedule(microbatches=...)`)
            then split each rank's part.
        shuffle: a new seeded order every epoch (default); else the dataset's order.
        seed: the shuffle's seed; the same on every rank.
        drop_last: with True (default) an epoch is `len(dataset) // batch_size` steps and the
            `len(dataset) % batch_size` samples last in that epoch's order are left out of it
            (each epoch leaves out others): every sample is seen at most once per epoch, each
            step is a full batch. With False the epoch has `ceil(len / batch_size)` steps and
            the last batch is completed with the epoch's first samples (as `DistributedSampler`
            pads): every sample at least once, the epoch's first ones more (a batch larger
            than the dataset repeats them as many times as it takes).
        start_step: the first step to yield (a checkpoint's `int(state.step)`): the sampler
            starts in its epoch (`epoch` is set to it) and never yields an earlier step, so a
            resumed run gets the batches an uninterrupted one would have.
        axes: the data axes (default: every mesh axis except `MODEL_PARALLEL_AXES`).
        check: compare the settings across all ranks of `mesh` (one small collective, on every
            rank) and raise `fs.MeshError` where they differ (say, a seed that depends on the
            rank, which would feed ranks overlapping samples). Default True.

    Iterating yields, for each step of the current epoch from `start_step` on, a list of
    `batch_size // size` dataset indices (Python ints); `len()` is how many. Like
    `DistributedSampler`, call `set_epoch(epoch)` before each epoch:

        sampler = fs.data.DataParallelSampler(dataset, mesh, batch_size=64, seed=0, start_step=int(state.step))
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)
            for batch in loader:
                state, metrics = step(state, batch)

    The sampler holds no reference to the mesh or the dataset, so it pickles (DataLoader workers).
    """

    def __init__(
        self,
        dataset: Sized | int,
        mesh: BaseMesh,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        start_step: int = 0,
        axes: tuple[str, ...] | list[str] | None = None,
        check: bool = True,
    ):
        if isinstance(dataset, int) and not isinstance(dataset, bool):
            length = _int("dataset length", dataset)
        elif isinstance(dataset, torch.utils.data.IterableDataset) or not isinstance(dataset, Sized):
            raise TypeError(
                f"DataParallelSampler needs a map-style dataset (with __len__ and __getitem__) or its length; got "
                f"{type(dataset).__name__}. An IterableDataset must split its stream itself: use fs.data.data_rank(mesh)"
            )
        else:
            length = len(dataset)
        rank = data_rank(mesh, axes)
        batch_size, seed, start_step = _int("batch_size", batch_size), _int("seed", seed), _int("start_step", start_step)
        if batch_size < 1 or batch_size % rank.size:
            raise ValueError(
                f"batch_size={batch_size} is the global batch size: it must be a positive multiple of the "
                f"{_describe(rank, mesh)}"
            )
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0; got {start_step}")
        steps = length // batch_size if drop_last else -(-length // batch_size)
        if steps == 0:
            raise ValueError(
                f"the dataset has {length} samples, fewer than one global batch of {batch_size}"
                + (" (drop_last=True leaves no step); use a smaller batch_size or drop_last=False" if length else "")
            )
        if check:
            settings = (
                f"dataset length {length}, batch_size {batch_size}, shuffle {shuffle}, seed {seed}, "
                f"drop_last {drop_last}, start_step {start_step}, data axes {rank.axes}"
            )
            mesh.agree("fs.data.DataParallelSampler")  # a collective entry point: every rank states it first
            mesh.check_same("fs.data.DataParallelSampler's settings", settings)
        self.dataset_length = length  # samples in the dataset
        self.batch_size = batch_size  # the global batch size
        self.local_batch_size = batch_size // rank.size  # samples per step on this rank
        self.rank = rank  # this rank's DataRank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.steps_per_epoch = steps  # global batches (steps) in an epoch
        self.start_step = start_step
        self.epoch = start_step // steps  # the epoch `__iter__` yields; `set_epoch` changes it

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration yield epoch `epoch`'s steps (from `start_step` on)."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0; got {epoch!r}")
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """Every dataset index in epoch `epoch`'s order (the same on every rank)."""
        if not self.shuffle:
            return list(range(self.dataset_length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_length, generator=generator).tolist()

    def indices(self, step: int) -> list[int]:
        """This rank's dataset indices for step `step` (counted from the start of training): its
        `local_batch_size` samples of that step's global batch."""
        epoch, position = divmod(step, self.steps_per_epoch)
        return self._part(self.order(epoch), position)

    def _part(self, order: list[int], position: int) -> list[int]:
        start = position * self.batch_size + self.rank.index * self.local_batch_size
        # Past the end only without drop_last: wrap around to the epoch's first samples.
        return [order[i % len(order)] for i in range(start, start + self.local_batch_size)]

    def _first_position(self) -> int:
        return min(self.steps_per_epoch, max(0, self.start_step - self.epoch * self.steps_per_epoch))

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for position in range(self._first_position(), self.steps_per_epoch):
            yield self._part(order, position)

    def __len__(self) -> int:
        return self.steps_per_epoch - self._first_position()

    def __repr__(self) -> str:
        return (
            f"DataParallelSampler({self.dataset_length} samples, batch_size={self.batch_size} "
            f"({self.local_batch_size} on data-parallel rank {self.rank.index} of {self.rank.size}), "
            f"steps_per_epoch={self.steps_per_epoch}, epoch={self.epoch}, start_step={self.start_step})"
        )
