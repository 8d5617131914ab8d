"""`load`: every rank reads the ranges its own shards need, whatever layout wrote them; `read`:
a checkpoint's full tensors in one process."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._layout import BufferSpec, Layout
from .._mesh import BaseMesh
from .._shard import _check_shards
from .._step import StepState
from ..tensor_parallel._placement import split_tensor
from ._files import ChunkReader, open_index
from ._format import (
    CheckpointError,
    check_compatible,
    entries_of,
    model_key,
    optimizer_key,
    optimizer_slots,
    piece_start,
    shard_pieces,
    split_order,
    step_tensors,
)

__all__ = ["load", "read"]

OPERATION = "fs.checkpoint.load"  # the name every rank states on entering (`BaseMesh.agree`)


def load(path: str | os.PathLike, template: StepState, *, verify: bool = True, across_devices: bool = False) -> StepState:
    """The state saved at `path`, laid out like `template`; every rank calls it.

    Arguments:
        path: a checkpoint directory written by `fs.checkpoint.save`, the same on every rank.
        template: a `StepState` of the step that will continue training, e.g.
            `step.init(params)`: it gives the mesh, the unit layout and the optimizer state's
            structure. Its values are ignored and never modified.
        verify: check every chunk this rank reads against its CRC-32 (one more pass over the
            bytes read: see docs/checkpoints.md for what it costs). False skips only that: each
            file's header is still checked against the commit marker and the save's identity.
        across_devices: load a state saved from one kind of device (`cuda`, `cpu`: the saving
            mesh's) onto a template on another kind: the same bits, now on the template's device.
            Without it such a load is refused, naming both (a CUDA run's checkpoint read by a
            CPU job, or the reverse, is more often a wrong path or a wrong machine than a plan).

    Returns a new `StepState` of the template's step, holding the saved parameters, optimizer
    state and step number. The checkpoint may come from any world size, mesh (hybrid or not,
    with or without a tensor-parallel axis), placements or unit policy: each rank reads exactly
    the ranges of each leaf that its shards cover where the leaf is stored in the order its
    placement needs (the same split, or C order for a leaf it holds whole or splits along its
    first dimension); otherwise it reads the whole leaf, one at a time, and cuts its piece. The
    gathered values (`fs.gather(state.params, full=True)`) equal the saved ones bit for bit.
    Module buffers (stored once, from rank 0 at save time) are given to every rank. The ranks
    may hold different leaves (a pipelined step's ranks hold their stages' units: each reads
    its own); the checkpoint must then hold every rank's leaves, and every leaf it holds must be
    some rank's.

    Raises `CheckpointError`, on every rank and before any tensor is read, if the checkpoint is
    incomplete (naming what is missing: an interrupted save), is not a checkpoint, or does not
    fit the template (naming the first leaf whose path, shape or dtype differs, or the optimizer
    structure); or, once reading, if a file is damaged: a rank file of another save (copied from
    another checkpoint) or whose header changed, or a chunk whose bytes fail their CRC-32, naming
    the file (the template untouched). Reads JSON and safetensors only: nothing in the files is
    executed.
    """
    if not isinstance(template, StepState):
        raise TypeError(
            f"fs.checkpoint.load expects a template StepState (from step.init(params)); got {type(template).__name__}"
        )
    _check_shards(template.params)
    mesh = template.params.mesh
    mesh.agree(OPERATION)
    path = os.path.abspath(path)

    def failure(failed: list[int]) -> CheckpointError:
        return CheckpointError(f"ranks {failed} could not load {path} (see their errors); no rank loaded it")

    reader, error = None, None
    try:
        reader = ChunkReader(path, open_index(path), verify=verify)
        _check_device(reader.index, template, path, across_devices)
        slots, structure = optimizer_slots(template.opt_state, template.params.layout)
        expected = entries_of(template.params.layout, slots, step_tensors(template))
    except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
        error = e
    try:
        mesh.succeed_together(OPERATION, error, failure)
        covered = _covered(reader, expected, mesh)
        result, error = None, None
        try:
            result = _load_here(reader, template, slots, structure, expected, covered)
        except Exception as e:  # noqa: BLE001
            error = e
    finally:
        if reader is not None:
            reader.__exit__(None, None, None)
    mesh.succeed_together(OPERATION, error, failure)
    return result


def _check_device(index: dict, template: StepState, path: str, across_devices: bool) -> None:
    """Refuse a state saved on one kind of device for a template on another, unless asked."""
    saved = (index.get("saved_by") or {}).get("device")  # absent before 2026-11-27: any
    here = getattr(template.params.mesh, "device", torch.device("cpu")).type
    if saved is not None and saved != here and not across_devices:
        raise CheckpointError(
            f"checkpoint {path} holds a state saved from {saved} tensors, and the template's mesh is on {here}: "
            f"pass across_devices=True to load it onto {here} (the same bits, on the template's device)"
        )


def _covered(reader: ChunkReader, expected: list, mesh: BaseMesh) -> set[str]:
    """The checkpoint's tensors that some rank's state holds (every rank's the same when ranks
    hold different leaves: a pipelined step's stages). A collective: one all-reduce of a count
    per tensor of the checkpoint."""
    mine = {entry.key for entry in expected}
    keys = list(reader.entries)
    if mesh.world_size == 1:
        return mine & set(keys)
    held = torch.tensor([key in mine for key in keys] or [False], dtype=torch.int32)
    held = mesh.all_reduce_flat(held.to(getattr(mesh, "device", "cpu"))).cpu().tolist()
    return {key for key, count in zip(keys, held) if count}


def _load_here(reader: ChunkReader, template: StepState, slots, structure, expected, covered: set[str]) -> StepState:
    sharded = template.params
    layout, mesh = sharded.layout, sharded.mesh
    path, index = str(reader.directory), reader.index
    extras = step_tensors(template)
    saved = [entry for entry, _ in reader.entries.values()]
    check_compatible(saved, index.get("optimizer_structure"), expected, str(structure), f"checkpoint {path}", covered)
    step = index.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint {path} has a malformed step count {step!r:.40}")

    pieces = _Pieces(reader, layout, mesh)

    def model(i: int) -> str:
        return model_key(layout, i)

    shards = [
        _read_shard(pieces, layout, spec, mesh.shard_index, model, spec.dtype, s.device)
        for spec, s in zip(layout.buffers, sharded.shards)
    ]
    local = [reader.read(model(i)).to(t.device) for i, t in zip(layout.local, sharded.local)]
    leaves: list[Any] = []
    for slot in slots:
        if slot.param_like:

            def key_of(i: int, prefix: str = slot.path) -> str:
                return optimizer_key(prefix, layout.paths[i])

            leaves.append(
                {
                    spec.name: _read_shard(
                        pieces, layout, spec, mesh.shard_index, key_of, slot.value[spec.name].dtype, slot.value[spec.name].device
                    )
                    for spec in layout.buffers
                    if spec.trainable
                }
            )
        else:
            leaves.append(reader.read(optimizer_key(slot.path)).to(slot.value.device))
    own = {key: reader.read(key).to(value.device) for key, value in extras}
    opt_state = structure.unflatten(leaves)
    loss_scale = template.loss_scale
    if loss_scale is not None:
        loss_scale = type(loss_scale)(**{name: own[f"state/loss_scale/{name}"] for name in loss_scale._fields})
    return template.replace(
        params=sharded.replace(shards=shards, local=local),
        opt_state=opt_state,
        loss_scale=loss_scale,
        rng=own["state/rng"],
        step=step,
    )


class _Pieces:
    """Ranges of this rank's tensor-parallel pieces of the saved leaves (whole leaves where no
    placement cuts them), from a checkpoint stored at any layout.

    Direct range reads when the stored order keeps this rank's piece contiguous (`split_order`
    of the leaf's placement here equals the entry's); otherwise the leaf is read whole, put back
    in C order, cut by the placement and kept until another leaf is asked for (one at a time)."""

    def __init__(self, reader: ChunkReader, layout: Layout, mesh: BaseMesh):
        self.reader, self.layout, self.mesh = reader, layout, mesh
        self.coordinates = mesh.coordinates
        self._cut: tuple[str, torch.Tensor] | None = None

    def read(self, key: str, leaf: int, start: int, length: int) -> torch.Tensor:
        """Elements `[start, start + length)` of this rank's piece of leaf `leaf` (1-D), from the
        checkpoint's tensor `key` (the leaf, or an optimizer tensor shaped like it)."""
        entry, _ = self.reader.entries[key]
        placement = self.layout.placement(leaf)
        parts = 1 if placement is None else self.mesh.shape[placement.axis]
        if entry.split == split_order(entry.shape, placement, parts):
            return self.reader.read_range(key, piece_start(self.layout, leaf, self.coordinates) + start, length)
        if self._cut is None or self._cut[0] != key:
            self._cut = None  # drop the previous leaf first
            whole = self.reader.read(key)
            if placement is not None:
                whole = split_tensor(whole, placement, self.coordinates[placement.axis], parts)
            self._cut = (key, whole.reshape(-1))
        return self._cut[1][start : start + length]


def _read_shard(pieces: _Pieces, layout: Layout, spec: BufferSpec, shard_index: int, key_of, dtype, device) -> torch.Tensor:
    """Shard `shard_index` of buffer `spec` (`[spec.shard_numel]`, padding zero) from the saved leaves."""
    out = torch.zeros(spec.shard_numel, dtype=dtype)
    for piece in shard_pieces(spec, shard_index):
        out[piece.shard_offset : piece.shard_offset + piece.length] = pieces.read(
            key_of(piece.leaf), piece.leaf, piece.leaf_offset, piece.length
        )
    return out.to(device)


def read(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path`, whole, by name (`params/<leaf path>`,
    `opt/<state path>/<leaf path>`, `opt/<state path>`), in one process: for inspection and
    conversion. The step number and what saved it are in `<path>/index.json`. `verify`: as for
    `load` (every byte checked against its CRC-32 unless False)."""
    path = os.path.abspath(path)
    index = open_index(path)
    with ChunkReader(path, index, verify=verify) as reader:
        return {key: reader.read(key) for key in reader.entries}
