"""Sequence parallelism: the residual stream between the matmuls split along the sequence.

`parallelize(model, rules, mesh, sequence_parallel=True)` (Megatron-SP, torchtitan's
`SequenceParallel` + `PrepareModuleInput`). Inside the transformer blocks, every activation a
rank holds is then rank-local: a slice of the sequence (dimension 1 of `[batch, seq, hidden]`)
between the matmuls, or the rank's heads / features of the whole sequence inside them:

- the first block: its input cut, `scatter_along(x, 1)` (backward: all-gather);
- a module holding column-parallel Linears (attention, MLP): its first input gathered once,
  `gather_sequence(x)` = `gather_along(x, 1)` (backward: reduce-scatter of the summed gradient);
- its column-parallel Linears: `F.linear` on the gathered input, saving this rank's slice and
  gathering it again in the backward, once per module (`LinearOnGathered`, Megatron-SP);
- row-parallel Linear: `reduce_scatter_along(F.linear(x, w), 1) + copy_to(b)`;
- any other module with whole parameters (norms; a Qwen3 `q_norm` on local heads): its own
  forward with each parameter through `copy_to` (backward: all-reduce of its gradient);
- `nn.Dropout`: the whole activation's mask drawn, this rank's slice along dim 1 kept;
- after the blocks: norms as inside; a column-parallel head gathers its input
  (`gather_sequence`); a head with a whole weight gathers it with `grad="split"` (every rank
  computes the same logits).

The embedding keeps its tensor-parallel forward and its output is the whole sequence (so
Hugging Face models compute rotary embeddings, position ids and the causal mask from it, and
`fs.models.GPT` adds its position embedding, as without sequence parallelism); the residual
stream is cut where the first block begins. Attention runs on the whole sequence: the module
that holds `q_proj`/`k_proj`/`v_proj` receives the gathered input, so its own shape arithmetic
(`hidden_states.shape[:-1]`) sees the whole sequence.

"Replicated parameters inside the blocks are used on rank-local data" is what makes `copy_to`
right for every one of them: their gradients are partial sums over `tp` (Megatron's all-reduce
of sequence-parallel gradients). It holds for Llama, Qwen2 and GPT-style blocks; a block whose
replicated parameter reads a replicated activation (none in these models) would be summed `tp`
times.

Dropout, without changing the step's RNG stream (seeded per data rank, so the ranks of `tp` draw
alike): a dropout on rank-local data (a sequence slice, or the local heads' attention weights)
draws the mask of the whole activation (dimension 1 `tp` times longer) and keeps this rank's
slice. Masks on slices therefore differ across `tp` ranks (different tokens, or heads), every
rank consumes the stream alike (so masks on replicated activations after it, such as the
embedding dropout of the next step's forward, stay identical), and they are the very masks the
single-process model draws: training with dropout equals single-process training at data rank
0. The cost: `tp` times the random numbers of those dropouts, and a whole-activation mask alive
for an instant (never saved for the backward; only the slice is).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._collectives import _all_gather, copy_to, gather_along, scatter_along
from ._placement import PlacementError
from .._tracing import adjoint_ops_enabled, carried, note_collective

__all__ = [
    "SEQUENCE_DIM",
    "SequenceParallelModule",
    "SequenceParallelDropout",
    "SequenceGatheredLinear",
    "LinearOnGathered",
    "Role",
    "sequence_roles",
    "gather_sequence",
    "column_linear",
]

SEQUENCE_DIM = 1  # activations are [batch, seq, ...]; attention weights [batch, heads, seq, seq] split along heads

_COLUMN = {"colwise", "packed_colwise"}
_ROW = {"rowwise", "packed_rowwise"}
_HEAD = {"colwise", "packed_colwise", "colwise_rep", "colwise_gather_output"}


class Role(NamedTuple):
    """What sequence parallelism does to one module (`sequence_roles`)."""

    input: str | None  # "scatter" (the first block), "gather" (holds column-parallel Linears), "copy" (plain TP: copy_to once), or None
    copied: tuple[str, ...]  # names of its replicated parameters passed through copy_to
    linear: str | None  # a Linear's mode: "gathered", "gather", "scatter", "gather_replicated"
    dropout: bool  # an nn.Dropout on rank-local data


class _SequenceParallel:
    """What every module `parallelize` changes carries (tensor- or sequence-parallel): its style or
    role, the mesh and the axis."""

    _fs_style: str
    _fs_mesh: Any
    _fs_axis: str

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tensor_parallel={self._fs_style!r} over {self._fs_axis!r}"


class SequenceParallelModule(_SequenceParallel):
    """A module on sequence slices: its first input scattered (the first block) or gathered (a
    module of column-parallel Linears) along the sequence, and its replicated parameters passed
    through `copy_to` (partial gradients, summed over the axis), around its own forward."""

    _fs_input: str | None
    _fs_input_name: str | None
    _fs_copied: tuple[str, ...]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mesh, axis = self._fs_mesh, self._fs_axis
        frames = None
        if self._fs_input == "copy":  # plain TP: its Linears that read this input share one copy_to of it
            first = args[0] if args else kwargs.get(self._fs_input_name)
            frames = self.__dict__.setdefault("_fs_copy_frames", [])
            frames.append([first, None])
        elif self._fs_input is not None:
            move = {"scatter": _scatter_sequence, "gather": _gather_sequence}[self._fs_input]
            if args:
                args = (move(args[0], mesh, axis, self),) + tuple(args[1:])
            elif self._fs_input_name in kwargs:
                kwargs = {**kwargs, self._fs_input_name: move(kwargs[self._fs_input_name], mesh, axis, self)}
        saved = {name: self._parameters[name] for name in self._fs_copied}
        try:
            for name, value in saved.items():
                self._parameters[name] = copy_to(value, mesh, axis)
            return super().forward(*args, **kwargs)
        finally:
            self._parameters.update(saved)
            if frames is not None:
                frames.pop()


class SequenceParallelDropout(_SequenceParallel):
    """`nn.Dropout` on a slice (dim 1) of an activation: the whole activation's mask is drawn
    from the step's stream (the same on every rank of the axis) and this rank's slice kept."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.p == 1:
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        mesh, axis = self._fs_mesh, self._fs_axis
        size, index = mesh.shape[axis], mesh.coordinates[axis]
        shape = list(x.shape)
        piece = shape[SEQUENCE_DIM]
        shape[SEQUENCE_DIM] = piece * size
        # What F.dropout does on the CPU (empty, bernoulli_(1 - p), div_(1 - p), multiply), on the whole activation.
        # from `x` (new_empty): a pipeline's cut puts the draw on x's stage (a draw reading nothing is refused there)
        noise = x.new_empty(shape)
        note_collective(noise, (axis,), "whole")  # the whole activation's mask: the same on every rank (`_split_values`)
        noise = noise.bernoulli_(1 - self.p).div_(1 - self.p)
        # A copy, not a view: the backward keeps only this rank's slice of the mask alive.
        mine = noise.narrow(SEQUENCE_DIM, index * piece, piece).clone(memory_format=torch.contiguous_format)
        return x * mine


