"""What varies over a model-parallel axis while `loss_fn` runs (`SplitValues`): dropout on split
activations drawn per rank, whole trainable leaves used with them refused.

A step seeds torch's generators per data rank (`_random.stream`), so the ranks of a `tp` group
draw the same numbers: a dropout on an activation they all hold (the residual stream after a
row-parallel layer's all-reduce) gets one mask, as it must. On an activation split over the
axis (a column-parallel layer's output, the attention weights of the rank's own heads) the same
numbers would make each rank's piece of the mask the same: masks that repeat across the ranks,
where one process draws them independently (an adversarial pass measured 32 of 32 mask bits
equal on the two halves of a split layer, before 2026-11-29).

So, as Megatron draws those from a stream per tensor-parallel rank, `F.dropout` / `nn.Dropout`
on a split activation draws the masks of all the ranks over the split axes from the shared
stream (one after the other, what CPU dropout draws for one) and keeps its own: independent masks,
every rank's stream left where the others' is. Any other random operation on a split tensor
(fused attention's `dropout_p`, `bernoulli(x)`, channel or alpha dropout) is refused with a
`StepError` naming it and the axis. Under sequence parallelism `nn.Dropout` is
`tensor_parallel._sequence`'s, which draws the whole activation's mask (the single process's).

A trainable leaf kept whole on every rank (not in the rules, or `Replicated`) and used with a
split activation (a per-head norm on the rank's own heads, a learnable activation on a
column-parallel output) gets only this rank's part of its gradient: each rank would apply its own
and the copies drift apart (an adversarial pass: Phi's `q_layernorm` 99 % off, Apertus' xIELU
alphas 548 %). Unless the value reached the split activation through `copy_to` (whose backward
sums the gradient: the `replicated_with_grad_allreduce` style, sequence parallelism's whole
parameters, a column-parallel layer's input), such a use raises `WholeLeafError` (a
`PlacementError`) naming the leaf and the fixes. Values made from a whole leaf alone are followed
through every operation until a collective.

While `loss_fn` runs, `SplitValues` (a dispatch mode) follows which tensors vary over the split
axes: the parameters split over them (through `torch.func`'s wrappers), and every output of an
operation that reads one, except what a collective over such an axis makes whole (an
all-reduce or all-gather: the same on every rank), while a reduce-scatter over it, or the
rank's slice of a whole tensor (`scatter_along`, sequence parallelism's first cut), splits. A
function mode sees the dropout calls with their activation (their aten form draws from a fresh
`empty`, which no longer reads it). Collectives are read by their process group's name (`Mesh`;
a pipeline stage's trace issues them as `functional_shard::tp_collective`, read by kind); a
`SimulatedMesh`, whose collectives are Python, says what it made (`_tracing.note_collective`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from . import _tracing
from ._losses import StepError
from .schedule._axes import abstract_group_name
from .tensor_parallel._placement import PlacementError

__all__ = ["SplitValues", "WholeLeafError"]


class WholeLeafError(PlacementError):
    """A whole trainable leaf used with an activation split over a model axis."""


_WHOLE = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "broadcast"})
_SPLIT = frozenset({"reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single"})


class SplitValues(TorchDispatchMode):
    """While `loss_fn` runs: what varies over `axes`, and what is made from a whole trainable leaf
    alone; dropout on varying tensors per rank, other random operations on them and whole leaves
    used with them refused (see the module)."""

    def __init__(self, mesh: Any, axes: Sequence[str], split: Sequence[torch.Tensor], whole: Sequence[tuple[str, torch.Tensor]] = ()):
        super().__init__()
        self.axes = tuple(axes)
        self.varying = WeakTensorKeyDictionary()
        for t in split:
            for level in _levels(t):
                self.varying[level] = True
        self.whole = WeakTensorKeyDictionary()  # a value made from a whole trainable leaf alone -> the leaf's path
        for path, t in whole:
            for level in _levels(t):
                self.whole[level] = path
        self.groups = _group_axes(mesh)
        self.size, self.index = 1, 0  # ranks over the split axes, and this one's row-major index among them
        for axis in self.axes:
            self.size, self.index = self.size * mesh.shape[axis], self.index * mesh.shape[axis] + mesh.coordinates[axis]

    def __enter__(self):
        self._outer = contextlib.ExitStack()
        self._outer.enter_context(_tracing.noting_collectives(self._noted))
        self._outer.enter_context(_RandomCalls(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._outer.__exit__(*exc)

    def _noted(self, out: Any, axes: Sequence[str], kind: str) -> None:
        if set(axes) & set(self.axes):
            self.made(out, kind, self.varies(out))

    def made(self, out: Any, kind: str, varying: bool) -> None:
        """`out` made by a tensor-parallel collective over the axes: "whole" (an all-reduce or
        all-gather), "split" (a reduce-scatter, the rank's slice) or "copy" (`copy_to`: as it was,
        `varying`); no longer a whole leaf's alone (the collective's backward sums)."""
        self.mark(out, kind == "split" or (kind == "copy" and varying))

    def varies(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and any(level in self.varying for level in _levels(t))

    def refuse(self, what: str) -> None:
        raise StepError(
            f"loss_fn draws random numbers ({what}) on an activation split over {list(self.axes)}: every rank of "
            f"{self.axes[0]!r} would draw the same ones, repeating the mask across the ranks' pieces. fs draws "
            f"per rank for F.dropout / nn.Dropout only; use one of those (for attention, dropout on the attention "
            f"weights instead of the fused kernel's dropout_p), set this one's probability to 0 (most large language "
            f"models train without), or train without tensor parallelism"
        )

    def mark(self, out: Any, varying: bool, leaf: str | None = None) -> None:
        """`out` varies over the axes (or not); `leaf`: made from that whole trainable leaf alone
        (None: from none, as whatever a tensor-parallel collective makes, `copy_to` included)."""
        for t in _tensors((out,)):
            for level in _levels(t):
                if varying:
                    self.varying[level] = True
                else:
                    self.varying.pop(level, None)
                if leaf is None:
                    self.whole.pop(level, None)
                else:
                    self.whole[level] = leaf

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        varying = any(t in self.varying for t in tensors)
        leaf = next((self.whole[t] for t in tensors if t in self.whole), None) if self.whole else None
        if varying and torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.refuse(str(func))  # a draw shaped by a split tensor (fused attention's dropout_p, bernoulli(x))
        if varying and leaf is not None:
            raise WholeLeafError(
                f"leaf {leaf!r} is whole on every rank of {list(self.axes)}, but {func} uses it with an activation "
                f"split over {self.axes[0]!r}: its gradient would be each rank's part of the sum, and the ranks' copies "
                f"would drift apart. Give it a rule: split it with the activation, or style "
                f"'replicated_with_grad_allreduce' (its gradient all-reduced over {self.axes[0]!r}), or use sequence "
                f"parallelism (parallelize(..., sequence_parallel=True) all-reduces every whole parameter's gradient)"
            )
        out = func(*args, **kwargs)
        kind, groups = None, ()  # what a collective makes ("whole", "split", "copy"), over which groups
        if func.namespace == "_c10d_functional" and (func._opname in _WHOLE or func._opname in _SPLIT):
            kind, groups = "split" if func._opname in _SPLIT else "whole", [a for a in args if isinstance(a, str)][-1:]
        elif func.namespace == "functional_shard" and func._opname == "tp_collective":  # a pipeline stage's trace
            kind, groups = {"copy": "copy", "reduce_scatter": "split", "scatter": "split"}.get(args[1], "whole"), (args[3], args[4])
        if kind is not None and any(set(self.groups.get(g, ())) & set(self.axes) for g in groups):
            self.made(out, kind, varying)
        elif varying or leaf is not None:
            self.mark(out, varying, leaf)
        return out


class _RandomCalls(TorchFunctionMode):
    """The dropout functions, seen where they are called with the activation (their aten form draws
    the mask from a fresh tensor of its shape, which no longer reads it)."""

    def __init__(self, split: SplitValues):
        super().__init__()
        self.split = split

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _F.scaled_dot_product_attention:
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if dropout_p != 0 and any(self.split.varies(t) for t in args[:3]):
                self.split.refuse(f"scaled_dot_product_attention, dropout_p={dropout_p}")
        if func in _DROPOUTS and args and self.split.varies(args[0]):
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("train", kwargs.get("training", True))
            if training and p != 0:
                if func not in _ELEMENTWISE:
                    self.split.refuse(f"{func.__name__}, p={p}")
                inplace = (args[3] if len(args) > 3 else kwargs.get("inplace", False)) if func is _F.dropout else False
                return _per_rank_dropout(args[0], float(p), inplace, self.split)
        return func(*args, **kwargs)


def _per_rank_dropout(x: torch.Tensor, p: float, inplace: bool, split: SplitValues) -> torch.Tensor:
    """`F.dropout(x, p)` on an activation split over ranks: the masks of all `split.size` ranks
    drawn from the stream they share, one after the other (what CPU dropout does,
    `bernoulli_(1 - p).div_(1 - p)`), this rank's (`split.index`) kept: independent masks for the
    ranks' pieces, every rank's stream left where the others' is (a later draw on a whole
    activation agrees), and one other mask alive at a time (not `size` of them: at long sequences
    the attention weights' masks of every rank would be the whole model's)."""
    if p == 1:
        return x.mul_(0) if inplace else x * torch.zeros((), dtype=x.dtype, device=x.device)
    mine = None
    for rank in range(split.size):
        # from `x` (new_empty): a pipeline's cut puts the draw on x's stage (a draw reading nothing is refused there)
        noise = x.new_empty(x.shape)
        split.mark(noise, False)  # the draw is every rank's: the same on all
        noise = noise.bernoulli_(1 - p)
        if rank == split.index:
            mine = noise.div_(1 - p)
    return x.mul_(mine) if inplace else x * mine


_F = torch.nn.functional
_ELEMENTWISE = frozenset({_F.dropout, torch.dropout})  # drawn per rank; the others (channel, alpha) refused
_DROPOUTS = _ELEMENTWISE | {
    _F.dropout1d, _F.dropout2d, _F.dropout3d, _F.alpha_dropout, _F.feature_alpha_dropout, torch.alpha_dropout,
    torch.feature_dropout, torch.feature_alpha_dropout,
}  # fmt: skip


def _tensors(args: tuple, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors among an operation's arguments (or outputs), lists of them included: what
    `tree_leaves` finds there, at a fraction of its cost (every operation of `loss_fn` pays it)."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _levels(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` and what it wraps (a `torch.func` transform's tensors: the mode sees the innermost)."""
    out = [t]
    while torch._C._functorch.is_functorch_wrapped_tensor(out[-1]):
        out.append(torch._C._functorch.get_unwrapped(out[-1]))
    return out


