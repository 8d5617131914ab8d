"""The checkpoint format: what a state is stored as, under which names, by which rank.

A checkpoint names every tensor by what it is, never by where it lived:

    params/<leaf path>                 a model leaf, e.g. params/blocks.0.attn.weight
    opt/<state path>/<leaf path>       a parameter-like optimizer leaf, e.g. opt/exp_avg/blocks.0.attn.weight
    opt/<state path>                   any other optimizer leaf, e.g. opt/count

Each is one logical tensor of the leaf's full shape. A sharded one (parameters, and optimizer
state shaped like them) is stored flattened, as 1-D chunks `[offset, offset + length)`: a rank's
shard of a flat buffer covers a contiguous range of the buffer's concatenated leaves, i.e. one
chunk of each leaf it touches (padding is never stored). The chunks of a leaf tile it exactly,
so the format depends on neither the unit policy, nor the padding, nor the world size, and any
layout can read any range back. Whole tensors (module buffers, replicated optimizer leaves such
as a step count) are stored once, with their shape, by rank 0.

A leaf split by a tensor-parallel placement (`Split(dim, axis, chunks)` over `parts` ranks) is
stored in its *split order* (`Entry.split = (dim, chunks, parts)`, format version 3): the full
tensor viewed as `[before, chunks, parts, per, after]` (`before`/`after`: the products of the
dimensions before and after `dim`) and flattened with `parts` first, so that each rank's piece
is one contiguous range, `[t * numel / parts, (t + 1) * numel / parts)` for the rank at
coordinate t, in the piece's own C order. Its FSDP shards are then ranges of that range, written
by the ranks that hold them; a layout with the same split reads its ranges directly, any other
rebuilds the full leaf (`from_split_order`) and cuts it. A split whose pieces already are
contiguous in C order (dimension 0 or only size-1 dimensions before it, one chunk) is stored in
C order (`split` None), as are all other leaves: a checkpoint with no other split is version 2,
readable by a functional_shard that knows no tensor parallelism.

The optimizer state may be any pytree: a dict whose keys are exactly the trainable buffer names
and whose values are shard-shaped (`[spec.shard_numel]`) is parameter-like; every other tensor
leaf is replicated state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import optree
import torch

from .._basemesh import BaseMesh
from .._export_file import state_dict_names
from .._layout import BufferSpec, Layout
from .._placed import layouts_say
from .._pytree import NAMESPACE

FORMAT = "functional_shard.checkpoint"
VERSION = 3  # 3: tensors stored in a split order (`Entry.split`); 2: the save's identity and CRC-32s
READ_VERSIONS = (2, 3)  # what `load` reads; a save writes 2 unless some entry has a split order
INDEX = "index.json"  # what the checkpoint holds and where (rank 0 writes it first)
COMMIT = "COMMIT"  # the marker rank 0 writes last, once every rank's file is on disk


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read, or used for the given state."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    """The torch dtype called `name`; never anything else (the index is data, not code)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint index names an unknown dtype {name!r:.40}")
    return dtype


