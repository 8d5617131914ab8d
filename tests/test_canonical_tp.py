"""Layout invariance and tensor parallelism (issue 28).

- At a fixed `tp` degree, `canonical_chunks` makes training independent of the data-parallel
  layout: `fs.models.GPT` (dropout: on the rank's own heads drawn per `tp` rank, elsewhere the
  same on both; vocabulary-parallel embedding and loss, clipping, AdamW)
  at `{"fsdp": 1, "tp": 2}` and `{"fsdp": 2, "tp": 2}` gives the same parameters and losses,
  bit for bit. The tensor-parallel collectives see the same operands at both layouts (each
  data rank's chunks are computed alone, with the same shapes), so only the data-parallel
  sums could differ, and those follow the canonical tree.

- Across `tp` degrees (`tensor_parallel/_canonical_k.py`, a prototype): with every split
  dimension cut in `blocks` canonical blocks (`parallelize_canonical`, its
  `vocab_parallel_cross_entropy`), a Megatron MLP, a fused q|k|v projection and the
  vocabulary-parallel loss give the same loss and gradients, bit for bit, at `tp` 1, 2 and 4
  (thread meshes, against the plain ops to 1e-6), and GPT training (no dropout, AdamW without
  clipping) gives the same parameters and losses at `{"tp": 1}`, `{"tp": 2}`, `{"tp": 4}` and
  `{"fsdp": 2, "tp": 2}` (gloo processes, eager and traced); so does a Hugging Face Llama by its
  own plan at tp 1 and 2 (slow). Without the canonical cut every
  leaf differs after one step (~1e-7 relative in the gradients, 1e-3 of a leaf's scale in the
  parameters after AdamW). Clipping (the global norm sums squares over each rank's buffer of
  pieces) and dropout on local heads still depend on the degree.

Every rank pins one thread before it builds the step (`torch.set_num_threads(1)`): the thread
count changes how kernels split their sums.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig
from functional_shard.tensor_parallel import _canonical_k as canonical_k

GPT_CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, d_model=32, dropout=0.1)
ROWS, LENGTH = 8, 12  # the global batch


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, GPT_CONFIG.vocab_size, (ROWS, LENGTH), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def train_gpt(_, axes: dict[str, int], chunks: int, steps: int, trace: bool = False):
    """`steps` of GPT at `axes` with `canonical_chunks=chunks`; rank 0 returns the full
    parameters, per-step losses and grad norms."""
    torch.set_num_threads(1)
    mesh = fs.init_mesh(axes)
    torch.manual_seed(0)
    rules = tp.gpt_rules(GPT_CONFIG)
    apply_fn, params = fs.functionalize(tp.parallelize(GPT(GPT_CONFIG), rules, mesh))

    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(1e-2, weight_decay=0.1))
    step = fs.sharded_step(
        loss_fn, mesh, optimizer=optimizer, placements=rules, canonical_chunks=chunks, schedule=fs.Schedule(trace=trace)
    )
    state = step.init(params)
    per = ROWS // mesh.data_size
    first = mesh.data_rank * per
    losses, norms = [], []
    for i in range(steps):
        state, metrics = step(state, tuple(t[first : first + per] for t in global_batch(i)))
        losses.append(metrics["loss"].clone())
        norms.append(metrics["grad_norm"].clone())
    full = fs.gather(state.params, full=True)
    if mesh.rank != 0:
        return None
    return {"params": {k: full[k].clone() for k in full.trainable}, "losses": losses, "norms": norms}


def test_fixed_tp_degree_is_invariant_across_data_parallel_layouts(local_world):
    one = local_world(2).run(train_gpt, {"fsdp": 1, "tp": 2}, 4, 3)[0]
    two = local_world(4).run(train_gpt, {"fsdp": 2, "tp": 2}, 4, 3)[0]
    traced = local_world(4).run(train_gpt, {"fsdp": 2, "tp": 2}, 4, 3, True)[0]
    for other in (two, traced):
        assert one["params"].keys() == other["params"].keys()
        differ = [k for k in one["params"] if not torch.equal(one["params"][k], other["params"][k])]
        assert not differ, differ
        assert all(torch.equal(a, b) for a, b in zip(one["losses"], other["losses"])), (one["losses"], other["losses"])
        assert all(torch.equal(a, b) for a, b in zip(one["norms"], other["norms"])), (one["norms"], other["norms"])


# --- the canonical cut across tp degrees ----------------------------------------------------------

BLOCKS = 4
M, D, HIDDEN, VOCAB = 17, 24, 96, 40  # tokens, width, MLP hidden size, vocabulary: awkward sizes


def _weights():
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(M, D, generator=g),
        "qkv.weight": torch.randn(3 * D, D, generator=g) * 0.1,
        "qkv.bias": torch.randn(3 * D, generator=g) * 0.1,
        "out.weight": torch.randn(D, D, generator=g) * 0.1,
        "fc.weight": torch.randn(HIDDEN, D, generator=g) * 0.1,
        "fc.bias": torch.randn(HIDDEN, generator=g) * 0.1,
        "proj.weight": torch.randn(D, HIDDEN, generator=g) * 0.1,
        "proj.bias": torch.randn(D, generator=g) * 0.1,
        "head.weight": torch.randn(VOCAB, D, generator=g) * 0.1,
        "targets": torch.randint(0, VOCAB, (M,), generator=g),
    }


PLACEMENTS = {
    "qkv.weight": tp.Split(0, "tp", chunks=3),
    "qkv.bias": tp.Split(0, "tp", chunks=3),
    "out.weight": tp.Split(1, "tp"),
    "fc.weight": tp.Split(0, "tp"),
    "fc.bias": tp.Split(0, "tp"),
    "proj.weight": tp.Split(1, "tp"),
    "head.weight": tp.Split(0, "tp"),
}


def _block_loss(mesh, w, canonical: bool):
    """A Megatron block on this rank's pieces: fused q|k|v (column-parallel, chunks=3) mixed per
    "head" and projected back (row-parallel), an MLP (column- then row-parallel), a
    vocabulary-parallel head and loss; in canonical blocks or with the ordinary collectives."""
    n = BLOCKS // mesh.shape["tp"]

    def column(x, name, chunks):
        weight, bias = w[name + ".weight"], w.get(name + ".bias")
        if canonical:
            return canonical_k._column(x, weight, bias, n, chunks, mesh, "tp")
        return F.linear(tp.copy_to(x, mesh, "tp"), weight, bias)

    def row(x, name):
        if canonical:
            return canonical_k._row(x, w[name + ".weight"], n, 1, mesh, "tp")
        return tp.reduce_from(F.linear(x, w[name + ".weight"]), mesh, "tp")

    x = w["x"]
    q, k, v = column(x, "qkv", 3).chunk(3, dim=-1)  # this rank's "heads"
    x = x + row(q * k - v, "out")
    x = x + row(F.gelu(column(x, "fc", 1)), "proj") + w["proj.bias"]
    logits = column(torch.tanh(x), "head", 1)
    if canonical:
        return canonical_k.vocab_parallel_cross_entropy(logits, w["targets"], mesh, "tp", blocks=BLOCKS)
    return tp.vocab_parallel_cross_entropy(logits, w["targets"], mesh, "tp")


def _block_on_rank(mesh, canonical: bool):
    """This rank's loss and the gradients of x and of its pieces, joined over tp."""
    torch.set_num_threads(1)
    full = _weights()
    size, index = mesh.shape["tp"], mesh.coordinates["tp"]
    w = {k: (tp.split_tensor(t, PLACEMENTS[k], index, size) if k in PLACEMENTS else t) for k, t in full.items()}
    leaves = {k: t.clone().requires_grad_() for k, t in w.items() if t.is_floating_point()}
    loss = _block_loss(mesh, {**w, **leaves}, canonical)
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    return loss.detach(), {k: tp.gather_leaf(g, PLACEMENTS.get(k, tp.Replicated()), mesh) for k, g in grads.items()}


