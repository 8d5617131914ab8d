"""`save_dcp`: an fs state as a `torch.distributed.checkpoint` (DCP) checkpoint that an FSDP2 job loads.

    fs.checkpoint.save_dcp(path, state, param_groups=[{"lr": 1e-3, "betas": (0.9, 0.999), ...}])   # every rank
    # the FSDP2 job, at any world size:
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"]); set_optimizer_state_dict(model, opt, sd["optim"])

What torch's recipe saves, under the same keys: `model.<name>` for every state-dict name (tied
weights under each of their names, stored once), `optim.state.<name>.exp_avg` / `exp_avg_sq` /
(`max_exp_avg_sq`) / `step` for every trainable leaf, `optim.param_groups.<i>.<field>` when
given. A rank's shard of a flat buffer covers a range of each leaf it touches, not a block of
rows: each range is stored as the few row blocks that tile it (`flat_range_slices`), which DCP
records as chunks (n-D boxes) and any DCP reader reshards from. Each writing rank (one per shard
index) writes `__<rank>_0.distcp`; rank 0 writes `.metadata` (the pickle of torch's own metadata
classes, that `dcp.load` reads) once every rank's file is on disk, all in
`<path>.partial-<token>/`, renamed to `path` at the end. Every rank tells rank 0 its items
(what each stores, its box, its length) for the index. Where the ranks hold different leaves (a
pipelined step's coordinates hold their stages), the first rank of each layout describes its
tensors to every rank and each tensor is stored by the first layout in rank order that holds it.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from .._export_file import create_new_file, fsync_dir, state_dict_names
from .._layout import Layout
from .._placed import gather_texts, layout_groups, layouts_say
from .._shard import _check_shards
from .._step import StepState, check_not_donated
from ._dcp import ADAMW_STATE, _adamw_of
from ._dcp_files import METADATA
from ._format import CheckpointError
from ._full import flat_range_slices
from ._save import Writer, writer_pieces, writers_of

__all__ = ["save_dcp"]

OPERATION = "fs.checkpoint.save_dcp"


def save_dcp(
    path: str | os.PathLike,
    state: StepState,
    *,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    overwrite: bool = False,
) -> None:
    """Save `state` as a DCP checkpoint directory at `path` that FSDP2 (`dcp.load`) reads; every rank.

    Arguments:
        path: the directory to create, the same on every rank, on a file system every rank sees.
        state: a `StepState` with `fs.optim.adamw` (alone or after stateless transformations),
            this rank's part of it; with `optim_key=None`, any optimizer (the model only).
        model_key / optim_key: the keys of the model's and the optimizer's state dicts, as in
            `load_dcp` (`"model"` / `"optim"`: torch's recipe); `model_key=None` writes the
            model's names at the top level (`dcp.load(model.state_dict(), ...)` reads them);
            `optim_key=None` writes no optimizer state.
        param_groups: the optimizer's hyperparameters as `torch.optim` holds them, e.g.
            `[{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False,
            ...}]`: every field the FSDP2 optimizer's `param_groups` has, since `dcp.load` asks for
            each (plain values: numbers, bools, strings, None, tuples and lists of them). A
            single group without `"params"` covers every trainable leaf; several groups must each
            name theirs. None: none are written, and the FSDP2 side loads with
            `planner=DefaultLoadPlanner(allow_partial_load=True)`, keeping its own.
        overwrite: replace an existing directory at `path` (default: raise `CheckpointError`).

    Values are written exactly: the parameters, AdamW's moments (as torch's per-parameter
    `exp_avg`, `exp_avg_sq`) and its count (as every parameter's `step`, a 0-d tensor stored
    once). Only the ranks at coordinate 0 on every replicate axis write tensors; module buffers
    and the count come from rank 0. With tensor-parallel placements each rank of `tp` writes
    its pieces as boxes of the full tensors (whole leaves from the ranks at coordinate 0 on it),
    so the FSDP2 side reads full tensors of the model's own shapes. Atomic: a save that fails leaves nothing at `path` (nor
    changes what was there); a collective that returns on every rank once `path` is complete,
    or raises on every rank.
    """
    if not isinstance(state, StepState):
        raise TypeError(f"fs.checkpoint.save_dcp expects the StepState of a sharded step; got {type(state).__name__}")
    check_not_donated(state, OPERATION)
    _check_shards(state.params)
    layout, mesh = state.params.layout, state.params.mesh
    mesh.agree(OPERATION)
    path = Path(os.path.abspath(path))
    groups = layout_groups(layout, mesh)  # a pipelined state: one per pipeline coordinate
    layouts = "" if len(set(groups)) > 1 else f"|{layout.signature()}"  # (several: compared tensor by tensor below)
    mesh.check_same("the DCP checkpoint's path and contents", f"{path}{layouts}|{model_key}|{optim_key}|{param_groups!r}")
    adam = None
    if optim_key is not None:
        leaves, _, k = _adamw_of(state.opt_state)
        adam = leaves[k]
    leader = groups[mesh.rank]
    tensors, owner = _catalog(layout, adam, model_key, optim_key), None
    if len(set(groups)) > 1:
        tensors, owner = _union(tensors, groups, mesh)
    trainable = [t.ident[1] for t in tensors if t.ident[0] == ADAMW_STATE[0]]  # (one exp_avg per trainable leaf)
    objects = _param_groups(param_groups, trainable, optim_key) if optim_key is not None else []
    writer = writers_of(layout, mesh, groups if owner is not None else None, always=leader).get(mesh.rank)
    names = state_dict_names(layout)
    mine = _boxes(layout, adam, writer, mesh.model_axes) if writer is not None else []
    if mesh.rank == leader:
        mine += _whole_items(layout, adam, names)
    if owner is not None:  # what an earlier layout stores is left to it
        mine = [item for item in mine if owner[_ident(item, layout, names)] == leader]
    if mesh.rank != 0:
        objects = []

    # Rank 0 makes the directory; every writing rank writes its file there.
    code, error = 0, None
    if mesh.rank == 0:
        try:
            if path.exists() and not overwrite:
                raise CheckpointError(f"{path} already exists: pass overwrite=True to replace it (or save elsewhere)")
            code = secrets.randbits(62) + 1
            path.parent.mkdir(parents=True, exist_ok=True)
            _partial(path, code).mkdir()
        except Exception as e:  # noqa: BLE001 (every rank must learn of it)
            code, error = -1, e
    code = mesh.agree(OPERATION, code)[0]
    if error is not None:
        raise error
    if code == -1:
        raise CheckpointError(
            f"rank 0 could not start the DCP checkpoint at {path} (see its error); nothing was written"
        )
    tmp = _partial(path, code)
    lengths: list[int] = []
    try:
        if mine or objects:
            values = [_value(state, adam, item) for item in mine] + [value for _, _, value in objects]
            lengths = _write_file(tmp / data_file(mesh.rank), values)
    except Exception as e:  # noqa: BLE001
        error = e
    told = {"failed": error is not None, "items": [[*_ident(item, layout, names), item.offsets, item.sizes] for item in mine],
            "lengths": lengths}  # fmt: skip
    everyone = [json.loads(text) for text in gather_texts(mesh, json.dumps(told))]
    failed = [r for r in range(mesh.world_size) if everyone[r]["failed"]]
    committed = 0
    if not failed and mesh.rank == 0:
        try:
            write_durably(tmp / METADATA, _metadata(tensors, everyone, objects))
            fsync_dir(tmp)
            _commit(tmp, path, overwrite, code)
            committed = 1
        except Exception as e:  # noqa: BLE001
            error = e
    if mesh.rank == 0 and not committed:
        shutil.rmtree(tmp, ignore_errors=True)
    committed = mesh.agree(OPERATION, committed)[0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(
            f"ranks {failed} could not write their part of {path} (see their errors); nothing was saved"
        )
    if not committed:
        raise CheckpointError(f"rank 0 could not complete {path} (see its error); nothing was saved")


class _Item(NamedTuple):
    """One stored tensor item: a box of a leaf (or of its moment), or a whole tensor."""

    leaf: int  # the leaf, or -1 for AdamW's count
    source: str  # "params", a moment's name ("exp_avg", ...), or "count"
    offsets: tuple[int, ...]  # the box in the (full) leaf
    sizes: tuple[int, ...]
    buffer: int  # the buffer whose shard holds it, or -1: a whole tensor
    shard_offset: int  # where the elements of the box of this rank's piece start in that shard
    piece_box: tuple[int, ...] = ()  # that box's sizes, when a split leaf's item is a part of it
    narrow: tuple[int, int, int] | None = None  # (dim, start, length): the part, along the split dimension


def _moments(adam: Any) -> list[str]:
    if adam is None:
        return []
    return [*ADAMW_STATE, *(["max_exp_avg_sq"] if adam.max_exp_avg_sq is not None else [])]


def _boxes(layout: Layout, adam: Any, writer: Writer, model_axes: tuple[str, ...]) -> list[_Item]:
    """What `writer` stores: for each piece of a leaf in its shards (`_save.writer_pieces`: of this
    rank's tensor-parallel piece of a split leaf), the row blocks that tile it, for the
    parameter and each moment, as boxes of the full leaf (a box of a piece split with `chunks`
    is one box per chunk it meets). Leaves with no elements are stored whole (`_whole_items`)."""
    out = []
    for _, k, piece, _, _ in writer_pieces(layout, [], writer, model_axes):
        spec = layout.buffers[k]
        shape = tuple(layout.shapes[piece.leaf])
        for source in ["params", *(_moments(adam) if spec.trainable else [])]:
            position = piece.shard_offset
            for box in flat_range_slices(shape, piece.leaf_offset, piece.leaf_offset + piece.length):
                offsets = tuple(s.start for s in box) + (0,) * (len(shape) - len(box))
                sizes = tuple(s.stop - s.start for s in box) + shape[len(box) :]
                out += _in_full_leaf(layout, piece.leaf, writer.coordinates, source, offsets, sizes, k, position)
                position += _numel(sizes)
    return out


def _in_full_leaf(layout: Layout, leaf: int, coordinates, source: str, offsets, sizes, k: int, position: int) -> list[_Item]:
    """The box `offsets`/`sizes` of the piece of `leaf` held at `coordinates`, as items over
    the full leaf: itself for a leaf held whole; shifted along the split dimension by the
    piece's place, and cut at the chunks' edges (`Split(chunks=...)`), for a split one."""
    placement = layout.placement(leaf)
    if placement is None:
        return [_Item(leaf, source, offsets, sizes, k, position)]
    dim, chunks = placement.dim, placement.chunks
    per = layout.shapes[leaf][dim] // chunks  # a chunk's rows in the piece
    block = layout.full_shape(leaf)[dim] // chunks  # a chunk's rows in the full leaf
    index = coordinates[placement.axis]
    lo, hi = offsets[dim], offsets[dim] + sizes[dim]
    out = []
    for c in range(chunks):
        a, b = max(lo, c * per), min(hi, (c + 1) * per)
        if a < b:
            full_offsets = (*offsets[:dim], c * block + index * per + (a - c * per), *offsets[dim + 1 :])
            part = (*sizes[:dim], b - a, *sizes[dim + 1 :])
            narrow = None if (a, b) == (lo, hi) else (dim, a - lo, b - a)
            out.append(_Item(leaf, source, full_offsets, part, k, position, tuple(sizes), narrow))
    return out


def _whole_items(layout: Layout, adam: Any, names: list[tuple[str, ...]]) -> list[_Item]:
    """Rank 0's whole tensors: module buffers (but non-persistent ones, which no state dict
    holds), leaves with no elements, AdamW's count."""
    out = []
    for i in range(len(layout.paths)):
        shape = layout.full_shape(i)
        if (i in layout.local and names[i]) or (i not in layout.local and _numel(tuple(shape)) == 0):
            trainable = i not in layout.local and any(spec.trainable and i in spec.leaves for spec in layout.buffers)
            for source in ["params", *(_moments(adam) if trainable else [])]:
                out.append(_Item(i, source, (0,) * len(shape), tuple(shape), -1, 0))
    if adam is not None:
        out.append(_Item(-1, "count", (), (), -1, 0))
    return out