@dataclasses.dataclass(frozen=True)
class Entry:
    """One logical tensor of a checkpoint.

    Attributes:
        key: its name (`params/...` or `opt/...`).
        shape / dtype: of the full tensor.
        sharded: stored as 1-D chunks by the shard ranks (else whole, by rank 0).
        split: `(dim, chunks, parts)`: stored flattened in that split order (see the module's
            docstring), each of `parts` tensor-parallel pieces contiguous; None: C order.
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool
    split: tuple[int, int, int] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


def split_order(shape: tuple[int, ...], placement: Any, parts: int) -> tuple[int, int, int] | None:
    """The order a leaf of full `shape` with tensor-parallel `placement` (a `Split`, or None) over
    `parts` ranks is stored in: `(dim, chunks, parts)`, or None when C order already keeps each
    piece contiguous (no split, one part, or one chunk of a dimension with only size-1
    dimensions before it)."""
    if placement is None or parts == 1:
        return None
    dim, chunks = placement.dim % len(shape), placement.chunks
    if chunks == 1 and math.prod(shape[:dim]) == 1:
        return None
    return (dim, chunks, parts)


def _split_view(shape: tuple[int, ...], split: tuple[int, int, int]) -> tuple[int, int, int, int, int]:
    dim, chunks, parts = split
    return (math.prod(shape[:dim]), chunks, parts, shape[dim] // (chunks * parts), math.prod(shape[dim + 1 :]))


def to_split_order(full: torch.Tensor, split: tuple[int, int, int] | None) -> torch.Tensor:
    """`full` flattened in the order `split` (from `split_order`) stores it (a 1-D tensor)."""
    if split is None:
        return full.reshape(-1)
    return full.reshape(_split_view(tuple(full.shape), split)).permute(2, 0, 1, 3, 4).reshape(-1)


def from_split_order(flat: torch.Tensor, shape: tuple[int, ...], split: tuple[int, int, int] | None) -> torch.Tensor:
    """The inverse of `to_split_order`: the tensor of `shape` whose elements `flat` holds in the order `split`."""
    if split is None:
        return flat.reshape(shape)
    before, chunks, parts, per, after = _split_view(shape, split)
    return flat.reshape(parts, before, chunks, per, after).permute(1, 2, 0, 3, 4).reshape(shape)


class Piece(NamedTuple):
    """The part of one leaf inside one rank's shard of a flat buffer."""

    leaf: int  # index of the leaf in the layout's flatten order
    leaf_offset: int  # first element, in the leaf flattened
    shard_offset: int  # where it sits in the shard
    length: int  # elements (never 0)


def shard_pieces(spec: BufferSpec, shard_index: int) -> list[Piece]:
    """The leaves' ranges that shard `shard_index` of buffer `spec` holds, in buffer order.

    The shard covers `[shard_index * shard_numel, (shard_index + 1) * shard_numel)` of the
    padded buffer; the leaves lie back to back from 0, the padding after them."""
    start = shard_index * spec.shard_numel
    stop = start + spec.shard_numel
    pieces, offset = [], 0
    for leaf, size in zip(spec.leaves, spec.sizes):
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            pieces.append(Piece(leaf, lo - offset, lo - start, hi - lo))
        offset += size
    return pieces


class OptimizerSlot(NamedTuple):
    """One leaf of the optimizer state once parameter-like dicts are taken as leaves."""

    path: str  # e.g. "exp_avg", "0/momentum_buffer", "count"
    param_like: bool  # a dict trainable buffer name -> shard
    value: Any  # that dict, or the tensor


def optimizer_slots(opt_state: Any, layout: Layout) -> tuple[list[OptimizerSlot], optree.PyTreeSpec]:
    """The optimizer state's slots (flatten order) and its structure (parameter-like dicts as
    leaves; `str` of it is what a checkpoint records).

    Raises `CheckpointError` naming a leaf that is not a tensor."""
    trainable = [spec for spec in layout.buffers if spec.trainable]
    names = {spec.name for spec in trainable}

    def is_param_like(x: Any) -> bool:
        # (a rank without trainable leaves, a pipeline stage all frozen, holds `{}` there: the
        # same structure as the ranks that hold tensors, as the built-in optimizers keep a field
        # either a tree over the parameters or None)
        return (
            isinstance(x, dict)
            and set(x) == names
            and all(isinstance(x[s.name], torch.Tensor) and tuple(x[s.name].shape) == (s.shard_numel,) for s in trainable)
        )

    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        opt_state, is_leaf=is_param_like, none_is_leaf=False, namespace=NAMESPACE
    )
    slots = []
    for accessor, leaf in zip(accessors, leaves):
        path = "/".join(_entry_name(entry) for entry in accessor)
        if is_param_like(leaf):
            slots.append(OptimizerSlot(path, True, leaf))
        elif isinstance(leaf, torch.Tensor):
            slots.append(OptimizerSlot(path, False, leaf))
        else:
            raise CheckpointError(
                f"optimizer state leaf {path or '<root>'!r} is a {type(leaf).__name__} ({leaf!r:.60}), not a tensor: "
                f"a checkpoint stores tensors only"
            )
    return slots, treedef


def _entry_name(entry: Any) -> str:
    """A path entry as text: a NamedTuple's or dataclass's field name, a key, or an index."""
    field = getattr(entry, "field", None)
    return field if isinstance(field, str) else str(entry.entry)


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def model_key(layout: Layout, leaf: int) -> str:
    return _join("params", layout.paths[leaf])