def _reference():
    """The block on whole tensors with plain ops (F.linear, F.cross_entropy)."""
    w = {k: (t.clone().requires_grad_() if t.is_floating_point() else t) for k, t in _weights().items()}
    x = w["x"]
    q, k, v = F.linear(x, w["qkv.weight"], w["qkv.bias"]).chunk(3, dim=-1)
    x = x + F.linear(q * k - v, w["out.weight"])
    x = x + F.linear(F.gelu(F.linear(x, w["fc.weight"], w["fc.bias"])), w["proj.weight"], w["proj.bias"])
    loss = F.cross_entropy(F.linear(torch.tanh(x), w["head.weight"]), w["targets"])
    leaves = {k: t for k, t in w.items() if t.is_floating_point()}
    return loss.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _threads(fn):
    threads = torch.get_num_threads()
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "ordinary"])
def test_a_block_gives_the_same_bits_at_every_tp_degree_with_canonical_blocks(canonical):
    """Canonical: loss and every gradient equal at tp 1, 2 and 4 (thread meshes), and equal to the
    plain ops to 1e-6. Ordinary collectives: at 2 and 4 the bits move (the check's failing side)."""
    runs = {
        size: _threads(lambda: fs.testing.SimulatedWorld(size, axes={"tp": size}).run(_block_on_rank, canonical)[0])
        for size in (1, 2, 4)
    }
    loss, grads = runs[1]
    ref_loss, ref_grads = _threads(_reference)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-6, msg=k)
    for size in (2, 4):
        other_loss, other = runs[size]
        same = torch.equal(other_loss, loss) and all(torch.equal(other[k], grads[k]) for k in grads)
        assert same == canonical, (size, {k: float((other[k] - grads[k]).abs().max()) for k in grads})