def _value(state: StepState, adam: Any, item: _Item) -> torch.Tensor:
    """The tensor of an item on the rank that writes it (a CPU copy)."""
    layout = state.params.layout
    if item.source == "count":
        return adam.count.detach().to("cpu", copy=True)
    if item.buffer < 0:
        if item.leaf in layout.local:
            return state.params.local[layout.local.index(item.leaf)].detach().to("cpu", copy=True)
        dtype = layout.dtypes[item.leaf] if item.source == "params" else _moment_dtype(layout, adam, item)
        return torch.empty(item.sizes, dtype=dtype)
    spec = layout.buffers[item.buffer]
    shard = state.params.shards[item.buffer] if item.source == "params" else getattr(adam, item.source)[spec.name]
    box = item.piece_box or item.sizes
    part = shard.detach()[item.shard_offset : item.shard_offset + _numel(box)].view(box)
    if item.narrow is not None:
        part = part.narrow(*item.narrow)
    return part.to("cpu", copy=True).contiguous()


def _moment_dtype(layout: Layout, adam: Any, item: _Item) -> torch.dtype:
    spec = next(s for s in layout.buffers if item.leaf in s.leaves)
    return getattr(adam, item.source)[spec.name].dtype


def _write_file(file: Path, values: list[Any]) -> list[int]:
    """Write `torch.save` of each value back to back into a new `file`; their byte lengths."""
    lengths = []
    with create_new_file(file) as f:
        for value in values:
            lengths.append(write_item(f, value)[1])
        f.flush()
        os.fsync(f.fileno())
    return lengths


