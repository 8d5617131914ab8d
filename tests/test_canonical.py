"""Layout-invariant training (issue 28): `sharded_step(..., canonical_chunks=G)` gives the same
bits at any data-parallel layout, on real gloo processes.

- `fs.models.GPT` with dropout, fp32, AdamW with clipping, G = 8: every parameter, optimizer
  moment, per-step mean loss and grad norm, and `step.evaluate`'s loss bit-identical at world
  sizes 1 and 2 (eager) and 4 (traced);
- a Hugging Face Llama (padding, `-100` labels, `fs.WeightedLoss` by token count) in bf16 mixed
  precision: the same at world size 1 (eager) and at `{"replicate": 2, "fsdp": 2}` (traced);
- without `canonical_chunks` the bits differ between world sizes 1 and 2 (these tests can fail);
- the law the invariance rests on, property-tested: `tree_sum` over G values equals the tree of
  the D ranks' partial sums (`TreeSum` over each rank's block) for every D of `degrees(G)`, and
  `reduce` / `chunk_values` over a mesh give the tree's bits.

The full matrix (both models, fp32 and bf16, world sizes 1, 2, 4, 8, replicate x fsdp, explicit
micro-batches, 20 steps) is in test_canonical_soak.py (slow).

Every rank sets `torch.set_num_threads(1)` before it builds the step: thread counts change how
kernels split their sums, hence the bits (the step's facts name the count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard import _canonical
from functional_shard.models import GPT, GPTConfig

G = 8  # canonical chunks
BATCH = 16  # rows of the global batch (2 per chunk)
LENGTH = 11
VOCAB = 61


# --- models, data and one training run (on every rank) ------------------------------------------


def build(model: str, dropout: float):
    """(apply_fn, params, loss_fn) of a tiny model: fs's GPT (plain mean loss) or a Hugging Face
    Llama (right padding, -100 labels, `fs.WeightedLoss` by token count)."""
    torch.manual_seed(0)
    if model == "gpt":
        net = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=24, dropout=dropout))
        apply_fn, params = fs.functionalize(net)

        def loss_fn(p, batch):
            x, y, _ = batch
            logits = apply_fn(p, x).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

        return params, loss_fn
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        attention_dropout=dropout, attn_implementation="sdpa",
    )  # fmt: skip
    apply_fn, params = fs.functionalize(LlamaForCausalLM(config))

    def loss_fn(p, batch):
        ids, mask, labels = batch
        logits = apply_fn(p, input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        n = (target != -100).sum()
        flat = logits.reshape(-1, logits.shape[-1])
        total = F.cross_entropy(flat, target.reshape(-1), ignore_index=-100, reduction="sum")
        return fs.WeightedLoss(total / n, n)

    return params, loss_fn


def global_batch(model: str, step: int):
    """The global batch of `step` (BATCH rows): GPT (tokens, next tokens, unused); Llama (ids,
    attention mask, labels) with right padding (rows of 3..LENGTH tokens) and -100 labels."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g)
    if model == "gpt":
        return ids, torch.roll(ids, -1, 1), torch.zeros(BATCH)
    lengths = torch.randint(3, LENGTH + 1, (BATCH,), generator=g)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 2)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def local_rows(batch, mesh):
    """This data-parallel rank's contiguous rows of the global batch."""
    per = BATCH // mesh.data_size
    r = mesh.data_rank
    return tuple(t[r * per : (r + 1) * per] for t in batch)


def precision_of(name: str):
    if name == "fp32":
        return None
    return fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def schedule_of(trace):
    """False: the eager reference; True: the canonical step's default schedule (each unit gathered
    once per step); "per chunk": `fs.Schedule()` (gathered for every chunk)."""
    if trace == "per chunk":
        return fs.Schedule()
    return None if trace else fs.Schedule(trace=False)


