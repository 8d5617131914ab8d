"""Checkpoint directories on disk: atomic writes, the commit marker, and reading chunks back.

A save writes into `<path>.partial-<token>/`: `index.json` first (rank 0), then one
`rank-XXXXX.safetensors` per writing rank (each written to `.tmp`, fsynced, renamed), then,
once every rank has reported its file, `COMMIT` (rank 0, fsynced) and finally renames the
directory to `<path>` (atomic on POSIX). A directory without `COMMIT` is never read.

Nothing here executes code from a file: the index and the marker are JSON, the tensors are
safetensors (a JSON header and raw bytes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from ._format import COMMIT, FORMAT, INDEX, VERSION, CheckpointError, Entry, entry_from_json

_RANK_FILE = re.compile(r"rank-\d{5,}\.safetensors")

__all__ = ["write_bytes", "write_rank_file", "fsync_dir", "commit", "open_index", "ChunkReader"]


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either nothing or all of it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """Write one rank's chunks as a safetensors file (via `.tmp`, fsynced); returns its size."""
    tmp = path.with_name(path.name + ".tmp")
    safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, path: Path, sizes: dict[str, int], overwrite: bool, token: str) -> None:
    """Rank 0, once every file is on disk: write the marker, then move the directory in place.

    With `overwrite`, an existing checkpoint at `path` is first renamed to `<path>.old-<token>`
    and removed once the new one is in place: a crash between the two renames leaves it there
    (`load` names it), never a mix of both."""
    write_bytes(tmp / COMMIT, json.dumps({"format": FORMAT, "version": VERSION, "files": sizes}).encode())
    fsync_dir(tmp)
    old = None
    if path.exists():
        if not overwrite:
            raise CheckpointError(f"{path} already exists: pass overwrite=True to replace it")
        old = path.with_name(f"{path.name}.old-{token}")
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path} is not a functional_shard checkpoint {what} (not JSON): {error}") from None
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
    index = _read_json(path / INDEX, "index")
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {index.get('version')!r}; this functional_shard reads version {VERSION}"
        )
    return index


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


class ChunkReader:
    """Reads ranges of a checkpoint's logical tensors from their chunks. Use as a context manager."""

    def __init__(self, directory: str | os.PathLike, index: dict):
        self.directory = Path(directory)
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
        self._open: dict[str, Any] = {}

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _file(self, name: str):
        if name not in self._open:
            try:
                handle = safetensors.safe_open(str(self.directory / name), framework="pt", device="cpu")
                self._open[name] = handle.__enter__()
            except Exception as error:  # safetensors raises its own SafetensorError
                raise CheckpointError(f"{self.directory / name} is not a readable safetensors file: {error}") from None
        return self._open[name]

    def _chunk(self, entry: Entry, file: str, name: str, start: int, stop: int) -> torch.Tensor:
        handle = self._file(file)
        if name not in handle.keys():
            raise CheckpointError(f"{self.directory / file} lacks tensor {name!r} (a chunk of {entry.key!r})")
        if entry.sharded:
            piece = handle.get_slice(name)[start:stop]
        else:
            piece = handle.get_tensor(name).reshape(-1)[start:stop]
        if piece.dtype != entry.dtype or piece.numel() != stop - start:
            raise CheckpointError(f"chunk {name!r} of {entry.key!r} in {file} is not {entry.describe()} data")
        return piece

    def read_range(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements `[start, start + length)` of tensor `key` flattened (a new 1-D CPU tensor)."""
        entry, chunks = self.entries[key]
        out = torch.empty(length, dtype=entry.dtype)
        stop = start + length
        for file, name, offset, size in chunks:
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                out[lo - start : hi - start] = self._chunk(entry, file, name, lo - offset, hi - offset)
        return out

    def read(self, key: str) -> torch.Tensor:
        """Tensor `key` whole, with its shape."""
        entry, _ = self.entries[key]
        return self.read_range(key, 0, entry.numel).view(entry.shape)
