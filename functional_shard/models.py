"""Small reference models used by the tests, examples and benchmarks.

These are plain ``torch.nn.Module`` s with no dependence on the rest of the
library. Each one exercises a feature that sharding has to get right:

* :class:`MLP`: the simplest stack of ``blocks``.
* :class:`SmallCNN`: frozen parameters (``requires_grad=False``) and BatchNorm
  buffers (``running_mean``, ``running_var``, ``num_batches_tracked``).
* :class:`GPT`: a weight tied between the token embedding and the output head,
  so ``named_parameters()`` lists it once and ``state_dict()`` under two names
  (``GPTConfig(tie_weights=False)`` unties them).

All forwards are written to run under ``torch.func.functional_call`` and
``torch.func.grad``: no in-place updates of parameters, no ``.item()``, and no
Python branching on tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = ["MLP", "SmallCNN", "GPTConfig", "GPT"]


class ResidualBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` on float tensors of shape ``(..., d_model)``."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class MLP(nn.Module):
    """A multilayer perceptron: input projection, residual blocks, output projection.

    Parameters: ``input_proj.{weight,bias}``, ``blocks.{i}.fc1.{weight,bias}``,
    ``blocks.{i}.fc2.{weight,bias}``, ``output_proj.{weight,bias}``.

    The blocks work at width ``d_hidden`` and expand to ``2 * d_hidden`` inside.
    """

    def __init__(self, d_in: int, d_hidden: int, d_out: int, n_blocks: int) -> None:
        super().__init__()
        self.input_proj = nn.Linear(d_in, d_hidden)
        self.blocks = nn.ModuleList(ResidualBlock(d_hidden, 2 * d_hidden) for _ in range(n_blocks))
        self.output_proj = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map float ``(B, d_in)`` (or ``(..., d_in)``) to float ``(B, d_out)``."""
        x = self.input_proj(x)
        for block in self.blocks:
            x = block(x)
        return self.output_proj(x)


class ConvBlock(nn.Module):
    """3x3 convolution, BatchNorm, ReLU: float ``(B, C_in, H, W) -> (B, C_out, H / stride, W / stride)``."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        # No conv bias: the BatchNorm that follows has its own shift.
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


class SmallCNN(nn.Module):
    """A small image classifier with a frozen stem and BatchNorm buffers.

    Input: float ``(B, in_channels, H, W)``, e.g. ``(B, 3, 16, 16)``; any ``H, W >= 4`` works
    because of the global average pool. Output: float logits ``(B, num_classes)``.

    Trainable parameters: ``stem_norm.{weight,bias}``, ``blocks.{i}.conv.weight``,
    ``blocks.{i}.norm.{weight,bias}`` for ``i`` in 0..2, ``head.{weight,bias}``.
    Frozen parameters (``requires_grad=False``): ``stem.weight``, ``stem.bias``, a fixed
    random feature extractor as in transfer learning.
    Buffers: ``running_mean``, ``running_var``, ``num_batches_tracked`` of ``stem_norm``
    and of every ``blocks.{i}.norm``.

    In training mode the forward updates the BatchNorm buffers in place. Under
    ``torch.func.grad`` the buffers must therefore be arguments of the transformed function
    (as ``functional_call`` inputs), not tensors captured from outside it, which torch.func
    refuses to mutate.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.stem.requires_grad_(False)
        self.stem_norm = nn.BatchNorm2d(16)
        self.blocks = nn.Sequential(
            ConvBlock(16, 32, stride=2),
            ConvBlock(32, 32),
            ConvBlock(32, 64, stride=2),
        )
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_norm(self.stem(x)))
        x = self.blocks(x)
        return self.head(x.mean(dim=(2, 3)))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids.
        block_size: longest sequence the position embedding covers.
        n_layer: number of transformer blocks.
        n_head: attention heads per block; must divide ``d_model``.
        d_model: width of the residual stream.
        dropout: dropout probability on attention weights and residual branches; 0 makes
            the forward deterministic.
        bias: whether Linear and LayerNorm layers have a bias.
        tie_weights: whether the output head is the token embedding's weight (GPT-2's
            weight tying); False gives the head a weight of its own.
    """

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position ``t`` attends to positions ``<= t``.

    Float ``(B, T, d_model) -> (B, T, d_model)``. Parameters: ``qkv`` (d_model -> 3 d_model)
    and ``proj`` (d_model -> d_model).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads counted from the width (`d` fixed): a tensor-parallel rank holds n_head / tp of them.
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, d=self.head_dim)
        # Explicit masked softmax rather than scaled_dot_product_attention: the same kernels
        # run on every backend and under every torch.func transform, so results are reproducible.
        scores = torch.einsum("bhtd,bhsd->bhts", q, k) * q.shape[-1] ** -0.5
        length = x.shape[1]
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        weights = self.attn_dropout(scores.softmax(dim=-1))
        out = torch.einsum("bhts,bhsd->bhtd", weights, v)
        return self.resid_dropout(self.proj(rearrange(out, "b h t d -> b t (h d)")))


class GPTMLP(nn.Module):
    """Position-wise feed-forward layer ``d_model -> 4 d_model -> d_model`` with GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model (GPT-2 layout, pre-LayerNorm).

    Parameters (with ``bias=True``), each listed once by ``named_parameters()``:
    ``tok_emb.weight`` (vocab_size, d_model), ``pos_emb.weight`` (block_size, d_model), and
    for each block ``i``: ``blocks.{i}.ln1.{weight,bias}``, ``blocks.{i}.attn.qkv.{weight,bias}``,
    ``blocks.{i}.attn.proj.{weight,bias}``, ``blocks.{i}.ln2.{weight,bias}``,
    ``blocks.{i}.mlp.fc.{weight,bias}``, ``blocks.{i}.mlp.proj.{weight,bias}``; then
    ``ln_f.{weight,bias}``.

    ``head.weight`` is the same Parameter as ``tok_emb.weight`` (weight tying): it is absent
    from ``named_parameters()`` but present in ``state_dict()``. With ``tie_weights=False``
    it is a parameter of its own, listed last. The head has no bias.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual output projections by 1/sqrt(2 n_layer) so the residual
        # stream's variance does not grow with depth.
        for name, parameter in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = False) -> int:
        """Number of distinct parameter elements (the tied weight counted once).

        With ``non_embedding=True`` the position embedding is left out, as GPT-2 reports it;
        the token embedding stays in (tied, it doubles as the output head).
        """
        total = sum(parameter.numel() for parameter in self.parameters())
        if non_embedding:
            total -= self.pos_emb.weight.numel()
        return total

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map int64 token ids ``(B, T)`` with ``T <= block_size`` to float logits ``(B, T, vocab_size)``."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend int64 ids ``(B, T0)`` to ``(B, T0 + max_new_tokens)`` one token at a time.

        ``temperature == 0`` decodes greedily; otherwise tokens are sampled from the softmax of
        ``logits / temperature`` using ``generator``. Only the last ``block_size`` ids are fed
        back, so the output may be longer than ``block_size``. Call ``eval()`` first if the
        model has dropout.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :]
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = (logits / temperature).softmax(dim=-1)
                next_id = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx
