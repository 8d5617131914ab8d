"""`fs.initialize`: deferred initialization: build this rank's shards without ever holding the whole model.

    with torch.device("meta"):
        model = GPT(config)                                   # no memory: meta tensors
    apply_fn, params = fs.functionalize(model)                # meta tensors too
    state = step.init(params, initialize=fs.initialize.from_module(model, seed=0))

`step.init(params, initialize=...)` fills each flat buffer's shard piece by piece: for every leaf
that this rank's shard touches it asks the initializer for the range it keeps, and the
initializer makes that leaf (materializing and initializing the one submodule that owns it,
reading it from a file, ...) and drops it before the next owner. Peak memory is this rank's
shards plus one owner module's tensors (a block's attention, say; never more than a unit).

Sharding-independent: a leaf's values are a function of the seed and the path of the module that
owns it (`seed_for(seed, path)` seeds torch's RNG around that module's init), never of the world
size, the unit policy or the order the ranks visit leaves in. So `fs.export(state)` is the same
at any world size and unit policy, and `reference(model, seed=...)` gives the same values in one
process.

It is *not* what the model's own `__init__` would give after `torch.manual_seed(seed)`: torch
draws one random stream for the whole model there, in construction order, and whole-model
adjustments made in `__init__` after the submodules are built (GPT-2's scaled residual
projections in `fs.models.GPT`) are not a submodule's init. Use `reference` when one process
must reproduce the weights.
"""

from __future__ import annotations

import hashlib
import math
import threading
from typing import Callable

import torch
from torch import nn

from ._functionalize import functionalize
from ._layout import Layout
from ._mesh import BaseMesh
from ._pytree import tree_flatten, tree_paths, tree_unflatten
from ._shard import Sharded
from ._tree import ModuleParams

__all__ = ["Initializer", "InitError", "from_module", "from_function", "reference", "seed_for", "shard_from"]

OPERATION = "step.init"

# torch's RNG is one per process: thread-ranks (SimulatedMesh) take turns around a seeded init.
_RNG_TURN = threading.Lock()


class InitError(RuntimeError):
    """A leaf that an initializer cannot make (not in the module, left uninitialized, ...)."""