def train(
    mesh,
    model: str = "gpt",
    precision: str = "fp32",
    steps: int = 3,
    trace: bool = True,
    canonical: int | None = G,
    microbatches: int | None = None,
    dropout: float = 0.1,
) -> dict:
    """`steps` steps of AdamW with clipping on the global batches, this rank's part of them.
    Returns this rank's view: per-step mean losses and grad norms, the evaluate loss, the full
    parameters (rank 0 only), its optimizer-state leaves (shards) and its shard index."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels at every layout: set before building the step
    try:
        params, loss_fn = build(model, dropout)
        optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(lr=1e-2, weight_decay=0.1))
        extra = {} if microbatches is None else {"microbatches": microbatches}
        step = fs.sharded_step(
            loss_fn, mesh, optimizer=optimizer, schedule=schedule_of(trace), precision=precision_of(precision),
            canonical_chunks=canonical, **extra,
        )  # fmt: skip
        state = step.init(params)
        losses, norms = [], []
        for i in range(steps):
            state, metrics = step(state, local_rows(global_batch(model, i), mesh))
            losses.append(metrics["loss"].detach().clone())
            norms.append(metrics["grad_norm"].detach().clone())
        evaluated = step.evaluate(state, local_rows(global_batch(model, 10_000), mesh))["loss"].detach().clone()
        full = fs.gather(state.params, full=True)  # a collective: on every rank
        full = list(zip(fs.tree_paths(full), fs.tree_leaves(full))) if mesh.rank == 0 else None
        return {
            "losses": losses,
            "norms": norms,
            "eval": evaluated,
            "params": [t.detach().clone() for _, t in full] if full is not None else None,
            "names": [name for name, _ in full] if full is not None else None,
            "opt": [t.detach().clone() for t in fs.tree_leaves(state.opt_state)],
            "opt_names": fs.tree_paths(state.opt_state),
            "shard": mesh.shard_index,
            "shards": mesh.num_shards,
        }
    finally:
        torch.set_num_threads(threads)


# --- comparing runs ------------------------------------------------------------------------------


def joined(results: list[dict]) -> dict:
    """One run's bits from its ranks' results: the ranks' metrics must agree, replicas of a shard
    must hold the same optimizer state, and the state's shards are joined in shard order (each
    buffer is padded to G canonical blocks at every layout, so the joined buffers compare)."""
    first = results[0]
    for r, res in enumerate(results[1:], 1):
        for key in ("losses", "norms"):
            same = all(torch.equal(a, b) for a, b in zip(first[key], res[key]))
            assert same, f"rank {r}'s {key} differ from rank 0's"
        assert torch.equal(first["eval"], res["eval"]), f"rank {r}'s evaluate loss differs from rank 0's"
    by_shard: dict[int, list[torch.Tensor]] = {}
    for r, res in enumerate(results):
        if res["shard"] in by_shard:
            same = all(torch.equal(a, b) for a, b in zip(by_shard[res["shard"]], res["opt"]))
            assert same, f"rank {r} (a replica of shard {res['shard']}) holds another optimizer state"
        else:
            by_shard[res["shard"]] = res["opt"]
    assert sorted(by_shard) == list(range(first["shards"]))
    parts = [by_shard[s] for s in range(first["shards"])]
    opt = [t if t.dim() == 0 else torch.cat(pieces) for t, *pieces in zip(parts[0], *parts)]
    # a 0-d leaf (the step count) is the same on every shard: keep one, checked here
    for s, part in enumerate(parts[1:], 1):
        for k, (a, b) in enumerate(zip(parts[0], part)):
            if a.dim() == 0:
                assert torch.equal(a, b), f"optimizer leaf {k} (0-d) differs between shard 0 and shard {s}"
    return {**{k: first[k] for k in ("losses", "norms", "eval", "params", "names", "opt_names")}, "opt": opt}


def differences(a: dict, b: dict) -> list[str]:
    """What differs (bitwise) between two joined runs, first items first."""
    out = []
    for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
        if not torch.equal(x, y):
            out.append(f"loss of step {i}: {x.item()!r} vs {y.item()!r}")
    for i, (x, y) in enumerate(zip(a["norms"], b["norms"])):
        if not torch.equal(x, y):
            out.append(f"grad_norm of step {i}: {x.item()!r} vs {y.item()!r}")
    if not torch.equal(a["eval"], b["eval"]):
        out.append(f"evaluate loss: {a['eval'].item()!r} vs {b['eval'].item()!r}")
    assert a["names"] == b["names"] and a["opt_names"] == b["opt_names"]
    for name, x, y in zip(a["names"], a["params"], b["params"]):
        if not torch.equal(x, y):
            out.append(f"parameter {name}: max |diff| {(x.double() - y.double()).abs().max().item():.3g}")
    for name, x, y in zip(a["opt_names"], a["opt"], b["opt"]):
        if x.shape != y.shape:
            out.append(f"optimizer leaf {name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        elif not torch.equal(x, y):
            out.append(f"optimizer leaf {name}: max |diff| {(x.double() - y.double()).abs().max().item():.3g}")
    return out


def assert_same(reference: dict, other: dict, label: str) -> None:
    diffs = differences(reference, other)
    assert not diffs, f"{label}: {len(diffs)} bitwise differences from the reference, first: {diffs[:5]}"


# --- training at several layouts -----------------------------------------------------------------


def test_gpt_dropout_same_bits_at_1_2_4_ranks_traced_and_eager(local_world):
    """GPT with dropout 0.1, fp32, clip + AdamW, G = 8, 3 steps: world sizes 1 (8 micro-batches),
    2 and 4 give the same parameters, moments, losses, norms and eval loss, eager and traced
    (traced at 4 ranks here, where a trace is cheapest; every layout traced in the soak)."""
    reference = joined(local_world(1).run(train, "gpt", "fp32", 3, False))
    assert len(reference["params"]) > 0 and len(reference["opt"]) > 0
    assert reference["norms"][0] > 0.5  # clipping acts (the threshold is 0.5)
    assert_same(reference, joined(local_world(2).run(train, "gpt", "fp32", 3, False)), "world 2 eager")
    assert_same(reference, joined(local_world(4).run(train, "gpt", "fp32", 3, True)), "world 4 traced")


# With -m slow (~25 s, a hybrid world of its own): layout invariance of the step in
# test_gpt_dropout_same_bits_at_1_2_4_ranks_traced_and_eager; the tree over replicate x fsdp layouts
# in test_reduce_and_chunk_values_give_the_tree_on_a_simulated_mesh; the Llama in bf16 at every
# layout in test_canonical_soak.py (slow).
@pytest.mark.slow
def test_llama_bf16_weighted_padding_same_bits_at_1_and_replicate2_fsdp2(local_world):
    """Hugging Face Llama, bf16 params / fp32 reduce, padding, -100 labels, fs.WeightedLoss,
    clip + AdamW, G = 8, 3 steps: world size 1 (eager) and {"replicate": 2, "fsdp": 2} (traced)
    agree bitwise."""
    reference = joined(local_world(1).run(train, "llama", "bf16", 3, False))
    with fs.testing.LocalWorld(4, axes={"replicate": 2, "fsdp": 2}, collective_timeout=60.0) as world:
        hybrid = joined(world.run(train, "llama", "bf16", 3, True))
    assert_same(reference, hybrid, 'world {"replicate": 2, "fsdp": 2} traced')


def test_without_canonical_chunks_bits_differ_between_1_and_2_ranks(local_world):
    """The control: the default step (no canonical_chunks, no dropout) is not layout-invariant,
    so the tests above can fail."""
    one = joined(local_world(1).run(train, "gpt", "fp32", 3, False, None, None, 0.0))
    two = joined(local_world(2).run(train, "gpt", "fp32", 3, False, None, None, 0.0))
    diffs = differences(one, two)
    assert any(d.startswith("parameter") for d in diffs), diffs


# --- the law: the canonical tree splits over any valid degree ------------------------------------


AWKWARD = st.sampled_from([1, 3, 6, 12, 24])


def _rows(chunks: int, width: int, seed: int) -> torch.Tensor:
    """Float32 values over many magnitudes, so that the order of their sum changes its bits."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-20, 20, (chunks, width), generator=g).float())
    return torch.randn(chunks, width, generator=g) * scales