def _param_groups(
    groups: Sequence[Mapping[str, Any]] | None, trainable: list[str], optim_key: str
) -> list[tuple[str, tuple, Any]]:
    """(flattened key, path, value) for every field of every group (`trainable`: the names of
    every trainable leaf); checked."""
    if groups is None:
        return []
    if isinstance(groups, Mapping) or not all(isinstance(g, Mapping) for g in groups) or not groups:
        raise TypeError("param_groups must be a list of dicts (torch.optim's param_groups), e.g. [{'lr': 1e-3, ...}]")
    out = []
    for g, group in enumerate(groups):
        group = dict(group)
        if "params" not in group:
            if len(groups) > 1:
                raise ValueError(
                    f"param_groups[{g}] has no 'params': with several groups, each must name its parameters"
                )
            group["params"] = trainable
        unknown = [p for p in group["params"] if p not in trainable]
        if unknown:
            raise ValueError(
                f"param_groups[{g}]['params'] names {unknown[:3]}, which are not trainable leaves of this state"
            )
        for field, value in group.items():
            if not _plain(value):
                raise ValueError(
                    f"param_groups[{g}][{field!r}] is a {type(value).__name__}: only plain values (numbers, bools, "
                    f"strings, None, tuples and lists of them) are written"
                )
            out.append((f"{optim_key}.param_groups.{g}.{field}", (optim_key, "param_groups", g, str(field)), value))
    return out


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _ident(item: _Item, layout: Layout, names: list[tuple[str, ...]]) -> tuple[str, str]:
    """What an item stores: (source, the leaf's first state-dict name), ("count", "") for the count."""
    if item.source == "count":
        return ("count", "")
    return (item.source, names[item.leaf][0] if names[item.leaf] else layout.paths[item.leaf])


