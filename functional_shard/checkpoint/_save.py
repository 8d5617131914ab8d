"""`save`: every rank writes its own chunks of a `StepState`; rank 0 commits the directory."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from .._layout import Layout
from .._mesh import BaseMesh, _coordinates
from .._placed import gather_texts, layout_groups
from .._shard import _check_shards
from .._step import StepState, check_not_donated
from . import _files
from ._format import (
    FORMAT,
    INDEX,
    VERSION,
    CheckpointError,
    Entry,
    OptimizerSlot,
    Piece,
    entries_of,
    entry_from_json,
    entry_to_json,
    model_key,
    optimizer_key,
    optimizer_slots,
    parse_dtype,
    piece_start,
    rank_file,
    shard_pieces,
    step_tensors,
)

__all__ = ["save"]

OPERATION = "fs.checkpoint.save"  # the name every rank states on entering (`BaseMesh.agree`)


def save(path: str | os.PathLike, state: StepState, *, overwrite: bool = False) -> None:
    """Save a training state as a sharded checkpoint directory at `path`; every rank calls it.

    Arguments:
        path: the checkpoint directory to create, the same on every rank, on a file system every
            rank sees. Its parent is created if needed.
        state: a `StepState` (from `step.init` or a step), this rank's part of it.
        overwrite: replace an existing checkpoint at `path` (default: raise `CheckpointError`).
            Only ever a committed functional_shard checkpoint: a directory with a `COMMIT`
            marker and no other files than the checkpoint's. Anything else at `path` (a link, a
            file, a run directory with a log) raises `CheckpointError` and is left untouched.

    Each shard rank writes only its own chunks (`rank-XXXXX.safetensors`): the pieces of each
    parameter and parameter-like optimizer tensor its shards hold. On a hybrid mesh only the
    replica with coordinate 0 on every replicate axis writes, so no chunk is written twice. On a
    mesh with a tensor-parallel axis, each rank of it writes its own pieces of the leaves split
    over it (stored in the leaf's split order, see `_format`), and the leaves every rank of the
    axis holds whole are written by the ranks at coordinate 0 on it. Rank 0 also writes the
    index, the whole tensors (module buffers: rank 0's, as a full state dict holds them;
    replicated optimizer leaves such as the step count) and the step number. Ranks may hold
    different leaves (a pipelined step: the ranks of each pipeline coordinate hold its stages'
    units): each tensor is then stored by the ranks of the first layout, in rank order, that
    holds it, by the rules above, and the checkpoint is the same as one saved without a pipeline
    (`plan_save`).

    Atomic: everything goes to `<path>.partial-<token>/`, and only once every rank has written
    its file does rank 0 write the `COMMIT` marker and rename the directory to `path`. A save
    that fails or is killed part-way leaves any previous checkpoint untouched, and `load` refuses
    the partial directory, saying which files are missing; a save that fails (a rank's write,
    or the commit: a concurrent save that committed first, a rename refused) removes it. A
    collective: returns on every rank once the checkpoint is committed, or raises on every rank.

    Bound: the save's identity (`token`) is in the index, the marker and every rank file; each
    rank file holds the CRC-32 of each of its tensors, and the marker the CRC-32 of each file's
    header, so that `load` refuses a changed byte or a file of another save (see `_files`).
    """
    if not isinstance(state, StepState):
        raise TypeError(f"fs.checkpoint.save expects the StepState of a sharded step; got {type(state).__name__}")
    check_not_donated(state, "fs.checkpoint.save")
    _check_shards(state.params)
    layout, mesh = state.params.layout, state.params.mesh
    mesh.agree(OPERATION)
    slots, structure = optimizer_slots(state.opt_state, layout)
    path = Path(os.path.abspath(path))
    mesh.check_same("the checkpoint's path and optimizer state", f"{path}|{structure}")
    plan = plan_save(state, slots)  # raises on every rank alike (ranks holding one leaf differently)
    writers = plan.writers

    # Rank 0 picks the directory to write into and writes the index there first, so that an
    # interrupted save can always say which files it lacks.
    code, created, error = 0, False, None
    if mesh.rank == 0:
        try:
            if os.path.lexists(path):
                if not overwrite:
                    raise CheckpointError(f"{path} already exists: pass overwrite=True to replace it (or save elsewhere)")
                _files.refuse_unless_checkpoint(path)
            code = _new_token()
            tmp = _partial(path, code)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.mkdir()  # never a directory or link that was there before
            except FileExistsError:
                raise CheckpointError(
                    f"{tmp} already exists (planted there?): a save never writes into a directory or link it did not "
                    f"create; remove it and save again"
                ) from None
            created = True
            index = _json(_index(state, slots, str(structure), plan, _save_id(code)))
            _files.write_bytes(tmp / INDEX, index)
            index_crc = _files.crc32_hex(index)
        except Exception as e:  # noqa: BLE001 (every rank must learn of it)
            if created:
                shutil.rmtree(_partial(path, code), ignore_errors=True)
            code, error = -1, e
    code = mesh.agree(OPERATION, code)[0]
    if error is not None:
        raise error
    if code == -1:
        raise CheckpointError(f"rank 0 could not start the checkpoint at {path} (see its error); nothing was written")
    tmp = _partial(path, code)

    size, header, error = 0, "0", None
    if mesh.rank in writers:
        try:
            tensors = _rank_tensors(state, slots, writers[mesh.rank], plan)
            version = _version(plan.entries)
            metadata = {"format": FORMAT, "version": str(version), "rank": str(mesh.rank), "save": _save_id(code)}
            size, header = _files.write_rank_file(tmp / rank_file(mesh.rank), tensors, metadata)
        except Exception as e:  # noqa: BLE001
            error = e
    sizes = mesh.agree(OPERATION, -1 if error else size)
    headers = mesh.agree(OPERATION, int(header, 16) if size else 0)  # CRC-32s of the files' headers
    failed = [r for r, size in enumerate(sizes) if size < 0]
    committed = 0
    if not failed and mesh.rank == 0:
        try:
            ranks = plan.files
            marker = {
                "save": _save_id(code),
                "files": {rank_file(r): sizes[r] for r in ranks},
                "headers": {rank_file(r): f"{headers[r]:08x}" for r in ranks},
                "index": index_crc,  # the index's CRC-32: a changed step, split or chunk place is refused
            }
            _files.commit(tmp, path, marker, overwrite, f"{code:016x}", _version(plan.entries))
            committed = 1
        except Exception as e:  # noqa: BLE001
            error = e
    if mesh.rank == 0 and not committed:
        shutil.rmtree(tmp, ignore_errors=True)  # once moved into place it is no longer there
    committed = mesh.agree(OPERATION, committed)[0]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"ranks {failed} could not write their part of {path} (see their errors); nothing was committed")
    if not committed:
        raise CheckpointError(f"rank 0 could not commit {path} (see its error); the previous checkpoint, if any, is intact")


def _new_token() -> int:
    """A save's random token (62 bits, never 0): its partial directory's name and its identity."""
    return secrets.randbits(62) + 1


def _save_id(code: int) -> str:
    return f"{code:016x}"


def _partial(path: Path, code: int) -> Path:
    return path.with_name(f"{path.name}.partial-{code:016x}")


def _json(index: dict) -> bytes:
    return json.dumps(index, indent=1).encode()


class Writer(NamedTuple):
    """A rank that writes chunks, and where it sits."""

    shard_index: int  # its coordinate on the shard axis (0 without one)
    coordinates: dict[str, int]  # its coordinate on every mesh axis
    # The axes along which no rank of a lower coordinate (the others equal) holds its layout
    # (`layout_groups`); None: every rank holds one layout, and these are the axes where its
    # coordinate is 0.
    first: frozenset[str] | None = None

    def is_first(self, axis: str) -> bool:
        return self.coordinates[axis] == 0 if self.first is None else axis in self.first


def _first_axes(mesh: BaseMesh, groups: tuple[int, ...], rank: int) -> frozenset[str]:
    """The axes along which every rank of a lower coordinate than `rank` (the others equal) has
    another layout than `rank` (`groups`: `layout_groups`)."""
    coordinates, stride, strides = _coordinates(mesh, rank), 1, {}
    for name, size in reversed(list(zip(mesh.axis_names, mesh.axis_sizes))):
        strides[name], stride = stride, stride * size
    return frozenset(
        axis
        for axis in mesh.axis_names
        if all(groups[rank - k * strides[axis]] != groups[rank] for k in range(1, coordinates[axis] + 1))
    )


def writers_of(
    layout: Layout, mesh: BaseMesh, groups: tuple[int, ...] | None = None, keep=None, always: int | None = 0
) -> dict[int, Writer]:
    """Rank -> `Writer`, for every rank of this rank's layout that writes a file: `always` (rank
    0, which writes the whole tensors), and each rank first on every replicate axis that holds a
    chunk no other such rank writes (see `writer_pieces`; `keep`: which keys it stores).

    `groups` (`layout_groups`): which ranks share this rank's layout; None: every rank does."""
    out = {}
    for rank in range(mesh.world_size):
        if groups is not None and groups[rank] != groups[mesh.rank]:
            continue
        coordinates = _coordinates(mesh, rank)
        first = None if groups is None else _first_axes(mesh, groups, rank)
        writer = Writer(coordinates[mesh.shard_axis] if mesh.shard_axis is not None else 0, coordinates, first)
        if any(not writer.is_first(axis) for axis in mesh.replicate_axes):
            continue
        if rank == always or next(writer_pieces(layout, [], writer, mesh.model_axes, keep), None) is not None:
            out[rank] = writer
    return out