def _group_axes(mesh: Any) -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axes its ranks span (a `Mesh`'s groups, an `AbstractMesh`'s names)."""
    out: dict[str, tuple[str, ...]] = {}
    for attribute in ("_group_names", "_gather_group_names", "_reduce_group_names"):
        for axis, name in getattr(mesh, attribute, {}).items():
            out[name] = (axis,)
    world = getattr(mesh, "_world_group_name", None)
    if world is not None:
        out[world] = tuple(mesh.axis_names)
    if getattr(mesh, "abstract", False):  # an `AbstractMesh`: its collectives name their axis ("world": every axis)
        for axis in mesh.axis_names:
            out[abstract_group_name(axis, mesh.shape)] = (axis,)
        out[abstract_group_name("world", mesh.shape)] = tuple(mesh.axis_names)
    for axis in mesh.axis_names:  # what a pipeline stage's `tp_collective` names on a mesh without groups
        out.setdefault(f"abstract:{axis}", (axis,))
    return out


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether a call of an operation tagged random draws numbers: fused attention with
    `dropout_p=0` and `native_dropout` outside training (or at p=0) do not."""
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value)) for i, a in enumerate(func._schema.arguments)}
    if "dropout_p" in values:
        return values["dropout_p"] != 0
    if func.overloadpacket is torch.ops.aten.native_dropout:
        return bool(values.get("train")) and values.get("p") != 0
    return True
