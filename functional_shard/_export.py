"""Export: the full, unsharded parameters of a sharded state, in memory or streamed to a file.

    full = fs.export(state)                              # every rank: the whole state dict (small models)
    fs.export(state, "out/model.safetensors")            # every rank; rank 0 writes, one unit at a time

The streamed export never holds more than this rank's shards plus one flat buffer gathered
whole: the ranks all-gather the buffers one by one, and rank 0 writes each buffer's leaves to
the file (as raw bytes at offsets fixed in advance by the safetensors header) before the next
is gathered. With tensor-parallel placements, each split leaf of the buffer is also gathered
over its axis (`fs.tensor_parallel.gather_leaf`), so the file holds the full leaves, named and
ordered as an export of the same values without placements writes them: the same bytes. The file is a plain safetensors file with state-dict names, which
`model.load_state_dict(safetensors.torch.load_file(path), strict=True)` and Hugging Face
`from_pretrained(directory)` read.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import optree
import torch

from ._collectives import gather_bytes
from ._layout import Layout
from ._placed import gather_texts, layout_groups
from ._pytree import NAMESPACE, path_string, tree_flatten, tree_map, tree_paths
from ._shard import Sharded, _check_shards, gather
from ._step import StepState, check_not_donated
from ._tree import ModuleParams
from .tensor_parallel import gather_leaf

__all__ = ["export", "state_dict_names", "file_order", "ExportError"]

OPERATION = "fs.export"  # the name every rank states on entering (`BaseMesh.agree`)

# torch dtype -> safetensors dtype name (the format's own list).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class ExportError(RuntimeError):
    """A state that cannot be exported to the file asked for."""


def state_dict_names(layout: Layout) -> list[tuple[str, ...]]:
    """For every leaf of `layout` (flatten order), the names under which a state dict holds it.

    A leaf of a `ModuleParams` is named by its path (the parameter's first name), followed by
    its aliases (tied weights: `head.weight` for `tok_emb.weight`); a non-persistent buffer has
    no name (a module's `state_dict()` leaves it out). Any other leaf is named by its path.
    A `ModuleParams` nested in a larger tree prefixes its names with its own path.
    """
    names: list[list[str]] = [[p] for p in layout.paths]
    indices = optree.tree_unflatten(layout.treedef, list(range(len(layout.paths))))
    is_module_params = lambda x: isinstance(x, ModuleParams)  # noqa: E731
    paths, nodes, _ = optree.tree_flatten_with_path(indices, is_leaf=is_module_params, none_is_leaf=False, namespace=NAMESPACE)
    for path, node in zip(paths, nodes):
        if not isinstance(node, ModuleParams):
            continue
        prefix = path_string(path) + "." if path else ""
        for alias, name in node.aliases:
            if name in node:
                names[node[name]].append(prefix + alias)
        for name in node.non_persistent:
            if name in node:
                names[node[name]] = []
    return [tuple(n) for n in names]


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
    named with its leaf, before anything is gathered; a state whose ranks hold different leaves,
    which only the in-memory export joins yet).
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
    if len(set(groups)) > 1:
        raise ExportError(
            f"fs.export(state, path) streams a state whose ranks all hold every leaf; here the ranks hold different "
            f"leaves (a pipelined step's stages: rank groups {sorted(set(groups))}). Write the full state dict "
            f"instead: `full = fs.export(state)` on every rank, then `safetensors.torch.save_file(full, path)` on "
            f"rank 0 (or save a checkpoint: fs.checkpoint.save)"
        )
    _check_shards(sharded)
    path = Path(os.path.abspath(path))
    header = FileHeader.of(sharded, aliases)  # the same on every rank: raises on every rank alike
    mesh.check_same("the export's path and contents", f"{path}|{sharded.layout.signature()}")
    writer, error = None, None
    if mesh.rank == 0:
        try:
            writer = _Writer(path, header)
        except Exception as e:  # noqa: BLE001 (the others must learn of it: they gather regardless)
            error = e
    layout = sharded.layout
    with torch.no_grad():
        for k, spec in enumerate(layout.buffers):
            full = gather_bytes(sharded.shards[k], mesh, spec)
            leaves = layout.unflatten_buffer(spec, full)
            if layout.is_split:  # every rank of the axis takes part; rank 0 writes
                leaves = [_join(t, layout.placement(i), mesh) for t, i in zip(leaves, spec.leaves)]
            if writer is not None:
                try:
                    writer.write_buffer(k, spec.leaves, leaves)
                except Exception as e:  # noqa: BLE001 (keep gathering with the others, then report)
                    writer.abandon()
                    writer, error = None, e
            del full, leaves
        if writer is not None:
            try:
                writer.write_local(sharded.layout.local, sharded.local)
                writer.commit()
            except Exception as e:  # noqa: BLE001
                writer.abandon()
                error = e
    ok = mesh.agree(OPERATION, 0 if error else 1)[0]
    if error is not None:
        raise error
    if not ok:
        raise ExportError(f"rank 0 could not write {path} (see its error); nothing was written")
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
    leader = groups[mesh.rank]
    mine = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in named.items()]
    said = gather_texts(mesh, json.dumps(mine) if mesh.rank == leader else "")
    owner: dict[str, tuple[int, list[int], torch.dtype]] = {}
    holders: dict[str, int] = {}
    for g in sorted(set(groups)):
        for name, shape, dtype in json.loads(said[g]):
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


class Record(NamedTuple):
    """One tensor of the file."""

    name: str  # its state-dict name
    leaf: int  # the leaf it holds (layout flatten order)
    start: int  # byte offset in the data section
    nbytes: int


def _join(piece: torch.Tensor, placement: Any, mesh: Any) -> torch.Tensor:
    """The full leaf from every rank's `piece` of it (a collective over the placement's axis), or
    `piece` itself for a leaf every rank holds whole."""
    return piece if placement is None else gather_leaf(piece, placement, mesh)


def file_order(layout: Layout) -> list[int]:
    """The leaves in the order an export writes them: by flat buffer as a layout without
    tensor-parallel placements groups them (one buffer per unit, role and dtypes, in order of
    first leaf; placements only separate split from whole leaves), then the module buffers."""
    groups: dict[tuple, list[int]] = {}
    for spec in layout.buffers:
        groups.setdefault((spec.unit, spec.trainable, spec.dtype, spec.gather_dtype, spec.reduce_dtype), []).extend(spec.leaves)
    return [i for leaves in sorted(groups.values(), key=min) for i in sorted(leaves)] + list(layout.local)


class FileHeader(NamedTuple):
    """The safetensors header of an export, and the order the tensors are written in."""

    header: bytes  # 8-byte length + JSON, padded with spaces to a multiple of 8
    buffers: tuple[tuple[Record, ...], ...]  # per flat buffer (layout order): its leaves' records
    local: tuple[Record, ...]  # module buffers (persistent ones), written last

    @staticmethod
    def of(sharded: Sharded, aliases: bool) -> "FileHeader":
        layout = sharded.layout
        names = state_dict_names(layout)
        entries: dict[str, dict] = {}
        offset = 0

        def records(i: int) -> Iterator[Record]:
            nonlocal offset
            dtype = layout.dtypes[i]
            if dtype not in SAFETENSORS_DTYPES:
                raise ExportError(
                    f"{layout.describe_leaf(i)}: safetensors cannot store {dtype}; cast it (or leave it out of "
                    f"the exported tree) and export again"
                )
            numel = 1
            for d in layout.full_shape(i):
                numel *= d
            for name in names[i][: None if aliases else 1]:
                nbytes = numel * dtype.itemsize
                entries[name] = {
                    "dtype": SAFETENSORS_DTYPES[dtype],
                    "shape": list(layout.full_shape(i)),
                    "data_offsets": [offset, offset + nbytes],
                }
                yield Record(name, i, offset, nbytes)
                offset += nbytes

        of_leaf = {i: tuple(records(i)) for i in file_order(layout)}
        buffers = tuple(tuple(r for i in spec.leaves for r in of_leaf[i]) for spec in layout.buffers)
        local = tuple(r for i in layout.local for r in of_leaf[i])
        metadata = {"format": "pt", "written_by": "functional_shard.export"}
        text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return FileHeader(struct.pack("<Q", len(text)) + text, buffers, local)


def create_new_file(path: Path, mode: int = 0o666):
    """A new file at `path`, open for binary writing; `FileExistsError` if anything is there.

    `O_CREAT | O_EXCL | O_NOFOLLOW`: a file or symbolic link planted at `path` beforehand is
    never opened, truncated or followed. Permissions as `open(path, "wb")` gives (`mode` less
    the umask)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, mode), "wb")


