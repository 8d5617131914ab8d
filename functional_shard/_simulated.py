"""`SimulatedMesh`: the ranks of a mesh as threads of one process (for tests; see
`fs.testing.SimulatedWorld`). The same interface as `Mesh`; sums run in rank order, so results
are deterministic; a thread that fails breaks the barrier and the others raise
`threading.BrokenBarrierError` instead of waiting."""

from __future__ import annotations

import threading

import torch

from . import _tracing
from ._mesh import BaseMesh, _check_axes, _check_product, _coordinates, _shard_axis_of

__all__ = ["SimulatedMesh"]


class _Rendezvous:
    """Where the thread-ranks of a `SimulatedMesh` meet: one slot per rank and a barrier.

    Every collective is a world-wide meeting (all ranks call the same collectives in the same
    order, as SPMD programs must), so axis groups need no bookkeeping of their own."""

    def __init__(self, world_size: int, timeout: float):
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x
        self.barrier.wait()
        everyone = list(self.slots)  # type: ignore[arg-type]
        self.barrier.wait()  # nobody overwrites a slot before all have read them
        return everyone


class SimulatedMesh(BaseMesh):
    """A mesh whose ranks are threads of this process (for tests; see `fs.testing.SimulatedWorld`).

    Sums run in rank order, so results are deterministic. A thread that fails breaks the
    barrier, and the others raise `threading.BrokenBarrierError` instead of waiting."""

    device = torch.device("cpu")
    supports_tracing = False

    def __init__(self, axes: dict[str, int], rank: int, rendezvous: _Rendezvous, *, shard_axis: str | None = None):
        self.axis_names, self.axis_sizes = _check_axes(axes)
        self.world_size = len(rendezvous.slots)
        _check_product(self.axis_names, self.axis_sizes, self.world_size)
        self.shard_axis = _shard_axis_of(self.axis_names, shard_axis)
        self.rank = rank
        self._rendezvous = rendezvous

    def _group(self, axes: tuple[str, ...]) -> list[int]:
        """Ranks that share this rank's coordinates on every axis not in `axes`, in rank order."""
        mine = self.coordinates
        members = []
        for r in range(self.world_size):
            other = _coordinates(self, r)
            if all(other[a] == mine[a] for a in self.axis_names if a not in axes):
                members.append(r)
        return members

    def _exchange(self, x: torch.Tensor, axes: tuple[str, ...]) -> list[torch.Tensor]:
        everyone = self._rendezvous.exchange(self.rank, x)
        return [everyone[r] for r in self._group(axes)]

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        if self.shard_axis is None:
            return shard.clone()
        return torch.cat(self._exchange(shard, (self.shard_axis,)))

    def reduce_scatter_flat(self, full: torch.Tensor) -> torch.Tensor:
        if self.shard_axis is None:
            return full.clone()
        total = _ordered_sum(self._exchange(full, (self.shard_axis,)))
        return total.chunk(self.num_shards)[self.shard_index].clone()

    # Each says what it made to a `SplitValues` following the call (a Mesh's are read by group name).
    def all_reduce_flat(self, x: torch.Tensor, axes: tuple[str, ...] | None = None) -> torch.Tensor:
        axes = self.axis_names if axes is None else axes
        out = _ordered_sum(self._exchange(x, tuple(axes)))
        _tracing.note_collective(out, axes, "whole")
        return out

    def all_gather_world(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat(self._rendezvous.exchange(self.rank, x))
        _tracing.note_collective(out, self.axis_names, "whole")
        return out

    def all_gather_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        out = torch.cat(self._exchange(x, (axis,)))
        _tracing.note_collective(out, (axis,), "whole")
        return out

    def reduce_scatter_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        total = _ordered_sum(self._exchange(x, (axis,)))
        out = total.chunk(self.shape[axis])[self.coordinates[axis]].clone()
        _tracing.note_collective(out, (axis,), "split")
        return out


    def all_to_all_axis_flat(self, x: torch.Tensor, axis: str) -> torch.Tensor:
        mine = self.coordinates[axis]
        return torch.cat([t.chunk(self.shape[axis])[mine] for t in self._exchange(x, (axis,))])


def _ordered_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total = total + t
    return total
