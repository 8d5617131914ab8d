"""The models, batches and losses that every arm of `compare.py` trains on.

Everything here is deterministic: a model is built from a seed, and a batch is a pure function
of (seed, rank, step), so every arm (and the single-process reference, which rebuilds every
rank's batch to concatenate them) sees exactly the same data.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from functional_shard.data import CharTokenizer, batches, load_text
from functional_shard.models import GPT, MLP, GPTConfig

MODELS = ("mlp", "gpt", "gpt-large")
# The full run's default: the two small models (gpt-large is the scale run, ~10 min at world size 2).
DEFAULT_MODELS = ("mlp", "gpt")

# MLP: `functional_shard.models.MLP(256, 256, 256, n_blocks=8)` (blocks 256 -> 512 -> 256).
MLP_WIDTH = 256
MLP_BLOCKS = 8
# GPT: 8 layers, 4 heads, d_model 256, sequence 128, character vocabulary of the shipped corpus,
# output head untied from the token embedding.
GPT_LAYERS = 8
GPT_HEADS = 4
GPT_WIDTH = 256
GPT_SEQUENCE = 128
# gpt-large: the same GPT at d_model 1024, 16 heads: 8 x 12 x 1024^2 + embeddings, about 101M
# parameters (the scale point: >= 100M).
GPT_LARGE_WIDTH = 1024
GPT_LARGE_HEADS = 16


@dataclass(frozen=True)
class Workload:
    """One model family: how to build it, draw a rank's batch, and score its output."""

    name: str

    def build(self, seed: int) -> nn.Module:
        """The model with the initial weights of `seed` (identical on every rank)."""
        torch.manual_seed(seed)
        if self.name == "mlp":
            return MLP(MLP_WIDTH, MLP_WIDTH, MLP_WIDTH, n_blocks=MLP_BLOCKS)
        if self.name in ("gpt", "gpt-large"):
            large = self.name == "gpt-large"
            config = GPTConfig(
                vocab_size=_tokenizer().vocab_size,
                block_size=GPT_SEQUENCE,
                n_layer=GPT_LAYERS,
                n_head=GPT_LARGE_HEADS if large else GPT_HEADS,
                d_model=GPT_LARGE_WIDTH if large else GPT_WIDTH,
            )
            model = GPT(config)
            # Untied: the output head gets its own copy of the token embedding's initial weights.
            # SimpleFSDP cannot shard a tied weight, and every arm must train the same model.
            model.head.weight = nn.Parameter(model.tok_emb.weight.detach().clone())
            return model
        raise ValueError(f"unknown model {self.name!r}; expected one of {MODELS}")

    def batch(self, batch_size: int, *, seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s batch at step `step`: `(inputs, targets)`, a pure function of its arguments."""
        # One generator per (seed, step, rank): any process can rebuild any rank's batch.
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
        if self.name == "mlp":
            inputs = torch.randn(batch_size, MLP_WIDTH, generator=generator)
            # A fixed random teacher gives a learnable regression target.
            return inputs, torch.tanh(inputs @ _teacher(seed))
        return batches(_tokens(), batch_size, GPT_SEQUENCE, generator=generator)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss over the batch: equal per-rank batches make the mean of the ranks' losses
        the loss of the concatenated batch, which is what the single-process reference trains."""
        if self.name == "mlp":
            return F.mse_loss(output, targets)
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """The repeated blocks (the units FSDP2 wraps one by one, as fs does by default)."""
        return list(model.blocks)


@functools.lru_cache(maxsize=None)
def _teacher(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 17)
    return torch.randn(MLP_WIDTH, MLP_WIDTH, generator=generator) / MLP_WIDTH**0.5


@functools.lru_cache(maxsize=None)
def _tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(load_text())


@functools.lru_cache(maxsize=None)
def _tokens() -> torch.Tensor:
    return _tokenizer().encode(load_text())


def num_params(model: nn.Module) -> int:
    """Ψ: trainable parameter elements, a tied weight counted once."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