def _local_tree(rows: torch.Tensor) -> torch.Tensor:
    tree = _canonical.TreeSum(rows.shape[0])
    for row in rows:
        tree.add([row])
    return tree.result()[0]


@settings(max_examples=12, deadline=None)
@given(chunks=AWKWARD, seed=st.integers(0, 2**31 - 1))
def test_tree_sum_splits_over_every_degree(chunks, seed):
    """tree_sum of G rows == tree_sum of the D ranks' partials (TreeSum over each rank's block of
    G/D rows) for every D in degrees(G); and the degrees are the powers of two dividing G."""
    assert _canonical.degrees(chunks) == [d for d in (1, 2, 4, 8, 16, 32) if chunks % d == 0]
    rows = _rows(chunks, 64, seed)
    whole = _canonical.tree_sum(rows)
    for d in _canonical.degrees(chunks):
        per = chunks // d
        partials = torch.stack([_local_tree(rows[r * per : (r + 1) * per]) for r in range(d)])
        assert torch.equal(_canonical.tree_sum(partials), whole), f"G={chunks} D={d}"


def test_tree_sum_is_not_the_sequential_sum():
    """The control: the order matters for these values (else the law above proves nothing)."""
    rows = _rows(24, 64, 0)
    sequential = rows[0]
    for row in rows[1:]:
        sequential = sequential + row
    assert not torch.equal(sequential, _canonical.tree_sum(rows))


