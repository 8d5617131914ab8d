"""A module run on its tensor-parallel pieces: a plan's activation collectives, without hooks.

    model = fs.tensor_parallel.parallelize(model, rules, mesh)     # in place, returns it
    apply_fn, params = fs.functionalize(model)                      # full params, as before
    step = fs.sharded_step(loss_fn, mesh, optimizer=..., placements=rules)

`parallelize` gives each module a plan places (its weight split over an axis of more than one
rank) a forward that runs on the rank's pieces with Megatron's conjugate collectives around it,
chosen by the rule's style (Hugging Face's names):

| style | module | forward on the pieces |
|---|---|---|
| `colwise`, `packed_colwise` | Linear | `F.linear(copy_to(x), w, b)`: local outputs |
| `colwise_rep`, `colwise_gather_output` | Linear | the same, outputs gathered (`gather_along(-1, grad="split")`) |
| `rowwise`, `packed_rowwise` | Linear | `reduce_from(F.linear(x, w)) + b` (the bias added once) |
| `rowwise_rep`, `rowwise_split_input` | Linear | the same after `scatter_along(x, -1)` (a replicated input) |
| `embedding_rowwise` | Embedding | vocabulary-parallel lookup: rows outside this rank's range masked, `reduce_from` |
| `embedding_colwise` | Embedding | lookup of local columns, gathered (`gather_along(-1, grad="split")`) |

It does so by giving the module a class of its own (`TensorParallelLinear`, ...: a subclass of its
class whose `forward` is the one above; `repr(model)` shows which modules and styles), not by a
hook: `torch.func.functional_call` runs it on whatever pieces the step passes, and `make_fx`
traces the collectives as nodes. A module whose weight is whole (replicated, a head tied to a
replicated embedding, an axis of size 1) keeps its own forward; so does a module whose rule has no
style (your own rules: apply the collectives in `loss_fn` yourself, the `shard_map` way).

`loss_parallel=True` keeps a `colwise_gather_output` head's logits split along the vocabulary
(`[..., V / tp]` on each rank): compute the loss with `vocab_parallel_cross_entropy`, which never
materializes the full logits. Attention modules need no change where they reshape with `-1`
heads (Hugging Face's do; `fs.models.GPT` infers its local heads from the width).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ._collectives import copy_to, gather_along, reduce_from, reduce_scatter_along, scatter_along
from ._placement import PlacementError, Split, _as_rules, placements_for
from ._sequence import (
    SEQUENCE_DIM,
    Role,
    _SequenceParallel,
    apply_role,
    column_linear,
    gather_sequence,
    role_style,
    sequence_roles,
)

__all__ = ["parallelize", "parallelized_modules"]

_COLWISE = {"colwise", "packed_colwise"}
_COLWISE_GATHERED = {"colwise_rep", "colwise_gather_output"}
_ROWWISE = {"rowwise", "packed_rowwise"}
_ROWWISE_SPLIT_INPUT = {"rowwise_rep", "rowwise_split_input"}
_LINEAR_STYLES = _COLWISE | _COLWISE_GATHERED | _ROWWISE | _ROWWISE_SPLIT_INPUT
_EMBEDDING_STYLES = {"embedding_rowwise", "embedding_colwise"}
# Styles that place parameters but leave the module's forward as it is.
_NO_FORWARD = {"sequence_parallel", "replicate", "replicated_with_grad_allreduce"}


# Every module `parallelize` changes carries its style, the mesh and the axis (`_sequence`).
_TensorParallel = _SequenceParallel


class TensorParallelLinear(_TensorParallel):
    """`nn.Linear` on its column- or row-parallel pieces (the class `parallelize` gives it is a
    subclass of the module's own class and of this one)."""

    # Under sequence parallelism (`_sequence`): "gathered" (the enclosing module gathered the
    # input along the sequence), "gather" (gather it here), "scatter" (reduce-scatter the output
    # along the sequence, then a bias through copy_to: it is added on sequence slices).
    _fs_sequence: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style, mesh, axis, sequence = self._fs_style, self._fs_mesh, self._fs_axis, self._fs_sequence
        if style in _COLWISE or style in _COLWISE_GATHERED:
            if sequence is None:
                y = F.linear(copy_to(x, mesh, axis), self.weight, self.bias)
            elif sequence == "copied":  # the holder's first input: through copy_to once for all its Linears
                y = F.linear(_copied_input(self, x, mesh, axis), self.weight, self.bias)
            else:
                # On the whole sequence, saving only this rank's slice for the backward.
                full = gather_sequence(x, mesh, axis) if sequence == "gather" else x
                y = column_linear(full, self.weight, self.bias)
            return gather_along(y, -1, mesh, axis, grad="split") if style in _COLWISE_GATHERED else y
        if style in _ROWWISE_SPLIT_INPUT:
            x = scatter_along(x, -1, mesh, axis)
        if sequence == "scatter":
            y = reduce_scatter_along(F.linear(x, self.weight), SEQUENCE_DIM, mesh, axis)
            return y if self.bias is None else y + copy_to(self.bias, mesh, axis)
        y = reduce_from(F.linear(x, self.weight), mesh, axis)
        return y if self.bias is None else y + self.bias


class TensorParallelEmbedding(_TensorParallel):
    """`nn.Embedding` split along the vocabulary (rows) or the hidden size (columns)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mesh, axis = self._fs_mesh, self._fs_axis
        if self._fs_style == "embedding_colwise":
            out = F.embedding(ids, self.weight, self.padding_idx)
            return gather_along(out, -1, mesh, axis, grad="split")
        rows = self.weight.shape[0]
        start = mesh.coordinates[axis] * rows
        local = ids - start
        outside = (local < 0) | (local >= rows)
        local = local.masked_fill(outside, 0)
        padding = None
        if self.padding_idx is not None and 0 <= self.padding_idx - start < rows:
            padding = self.padding_idx - start
        out = F.embedding(local, self.weight, padding)
        return reduce_from(out.masked_fill(outside.unsqueeze(-1), 0), mesh, axis)


def _module_class(module: nn.Module, base: type) -> type:
    cls = type(module)
    if isinstance(module, _SequenceParallel):
        return cls
    return type(f"{base.__name__}[{cls.__name__}]", (base, cls), {"__module__": __name__})


def _style_of(path: str, shape: tuple, rules: list) -> str | None:
    for candidate in rules:
        if candidate.matches(path, shape):
            return candidate.style
    return None


def parallelize(
    model: nn.Module,
    rules: Iterable[Any],
    mesh: Any,
    *,
    loss_parallel: bool = False,
    sequence_parallel: bool = False,
    blocks: str | None = None,
) -> nn.Module:
    """Give every module that `rules` split a forward on its tensor-parallel pieces (in place).

    Arguments:
        model: the model; its parameters stay as they are (whole): the step passes each
            rank's pieces to `functional_call`. Modules are given classes of their own.
        rules: the placement rules the step is given (`hf_rules(model)`, `gpt_rules(config)`);
            a rule's `style` says which collectives surround the module.
        mesh: the mesh (`fs.init_mesh`, a `SimulatedMesh`, an `AbstractMesh`); its axes decide
            which modules are split at all (an axis of size 1 splits nothing).
        loss_parallel: keep the vocabulary split after a `colwise_gather_output` head (see the
            module docstring).
        sequence_parallel: split the residual stream along the sequence (dimension 1 of
            `[batch, seq, hidden]`) over the axis from the first block on: norms, dropout and
            residual adds run on `seq / tp` tokens per rank (`_sequence`, docs/parallelism.md).
            The sequence length must be divisible by the axis size.
        blocks: with `sequence_parallel`, the path of the transformer blocks' `nn.ModuleList`
            (`"model.layers"`, `"blocks"`); default: the one list whose every element holds
            split modules.

    Returns `model`. Raises `PlacementError` naming the module for a style on a module that is
    not a Linear or an Embedding, a rowwise Linear with a split bias, an Embedding with
    `max_norm` (it would renormalize rows in place), and, with `sequence_parallel`, for what it
    cannot run (`sequence_roles`).
    """
    rules = _as_rules(rules)
    canonical = {id(p): name for name, p in model.named_parameters()}
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    sizes = dict(mesh.shape)
    placements = placements_for(shapes, rules, sizes)
    split: dict[str, tuple[str, str]] = {}
    summed: dict[str, tuple[str, ...]] = {}  # module -> its parameters styled replicated_with_grad_allreduce
    for name, module in model.named_modules():
        if hasattr(module, "_parameters"):
            grads = tuple(k for k, v in module._parameters.items() if v is not None and _style_of(
                f"{name}.{k}" if name else k, tuple(v.shape), rules) == "replicated_with_grad_allreduce")  # fmt: skip
            if grads:
                summed[name] = grads
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is None:
            continue
        path = f"{name}.weight" if name else "weight"
        style = _style_of(path, tuple(weight.shape), rules)
        placement = placements.get(canonical.get(id(weight), path))
        if style is None or style in _NO_FORWARD or not isinstance(placement, Split) or sizes[placement.axis] == 1:
            continue
        if loss_parallel and style == "colwise_gather_output":
            style = "colwise"
        if isinstance(module, nn.Linear) and style in _LINEAR_STYLES:
            bias = module._parameters.get("bias")
            if bias is not None and style in _ROWWISE | _ROWWISE_SPLIT_INPUT:
                if isinstance(placements.get(canonical.get(id(bias), f"{name}.bias")), Split):
                    raise PlacementError(
                        f"module {name!r} is row-parallel ({style!r}) but its bias is split: a row-parallel bias is "
                        f"added once, after the sum over {placement.axis!r}; place it Replicated()"
                    )
        elif isinstance(module, nn.Embedding) and style in _EMBEDDING_STYLES:
            if module.max_norm is not None:
                raise PlacementError(
                    f"embedding {name!r} has max_norm={module.max_norm}: it renormalizes rows in place, which a "
                    f"vocabulary-parallel lookup cannot do on pieces; drop max_norm or replicate the embedding"
                )
        else:
            raise PlacementError(
                f"module {name!r} ({type(module).__name__}) has tensor-parallel style {style!r}, which fs applies to "
                f"nn.Linear ({sorted(_LINEAR_STYLES)}) and nn.Embedding ({sorted(_EMBEDDING_STYLES)}) modules only: "
                f"give its leaves a rule without a style and apply the collectives in loss_fn yourself"
            )
        split[name] = (style, placement.axis)
    roles = {}
    if sequence_parallel and split:
        replicated = {path for path, placement in placements.items() if not isinstance(placement, Split)}
        _, sequence_axis, roles = sequence_roles(model, split, replicated, blocks)
    elif split:
        roles, sequence_axis = _copy_once_roles(split), None
        # A module on each rank's own part of the activations (a per-head q/k norm after a
        # column-parallel projection) holding parameters styled replicated_with_grad_allreduce:
        # their gradients are partial sums over the axis, all-reduced by passing them through
        # copy_to in its forward (what sequence parallelism does for the norms it runs on slices).
        for name, names in summed.items():
            if name in split:
                continue
            role = roles.get(name, Role(None, (), None, False))
            roles[name] = role._replace(copied=tuple(dict.fromkeys((*role.copied, *names))))
    # Every check passed: only now are classes changed.
    modules = dict(model.named_modules())
    for name, (style, axis) in split.items():
        module = modules[name]
        base = TensorParallelLinear if isinstance(module, nn.Linear) else TensorParallelEmbedding
        module.__class__ = _module_class(module, base)
        module._fs_style, module._fs_mesh, module._fs_axis = style, mesh, axis
        if name in roles:
            module._fs_sequence = roles[name].linear
    for name, role in roles.items():
        if name not in split:
            apply_role(modules[name], role, role_style(role), mesh, sequence_axis or _split_axis(split), _module_class)
    if not sequence_parallel:  # a Linear reading its holder's first input shares the holder's one copy_to
        for name, role in roles.items():
            if role.linear == "copied":
                modules[name].__dict__["_fs_copy_holder"] = modules[name.rsplit(".", 1)[0]]
    return model


def _split_axis(split: dict[str, tuple[str, str]]) -> str:
    return next(iter(split.values()))[1]


def _copied_input(linear: nn.Module, x: torch.Tensor, mesh: Any, axis: str) -> torch.Tensor:
    """A column-parallel Linear's input through `copy_to`: the holder's one copy when `x` is the
    holder's first input itself, else a copy of its own (an input the holder computed: a norm of
    it, another tensor)."""
    holder = linear.__dict__.get("_fs_copy_holder")
    frames = holder.__dict__.get("_fs_copy_frames") if holder is not None else None
    if frames and x is frames[-1][0]:
        if frames[-1][1] is None:
            frames[-1][1] = copy_to(x, mesh, axis)
        return frames[-1][1]
    return copy_to(x, mesh, axis)


def _copy_once_roles(split: dict[str, tuple[str, str]]) -> dict[str, Role]:
    """Plain tensor parallelism: a module holding several column-parallel Linears as direct
    children (attention's q/k/v, a gated MLP's gate/up) passes its first input through `copy_to`
    once for the Linears that read it, so its gradient is all-reduced once per module —
    Megatron's 4 all-reduces of `b·s·h` per layer, not one per Linear. Only the Linears that read
    that very tensor share the copy: another use of it in the module (a residual add) keeps the
    input's own gradient, and a Linear reading something else (a norm of it) copies its own input
    (`_copied_input`)."""
    holders: dict[str, list[str]] = {}
    for name, (style, _) in split.items():
        if style in _COLWISE and "." in name:
            holders.setdefault(name.rsplit(".", 1)[0], []).append(name)
    roles: dict[str, Role] = {}
    for parent, children in holders.items():
        if len(children) < 2 or parent in split or len({split[c][1] for c in children}) != 1:
            continue
        roles[parent] = Role("copy", (), None, False)
        for child in children:
            roles[child] = Role(None, (), "copied", False)
    return roles


def parallelized_modules(model: nn.Module) -> dict[str, str]:
    """Module path -> style of the modules `parallelize` gave a tensor-parallel forward (with
    `sequence_parallel`, what each does on the sequence: `"rowwise+sequence_reduce_scatter_output"`,
    `"sequence_parallel"` for a norm, `"sequence_gather_input"` for an attention or MLP module)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, _SequenceParallel):
            sequence = getattr(m, "_fs_sequence", None)
            out[name] = m._fs_style + (f"+{_SEQUENCE_NAMES[sequence]}" if sequence else "")
    return out


_SEQUENCE_NAMES = {
    "gathered": "sequence_gathered_input",
    "gather": "sequence_gather_input",
    "scatter": "sequence_reduce_scatter_output",
    "copied": "copied_input",
}
