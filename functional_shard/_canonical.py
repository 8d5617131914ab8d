"""Layout-invariant steps: the same bits at any number of data-parallel ranks.

`sharded_step(..., canonical_chunks=G)` fixes the three things a data-parallel layout changes:

- **the pieces**: the global batch is cut into `G` equal chunks, and every chunk is computed
  alone (the same shapes, hence the same kernels, at every layout); data-parallel rank `r` of
  `D` holds chunks `[r * G/D, (r + 1) * G/D)` and runs them as its micro-batches;
- **the order of sums**: chunk gradients add up in one fixed tree over the chunk index
  (`tree_sum`: left folds over runs of `odd(G)` chunks, then pairs of neighbours, level by
  level). A rank sums its chunks (the tree's lower levels, `TreeSum`), then the ranks' partial
  sums meet along each data axis, innermost first (`reduce`): an all-to-all over the shard
  axis (each rank receives every rank's slice of what it keeps) or an all-gather over a
  replicate axis, then the same tree over the received parts — never a ring whose order
  depends on the rank count. The tree over `G` restricted to a rank's block is the tree over
  its chunks exactly when `D` is a power of two dividing `G` (`degrees`);
- **sums over parameters**: buffers are padded to `G` canonical blocks of a multiple of 64
  elements (`Layout.blocks`); the global norm sums squares per block, gathers the blocks'
  sums and adds them in the tree (`block_squares`); the loss metrics gather each chunk's
  loss (`chunk_values`) and add them in the tree.

Random numbers are drawn per chunk (`_random.reseed`), so that dropout masks are the same at
every layout.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from . import _tracing
from ._basemesh import BaseMesh

__all__ = ["Canonical", "degrees", "resolve", "tree_sum", "TreeSum", "reduce", "chunk_values"]


@dataclasses.dataclass(frozen=True)
class Canonical:
    """A layout-invariant step's chunks, as this rank holds them."""

    chunks: int  # G: chunks of the global batch (and canonical blocks of every buffer)
    degree: int  # D: data-parallel ranks (`mesh.data_size`)
    first: int  # the index of this rank's first chunk

    @property
    def per_rank(self) -> int:
        """Chunks each data-parallel rank computes: its micro-batches."""
        return self.chunks // self.degree


def degrees(chunks: int) -> list[int]:
    """The data-parallel degrees at which `chunks` canonical chunks give the same bits: the
    powers of two that divide it (a rank's block of chunks is then a subtree of the tree)."""
    out, d = [], 1
    while chunks % d == 0:
        out.append(d)
        d *= 2
    return out


def resolve(chunks: int | None, mesh: BaseMesh, microbatches: int) -> Canonical | None:
    """The chunks of `sharded_step(..., canonical_chunks=chunks)` on `mesh`, or None without.
    Raises ValueError naming what cannot be layout-invariant."""
    if chunks is None:
        return None
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"canonical_chunks must be an int >= 1 (or None); got {chunks!r}")
    size = mesh.data_size
    valid = degrees(chunks)
    if size not in valid:
        axes = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.data_axes) or "none"
        raise ValueError(
            f"canonical_chunks={chunks} cannot give the same bits at {size} data-parallel ranks (data axes: {axes}): "
            f"the data-parallel degree must be a power of two that divides canonical_chunks, one of {valid} here. "
            f"Pick canonical_chunks as a multiple of every degree you will run at (e.g. 8 for 1, 2, 4 and 8 ranks)"
        )
    per_rank = chunks // size
    if microbatches not in (1, per_rank):
        raise ValueError(
            f"with canonical_chunks={chunks} at {size} data-parallel ranks each rank runs its {per_rank} chunk(s) as "
            f"its micro-batches; microbatches={microbatches} asks for another cut. Leave microbatches at 1 (or pass "
            f"{per_rank})"
        )
    return Canonical(chunks, size, mesh.data_rank * per_rank)


def _odd(n: int) -> int:
    while n % 2 == 0:
        n //= 2
    return n


def tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """The sum of `rows[0], ..., rows[k-1]` in the canonical tree: left folds over runs of
    `odd(k)` rows (`((r0 + r1) + r2)`), then neighbours paired level by level (`(a + b) + (c + d)`).
    Elementwise: every element is summed in that order, whatever the other dimensions."""
    k = rows.shape[0]
    odd = _odd(k)
    runs = rows.reshape(k // odd, odd, *rows.shape[1:])
    acc = runs[:, 0]
    for t in range(1, odd):
        acc = acc + runs[:, t]
    while acc.shape[0] > 1:
        acc = acc[0::2] + acc[1::2]
    return acc[0]


class TreeSum:
    """`tree_sum` of `count` values given one at a time (lists of tensors, added elementwise),
    holding O(log count) partial sums instead of every value."""

    def __init__(self, count: int):
        self._odd = _odd(count)
        self._count = count
        self._seen = 0
        self._fold: list[torch.Tensor] | None = None
        self._stack: list[tuple[int, list[torch.Tensor]]] = []

    def add(self, values: Sequence[torch.Tensor]) -> None:
        values = list(values)
        fold = values if self._fold is None else [a + b for a, b in zip(self._fold, values)]
        self._seen += 1
        if self._seen % self._odd:
            self._fold = fold
            return
        self._fold = None
        level, item = 0, fold
        while self._stack and self._stack[-1][0] == level:
            _, left = self._stack.pop()
            level, item = level + 1, [a + b for a, b in zip(left, item)]
        self._stack.append((level, item))

    def result(self) -> list[torch.Tensor]:
        if self._seen != self._count or len(self._stack) != 1:
            raise RuntimeError(f"internal: TreeSum of {self._count} values was given {self._seen}")
        return self._stack[0][1]


def reduce(full: torch.Tensor, mesh: BaseMesh) -> torch.Tensor:
    """This rank's shard of the sum over the data-parallel ranks of `full` (a flat, padded
    gradient buffer summed over this rank's chunks), in the canonical tree: along each data
    axis from the innermost (neighbouring data ranks) out, an all-to-all over the shard axis or
    an all-gather over a replicate axis, then `tree_sum` of the received parts."""
    x = full
    for axis in reversed(mesh.data_axes):
        size = mesh.shape[axis]
        if size == 1:
            continue
        if axis == mesh.shard_axis:
            parts = mesh.all_to_all_axis_flat(x.contiguous(), axis)
        else:
            with _tracing.moving(None):  # a replica's partial sum, not a parameter collective
                parts = mesh.all_gather_axis_flat(x.contiguous(), axis)
        x = tree_sum(parts.view(size, -1))
    return x


def chunk_values(values: torch.Tensor, mesh: BaseMesh) -> torch.Tensor:
    """`[n, ...]` values of this rank's chunks -> `[D * n, ...]`: every data-parallel rank's, in
    chunk order (all-gathers along the data axes, innermost first)."""
    shape = values.shape[1:]
    x = values.reshape(-1)
    for axis in reversed(mesh.data_axes):
        if mesh.shape[axis] > 1:
            x = mesh.all_gather_axis_flat(x.contiguous(), axis)
    return x.view(-1, *shape)