class SavePlan(NamedTuple):
    """What a save stores and who writes what, the same on every rank (but `others`)."""

    entries: list[Entry]  # every tensor of the checkpoint: the union of what the ranks' layouts hold
    writers: dict[int, Writer]  # the ranks of this rank's layout that write a file
    keep: Any  # key -> whether this rank's layout stores it (no lower rank's layout holds it); None: every key
    whole: frozenset[str]  # the whole tensors this rank writes (rank 0: every one it holds, with one layout)
    others: dict[int, list]  # on rank 0, with several layouts: the other layouts' files -> [key, name, start, length]
    saved_by: dict  # the units and placements of every layout, for the index

    @property
    def files(self) -> list[int]:
        """The ranks that write a file (on rank 0: all of them)."""
        return sorted({*self.writers, *self.others})


def plan_save(state: StepState, slots: list[OptimizerSlot]) -> SavePlan:
    """Who writes what. With one layout on every rank (`layout_groups`), each leaf's chunks are
    written by the ranks first on every replicate axis and on every model-parallel axis but the
    leaf's own split (`writer_pieces`). Ranks may also hold different leaves (a pipelined step's
    ranks hold their stages): then the first rank of each layout describes it to the others, each
    tensor is stored by the first layout (in rank order) that holds it, with that layout's
    writers, and the ranks of other layouts tell rank 0 their chunks for the index. A collective.

    Raises `CheckpointError` on every rank if two layouts hold one leaf with different shapes or
    dtypes."""
    layout, mesh = state.params.layout, state.params.mesh
    own = entries_of(layout, slots, step_tensors(state))
    groups = layout_groups(layout, mesh)
    saved_by = {
        "placements": {layout.paths[i]: repr(p) for i, p in enumerate(layout.placements) if p is not None},
        "units": list(layout.units),
    }
    if len(set(groups)) == 1:
        whole = frozenset(e.key for e in own if not e.sharded) if mesh.rank == 0 else frozenset()
        return SavePlan(own, writers_of(layout, mesh), None, whole, {}, saved_by)
    leader = groups[mesh.rank]
    message: dict[str, Any] = {}
    if mesh.rank == leader:
        message = {"entries": [entry_to_json(e, []) for e in own], **saved_by}
    candidates = writers_of(layout, mesh, groups, always=leader)
    if leader != groups[0] and mesh.rank in candidates:
        pieces = writer_pieces(layout, slots, candidates[mesh.rank], mesh.model_axes)
        message["chunks"] = [[key, start, piece.length] for key, _, piece, start, _ in pieces]
    messages = [json.loads(text) if text else {} for text in gather_texts(mesh, json.dumps(message))]

    owner: dict[str, int] = {}
    merged: dict[str, Entry] = {}
    order = []
    for g in sorted(set(groups)):
        for position, item in enumerate(messages[g]["entries"]):
            split = item.get("split")
            entry = Entry(item["key"], tuple(item["shape"]), parse_dtype(item["dtype"]), item["sharded"], split and tuple(split))
            held = merged.get(entry.key)
            if held is None:
                owner[entry.key], merged[entry.key] = g, entry
                order.append((_part(entry.key), g, position, entry.key))
            elif (held.shape, held.dtype) != (entry.shape, entry.dtype):
                raise CheckpointError(
                    f"rank {owner[entry.key]} holds {entry.key!r} as {held.describe()} but rank {g} as "
                    f"{entry.describe()}: the ranks hold different models; nothing was written"
                )
        saved_by["units"] += [u for u in messages[g]["units"] if u not in saved_by["units"]]
        saved_by["placements"].update(messages[g]["placements"])

    def keep(key: str) -> bool:
        return owner[key] == leader

    held_whole = [e for e in own if not e.sharded and e.numel and keep(e.key)]
    whole = frozenset(e.key for e in held_whole) if mesh.rank == leader else frozenset()
    writers = writers_of(layout, mesh, groups, keep, always=leader if whole else None)
    others: dict[int, list] = {}
    if mesh.rank == 0:
        for rank, message in enumerate(messages):
            rows = [[key, _chunk_name(key, start), start, n] for key, start, n in message.get("chunks", ()) if owner[key] == groups[rank]]
            if rows:
                others[rank] = rows
        for key, entry in merged.items():
            if not entry.sharded and entry.numel and owner[key] != groups[0]:
                others.setdefault(owner[key], []).append([key, key, 0, entry.numel])
    entries = [merged[key] for *_, key in sorted(order)]
    return SavePlan(entries, writers, keep, whole, others, saved_by)


