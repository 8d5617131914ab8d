"""Full (unsharded) safetensors files in: each rank reads only the ranges its shards keep.

    state = step.init(meta_params, initialize=fs.checkpoint.from_safetensors("model.safetensors"))
    state = fs.checkpoint.load_full("model.safetensors", template)      # template: step.init(...)

The file is a state dict (what `fs.export(state, path)`, `safetensors.torch.save_file(
model.state_dict(), path)` or Hugging Face `save_pretrained` write), named by state-dict names:
a leaf is looked up under its path, then under its aliases (a tied weight stored once under
either name). A leaf's part of a shard is a range of the leaf flattened; it is read as row
blocks of the stored tensor: whole rows of the first dimension where the range covers them,
and for a partial first or last row the same decomposition one dimension down, so exactly the
range's elements are read (at most `2 * ndim + 1` slices per leaf and rank).
"""

from __future__ import annotations

import math
import os
from typing import Callable

import safetensors
import torch

from .._export_file import SAFETENSORS_DTYPES, state_dict_names
from .._layout import Layout
from .._placed import layout_groups
from .._shard import Sharded, _check_shards
from .._step import StepState
from ..initialize import Initializer, LeafSource, shard_from
from ._format import CheckpointError, held_elsewhere

__all__ = ["from_safetensors", "load_full", "flat_range_slices"]

OPERATION = "fs.checkpoint.load_full"

_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def from_safetensors(
    path: str | os.PathLike, *, rename: Callable[[str], str] | None = None, strict: bool = True
) -> "SafetensorsInitializer":
    """An initializer for `step.init(params, initialize=...)` reading a full safetensors state dict.

    Arguments:
        path: a safetensors file holding every leaf whole (the same file on every rank).
        rename: state-dict name -> name in the file (e.g. `lambda n: "model." + n`); default as is.
        strict: refuse a file with tensors that no leaf takes, naming the first (as
            `load_state_dict(strict=True)` does).

    Every parameter and persistent buffer must be in the file (under its path or one of its
    aliases) with the leaf's exact shape and dtype; the first that is missing or differs (in the
    tree's order) raises `CheckpointError` naming it with both shapes/dtypes, on every rank and
    before any tensor is read. Non-persistent buffers, which a state dict leaves out, keep the
    values given in `params` (they must not be on the meta device). Each rank reads only the
    ranges its shards keep (see `flat_range_slices`), and every module buffer whole.
    `elements_read` holds, after an init, how many elements this rank read.
    """
    return SafetensorsInitializer(os.path.abspath(path), rename or (lambda name: name), strict)


def load_full(
    path: str | os.PathLike, template: StepState | Sharded, *, rename: Callable[[str], str] | None = None, strict: bool = True
) -> StepState | Sharded:
    """`template` with its parameters read from the full safetensors file at `path`; every rank.

    Arguments:
        path / rename / strict: as for `from_safetensors`.
        template: a `StepState` (e.g. `step.init(params)`) or a `Sharded`: its layout and mesh.
            Not modified. Its optimizer state and step count are kept as they are (a fresh
            `step.init` gives the state a fine-tuning run starts from); its module buffers are
            replaced by the file's, except non-persistent ones.

    Returns a new `StepState` (or `Sharded`) whose gathered parameters equal the file's tensors
    bit for bit (`fs.gather(..., full=True)` with tensor-parallel placements; each rank then
    reads each split leaf whole, one at a time, and keeps its piece). Raises `CheckpointError` on every rank, naming the first missing or
    mismatched tensor, before reading any.
    """
    sharded = template.params if isinstance(template, StepState) else template
    if not isinstance(sharded, Sharded):
        raise TypeError(f"load_full expects a template StepState or Sharded; got {type(template).__name__}")
    _check_shards(sharded)
    layout, mesh = sharded.layout, sharded.mesh
    mesh.agree(OPERATION)
    leaves: list[torch.Tensor] = [
        torch.empty(layout.full_shape(i), dtype=dtype, device="meta") for i, dtype in enumerate(layout.dtypes)
    ]
    for i, t in zip(layout.local, sharded.local):
        leaves[i] = t
    # The file holds the full leaves (`layout.full_shape`); with tensor-parallel placements each
    # split leaf is read whole, one at a time, and cut to this rank's piece (`shard_from`).
    initialize = from_safetensors(path, rename=rename, strict=strict)
    groups = layout_groups(layout, mesh)
    if len(set(groups)) > 1:  # a pipelined state: a file tensor is extra only if no rank's stages take it
        initialize = initialize.also_taken(held_elsewhere(layout, groups, mesh, initialize.rename)[0])
    loaded = shard_from(initialize, layout, leaves, mesh, operation=OPERATION, full_layout=layout)
    loaded = loaded.replace(shards=[s.to(old.device) for s, old in zip(loaded.shards, sharded.shards)])
    return template.replace(params=loaded) if isinstance(template, StepState) else loaded


