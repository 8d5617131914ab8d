"""Tensor parallelism with the same bits at every `tp` degree: a canonical cut of the split dimensions.

At `tp = T` a row-parallel Linear adds `T` partial products (an all-reduce whose order depends on
`T`), a column-parallel Linear's input gradient adds `T` partial products likewise (the backward
all-reduce of `copy_to`), the vocabulary-parallel loss adds `T` partial sums of `exp`, and even
the rank-local matrix products change bits with `T`: BLAS picks its kernel by the operands'
shapes (a `[512, 1024] x [1024, 128]` product does not give the columns of the `[.., 256]` one),
and so does a bias gradient's sum over tokens.

`parallelize_canonical(model, rules, mesh, blocks=B)` runs every split Linear as `B` virtual
ranks whatever `T` is (a power of two dividing `B`, `T = 1` included): a rank computes its
`B / T` canonical blocks of the split dimension one matrix product each, always of the same
shape, and the blocks' contributions meet in `_canonical.tree_sum`'s fixed tree: the rank's own
blocks first, then the `T` ranks' partial sums, all-gathered over the axis and added in rank
order (the tree over `B` restricted to a rank's blocks is the tree over them).

- column-parallel (`colwise`, `packed_colwise`, `colwise_rep`, `colwise_gather_output`): the
  output columns in `B` blocks (of every chunk of a fused weight), each `F.linear(x, w_j, b_j)`;
  backward: each block's input gradient `g_j @ w_j`, added in the tree (`_FanOut`), instead of
  `copy_to`'s all-reduce. Weight and bias gradients are per block, as computed.
- row-parallel (`rowwise`, `packed_rowwise`, `rowwise_rep`, `rowwise_split_input`): the input
  features in `B` blocks, each `F.linear(x_j, w_j)`, added in the tree (`_TreeReduce`) instead of
  `reduce_from`'s all-reduce, then the bias; backward: each block's gradients, no sum over `B`.
- `vocab_parallel_cross_entropy(..., blocks=B)`: the sum of `exp` per vocabulary block, added
  in the tree. The vocabulary-parallel embedding needs nothing: its all-reduce adds zeros.

Everything else runs as it is: replicated work (norms, residuals) is the same at every `T`;
attention on a rank's heads is a batched product over `n_head / T` heads (its bits per head do
not change with the head count: checked, not promised by BLAS).

Cost (CPU, one thread, forward + backward, against `F.linear` at M=512, d=1024, 4 blocks): qkv
1.12x, MLP fc 1.06x, MLP proj 1.19x; a GPT step (d 256, 4 layers) 1.17x at `tp = 1`, 1.13x at
`tp = 2`. Bytes: each all-reduce of `b·s·h` becomes an all-gather of `T` partial sums,
`(T - 1)·b·s·h` per rank instead of `2(T - 1)/T·b·s·h`: equal at `T = 2`, 3.5x at `T = 8`.

A prototype (not exported). What stays outside: the global gradient norm (and so clipping)
sums squares over each rank's buffer of pieces; dropout inside the split section (attention
weights on local heads) draws per `tp` rank (`_split_values`), so its masks depend on `T`;
sequence parallelism is not supported.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .._basemesh import BaseMesh
from .._tracing import carried
from .._canonical import degrees, tree_sum
from ._collectives import gather_along, scatter_along
from ._loss import reduce_loss, shifted_logits
from ._modules import _COLWISE, _COLWISE_GATHERED, _LINEAR_STYLES, _ROWWISE, _ROWWISE_SPLIT_INPUT, parallelize
from ._placement import Split, _as_rules, placements_for

__all__ = ["parallelize_canonical", "vocab_parallel_cross_entropy", "CanonicalLinear"]


def _size(mesh: BaseMesh, axis: str) -> int:
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def _check(blocks: int, size: int, axis: str) -> int:
    """Blocks per rank; a ValueError where `size` ranks cannot give `blocks`' bits."""
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1 or blocks & (blocks - 1):
        raise ValueError(
            f"blocks must be a power of two >= 1 (the largest tp degree to give the same bits at); got {blocks!r}"
        )
    if size not in degrees(blocks):
        raise ValueError(
            f"blocks={blocks} cannot give the same bits at {axis}={size}: the degree must be a power of two dividing "
            f"blocks, one of {degrees(blocks)}; pick blocks as the largest degree you will run at"
        )
    return blocks // size


def _gather_tree(local: torch.Tensor, mesh: BaseMesh, axis: str) -> torch.Tensor:
    """The tree sum over the ranks of `axis` (rank order) of every rank's `local`."""
    size = _size(mesh, axis)
    if size == 1:
        return local
    every = mesh.all_gather_axis_flat(local.contiguous().view(-1), axis)
    return tree_sum(every.view(size, *local.shape))