def _part(key: str) -> int:
    """Where a key goes in the index: model leaves, then optimizer state, then the step's own."""
    return 0 if key.startswith("params/") else 1 if key.startswith("opt/") else 2


def _version(entries) -> int:
    """The format version a save writes: 3 when a tensor is stored in a split order, else 2
    (what a functional_shard without tensor parallelism reads)."""
    return VERSION if any(entry.split is not None for entry in entries) else 2


def writer_pieces(
    layout: Layout, slots: list[OptimizerSlot], writer: Writer, model_axes: tuple[str, ...], keep=None
) -> Iterator[tuple[str, int, Piece, int, OptimizerSlot | None]]:
    """(key, buffer position, piece, where the piece starts in the stored leaf, optimizer slot or
    None for parameters) for every chunk that `writer` writes: those of the pieces of its shard
    of each buffer whose leaf it holds first (`Writer.is_first`: at coordinate 0, with one
    layout) on every model-parallel axis the leaf is not split over (so that a leaf every rank of
    `tp` holds whole is written once), and whose key `keep` (None: every key) says it stores."""
    for k, spec in enumerate(layout.buffers):
        for piece in shard_pieces(spec, writer.shard_index):
            placement = layout.placement(piece.leaf)
            if any(not writer.is_first(a) for a in model_axes if placement is None or a != placement.axis):
                continue
            start = piece_start(layout, piece.leaf, writer.coordinates) + piece.leaf_offset
            key = model_key(layout, piece.leaf)
            if keep is None or keep(key):
                yield key, k, piece, start, None
            if spec.trainable:
                for slot in slots:
                    key = optimizer_key(slot.path, layout.paths[piece.leaf])
                    if slot.param_like and (keep is None or keep(key)):
                        yield key, k, piece, start, slot


