"""The files of a `torch.distributed.checkpoint` (DCP) checkpoint, read without running its pickles.

What `dcp.save(state_dict, checkpoint_id=path)` writes with torch's default `FileSystemWriter`:

    path/.metadata          a pickle of `torch.distributed.checkpoint.metadata.Metadata`: for every
                            flattened key (`model.blocks.0.attn.weight`, `optim.state.<fqn>.exp_avg`,
                            `optim.param_groups.0.lr`) either a tensor's size, dtype and chunks (n-D
                            boxes `offsets`/`sizes`) or "bytes" (any other Python object); where
                            each item lies (`MetadataIndex(fqn, offsets) -> _StorageInfo(file,
                            offset, length)`); and `planner_data`, each key's path in the nested
                            state dict (`("optim", "state", "<fqn>", "exp_avg")`).
    path/__<rank>_<n>.distcp  each item's bytes at (offset, length): `torch.save` of the chunk's
                            tensor, or of the object.

Torch reads `.metadata` with `pickle.load` and "bytes" items with `torch.load(weights_only=False)`:
both run whatever code the file names. Here (the trust boundary):

- `.metadata` goes through `_MetadataUnpickler`, whose `find_class` gives only DCP's metadata
  dataclasses, `torch.Size`, torch dtypes and layouts and pure paths (see `_allowed`); any other
  global (`os.system`, `builtins.eval`, ...) raises `CheckpointError` before it is called. The
  result is then checked field by field (types, bounds, chunks tiling each tensor exactly, file
  names without directories).
- A tensor item is `torch.load(..., weights_only=True)`ed (torch's restricted unpickler) from
  its byte range, and must be a tensor of the declared dtype and chunk size.
- A "bytes" item is read only by `DcpReader.read_object`, also with `weights_only=True` (plain
  Python values: the learning rate, betas, parameter names).
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ._format import CheckpointError

__all__ = ["METADATA", "DcpChunk", "DcpTensor", "DcpIndex", "read_metadata", "DcpReader"]

METADATA = ".metadata"  # torch's `_metadata_fn`: written last by dcp.save, so its presence marks a complete save
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")  # an item's file: a plain name in the directory


class DcpChunk(NamedTuple):
    """One stored box of a tensor and where its bytes are."""

    offsets: tuple[int, ...]  # first index of the box in every dimension
    sizes: tuple[int, ...]  # extent of the box in every dimension
    file: str  # a file name in the checkpoint directory
    offset: int  # where the item's `torch.save` bytes start in that file
    length: int  # how many bytes they take


class DcpTensor(NamedTuple):
    """A tensor of the checkpoint: its flattened key, full shape, dtype and chunks."""

    key: str  # e.g. "model.blocks.0.attn.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[DcpChunk, ...]  # tile the tensor exactly (checked)

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


class DcpIndex(NamedTuple):
    """What a DCP checkpoint holds, from its `.metadata` (checked)."""

    directory: Path
    tensors: dict[str, DcpTensor]  # flattened key -> tensor
    objects: dict[str, tuple[str, int, int]]  # flattened key -> (file, offset, length) of a non-tensor value
    paths: dict[str, tuple[str | int, ...]]  # flattened key -> its path in the nested state dict (planner_data)


# --- .metadata: a restricted unpickler ----------------------------------------------------------

# The classes a DCP `.metadata` pickle names, with the fields each has (torch's dataclasses in
# `torch.distributed.checkpoint.metadata` and `filesystem._StorageInfo`).
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_RECORDS = {
    (_METADATA_MODULE, "Metadata"): ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    (_METADATA_MODULE, "MetadataIndex"): ("fqn", "offset", "index"),
    (_METADATA_MODULE, "TensorStorageMetadata"): ("properties", "size", "chunks"),
    (_METADATA_MODULE, "BytesStorageMetadata"): (),
    (_METADATA_MODULE, "ChunkStorageMetadata"): ("offsets", "sizes"),
    (_METADATA_MODULE, "TensorProperties"): ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    (_METADATA_MODULE, "StorageMeta"): ("checkpoint_id", "save_id", "load_id", "modules"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): (
        "relative_path", "offset", "length", "transform_descriptors",
    ),  # fmt: skip
}


class _Record:
    """A stand-in for one of DCP's metadata dataclasses: it only stores what it is given."""

    _fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any):  # what REDUCE / NEWOBJ_EX may call
        for name, value in zip(self._fields, args):
            self.__dict__[name] = value
        for name, value in kwargs.items():
            self.__dict__[str(name)] = value

    def __setstate__(self, state: Any) -> None:  # TensorProperties pickles its fields as a tuple
        if isinstance(state, tuple) and state and isinstance(state[-1], dict):
            state = state[-1]  # (None, slot state) or (dict, slot state)
        if isinstance(state, tuple):
            self.__dict__.update(zip(self._fields, state))
        elif isinstance(state, dict):
            self.__dict__.update((str(k), v) for k, v in state.items())

    def get(self, name: str) -> Any:
        return self.__dict__.get(name)


