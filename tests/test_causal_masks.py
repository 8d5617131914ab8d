"""`fs.Schedule(causal_masks=True)` (default): attention whose mask the trace built from
constants and which is exactly causal runs with `is_causal=True`, as the eager step runs it.

- a Hugging Face Llama with `use_cache=False` on a batch without padding: traced, the model
  builds its causal mask as a tensor (it cannot read values under fake tensors); the step's
  graph has no mask left, `is_causal=True`, and gives the eager step's bits; with
  `causal_masks=False` the masks stay;
- a batch with padding: the mask is computed from the batch, and stays;
- a hand-written model: a constant causal mask, boolean or additive (0 / -inf, made out of
  place or written in place through a view), becomes
  `is_causal=True` with the bits of a model that asks for `is_causal=True`; a constant mask
  that is not causal (a band) stays.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.schedule._causal import _argument

VOCAB, LENGTH = 61, 16
ATTENTION = "flash_attention_for_cpu"


def attention_nodes(step) -> list:
    gm = step.cache[next(iter(step.cache))].graph_module
    return [n for n in gm.graph.nodes if ATTENTION in str(n.target)]


def masked(node) -> bool:
    return _argument(node, "attn_mask") is not None


def causal(node) -> bool:
    return bool(_argument(node, "is_causal"))


def train(loss_fn, params, mesh, schedule, batches):
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-3, weight_decay=0.1), schedule=schedule)
    state, losses = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return step, state, losses


def same_bits(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(fs.tree_leaves((a.params, a.opt_state)), fs.tree_leaves((b.params, b.opt_state))))


def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LENGTH, attn_implementation="sdpa", use_cache=False,
        pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return fs.functionalize(transformers.LlamaForCausalLM(config))


def llama_loss(apply_fn):
    def loss(p, batch):
        ids, mask = batch
        logits = apply_fn(p, input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        labels = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)

    return loss


def batches(padded: bool):
    out = []
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, VOCAB, (3, LENGTH), generator=g)
        mask = None
        if padded:
            mask = (torch.arange(LENGTH)[None, :] < torch.tensor([[LENGTH], [9], [5]])).long()
            ids = ids.masked_fill(mask == 0, 0)
        out.append((ids, mask))
    return out


def test_hugging_face_causal_mask_runs_as_is_causal_with_the_eager_bits():
    apply_fn, params = llama()
    loss = llama_loss(apply_fn)
    with fs.init_mesh({"fsdp": 1}, backend="gloo") as mesh:
        _, eager, eager_losses = train(loss, params, mesh, fs.Schedule(trace=False), batches(False))
        step, traced, traced_losses = train(loss, params, mesh, fs.Schedule(), batches(False))
        nodes = attention_nodes(step)
        assert nodes and all(causal(n) and not masked(n) for n in nodes), [(n.args, n.kwargs) for n in nodes]
        assert "-> is_causal=True" in step.explain()
        assert all(torch.equal(a, b) for a, b in zip(eager_losses, traced_losses)) and same_bits(eager, traced)
        kept, _, _ = train(loss, params, mesh, fs.Schedule(causal_masks=False), batches(False))
        assert all(masked(n) and not causal(n) for n in attention_nodes(kept))
        padded, _, _ = train(loss, params, mesh, fs.Schedule(), batches(True))
        assert all(masked(n) for n in attention_nodes(padded))  # the batch's padding: kept


def tiny_attention(mask_kind: str):
    """A one-layer attention model with a constant mask (or is_causal) built in its forward."""
    torch.manual_seed(1)
    params = {"qkv": torch.randn(3 * 16, 16) * 0.2, "out": torch.randn(16, 16) * 0.2, "emb": torch.randn(VOCAB, 16)}

    def forward(p, ids):
        x = p["emb"][ids]
        q, k, v = (x @ p["qkv"].t()).view(ids.shape[0], LENGTH, 3, 2, 8).permute(2, 0, 3, 1, 4)
        positions = torch.arange(LENGTH)
        if mask_kind == "is_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            allowed = positions[None, :] <= positions[:, None]
            if mask_kind == "band":
                allowed = allowed & (positions[:, None] - positions[None, :] < 4)
            if mask_kind == "in_place":  # filled in place, through a view: as torch pads an attention bias
                mask = torch.empty(LENGTH, LENGTH)
                mask.fill_(0.0)
                mask[:].masked_fill_(~allowed, float("-inf"))
            else:
                mask = allowed if mask_kind != "additive" else torch.zeros(LENGTH, LENGTH).masked_fill(~allowed, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).reshape(ids.shape[0], LENGTH, 16) @ p["out"].t()
        return F.cross_entropy((y @ p["emb"].t()).reshape(-1, VOCAB), torch.roll(ids, -1, 1).reshape(-1))

    return params, lambda p, b: forward(p, b[0])


@pytest.mark.parametrize("kind", ["boolean", "additive", "in_place", "band"])
def test_constant_masks(kind):
    data = [(torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(i)),) for i in range(2)]
    with fs.init_mesh({"fsdp": 1}, backend="gloo") as mesh:
        params, loss = tiny_attention(kind)
        step, state, losses = train(loss, params, mesh, fs.Schedule(), data)
        nodes = attention_nodes(step)
        assert len(nodes) == 2  # forward and backward
        if kind == "band":  # not causal: kept as traced, the eager step's bits
            assert all(masked(n) and not causal(n) for n in nodes)
            assert "kept (not the causal pattern)" in step.explain()
            _, eager, _ = train(loss, params, mesh, fs.Schedule(trace=False), data)
            assert same_bits(state, eager)
            return
        assert all(causal(n) and not masked(n) for n in nodes), step.cache[next(iter(step.cache))].graph_module.meta
        gm = step.cache[next(iter(step.cache))].graph_module
        assert not any(n.target is torch.ops.aten.arange.start for n in gm.graph.nodes if not n.users)
        params, is_causal = tiny_attention("is_causal")
        _, reference, reference_losses = train(is_causal, params, mesh, fs.Schedule(trace=False), data)
        assert same_bits(state, reference) and all(torch.equal(a, b) for a, b in zip(losses, reference_losses))


def test_schedule_refuses_a_non_bool():
    with pytest.raises(ValueError, match="causal_masks"):
        fs.Schedule(causal_masks="yes")
