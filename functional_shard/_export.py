"""Export: the full, unsharded parameters of a sharded state, in memory or streamed to a file.

    full = fs.export(state)                              # every rank: the whole state dict (small models)
    fs.export(state, "out/model.safetensors")            # every rank; rank 0 writes, one unit at a time

The streamed export (`functional_shard/_export_stream.py`) never holds more than this rank's
shards plus one flat buffer gathered whole: the ranks all-gather the buffers one by one (each
split leaf also over its tensor-parallel axis), and rank 0 writes each buffer's leaves to the
file (raw bytes at offsets fixed in advance by the header, `functional_shard/_export_file.py`)
before the next is gathered; where the ranks hold different leaves (a pipelined step's stages),
each pipeline coordinate gathers its own buffers in turn and sends them to rank 0. The file is
a plain safetensors file with state-dict names, which
`model.load_state_dict(safetensors.torch.load_file(path), strict=True)` and Hugging Face
`from_pretrained(directory)` read.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ._export_file import ExportError
from ._export_stream import stream
from ._placed import layout_groups, layouts_say
from ._pytree import tree_flatten, tree_map, tree_paths
from ._shard import Sharded, gather
from ._step import StepState, check_not_donated
from ._tree import ModuleParams

__all__ = ["export", "ExportError"]

OPERATION = "fs.export"  # the name every rank states on entering (`BaseMesh.agree`)


def export(state: StepState | Sharded, path: str | os.PathLike | None = None, *, aliases: bool = True) -> Any:
    """The full, unsharded parameters of a step state (or a `Sharded`); a collective.

    Arguments:
        state: a `StepState` (or its `params`, a `Sharded`), this rank's part.
        path: where to write a safetensors file (the same on every rank; rank 0 writes it). None:
            return the full parameters on every rank instead.
        aliases: with `path`, also store each tied weight under its aliases (a copy of the bytes
            per alias, as safetensors cannot share storage): `load_state_dict(strict=True)`
            then reads the file. False stores each tensor once, under its first name, as
            transformers' `save_pretrained` does (`from_pretrained` re-ties).

    Without `path`: for parameters from `fs.functionalize`, a state dict for
    `model.load_state_dict(..., strict=True)` (every parameter and persistent buffer under every
    name the module's state dict uses, tied names included; buffers are this rank's); otherwise
    the full pytree. Leaves split by tensor-parallel placements are joined whole
    (`fs.gather(..., full=True)`). Every rank holds the whole model at once: for small models.
    Where the ranks hold different leaves (a pipelined step: each pipeline coordinate its
    stages), each rank gets the leaves it lacks from the first rank that holds them, as a state
    dict (every leaf by its path for a tree of another kind).

    With `path`: streams. The ranks all-gather one flat buffer at a time; rank 0 writes its
    leaves at their place in the file and drops it before the next is gathered, so no rank holds
    more than its shards plus one buffer gathered whole (at most one unit's parameters; with
    tensor-parallel placements, its leaves joined whole over their axis). Names are the state
    dict's (as above; non-persistent buffers left out), module buffers rank 0's; the file is
    the same whatever the mesh, placements or world size the values are sharded over.
    The file is written to a new temporary file of its own next to it,
    `<path>.partial-<16 random hex digits>` (created exclusively: never a file or link that
    was there before), and renamed over `path` at the end: `path` holds either a complete file
    or what it held before, never a mix. If `path` changed while this export was writing (a
    concurrent export to the same path finished first), this export discards its file and
    raises `ExportError`: the first to finish wins. Returns None on every rank once the file is
    in place, or raises `ExportError` on every rank (e.g. a dtype safetensors cannot store,
    named with its leaf, before anything is gathered). Where the ranks hold different leaves (a
    pipelined step), each pipeline coordinate's ranks gather their buffers in turn and its first
    rank sends each, whole, to rank 0: the same tensors under the same names as without the
    pipeline, in the same order when its stages follow the model's units (one stage per rank).
    """
    if isinstance(state, StepState):
        check_not_donated(state, "fs.export")
        sharded = state.params
    else:
        sharded = state
    if not isinstance(sharded, Sharded):
        raise TypeError(f"export expects a StepState or a Sharded; got {type(state).__name__}")
    mesh = sharded.mesh
    mesh.agree(OPERATION)
    groups = layout_groups(sharded.layout, mesh)
    if path is None:
        with torch.no_grad():
            tree = tree_map(lambda t: t.detach().clone(), gather(sharded, full=True))
        if len(set(groups)) > 1:
            return _union(_named(tree), groups, mesh)
        return tree.state_dict() if isinstance(tree, ModuleParams) else tree
    stream(sharded, path, aliases, groups, OPERATION)
    return None


def _named(tree: Any) -> dict[str, torch.Tensor]:
    """A gathered tree as a state dict: a `ModuleParams`'s own, or every leaf by its path."""
    if isinstance(tree, ModuleParams):
        return tree.state_dict()
    leaves, _ = tree_flatten(tree)
    return dict(zip(tree_paths(tree), leaves))


def _union(named: dict[str, torch.Tensor], groups: tuple[int, ...], mesh: Any) -> dict[str, torch.Tensor]:
    """The state dict of the whole model on every rank, from ranks that hold different leaves
    (`groups`: `layout_groups`; a pipelined step's stages): the first rank of each layout names
    its tensors; each tensor this rank lacks comes from the first rank (in rank order) that holds
    it, byte for byte (an all-reduce of the bytes, zeros from every other rank); a tensor it
    holds stays its own (module buffers: this rank's). A collective."""
    mine = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in named.items()]
    owner: dict[str, tuple[int, list[int], torch.dtype]] = {}
    holders: dict[str, int] = {}
    for g, told in layouts_say(mesh, groups, mine).items():
        for name, shape, dtype in told:
            owner.setdefault(name, (g, shape, getattr(torch, dtype)))
            holders[name] = holders.get(name, 0) + 1
    moved = [name for name in owner if holders[name] < len(set(groups))]  # what some layout lacks
    sizes = [math.prod(owner[n][1]) * owner[n][2].itemsize for n in moved]
    device = next(iter(named.values())).device if named else torch.device("cpu")
    flat = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    for name, start, stop in zip(moved, offsets, offsets[1:]):
        if owner[name][0] == mesh.rank:
            flat[start:stop] = named[name].detach().contiguous().reshape(-1).view(torch.uint8)
    if moved:
        flat = mesh.all_reduce_flat(flat)
    position = {name: k for k, name in enumerate(moved)}
    out = {}
    for name, (_, shape, dtype) in owner.items():
        if name in named:
            out[name] = named[name]
        else:
            k = position[name]
            out[name] = flat[offsets[k] : offsets[k + 1]].clone().view(dtype).reshape(shape)
    return out
