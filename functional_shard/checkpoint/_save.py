"""`save`: every rank writes its own chunks of a `StepState`; rank 0 commits the directory."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from .._layout import Layout
from .._mesh import BaseMesh, _coordinates
from .._shard import _check_shards
from .._step import StepState, check_not_donated
from . import _files
from ._format import (
    FORMAT,
    INDEX,
    VERSION,
    CheckpointError,
    OptimizerSlot,
    Piece,
    entries_of,
    entry_to_json,
    model_key,
    optimizer_key,
    optimizer_slots,
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
    replicated optimizer leaves such as the step count) and the step number.

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
    mesh.check_same("the checkpoint's path and contents", f"{path}|{layout.signature()}|{structure}")
    writers = writers_of(layout, mesh)

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
            index = _index(state, slots, str(structure), writers, _save_id(code))
            _files.write_bytes(tmp / INDEX, _json(index))
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
            tensors = _rank_tensors(state, slots, writers[mesh.rank], whole=mesh.rank == 0)
            version = _version(entries_of(layout, slots))
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
            ranks = sorted(writers)
            marker = {
                "save": _save_id(code),
                "files": {rank_file(r): sizes[r] for r in ranks},
                "headers": {rank_file(r): f"{headers[r]:08x}" for r in ranks},
            }
            _files.commit(tmp, path, marker, overwrite, f"{code:016x}", _version(entries_of(layout, slots)))
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
    import json

    return json.dumps(index, indent=1).encode()


class Writer(NamedTuple):
    """A rank that writes chunks, and where it sits."""

    shard_index: int  # its coordinate on the shard axis (0 without one)
    coordinates: dict[str, int]  # its coordinate on every mesh axis


def writers_of(layout: Layout, mesh: BaseMesh) -> dict[int, Writer]:
    """Rank -> `Writer`, for every rank that writes a file: rank 0, and each rank at coordinate 0
    on every replicate axis that holds a chunk no other such rank writes (see `writer_pieces`)."""
    out = {}
    for rank in range(mesh.world_size):
        coordinates = _coordinates(mesh, rank)
        if any(coordinates[axis] != 0 for axis in mesh.replicate_axes):
            continue
        writer = Writer(coordinates[mesh.shard_axis] if mesh.shard_axis is not None else 0, coordinates)
        if rank == 0 or next(writer_pieces(layout, [], writer, mesh.model_axes), None) is not None:
            out[rank] = writer
    return out


def _version(entries) -> int:
    """The format version a save writes: 3 when a tensor is stored in a split order, else 2
    (what a functional_shard without tensor parallelism reads)."""
    return VERSION if any(entry.split is not None for entry in entries) else 2


def writer_pieces(
    layout: Layout, slots: list[OptimizerSlot], writer: Writer, model_axes: tuple[str, ...]
) -> Iterator[tuple[str, int, Piece, int, OptimizerSlot | None]]:
    """(key, buffer position, piece, where the piece starts in the stored leaf, optimizer slot or
    None for parameters) for every chunk that `writer` writes: those of the pieces of its shard
    of each buffer whose leaf it holds at coordinate 0 on every model-parallel axis the leaf is
    not split over (so that a leaf every rank of `tp` holds whole is written once)."""
    for k, spec in enumerate(layout.buffers):
        for piece in shard_pieces(spec, writer.shard_index):
            placement = layout.placement(piece.leaf)
            if any(writer.coordinates[a] != 0 for a in model_axes if placement is None or a != placement.axis):
                continue
            start = piece_start(layout, piece.leaf, writer.coordinates) + piece.leaf_offset
            yield model_key(layout, piece.leaf), k, piece, start, None
            if spec.trainable:
                for slot in slots:
                    if slot.param_like:
                        yield optimizer_key(slot.path, layout.paths[piece.leaf]), k, piece, start, slot


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


def _rank_tensors(state: StepState, slots: list[OptimizerSlot], writer: Writer, whole: bool) -> dict[str, torch.Tensor]:
    """This rank's chunks (fresh CPU copies: safetensors refuses tensors that share memory)."""
    sharded = state.params
    tensors = {}
    for key, k, piece, start, slot in writer_pieces(sharded.layout, slots, writer, sharded.mesh.model_axes):
        spec = sharded.layout.buffers[k]
        shard = sharded.shards[k] if slot is None else slot.value[spec.name]
        tensors[_chunk_name(key, start)] = shard.detach()[piece.shard_offset : piece.shard_offset + piece.length].to("cpu", copy=True)
    if whole:
        for key, tensor in _whole(state, slots):
            if tensor.numel():
                tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
    return tensors


def _index(state: StepState, slots: list[OptimizerSlot], structure: str, writers: dict[int, Writer], save: str) -> dict:
    import functional_shard

    layout, mesh = state.params.layout, state.params.mesh
    entries = entries_of(layout, slots, step_tensors(state))
    chunks: dict[str, list[list]] = {entry.key: [] for entry in entries}
    for rank, writer in writers.items():
        file = rank_file(rank)
        for key, _, piece, start, _ in writer_pieces(layout, slots, writer, mesh.model_axes):
            chunks[key].append([file, _chunk_name(key, start), start, piece.length])
    for key, tensor in _whole(state, slots):
        if tensor.numel():
            chunks[key].append([rank_file(0), key, 0, tensor.numel()])
    return {
        "format": FORMAT,
        "version": _version(entries),
        "save": save,
        "step": int(state.step),
        "optimizer_structure": structure,
        "saved_by": {
            "mesh": mesh.shape,
            "shard_axis": mesh.shard_axis,
            "placements": {layout.paths[i]: repr(p) for i, p in enumerate(layout.placements) if p is not None},
            "world_size": mesh.world_size,
            "units": list(layout.units),
            "torch": torch.__version__,
            "functional_shard": functional_shard.__version__,
        },
        "files": {rank_file(rank): rank for rank in sorted(writers)},
        "entries": [entry_to_json(entry, chunks[entry.key]) for entry in entries],
    }
