"""Sequence parallelism (issue 26, items 3-5): `fs.tensor_parallel.parallelize(..., sequence_parallel=True)`.

On 2 gloo processes at `{"tp": 2}` (4 at `{"fsdp": 2, "tp": 2}`, slow):

- Hugging Face `LlamaForCausalLM` (sdpa, grouped-query attention, right padding, `-100` labels)
  by its own plan and `fs.models.GPT` by `gpt_rules` (vocabulary-parallel, and with a replicated
  embedding and head) equal single-process training: loss and first-step gradients to 1e-5;
  traced == eager bit for bit after steps of AdamW.
- Dropout: a GPT with dropout 0.1 equals single-process training with the step's seed (the same
  masks); masks are identical across `tp` ranks where activations are replicated (the embedding
  dropout before the blocks) and different on sequence slices, whose masks put together are the
  single-process mask.
- Activation memory: the activations saved between the blocks' matmuls (norms, residual
  dropout, the column-parallel matmuls' inputs) are `tp` times smaller per block.
- Errors: a sequence not divisible by `tp`, no blocks or several, a row-parallel Linear after
  them, each before anything changes.
- Slow: GPT with a replicated embedding and head, GPT at `{"fsdp": 2, "tp": 2}`, the memory at
  `tp=4`, Qwen2 (split q/k/v biases) with 2 micro-batches and `step.evaluate`.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

VOCAB = 64
LENGTH = 12
LR = 1e-2
STEPS = 2


# --- models and data ----------------------------------------------------------------------------


def build_llama(layers: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def llama_batch(step: int):
    """(ids, mask, labels): 2 rows, right padding, -100 labels."""
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(3, VOCAB, (2, LENGTH), generator=g)
    lengths = torch.tensor([LENGTH, 7])
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 2)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def llama_loss(logits, labels):
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


def gpt_config(dropout: float = 0.0, layers: int = 2, length: int = 16, d_model: int = 32) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=length, n_layer=layers, n_head=4, d_model=d_model, dropout=dropout)


def build_gpt(config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(config)


def gpt_batch(step: int, length: int = LENGTH):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (2, length), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def relative_errors(got: dict, want: dict) -> dict:
    return {k: float((got[k] - w).norm() / w.norm()) for k, w in want.items()}


def same_tree(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(fs.tree_leaves(a), fs.tree_leaves(b)))


# --- rank functions (module level: they pickle) ---------------------------------------------------


def train_sequence_parallel(_, axes: dict, kind: str, dropout: float = 0.0, vocab_parallel: bool = True):
    """First-step gradient (full leaves) and loss, eager; traced == eager after STEPS AdamW steps."""
    mesh = fs.init_mesh(axes)
    report = {}
    states = {}
    for trace in (False, True):
        if kind == "llama":
            model = build_llama()
            rules = tp.hf_rules(model)
        else:
            model = build_gpt(gpt_config(dropout))
            rules = tp.gpt_rules(model.config, vocab_parallel=vocab_parallel)
        apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh, sequence_parallel=True))

        if kind == "llama":

            def loss_fn(p, batch):
                ids, mask, labels = batch
                return llama_loss(apply_fn(p, input_ids=ids, attention_mask=mask).logits, labels)

            batches = [llama_batch(i) for i in range(STEPS)]
        else:

            def loss_fn(p, batch):
                logits = apply_fn(p, batch[0]).flatten(0, 1)
                if vocab_parallel:
                    return tp.vocab_parallel_cross_entropy(logits, batch[1].flatten(), mesh, "tp")
                return F.cross_entropy(logits, batch[1].flatten())

            batches = [gpt_batch(i) for i in range(STEPS)]
        step = fs.sharded_step(
            loss_fn, mesh, optimizer=fs.optim.adamw(LR), placements=rules, schedule=fs.Schedule(trace=trace)
        )
        state = step.init(params)
        if not trace:
            grads, metrics = step.grad(state, batches[0])
            full = fs.gather(grads, full=True)
            report["grads"] = {k: full[k] for k in full.trainable}
            report["loss"] = float(metrics["loss"])
        for batch in batches:
            state, _ = step(state, batch)
        states[trace] = state
    report["traced_equals_eager"] = same_tree(states[True], states[False])
    return report if mesh.rank == 0 else None


def single_process(_, kind: str, dropout: float = 0.0):
    """The unparallelized model's first-step gradient and loss from fs's step at one rank (the same seed)."""
    model = build_llama() if kind == "llama" else build_gpt(gpt_config(dropout))
    apply_fn, params = fs.functionalize(model)
    if kind == "llama":
        batch = llama_batch(0)

        def loss_fn(p, batch):
            return llama_loss(apply_fn(p, input_ids=batch[0], attention_mask=batch[1]).logits, batch[2])
    else:
        batch = gpt_batch(0)

        def loss_fn(p, batch):
            return F.cross_entropy(apply_fn(p, batch[0]).flatten(0, 1), batch[1].flatten())

    step = fs.sharded_step(loss_fn, _, optimizer=fs.optim.adamw(LR), schedule=fs.Schedule(trace=False))
    grads, metrics = step.grad(step.init(params), batch)
    full = fs.gather(grads)
    return {"grads": {k: full[k] for k in full.trainable}, "loss": float(metrics["loss"])}


def dropout_masks(_):
    """Masks drawn by a replicated dropout (the embedding's, before the blocks) and a dropout on
    sequence slices (a block's), on ones, from the same stream on every rank."""
    mesh = fs.init_mesh({"tp": 2})
    model = build_gpt(gpt_config(dropout=0.5))
    tp.parallelize(model, tp.gpt_rules(model.config), mesh, sequence_parallel=True)
    model.train()
    with torch.random.fork_rng():
        torch.manual_seed(7)
        replicated = model.dropout(torch.ones(2, 8, 32))
        sliced = model.blocks[0].mlp.dropout(torch.ones(2, 4, 32))
    everyone = [torch.empty_like(sliced) for _ in range(2)]
    torch.distributed.all_gather(everyone, sliced)  # the world is the tp axis
    replicas = [torch.empty_like(replicated) for _ in range(2)]
    torch.distributed.all_gather(replicas, replicated)
    return {"slices": everyone, "replicas": replicas} if mesh.rank == 0 else None


def saved_between_blocks(_, tp_size: int):
    """Bytes per block the forward saves for the backward, by where: modules between the blocks'
    matmuls (norms, residual dropout, the column-parallel matmuls' inputs) and the rest, with and
    without sequence parallelism (blocks counted as the difference of a 3- and a 1-block GPT)."""
    mesh = fs.init_mesh({"tp": tp_size})
    out = {}
    for sequence_parallel in (False, True):
        per_layers = {}
        for layers in (1, 3):
            model = build_gpt(gpt_config(dropout=0.1, layers=layers, length=64, d_model=64))
            rules = tp.gpt_rules(model.config)
            tp.parallelize(model, rules, mesh, sequence_parallel=sequence_parallel)
            apply_fn, params = fs.functionalize(model)
            step = fs.sharded_step(lambda p, b: 0, mesh, optimizer=fs.optim.sgd(0.1), placements=rules)
            pieces = fs.tree_map(lambda t: t.detach().requires_grad_(), fs.gather(step.init(params).params))
            per_layers[layers] = saved_by_place(model, apply_fn, pieces, gpt_batch(0, 64)[0])
        out[sequence_parallel] = {k: (per_layers[3][k] - per_layers[1][k]) / 2 for k in per_layers[3]}
    return out if mesh.rank == 0 else None


def saved_by_place(model: nn.Module, apply_fn, pieces, ids) -> collections.Counter:
    """Bytes of the storages the forward saves (parameters left out), by the kind of module
    running when each was first saved (measurement only: forward hooks track the running module)."""
    stack = ["other"]
    handles = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.LayerNorm) or (isinstance(module, nn.Dropout) and leaf != "attn_dropout"):
            place = "between"
        elif isinstance(module, nn.Linear) and leaf in ("qkv", "fc"):
            place = "between"  # what a column-parallel matmul saves is its input
        else:
            place = "other"
        handles.append(module.register_forward_pre_hook(lambda m, a, place=place: stack.append(place) and None))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    parameters = {t.untyped_storage().data_ptr() for t in fs.tree_leaves(pieces)}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen.setdefault(storage.data_ptr(), (storage.nbytes(), stack[-1]))
        return t

    model.train()
    with torch.random.fork_rng(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        apply_fn(pieces, ids)
    for handle in handles:
        handle.remove()
    total = collections.Counter({"between": 0, "other": 0})
    for nbytes, place in seen.values():
        total[place] += nbytes
    return total


def refusals(_):
    """The errors sequence parallelism gives, as (type, message) pairs."""
    mesh = fs.init_mesh({"tp": 2})
    out = {}
    model = build_gpt(gpt_config())
    rules = tp.gpt_rules(model.config, vocab_parallel=False)
    apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh, sequence_parallel=True))
    step = fs.sharded_step(
        lambda p, b: F.cross_entropy(apply_fn(p, b[0]).flatten(0, 1), b[1].flatten()),
        mesh,
        optimizer=fs.optim.sgd(0.1),
        placements=rules,
    )
    try:
        step.grad(step.init(params), gpt_batch(0, length=7))
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        out["odd length"] = (type(e).__name__, str(e))
    return out


