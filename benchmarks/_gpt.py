"""What the GPT benchmarks share: the model on the shipped corpus, and MemTracker's CPU peak."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs
from functional_shard.data import CharTokenizer, load_text
from functional_shard.models import GPT, GPTConfig


def corpus_gpt(n_layer: int, d_model: int, *, block_size: int = 64) -> tuple[torch.Tensor, GPTConfig, Any, Callable]:
    """(the corpus as tokens, the GPT's config, its parameters, `loss_fn(params, (x, y))`), seed 0."""
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=n_layer, n_head=4, d_model=d_model)
    apply_fn, params = fs.functionalize(GPT(config))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1).float(), y.flatten())

    return tokenizer.encode(text), config, params, loss_fn


def cpu_total(tracker: MemTracker, kind: str = "peak") -> int:
    """MemTracker's 'Total' bytes on the CPU for `kind` ("peak" or "current")."""
    for device, categories in tracker.get_tracker_snapshot(kind).items():
        if torch.device(device).type == "cpu":
            return int(next((v for k, v in categories.items() if str(getattr(k, "value", k)) == "Total"), 0))
    return 0
