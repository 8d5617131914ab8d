"""The safetensors file an export writes: each leaf's names, the order of the tensors, the
header, and the writer that puts the file in place whole (a temporary file of its own, renamed
over the path at the end).

An export hands the writer the tensors of one flat buffer at a time (`Writer.write_buffer`),
each written at the offset the header fixed for it; the header is built from a list of
`LeafEntry`s in file order (`FileHeader.build`), so the same writer serves a state whose ranks
all hold every leaf (`FileHeader.of`) and one whose pipeline stages hold different leaves
(`functional_shard/_export_stream.py`).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import struct
from pathlib import Path
from typing import Hashable, Iterable, NamedTuple

import optree
import torch

from ._layout import Layout
from ._pytree import NAMESPACE, path_string
from ._tree import ModuleParams

__all__ = ["SAFETENSORS_DTYPES", "ExportError", "state_dict_names", "file_order", "LeafEntry", "Record", "FileHeader",
           "Writer", "create_new_file", "temporary_name", "fsync_dir"]

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


class LeafEntry(NamedTuple):
    """One leaf of an export, as the header needs it."""

    key: Hashable  # what the writer is handed its tensor by
    names: tuple[str, ...]  # its state-dict names (none: left out of the file)
    shape: tuple[int, ...]  # full
    dtype: torch.dtype
    what: str  # the leaf described, for errors


def entries_of(layout: Layout) -> dict[int, LeafEntry]:
    """Every leaf of `layout` as a `LeafEntry` keyed by its flatten index."""
    names = state_dict_names(layout)
    return {
        i: LeafEntry(i, names[i], tuple(layout.full_shape(i)), layout.dtypes[i], layout.describe_leaf(i))
        for i in range(len(layout.paths))
    }


def file_order(layout: Layout) -> list[int]:
    """The leaves in the order an export writes them: by flat buffer as a layout without
    tensor-parallel placements groups them (one buffer per unit, role and dtypes, in order of
    first leaf; placements only separate split from whole leaves), then the module buffers."""
    groups: dict[tuple, list[int]] = {}
    for spec in layout.buffers:
        groups.setdefault((spec.unit, spec.trainable, spec.dtype, spec.gather_dtype, spec.reduce_dtype), []).extend(spec.leaves)
    return [i for leaves in sorted(groups.values(), key=min) for i in sorted(leaves)] + list(layout.local)


class Record(NamedTuple):
    """One tensor of the file."""

    name: str  # its state-dict name
    leaf: Hashable  # the leaf it holds (its `LeafEntry.key`: a layout flatten index, or (group, index))
    start: int  # byte offset in the data section
    nbytes: int


class FileHeader(NamedTuple):
    """The safetensors header of an export, and the order the tensors are written in."""

    header: bytes  # 8-byte length + JSON, padded with spaces to a multiple of 8
    buffers: tuple[tuple[Record, ...], ...]  # per flat buffer (in the order they are gathered): its leaves' records
    local: tuple[Record, ...]  # module buffers (persistent ones), written last

    @staticmethod
    def of(layout: Layout, aliases: bool) -> "FileHeader":
        """The header of a state whose ranks hold every leaf of `layout`."""
        entries = entries_of(layout)
        return FileHeader.build(
            [entries[i] for i in file_order(layout)], [[entries[i] for i in spec.leaves] for spec in layout.buffers],
            [entries[i] for i in layout.local], aliases,
        )  # fmt: skip

    @staticmethod
    def build(order: Iterable[LeafEntry], buffers: Iterable[Iterable[LeafEntry]], local: Iterable[LeafEntry],
              aliases: bool) -> "FileHeader":  # fmt: skip
        """The header of the leaves `order` (file order), gathered as `buffers` (each a flat
        buffer's leaves), then `local` (module buffers); each leaf under every one of its names
        (`aliases`) or its first. Raises `ExportError` for a dtype safetensors cannot store."""
        entries: dict[str, dict] = {}
        of_leaf: dict[Hashable, tuple[Record, ...]] = {}
        offset = 0
        for leaf in order:
            if leaf.dtype not in SAFETENSORS_DTYPES:
                raise ExportError(
                    f"{leaf.what}: safetensors cannot store {leaf.dtype}; cast it (or leave it out of the exported "
                    f"tree) and export again"
                )
            nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
            records = []
            for name in leaf.names[: None if aliases else 1]:
                entries[name] = {"dtype": SAFETENSORS_DTYPES[leaf.dtype], "shape": list(leaf.shape),
                                 "data_offsets": [offset, offset + nbytes]}  # fmt: skip
                records.append(Record(name, leaf.key, offset, nbytes))
                offset += nbytes
            of_leaf[leaf.key] = tuple(records)
        metadata = {"format": "pt", "written_by": "functional_shard.export"}
        text = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return FileHeader(
            struct.pack("<Q", len(text)) + text,
            tuple(tuple(r for leaf in leaves for r in of_leaf.get(leaf.key, ())) for leaves in buffers),
            tuple(r for leaf in local for r in of_leaf.get(leaf.key, ())),
        )


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


class Writer:
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

    def write_buffer(self, k: int, leaf_indices: tuple[Hashable, ...], leaves: list[torch.Tensor]) -> None:
        """Buffer `k`'s leaves (`leaf_indices`: their keys, e.g. its `spec.leaves`), gathered whole."""
        by_leaf = dict(zip(leaf_indices, leaves))
        for record in self.header.buffers[k]:
            self._write(record, by_leaf[record.leaf])

    def write_local(self, leaf_indices: tuple[Hashable, ...], local: tuple) -> None:
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
