"""A pipelined step's `aux` (`has_aux=True`) on every pipeline rank.

`loss_fn` returns `(loss, aux)`; the cut (`_stages.cut_stages(..., has_aux=True)`) puts aux's
tensors, detached, after the loss values among the last stage's outputs, so the rank that holds
the last stage has each micro-batch's aux. Every other rank of its pipeline gets them from it
with one all-gather over `pp` of their bytes (exact for every dtype: nothing is added up), so
that `metrics["aux"]` is on every rank as a plain step's is: the micro-batch's tree with one
micro-batch, else the list of the micro-batches' trees (this data-parallel rank's rows).
"""

from __future__ import annotations

from typing import Any

import torch

from ._pytree import tree_unflatten
from ._stages import Cut, boundary_bytes

__all__ = ["aux_of"]


def aux_of(cut: Cut, losses: list, mesh, last_rank: int, microbatches: int) -> Any:
    """`losses`: this rank's per-micro-batch outputs of the last stage (empty unless it holds it);
    `last_rank`: the pipeline coordinate that holds the last stage."""
    count = 3 if cut.weighted else 2  # (objective, loss[, weight]) come first
    specs = cut.stages[-1].sent[count:]
    device = getattr(mesh, "device", torch.device("cpu"))
    if losses:
        values = [list(v[count:]) for v in losses]
    else:
        values = [[torch.zeros(b.shape, dtype=b.dtype, device=device) for b in specs] for _ in range(microbatches)]
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for mb in values for t in mb]
    if flat and mesh.shape["pp"] > 1:
        every = mesh.all_gather_axis_flat(torch.cat(flat), "pp")
        mine = every.view(mesh.shape["pp"], -1)[last_rank]
        values, offset = [], 0
        for _ in range(microbatches):
            tensors = []
            for b in specs:
                n = boundary_bytes(b)
                tensors.append(mine[offset : offset + n].clone().view(b.dtype).reshape(b.shape))
                offset += n
            values.append(tensors)
    trees = [tree_unflatten(cut.aux, mb) for mb in values]
    return trees[0] if microbatches == 1 else trees