def _torch_constants() -> dict[str, Any]:
    """torch's dtypes and layouts by name, read from the module's own dictionary (a `getattr` on
    `torch` may import a submodule)."""
    return {name: v for name, v in vars(torch).items() if isinstance(v, (torch.dtype, torch.layout))}


def _layout_by_name(name: Any) -> torch.layout:
    """Stands in for `torch.serialization._get_layout` (how a `torch.layout` pickles): a lookup."""
    value = _torch_constants().get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"unknown torch layout {name!r:.40}")
    return value


class _MemoryFormats:
    """Stands in for DCP's `_MEM_FORMAT_ENCODING` enum. Python pickles an enum member as a call of
    the class with its value (3.11.7 and later) or as `getattr(<class>, <member name>)` (3.11.2
    and earlier); both give the member's int value here."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

        self.values = {member.name: member.value for member in _MEM_FORMAT_ENCODING}

    def __call__(self, value: Any) -> Any:
        return value


def _member_of(owner: Any, name: Any) -> Any:
    """Stands in for `builtins.getattr` in a DCP metadata pickle: only a member of the memory-format
    enum is looked up; any other `getattr` (`getattr(os, "system")`) is refused."""
    if isinstance(owner, _MemoryFormats) and isinstance(name, str) and name in owner.values:
        return owner.values[name]
    raise pickle.UnpicklingError(f"refused getattr({owner!r:.40}, {name!r:.40}): only an enum member of DCP's metadata is looked up")


def _allowed() -> dict[tuple[str, str], Any]:
    """(module, name) -> what `find_class` gives for it. Fresh classes on every call: a pickle
    can set attributes of a class it names (BUILD), and must not change torch's classes nor
    the next load's. Dtypes and layouts named `torch.<name>` are allowed separately."""
    allowed: dict[tuple[str, str], Any] = {
        key: type(key[1], (_Record,), {"_fields": fields, "__module__": __name__}) for key, fields in _RECORDS.items()
    }
    allowed["torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"] = _MemoryFormats()
    allowed["builtins", "getattr"] = _member_of
    allowed["torch", "Size"] = lambda values=(): tuple(values)
    allowed["torch.serialization", "_get_layout"] = _layout_by_name
    for module in ("pathlib", "pathlib._local"):  # a save's checkpoint_id (Python 3.13 moved the classes)
        for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            allowed[module, name] = lambda *parts: "/".join(map(str, parts))
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the allowed globals (`find_class` is the one way a
    pickle reaches a callable); anything else raises before it is looked up, let alone called."""

    def __init__(self, file, allowed: dict[tuple[str, str], Any]):
        super().__init__(file)
        self.allowed = allowed
        self.constants = _torch_constants()

    def find_class(self, module: str, name: str) -> Any:
        found = self.allowed.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in self.constants:
            return self.constants[name]
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


def read_metadata(directory: str | os.PathLike) -> DcpIndex:
    """The checked index of the DCP checkpoint in `directory`; nothing in the file is executed.

    Raises `CheckpointError` naming the file and what is wrong: no `.metadata` (not a DCP
    checkpoint, or a save that did not finish), a global the metadata may not name (the file
    is refused unexecuted), or metadata that does not describe a readable checkpoint."""
    directory = Path(directory)
    where = directory / METADATA
    if not where.is_file():
        per_rank = sorted(p.name for p in directory.glob("__*.metadata")) if directory.is_dir() else []
        if per_rank:
            raise CheckpointError(
                f"{directory} holds per-rank DCP metadata ({per_rank[0]}, ...: saved with use_collectives=False), "
                f"which only the same ranks can read back; save it with dcp.save's defaults"
            )
        what = "no such directory" if not directory.is_dir() else f"no {METADATA} file"
        raise CheckpointError(
            f"{directory} is not a torch.distributed.checkpoint checkpoint ({what}; dcp.save writes {METADATA} "
            f"last, so a save that did not finish has none)"
        )
    allowed = _allowed()
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(f, allowed).load()
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{where} was refused, unexecuted: {error}. A DCP metadata file names only torch's checkpoint "
            f"metadata classes; this one names something else (was it written by dcp.save? a pickle can run "
            f"any code on loading, so it is never loaded unrestricted here)"
        ) from None
    except Exception as error:  # noqa: BLE001 (truncated, or fields a constructor refused)
        raise CheckpointError(f"{where} is not readable DCP metadata ({type(error).__name__}: {error})") from None
    try:
        return _index(directory, metadata, allowed)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 (a field of an unexpected type)
        raise CheckpointError(f"{where} holds malformed DCP metadata ({type(error).__name__}: {error})") from None


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise CheckpointError(f"{what} is not a tuple of non-negative ints ({value!r:.80})")
    return tuple(value)


def _index(directory: Path, metadata: Any, allowed: dict[tuple[str, str], Any]) -> DcpIndex:
    where = directory / METADATA

    def record(value: Any, name: str, module: str = "torch.distributed.checkpoint.metadata") -> bool:
        return type(value) is allowed[module, name]

    if not record(metadata, "Metadata") or not isinstance(metadata.get("state_dict_metadata"), dict):
        raise CheckpointError(f"{where} does not hold DCP Metadata (a {type(metadata).__name__})")
    storage = metadata.get("storage_data")
    if not isinstance(storage, dict):
        raise CheckpointError(f"{where} has no storage index (was it written by torch's FileSystemWriter?)")
    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for index, info in storage.items():
        fqn = index.get("fqn") if record(index, "MetadataIndex") else None
        if not isinstance(fqn, str) or not record(info, "_StorageInfo", "torch.distributed.checkpoint.filesystem"):
            raise CheckpointError(
                f"{where} has a malformed storage entry ({type(index).__name__}: {type(info).__name__})"
            )
        if info.get("transform_descriptors"):
            raise CheckpointError(
                f"{where}: {fqn!r} is stored through stream transforms ({info.get('transform_descriptors')!r:.80}: an "
                f"experimental DCP extension, e.g. compression), which are not read here; save without _extensions"
            )
        file = info.get("relative_path")
        if not isinstance(file, str) or not _FILE_NAME.fullmatch(file):
            raise CheckpointError(
                f"{where} places {fqn!r} in {file!r:.80}, which is not a file name in the checkpoint's directory"
            )
        offset, length = _ints((info.get("offset"), info.get("length")), f"the byte range of {fqn!r}")
        at = index.get("offset")
        places[fqn, None if at is None else _ints(at, f"the offsets of {fqn!r}")] = (file, offset, length)
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, tuple[str, int, int]] = {}
    for key, item in metadata.get("state_dict_metadata").items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where} has a non-text key {key!r:.80}")
        if record(item, "BytesStorageMetadata"):
            place = places.get((key, None))
            if place is None:
                raise CheckpointError(f"{where} does not say where the value of {key!r} is stored")
            objects[key] = place
            continue
        if not record(item, "TensorStorageMetadata") or not record(item.get("properties"), "TensorProperties"):
            raise CheckpointError(f"{where}: {key!r} is described by a {type(item).__name__}")
        dtype = item.get("properties").get("dtype")
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{where}: {key!r} has no dtype")
        shape = _ints(item.get("size"), f"the size of {key!r}")
        chunks = []
        if not isinstance(item.get("chunks"), list):
            raise CheckpointError(f"{where}: {key!r} has no list of chunks")
        for chunk in item.get("chunks"):
            if not record(chunk, "ChunkStorageMetadata"):
                raise CheckpointError(f"{where}: a chunk of {key!r} is a {type(chunk).__name__}")
            offsets = _ints(chunk.get("offsets"), f"a chunk of {key!r}")
            sizes = _ints(chunk.get("sizes"), f"a chunk of {key!r}")
            place = places.get((key, offsets))
            if place is None:
                raise CheckpointError(f"{where} does not say where the chunk of {key!r} at {list(offsets)} is stored")
            chunks.append(DcpChunk(offsets, sizes, *place))
        tensors[key] = DcpTensor(key, shape, dtype, tuple(chunks))
        _check_tiling(tensors[key], where)
    paths: dict[str, tuple[str | int, ...]] = {}
    planner = metadata.get("planner_data")
    if isinstance(planner, dict):
        for key, path in planner.items():
            if isinstance(key, str) and isinstance(path, tuple) and all(type(p) in (str, int) for p in path):
                paths[key] = path
    return DcpIndex(directory, tensors, objects, paths)


def _check_tiling(tensor: DcpTensor, where: Path) -> None:
    """The chunks lie inside the tensor, do not overlap, and hold as many elements as it: so
    they cover it exactly. Overlaps are looked for among chunks whose first-dimension ranges
    meet (a sweep), so FSDP2's row blocks cost O(n log n)."""
    ndim, total = len(tensor.shape), 0
    for chunk in tensor.chunks:
        inside = all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, tensor.shape))
        if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim or not inside:
            raise CheckpointError(
                f"{where}: a chunk of {tensor.key!r} (at {list(chunk.offsets)}, {list(chunk.sizes)}) lies outside "
                f"its shape {list(tensor.shape)}"
            )
        total += _numel(chunk.sizes)
    boxes = sorted((c for c in tensor.chunks if _numel(c.sizes)), key=lambda c: c.offsets)
    active: list[DcpChunk] = []
    for box in boxes:
        start = box.offsets[0] if ndim else 0
        active = [a for a in active if not ndim or a.offsets[0] + a.sizes[0] > start]
        for a in active:
            spans = zip(a.offsets, a.sizes, box.offsets, box.sizes)
            if all(max(ao, bo) < min(ao + asz, bo + bsz) for ao, asz, bo, bsz in spans):
                raise CheckpointError(
                    f"{where}: two chunks of {tensor.key!r} overlap (at {list(a.offsets)} and {list(box.offsets)})"
                )
        active.append(box)
    if total != _numel(tensor.shape):
        numel = _numel(tensor.shape)
        raise CheckpointError(f"{where}: the chunks of {tensor.key!r} hold {total} of its {numel} elements")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --- reading items --------------------------------------------------------------------------------