def test_canonical_blocks_refuse_a_degree_they_cannot_reproduce():
    class Mesh:
        axis_names, shape, coordinates = ("tp",), {"tp": 8}, {"tp": 0}

    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, d_model=32))
    with pytest.raises(ValueError, match=r"blocks=4 cannot give the same bits at tp=8.*\[1, 2, 4\]"):
        canonical_k.parallelize_canonical(model, tp.gpt_rules(model.config), Mesh(), blocks=4)
    with pytest.raises(ValueError, match="power of two"):
        canonical_k.parallelize_canonical(model, tp.gpt_rules(model.config), Mesh(), blocks=6)
    with pytest.raises(tp.PlacementError, match="tok_emb.weight"):  # 32 rows cannot be cut in 64 blocks
        canonical_k.parallelize_canonical(model, tp.gpt_rules(model.config), Mesh(), blocks=64)


def train_gpt_canonical_blocks(_, axes: dict[str, int], steps: int, trace: bool = False):
    """`steps` of GPT (no dropout) at `axes` with every tp-split dimension in BLOCKS canonical
    blocks and `canonical_chunks=4`; rank 0 returns the full parameters and per-step losses."""
    torch.set_num_threads(1)
    mesh = fs.init_mesh(axes)
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, d_model=32)
    torch.manual_seed(0)
    rules = tp.gpt_rules(config)
    apply_fn, params = fs.functionalize(canonical_k.parallelize_canonical(GPT(config), rules, mesh, blocks=BLOCKS))

    def loss_fn(p, batch):
        ids, targets = batch
        logits = apply_fn(p, ids).flatten(0, 1)
        return canonical_k.vocab_parallel_cross_entropy(logits, targets.flatten(), mesh, "tp", blocks=BLOCKS)

    optimizer = fs.optim.adamw(1e-2, weight_decay=0.1)
    schedule = fs.Schedule(trace=trace)
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, placements=rules, canonical_chunks=4, schedule=schedule)
    state = step.init(params)
    per = ROWS // mesh.data_size
    first = mesh.data_rank * per
    losses = []
    for i in range(steps):
        state, metrics = step(state, tuple(t[first : first + per] for t in global_batch(i)))
        losses.append(metrics["loss"].clone())
    full = fs.gather(state.params, full=True)
    if mesh.rank != 0:
        return None
    return {"params": {k: full[k].clone() for k in full.trainable}, "losses": losses}


