"""The streamed export: the full leaves of a sharded state written to one safetensors file by
rank 0, one flat buffer gathered at a time (`fs.export(state, path)`).

Where every rank holds every leaf, the ranks all-gather the buffers one by one (each split leaf
also joined over its tensor-parallel axis) and rank 0 writes each buffer's leaves at the offsets
the header fixed (`_export_file.FileHeader`) before the next is gathered.

Where the ranks hold different leaves — a pipelined step, whose ranks of each pipeline
coordinate (a *layout group*, `_placed.layout_groups`) hold that coordinate's stages — the first
rank of each group describes its leaves to every rank (names, full shapes, dtypes, and its
buffers' leaves), so every rank builds the same header. The groups then take their turns in
rank order: a group's ranks gather each of its buffers among themselves, as above, and its first
rank sends the buffer's leaves, whole, to rank 0 (one message, on the mesh's transfer group),
which writes them; module buffers are rank 0's. No rank holds more than its shards plus one
buffer gathered whole, and rank 0 one received buffer. A file's tensors are in group order, each
group's in its own file order: for a pipeline whose stages follow the model's units in order
(one stage per rank), the order (and the file, byte for byte) of an export of the same values
without a pipeline; the same tensors under the same names whatever the stages.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ._collectives import gather_bytes
from ._export_file import ExportError, FileHeader, LeafEntry, Writer, entries_of, file_order
from ._placed import layouts_say
from ._shard import Sharded, _check_shards
from .tensor_parallel import gather_leaf

__all__ = ["stream"]


def stream(sharded: Sharded, path: str | os.PathLike, aliases: bool, groups: tuple[int, ...], operation: str) -> None:
    """Write the full leaves of `sharded` to the safetensors file `path` (rank 0 writes); a
    collective. `groups`: `layout_groups` of its layout (every rank 0 where the ranks hold the
    same leaves). Returns on every rank once the file is in place, or raises on every rank."""
    mesh = sharded.mesh
    _check_shards(sharded)
    path = Path(os.path.abspath(path))
    leaders = sorted(set(groups))
    layout = sharded.layout
    if len(leaders) == 1:
        header = FileHeader.of(layout, aliases)  # the same on every rank: raises on every rank alike
        sequence = [(0, k, spec.leaves) for k, spec in enumerate(layout.buffers)]
        signature, sizes = layout.signature(), None
    else:
        header, sequence, sizes = _grouped_header(sharded, aliases, groups, leaders)
        signature = hashlib.sha256(header.header).hexdigest()
    mesh.check_same("the export's path and contents", f"{path}|{signature}")
    writer, error = None, None
    if mesh.rank == 0:
        try:
            writer = Writer(path, header)
        except Exception as e:  # noqa: BLE001 (the others must learn of it: they gather regardless)
            error = e
    mine = groups[mesh.rank]
    transfers = getattr(mesh, "p2p_group", None)  # a pipelined mesh's own group for transfers
    device = getattr(mesh, "device", None)  # NCCL moves CUDA tensors only; the writer copies to the host
    with torch.no_grad():
        for turn, (group, k, keys) in enumerate(sequence):
            leaves = None
            if group == mine:  # every rank of the group takes part in the gather
                leaves = _gathered(sharded, k)
                if mesh.rank == group != 0:  # its first rank sends the buffer whole to rank 0
                    dist.send(_packed(leaves, device), 0, group=transfers)
            elif mesh.rank == 0:
                message = torch.empty(sum(n for n, _, _ in sizes[turn]), dtype=torch.uint8, device=device)
                dist.recv(message, group, group=transfers)
                leaves = _unpacked(message, sizes[turn])
            if writer is not None:
                try:
                    writer.write_buffer(turn, keys, leaves)
                except Exception as e:  # noqa: BLE001 (keep gathering with the others, then report)
                    writer.abandon()
                    writer, error = None, e
            del leaves
        if writer is not None:
            try:
                keys = layout.local if len(leaders) == 1 else tuple((0, i) for i in layout.local)
                writer.write_local(keys, sharded.local)
                writer.commit()
            except Exception as e:  # noqa: BLE001
                writer.abandon()
                error = e
    ok = mesh.agree(operation, 0 if error else 1)[0]
    if error is not None:
        raise error
    if not ok:
        raise ExportError(f"rank 0 could not write {path} (see its error); nothing was written")


def _gathered(sharded: Sharded, k: int) -> list[torch.Tensor]:
    """Buffer `k`'s leaves gathered whole over the shard axis (and each split leaf over its
    tensor-parallel axis); a collective of the ranks that hold the buffer."""
    layout, mesh = sharded.layout, sharded.mesh
    spec = layout.buffers[k]
    leaves = layout.unflatten_buffer(spec, gather_bytes(sharded.shards[k], mesh, spec))
    if layout.is_split:
        leaves = [t if layout.placement(i) is None else gather_leaf(t, layout.placement(i), mesh) for t, i in zip(leaves, spec.leaves)]
    return leaves


def _packed(leaves: list[torch.Tensor], device) -> torch.Tensor:
    """The leaves' bytes, one after another, as one uint8 tensor on `device` (the mesh's: an
    offloaded state's leaves come back to the host)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in leaves]
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)).to(device)


def _unpacked(message: torch.Tensor, sizes: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """`_packed`'s leaves again, from their (bytes, dtype, shape)."""
    out, start = [], 0
    for nbytes, dtype, shape in sizes:
        out.append(message[start : start + nbytes].view(dtype).reshape(shape))
        start += nbytes
    return out


def _grouped_header(sharded: Sharded, aliases: bool, groups: tuple[int, ...], leaders: list[int]):
    """Every rank's copy of the header of a state whose layout groups hold different leaves, the
    sequence of turns (group, buffer index in its layout, its leaves' keys in the header), and
    per turn its leaves' (bytes, dtype, shape).
    A collective: the first rank of each group describes its layout to every rank."""
    mesh, layout = sharded.mesh, sharded.layout
    mine = None
    if mesh.rank in leaders:
        entries = entries_of(layout)
        mine = {
            "leaves": {i: [list(e.names), list(e.shape), str(e.dtype).removeprefix("torch."), e.what] for i, e in entries.items()},
            "order": [i for i in file_order(layout) if i not in layout.local],
            "buffers": [list(spec.leaves) for spec in layout.buffers],
            "local": list(layout.local),
        }
    order, buffers, sequence, sizes, local, seen = [], [], [], [], [], set()
    for g, told in layouts_say(mesh, groups, mine).items():
        entry = {
            int(i): LeafEntry((g, int(i)), tuple(names), tuple(shape), getattr(torch, dtype), what)
            for i, (names, shape, dtype, what) in told["leaves"].items()
        }
        for i in told["order"]:
            if not seen.issuperset(entry[i].names) or not entry[i].names:
                order.append(entry[i])  # a leaf an earlier group wrote under all its names is left out
                seen.update(entry[i].names)
        for k, members in enumerate(told["buffers"]):
            buffers.append([entry[i] for i in members])
            sequence.append((g, k, tuple((g, i) for i in members)))
            sizes.append([(math.prod(entry[i].shape) * entry[i].dtype.itemsize, entry[i].dtype, entry[i].shape) for i in members])
        if g == 0:
            local = [entry[i] for i in told["local"]]
    header = FileHeader.build(order + local, buffers, local, aliases)
    return header, sequence, sizes
