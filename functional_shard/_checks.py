"""What a step checks in the parameters it is given, and what ranks must agree on.

`check_leaves` refuses leaves a step cannot train (meta without an initializer, complex),
naming them; `check_same_values` compares a hash of every buffer across ranks (ranks seeded
differently would otherwise train a silent mixture); `broadcast_from_rank0` takes rank 0's
values instead, as DDP does. `optimizer_facts` and `scalar_facts` describe an optimizer as
lines that ranks compare in their agreement before each step (`_jit.agree`): a different
optimizer, hyperparameter or learning rate on one rank would otherwise train silently.
"""

from __future__ import annotations

import contextlib
import hashlib
import types
from typing import Any, Iterator

import torch

from ._layout import Layout
from ._mesh import BaseMesh, MeshError
from ._microbatches import batch_problem
from ._reference import StepError
from ._pytree import tree_leaves, tree_paths
from ._tree import FROZEN
from .optim import GradientTransformation, Optimizer

__all__ = ["check_leaves", "check_same_values", "broadcast_from_rank0", "step_facts", "optimizer_facts", "scalar_facts"]


def check_leaves(layout: Layout, leaves: list, mesh: BaseMesh, meta_ok: bool = False) -> None:
    """Refuse leaves a step cannot train, naming them (before any collective)."""
    for i, leaf in enumerate(leaves):
        where = f"{layout.describe_leaf(i)} on rank {mesh.rank}"
        if leaf.is_meta and not meta_ok:
            raise StepError(
                f"{where} is on the meta device: it has no values to shard. Pass an initializer, "
                f"step.init(params, initialize=fs.initialize.from_module(model, seed=0)), which materializes "
                f"one submodule at a time and keeps this rank's slice"
            )
        if leaf.is_complex() and layout.roles[i] != FROZEN:
            raise StepError(
                f"{where} is complex: a sharded step does not train complex parameters (they would be "
                f"frozen silently). Store it as torch.view_as_real(...) and view it back in loss_fn, or "
                f"mark it frozen (requires_grad=False)"
            )