def temporary_name(path: Path) -> Path:
    """A name next to `path` to write it under: `<name>.partial-<16 random hex digits>`."""
    return path.with_name(f"{path.name}.partial-{secrets.token_hex(8)}")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _identity(path: Path) -> tuple | None:
    """What is at `path` now (device, inode, size, modification time, mode), or None; a link is
    not followed."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


class _Writer:
    """Rank 0's file: the header first, then each tensor's bytes at its offset.

    Written to a temporary file of its own (`temporary_name`, made by `create_new_file`), which
    `commit` renames over `path` unless `path` changed since the writer started: another writer
    finished first and wins; this one raises and leaves no file."""

    def __init__(self, path: Path, header: FileHeader):
        self.path = path
        self.header = header
        path.parent.mkdir(parents=True, exist_ok=True)
        self.before = _identity(path)
        self.tmp = temporary_name(path)
        try:
            self.file = create_new_file(self.tmp)
        except FileExistsError:
            raise ExportError(
                f"{self.tmp} already exists (planted there?): fs.export never writes through an existing file or "
                f"link; remove it and export again"
            ) from None
        self.base = len(header.header)
        try:
            self.file.write(header.header)
        except BaseException:
            self.abandon()
            raise

    def _write(self, record: Record, tensor: torch.Tensor) -> None:
        # In file order but for the split and whole leaves of a unit under tensor-parallel
        # placements, which are gathered in buffers of their own: each goes to its offset.
        if self.file.tell() != self.base + record.start:
            self.file.seek(self.base + record.start)
        if record.nbytes:
            # A uint8 view through numpy: the bytes go to the file without another copy of the leaf.
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            self.file.write(memoryview(data))

    def write_buffer(self, k: int, leaf_indices: tuple[int, ...], leaves: list[torch.Tensor]) -> None:
        """Buffer `k`'s leaves (`leaf_indices`, its `spec.leaves`), gathered whole."""
        by_leaf = dict(zip(leaf_indices, leaves))
        for record in self.header.buffers[k]:
            self._write(record, by_leaf[record.leaf])

    def write_local(self, leaf_indices: tuple[int, ...], local: tuple) -> None:
        """The module buffers (`layout.local`, this rank's values)."""
        by_leaf = dict(zip(leaf_indices, local))
        for record in self.header.local:
            self._write(record, by_leaf[record.leaf])

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        # The first writer to finish wins: replace `path` only if it is what this export found
        # there when it started. (Two commits within the microseconds between this check and
        # the rename both succeed and the last one's file stays: whole either way.)
        if _identity(self.path) != self.before:
            raise ExportError(
                f"{self.path} changed while this export was writing it (another fs.export to the same path "
                f"finished first?): it holds the other writer's file, whole, and this export's was discarded. "
                f"Export to another path, or again once the other is done"
            )
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abandon(self) -> None:
        try:
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)
