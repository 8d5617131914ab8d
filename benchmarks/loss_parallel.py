"""torch's `loss_parallel` cross-entropy as the planner sees it: the buffers torch's eager code holds.

torchtitan trains with `loss_parallel` (the output projection's logits stay split over the
vocabulary as a DTensor, `Shard(-1)`) and `F.cross_entropy(pred.flatten(0, 1).float(), labels)`
(its `train.py`, December 2024). Under `loss_parallel`, DTensor runs `aten._log_softmax` and
`aten.nll_loss_backward` with the Python of `torch/distributed/tensor/parallel/loss.py`:

- `_log_softmax`: `shifted = x - max` and `exp(shifted)` beside `x` (the caller's float copy of the
  logits, alive until `cross_entropy` returns), then `result = shifted - log(sum)`: three buffers
  of the local logits' size at once;
- `_nll_loss_and_log_softmax_backward` (the log-softmax's backward folded in):
  `grad_input = zeros_like(result)`, the targets' entries set to -1, then
  `(grad_input + exp(result)) * grad_output`, with `result` (saved) and `grad_input` (a local)
  alive until it returns: four buffers of the local logits' size at once.

A traced graph frees every value after its last use, so written as plain aten calls these
functions would be priced with fewer buffers than torch holds (fs's own
`tensor_parallel.vocab_parallel_cross_entropy` holds three at most, the trace's way). Here the
two bodies are opaque operators (`torch.library.custom_op`, fake kernels for the meta device)
whose extra outputs are the locals torch keeps: the planner counts them alive at the operator,
as torch's allocator sees them. The collectives (the max, the sum of `exp`, the target's logit:
one float per token each) are the mesh's, outside the operators, so they are traced and priced.
The CPU kernels compute the values (the same loss and gradient as `F.cross_entropy`, checked in
`tests/test_planning_loss_parallel.py`).

    from loss_parallel import loss_parallel_cross_entropy
    loss = loss_parallel_cross_entropy(local_logits.float(), labels, mesh, "tp")
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fs_bench::loss_parallel_shift", mutates_args=())
def _shift(x: torch.Tensor, largest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shifted = x - largest, the local sum of exp(shifted) per row, exp(shifted) itself: the
    temporary `_log_softmax` makes beside x and shifted)."""
    shifted = x - largest
    exps = shifted.exp()
    return shifted, exps.sum(-1, keepdim=True), exps


@_shift.register_fake
def _(x, largest):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1)), torch.empty_like(x)


@torch.library.custom_op("fs_bench::loss_parallel_backward", mutates_args=())
def _backward(
    result: torch.Tensor, index: torch.Tensor, mine: torch.Tensor, grad_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the gradient of the local logits, and the locals torch holds while it makes it: its
    `grad_input` with -1 at this rank's targets, and `grad_input + exp(result)`)."""
    grad_input = torch.zeros_like(result)
    rows = torch.arange(result.shape[0], device=result.device)
    grad_input[rows, index] = -mine.to(result.dtype)  # torch: mask_buffer - 1.0 (0 where another rank holds it)
    summed = grad_input + result.exp()
    return summed * grad_rows.unsqueeze(-1), grad_input, summed


@_backward.register_fake
def _(result, index, mine, grad_rows):
    return torch.empty_like(result), torch.empty_like(result), torch.empty_like(result)


class _LossParallel(torch.autograd.Function):
    """Mean cross-entropy of vocabulary-split fp32 logits, torch's `loss_parallel` way (an
    `autograd.Function` with `setup_context`, which `torch.func` transforms accept)."""

    @staticmethod
    def forward(x, targets, mesh, axis, ignore_index):
        size = mesh.shape[axis] if axis in mesh.axis_names else 1
        local_vocab = x.shape[-1]
        start = (mesh.coordinates[axis] if size > 1 else 0) * local_vocab
        local_max = x.detach().amax(-1, keepdim=True)
        if size > 1:  # torch: all_reduce(MAX); one float per token and rank
            everyone = mesh.all_gather_axis_flat(local_max.contiguous().view(-1), axis)
            local_max = everyone.view(size, -1).amax(0).view(local_max.shape)
        shifted, sums, _exps = torch.ops.fs_bench.loss_parallel_shift(x, local_max)
        if size > 1:
            sums = mesh.all_reduce_flat(sums.contiguous().view(-1), (axis,)).view(sums.shape)
        result = shifted - sums.log()
        kept = targets != ignore_index
        safe = torch.where(kept, targets, torch.zeros_like(targets))
        mine = (safe >= start) & (safe < start + local_vocab)
        index = torch.where(mine, safe - start, torch.zeros_like(safe))
        picked = torch.where(mine, result.gather(-1, index.unsqueeze(-1)).squeeze(-1), torch.zeros_like(sums.view(-1)))
        if size > 1:  # torch: the _MaskPartial reduction of the target's log-probability
            picked = mesh.all_reduce_flat(picked.contiguous(), (axis,))
        total = kept.sum().to(x.dtype)
        loss = -torch.where(kept, picked, torch.zeros_like(picked)).sum() / total
        return loss, result, index, mine & kept, kept, total

    @staticmethod
    def setup_context(ctx, inputs, output):
        _loss, result, index, mine, kept, total = output
        ctx.save_for_backward(result, index, mine, kept, total)
        ctx.mark_non_differentiable(result, index, mine, kept, total)

    @staticmethod
    def backward(ctx, grad, *_):
        result, index, mine, kept, total = ctx.saved_tensors
        grad_rows = torch.where(kept, (grad / total).expand(kept.shape), torch.zeros_like(total).expand(kept.shape))
        grad_x, _grad_input, _summed = torch.ops.fs_bench.loss_parallel_backward(result, index, mine, grad_rows)
        return grad_x, None, None, None, None


def loss_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, mesh, axis: str = "tp",
                                ignore_index: int = -100) -> torch.Tensor:  # fmt: skip
    """Mean cross-entropy of `[tokens, V_local]` fp32 logits split over the vocabulary on `axis`
    (rank i holds entries `[i * V_local, (i + 1) * V_local)`), as torch's `loss_parallel` computes
    it and holds its buffers; `targets`: `[tokens]` class indices, `ignore_index` left out."""
    return _LossParallel.apply(local_logits, targets, mesh, axis, ignore_index)[0]