class DcpReader:
    """Reads ranges of a DCP checkpoint's tensors from its chunks. Use as a context manager.

    Keeps the last chunk it loaded (ranges of one tensor are read in order), nothing else."""

    def __init__(self, index: DcpIndex):
        self.index = index
        self._files: dict[str, Any] = {}
        self._last: tuple[tuple, torch.Tensor] | None = None
        self.bytes_read = 0  # bytes of items loaded, for reports

    def __enter__(self) -> "DcpReader":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._last = None

    def _bytes(self, file: str, offset: int, length: int, key: str) -> bytes:
        if file not in self._files:
            try:
                self._files[file] = open(self.index.directory / file, "rb")
            except OSError as error:
                where = self.index.directory / file
                raise CheckpointError(f"{where} (which holds {key!r}) cannot be read: {error}") from None
        f = self._files[file]
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            where = self.index.directory / file
            raise CheckpointError(f"{where} is truncated: {key!r} needs bytes [{offset}, {offset + length})")
        self.bytes_read += length
        return data

    def _load(self, data: bytes, key: str, file: str) -> Any:
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 (torch's UnpicklingError, or a zip error)
            raise CheckpointError(
                f"the bytes of {key!r} in {self.index.directory / file} were refused by torch.load(weights_only=True) "
                f"({type(error).__name__}: {str(error)[:300]}); they are not a tensor as dcp.save writes it "
                f"(the default serialization_format, torch_save, is read here)"
            ) from None

    def _chunk(self, tensor: DcpTensor, chunk: DcpChunk) -> torch.Tensor:
        cache_key = (tensor.key, chunk.offsets)
        if self._last is not None and self._last[0] == cache_key:
            return self._last[1]
        value = self._load(self._bytes(chunk.file, chunk.offset, chunk.length, tensor.key), tensor.key, chunk.file)
        if not isinstance(value, torch.Tensor) or value.dtype != tensor.dtype or tuple(value.shape) != chunk.sizes:
            if isinstance(value, torch.Tensor):
                got = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            else:
                got = f"a {type(value).__name__}"
            raise CheckpointError(
                f"the chunk of {tensor.key!r} at {list(chunk.offsets)} in {chunk.file} holds {got}, not the "
                f"{str(tensor.dtype).removeprefix('torch.')}{list(chunk.sizes)} its metadata declares"
            )
        self._last = (cache_key, value)
        return value

    def read_range(self, key: str, start: int, length: int) -> torch.Tensor:
        """Elements `[start, start + length)` of tensor `key` flattened (a new 1-D CPU tensor),
        read as row blocks (`flat_range_slices`) intersected with the stored chunks."""
        from ._full import flat_range_slices

        tensor = self.index.tensors[key]
        out = torch.empty(length, dtype=tensor.dtype)
        position = 0
        for box in flat_range_slices(tensor.shape, start, start + length):
            lows = [s.start for s in box] + [0] * (len(tensor.shape) - len(box))
            highs = [s.stop for s in box] + list(tensor.shape[len(box) :])
            sizes = [h - lo for lo, h in zip(lows, highs)]
            region = out[position : position + _numel(tuple(sizes))].view(sizes)
            position += region.numel()
            for chunk in tensor.chunks:
                inner_lo = [max(lo, o) for lo, o in zip(lows, chunk.offsets)]
                inner_hi = [min(h, o + s) for h, o, s in zip(highs, chunk.offsets, chunk.sizes)]
                if any(lo >= hi for lo, hi in zip(inner_lo, inner_hi)):
                    continue
                source = self._chunk(tensor, chunk)
                region[tuple(slice(lo - b, hi - b) for lo, hi, b in zip(inner_lo, inner_hi, lows))] = source[
                    tuple(slice(lo - o, hi - o) for lo, hi, o in zip(inner_lo, inner_hi, chunk.offsets))
                ]
        assert position == length, (key, start, length, position)
        return out

    def read(self, key: str) -> torch.Tensor:
        """Tensor `key` whole, with its shape."""
        tensor = self.index.tensors[key]
        return self.read_range(key, 0, _numel(tensor.shape)).view(tensor.shape)

    def read_object(self, key: str) -> Any:
        """The non-tensor value `key` (e.g. `optim.param_groups.0.lr`), loaded with
        `torch.load(weights_only=True)`: plain Python values only."""
        file, offset, length = self.index.objects[key]
        return self._load(self._bytes(file, offset, length, key), key, file)