def _assert_same(runs: dict) -> None:
    one = runs.pop("tp1")
    for name, other in runs.items():
        differ = [k for k in one["params"] if not torch.equal(one["params"][k], other["params"][k])]
        assert not differ, (name, differ)
        same = all(torch.equal(a, b) for a, b in zip(one["losses"], other["losses"]))
        assert same, (name, one["losses"], other["losses"])


@pytest.mark.slow  # the prototype's training at tp 1 and 2 (~6 s); its law on thread meshes stays in the suite
def test_gpt_trains_alike_at_tp_1_and_2_with_canonical_blocks(local_world):
    _assert_same({
        "tp1": local_world(1).run(train_gpt_canonical_blocks, {"tp": 1}, 2)[0],
        "tp2": local_world(2).run(train_gpt_canonical_blocks, {"tp": 2}, 2)[0],
        "fsdp2xtp2 traced": local_world(4).run(train_gpt_canonical_blocks, {"fsdp": 2, "tp": 2}, 2, True)[0],
    })  # fmt: skip


@pytest.mark.slow
def test_gpt_trains_alike_at_tp_1_2_and_4_with_canonical_blocks_for_5_steps(local_world):
    _assert_same({
        "tp1": local_world(1).run(train_gpt_canonical_blocks, {"tp": 1}, 5)[0],
        "tp2 traced": local_world(2).run(train_gpt_canonical_blocks, {"tp": 2}, 5, True)[0],
        "tp4": local_world(4).run(train_gpt_canonical_blocks, {"tp": 4}, 5)[0],
        "tp4 traced": local_world(4).run(train_gpt_canonical_blocks, {"tp": 4}, 5, True)[0],
    })  # fmt: skip


def train_llama_canonical_blocks(_, axes: dict[str, int], steps: int):
    """A Hugging Face Llama (grouped-query attention, right padding, -100 labels, fs.WeightedLoss)
    by its own plan, every split dimension in 2 canonical blocks (2 key/value heads: tp <= 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    mesh = fs.init_mesh(axes)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    rules = tp.hf_rules(model)
    apply_fn, params = fs.functionalize(canonical_k.parallelize_canonical(model, rules, mesh, blocks=2))

    def loss_fn(p, batch):
        ids, mask, labels = batch
        logits = apply_fn(p, input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        targets = labels[:, 1:].reshape(-1)
        count = (targets != -100).sum()
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=-100, reduction="sum")
        return fs.WeightedLoss(total / count, count)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), placements=rules, canonical_chunks=2)
    state = step.init(params)
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(700 + i)
        ids = torch.randint(3, 64, (4, 12), generator=g)
        lengths = torch.randint(3, 12, (4,), generator=g)
        mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 2)
        state, metrics = step(state, (ids, mask, ids.masked_fill(mask == 0, -100)))
        losses.append(metrics["loss"].clone())
    full = fs.gather(state.params, full=True)
    if mesh.rank != 0:
        return None
    return {"params": {k: full[k].clone() for k in full.trainable}, "losses": losses}


@pytest.mark.slow
def test_llama_by_its_own_plan_trains_alike_at_tp_1_and_2_with_canonical_blocks(local_world):
    pytest.importorskip("transformers")
    _assert_same({
        "tp1": local_world(1).run(train_llama_canonical_blocks, {"tp": 1}, 3)[0],
        "tp2": local_world(2).run(train_llama_canonical_blocks, {"tp": 2}, 3)[0],
    })  # fmt: skip