@carried
class _TreeReduce(torch.autograd.Function):
    """Forward: `parts` (`[n, ...]`, this rank's `n` canonical blocks' addends, block-major, in
    runs of `chunks` per block) added in the canonical tree, then every rank's sum all-gathered
    over `axis` and added in the tree (replaces `reduce_from`'s all-reduce). Backward: the
    output's gradient (replicated over `axis`) for every addend (`_FanOut`)."""

    @staticmethod
    def forward(parts: torch.Tensor, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return _gather_tree(tree_sum(parts), mesh, axis)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.count, ctx.mesh, ctx.axis = inputs[0].shape[0], inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _FanOut.apply(grad, ctx.count, ctx.mesh, ctx.axis), None, None


@carried
class _FanOut(torch.autograd.Function):
    """Forward: `x` (replicated over `axis`) as `count` views, `[count, ...]`, one per canonical
    block that reads it (replaces `copy_to`). Backward: the blocks' gradients added in the
    canonical tree, then over the ranks of `axis` (`_TreeReduce`)."""

    @staticmethod
    def forward(x: torch.Tensor, count: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
        return x.unsqueeze(0).expand(count, *x.shape)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mesh, ctx.axis = inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _TreeReduce.apply(grad, ctx.mesh, ctx.axis), None, None, None


class CanonicalLinear:
    """An `nn.Linear` split over `tp` computed as `blocks` canonical blocks at every degree (the
    class `parallelize_canonical` gives it is a subclass of the module's class and of this one).
    `_fs_chunks`: the fused blocks of its split dimension (`Split.chunks`)."""

    _fs_style: str
    _fs_mesh: Any
    _fs_axis: str
    _fs_blocks: int
    _fs_chunks: int

    def extra_repr(self) -> str:
        blocks = f"{self._fs_blocks} canonical blocks"
        return f"{super().extra_repr()}, tensor_parallel={self._fs_style!r} over {self._fs_axis!r} in {blocks}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style, mesh, axis = self._fs_style, self._fs_mesh, self._fs_axis
        n = self._fs_blocks // _size(mesh, axis)
        if style in _COLWISE or style in _COLWISE_GATHERED:
            y = _column(x, self.weight, self.bias, n, self._fs_chunks, mesh, axis)
            if style in _COLWISE_GATHERED and _size(mesh, axis) > 1:
                y = gather_along(y, -1, mesh, axis, grad="split")
            return y
        if style in _ROWWISE_SPLIT_INPUT and _size(mesh, axis) > 1:
            x = scatter_along(x, -1, mesh, axis)
        y = _row(x, self.weight, n, self._fs_chunks, mesh, axis)
        return y if self.bias is None else y + self.bias


def _blocks(t: torch.Tensor, dim: int, chunks: int, n: int) -> list[torch.Tensor]:
    """`t` cut along `dim` into `chunks * n` equal pieces (chunk-major, as a rank's piece of a
    `Split(chunks=...)` leaf is laid out) -> the `n` canonical blocks, block `j` the `j`-th piece
    of every chunk, concatenated in chunk order (a view when `chunks == 1`). `split`/`unbind`,
    not indexing: their gradients are one concatenation, not a zero-filled tensor per piece."""
    pieces = t.split(t.shape[dim] // (chunks * n), dim=dim)
    if chunks == 1:
        return list(pieces)
    return [torch.cat([pieces[c * n + j] for c in range(chunks)], dim=dim) for j in range(n)]


def _column(x, weight, bias, n: int, chunks: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
    """`F.linear(x, weight, bias)` of this rank's output columns: one product per canonical block
    (block `j`: rows `j` of every fused chunk), the input's gradient added over the blocks in the
    tree, then over the ranks (`_FanOut`)."""
    lead, features = x.shape[:-1], x.shape[-1]
    copies = _FanOut.apply(x.reshape(-1, features), n, mesh, axis).unbind(0)  # one view per block
    weights = _blocks(weight, 0, chunks, n)
    biases = _blocks(bias, 0, chunks, n) if bias is not None else [None] * n
    rows = weight.shape[0] // (chunks * n)
    outs = [F.linear(copies[j], weights[j], biases[j]).view(-1, chunks, rows) for j in range(n)]
    # [M, chunks, n, rows]: chunk-major, as the local weight's rows
    return torch.stack(outs, dim=2).view(*lead, -1)


def _row(x, weight, n: int, chunks: int, mesh: BaseMesh, axis: str) -> torch.Tensor:
    """The sum over every rank's input features of `F.linear(x, weight)` (no bias): one product
    per canonical block of this rank's features (block `j`: features `j` of every fused chunk),
    added in the canonical tree, then over the ranks (`_TreeReduce`)."""
    lead = x.shape[:-1]
    inputs = _blocks(x.reshape(-1, x.shape[-1]), 1, chunks, n)
    # Contiguous blocks: the weight gradient then comes out row-major (a strided block's comes out
    # column-major, and joining those transposes: +50% on the product at d=1024).
    weights = [w.contiguous() for w in _blocks(weight, 1, chunks, n)]
    parts = torch.stack([F.linear(inputs[j], weights[j]) for j in range(n)])
    return _TreeReduce.apply(parts, mesh, axis).view(*lead, weight.shape[0])


def _plain_class(module: nn.Module) -> type:
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("functional_shard.tensor_parallel"):
            return cls
    raise AssertionError("unreachable: nn.Module is in every module's mro")


def parallelize_canonical(
    model: nn.Module, rules: Iterable[Any], mesh: Any, *, blocks: int, axis: str = "tp"
) -> nn.Module:
    """`parallelize(model, rules, mesh)` whose split Linears give the same bits at every degree of
    `axis` that divides `blocks` (in place; `mesh` may have `axis` of size 1, or none: `tp = 1`).

    Arguments:
        model: the model (its parameters whole, as for `parallelize`).
        rules: its placement rules with styles (`gpt_rules(config)`, `hf_rules(model)`).
        mesh: the mesh the step runs on.
        blocks: the canonical blocks of every split dimension: the largest degree of `axis` to
            give the same bits at (a power of two; every split dimension, of every fused chunk,
            must divide by it: the placements are checked at `axis = blocks`).
        axis: the tensor-parallel axis.

    Returns `model`. Compute the loss of vocabulary-split logits with this module's
    `vocab_parallel_cross_entropy(..., blocks=blocks)`. Raises ValueError for a degree that
    does not divide `blocks`, `PlacementError` for a leaf `blocks` cannot cut (`placements_for`
    at `axis = blocks`).
    """
    rules = _as_rules(rules)
    size = _size(mesh, axis)
    _check(blocks, size, axis)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    canonical_shape = {**dict(mesh.shape), axis: blocks}
    placements = placements_for(shapes, rules, canonical_shape)  # every degree up to `blocks` cuts alike
    names = {id(p): name for name, p in model.named_parameters()}
    linears: dict[str, tuple[str, Split]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None
        if weight is None:
            continue
        path = f"{name}.weight" if name else "weight"
        placement = placements.get(names.get(id(weight), path))
        style = next((r.style for r in rules if r.matches(path, tuple(weight.shape))), None)
        if style in _LINEAR_STYLES and isinstance(placement, Split) and placement.axis == axis:
            linears[name] = (style, placement)
    plain = {name: _plain_class(m) for name, m in model.named_modules() if name in linears}
    if size > 1:  # the embeddings (and nothing else: the Linears' styles are taken off)
        loose = [dataclasses.replace(r, style=None) if r.style in _LINEAR_STYLES else r for r in rules]
        parallelize(model, loose, mesh)
    modules = dict(model.named_modules())
    for name, (style, placement) in linears.items():
        module = modules[name]
        cls = plain[name]
        module.__class__ = type(f"CanonicalLinear[{cls.__name__}]", (CanonicalLinear, cls), {"__module__": __name__})
        module._fs_style, module._fs_mesh, module._fs_axis = style, mesh, axis
        module._fs_blocks, module._fs_chunks = blocks, placement.chunks
    return model


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    mesh: BaseMesh,
    axis: str = "tp",
    *,
    blocks: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`fs.tensor_parallel.vocab_parallel_cross_entropy` with the same bits at every degree of
    `axis` dividing `blocks`: the sum of `exp` is taken per canonical block of the vocabulary
    (`V / blocks` entries) and added in the canonical tree (the max and the target's logit are
    exact at any cut). One all-gather of one float per token and rank (the max), one of
    `2 * blocks / T` floats per token and rank (the sums).

    Arguments: as `fs.tensor_parallel.vocab_parallel_cross_entropy`; `blocks`: the canonical
    blocks of the vocabulary (`parallelize_canonical`'s). Returns fp32.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy(reduction=...) is 'mean', 'sum' or 'none'; got {reduction!r}")
    size = _size(mesh, axis)
    n = _check(blocks, size, axis)
    local_vocab = local_logits.shape[-1]
    if local_vocab % n:
        raise ValueError(
            f"vocab_parallel_cross_entropy: {local_vocab} local logits cannot be cut in {n} blocks (blocks={blocks}, "
            f"{axis}={size}): pad the vocabulary to a multiple of blocks"
        )
    shifted, picked = shifted_logits(local_logits, targets, mesh, axis)
    # [n, tokens, V / blocks], each block summed alone: the same reduction at every degree
    exps = shifted.exp().reshape(-1, n, local_vocab // n).transpose(0, 1).contiguous()
    sums = torch.stack([block.sum(-1) for block in exps.unbind(0)]).view(n, *picked.shape)
    # The target's logit goes in with block 0's sum, zeros with the others (adding zeros is exact).
    first = (torch.arange(n, device=picked.device) == 0).to(picked.dtype).view(n, *[1] * picked.dim())
    total = _TreeReduce.apply(torch.stack([sums, first * picked], dim=1), mesh, axis)
    loss = total[0].log() - total[1]
    return reduce_loss(loss, targets, ignore_index, reduction)
