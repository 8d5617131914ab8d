"""Checkpoint directories on disk: atomic writes, the commit marker, integrity, reading chunks back.

A save writes into `<path>.partial-<token>/`: `index.json` first (rank 0), then one
`rank-XXXXX.safetensors` per writing rank (each written to `.tmp`, fsynced, renamed), then,
once every rank has reported its file, `COMMIT` (rank 0, fsynced) and finally renames the
directory to `<path>` (atomic on POSIX). A directory without `COMMIT` is never read. Every
temporary file is created exclusively (`O_EXCL | O_NOFOLLOW`): nothing planted at its name is
written through.

Integrity: the save's identity (`save`, 16 random hex digits, new for every save) is in the
index, the marker and every rank file's metadata; each rank file's metadata holds the CRC-32 of
every tensor it stores, and the marker the CRC-32 of every rank file's header (which holds
those). A reader checks a file's header against the marker, its identity against the index,
and every chunk it reads against its CRC: a changed byte, or a file from another save, is
refused naming the file.

Nothing here executes code from a file: the index and the marker are JSON, the tensors are
safetensors (a JSON header and raw bytes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import safetensors
import torch

from .._export_file import SAFETENSORS_DTYPES, create_new_file
from .._export_file import fsync_dir as fsync_dir
from ._format import COMMIT, FORMAT, INDEX, READ_VERSIONS, VERSION, CheckpointError, Entry, entry_from_json, from_split_order

_RANK_FILE = re.compile(r"rank-\d{5,}\.safetensors")
_HEX = re.compile(r"[0-9a-f]{8}|[0-9a-f]{16}")
_MAX_HEADER = 100_000_000  # safetensors' own limit on a header
_MAX_DEPTH = 16  # no checkpoint's JSON nests deeper (the index: 5 levels)

__all__ = [
    "write_bytes",
    "write_rank_file",
    "fsync_dir",
    "commit",
    "not_a_checkpoint",
    "open_index",
    "ChunkReader",
    "checksum",
]


def checksum(tensor: torch.Tensor) -> str:
    """The CRC-32 of a contiguous CPU tensor's bytes, as 8 hex digits (fixed width: a file's
    size does not depend on its checksums)."""
    return crc32_hex(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")


def crc32_hex(data) -> str:
    """The CRC-32 of `data` (bytes or a buffer) as 8 hex digits: how the checkpoint writes every checksum."""
    return f"{zlib.crc32(data):08x}"


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either nothing or all of it."""
    tmp = path.with_name(path.name + ".tmp")
    with create_new_file(tmp) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write one rank's chunks (contiguous CPU tensors) as a safetensors file, via `.tmp`, fsynced.

    The metadata gets `crc32`: every tensor's `checksum`, as JSON. Tensors are laid out widest
    dtype first, each at an offset aligned to its element size. Returns the file's size and the
    CRC-32 of its header (8-byte length and JSON), for the commit marker. Tensors on a GPU are
    copied to the host first."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    names = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    entries: dict[str, dict] = {}
    offset = 0
    for name in names:
        tensor = tensors[name]
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name!r} is {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    crcs = json.dumps({name: checksum(tensors[name]) for name in names}, separators=(",", ":"))
    text = json.dumps({"__metadata__": {**metadata, "crc32": crcs}, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    header = struct.pack("<Q", len(text)) + text
    tmp = path.with_name(path.name + ".tmp")
    with create_new_file(tmp) as f:
        f.write(header)
        for name in names:
            if tensors[name].numel():
                f.write(memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(header) + offset, crc32_hex(header)


def commit(tmp: Path, path: Path, marker: dict, overwrite: bool, token: str, version: int = VERSION) -> None:
    """Rank 0, once every file is on disk: write the marker, then move the directory in place.

    `marker`: the `COMMIT` marker's contents (files and their sizes, header checksums, the
    save). With `overwrite`, an existing checkpoint at `path` (and only a checkpoint, see
    `not_a_checkpoint`) is first renamed to `<path>.old-<token>` and removed once the new one is
    in place: a crash between the two renames leaves it there (`load` names it), never a mix of
    both. If the new directory cannot take its place, the old one is moved back. On error the
    caller removes `tmp`."""
    write_bytes(tmp / COMMIT, json.dumps({"format": FORMAT, "version": version, **marker}).encode())
    fsync_dir(tmp)
    old = None
    if os.path.lexists(path):
        if not overwrite:
            raise CheckpointError(f"{path} already exists (another save finished first?): pass overwrite=True to replace it")
        refuse_unless_checkpoint(path)
        old = path.with_name(f"{path.name}.old-{token}")
        os.rename(path, old)
        reason = not_a_checkpoint(old)  # changed between the check and the rename
        if reason is not None:
            where = _move_back(old, path)
            raise CheckpointError(f"{path} is not a functional_shard checkpoint ({reason}): not replaced; {where}")
    try:
        os.rename(tmp, path)
    except OSError as error:
        if old is None:
            raise
        raise CheckpointError(f"could not move {tmp} to {path} ({error}); the previous checkpoint: {_move_back(old, path)}") from error
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _move_back(old: Path, path: Path) -> str:
    try:
        os.rename(old, path)
    except OSError as error:
        return f"left at {old}, as something now occupies {path} ({error})"
    return f"left in place at {path}"


def not_a_checkpoint(path: Path) -> str | None:
    """Why `path` is not a committed functional_shard checkpoint that an overwrite may replace
    (in words), or None when it is: a directory (not a link) holding a `COMMIT` marker of this
    format and nothing but the files that marker and the index name."""
    if os.path.islink(path):
        return "a symbolic link"
    if not path.is_dir():
        return "not a directory"
    marker = path / COMMIT
    if os.path.islink(marker) or not marker.is_file():
        return f"no {COMMIT} marker"
    try:
        files = _files_of(_read_json(marker, "commit marker"), marker)
    except CheckpointError as error:
        return f"its {COMMIT} is not a functional_shard commit marker: {error}"
    others = sorted(set(os.listdir(path)) - {INDEX, COMMIT, *files})
    if others:
        return f"it holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}, which no checkpoint holds"
    return None


def refuse_unless_checkpoint(path: Path) -> None:
    """Raise `CheckpointError` unless `path` is a checkpoint an overwrite may replace."""
    reason = not_a_checkpoint(path)
    if reason is not None:
        raise CheckpointError(
            f"{path} is not a functional_shard checkpoint ({reason}): overwrite=True only ever replaces a committed "
            f"checkpoint, and nothing was deleted. Save to another path, or move {path} away first"
        )


def _depth(value: Any) -> int:
    """How deep `value` (parsed JSON) nests, counted without recursion."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > _MAX_DEPTH:
            break
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_json(data: bytes | str, what: str) -> Any:
    """JSON from a checkpoint, or `CheckpointError` (not JSON, or nested deeper than any
    checkpoint's JSON: never a `RecursionError`)."""
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise CheckpointError(f"{what} is not a functional_shard checkpoint's JSON ({reason})") from None
    if _depth(value) > _MAX_DEPTH:
        raise CheckpointError(f"{what} is not a functional_shard checkpoint's JSON (nested more than {_MAX_DEPTH} levels deep)")
    return value


def _read_json(path: Path, what: str, data: bytes | None = None) -> dict:
    value = parse_json(path.read_bytes() if data is None else data, f"{path} ({what})")
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a functional_shard checkpoint {what}")
    return value


def _files_of(value: dict, path: Path) -> dict[str, int]:
    """The `files` mapping of the index (file -> rank) or the marker (file -> size), checked."""
    files = value.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(name, str) and _RANK_FILE.fullmatch(name) and isinstance(n, int) for name, n in files.items()
    ):
        raise CheckpointError(f"{path} lists malformed files ({files!r:.120})")
    return files


def _missing(directory: Path) -> list[str]:
    """What a checkpoint directory lacks to be loadable, in words (empty when complete)."""
    missing = []
    index_path = directory / INDEX
    files: dict[str, int] = {}
    if not index_path.is_file():
        missing.append(f"{INDEX} (rank 0 writes it first: the save stopped before writing any tensor)")
    else:
        files = _files_of(_read_json(index_path, "index"), index_path)
        for name, rank in files.items():
            if not (directory / name).is_file():
                state = "was being written" if (directory / (name + ".tmp")).exists() else "was never written"
                missing.append(f"{name} (the file of rank {rank}, which {state})")
    marker = directory / COMMIT
    if not marker.is_file():
        missing.append(f"the {COMMIT} marker (written last, once every rank's file is on disk)")
    elif files:
        sizes = _files_of(_read_json(marker, "commit marker"), marker)
        for name, size in sizes.items():
            actual = (directory / name).stat().st_size if (directory / name).is_file() else None
            if actual is not None and actual != size:
                missing.append(f"{name} is {actual} bytes, {size} were committed (truncated or replaced)")
    return missing


def open_index(path: str | os.PathLike) -> dict:
    """The index of the committed checkpoint at `path`, checked complete; else `CheckpointError`
    saying what is missing (and naming an interrupted save's leftover directory, if any)."""
    path = Path(path)
    if not path.is_dir():
        leftovers = sorted(path.parent.glob(glob_escape(path.name) + ".partial-*")) if path.parent.is_dir() else []
        previous = sorted(path.parent.glob(glob_escape(path.name) + ".old-*")) if path.parent.is_dir() else []
        message = f"no checkpoint at {path}"
        for leftover in leftovers:
            message += f"; a save to it was interrupted and left {leftover}, which lacks: " + "; ".join(_missing(leftover))
        for old in previous:
            message += f"; {old} is the checkpoint that an interrupted overwrite moved aside: rename it to {path.name}"
        raise CheckpointError(message)
    missing = _missing(path)
    if missing:
        raise CheckpointError(f"{path} is an incomplete checkpoint (an interrupted save?); it lacks: " + "; ".join(missing))
    data = (path / INDEX).read_bytes()
    index = _read_json(path / INDEX, "index", data)
    committed = _read_json(path / COMMIT, "commit marker").get("index")  # absent: saved before it was recorded
    crc = crc32_hex(data)
    if committed is not None and crc != committed:
        raise CheckpointError(
            f"{path / INDEX} does not match the index committed with it (CRC-32 {crc}, committed "
            f"{committed!r:.20}): it was changed or damaged after the save"
        )
    if index.get("version") not in READ_VERSIONS:
        raise CheckpointError(
            f"{path} has checkpoint format version {index.get('version')!r:.40}; this functional_shard reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    return index


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


class ChunkReader:
    """Reads ranges of a checkpoint's logical tensors from their chunks, each file's header
    checked against the commit marker and the save's identity and, with `verify`, each chunk
    read whole and checked against its CRC-32. Use as a context manager."""

    def __init__(self, directory: str | os.PathLike, index: dict, *, verify: bool = True):
        self.directory = Path(directory)
        self.index = index
        self.verify = verify
        self.entries: dict[str, tuple[Entry, list[tuple[str, str, int, int]]]] = {}
        items = index.get("entries")
        if not isinstance(items, list):
            raise CheckpointError(f"the index of {self.directory} has no list of entries")
        for item in items:
            entry, chunks = entry_from_json(item)
            self.entries[entry.key] = (entry, sorted(chunks, key=lambda c: c[2]))
        allowed = set(_files_of(index, self.directory / INDEX))
        for entry, chunks in self.entries.values():
            for file, *_ in chunks:
                if file not in allowed:
                    raise CheckpointError(f"the chunks of {entry.key!r} name a file {file!r:.80} that the index does not list")
        marker = _read_json(self.directory / COMMIT, "commit marker")
        self.save = index.get("save")
        if not (isinstance(self.save, str) and _HEX.fullmatch(self.save)) or marker.get("save") != self.save:
            raise CheckpointError(
                f"{self.directory}: its {COMMIT} marker (save {marker.get('save')!r:.40}) and {INDEX} (save "
                f"{self.save!r:.40}) are not from the same save: one was copied from another checkpoint"
            )
        self.headers = marker.get("headers")
        if not isinstance(self.headers, dict) or set(self.headers) != allowed:
            raise CheckpointError(f"{self.directory / COMMIT} lacks the checksums of the files the index lists")
        self._open: dict[str, tuple[Any, set[str], dict[str, str]]] = {}

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        for handle, _, _ in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str) -> tuple[Any, set[str], dict[str, str]]:
        """The open file `name`, the names of its tensors and their checksums, once its header
        is checked."""
        if name not in self._open:
            path = self.directory / name
            metadata = self._check_header(path, name)
            crcs = parse_json(metadata.get("crc32", ""), f"the checksums in {path}")
            if not isinstance(crcs, dict) or not all(isinstance(v, str) for v in crcs.values()):
                raise CheckpointError(f"{path} has malformed checksums")
            try:
                handle = safetensors.safe_open(str(path), framework="pt", device="cpu")
                handle = handle.__enter__()
                self._open[name] = (handle, set(handle.keys()), crcs)
            except Exception as error:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None
        return self._open[name]

    def _check_header(self, path: Path, name: str) -> dict:
        """The metadata of rank file `path`, once its header's CRC-32 equals the committed one
        and its save is this checkpoint's; else `CheckpointError` naming the file and why."""
        with open(path, "rb") as f:
            length = f.read(8)
            n = struct.unpack("<Q", length)[0] if len(length) == 8 else -1
            if not 0 < n <= _MAX_HEADER:
                raise CheckpointError(f"{path} is not a readable safetensors file (its header length is {n})")
            header = length + f.read(n)
        try:
            metadata = parse_json(header[8:], f"the header of {path}").get("__metadata__")
        except (CheckpointError, AttributeError):
            metadata = None
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{path} is not a readable rank file of a functional_shard checkpoint (no metadata)")
        saved_by = metadata.get("save")
        if saved_by != self.save:
            raise CheckpointError(
                f"{path} was written by another save ({saved_by!r:.40}) than this checkpoint ({self.save}): a file "
                f"copied from another checkpoint? Refused; restore the file this save wrote, or load another checkpoint"
            )
        crc = crc32_hex(header)
        if crc != self.headers[name]:
            raise CheckpointError(
                f"{path}: its header does not match the one committed (CRC-32 {crc}, committed "
                f"{self.headers[name]!r:.20}): the file is corrupted. Refused; restore it, or load another checkpoint"
            )
        return metadata

    def _chunk(self, entry: Entry, file: str, name: str, size: int, start: int, stop: int) -> torch.Tensor:
        """Elements `[start, stop)` of chunk `name` (`size` elements) in `file`; the whole chunk
        is read and, with `verify`, checked against its CRC-32."""
        handle, names, crcs = self._file(file)
        if name not in names:
            raise CheckpointError(f"{self.directory / file} lacks tensor {name!r} (a chunk of {entry.key!r})")
        if not self.verify and entry.sharded:  # only the range is read
            piece = handle.get_slice(name)[start:stop]
            if piece.dtype != entry.dtype or piece.numel() != stop - start:
                raise CheckpointError(f"chunk {name!r} of {entry.key!r} in {file} is not {entry.describe()} data")
            return piece
        chunk = handle.get_tensor(name).reshape(-1)
        if chunk.dtype != entry.dtype or chunk.numel() != size:
            raise CheckpointError(f"chunk {name!r} of {entry.key!r} in {file} is not {entry.describe()} data")
        if self.verify and checksum(chunk) != crcs.get(name):
            raise CheckpointError(
                f"{self.directory / file}: tensor {name!r} (a chunk of {entry.key!r}) does not match its CRC-32: the file "
                f"is corrupted (its bytes changed after the save). Refused; restore it, or load another checkpoint"
            )
        return chunk[start:stop]

    def read_range(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements `[start, start + length)` of tensor `key` flattened in its stored order (C
        order, or its split order: `Entry.split`), as a new 1-D CPU tensor."""
        entry, chunks = self.entries[key]
        out = torch.empty(length, dtype=entry.dtype)
        stop = start + length
        for file, name, offset, size in chunks:
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                out[lo - start : hi - start] = self._chunk(entry, file, name, size, lo - offset, hi - offset)
        return out

    def read(self, key: str) -> torch.Tensor:
        """Tensor `key` whole, with its shape (in C order, whatever order it is stored in)."""
        entry, _ = self.entries[key]
        return from_split_order(self.read_range(key, 0, entry.numel), entry.shape, entry.split).contiguous()