def seed_for(seed: int, path: str) -> int:
    """The seed of torch's RNG while the leaves under `path` are initialized: a 63-bit hash of
    `(seed, path)`, the same in every process and at every world size."""
    digest = hashlib.blake2b(f"{int(seed)}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Initializer:
    """What `step.init(params, initialize=...)` takes: it makes leaves on request.

    Subclasses implement `open(layout, leaves)`, returning a `LeafSource` for the parameter tree
    of `layout` (whose `leaves` may be on the meta device). Made by `from_module`,
    `from_function` and `fs.checkpoint.from_safetensors`.
    """

    def open(self, layout: Layout, leaves: list[torch.Tensor]) -> "LeafSource":
        raise NotImplementedError

    def for_part(self, whole: Layout) -> "Initializer":
        """The initializer of a part of the tree `whole` lays out (a pipelined step's rank holds
        its stages' leaves): what it checks about the tree as a whole (a file's tensors that no
        leaf takes) is checked against `whole`. Default: itself."""
        return self


class LeafSource:
    """Leaves of one parameter tree, on request. Checks what it can when made (raising
    before anything is read), then answers `read` and `whole`; `close()` at the end."""

    def read(self, leaf: int, start: int, length: int) -> torch.Tensor:
        """Elements `[start, start + length)` of leaf `leaf` flattened (1-D, any float/int dtype:
        the caller casts to the buffer's dtype)."""
        raise NotImplementedError

    def whole(self, leaf: int) -> torch.Tensor:
        """Leaf `leaf` whole, with its shape (for module buffers, which every rank keeps whole)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Pieces(LeafSource):
    """A source of the full leaves (laid out by `full`) read as this rank's tensor-parallel
    pieces of them (laid out by `layout`): a split leaf is made whole once, cut, and read from."""

    def __init__(self, source: LeafSource, layout: Layout, mesh: BaseMesh):
        self.source, self.layout, self.mesh = source, layout, mesh
        self._piece: dict[int, torch.Tensor] = {}

    def read(self, leaf: int, start: int, length: int) -> torch.Tensor:
        placement = self.layout.placement(leaf)
        if placement is None:
            return self.source.read(leaf, start, length)
        if leaf not in self._piece:
            from .tensor_parallel._placement import split_tensor

            self._piece.clear()  # one leaf at a time: read in leaf order within a buffer
            whole = self.source.whole(leaf).reshape(self.layout.full_shape(leaf))
            index, size = self.mesh.coordinates[placement.axis], self.mesh.shape[placement.axis]
            self._piece[leaf] = split_tensor(whole, placement, index, size).reshape(-1)
        return self._piece[leaf][start : start + length]

    def whole(self, leaf: int) -> torch.Tensor:
        return self.source.whole(leaf)

    def close(self) -> None:
        self.source.close()


def shard_from(
    initialize: Initializer,
    layout: Layout,
    leaves: list[torch.Tensor],
    mesh: BaseMesh,
    *,
    operation: str = OPERATION,
    full_layout: Layout | None = None,
) -> Sharded:
    """This rank's `Sharded` for `layout`, made by `initialize` one leaf at a time (what
    `step.init(params, initialize=...)` runs). Raises on every rank if any rank fails (the
    first error here, `InitError` naming the ranks elsewhere); no collective runs in between.

    With tensor-parallel placements, `layout` lays out this rank's pieces and `full_layout` the
    full leaves `leaves` (what the initializer makes): each split leaf is made whole once and
    cut, so the values are the same at any placement."""
    from .checkpoint._format import shard_pieces  # the checkpoint package imports the step

    if not isinstance(initialize, Initializer):
        raise TypeError(
            f"initialize= must be an fs.initialize.Initializer (from_module, from_function, "
            f"fs.checkpoint.from_safetensors); got {type(initialize).__name__}"
        )
    device = getattr(mesh, "device", torch.device("cpu"))
    sharded, error = None, None
    try:
        if layout.is_split:
            source = _Pieces(initialize.open(full_layout, leaves), layout, mesh)
        else:
            source = initialize.open(layout, leaves)
        try:
            shards = []
            for spec in layout.buffers:
                out = torch.zeros(spec.shard_numel, dtype=spec.dtype)
                for piece in shard_pieces(spec, mesh.shard_index):
                    out[piece.shard_offset : piece.shard_offset + piece.length] = source.read(
                        piece.leaf, piece.leaf_offset, piece.length
                    )
                shards.append(out.to(device))
            local = [source.whole(i).to(device) for i in layout.local]
        finally:
            source.close()
        sharded = Sharded(layout, mesh, shards, local)
    except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
        error = e
    mesh.succeed_together(
        operation, error, lambda failed: InitError(f"ranks {failed} could not initialize their shards (see their errors); no rank did")
    )
    return sharded


# --- from a module on the meta device ---------------------------------------------------------

ModuleInit = Callable[[str, nn.Module], None]


def default_init(root: nn.Module) -> ModuleInit:
    """`module.reset_parameters()` if it has one, then `root._init_weights(module)` if the root
    has that method (Hugging Face models; `fs.models.GPT`)."""

    def init(path: str, module: nn.Module) -> None:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        model_init = getattr(root, "_init_weights", None)
        if callable(model_init):
            model_init(module)

    return init


def from_module(module: nn.Module, *, seed: int = 0, init: ModuleInit | None = None, prefix: str = "") -> Initializer:
    """Initialize the meta-device leaves of `fs.functionalize(module)` submodule by submodule.

    Arguments:
        module: the model, typically built under `torch.device("meta")`; not modified (each
            submodule is given fresh CPU tensors only while its init runs, then its own back).
        seed: the seed; leaf values depend on it and on the owning submodule's path only.
        init: `init(path, submodule)` initializing the submodule's own parameters and buffers
            in place; default `default_init(module)`: `reset_parameters()` if the submodule has
            it, then `module._init_weights(submodule)` if the model has that method (Hugging
            Face models: this computes rotary `inv_freq` and other buffers too).
        prefix: the path of the module's `ModuleParams` in the tree given to `step.init`
            (`"model"` for `{"model": params, ...}`); leaves outside it must not be on meta.

    A leaf is made by materializing the submodule that owns it under its first name (a tied
    weight: the first module that has it) with NaN-filled float tensors, running `init` under
    `torch.random.fork_rng()` seeded with `seed_for(seed, submodule path)`, and taking the leaf;
    any NaN left raises `InitError` naming the leaf and the submodule (its init does not cover
    it: pass `init=`). Leaves that are not on the meta device keep their values. Equal to
    `reference(module, seed=seed, init=init)`, not to the model's own whole-model init.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module expects an nn.Module; got {type(module).__name__}")
    return _FromModule(module, int(seed), init or default_init(module), prefix)