def flat_range_slices(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[slice, ...]]:
    """Index tuples that together read elements `[start, stop)` of a C-order tensor of `shape`
    flattened, in order, and nothing else: full rows of the first dimension where the range
    covers them, the same decomposition one dimension down for a partial first or last row."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(slice(start, stop),)] if shape else [()]
    inner = 1
    for d in shape[1:]:
        inner *= d
    first, first_offset = divmod(start, inner)
    last, last_offset = divmod(stop, inner)
    row = lambda r, parts: [(slice(r, r + 1), *p) for p in parts]  # noqa: E731
    if first == last:
        return row(first, flat_range_slices(shape[1:], first_offset, last_offset))
    out = []
    if first_offset:
        out += row(first, flat_range_slices(shape[1:], first_offset, inner))
        first += 1
    if first < last:
        out.append((slice(first, last),))
    if last_offset:
        out += row(last, flat_range_slices(shape[1:], 0, last_offset))
    return out


def _describe_full(layout: Layout, i: int) -> str:
    """Leaf `i` with its full shape (before a tensor-parallel placement cut it): what a file holds."""
    return f"leaf {layout.paths[i]!r} (shape {list(layout.full_shape(i))}, {str(layout.dtypes[i]).removeprefix('torch.')})"


class SafetensorsInitializer(Initializer):
    """Made by `from_safetensors`. `elsewhere`: the file names that leaves outside the layout it
    opens take (a pipelined step's other stages), which `strict` does not count as extra."""

    def __init__(self, path: str, rename: Callable[[str], str], strict: bool, elsewhere: frozenset[str] = frozenset()):
        self.path, self.rename, self.strict, self.elsewhere = path, rename, strict, frozenset(elsewhere)
        self.elements_read = 0

    def open(self, layout: Layout, leaves: list[torch.Tensor]) -> LeafSource:
        return _FileSource(self, layout, leaves)

    def for_part(self, whole: Layout) -> "SafetensorsInitializer":
        return self.also_taken({self.rename(n) for names in state_dict_names(whole) for n in names})

    def also_taken(self, names) -> "SafetensorsInitializer":
        """This initializer with `names` (of the file) taken by leaves elsewhere, too."""
        return SafetensorsInitializer(self.path, self.rename, self.strict, self.elsewhere | frozenset(names))


class _FileSource(LeafSource):
    def __init__(self, spec: SafetensorsInitializer, layout: Layout, leaves: list[torch.Tensor]):
        self.spec, self.layout, self.leaves = spec, layout, leaves
        spec.elements_read = 0
        try:
            self.handle = safetensors.safe_open(spec.path, framework="pt", device="cpu").__enter__()
        except Exception as error:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{spec.path} is not a readable safetensors file: {error}") from None
        try:
            self.names = self._match()
        except BaseException:
            self.close()
            raise

    def _same(self, a: str, b: str, chunk_bytes: int = 1 << 26) -> bool:
        """Whether the file's tensors `a` and `b` hold the same values (compared a run of rows at a
        time: a tied embedding can be large)."""
        x, y = self.handle.get_slice(a), self.handle.get_slice(b)
        if x.get_shape() != y.get_shape() or x.get_dtype() != y.get_dtype():
            return False
        shape = x.get_shape()
        if not shape:
            return torch.equal(self.handle.get_tensor(a), self.handle.get_tensor(b))
        dtype = _TORCH_DTYPES.get(x.get_dtype())
        row = max(1, math.prod(shape[1:]) * (dtype.itemsize if dtype is not None else 8))
        step = max(1, chunk_bytes // row)
        return all(torch.equal(x[s : s + step], y[s : s + step]) for s in range(0, shape[0], step))

    def _match(self) -> dict[int, str]:
        """Leaf -> its tensor's name in the file; raises naming the first leaf that does not fit."""
        layout, where = self.layout, self.spec.path
        in_file = set(self.handle.keys())
        found: dict[int, str] = {}
        used: set[str] = set()
        for i, names in enumerate(state_dict_names(layout)):
            candidates = [self.spec.rename(n) for n in names]
            used.update(candidates)
            name = next((c for c in candidates if c in in_file), None)
            if name is None:
                if not names:  # a non-persistent buffer: no state dict holds it
                    if self.leaves[i].is_meta:
                        raise CheckpointError(
                            f"{layout.describe_leaf(i)} is a non-persistent buffer, which a state dict file does not "
                            f"hold, and it is on the meta device: give it its values in params (build the buffers "
                            f"on CPU), or initialize with fs.initialize.from_module"
                        )
                    continue
                also = f" (nor under its aliases {candidates[1:]})" if len(candidates) > 1 else ""
                raise CheckpointError(
                    f"{where} lacks {candidates[0]!r}{also}, {_describe_full(layout, i)}: the file was saved from "
                    f"another model (or pass rename= to map state-dict names to the file's)"
                )
            stored = self.handle.get_slice(name)
            shape, dtype = tuple(stored.get_shape()), _TORCH_DTYPES.get(stored.get_dtype())
            if shape != tuple(layout.full_shape(i)) or dtype != layout.dtypes[i]:
                got = f"{str(dtype).removeprefix('torch.') if dtype else stored.get_dtype()}{list(shape)}"
                want = f"{str(layout.dtypes[i]).removeprefix('torch.')}{list(layout.full_shape(i))}"
                raise CheckpointError(
                    f"{where} holds {name!r} as {got}, but {_describe_full(layout, i)} is {want}: the file was saved "
                    f"from another model or in another dtype (no casts are made)"
                )
            for alias in dict.fromkeys(c for c in candidates if c != name and c in in_file):
                if not self._same(name, alias):
                    raise CheckpointError(
                        f"{where} holds {name!r} and {alias!r} with different values, but this state ties them into "
                        f"one leaf, {_describe_full(layout, i)}: the file was saved from a model that does not tie "
                        f"them; load it into an untied model, or pass rename= to read both names from one tensor"
                    )
            found[i] = name
        if self.spec.strict:
            extra = [n for n in self.handle.keys() if n not in used and n not in self.spec.elsewhere]
            if extra:
                raise CheckpointError(
                    f"{where} holds {extra[0]!r}, which no leaf of this state takes ({len(extra)} such tensors): pass "
                    f"strict=False to ignore them, or rename= to map names"
                )
        return found

    def read(self, leaf: int, start: int, length: int) -> torch.Tensor:
        if leaf not in self.names:
            return self.leaves[leaf].detach().reshape(-1)[start : start + length]
        stored = self.handle.get_slice(self.names[leaf])
        shape = self.layout.full_shape(leaf)
        parts = [stored[index].reshape(-1) for index in flat_range_slices(shape, start, start + length)]
        out = torch.cat(parts) if len(parts) != 1 else parts[0]
        assert out.numel() == length, (self.names[leaf], start, length, out.numel())
        self.spec.elements_read += length
        return out

    def whole(self, leaf: int) -> torch.Tensor:
        if leaf not in self.names:
            return self.leaves[leaf].detach()
        value = self.handle.get_tensor(self.names[leaf])
        self.spec.elements_read += value.numel()
        return value

    def close(self) -> None:
        handle, self.handle = getattr(self, "handle", None), None
        if handle is not None:
            handle.__exit__(None, None, None)
