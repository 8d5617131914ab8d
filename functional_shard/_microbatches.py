"""Cutting a batch into micro-batches: along the leading dimension of every tensor leaf, into
equal parts (gradient accumulation, a pipeline's micro-batches, a layout-invariant step's
canonical chunks), with the reason in words when it does not cut."""

from __future__ import annotations

from typing import Any

import torch

from ._losses import StepError
from ._pytree import tree_flatten, tree_map, tree_paths, tree_unflatten

__all__ = ["batch_problem", "cast_inputs", "split_microbatches"]


def cast_inputs(batch: Any, dtype: torch.dtype | None) -> Any:
    """`batch` with its floating tensors cast to `dtype` (unchanged when None)."""
    if dtype is None:
        return batch
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch)


def batch_problem(batch: Any, k: int, canonical: Any = None) -> str | None:
    """Why `batch` cannot be cut along the leading dimension of every tensor leaf into `k`
    equal micro-batches (a layout-invariant step's chunks, with `canonical`), or None."""
    leaves = tree_flatten(batch)[0]
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] % k):
            path, shape = tree_paths(batch)[index], list(leaf.shape)
            if canonical is None:
                return (
                    f"microbatches={k} must divide the leading dimension of every tensor of the batch; batch leaf "
                    f"{path!r} has shape {shape}: make its leading dimension a multiple of {k}"
                )
            g, d = canonical.chunks, canonical.degree
            return (
                f"canonical_chunks={g} at {d} data-parallel ranks: each rank computes its {k} chunks of the global "
                f"batch, cut along the leading dimension; batch leaf {path!r} has shape {shape}, whose leading "
                f"dimension {shape[0] if shape else 0} is not a multiple of {k}. Give data-parallel rank r rows "
                f"[r*B/{d}, (r+1)*B/{d}) of a global batch of B rows, B a multiple of {g} (fs.data.local_batch does this)"
            )
    return None


def split_microbatches(batch: Any, k: int, dtype: torch.dtype | None = None, canonical: Any = None) -> list[Any]:
    """`batch` cut along the leading dimension of every tensor leaf into `k` equal parts (its
    floating tensors cast to `dtype` when given); StepError (`batch_problem`) if it does not cut."""
    batch = cast_inputs(batch, dtype)
    if k == 1 and canonical is None:
        return [batch]
    problem = batch_problem(batch, k, canonical)
    if problem is not None:
        raise StepError(problem)
    leaves, structure = tree_flatten(batch)
    parts = [leaf.chunk(k) if isinstance(leaf, torch.Tensor) else [leaf] * k for leaf in leaves]
    return [tree_unflatten(structure, [p[i] for p in parts]) for i in range(k)]