def _reduce_on_rank(mesh, chunks: int, seed: int):
    """This rank's block of the G chunks: its local tree, `reduce`d over the mesh; and
    `chunk_values` of its chunks' scalars."""
    width = 64 * chunks
    rows = _rows(chunks, width, seed)
    per = chunks // mesh.data_size
    block = rows[mesh.data_rank * per : (mesh.data_rank + 1) * per]
    shard = _canonical.reduce(_local_tree(block), mesh)
    values = _canonical.chunk_values(block[:, :3].clone(), mesh)
    return shard, values, mesh.shard_index, mesh.num_shards


LAYOUTS = [({"fsdp": 1}, 1), ({"fsdp": 2}, 2), ({"fsdp": 4}, 4), ({"replicate": 2, "fsdp": 2}, 4), ({"fsdp": 8}, 8),
           ({"replicate": 2, "fsdp": 4}, 8), ({"replicate": 4}, 4)]  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(chunks=AWKWARD, layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**31 - 1))
def test_reduce_and_chunk_values_give_the_tree_on_a_simulated_mesh(chunks, layout, seed):
    """On thread meshes: the shards `reduce` leaves, joined in shard order, are tree_sum of every
    chunk's row; `chunk_values` gives every chunk's values in chunk order (layouts whose degree
    divides G)."""
    axes, size = layout
    assume(chunks % size == 0)
    results = fs.testing.SimulatedWorld(size, axes=axes).run(_reduce_on_rank, chunks, seed)
    rows = _rows(chunks, 64 * chunks, seed)
    whole = _canonical.tree_sum(rows)
    shards = results[0][3]
    parts = {}
    for shard, values, index, _ in results:
        assert torch.equal(values, rows[:, :3])
        if index in parts:
            assert torch.equal(parts[index], shard)  # replicas agree
        parts[index] = shard
    assert torch.equal(torch.cat([parts[i] for i in range(shards)]), whole), f"G={chunks} axes={axes}"


def test_reduce_and_chunk_values_give_the_tree_on_gloo(local_world):
    """The same on real gloo processes (all-to-all over the shard axis): 4 ranks, G = 12 and 8."""
    for chunks in (8, 12):
        rows = _rows(chunks, 64 * chunks, 7)
        results = local_world(4).run(_reduce_on_rank, chunks, 7)
        assert torch.equal(torch.cat([r[0] for r in sorted(results, key=lambda r: r[2])]), _canonical.tree_sum(rows))
        assert all(torch.equal(r[1], rows[:, :3]) for r in results)



def test_plan_a_canonical_step_at_scale_in_one_process():
    """`fs.analysis.plan(..., canonical_chunks=G)` on an `AbstractMesh`: each unit gathered once per
    step (the canonical default), its gradient reduced once — an all-to-all over `fsdp` — and the
    replicas' partial sums met by an all-gather over `replicate`; a degree that cannot be invariant
    is refused before tracing."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=2, n_head=2, d_model=24))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        logits = apply_fn(p, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    batch = (torch.empty(2, 11, dtype=torch.long, device="meta"),) * 2  # one rank's 2 chunks of 1 row
    mesh = fs.analysis.AbstractMesh({"replicate": 2, "fsdp": 4})
    analysis, compiled = fs.analysis.plan(
        loss_fn, params, batch, mesh=mesh, optimizer=fs.optim.adamw(1e-3), canonical_chunks=16
    )
    buffers = {c.buffer for c in analysis.collectives if c.buffer}
    gathers = [c for c in analysis.collectives if c.kind == "all_gather" and c.buffer]
    scatters = [c for c in analysis.collectives if c.kind == "reduce_scatter"]
    assert len(gathers) == len(buffers)  # once per step, shared by the chunks
    assert len(scatters) == len(buffers) and {c.axis for c in scatters} == {"fsdp"}
    a2a = torch.ops._c10d_functional.all_to_all_single.default
    assert sum(1 for n in compiled.graph_module.graph.nodes if n.target is a2a) == len(buffers)
    replicas = [c for c in analysis.collectives if c.kind == "all_gather" and c.axis == "replicate"]
    assert len(replicas) >= len(buffers)  # the replicas' partial sums (and the chunks' losses)
    assert analysis.memory.peak > 0
    with pytest.raises(ValueError, match="power of two that divides canonical_chunks"):
        fs.analysis.plan(loss_fn, params, batch, mesh=fs.analysis.AbstractMesh({"fsdp": 3}),
                         optimizer=fs.optim.adamw(1e-3), canonical_chunks=12)