class Stored(NamedTuple):
    """A tensor of the checkpoint's index, and what stores its values (`_ident`)."""

    key: str  # flattened key
    path: tuple[str, ...]  # in the nested state dict
    shape: tuple[int, ...]
    dtype: torch.dtype
    ident: tuple[str, str]  # tied names share one; every parameter's `step` is the count


def _catalog(layout: Layout, adam: Any, model_key: str | None, optim_key: str | None) -> list[Stored]:
    """Every tensor this layout puts in the index: each state-dict name of each leaf, then each
    trainable leaf's moments and `step`."""
    names = state_dict_names(layout)
    out = []
    for i in range(len(layout.paths)):
        for name in names[i]:
            key, path = (name, (name,)) if model_key is None else (f"{model_key}.{name}", (model_key, name))
            out.append(Stored(key, path, tuple(layout.full_shape(i)), layout.dtypes[i], ("params", names[i][0])))
    if adam is not None:
        for spec in layout.buffers:
            if spec.trainable:
                for i in spec.leaves:
                    fqn = names[i][0] if names[i] else layout.paths[i]
                    for source in _moments(adam):
                        dtype = getattr(adam, source)[spec.name].dtype
                        out.append(Stored(f"{optim_key}.state.{fqn}.{source}", (optim_key, "state", fqn, source),
                                          tuple(layout.full_shape(i)), dtype, (source, fqn)))  # fmt: skip
                    out.append(Stored(f"{optim_key}.state.{fqn}.step", (optim_key, "state", fqn, "step"), (),
                                      adam.count.dtype, ("count", "")))  # fmt: skip
    return out


