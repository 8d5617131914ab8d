"""A fused RMSNorm kernel as the planner sees it: one operator forward, one backward.

torchtitan's `norm_type = "fused_rmsnorm"` (the Triton kernel of `torchtitan/models/norms.py`,
what its 2024 A100 configurations of Llama 3 8B and Llama 2 13B ran, `train_configs/*.toml`)
reads its input once and writes its output and the inverse RMS once; its backward reads the
gradient, the input, the weight and the saved inverse RMS and writes the two gradients. The
eager RMSNorm of Hugging Face's Llama (and torchtitan's `rmsnorm`) runs about seven kernels
forward (upcast, square, mean, add, rsqrt, two products, downcast) and more backward. On the
meta device `aten._fused_rms_norm` decomposes into those same kernels under a trace, so the
planner could not tell the two apart; `fs_bench::_fused_rms_norm` is an opaque operator with
a fake (meta) kernel, which `fs.analysis` prices as one memory-bound kernel by the bytes it
reads and writes (`analysis._costs`: class "normalization"). Its CPU kernel is the plain
math, so a model built with it also runs (and is checked against autograd in the tests).

    from fused_rmsnorm import fuse_rms_norms
    fuse_rms_norms(llama)   # every LlamaRMSNorm of a Hugging Face model -> FusedRMSNorm
"""

from __future__ import annotations

import torch


def _upcast(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


@torch.library.custom_op("fs_bench::_fused_rms_norm", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * weight in x's dtype, the inverse RMS in at least float32, shape (..., 1))."""
    xf = x.to(_upcast(x))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


@_fused_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=_upcast(x))


@torch.library.custom_op("fs_bench::_fused_rms_norm_backward", mutates_args=())
def _fused_rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient of x, gradient of weight) of `_fused_rms_norm`'s first output."""
    up = _upcast(x)
    xf, gf = x.to(up), grad.to(up)
    normed = xf * rstd
    grad_weight = (gf * normed).flatten(0, -2).sum(0).to(weight.dtype)
    gn = gf * weight.to(up)
    grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight


@_fused_rms_norm_backward.register_fake
def _(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


class _FusedRMSNormFunction(torch.autograd.Function):
    """The pair as one differentiable call (an `autograd.Function` with `setup_context`, so
    `torch.func` transforms, which fs's trace uses, accept it)."""

    @staticmethod
    def forward(x, weight, eps):
        return torch.ops.fs_bench._fused_rms_norm(x, weight, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight, output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, grad, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.fs_bench._fused_rms_norm_backward(grad, x, weight, rstd)
        return grad_x, grad_weight, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension, scaled by `weight`, as one fused kernel."""
    return _FusedRMSNormFunction.apply(x, weight, eps)[0]


class FusedRMSNorm(torch.nn.Module):
    """A drop-in for a Hugging Face `LlamaRMSNorm` (the same `weight` parameter)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Replace every `LlamaRMSNorm` of `model` by a `FusedRMSNorm` sharing its weight; returns
    how many were replaced."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LlamaRMSNorm):
                setattr(module, name, FusedRMSNorm(child.weight, child.variance_epsilon))
                replaced += 1
    return replaced
