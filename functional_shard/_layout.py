"""Layouts: how a pytree of tensors is cut into units, flat buffers and per-rank shards.

The leaves of a unit that share a dtype and a role are concatenated, in leaf order, into one
flat buffer, padded with zeros to `num_shards * shard_numel` (never less than one element per
rank, so that no collective ever moves an empty tensor). Rank `i` of the shard axis keeps
elements `[i * shard_numel, (i + 1) * shard_numel)`. Module buffers (role `buffer`) are not
part of any flat buffer: each rank keeps its own copy whole.

A layout is immutable and hashable; it is all that `gather(shard(tree)) == tree` needs to be
exact for any shapes (0-d and empty included) and any dtype.

On a mesh with a tensor-parallel axis, FSDP is one placement among others: the tree laid out is
the rank's *tensor-parallel-local* tree (each leaf already cut by its placement, e.g.
`Split(0, "tp")`), the layout records each leaf's placement and full shape, and leaves that are
split and leaves that are whole on every rank of the model axes go to buffers of their own (a
unit with both gets `<unit>` and `<unit>/replicated`), so that a reduction over the whole model
counts each of them once (`Layout.replicated_buffers`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import optree
import torch

from ._pytree import NAMESPACE, tree_flatten, tree_paths
from ._tree import BUFFER, TRAINABLE, ModuleParams, leaf_roles
from ._units import Units, assign_units

__all__ = ["BufferSpec", "Layout", "make_layout", "check_leaves_match", "LayoutError"]


class LayoutError(ValueError):
    """A pytree that cannot be sharded, or a sharded value that does not fit its layout."""


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    """One flat buffer: the leaves of one unit with one dtype and one role.

    Attributes:
        name: `unit`, with `/frozen` for frozen leaves and `/<dtype>` when the unit holds
            several dtypes in that role.
        unit: the unit it belongs to (e.g. `blocks.3`).
        dtype: the dtype of every leaf in it, and of the buffer.
        trainable: True for trainable parameters, False for frozen ones.
        leaves: indices of its leaves in the tree's flatten order.
        numel: elements before padding (sum of the leaves' numels).
        shard_numel: elements each rank keeps (`ceil(numel / num_shards)`, at least 1).
        gather_dtype: the dtype it is all-gathered and computed in (`dtype` unless mixed
            precision says otherwise).
        reduce_dtype: the dtype its gradient is reduce-scattered in.
    """

    name: str
    unit: str
    dtype: torch.dtype
    trainable: bool
    leaves: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int
    shard_numel: int
    num_shards: int
    gather_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.gather_dtype is None:
            object.__setattr__(self, "gather_dtype", self.dtype)
        if self.reduce_dtype is None:
            object.__setattr__(self, "reduce_dtype", self.gather_dtype)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.num_shards

    @property
    def nbytes(self) -> int:
        """Bytes of the full (unsharded, padded) buffer as gathered: what one all-gather of it moves."""
        return self.padded_numel * self.gather_dtype.itemsize

    @property
    def reduce_nbytes(self) -> int:
        """Bytes of its full gradient as reduce-scattered."""
        return self.padded_numel * self.reduce_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every leaf of a pytree lives once sharded.

    Attributes:
        treedef: the pytree structure (optree, namespace `functional_shard`).
        paths / shapes / dtypes / roles: one entry per leaf, in flatten order.
        buffers: the flat buffers (units x dtypes x roles), in order of first appearance.
        local: indices of the leaves that are not sharded (module buffers), kept whole per rank.
        num_shards: size of the mesh's shard axis.
        placements: per leaf, its tensor-parallel placement (`fs.tensor_parallel.Split` with a
            non-negative dim) or None for a leaf every rank of the model axes holds whole; `()`
            when no leaf is split (then `shapes` are the full shapes).
        full_shapes: per leaf, its shape before the placement cut it (`()` when no leaf is split).
        blocks: the number of canonical blocks of every buffer (`sharded_step(...,
            canonical_chunks=G)`: `G`), or 0. With blocks, each buffer is padded to a multiple
            of `blocks * BLOCK_ALIGN` elements whatever the number of shards, so that its
            blocks (and each shard, a whole number of them) are the same at every layout.
    """

    treedef: optree.PyTreeSpec
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    roles: tuple[str, ...]
    buffers: tuple[BufferSpec, ...]
    local: tuple[int, ...]
    num_shards: int
    placements: tuple = ()
    full_shapes: tuple[tuple[int, ...], ...] = ()
    blocks: int = 0

    def __hash__(self) -> int:
        # A step looks its traced graph up by layout on every call: hash the (possibly
        # thousands of) paths and shapes once per layout, not once per step.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        return cached

    @property
    def units(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.unit for b in self.buffers))

    def signature(self) -> str:
        """A text that two ranks' layouts share exactly when they are the same."""
        leaves = ";".join(
            f"{p}:{tuple(s)}:{str(d).removeprefix('torch.')}:{r}"
            for p, s, d, r in zip(self.paths, self.shapes, self.dtypes, self.roles)
        )
        units = ";".join(f"{b.name}={b.leaves}:{b.gather_dtype}:{b.reduce_dtype}" for b in self.buffers)
        split = ";".join(f"{i}:{p!r}" for i, p in enumerate(self.placements) if p is not None)
        return f"{self.treedef}|{leaves}|{units}|{self.num_shards}|{split}|{self.blocks}"

    def placement(self, index: int):
        """Leaf `index`'s tensor-parallel placement, or None when every rank holds it whole."""
        return self.placements[index] if self.placements else None

    def full_shape(self, index: int) -> tuple[int, ...]:
        """Leaf `index`'s shape before its placement cut it."""
        return self.full_shapes[index] if self.full_shapes else self.shapes[index]

    @property
    def is_split(self) -> bool:
        """Whether some leaf is split over a model-parallel axis."""
        return any(p is not None for p in self.placements)

    @property
    def replicated_buffers(self) -> frozenset[str]:
        """Names of the buffers whose leaves every rank of the model-parallel axes holds whole
        (empty when no leaf is split): a sum over the whole model counts them on one such rank."""
        if not self.is_split:
            return frozenset()
        return frozenset(b.name for b in self.buffers if all(self.placements[i] is None for i in b.leaves))

    def eager_bytes(self, microbatches: int = 1, accumulate: str = "sharded", keep: bool = False) -> tuple[int, int]:
        """(gathered, reduce-scattered) bytes the eager reference moves per step: frozen buffers
        gathered once, trainable ones once per micro-batch (ZeRO-1, `keep`: trainable ones once,
        after the update, and frozen ones never), reduce-scattered once per micro-batch
        ("sharded") or once ("full")."""
        frozen = sum(b.nbytes for b in self.buffers if not b.trainable)
        trainable = sum(b.nbytes for b in self.buffers if b.trainable)
        scattered = sum(b.reduce_nbytes for b in self.buffers if b.trainable)
        gathered = trainable if keep else frozen + microbatches * trainable
        return gathered, scattered * (microbatches if accumulate == "sharded" else 1)

    def describe_leaf(self, index: int) -> str:
        shape = list(self.shapes[index])
        return f"leaf {self.paths[index]!r} (shape {shape}, {str(self.dtypes[index]).removeprefix('torch.')})"

    # --- flat buffers <-> leaves -------------------------------------------------------------

    def flatten_buffer(self, spec: BufferSpec, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full padded buffer `[padded_numel]` of `spec` from the tree's leaves (all of them)."""
        parts = [leaves[i].reshape(-1) for i in spec.leaves]
        pad = spec.padded_numel - spec.numel
        parts.append(torch.zeros(pad, dtype=spec.dtype, device=_device_of(parts)))
        return torch.cat(parts)

    def unflatten_buffer(self, spec: BufferSpec, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of the leaves of `spec` in a full buffer. `split` + `view`: its backward is one
        `cat`, where slicing leaf by leaf would add a full-size zero tensor per leaf."""
        pieces = torch.split(full, [*spec.sizes, spec.padded_numel - spec.numel])
        return [piece.view(self.shapes[i]) for piece, i in zip(pieces, spec.leaves)]

    def shard_of(self, full: torch.Tensor, spec: BufferSpec, shard_index: int) -> torch.Tensor:
        """Rank `shard_index`'s slice of a full buffer, as a tensor of its own."""
        start = shard_index * spec.shard_numel
        return full[start : start + spec.shard_numel].clone()

    def assemble(self, buffer_leaves: dict[int, torch.Tensor], local: Sequence[torch.Tensor]) -> Any:
        """The pytree from leaves of the flat buffers (index -> tensor) and the local leaves."""
        leaves: list[Any] = [None] * len(self.paths)
        for i, t in buffer_leaves.items():
            leaves[i] = t
        for i, t in zip(self.local, local):
            leaves[i] = t
        return optree.tree_unflatten(self.treedef, leaves)


def _device_of(parts: list[torch.Tensor]) -> torch.device:
    return parts[0].device if parts else torch.device("cpu")


def make_layout(
    tree: Any,
    num_shards: int,
    *,
    units: Units = None,
    precision: Any = None,
    placements: Sequence[Any] | None = None,
    full_shapes: Sequence[tuple[int, ...]] | None = None,
    blocks: int = 0,
) -> tuple[Layout, list[torch.Tensor]]:
    """The layout of `tree` over `num_shards` shards, and its leaves (flatten order).

    Arguments:
        tree: a pytree whose leaves are all tensors (a `ModuleParams` may sit anywhere in it).
        num_shards: size of the shard axis.
        units: the unit policy: an `fs.UnitPolicy` (called once with the paths of the sharded
            leaves, in flatten order) or a function `path -> unit name` (called leaf by leaf);
            default `fs.BlockUnits()` (one unit per repeated block, `input` and `output` for
            the leaves before and after the blocks).
        precision: an `fs.Precision` giving each leaf its gather and reduce dtypes (leaves of a
            unit that differ in them get buffers of their own; parameters of BatchNorm modules,
            as a `ModuleParams` names them, keep theirs by default); None: their own dtype.
        blocks: canonical blocks per buffer (0: none; else a multiple of `num_shards`): every
            buffer is padded to a multiple of `blocks * BLOCK_ALIGN` elements.

    Raises `LayoutError` naming the path of a leaf that is not a tensor, or that the policy
    gives no unit name (a str).
    """
    leaves, treedef = tree_flatten(tree)
    paths = tree_paths(tree)
    roles = leaf_roles(tree)
    batch_norm = _batch_norm_leaves(tree)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            hint = (
                "pass the params of `apply_fn, params = fs.functionalize(model)`, not the module"
                if isinstance(leaf, torch.nn.Module)
                else "every leaf of a sharded pytree must be a tensor (put static values in the function, not the tree)"
            )
            shown = " ".join(repr(leaf).split())
            raise LayoutError(f"leaf {path!r} is a {type(leaf).__name__} ({shown:.80}), not a torch.Tensor: {hint}")
        if leaf.layout != torch.strided:
            raise LayoutError(
                f"leaf {path!r} (shape {list(leaf.shape)}, {leaf.dtype}) is a {leaf.layout} tensor: only dense "
                f"(strided) tensors can be flattened into a sharded buffer; call .to_dense() on it first"
            )
        if leaf.is_quantized:
            raise LayoutError(
                f"leaf {path!r} (shape {list(leaf.shape)}) is a quantized tensor ({leaf.dtype}): shard its "
                f"dequantized values (.dequantize()) or keep it out of the parameter tree"
            )
    local = [i for i, role in enumerate(roles) if role == BUFFER]
    sharded = [i for i, role in enumerate(roles) if role != BUFFER]
    in_use = [i for i in leaves_in_use(tree) if roles[i] != BUFFER]  # the unit policy sees them in the order of use
    try:
        unit_of = dict(zip(in_use, assign_units(units, [paths[i] for i in in_use])))
    except ValueError as error:
        raise LayoutError(str(error)) from None
    placements = tuple(placements) if placements is not None and any(p is not None for p in placements) else ()
    split = [bool(placements) and placements[i] is not None for i in range(len(leaves))]
    groups: dict[tuple[str, bool, bool, torch.dtype, torch.dtype, torch.dtype], list[int]] = {}
    for i in sharded:
        path, leaf, role, unit = paths[i], leaves[i], roles[i], unit_of[i]
        # Only floating leaves can be differentiated; others are carried like frozen ones.
        trainable = role == TRAINABLE and leaf.dtype.is_floating_point
        if precision is None:
            gather, reduce = leaf.dtype, leaf.dtype
        elif batch_norm[i]:
            gather, reduce = precision.dtypes(path, unit, leaf.dtype, batch_norm=True)
        else:
            gather, reduce = precision.dtypes(path, unit, leaf.dtype)
        groups.setdefault((unit, trainable, split[i], leaf.dtype, gather, reduce), []).append(i)
    per_unit_role: dict[tuple[str, bool, bool], list[tuple]] = {}
    kinds: dict[tuple[str, bool], set[bool]] = {}
    for unit, trainable, is_split, *dtypes in groups:
        per_unit_role.setdefault((unit, trainable, is_split), []).append(tuple(dtypes))
        kinds.setdefault((unit, trainable), set()).add(is_split)
    specs = []
    for (unit, trainable, is_split, dtype, gather, reduce), members in groups.items():
        name = unit + ("" if trainable else "/frozen")
        if not is_split and len(kinds[unit, trainable]) > 1:
            name += "/replicated"
        siblings = per_unit_role[unit, trainable, is_split]
        if len({d[0] for d in siblings}) > 1:
            name += "/" + str(dtype).removeprefix("torch.")
        if len({d[1:] for d in siblings if d[0] == dtype}) > 1:
            name += "@" + str(gather).removeprefix("torch.")
        sizes = tuple(leaves[i].numel() for i in members)
        numel = sum(sizes)
        specs.append(
            BufferSpec(
                name=name,
                unit=unit,
                dtype=dtype,
                trainable=trainable,
                leaves=tuple(members),
                sizes=sizes,
                numel=numel,
                shard_numel=_shard_numel(numel, num_shards, blocks),
                num_shards=num_shards,
                gather_dtype=gather,
                reduce_dtype=reduce,
            )
        )
    layout = Layout(
        treedef=treedef,
        paths=tuple(paths),
        shapes=tuple(tuple(leaf.shape) for leaf in leaves),
        dtypes=tuple(leaf.dtype for leaf in leaves),
        roles=tuple(roles),
        buffers=tuple(specs),
        local=tuple(local),
        num_shards=num_shards,
        placements=placements,
        full_shapes=tuple(tuple(s) for s in full_shapes) if placements and full_shapes is not None else (),
        blocks=blocks,
    )
    return layout, leaves


# Elements: a canonical block is a multiple of it, so that a shard (a whole number of blocks)
# never ends inside a vector loop's step: an elementwise kernel then treats every element the
# same way (vector body, never the scalar tail) at every layout.
BLOCK_ALIGN = 64


def _shard_numel(numel: int, num_shards: int, blocks: int) -> int:
    if not blocks:
        return max(1, math.ceil(numel / num_shards))
    if blocks % num_shards:
        raise LayoutError(f"{blocks} canonical blocks cannot be split over {num_shards} shards")
    unit = blocks * BLOCK_ALIGN
    return max(1, math.ceil(numel / unit)) * unit // num_shards


def _batch_norm_leaves(tree: Any) -> list[bool]:
    """Per leaf of `tree` (flatten order): whether a `ModuleParams` names it a parameter of a
    BatchNorm module (`fs.functionalize` records them)."""

    def flags(node: Any) -> Any:
        if not isinstance(node, ModuleParams):
            return False
        named = set(node.batch_norm)
        return ModuleParams(
            {k: k in named for k in node.trainable},
            {k: k in named for k in node.frozen},
            {k: False for k in node.buffers},
            aliases=node.aliases,
            non_persistent=node.non_persistent,
            batch_norm=node.batch_norm,
            order=node.order,
        )

    flag_tree = optree.tree_map(
        flags, tree, is_leaf=lambda x: isinstance(x, ModuleParams), none_is_leaf=False, namespace=NAMESPACE
    )
    return tree_flatten(flag_tree)[0]


def leaves_in_use(tree: Any) -> list[int]:
    """The indices (flatten order) of `tree`'s leaves in their order of use: a `ModuleParams` at
    the root orders its leaves by its `order` (the module's registration order, which
    `fs.functionalize` records); any other tree, the flatten order."""
    if isinstance(tree, ModuleParams):
        used = tree.used_order()
        return sorted(range(len(used)), key=used.__getitem__)
    return list(range(len(tree_flatten(tree)[0])))


def check_leaves_match(layout: Layout, leaves: Sequence[torch.Tensor], what: str) -> None:
    """Raise `LayoutError` naming the first leaf whose shape or dtype differs from the layout."""
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            raise LayoutError(f"{what}: leaf {layout.paths[i]!r} is a {type(leaf).__name__}, not a tensor")
        if tuple(leaf.shape) != layout.shapes[i] or leaf.dtype != layout.dtypes[i]:
            raise LayoutError(
                f"{what}: {layout.describe_leaf(i)} expected, got shape {list(leaf.shape)} "
                f"{str(leaf.dtype).removeprefix('torch.')}"
            )

