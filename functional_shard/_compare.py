"""Train the same model at several layouts and find the first bit that differs: `compare_layouts`.

    result = fs.testing.compare_layouts(make_step, params_fn, batch_fn,
                                        layouts=[{"fsdp": 1}, {"fsdp": 2}], steps=5)
    assert result.identical, str(result)

Each layout runs in a fresh `fs.testing.LocalWorld` (gloo processes on this machine). Every rank
sets `torch.set_num_threads(threads)`, builds its step with `make_step(mesh)`, initializes it
from `params_fn()` and trains `steps` steps on its data-parallel rows of `batch_fn(i)` (the global
batch of step `i`, cut by `fs.data.local_batch`). Rank 0 hands back each step's
`metrics["loss"]` and the full state (every parameter leaf, joined over `tp` too, and every
optimizer leaf, gathered whole) after the last step, or after every step with
`every_step=True`. The first layout is the reference; the result names the first step, the
kind (loss, parameter, optimizer state) and the leaf whose bits differ in any other.

With `sharded_step(..., canonical_chunks=G)` every data-parallel degree that divides `G` (a
power of two) gives the same bits (docs/reproducibility.md): this is how to check it on a model
of your own, and how to find where a run that should be invariant is not.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ._pytree import tree_leaves
from ._shard import Sharded, gather
from .checkpoint._format import optimizer_slots
from .data import local_batch

__all__ = ["compare_layouts", "LayoutComparison", "Difference", "full_state", "first_difference"]

_KINDS = ("loss", "param", "optimizer state")  # the order things are compared within a step


class Difference(NamedTuple):
    """The first place two runs differ in their bits."""

    step: int  # the step (0-based) whose loss differs, or after which the leaf differs
    what: str  # "loss", "param" or "optimizer state"
    leaf: str | None  # the leaf's path ("blocks.0.attn.weight"; optimizer: "1/exp_avg/blocks.0.attn.weight"); None for the loss
    layouts: tuple[dict, dict]  # the reference layout and the one that differs
    max_abs_diff: float  # the largest |a - b| over the leaf's elements (inf or nan where they are not finite)
    differing: int  # elements whose bits differ
    numel: int  # elements of the leaf (1 for the loss)

    def describe(self) -> str:
        """One sentence: where, what, how much."""
        what = "the loss" if self.what == "loss" else f"{self.what} {self.leaf!r}"
        when = f"of step {self.step}" if self.what == "loss" else f"after step {self.step}"
        return (
            f"{what} {when} differs between {_name(self.layouts[0])} and {_name(self.layouts[1])}: "
            f"{self.differing} of {self.numel} element(s), max |difference| {self.max_abs_diff:.3g}"
        )


class LayoutComparison(NamedTuple):
    """What `compare_layouts` found. `str()` of it is a short report."""

    identical: bool  # every loss and every state leaf compared has the same bits at every layout
    layouts: tuple[dict, ...]  # the layouts, the reference first
    steps: int  # steps trained at each layout
    every_step: bool  # the state was compared after every step (else after the last only)
    first: Difference | None  # the earliest difference: by step, then loss, parameters, optimizer state
    first_leaf: Difference | None  # the earliest parameter or optimizer-state leaf that differs (may follow `first`)
    losses: tuple[tuple[float, ...], ...]  # metrics["loss"] per layout, per step

    def __str__(self) -> str:
        names = ", ".join(_name(layout) for layout in self.layouts)
        after = "every step" if self.every_step else f"step {self.steps - 1}"
        if self.identical:
            return (
                f"Identical bits at {names} over {self.steps} step(s): every step's loss, and every parameter and "
                f"optimizer-state leaf after {after}."
            )
        text = f"Bits differ at {names} over {self.steps} step(s). First: {self.first.describe()}."
        if self.first_leaf is not None and self.first_leaf != self.first:
            text += f" First leaf: {self.first_leaf.describe()}."
        elif self.first_leaf is None:
            text += f" Every parameter and optimizer-state leaf is identical after {after}."
        if not self.every_step and self.first_leaf is not None:
            text += " (The state was compared after the last step only: pass every_step=True to find the first step a leaf differs.)"
        return text


def compare_layouts(
    make_step: Callable[[Any], Any],
    params_fn: Callable[[], Any],
    batch_fn: Callable[[int], Any],
    *,
    layouts: Sequence[dict[str, int]] = ({"fsdp": 1}, {"fsdp": 2}),
    steps: int = 5,
    threads: int = 1,
    every_step: bool = False,
    seed: int = 0,
    timeout: float = 300.0,
) -> LayoutComparison:
    """Train `steps` steps at each layout and compare every loss and state leaf bit for bit.

    Arguments:
        make_step: `make_step(mesh) -> step`, e.g. `lambda`-free `def make_step(mesh): return
            fs.sharded_step(loss_fn, mesh, optimizer=..., canonical_chunks=8)`. Called on every
            rank after `torch.set_num_threads(threads)`.
        params_fn: `params_fn() -> params`, the same values on every rank and at every layout
            (seed inside it: e.g. `torch.manual_seed(0)` then `fs.functionalize(model)[1]`).
        batch_fn: `batch_fn(i) -> batch`, the GLOBAL batch of step `i` (a pytree of tensors with a
            common leading batch dimension, the same on every rank); each data-parallel rank
            trains on its rows (`fs.data.local_batch`).
        layouts: mesh axes per layout (`fs.init_mesh` style, e.g. `{"replicate": 2, "fsdp": 2}`),
            two or more; the first is the reference. Each runs in a fresh `LocalWorld` of the
            product of its sizes.
        steps: steps trained at each layout.
        threads: torch threads of every rank (the thread count changes how kernels split
            their sums, so it is fixed for every layout).
        every_step: compare the full state after every step (finds the first step a leaf
            differs; holds `steps` copies of the model on the calling process); default: after
            the last step only. Losses are compared at every step either way.
        seed: `step.init(params, seed=seed)` (dropout's stream).
        timeout: seconds one layout's run may take.

    The three functions run in the rank processes, so they must be picklable: module-level
    functions (or `functools.partial` of them), not lambdas or closures.

    Returns a `LayoutComparison`: `identical`, the first `Difference` (step, what, leaf path,
    layouts, max |difference|, number of differing elements), the first leaf that differs, and
    every layout's losses. Raises `ValueError` for malformed arguments before any process starts,
    and `fs.RankError` (noting the layout) when training fails at a layout.
    """
    from .testing import LocalWorld  # testing re-exports this module

    layouts = _check_arguments(make_step, params_fn, batch_fn, layouts, steps, threads)
    runs = []
    for layout in layouts:
        size = math.prod(layout.values())
        try:
            with LocalWorld(size, axes=dict(layout), call_timeout=timeout) as world:
                runs.append(world.run(_train, make_step, params_fn, batch_fn, steps, threads, every_step, seed)[0])
        except Exception as error:
            error.add_note(f"(fs.testing.compare_layouts: while training at {_name(layout)})")
            raise
    return _compare(layouts, runs, steps, every_step)


def _name(layout: dict) -> str:
    return "{" + ", ".join(f"{axis!r}: {size}" for axis, size in layout.items()) + "}"


def _check_arguments(make_step, params_fn, batch_fn, layouts, steps, threads) -> tuple[dict, ...]:
    for name, fn in (("make_step", make_step), ("params_fn", params_fn), ("batch_fn", batch_fn)):
        if not callable(fn):
            raise ValueError(f"compare_layouts: {name} must be callable; got {type(fn).__name__}")
        try:
            pickle.dumps(fn)
        except Exception as error:  # noqa: BLE001 (any pickling failure means the same thing here)
            raise ValueError(
                f"compare_layouts: {name} ({getattr(fn, '__qualname__', fn)!r}) cannot be pickled into the rank "
                f"processes ({type(error).__name__}: {error}); define it as a module-level function (or a "
                f"functools.partial of one), not a lambda or a closure"
            ) from None
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"compare_layouts: steps must be an int >= 1; got {steps!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"compare_layouts: threads must be an int >= 1; got {threads!r}")
    layouts = tuple(layouts)
    if len(layouts) < 2:
        raise ValueError(f"compare_layouts: give two or more layouts to compare; got {list(layouts)!r}")
    for layout in layouts:
        if (
            not isinstance(layout, dict)
            or not layout
            or not all(isinstance(a, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 1 for a, n in layout.items())
        ):
            raise ValueError(
                f"compare_layouts: a layout is a dict of mesh axis -> size >= 1, as fs.init_mesh takes "
                f"(e.g. {{'fsdp': 2}} or {{'replicate': 2, 'fsdp': 2}}); got {layout!r}"
            )
    return layouts


def _train(mesh, make_step, params_fn, batch_fn, steps: int, threads: int, every_step: bool, seed: int):
    """One rank of one layout: (losses, [(step, full state)]) on rank 0, None elsewhere."""
    torch.set_num_threads(threads)
    step = make_step(mesh)
    state = step.init(params_fn(), seed=seed)
    losses, states = [], []
    for i in range(steps):
        state, metrics = step(state, local_batch(batch_fn(i), mesh))
        losses.append(metrics["loss"].detach().clone())
        if every_step or i == steps - 1:
            states.append((i, full_state(state)))  # a collective: every rank
    return (losses, states) if mesh.rank == 0 else None


def full_state(state: Any) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state leaf of a step's state, whole, on every rank (a
    collective). Keys: `params/<leaf path>` (split leaves joined over `tp`), `opt/<state
    path>/<leaf path>` for parameter-like optimizer state (`exp_avg`, ...), `opt/<state path>`
    for the rest (a step count), as checkpoints name them. Padding is never included."""
    sharded = state.params
    layout = sharded.layout
    out = {}
    for path, leaf in zip(layout.paths, tree_leaves(gather(sharded, full=True))):
        out[f"params/{path}"] = leaf.detach().clone()
    slots, _ = optimizer_slots(state.opt_state, layout)
    for slot in slots:
        key = "/".join(p for p in ("opt", slot.path) if p)
        if not slot.param_like:
            out[key] = slot.value.detach().clone()
            continue
        shards = [
            slot.value[spec.name] if spec.trainable else torch.zeros(spec.shard_numel, dtype=spec.dtype, device=s.device)
            for spec, s in zip(layout.buffers, sharded.shards)
        ]
        leaves = tree_leaves(gather(Sharded(layout, sharded.mesh, shards, sharded.local), full=True))
        for spec in layout.buffers:
            if spec.trainable:
                for i in spec.leaves:
                    out[f"{key}/{layout.paths[i]}"] = leaves[i].detach().clone()
    return out


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: do `a` and `b` (same shape and dtype) differ in their bits? (NaN == NaN
    bit for bit; -0.0 != 0.0.)"""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if width is not None:
            return a.contiguous().view(width) != b.contiguous().view(width)
    return a != b


def _tensor_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, int] | None:
    """(max |a - b|, differing elements, elements), or None when the bits are the same."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf"), max(a.numel(), b.numel()), max(a.numel(), b.numel())
    differ = _bits_differ(a, b)
    count = int(differ.sum())
    if not count:
        return None
    if a.dtype.is_floating_point or a.dtype.is_complex:
        gap = float((a[differ].to(torch.float64) - b[differ].to(torch.float64)).abs().max())
    else:
        gap = float((a[differ].to(torch.int64) - b[differ].to(torch.int64)).abs().max()) if a.dtype != torch.bool else 1.0
    return gap, count, a.numel()


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[str, float, int, int] | None:
    """The first key (in `a`'s order) whose tensors differ in their bits, as (key, max |a - b|,
    differing elements, elements); None when every tensor is the same. Keys in one only differ."""
    for key, x in a.items():
        if key not in b:
            return key, float("inf"), x.numel(), x.numel()
        found = _tensor_difference(x, b[key])
        if found is not None:
            return (key, *found)
    for key, y in b.items():
        if key not in a:
            return key, float("inf"), y.numel(), y.numel()
    return None