def optimizer_key(slot_path: str, leaf_path: str | None = None) -> str:
    return _join("opt", slot_path, leaf_path or "")


def step_tensors(state: Any) -> list[tuple[str, torch.Tensor]]:
    """The step state's own tensors, stored whole: the RNG seed and the loss scale's state."""
    out = [("state/rng", state.rng)]
    if state.loss_scale is not None:
        out += [(f"state/loss_scale/{name}", value) for name, value in state.loss_scale._asdict().items()]
    return out


def leaf_split(layout: Layout, leaf: int) -> tuple[int, int, int] | None:
    """The order leaf `leaf` of `layout` is stored in (`split_order` of its placement)."""
    placement = layout.placement(leaf)
    if placement is None:
        return None
    full, piece = layout.full_shape(leaf), layout.shapes[leaf]
    return split_order(full, placement, full[placement.dim] // piece[placement.dim])


def piece_start(layout: Layout, leaf: int, coordinates: dict[str, int]) -> int:
    """Where the piece of leaf `leaf` held at `coordinates` (a rank's, on every mesh axis)
    starts in the leaf's stored order: its coordinate on the placement's axis times the piece's
    elements (0 for a leaf held whole)."""
    placement = layout.placement(leaf)
    return 0 if placement is None else coordinates[placement.axis] * math.prod(layout.shapes[leaf])


def entries_of(layout: Layout, slots: list[OptimizerSlot], extras: list[tuple[str, torch.Tensor]] = ()) -> list[Entry]:
    """Every logical tensor of a state with this layout and optimizer state, in a fixed order:
    model leaves (flatten order), then optimizer slots, each parameter-like one by leaf, then
    the step's own tensors (`step_tensors`). Shapes are the full leaves' (before a
    tensor-parallel placement cut them), with their stored order (`leaf_split`)."""
    local = set(layout.local)
    out = [
        Entry(model_key(layout, i), tuple(layout.full_shape(i)), layout.dtypes[i], i not in local, leaf_split(layout, i))
        for i in range(len(layout.paths))
    ]
    for slot in slots:
        if slot.param_like:
            for spec in layout.buffers:
                if spec.trainable:
                    for i in spec.leaves:
                        key = optimizer_key(slot.path, layout.paths[i])
                        dtype = slot.value[spec.name].dtype
                        out.append(Entry(key, tuple(layout.full_shape(i)), dtype, True, leaf_split(layout, i)))
        else:
            out.append(Entry(optimizer_key(slot.path), tuple(slot.value.shape), slot.value.dtype, False))
    out += [Entry(key, tuple(value.shape), value.dtype, False) for key, value in extras]
    seen: set[str] = set()
    for entry in out:
        if entry.key in seen:
            raise CheckpointError(
                f"two tensors of the state would be stored under the same name {entry.key!r}: rename a leaf "
                f"(leaf paths must be unique once written as text)"
            )
        seen.add(entry.key)
    return out


def entry_to_json(entry: Entry, chunks: list[list]) -> dict:
    item = {"key": entry.key, "shape": list(entry.shape), "dtype": dtype_name(entry.dtype), "sharded": entry.sharded}
    if entry.split is not None:
        item["split"] = list(entry.split)
    return {**item, "chunks": chunks}


def entry_from_json(item: Any) -> tuple[Entry, list[tuple[str, str, int, int]]]:
    """An index item back as `(Entry, chunks)`; each chunk `(file, tensor name, offset, length)`.
    Checks types and that the chunks tile the tensor exactly."""
    try:
        key, shape, sharded, raw_chunks = item["key"], item["shape"], item["sharded"], item["chunks"]
        dtype = parse_dtype(item["dtype"])
        if not (isinstance(key, str) and isinstance(sharded, bool) and isinstance(shape, list)):
            raise TypeError
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TypeError
        chunks = [(str(f), str(n), int(o), int(length)) for f, n, o, length in raw_chunks]
        split = item.get("split")
        if split is not None:
            if not (isinstance(split, list) and len(split) == 3 and all(isinstance(v, int) and v >= 1 for v in split[1:])):
                raise TypeError
            dim, chunk_count, parts = split
            if not (isinstance(dim, int) and 0 <= dim < len(shape) and shape[dim] % (chunk_count * parts) == 0):
                raise TypeError
            split = (dim, chunk_count, parts)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"the checkpoint index has a malformed entry ({item!r:.120})") from error
    entry = Entry(key, tuple(shape), dtype, sharded, split)
    covered = 0
    for _, _, offset, length in sorted(chunks, key=lambda c: c[2]):
        if offset != covered or length <= 0:
            raise CheckpointError(
                f"the chunks of {key!r} do not tile its {entry.numel} elements: a gap or overlap at element {covered}"
            )
        covered += length
    if covered != entry.numel:
        raise CheckpointError(f"the chunks of {key!r} cover {covered} of its {entry.numel} elements")
    return entry, chunks