class SequenceGatheredLinear(_SequenceParallel):
    """A replicated Linear after the blocks (a head whose weight is whole): its input gathered
    along the sequence; every rank computes the same output, so the input's gradient is sliced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = gather_along(_checked(x, self), SEQUENCE_DIM, self._fs_mesh, self._fs_axis, grad="split")
        return F.linear(full, self.weight, self.bias)


class _Regather:
    """The whole-sequence input of the column-parallel Linears of one module, gathered again in
    the backward: once, by the first Linear whose backward runs, and dropped after the last."""

    def __init__(self, shard: torch.Tensor, mesh: Any, axis: str) -> None:
        self.shard, self.mesh, self.axis = shard, mesh, axis
        self.users = 0  # Linears whose backward still needs it
        self.full: torch.Tensor | None = None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = _all_gather(shard, SEQUENCE_DIM, self.mesh, self.axis)
        full = self.full
        self.users -= 1
        if self.users <= 0:
            self.full = self.shard = None
        return full


@carried
class LinearOnGathered(torch.autograd.Function):
    """`F.linear(full, weight, bias)` that saves this rank's sequence slice instead of the
    gathered input and all-gathers it again for the weight's gradient (Megatron-SP: the
    activations saved between blocks are `tp` times smaller, for one more all-gather of the
    block's input per module in the backward, shared by its Linears).

    Forward: the matmul, no communication. Backward: the input's gradient `grad @ weight`
    (partial: the gather that made `full` reduce-scatters it), the weight's gradient from the
    gathered-again input.
    """

    @staticmethod
    def forward(full, shard, weight, bias, regather):
        return F.linear(full, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        full, shard, weight, bias, regather = inputs
        ctx.save_for_backward(shard, weight)
        ctx.regather, ctx.has_bias = regather, bias is not None

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_full = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        flat = grad.reshape(-1, grad.shape[-1])
        full = ctx.regather.take(shard)
        if ctx.needs_input_grad[2]:
            grad_weight = flat.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat.sum(0)
        return grad_full, None, grad_weight, grad_bias, None


def gather_sequence(shard: torch.Tensor, mesh: Any, axis: str) -> torch.Tensor:
    """The whole sequence from this rank's slice (`gather_along(shard, 1)`), marked so that the
    column-parallel Linears applied to it save the slice, not the whole (`column_linear`)."""
    full = gather_along(shard, SEQUENCE_DIM, mesh, axis)
    full._fs_regather = _Regather(shard, mesh, axis)
    return full


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A column-parallel matmul on a gathered sequence (`gather_sequence`'s output): saves the
    slice and gathers again in the backward; on any other tensor, `F.linear`."""
    regather = getattr(x, "_fs_regather", None)
    # (a pipeline stage is traced into aten operations differentiated by their own formulas: there
    # the Linear saves the gathered input, as without sequence parallelism, and does not gather again)
    if regather is None or regather.shard is None or not torch.is_grad_enabled() or adjoint_ops_enabled():
        return F.linear(x, weight, bias)
    regather.users += 1
    return LinearOnGathered.apply(x, regather.shard, weight, bias, regather)