def from_function(fn: Callable[[str, torch.Tensor], torch.Tensor], *, seed: int = 0) -> Initializer:
    """Initialize every meta-device leaf with `fn(path, like)`: `like` is the meta leaf (its
    shape and dtype), the result a tensor of that shape. Called under `torch.random.fork_rng()`
    seeded with `seed_for(seed, path)`, one leaf at a time; leaves not on meta keep their values."""
    if not callable(fn):
        raise TypeError(f"from_function expects a callable fn(path, like) -> Tensor; got {type(fn).__name__}")
    return _FromFunction(fn, int(seed))


def reference(module: nn.Module, *, seed: int = 0, init: ModuleInit | None = None) -> ModuleParams:
    """In one process, the full parameters that `from_module(module, seed=seed, init=init)`
    gives a sharded state at any world size: `fs.functionalize(module)[1]` with every meta leaf
    made the same way (load them with `model.load_state_dict(params.state_dict(), assign=True)`)."""
    _, params = functionalize(module)
    leaves, treedef = tree_flatten(params)
    layout = _PathsOnly(tuple(tree_paths(params)))
    source = from_module(module, seed=seed, init=init).open(layout, leaves)
    try:
        made = [source.whole(i) for i in range(len(leaves))]
    finally:
        source.close()
    return tree_unflatten(treedef, made)


class _PathsOnly:
    """The part of a `Layout` that `_FromModule.open` and its source read."""

    def __init__(self, paths: tuple[str, ...]):
        self.paths = paths

    def describe_leaf(self, i: int) -> str:
        return f"leaf {self.paths[i]!r}"


class _FromModule(Initializer):
    def __init__(self, module: nn.Module, seed: int, init: ModuleInit, prefix: str):
        self.module, self.seed, self.init, self.prefix = module, seed, init, prefix

    def open(self, layout: Layout, leaves: list[torch.Tensor]) -> LeafSource:
        # Every name a tensor has in the module -> (owner path, local name); the first name of a
        # tied tensor (what functionalize keys it by) is the owner that initializes it.
        slots: dict[str, tuple[str, str]] = {}
        for owner, sub in self.module.named_modules(remove_duplicate=False):
            for local, t in [*sub._parameters.items(), *sub._buffers.items()]:
                if t is not None:
                    slots.setdefault(f"{owner}.{local}" if owner else local, (owner, local))
        owners: dict[int, tuple[str, str]] = {}
        head = self.prefix + "." if self.prefix else ""
        for i, (path, leaf) in enumerate(zip(layout.paths, leaves)):
            if not leaf.is_meta:
                continue
            name = path[len(head) :] if path.startswith(head) else None
            if name not in slots:
                raise InitError(
                    f"{layout.describe_leaf(i)} is on the meta device but is not a parameter or buffer of the "
                    f"{type(self.module).__name__} given to from_module (prefix {self.prefix!r}): pass the module "
                    f"the parameters came from (fs.functionalize(module)), and prefix= if they sit inside a larger tree"
                )
            owners[i] = slots[name]
        return _ModuleSource(self, layout, leaves, owners)


