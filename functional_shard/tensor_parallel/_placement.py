"""Placements as values: which dimension of each leaf is split over which mesh axis.

A placement says where one leaf of the model lives on the tensor-parallel axes, before FSDP
flattens and shards what is left (JAX's `PartitionSpec`, DTensor's `Shard`/`Replicate`):

    fs.tensor_parallel.Replicated()                   # every rank of the axis holds the whole leaf
    fs.tensor_parallel.Split(dim=0, axis="tp")        # rank i of "tp" holds the i-th equal slice of dim 0
    fs.tensor_parallel.Split(0, "tp", chunks=3)       # a fused q|k|v weight: each third split alike
    fs.tensor_parallel.Split(0, "tp", granule=64)     # cut only between heads of 64 rows

Placements are chosen by rules on the leaves' paths (those of `fs.tree_paths(params)`, e.g.
`model.layers.0.self_attn.q_proj.weight`), first match wins, as `fs.optim.group` chooses
hyperparameters; leaves no rule matches are replicated. `placements_for` applies the rules to
the leaves' shapes for a mesh and checks everything before any tensor moves.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Any, Callable, Iterable, Mapping, Union

import torch

from .._basemesh import DATA_PARALLEL_AXES
from .._pytree import tree_leaves, tree_paths

__all__ = [
    "Replicated",
    "Split",
    "Placement",
    "Rule",
    "PlacementError",
    "rule",
    "placements_for",
    "local_shape",
    "split_tensor",
    "join_pieces",
]


class PlacementError(ValueError):
    """A placement rule or a leaf that cannot be placed on the mesh (the message says which and what to do)."""


@dataclasses.dataclass(frozen=True, repr=False)
class Replicated:
    """Every rank holds the whole leaf (norms, biases after a row-parallel matmul, buffers).

    FSDP may still shard it over the fsdp axis: a placement only speaks of tensor-parallel axes."""

    def describe(self) -> str:
        return "Replicated()"

    __repr__ = describe


@dataclasses.dataclass(frozen=True, repr=False)
class Split:
    """The leaf's dimension `dim` is cut into `mesh.shape[axis]` equal slices; the rank at
    coordinate i of `axis` holds slice i (DTensor's `Shard(dim)`).

    Arguments:
        dim: the split dimension (negative counts from the end; `placements_for` returns it
            non-negative).
        axis: the mesh axis it is split over, e.g. `"tp"`.
        chunks: the dimension is `chunks` equal blocks back to back (a fused q|k|v projection:
            3; a fused gate|up: 2), each split alike; rank i holds slice i of every block,
            concatenated in block order (Megatron's fused QKV, DTensor's `_StridedShard`,
            Hugging Face's `packed_colwise`). Default 1.
        granule: slices hold whole multiples of `granule` elements along `dim` (the head size
            of an attention projection, so that every rank holds whole heads). Default 1.

    A split needs `shape[dim]` divisible by `chunks * granule * mesh.shape[axis]`;
    `placements_for` refuses the leaf otherwise.
    """

    dim: int
    axis: str
    chunks: int = 1
    granule: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Split(dim=...) must be an int; got {self.dim!r}")
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"Split(axis=...) must be a mesh axis name such as 'tp'; got {self.axis!r}")
        for name in ("chunks", "granule"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Split({name}=...) must be a positive int; got {value!r}")

    def describe(self) -> str:
        extra = f", chunks={self.chunks}" if self.chunks != 1 else ""
        extra += f", granule={self.granule}" if self.granule != 1 else ""
        return f"Split(dim={self.dim}, axis={self.axis!r}{extra})"

    __repr__ = describe


Placement = Union[Replicated, Split]

# What a rule matches: a glob on the whole leaf path (`fnmatch`, `*` crosses dots), a compiled
# regular expression (`pattern.search(path)`), or a function `(path, shape) -> bool`.
Pattern = Union[str, "re.Pattern[str]", Callable[[str, tuple], bool]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """A pattern on leaf paths and the placement of the leaves it matches. Make one with `rule`.

    Attributes:
        pattern: a glob (str, `fnmatch` on the whole path), a compiled regular expression
            (`search`) or a function `(path, shape) -> bool`.
        placement: `Split(...)` or `Replicated()`.
        required: whether `placements_for` refuses the rule when it matches no leaf.
        style: what the rule came from, for the step that applies the plan (Hugging Face's
            style names: "colwise", "rowwise", "embedding_rowwise", ...), or None.
    """

    pattern: Pattern
    placement: Placement
    required: bool = True
    style: str | None = None

    def matches(self, path: str, shape: tuple[int, ...]) -> bool:
        if isinstance(self.pattern, str):
            return fnmatch.fnmatchcase(path, self.pattern)
        if isinstance(self.pattern, re.Pattern):
            return self.pattern.search(path) is not None
        return bool(self.pattern(path, shape))

    def describe(self) -> str:
        if isinstance(self.pattern, str):
            pattern = repr(self.pattern)
        elif isinstance(self.pattern, re.Pattern):
            pattern = f"re.compile({self.pattern.pattern!r})"
        else:
            pattern = getattr(self.pattern, "__qualname__", repr(self.pattern))
        return f"rule({pattern}, {self.placement.describe()})"


def rule(pattern: Pattern, placement: Placement, *, required: bool = True, style: str | None = None) -> Rule:
    """A placement rule: the leaves whose path `pattern` matches take `placement`.

        fs.tensor_parallel.rule("blocks.*.mlp.fc.weight", fs.tensor_parallel.Split(0, "tp"))
        fs.tensor_parallel.rule(re.compile(r"\\.proj\\.bias$"), fs.tensor_parallel.Replicated())

    Arguments:
        pattern: a glob matched against the whole leaf path (`fnmatch`, `*` also matches dots),
            a compiled regular expression (`pattern.search(path)`), or a function
            `(path, shape) -> bool`.
        placement: `Split(dim, axis, ...)` or `Replicated()`.
        required: refuse the rule in `placements_for` when it matches no leaf (default: a typo
            never silently replicates a leaf meant to be split).
        style: a label kept with the rule (the plan style it came from).
    """
    if not (isinstance(pattern, (str, re.Pattern)) or callable(pattern)):
        raise TypeError(
            f"a placement rule's pattern must be a glob, a compiled regex or a function; got {pattern!r:.60}"
        )
    if not isinstance(placement, (Split, Replicated)):
        raise TypeError(f"a placement rule's placement must be Split(...) or Replicated(); got {placement!r:.60}")
    return Rule(pattern, placement, required, style)


def _as_rules(rules: Any) -> list[Rule]:
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    out = []
    for item in rules:
        if isinstance(item, Rule):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            out.append(rule(*item))
        else:
            raise TypeError(f"placement rules are Rule values, (pattern, placement) pairs or a dict; got {item!r:.80}")
    return out


def _leaf_shapes(leaves: Any) -> dict[str, tuple[int, ...]]:
    """path -> shape from a mapping path -> tensor/shape, pairs, or any pytree of tensors."""
    if isinstance(leaves, Mapping) and all(isinstance(k, str) for k in leaves):
        items = list(leaves.items())
    elif isinstance(leaves, (list, tuple)) and all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in leaves
    ):
        items = list(leaves)
    else:
        items = list(zip(tree_paths(leaves), tree_leaves(leaves)))
    return {path: tuple(value.shape if hasattr(value, "shape") else value) for path, value in items}


def _mesh_shape(mesh: Any) -> dict[str, int]:
    shape = mesh.shape if hasattr(mesh, "axis_names") else mesh
    if not isinstance(shape, Mapping) or not shape:
        raise TypeError(
            f"placements_for needs a mesh or its shape (a dict axis -> size, e.g. {{'tp': 2}}); got {mesh!r:.80}"
        )
    return dict(shape)


def placements_for(leaves: Any, rules: Iterable[Any], mesh: Any) -> dict[str, Placement]:
    """The placement of every leaf: the first rule that matches its path, else `Replicated()`.

    Checks, before anything moves (raising `PlacementError` naming the leaf, its shape, the
    dimension, the axis and its size, and what to do): a split dimension that exists and is
    divisible by `chunks * granule * mesh.shape[axis]`; an axis the mesh has; a required rule
    that matches no leaf (naming the rule and a few leaf paths).

    Arguments:
        leaves: the model's leaves: a mapping path -> tensor or shape (a `ModuleParams` from
            `fs.functionalize` is one), `(path, shape)` pairs, or any pytree of tensors (paths
            from `fs.tree_paths`).
        rules: `Rule`s (from `rule`, `hf_rules`, `gpt_rules`), `(pattern, placement)` pairs, or a
            dict pattern -> placement; first match wins.
        mesh: a mesh, or its shape (dict axis -> size, e.g. `{"fsdp": 2, "tp": 2}`).

    Returns a dict path -> placement with one entry per leaf, in the leaves' order; split
    dimensions are non-negative. Replicated leaves and splits over an axis of size 1 need no
    collective.
    """
    shapes = _leaf_shapes(leaves)
    sizes = _mesh_shape(mesh)
    rules = _as_rules(rules)
    used = [False] * len(rules)
    out: dict[str, Placement] = {}
    for path, shape in shapes.items():
        placement: Placement = Replicated()
        for i, candidate in enumerate(rules):
            if candidate.matches(path, shape):
                used[i] = True
                placement = candidate.placement
                break
        if isinstance(placement, Split):
            placement = _checked_split(path, shape, placement, sizes)
        out[path] = placement
    unused = [r for r, u in zip(rules, used) if r.required and not u]
    if unused:
        sample = ", ".join(list(shapes)[:6]) + (", ..." if len(shapes) > 6 else "")
        raise PlacementError(
            f"placement {'rules' if len(unused) > 1 else 'rule'} {', '.join(r.describe() for r in unused)} "
            f"matched no leaf (or only leaves an earlier rule took). The leaves' paths are like: {sample}. "
            f"Fix the pattern, or pass rule(..., required=False) for a leaf that may be absent"
        )
    return out


def _checked_split(path: str, shape: tuple[int, ...], split: Split, sizes: dict[str, int]) -> Split:
    if split.axis not in sizes:
        raise PlacementError(
            f"leaf {path!r} (shape {list(shape)}) is split over axis {split.axis!r}, which the mesh {sizes} does not "
            f"have: name one of {list(sizes)} in Split(axis=...), or add the axis to fs.init_mesh"
        )
    if split.axis in DATA_PARALLEL_AXES:
        raise PlacementError(
            f"leaf {path!r} (shape {list(shape)}) is split over axis {split.axis!r}: a placement splits a leaf over a "
            f"model-parallel axis ('tp'); the data-parallel axes of the mesh {sizes} shard the flat buffers on their "
            f"own (FSDP). Use Split(dim, 'tp')"
        )
    ndim = len(shape)
    if not -ndim <= split.dim < ndim:
        raise PlacementError(
            f"leaf {path!r} has shape {list(shape)} ({ndim} dimensions) but its placement {split.describe()} splits "
            f"dimension {split.dim}: a rule matched a leaf it was not meant for (narrow its pattern)"
        )
    dim = split.dim % ndim
    size = sizes[split.axis]
    parts = split.chunks * split.granule * size
    if shape[dim] % parts:
        if split.granule > 1 and shape[dim] % (split.chunks * split.granule) == 0:
            units = shape[dim] // (split.chunks * split.granule)
            why = (
                f"it holds {units} units of {split.granule} elements (attention heads)"
                f"{' per block' if split.chunks > 1 else ''}, "
                f"and {units} units cannot be shared equally by {size} ranks"
            )
        else:
            blocks = f" ({split.chunks} blocks, each split)" if split.chunks > 1 else ""
            why = f"{shape[dim]} is not divisible by {parts}{blocks}"
        raise PlacementError(
            f"leaf {path!r} of shape {list(shape)}: dimension {dim} (size {shape[dim]}) cannot be split over axis "
            f"{split.axis!r} of size {size} (mesh {sizes}): {why}. Choose a {split.axis} size that divides it, pad "
            f"the model's dimension to a multiple of {parts}, or replicate the leaf with an earlier "
            f"rule(..., Replicated())"
        )
    return dataclasses.replace(split, dim=dim)


def local_shape(shape: tuple[int, ...], placement: Placement, mesh: Any) -> tuple[int, ...]:
    """The shape of the piece of a leaf of full shape `shape` that one rank holds."""
    if isinstance(placement, Replicated):
        return tuple(shape)
    sizes = _mesh_shape(mesh)
    dim = placement.dim % len(shape)
    out = list(shape)
    out[dim] //= sizes[placement.axis]
    return tuple(out)


def split_tensor(full: torch.Tensor, placement: Placement, index: int, size: int) -> torch.Tensor:
    """The piece of `full` that the rank at coordinate `index` of an axis of `size` ranks holds
    (no communication; a view when `chunks` is 1). `Replicated()`: `full` itself."""
    if isinstance(placement, Replicated) or size == 1:
        return full
    dim = placement.dim % full.dim()
    if full.shape[dim] % (placement.chunks * size):
        raise PlacementError(
            f"split_tensor: dimension {dim} of shape {list(full.shape)} does not split into {placement.chunks} "
            f"block(s) x {size} ranks (check the leaf with placements_for first)"
        )
    block = full.shape[dim] // placement.chunks
    piece = block // size
    parts = [full.narrow(dim, c * block + index * piece, piece) for c in range(placement.chunks)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def join_pieces(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """The inverse of `split_tensor`: the full leaf from every rank's piece, in axis order."""
    if isinstance(placement, Replicated) or len(pieces) == 1:
        return pieces[0]
    dim = placement.dim % pieces[0].dim()
    if placement.chunks == 1:
        return torch.cat(pieces, dim)
    piece = pieces[0].shape[dim] // placement.chunks
    return torch.cat([p.narrow(dim, c * piece, piece) for c in range(placement.chunks) for p in pieces], dim)