def _checked(x: Any, module: nn.Module) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise PlacementError(
            f"sequence parallelism: {type(module).__name__} expects a [batch, seq, ...] tensor as its first input; "
            f"got {type(x).__name__}{list(x.shape) if isinstance(x, torch.Tensor) else ''}"
        )
    return x


def _scatter_sequence(x: Any, mesh: Any, axis: str, module: nn.Module) -> torch.Tensor:
    x = _checked(x, module)
    size = mesh.shape[axis]
    if x.shape[SEQUENCE_DIM] % size:
        raise PlacementError(
            f"sequence parallelism over {axis!r} (size {size}): the blocks' input has shape {list(x.shape)}, whose "
            f"sequence length {x.shape[SEQUENCE_DIM]} (dimension {SEQUENCE_DIM}) is not divisible by {size}; pad the "
            f"batch's sequences to a multiple of {size} (with an attention mask and -100 labels) or parallelize "
            f"without sequence_parallel"
        )
    return scatter_along(x, SEQUENCE_DIM, mesh, axis)


def _gather_sequence(x: Any, mesh: Any, axis: str, module: nn.Module) -> torch.Tensor:
    return gather_sequence(_checked(x, module), mesh, axis)


def _first_input_name(module: nn.Module) -> str | None:
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return parameters[0].name if parameters and parameters[0].kind != inspect.Parameter.VAR_POSITIONAL else None


def _find_blocks(model: nn.Module, split: dict[str, tuple[str, str]], blocks: str | None) -> str:
    containers = {
        name: m for name, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)
    }
    if blocks is not None:
        if blocks not in containers:
            raise PlacementError(
                f"parallelize(sequence_parallel=True, blocks={blocks!r}): the model has no non-empty nn.ModuleList or "
                f"nn.Sequential at that path; lists it has: {sorted(containers) or 'none'}"
            )
        return blocks
    found = []
    for name, container in containers.items():
        children = [f"{name}.{child}" if name else child for child, _ in container.named_children()]
        if all(any(path.startswith(child + ".") for path in split) for child in children):
            found.append(name)
    # The innermost lists (a list of blocks nested in another counts once).
    found = [name for name in found if not any(other.startswith(name + ".") for other in found)]
    if len(found) != 1:
        raise PlacementError(
            f"parallelize(sequence_parallel=True) needs the transformer blocks: the one nn.ModuleList whose every "
            f"element holds split Linears; found {found or 'none'} (split modules: {sorted(split)[:4]}...). "
            f"Name it with blocks='path.to.layers'"
        )
    return found[0]


def _inside(path: str, root: str) -> bool:
    return path.startswith(root + ".") if root else True