def _union(mine: list[Stored], groups: tuple[int, ...], mesh: Any) -> tuple[list[Stored], dict[tuple[str, str], int]]:
    """Every layout's tensors (the first rank of each describes its own; a pipelined state's
    coordinates hold different stages), each stored by the first layout in rank order that holds
    it, with that layout's owner: the index's tensors and `owner`. A collective. Two layouts
    holding one tensor with different shapes or dtypes is a `CheckpointError` on every rank."""
    described = [[t.key, list(t.path), list(t.shape), str(t.dtype).removeprefix("torch."), list(t.ident)] for t in mine]
    tensors: dict[str, Stored] = {}
    owner: dict[tuple[str, str], int] = {}
    for g, told in layouts_say(mesh, groups, described).items():
        for key, path, shape, dtype, ident in told:
            t = Stored(key, tuple(path), tuple(shape), getattr(torch, dtype), tuple(ident))
            held = tensors.setdefault(key, t)
            if (held.shape, held.dtype) != (t.shape, t.dtype):
                raise CheckpointError(
                    f"{key}: rank {owner[held.ident]} holds it as {held.dtype} {list(held.shape)} but rank {g} as "
                    f"{t.dtype} {list(t.shape)}: the ranks hold different models; nothing was written"
                )
            owner.setdefault(t.ident, g)
    owner.setdefault(("count", ""), groups[0])  # the count is rank 0's
    return list(tensors.values()), owner


def _metadata(tensors: list[Stored], everyone: list[dict], objects: list[tuple[str, tuple, Any]]) -> bytes:
    """The `.metadata` for the items every rank wrote (`everyone[rank]`: each item's ident, box
    and length, in its file's order) and rank 0's objects, written after its items."""
    where: dict[tuple[str, str], list] = {}
    placed = []
    for rank, told in enumerate(everyone):
        offset = 0
        for (source, fqn, offsets, sizes), length in zip(told["items"], told["lengths"]):
            where.setdefault((source, fqn), []).append((tuple(offsets), tuple(sizes), data_file(rank), offset, length))
            offset += length
        if rank == 0:
            lengths = told["lengths"][len(told["items"]) :]
            for (key, path, _), length in zip(objects, lengths):
                placed.append((key, path, data_file(0), offset, length))
                offset += length
    planned = [PlannedTensor(t.key, t.path, t.shape, t.dtype, where[t.ident]) for t in tensors]
    return metadata_bytes(planned, placed)


def _partial(path: Path, code: int) -> Path:
    return path.with_name(f"{path.name}.partial-{code:016x}")


def _commit(tmp: Path, path: Path, overwrite: bool, code: int) -> None:
    """Move the finished directory to `path` (an existing one, with `overwrite`, aside first)."""
    old = None
    if path.exists():
        if not overwrite:
            raise CheckpointError(f"{path} already exists: pass overwrite=True to replace it")
        old = path.with_name(f"{path.name}.old-{code:016x}")
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- the files --------------------------------------------------------------------------------------


def data_file(rank: int) -> str:
    """The data file of `rank`, named as torch's FileSystemWriter names it."""
    return f"__{rank}_0.distcp"


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` as the new file `path`, fsynced."""
    with create_new_file(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_item(f, value: Any) -> tuple[int, int]:
    """Append `torch.save(value)` to the open file `f`; returns its (offset, length)."""
    offset = f.tell()
    torch.save(value, f)
    return offset, f.tell() - offset


class PlannedTensor(NamedTuple):
    """A tensor as `metadata_bytes` records it."""

    key: str  # flattened key
    path: tuple[str | int, ...]  # its path in the nested state dict
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], str, int, int]]  # (offsets, sizes, file, offset, length)


def metadata_bytes(tensors: list[PlannedTensor], objects: list[tuple[str, tuple, str, int, int]]) -> bytes:
    """The `.metadata` pickle that `dcp.load` reads, for these tensors and objects
    (`(key, path, file, offset, length)`), built from torch's own metadata classes."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    for t in tensors:
        chunks = []
        for offsets, sizes, file, offset, length in t.chunks:
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            storage[MetadataIndex(t.key, offsets, len(chunks) - 1)] = filesystem._StorageInfo(file, offset, length)
        state_dict_metadata[t.key] = TensorStorageMetadata(TensorProperties(dtype=t.dtype), torch.Size(t.shape), chunks)
        planner[t.key] = t.path
    for key, path, file, offset, length in objects:
        state_dict_metadata[key] = BytesStorageMetadata()
        storage[MetadataIndex(key)] = filesystem._StorageInfo(file, offset, length)
        planner[key] = path
    metadata = Metadata(
        state_dict_metadata,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=filesystem.CURRENT_DCP_VERSION,
    )
    return pickle.dumps(metadata)