def check_compatible(
    saved: list[Entry], saved_structure: str, expected: list[Entry], structure: str, where: str, covered: set[str] | None = None
) -> None:
    """Raise `CheckpointError` naming the first difference between the checkpoint and the state:
    a model leaf (in the state's order) whose name, shape or dtype differs, or that only the
    checkpoint has; else the optimizer's structure; else the first optimizer tensor that differs.

    `covered`: the checkpoint's tensors that some rank's state holds, where ranks hold different
    leaves (a pipelined step's stages): a tensor this rank lacks is then the state's if another
    rank holds it. None: this rank's state is the whole state."""
    hint = "the checkpoint was saved from another model or optimizer (or another version of it)"

    def differ(what: str) -> CheckpointError:
        return CheckpointError(f"{where} does not fit this state: {what}; {hint}")

    by_key = {e.key: e for e in saved}
    expected_keys = {e.key for e in expected} if covered is None else {e.key for e in expected} | covered
    for part in ("params/", "opt/"):
        if part == "opt/" and saved_structure != structure:
            raise differ(f"its optimizer state is structured as {saved_structure}, this state's as {structure}")
        for entry in expected:
            if entry.key.startswith(part):
                other = by_key.get(entry.key)
                if other is None:
                    raise differ(f"{entry.key!r} ({entry.describe()}) is not in the checkpoint")
                if other.shape != entry.shape or other.dtype != entry.dtype:
                    raise differ(f"{entry.key!r} is {other.describe()} in the checkpoint but {entry.describe()} in this state")
        for entry in saved:
            if entry.key.startswith(part) and entry.key not in expected_keys:
                raise differ(f"{entry.key!r} ({entry.describe()}) is in the checkpoint but not in this state")
    for entry in expected:  # the step's own tensors (rng, loss scale)
        if entry.key.startswith(("params/", "opt/")):
            continue
        other = by_key.get(entry.key)
        if other is None and entry.key.startswith("state/loss_scale/"):
            raise CheckpointError(
                f"{where} has no loss-scale state ({entry.key!r} is not in it): it was saved by a step without fp16 "
                f"loss scaling (`fs.LossScale`), and this state has it. To go on with loss scaling from a fresh "
                f"scale: `state = fs.checkpoint.load(path, template.replace(loss_scale=None))"
                f".replace(loss_scale=template.loss_scale)`"
            )
        if other is None:
            raise differ(f"{entry.key!r} ({entry.describe()}) is not in the checkpoint")
        if other.shape != entry.shape or other.dtype != entry.dtype:
            raise differ(f"{entry.key!r} is {other.describe()} in the checkpoint but {entry.describe()} in this state")
    for entry in saved:
        if entry.key not in expected_keys:
            raise differ(f"{entry.key!r} ({entry.describe()}) is in the checkpoint but not in this state")


def held_elsewhere(layout: Layout, groups: tuple[int, ...], mesh: BaseMesh, rename) -> tuple[set[str], set[str]]:
    """Where the ranks hold different leaves (a pipelined state's coordinates hold their
    stages): the checkpoint names that any rank's state takes (every state-dict name, renamed)
    and the trainable ones (first names), as the first rank of each layout says. A collective."""
    names = state_dict_names(layout)
    trainable = {i for spec in layout.buffers if spec.trainable for i in spec.leaves}
    told = {
        "model": [rename(n) for i in range(len(names)) for n in names[i]],
        "trainable": [rename(names[i][0] if names[i] else layout.paths[i]) for i in sorted(trainable)],
    }
    every = layouts_say(mesh, groups, told).values()
    return {n for t in every for n in t["model"]}, {n for t in every for n in t["trainable"]}
