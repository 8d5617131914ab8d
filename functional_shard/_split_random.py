"""Random numbers on activations split over a model-parallel axis: refused (`SplitRandom`).

A step seeds torch's generators per data rank (`_random.stream`), so the ranks of a `tp` group
draw the same numbers: a dropout on an activation they all hold (the residual stream after a
row-parallel layer's all-reduce) gets one mask, as it must. On an activation split over the
axis (a column-parallel layer's output, the attention weights of the rank's own heads, a fused
attention's `dropout_p` on them) the same numbers make each rank's piece of the mask the same:
masks that repeat across the ranks, where one process draws them independently (an adversarial
pass: 32 of 32 mask bits equal on the two halves of a split hidden layer). Megatron draws those
from a stream per tensor-parallel rank; fs refuses them, naming the operation and the axis.

While `loss_fn` runs, `SplitRandom` (a dispatch mode) follows which tensors vary over the split
axes: the parameters split over them, and every output of an operation that reads one, except
what a collective over such an axis makes whole (an all-reduce or all-gather: the same on every
rank), while a reduce-scatter over it splits. A random operation that reads a varying tensor
(`dropout`'s `empty_like(x)` and `bernoulli_`, fused attention with `dropout_p > 0`) raises
`StepError`. Draws on tensors made whole — `nn.Dropout` under sequence parallelism draws the whole
activation's mask and keeps the rank's slice (`tensor_parallel._sequence`) — are untouched.
Collectives are read by their process group's name (`Mesh`); a `SimulatedMesh`, whose
collectives are Python, says what it made (`_tracing.note_collective`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from . import _tracing
from ._losses import StepError

__all__ = ["SplitRandom"]

_WHOLE = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "broadcast"})
_SPLIT = frozenset({"reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single"})


class SplitRandom(TorchDispatchMode):
    """Refuses a random operation on a tensor that varies over `axes` (see the module)."""

    def __init__(self, mesh: Any, axes: Sequence[str], split: Sequence[torch.Tensor]):
        super().__init__()
        self.axes = tuple(axes)
        self.varying = WeakTensorKeyDictionary()
        for t in split:
            for level in _levels(t):
                self.varying[level] = True
        self.groups = _group_axes(mesh)

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
            self.mark(out, kind == "split")

    def varies(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and any(level in self.varying for level in _levels(t))

    def refuse(self, what: str) -> None:
        raise StepError(
            f"loss_fn draws random numbers ({what}) on an activation split over {list(self.axes)}: every rank of "
            f"{self.axes[0]!r} draws the same ones, so its dropout mask would repeat across the ranks' pieces "
            f"(Megatron draws these from a stream per tensor-parallel rank; fs does not yet). Set that dropout's "
            f"probability to 0 (attention dropout: most large language models train without), or train without "
            f"tensor parallelism; dropout on activations every rank holds whole, and nn.Dropout under sequence "
            f"parallelism, draw correctly"
        )

    def mark(self, out: Any, varying: bool) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                if varying:
                    self.varying[t] = True
                else:
                    self.varying.pop(t, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        varying = any(isinstance(t, torch.Tensor) and t in self.varying for t in tree_leaves((args, kwargs)))
        if varying and torch.Tag.nondeterministic_seeded in func.tags and _draws(func, args, kwargs):
            self.refuse(str(func))  # a draw shaped by a split tensor (fused attention's dropout_p, bernoulli(x))
        out = func(*args, **kwargs)
        if func.namespace == "_c10d_functional" and (func._opname in _WHOLE or func._opname in _SPLIT):
            group = next((a for a in reversed(args) if isinstance(a, str)), None)
            if set(self.groups.get(group, ())) & set(self.axes):
                varying = func._opname in _SPLIT
        if varying:
            self.mark(out, True)
        return out


class _RandomCalls(TorchFunctionMode):
    """The dropout functions, seen where they are called with the activation (their aten form draws
    the mask from a fresh tensor of its shape, which no longer reads it)."""

    def __init__(self, split: SplitRandom):
        super().__init__()
        self.split = split

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS and args and self.split.varies(args[0]):
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and p != 0:
                self.split.refuse(f"{func.__name__}, p={p}")
        return func(*args, **kwargs)


_DROPOUTS = frozenset({
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
    torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
    torch.feature_dropout, torch.feature_alpha_dropout,
})  # fmt: skip


def _levels(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` and what it wraps (a `torch.func` transform's tensors: the mode sees the innermost)."""
    out = [t]
    while torch._C._functorch.is_functorch_wrapped_tensor(out[-1]):
        out.append(torch._C._functorch.get_unwrapped(out[-1]))
    return out


def _group_axes(mesh: Any) -> dict[str, tuple[str, ...]]:
    """Process group name -> the mesh axes its ranks span (a `Mesh`'s groups; none elsewhere)."""
    out: dict[str, tuple[str, ...]] = {}
    for attribute in ("_group_names", "_gather_group_names", "_reduce_group_names"):
        for axis, name in getattr(mesh, attribute, {}).items():
            out[name] = (axis,)
    world = getattr(mesh, "_world_group_name", None)
    if world is not None:
        out[world] = tuple(mesh.axis_names)
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