def _buffer_digests(layout: Layout, leaves: list) -> list[int]:
    digests = []
    for spec in layout.buffers:
        h = hashlib.blake2b(digest_size=8)
        for i in spec.leaves:
            h.update(leaves[i].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests.append(int.from_bytes(h.digest(), "little") >> 1)
    return digests


def check_same_values(layout: Layout, leaves: list, mesh: BaseMesh) -> None:
    """One all-gather of a 63-bit hash per buffer; raise on every rank if they differ."""
    if mesh.world_size == 1 or not layout.buffers:
        return
    mine = torch.tensor(_buffer_digests(layout, [t.cpu() for t in leaves]), dtype=torch.int64)
    everyone = mesh.all_gather_world(mine.to(getattr(mesh, "device", "cpu"))).view(mesh.world_size, -1).cpu()
    differ = (everyone != everyone[0]).any(dim=0)
    if bool(differ.any()):
        k = int(differ.nonzero()[0])
        spec = layout.buffers[k]
        ranks = [r for r in range(mesh.world_size) if everyone[r, k] != everyone[0, k]]
        raise MeshError(
            f"ranks {ranks} hold parameter values that differ from rank 0's, first in buffer {spec.name!r} "
            f"({layout.describe_leaf(spec.leaves[0])}, ...): every rank must start from the same parameters "
            f"(seed the model the same way everywhere), or pass step.init(params, values='broadcast') to take "
            f"rank 0's, as DDP does"
        )


def broadcast_from_rank0(layout: Layout, leaves: list, mesh: BaseMesh) -> list:
    """Every sharded leaf replaced by rank 0's values (one all-gather per buffer; rank 0's part kept)."""
    leaves = list(leaves)
    for spec in layout.buffers:
        # As raw bytes: the backend has no kernels for some dtypes, and bytes arrive unchanged.
        flat = layout.flatten_buffer(spec, leaves).contiguous()
        gathered = mesh.all_gather_world(flat.view(torch.uint8)).view(mesh.world_size, -1)[0]
        for i, piece in zip(spec.leaves, layout.unflatten_buffer(spec, gathered.clone().view(flat.dtype))):
            leaves[i] = piece
    return leaves


_SIMPLE = (bool, int, float, str, type(None))


def batch_facts(batch: Any, microbatches: int, canonical: Any) -> tuple[str | None, tuple[str, ...]]:
    """`(problem, facts)`: why this rank's batch cannot be cut into its micro-batches (None if
    it can), and what ranks compare about it before a step's first collective — whether it
    cuts, and with `canonical` its leading dimensions (every rank's chunks must be the global
    batch's). A rank whose batch is refused then raises its own error and its peers a
    `MeshError` naming it, together, instead of some ranks waiting in a collective."""
    if microbatches == 1 and canonical is None:
        return None, ()
    problem = batch_problem(batch, microbatches, canonical)
    facts = (f"the batch {'cuts' if problem is None else 'does not cut'} into {microbatches} micro-batches",)
    if canonical is not None:
        rows = sorted({leaf.shape[0] for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.ndim})
        facts += (f"batch rows {rows} (canonical_chunks: every rank holds {microbatches} equal chunks)",)
    return problem, facts


@contextlib.contextmanager
def refused_batch(problem: str | None) -> Iterator[None]:
    """Raise this rank's `StepError(problem)` in place of the `MeshError` its peers raise when
    ranks disagree on their batches (`batch_facts`)."""
    try:
        yield
    except MeshError as error:
        if problem is None:
            raise
        raise StepError(problem) from error


def step_facts(schedule: Any, nonfinite: Any, microbatches: int, loss_scale: Any) -> tuple[str, ...]:
    """What ranks must hold alike to run a step together, as lines, the mode first (what
    `step.evaluate` compares): traced or eager, the non-finite policy, micro-batches and
    accumulation, the loss scale."""
    return (
        "traced (fs.Schedule(trace=True))" if schedule.trace else "eager (fs.Schedule(trace=False))",
        f"nonfinite={nonfinite.value!r}",
        f"microbatches={microbatches}, accumulate={schedule.accumulate!r}",
        f"loss scale {loss_scale!r}",
    )


def optimizer_facts(optimizer: Any) -> tuple[str, ...]:
    """An optimizer as lines ranks compare: `optimizer <name>` (e.g. `fs.optim.adamw`), then one
    `optimizer hyperparameter <path> = <value>` per number, bool or string baked into the
    functions of `fs.optim` (betas, eps, weight decay, a constant learning rate, a chain's
    components...), found in their closures. A function of the user's own is described by
    its qualified name only (what it closes over may rightly differ across ranks); its
    per-step values are compared as scalars (`scalar_facts`)."""
    hyperparameters: dict[str, str] = {}
    _walk(optimizer, "", hyperparameters, depth=0)
    name = _function_name(optimizer.apply) if isinstance(optimizer, (Optimizer, GradientTransformation)) else _function_name(optimizer)
    return (f"optimizer {name}", *(f"optimizer hyperparameter {k} = {v}" for k, v in hyperparameters.items()))


def scalar_facts(scalars: Any) -> tuple[str, ...]:
    """The optimizer's per-step scalars (`optimizer.scalars(state)`: learning rate, bias
    corrections...) as `optimizer scalar <path> = <value>` lines, exactly (`repr` of a float
    round-trips), learning rates first (ranks report the first line that differs). Reads each
    0-d tensor on the host."""
    pairs = sorted(zip(tree_paths(scalars), tree_leaves(scalars)), key=lambda pair: pair[0].rpartition(".")[2] != "lr")
    return tuple(f"optimizer scalar {path} = {float(value)!r}" for path, value in pairs)


def _ours(fn: types.FunctionType) -> bool:
    return (fn.__module__ or "").startswith("functional_shard.optim")


def _function_name(fn: Any) -> str:
    if isinstance(fn, types.FunctionType) and _ours(fn):
        return "fs.optim." + fn.__qualname__.split(".<locals>")[0]
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}".lstrip(".")


def _walk(value: Any, path: str, out: dict[str, str], depth: int) -> None:
    """The simple values within `value` added to `out`, by path."""
    if isinstance(value, _SIMPLE):
        out[path or "<root>"] = repr(value)
    elif depth > 8:
        return
    elif isinstance(value, (Optimizer, GradientTransformation)):
        if path:
            out[path] = _function_name(value.apply)
        for fn in (value.apply, value.scalars, value.init):
            if isinstance(fn, types.FunctionType) and _ours(fn):
                _closure(fn, path, out, depth + 1)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for field in value._fields:
            _walk(getattr(value, field), f"{path}.{field}" if path else field, out, depth + 1)
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", out, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path}[{key!r}]", out, depth + 1)
    elif isinstance(value, types.FunctionType) and _ours(value):
        _closure(value, path, out, depth + 1)
    elif callable(value) and not isinstance(value, type):
        out[path or "<root>"] = _function_name(value)


def _closure(fn: types.FunctionType, path: str, out: dict[str, str], depth: int) -> None:
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        _walk(value, f"{path}.{var}" if path else var, out, depth)