def layered(n_lists: int = 1, tail: str = "norm") -> nn.Module:
    """A small stack: embedding, `n_lists` lists of (column, row) blocks, a tail."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 16)
            self.down = nn.Linear(16, 8)

        def forward(self, x):
            return x + self.down(self.up(x))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            for i in range(n_lists):
                setattr(self, f"blocks{i}", nn.ModuleList([Block(), Block()]))
            self.tail = nn.LayerNorm(8) if tail == "norm" else nn.Linear(8, 8)

    return Stack()


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_reference():
    pytest.importorskip("transformers")
    return fs.testing.SimulatedWorld(1).run(single_process, "llama")[0]


def check_against(report, reference, tolerance=1e-5):
    errors = relative_errors(report["grads"], reference["grads"])
    print({"worst_grad_error": max(errors.values()), "loss": (report["loss"], reference["loss"])})
    assert report["traced_equals_eager"]
    assert abs(report["loss"] - reference["loss"]) <= tolerance * abs(reference["loss"])
    assert max(errors.values()) <= tolerance, errors


def test_llama_with_sequence_parallelism_trains_like_single_process(local_world, llama_reference):
    report = local_world(2).run(train_sequence_parallel, {"tp": 2}, "llama")[0]
    check_against(report, llama_reference)


def test_gpt_with_dropout_under_sequence_parallelism_equals_single_process_with_its_masks(local_world):
    reference = fs.testing.SimulatedWorld(1).run(single_process, "gpt", 0.1)[0]
    report = local_world(2).run(train_sequence_parallel, {"tp": 2}, "gpt", 0.1)[0]
    check_against(report, reference)


def test_dropout_masks_are_identical_where_replicated_and_differ_on_sequence_slices(local_world):
    got = local_world(2).run(dropout_masks)[0]
    assert torch.equal(got["replicas"][0], got["replicas"][1])  # the embedding dropout, before the blocks
    first, second = got["slices"]
    assert not torch.equal(first, second)  # different tokens, different masks
    with torch.random.fork_rng():
        torch.manual_seed(7)
        F.dropout(torch.ones(2, 8, 32), 0.5)  # the replicated dropout's draw, first on every rank
        whole = F.dropout(torch.ones(2, 8, 32), 0.5)
    assert torch.equal(torch.cat([first, second], dim=1), whole)  # the single-process mask, cut along the sequence


def test_activations_saved_between_blocks_are_tp_times_smaller(local_world):
    got = local_world(2).run(saved_between_blocks, 2)[0]
    print({k: dict(v) for k, v in got.items()})
    assert got[False]["between"] == pytest.approx(2 * got[True]["between"], rel=0.02)
    assert got[True]["other"] == pytest.approx(got[False]["other"], rel=0.02)  # heads and features: already split


def test_sequence_length_not_divisible_by_tp_is_refused_naming_it(local_world):
    kind, message = local_world(2).run(refusals)[0]["odd length"]
    assert kind == "PlacementError" and "sequence length 7" in message and "divisible by 2" in message, message


def test_blocks_and_styles_sequence_parallelism_cannot_run_are_refused_before_anything_changes():
    mesh = fs.analysis.AbstractMesh({"tp": 2})
    rules = [
        tp.Rule("*.up.weight", tp.Split(0, "tp"), True, "colwise"),
        tp.Rule("*.up.bias", tp.Split(0, "tp"), True, "colwise"),
        tp.Rule("*.down.weight", tp.Split(1, "tp"), True, "rowwise"),
    ]
    two = layered(n_lists=2)
    with pytest.raises(tp.PlacementError, match=r"blocks0.*blocks1.*blocks='path"):
        tp.parallelize(two, rules, mesh, sequence_parallel=True)
    assert tp.parallelized_modules(two) == {}  # nothing changed
    assert tp.parallelized_modules(tp.parallelize(two, rules, mesh, sequence_parallel=True, blocks="blocks1"))
    with pytest.raises(tp.PlacementError, match="no non-empty nn.ModuleList"):
        tp.parallelize(layered(), rules, mesh, sequence_parallel=True, blocks="nowhere")
    tail = layered(tail="linear")
    with pytest.raises(tp.PlacementError, match=r"'tail' has style 'rowwise' after the blocks"):
        row_tail = rules + [tp.Rule("tail.weight", tp.Split(1, "tp"), True, "rowwise")]
        tp.parallelize(tail, row_tail, mesh, sequence_parallel=True)
    assert tp.parallelized_modules(tail) == {}


@pytest.mark.slow
def test_gpt_with_a_replicated_embedding_and_head_under_sequence_parallelism(local_world):
    reference = fs.testing.SimulatedWorld(1).run(single_process, "gpt")[0]
    report = local_world(2).run(train_sequence_parallel, {"tp": 2}, "gpt", 0.0, False)[0]
    check_against(report, reference)


@pytest.mark.slow
def test_gpt_at_fsdp_2_tp_2_with_sequence_parallelism(local_world):
    # Every data rank trains on the same rows (so the mean is the single-process gradient); no
    # dropout: data ranks draw from streams of their own.
    reference = fs.testing.SimulatedWorld(1).run(single_process, "gpt")[0]
    report = local_world(4).run(train_sequence_parallel, {"fsdp": 2, "tp": 2}, "gpt")[0]
    check_against(report, reference)


@pytest.mark.slow
def test_activations_saved_between_blocks_at_tp_4(local_world):
    got = local_world(4).run(saved_between_blocks, 4)[0]
    print({k: dict(v) for k, v in got.items()})
    assert got[False]["between"] == pytest.approx(4 * got[True]["between"], rel=0.02)


def qwen2_micro_batches(_):
    """Qwen2 (split q/k/v biases) with sequence parallelism, 2 micro-batches: first-step gradient
    against the single-process model's, evaluate, traced == eager."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mesh = fs.init_mesh({"tp": 2})
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa", tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    reference = Qwen2ForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))
    rules = tp.hf_rules(model)
    apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh, sequence_parallel=True))

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, input_ids=batch).logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    out = {}
    for trace in (False, True):
        step = fs.sharded_step(
            loss_fn, mesh, optimizer=fs.optim.adamw(LR), placements=rules, microbatches=2,
            schedule=fs.Schedule(trace=trace),
        )  # fmt: skip
        state = step.init(params)
        grads = fs.gather(step.grad(state, ids)[0], full=True)
        evaluated = float(step.evaluate(state, ids)["loss"])
        for _ in range(STEPS):
            state, _ = step(state, ids)
        out[trace] = (grads, evaluated, state)
    loss = F.cross_entropy(reference(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    errors = {k: float((out[False][0][k] - p.grad).norm() / p.grad.norm()) for k, p in reference.named_parameters()}
    return {
        "errors": errors,
        "evaluated": (out[False][1], out[True][1], float(loss)),
        "traced_equals_eager": same_tree(out[False][2], out[True][2]),
    }


@pytest.mark.slow
def test_qwen2_with_micro_batches_and_evaluate_under_sequence_parallelism(local_world):
    pytest.importorskip("transformers")
    got = local_world(2).run(qwen2_micro_batches)[0]
    print(max(got["errors"].values()), got["evaluated"])
    assert max(got["errors"].values()) <= 1e-5, got["errors"]
    eager, traced, single = got["evaluated"]
    assert eager == traced and abs(eager - single) <= 1e-5 * single
    assert got["traced_equals_eager"]