class _ModuleSource(LeafSource):
    def __init__(self, spec: _FromModule, layout, leaves, owners: dict[int, tuple[str, str]]):
        self.spec, self.layout, self.leaves, self.owners = spec, layout, leaves, owners
        self.cached: tuple[str, dict[str, torch.Tensor]] | None = None  # one owner's tensors at a time
        self.checked: set[tuple[str, str]] = set()

    def whole(self, leaf: int) -> torch.Tensor:
        if leaf not in self.owners:
            return self.leaves[leaf].detach()
        owner, local = self.owners[leaf]
        if self.cached is None or self.cached[0] != owner:
            self.cached = None  # drop the previous owner's tensors before making the next
            self.cached = (owner, self._materialize(owner))
        value = self.cached[1][local]
        if (owner, local) not in self.checked:
            if _has_nan(value):
                sub = self.spec.module.get_submodule(owner)
                raise InitError(
                    f"{self.layout.describe_leaf(leaf)} is not (fully) initialized by the init of its submodule "
                    f"{owner or '<root>'!r} ({type(sub).__name__}): it has no reset_parameters and the model's "
                    f"_init_weights does not cover it. Pass from_module(..., init=fn) with fn(path, module) "
                    f"initializing it, or give this leaf real values instead of a meta tensor"
                )
            self.checked.add((owner, local))
        return value

    def read(self, leaf: int, start: int, length: int) -> torch.Tensor:
        return self.whole(leaf).reshape(-1)[start : start + length]

    def close(self) -> None:
        self.cached = None

    def _materialize(self, owner: str) -> dict[str, torch.Tensor]:
        """The submodule's own tensors after its init, on CPU; the module keeps its own tensors."""
        sub = self.spec.module.get_submodule(owner)
        saved_parameters, saved_buffers = dict(sub._parameters), dict(sub._buffers)
        try:
            for name, p in saved_parameters.items():
                if p is not None:
                    sub._parameters[name] = nn.Parameter(_unset_like(p), requires_grad=p.requires_grad)
            for name, b in saved_buffers.items():
                if b is not None:
                    sub._buffers[name] = _unset_like(b)
            with _RNG_TURN, torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed_for(self.spec.seed, owner))
                self.spec.init(owner, sub)
            made = {**sub._parameters, **sub._buffers}
            return {name: t.detach() for name, t in made.items() if t is not None}
        finally:
            sub._parameters.clear()
            sub._parameters.update(saved_parameters)
            sub._buffers.clear()
            sub._buffers.update(saved_buffers)


def _has_nan(t: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """Whether a float tensor holds a NaN (in chunks: no leaf-sized temporary)."""
    if not (t.is_floating_point() or t.is_complex()):
        return False
    flat = t.reshape(-1)
    return any(bool(torch.isnan(flat[i : i + chunk]).any()) for i in range(0, flat.numel(), chunk))


def _unset_like(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like `t`: NaN where a float can say "never written", else zeros."""
    if t.is_floating_point() or t.is_complex():
        return torch.full(t.shape, math.nan, dtype=t.dtype)
    return torch.zeros(t.shape, dtype=t.dtype)


# --- from a function of the path ------------------------------------------------------------


class _FromFunction(Initializer):
    def __init__(self, fn, seed: int):
        self.fn, self.seed = fn, seed

    def open(self, layout: Layout, leaves: list[torch.Tensor]) -> LeafSource:
        return _FunctionSource(self, layout, leaves)


class _FunctionSource(LeafSource):
    def __init__(self, spec: _FromFunction, layout: Layout, leaves: list[torch.Tensor]):
        self.spec, self.layout, self.leaves = spec, layout, leaves
        self.cached: tuple[int, torch.Tensor] | None = None

    def whole(self, leaf: int) -> torch.Tensor:
        like = self.leaves[leaf]
        if not like.is_meta:
            return like.detach()
        if self.cached is None or self.cached[0] != leaf:
            self.cached = None
            path = self.layout.paths[leaf]
            with _RNG_TURN, torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(seed_for(self.spec.seed, path))
                value = self.spec.fn(path, like)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(like.shape):
                got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise InitError(f"the init function returned {got} for {self.layout.describe_leaf(leaf)}")
            self.cached = (leaf, value.detach().to("cpu", like.dtype))
        return self.cached[1]

    def read(self, leaf: int, start: int, length: int) -> torch.Tensor:
        return self.whole(leaf).reshape(-1)[start : start + length]

    def close(self) -> None:
        self.cached = None