def sequence_roles(
    model: nn.Module,
    split: dict[str, tuple[str, str]],
    replicated: set[str],
    blocks: str | None = None,
) -> tuple[str, str, dict[str, Role]]:
    """Which modules sequence parallelism changes, and how (see the module docstring).

    Arguments:
        model: the model `parallelize` is given.
        split: module path -> (style, axis) of the Linears and Embeddings whose weight is split
            over an axis of more than one rank.
        replicated: paths of the parameters that are whole on every rank (`fs.functionalize`
            names; a tied parameter under its first name is enough: `named_parameters` order).
        blocks: the path of the blocks' list; None: the one `nn.ModuleList`/`nn.Sequential`
            whose every element holds split modules.

    Returns `(blocks, axis, roles)`, roles a dict module path -> `Role`. Raises `PlacementError`
    naming the module for what sequence parallelism cannot run: a split Embedding inside or
    after the blocks, a style inside the blocks other than column- or row-parallel, a
    row-parallel Linear after them, splits over several axes.
    """
    axes = {axis for _, axis in split.values()}
    if len(axes) != 1:
        raise PlacementError(f"sequence parallelism runs over one axis; the split modules use {sorted(axes)}")
    (axis,) = axes
    root = _find_blocks(model, split, blocks)
    order = [name for name, _ in model.named_modules()]
    last_inside = max(i for i, name in enumerate(order) if _inside(name, root))
    block_paths = [f"{root}.{child}" if root else child for child, _ in model.get_submodule(root).named_children()]
    first_block = block_paths[0]
    names = {id(p): n for n, p in model.named_parameters()}
    roles: dict[str, Role] = {}
    for position, (name, module) in enumerate(model.named_modules()):
        inside = _inside(name, root) and name != root
        after = position > last_inside and not _inside(root, name)
        if not (inside or after):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name in split:
            style, _ = split[name]
            if isinstance(module, nn.Embedding):
                raise PlacementError(
                    f"sequence parallelism: embedding {name!r} is split ({style!r}) inside or after the blocks "
                    f"{root!r}; fs cuts the sequence where the first block begins: replicate it or leave it before"
                )
            if inside and style in _COLUMN:
                # A module of column-parallel Linears (attention, MLP) gathers its input once;
                # a Linear directly in a block gathers its own.
                inner = parent not in block_paths
                roles[name] = Role(None, (), "gathered" if inner else "gather", False)
                if inner:
                    previous = roles.get(parent, Role(None, (), None, False))
                    roles[parent] = previous._replace(input="gather")
            elif inside and style in _ROW:
                roles[name] = Role(None, (), "scatter", False)
            elif after and style in _HEAD:
                roles[name] = Role(None, (), "gather", False)
            else:
                raise PlacementError(
                    f"sequence parallelism: {name!r} has style {style!r} {'inside' if inside else 'after'} the blocks "
                    f"{root!r}; fs runs 'colwise'/'packed_colwise' and 'rowwise'/'packed_rowwise' Linears inside the "
                    f"blocks and column-parallel heads after them. Use those styles or parallelize without "
                    f"sequence_parallel"
                )
            continue
        if isinstance(module, nn.Dropout) and type(module).forward is nn.Dropout.forward:
            roles[name] = Role(None, (), None, True)
            continue
        own = [k for k, p in module._parameters.items() if p is not None and names.get(id(p)) in replicated]
        if after and isinstance(module, nn.Linear):
            roles[name] = Role(None, (), "gather_replicated", False)
            continue
        if own:
            previous = roles.get(name, Role(None, (), None, False))
            roles[name] = previous._replace(copied=tuple(own))
    entry = roles.get(first_block, Role(None, (), None, False))
    roles[first_block] = entry._replace(input="scatter")
    return root, axis, roles


def apply_role(module: nn.Module, role: Role, style: str, mesh: Any, axis: str, make_class: Any) -> None:
    """Give `module` (not a split Linear: `parallelize` sets those) the class of its role."""
    if role.dropout:
        base = SequenceParallelDropout
    elif role.linear == "gather_replicated":
        base = SequenceGatheredLinear
    else:
        base = SequenceParallelModule
        module._fs_input = role.input
        module._fs_input_name = _first_input_name(module) if role.input else None
        module._fs_copied = role.copied
    module.__class__ = make_class(module, base)
    module._fs_style, module._fs_mesh, module._fs_axis = style, mesh, axis


def role_style(role: Role) -> str:
    """A short name for `parallelized_modules`: what the module does on the sequence."""
    if role.dropout:
        return "sequence_parallel_dropout"
    if role.linear == "gather_replicated":
        return "sequence_gather_replicated"
    parts = []
    if role.input:
        parts.append({"scatter": "sequence_scatter_input", "gather": "sequence_gather_input", "copy": "copy_input"}[role.input])
    if role.copied:
        parts.append("sequence_parallel")
    return "+".join(parts)