def _chunk_name(key: str, start: int) -> str:
    return f"{key}@{start}"


def _whole(state: StepState, slots: list[OptimizerSlot]) -> Iterator[tuple[str, torch.Tensor]]:
    layout = state.params.layout
    for i, leaf in zip(layout.local, state.params.local):
        yield model_key(layout, i), leaf
    for slot in slots:
        if not slot.param_like:
            yield optimizer_key(slot.path), slot.value
    yield from step_tensors(state)


def _rank_tensors(state: StepState, slots: list[OptimizerSlot], writer: Writer, plan: SavePlan) -> dict[str, torch.Tensor]:
    """This rank's chunks (fresh CPU copies: safetensors refuses tensors that share memory)."""
    sharded = state.params
    tensors = {}
    for key, k, piece, start, slot in writer_pieces(sharded.layout, slots, writer, sharded.mesh.model_axes, plan.keep):
        spec = sharded.layout.buffers[k]
        shard = sharded.shards[k] if slot is None else slot.value[spec.name]
        tensors[_chunk_name(key, start)] = shard.detach()[piece.shard_offset : piece.shard_offset + piece.length].to("cpu", copy=True)
    for key, tensor in _whole(state, slots):
        if key in plan.whole and tensor.numel():
            tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
    return tensors


def _index(state: StepState, slots: list[OptimizerSlot], structure: str, plan: SavePlan, save: str) -> dict:
    import functional_shard

    layout, mesh = state.params.layout, state.params.mesh
    chunks: dict[str, list[list]] = {entry.key: [] for entry in plan.entries}
    for rank, writer in plan.writers.items():
        file = rank_file(rank)
        for key, _, piece, start, _ in writer_pieces(layout, slots, writer, mesh.model_axes, plan.keep):
            chunks[key].append([file, _chunk_name(key, start), start, piece.length])
    for key, tensor in _whole(state, slots):
        if key in plan.whole and tensor.numel():
            chunks[key].append([rank_file(0), key, 0, tensor.numel()])
    for rank, rows in plan.others.items():
        for key, name, start, length in rows:
            chunks[key].append([rank_file(rank), name, start, length])
    items = [entry_to_json(entry, chunks[entry.key]) for entry in plan.entries]
    if plan.others:
        for item in items:  # the layouts' chunks tile every tensor (else: a bug, refused before any write)
            entry_from_json(item)
    return {
        "format": FORMAT,
        "version": _version(plan.entries),
        "save": save,
        "step": int(state.step),
        "optimizer_structure": structure,
        "saved_by": {
            "mesh": mesh.shape,
            "shard_axis": mesh.shard_axis,
            "placements": plan.saved_by["placements"],
            "world_size": mesh.world_size,
            "device": getattr(mesh, "device", torch.device("cpu")).type,
            "units": plan.saved_by["units"],
            "torch": torch.__version__,
            "functional_shard": functional_shard.__version__,
        },
        "files": {rank_file(rank): rank for rank in plan.files},
        "entries": items,
    }