def _state_difference(step: int, a: dict, b: dict, layouts: tuple[dict, dict]) -> Difference | None:
    found = first_difference(a, b)
    if found is None:
        return None
    key, gap, count, numel = found
    what, leaf = ("param", key[len("params/") :]) if key.startswith("params/") else ("optimizer state", key[len("opt/") :])
    return Difference(step, what, leaf, layouts, gap, count, numel)


def _compare(layouts: tuple[dict, ...], runs: list, steps: int, every_step: bool) -> LayoutComparison:
    reference_losses, reference_states = runs[0]
    firsts, leaves = [], []
    for layout, (losses, states) in zip(layouts[1:], runs[1:]):
        pair = (layouts[0], layout)
        for i, (a, b) in enumerate(zip(reference_losses, losses)):
            found = _tensor_difference(a, b)
            if found is not None:
                firsts.append(Difference(i, "loss", None, pair, *found))
                break
        for (i, a), (_, b) in zip(reference_states, states):
            found = _state_difference(i, a, b, pair)
            if found is not None:
                firsts.append(found)
                leaves.append(found)
                break

    def order(d: Difference) -> tuple[int, int]:
        return d.step, _KINDS.index(d.what)

    first = min(firsts, key=order, default=None)
    first_leaf = min(leaves, key=order, default=None)
    return LayoutComparison(
        identical=first is None,
        layouts=tuple(dict(layout) for layout in layouts),
        steps=steps,
        every_step=every_step,
        first=first,
        first_leaf=first_leaf,
        losses=tuple(tuple(float(x) for x in run[0]) for run in runs),
    )
