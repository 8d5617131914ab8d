"""fs.tensor_parallel: placements, plans and the conjugate collectives, against single-process references.

Laws (hypothesis, simulated meshes up to 8 ranks, and real gloo processes at {"fsdp": 2, "tp": 2}):
a full gather of split pieces is the original bit for bit; each conjugate pair is adjoint
(`<f(x), y> == <x, f*(y)>`, summed over ranks, replicated values counted once, exact on
integer-valued fp64 data); the vocabulary-parallel cross-entropy equals `F.cross_entropy`;
a column -> row parallel MLP (and its sequence-parallel form) gives the single-process
loss and gradients.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import grad, grad_and_value, vjp

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

MESHES = [
    {"tp": 1},
    {"tp": 2},
    {"tp": 3},
    {"tp": 4},
    {"tp": 8},
    {"fsdp": 2, "tp": 2},
    {"tp": 2, "fsdp": 2},
    {"fsdp": 2, "tp": 4},
    {"replicate": 2, "fsdp": 2, "tp": 2},
]


def world_size(axes: dict[str, int]) -> int:
    n = 1
    for s in axes.values():
        n *= s
    return n


def simulated(axes):
    return fs.testing.SimulatedWorld(world_size(axes), axes=axes)


def integers(seed: int, shape) -> torch.Tensor:
    """Integer-valued fp64 data: every product and sum below is exact."""
    return torch.randint(-8, 9, tuple(shape), generator=torch.Generator().manual_seed(seed)).double()


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() * b.double()).sum())


# --- placements and rules -------------------------------------------------------------------


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    options = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    options.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**options))


def test_placements_are_hashable_values():
    assert tp.Split(0, "tp") == tp.Split(0, "tp") and hash(tp.Split(0, "tp")) == hash(tp.Split(0, "tp"))
    assert tp.Replicated() == tp.Replicated() and len({tp.Split(1, "tp"), tp.Split(1, "tp"), tp.Replicated()}) == 2
    with pytest.raises(Exception):
        tp.Split(0, "tp").dim = 1  # frozen
    assert repr(tp.Split(0, "tp", chunks=3)) == "Split(dim=0, axis='tp', chunks=3)"
    with pytest.raises(ValueError, match="chunks"):
        tp.Split(0, "tp", chunks=0)


def test_hf_llama_plan_places_fs_paths():
    pytest.importorskip("transformers")
    model = tiny_llama()
    _, params = fs.functionalize(model)
    placements = tp.placements_for(params, tp.hf_rules(model), {"fsdp": 2, "tp": 2})
    assert list(placements) == list(params)  # one per leaf, in order
    head = 64 // 4
    assert placements["model.layers.1.self_attn.q_proj.weight"] == tp.Split(0, "tp", granule=head)
    assert placements["model.layers.0.self_attn.k_proj.weight"] == tp.Split(0, "tp", granule=head)
    assert placements["model.layers.0.self_attn.o_proj.weight"] == tp.Split(1, "tp", granule=head)
    assert placements["model.layers.0.mlp.gate_proj.weight"] == tp.Split(0, "tp")
    assert placements["model.layers.0.mlp.down_proj.weight"] == tp.Split(1, "tp")
    assert placements["model.layers.0.input_layernorm.weight"] == tp.Replicated()
    assert placements["model.norm.weight"] == tp.Replicated()
    assert placements["model.embed_tokens.weight"] == tp.Replicated()  # Llama's plan leaves it
    assert placements["lm_head.weight"] == tp.Split(0, "tp")  # the class's own plan: colwise_gather_output
    assert placements["model.rotary_emb.inv_freq"] == tp.Replicated()
    # A tied head is the embedding's leaf: the optional head rule matches nothing, no error.
    tied = tiny_llama(tie_word_embeddings=True)
    _, tied_params = fs.functionalize(tied)
    assert "lm_head.weight" not in tp.placements_for(tied_params, tp.hf_rules(tied), {"tp": 2})


def test_hf_qwen2_plan_splits_biases_of_column_parallel_projections():
    pytest.importorskip("transformers")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))  # fmt: skip
    _, params = fs.functionalize(model)
    placements = tp.placements_for(params, tp.hf_rules(model), {"tp": 2})
    assert placements["model.layers.0.self_attn.q_proj.bias"] == tp.Split(0, "tp", granule=16)
    assert placements["model.layers.0.self_attn.o_proj.weight"] == tp.Split(1, "tp", granule=16)


def test_hf_styles_place_weight_and_bias():
    rules = tp.rules_from_hf_plan({"a.*.col": "colwise", "a.*.row": "rowwise", "emb": "embedding_rowwise",
                                   "a.*.packed": "packed_colwise", "a.*.norm": "sequence_parallel"})  # fmt: skip
    leaves = {
        "a.0.col.weight": (8, 4), "a.0.col.bias": (8,), "a.0.row.weight": (4, 8), "a.0.row.bias": (4,),
        "emb.weight": (10, 4), "a.0.packed.weight": (8, 4), "a.0.norm.weight": (4,), "a.10.col.weight": (8, 4),
    }  # fmt: skip
    placements = tp.placements_for(leaves, rules, {"tp": 2})
    assert placements == {
        "a.0.col.weight": tp.Split(0, "tp"), "a.0.col.bias": tp.Split(0, "tp"),
        "a.0.row.weight": tp.Split(1, "tp"), "a.0.row.bias": tp.Replicated(),
        "emb.weight": tp.Split(0, "tp"), "a.0.packed.weight": tp.Split(0, "tp", chunks=2),
        "a.0.norm.weight": tp.Replicated(), "a.10.col.weight": tp.Split(0, "tp"),
    }  # fmt: skip
    assert {r.style for r in rules} == {"colwise", "rowwise", "embedding_rowwise", "packed_colwise", "sequence_parallel"}
    with pytest.raises(tp.PlacementError, match=r"'layers.\*.experts'.*'grouped_gemm'.*supported styles"):
        tp.rules_from_hf_plan({"layers.*.experts": "grouped_gemm"})


def test_gpt_plan_keeps_whole_heads_of_q_k_and_v():
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, d_model=16)
    _, params = fs.functionalize(GPT(config))
    placements = tp.placements_for(params, tp.gpt_rules(config), {"tp": 2})
    qkv = placements["blocks.1.attn.qkv.weight"]
    assert qkv == tp.Split(0, "tp", chunks=3, granule=4)
    assert placements["blocks.0.attn.proj.weight"] == tp.Split(1, "tp", granule=4)
    assert placements["blocks.0.mlp.fc.bias"] == tp.Split(0, "tp") and placements["blocks.0.mlp.proj.bias"] == tp.Replicated()
    assert placements["tok_emb.weight"] == tp.Split(0, "tp") and placements["ln_f.weight"] == tp.Replicated()
    # Rank 1 holds heads 2 and 3 of q, of k and of v.
    rows = torch.arange(48)[:, None].expand(48, 16)
    piece = tp.split_tensor(rows, qkv, 1, 2)[:, 0].tolist()
    assert piece == [*range(8, 16), *range(24, 32), *range(40, 48)]
    with pytest.raises(tp.PlacementError, match=r"4 units of 4 elements \(attention heads\) per block.*3 ranks"):
        tp.placements_for(params, tp.gpt_rules(config, vocab_parallel=False), {"tp": 3})


def test_bad_rules_and_meshes_are_refused_clearly():
    leaves = {"blocks.0.w": (6, 4), "blocks.0.b": (6,), "head.w": (5, 4)}
    with pytest.raises(tp.PlacementError) as error:
        tp.placements_for(leaves, [("head.w", tp.Split(0, "tp"))], {"fsdp": 2, "tp": 2})
    for part in ("'head.w'", "[5, 4]", "dimension 0", "size 5", "'tp'", "size 2", "not divisible by 2", "Replicated()"):
        assert part in str(error.value)
    with pytest.raises(tp.PlacementError, match=r"axis 'model'.*does not have.*\['fsdp', 'tp'\]"):
        tp.placements_for(leaves, [("blocks.*.w", tp.Split(0, "model"))], {"fsdp": 2, "tp": 2})
    with pytest.raises(tp.PlacementError, match=r"rule\('blocks\.\*\.weight'.*matched no leaf.*blocks\.0\.w, blocks\.0\.b"):
        tp.placements_for(leaves, [("blocks.*.weight", tp.Split(0, "tp"))], {"tp": 2})
    with pytest.raises(tp.PlacementError, match=r"'blocks.0.b'.*dimension 1"):
        tp.placements_for(leaves, [("blocks.0.*", tp.Split(1, "tp"))], {"tp": 2})
    # first match wins; required=False may match nothing; regexes and functions are rules too
    placements = tp.placements_for(
        leaves,
        [tp.rule(re.compile(r"^blocks.*\.w$"), tp.Split(-1, "tp")), tp.rule("*.b", tp.Split(0, "tp")),
         tp.rule("absent", tp.Split(0, "tp"), required=False), tp.rule(lambda p, s: s == (5, 4), tp.Replicated())],
        {"tp": 2},
    )  # fmt: skip
    assert placements == {"blocks.0.w": tp.Split(1, "tp"), "blocks.0.b": tp.Split(0, "tp"), "head.w": tp.Replicated()}


def test_gqa_key_value_heads_not_divisible_by_tp_are_refused():
    pytest.importorskip("transformers")
    model = tiny_llama()  # 4 query heads, 2 key/value heads of 16
    _, params = fs.functionalize(model)
    with pytest.raises(tp.PlacementError, match=r"k_proj.weight.*2 units of 16 elements \(attention heads\).*4 ranks"):
        tp.placements_for(params, tp.hf_rules(model), {"tp": 4})


@st.composite
def split_cases(draw):
    size = draw(st.integers(1, 8))
    chunks = draw(st.sampled_from([1, 1, 2, 3]))
    granule = draw(st.sampled_from([1, 1, 2]))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.sampled_from([0, 1, 2, 3, 5])) for _ in range(ndim)]
    shape[dim] = draw(st.sampled_from([0, 1, 2, 3])) * size * chunks * granule
    return tp.Split(dim, "tp", chunks, granule), shape, size


@settings(max_examples=150, deadline=None)
@given(case=split_cases(), seed=st.integers(0, 2**16))
def test_join_of_split_pieces_is_identity(case, seed):
    split, shape, size = case
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    placements = tp.placements_for({"x": tuple(shape)}, [("x", split)], {"tp": size})
    pieces = [tp.split_tensor(full, placements["x"], i, size) for i in range(size)]
    assert all(tuple(p.shape) == tp.local_shape(tuple(shape), split, {"tp": size}) for p in pieces)
    assert torch.equal(tp.join_pieces(pieces, split), full)


# --- collective laws ------------------------------------------------------------------------


def gather_of_split_is_identity(mesh, shape, split, seed):
    """Every rank holds its piece of one full leaf; `gather_leaf` gives the leaf back, bit for bit."""
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    size = mesh.shape[split.axis]
    local = tp.split_tensor(full, split, mesh.coordinates[split.axis], size).contiguous()
    return torch.equal(tp.gather_leaf(local, split, mesh), full)


def adjoint_products(mesh, pair, shape, dim, seed):
    """This rank's terms of `<f(x), y>` and `<x, f*(y)>` (f* = the vjp, i.e. the backward).

    Replicated values (the same on every rank of "tp") count once: their products are divided
    by the axis size, so that the sums over all ranks are the inner products of the values."""
    n = mesh.shape["tp"]
    rank_seed = seed + 1 + mesh.rank
    fn = {
        "copy_to": lambda x: tp.copy_to(x, mesh, "tp"),
        "reduce_from": lambda x: tp.reduce_from(x, mesh, "tp"),
        "gather_along": lambda x: tp.gather_along(x, dim, mesh, "tp"),
        "gather_split": lambda x: tp.gather_along(x, dim, mesh, "tp", grad="split"),
        "reduce_scatter_along": lambda x: tp.reduce_scatter_along(x, dim, mesh, "tp"),
        "scatter_along": lambda x: tp.scatter_along(x, dim, mesh, "tp"),
    }[pair]
    # (input replicated over tp?, output cotangent replicated over tp?)
    replicated_in, replicated_out = {
        "copy_to": (True, False), "reduce_from": (False, True), "gather_along": (False, False),
        "gather_split": (False, True), "reduce_scatter_along": (False, False), "scatter_along": (True, False),
    }[pair]  # fmt: skip
    x = integers(seed if replicated_in else rank_seed, shape)
    y_shape = list(shape)
    if pair.startswith("gather"):
        y_shape[dim] *= n
    elif pair in ("reduce_scatter_along", "scatter_along"):
        y_shape[dim] //= n
    y = integers(seed + 10**6 if replicated_out else rank_seed + 10**6, y_shape)
    out, pull = vjp(fn, x)
    (back,) = pull(y)
    left = dot(out, y) / (n if replicated_out else 1)
    right = dot(x, back) / (n if replicated_in else 1)
    return left, right


PAIRS = ["copy_to", "reduce_from", "gather_along", "gather_split", "reduce_scatter_along", "scatter_along"]


@st.composite
def law_cases(draw):
    axes = draw(st.sampled_from(MESHES))
    n = axes["tp"]
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.sampled_from([1, 2, 3, 5, 17])) for _ in range(ndim)]
    shape[dim] = draw(st.sampled_from([1, 2, 3, 5])) * n
    return axes, shape, dim


HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]


def check_adjoint(run, pair, shape, dim, seed):
    products = run(adjoint_products, pair, shape, dim, seed)
    left, right = sum(p[0] for p in products), sum(p[1] for p in products)
    assert left == right, (pair, shape, dim, left, right)


@pytest.mark.parametrize("pair", PAIRS)
@settings(max_examples=12, deadline=None, suppress_health_check=HEALTH)
@given(case=law_cases(), seed=st.integers(0, 1000))
def test_conjugate_pairs_are_adjoint_simulated(pair, case, seed):
    axes, shape, dim = case
    check_adjoint(simulated(axes).run, pair, shape, dim, seed)


@settings(max_examples=40, deadline=None)
@given(case=law_cases(), chunks=st.sampled_from([1, 2, 3]), seed=st.integers(0, 1000))
def test_gather_of_split_is_identity_simulated(case, chunks, seed):
    axes, shape, dim = case
    shape[dim] *= chunks
    assert all(simulated(axes).run(gather_of_split_is_identity, shape, tp.Split(dim, "tp", chunks), seed))


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS)
@settings(max_examples=150, deadline=None, suppress_health_check=HEALTH)
@given(case=law_cases(), seed=st.integers(0, 10**6))
def test_conjugate_pairs_are_adjoint_simulated_sweep(pair, case, seed):
    axes, shape, dim = case
    check_adjoint(simulated(axes).run, pair, shape, dim, seed)


# --- vocabulary-parallel cross-entropy ------------------------------------------------------


def vocab_parallel_case(mesh, tokens, vocab, dtype, seed):
    """Loss and this rank's slice of the gradient, from its slice of the logits."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::3] = -100
    n, i = mesh.shape["tp"], mesh.coordinates["tp"]
    local = logits.chunk(n, -1)[i].contiguous()
    grads, loss = grad_and_value(lambda z: tp.vocab_parallel_cross_entropy(z, targets, mesh, "tp"))(local)
    summed = tp.vocab_parallel_cross_entropy(local, targets, mesh, "tp", reduction="sum")
    per_token = tp.vocab_parallel_cross_entropy(local, targets, mesh, "tp", reduction="none")
    return loss, grads, summed, per_token


@pytest.mark.parametrize("axes", [{"tp": 1}, {"tp": 2}, {"tp": 4}, {"fsdp": 2, "tp": 2}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_cross_entropy_equals_cross_entropy(axes, dtype):
    tokens, vocab, seed = 37, 64, 3
    results = simulated(axes).run(vocab_parallel_case, tokens, vocab, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(tokens, vocab, generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::3] = -100
    full = logits.float().requires_grad_()
    expected = F.cross_entropy(full, targets)
    (expected_grad,) = torch.autograd.grad(expected, full)
    n = axes["tp"]
    for start in range(0, world_size(axes), n):  # each tp group
        group = results[start : start + n]
        for loss, _, summed, per_token in group:
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(summed, F.cross_entropy(logits.float(), targets, reduction="sum"), rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(per_token, F.cross_entropy(logits.float(), targets, reduction="none"), rtol=1e-6, atol=1e-6)
        gradient = torch.cat([r[1] for r in group], -1)
        assert gradient.dtype == dtype
        torch.testing.assert_close(gradient.float(), expected_grad.to(dtype).float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


# --- a Megatron MLP from the pieces ---------------------------------------------------------

D_IN, D_HIDDEN, TOKENS = 12, 20, 8


def mlp_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(D_HIDDEN, D_IN, generator=g, dtype=torch.float64) * 0.3,
        "fc.bias": torch.randn(D_HIDDEN, generator=g, dtype=torch.float64) * 0.1,
        "proj.weight": torch.randn(D_IN, D_HIDDEN, generator=g, dtype=torch.float64) * 0.3,
        "proj.bias": torch.randn(D_IN, generator=g, dtype=torch.float64) * 0.1,
    }


def mlp_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, TOKENS, D_IN, generator=g, dtype=torch.float64), torch.randn(2, TOKENS, D_IN, generator=g, dtype=torch.float64)


MLP_RULES = [("fc.*", tp.Split(0, "tp")), ("proj.weight", tp.Split(1, "tp"))]


def mlp_loss(w, x, target, mesh=None, sequence_parallel=False):
    """`proj(gelu(fc(x)))`; with a mesh, fc column-parallel and proj row-parallel over "tp"
    (Megatron: f before fc, g after proj), or with sequence parallelism (x and the output split
    along the sequence: all-gather before fc, reduce-scatter after proj)."""
    if mesh is None:
        out = F.linear(F.gelu(F.linear(x, w["fc.weight"], w["fc.bias"])), w["proj.weight"])
        return ((out + w["proj.bias"] - target) ** 2).mean()
    if sequence_parallel:
        h = tp.gather_along(x, 1, mesh, "tp")
    else:
        h = tp.copy_to(x, mesh, "tp")
    partial = F.linear(F.gelu(F.linear(h, w["fc.weight"], w["fc.bias"])), w["proj.weight"])
    if sequence_parallel:
        # A replicated parameter used on sequence shards has a partial gradient: copy_to sums it
        # (Megatron's all-reduce of sequence-parallel gradients, as an adjoint pair).
        out = tp.reduce_scatter_along(partial, 1, mesh, "tp") + tp.copy_to(w["proj.bias"], mesh, "tp")
        # each rank's tokens: a partial mean; the replicated loss is their sum over tp
        local = ((out - target) ** 2).sum() / target.numel() / mesh.shape["tp"]
        return tp.reduce_from(local, mesh, "tp")
    out = tp.reduce_from(partial, mesh, "tp") + w["proj.bias"]
    return ((out - target) ** 2).mean()


def tensor_parallel_mlp(mesh, sequence_parallel):
    full = mlp_weights()
    x, target = mlp_batch()
    placements = tp.placements_for(full, MLP_RULES, mesh)
    n, i = mesh.shape["tp"], mesh.coordinates["tp"]
    local = {k: tp.split_tensor(v, placements[k], i, n).contiguous() for k, v in full.items()}
    if sequence_parallel:
        x = tp.scatter_along(x, 1, mesh, "tp")
        target = tp.scatter_along(target, 1, mesh, "tp")
    grads, loss = grad_and_value(mlp_loss)(local, x, target, mesh, sequence_parallel)
    # The full gradient of every leaf: gather the split ones, replicated ones are whole already.
    gathered = {k: tp.gather_leaf(g, placements[k], mesh) for k, g in grads.items()}
    return loss, gathered


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("axes", [{"tp": 2}, {"tp": 4}, {"replicate": 2, "tp": 2}])
def test_column_row_parallel_mlp_equals_single_process(axes, sequence_parallel):
    expected_grads, expected = grad_and_value(mlp_loss)(mlp_weights(), *mlp_batch())
    for loss, grads in simulated(axes).run(tensor_parallel_mlp, sequence_parallel):
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(g, expected_grads[name], rtol=1e-6, atol=1e-12, msg=name)


# --- real gloo processes: {"fsdp": 2, "tp": 2} ------------------------------------------------


def traced_graph_ops(mesh):
    """make_fx of torch.func.grad through every pair: the graph holds their collectives, and
    running it gives the eager gradient bit for bit."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss(x):
        h = tp.copy_to(x, mesh, "tp")
        h = tp.gather_along(h, 0, mesh, "tp")
        h = tp.reduce_scatter_along(h * 2.0, 0, mesh, "tp")
        h = tp.reduce_from(tp.scatter_along(h, 1, mesh, "tp"), mesh, "tp")
        return tp.vocab_parallel_cross_entropy(h, torch.tensor([0, 1, 7, -100]), mesh, "tp")

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(mesh.rank))
    gm = make_fx(grad(loss))(x)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    traced = gm(x)
    eager = grad(loss)(x)
    return torch.equal(traced, eager), sorted(o for o in ops if "c10d" in o)


@pytest.fixture(scope="module")
def gloo_world():
    with fs.testing.LocalWorld(4, axes={"fsdp": 2, "tp": 2}) as world:
        yield world


def test_gloo_laws_and_mlp(gloo_world):
    run = gloo_world.run
    for pair in PAIRS:
        for shape, dim in (([6, 3], 0), ([3, 4, 5], 1), ([17, 2], 1)):
            check_adjoint(run, pair, shape, dim, seed=7)
    assert all(run(gather_of_split_is_identity, [6, 4], tp.Split(1, "tp"), 3))
    assert all(run(gather_of_split_is_identity, [12, 3], tp.Split(0, "tp", chunks=3), 4))
    expected_grads, expected = grad_and_value(mlp_loss)(mlp_weights(), *mlp_batch())
    for sequence_parallel in (False, True):
        for loss, grads in run(tensor_parallel_mlp, sequence_parallel):
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
            for name, g in grads.items():
                torch.testing.assert_close(g, expected_grads[name], rtol=1e-6, atol=1e-12)
    # the real mesh's loss parallelism gives the simulated mesh's bits (checked against torch there)
    real = run(vocab_parallel_case, 37, 64, torch.float32, 3)
    sim = simulated({"fsdp": 2, "tp": 2}).run(vocab_parallel_case, 37, 64, torch.float32, 3)
    for a, b in zip(real, sim):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_gloo_traced_gradient_holds_the_collectives(gloo_world):
    for same, ops in gloo_world.run(traced_graph_ops):
        assert same
        assert "_c10d_functional.all_gather_into_tensor.default" in ops
        assert "_c10d_functional.all_reduce.default" in ops
        assert "_c10d_functional.all_to_all_single.default" in ops  # gloo's reduce-scatter
        assert "_c10d_functional.wait_tensor.default" in ops


# --- fs.models.GPT by hand from its plan: the plan and the pieces compose ---------------------

GPT_CONFIG = GPTConfig(vocab_size=48, block_size=8, n_layer=2, n_head=4, d_model=16)


def gpt_params_and_batch():
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG).double()
    _, params = fs.functionalize(model)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, GPT_CONFIG.vocab_size, (2, 8), generator=g)
    targets = torch.randint(0, GPT_CONFIG.vocab_size, (2, 8), generator=g)
    targets[0, :3] = -100
    return model, dict(params.trainable), idx, targets


def gpt_tensor_parallel_loss(w, idx, targets, mesh):
    """`fs.models.GPT`'s forward on this rank's pieces (`gpt_rules`): vocabulary-parallel
    embedding, heads split per rank, column -> row parallel MLP, vocabulary-parallel loss."""
    from einops import rearrange

    c, n, i = GPT_CONFIG, mesh.shape["tp"], mesh.coordinates["tp"]
    vocab = w["tok_emb.weight"].shape[0]
    mine = (idx >= i * vocab) & (idx < (i + 1) * vocab)
    local = F.embedding(torch.where(mine, idx - i * vocab, 0), w["tok_emb.weight"]) * mine[..., None]
    x = tp.reduce_from(local, mesh) + w["pos_emb.weight"][: idx.shape[1]]
    head_dim = c.d_model // c.n_head
    for b in range(c.n_layer):
        p = lambda name: w[f"blocks.{b}.{name}"]  # noqa: E731
        h = tp.copy_to(F.layer_norm(x, (c.d_model,), p("ln1.weight"), p("ln1.bias")), mesh)
        q, k, v = rearrange(F.linear(h, p("attn.qkv.weight"), p("attn.qkv.bias")), "b t (three h d) -> three b h t d", three=3, d=head_dim)
        scores = torch.einsum("bhtd,bhsd->bhts", q, k) * head_dim**-0.5
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        out = rearrange(torch.einsum("bhts,bhsd->bhtd", scores.softmax(-1), v), "b h t d -> b t (h d)")
        x = x + tp.reduce_from(F.linear(out, p("attn.proj.weight")), mesh) + p("attn.proj.bias")
        h = tp.copy_to(F.layer_norm(x, (c.d_model,), p("ln2.weight"), p("ln2.bias")), mesh)
        h = F.gelu(F.linear(h, p("mlp.fc.weight"), p("mlp.fc.bias")))
        x = x + tp.reduce_from(F.linear(h, p("mlp.proj.weight")), mesh) + p("mlp.proj.bias")
    x = tp.copy_to(F.layer_norm(x, (c.d_model,), w["ln_f.weight"], w["ln_f.bias"]), mesh)
    return tp.vocab_parallel_cross_entropy(F.linear(x, w["tok_emb.weight"]), targets, mesh)


def gpt_tensor_parallel(mesh, full, idx, targets):
    placements = tp.placements_for(full, tp.gpt_rules(GPT_CONFIG), mesh)
    n, i = mesh.shape["tp"], mesh.coordinates["tp"]
    local = {k: tp.split_tensor(v, placements[k], i, n).contiguous() for k, v in full.items()}
    grads, loss = grad_and_value(gpt_tensor_parallel_loss)(local, idx, targets, mesh)
    return loss, {k: tp.gather_leaf(g, placements[k], mesh) for k, g in grads.items()}


@pytest.mark.parametrize("axes", [{"tp": 2}, {"tp": 4}, {"fsdp": 2, "tp": 2}])
def test_gpt_by_its_plan_equals_single_process(axes):
    from torch.func import functional_call

    model, full, idx, targets = gpt_params_and_batch()

    def loss_fn(params):
        logits = functional_call(model, params, (idx,), tie_weights=True, strict=False)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    expected_grads, expected = grad_and_value(loss_fn)(full)
    # (built once, here: thread-ranks share torch's global RNG, which GPT's init draws from)
    for loss, grads in simulated(axes).run(gpt_tensor_parallel, full, idx, targets):
        torch.testing.assert_close(loss, expected.float(), rtol=1e-6, atol=0)
        assert grads.keys() == expected_grads.keys()
        for name, g in grads.items():
            # The model runs in fp64, the loss in fp32 (as Megatron's): measured 6e-8 of the norm.
            assert float((g - expected_grads[name]).norm() / expected_grads[name].norm()) < 1e-6, name


# --- a Hugging Face Llama decoder layer by its own plan ---------------------------------------


def llama_layer_setup():
    torch.manual_seed(0)
    model = tiny_llama().double()  # 4 query heads, 2 key/value heads (GQA), head size 16
    x = torch.randn(2, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    position_embeddings = model.model.rotary_emb(x, torch.arange(8)[None].expand(2, 8))
    _, params = fs.functionalize(model)
    prefix = "model.layers.0."
    layer = {k[len(prefix) :]: v for k, v in params.trainable.items() if k.startswith(prefix)}
    return model, layer, x, position_embeddings


def llama_layer_loss(w, x, position_embeddings, layer, mesh=None):
    """Llama's decoder layer on `w` (this rank's pieces with a mesh: f before the column-parallel
    projections, g after the row-parallel ones, as the plan's styles say)."""
    from torch.func import functional_call

    def part(prefix):
        return {k[len(prefix) :]: v for k, v in w.items() if k.startswith(prefix)}

    f = (lambda h: tp.copy_to(h, mesh)) if mesh is not None else (lambda h: h)
    g = (lambda h: tp.reduce_from(h, mesh)) if mesh is not None else (lambda h: h)
    h = functional_call(layer.input_layernorm, part("input_layernorm."), (x,))
    attention, _ = functional_call(layer.self_attn, part("self_attn."), (f(h),), {"position_embeddings": position_embeddings, "attention_mask": None})
    x = x + g(attention)
    h = functional_call(layer.post_attention_layernorm, part("post_attention_layernorm."), (x,))
    x = x + g(functional_call(layer.mlp, part("mlp."), (f(h),)))
    return (x**2).mean()


def llama_layer_tensor_parallel(mesh, model, layer_params, x, position_embeddings):
    rules = tp.hf_rules(model)
    placements = tp.placements_for({f"model.layers.0.{k}": v for k, v in layer_params.items()}, [
        tp.rule(r.pattern, r.placement, required=False) for r in rules], mesh)  # fmt: skip
    placements = {k[len("model.layers.0.") :]: p for k, p in placements.items()}
    n, i = mesh.shape["tp"], mesh.coordinates["tp"]
    local = {k: tp.split_tensor(v, placements[k], i, n).contiguous() for k, v in layer_params.items()}
    # A copy per rank: functional_call swaps tensors into the module, and thread-ranks share it.
    layer = copy.deepcopy(model.model.layers[0])
    grads, loss = grad_and_value(llama_layer_loss)(local, x, position_embeddings, layer, mesh)
    return loss, {k: tp.gather_leaf(g, placements[k], mesh) for k, g in grads.items()}


@pytest.mark.parametrize("axes", [{"tp": 2}, {"fsdp": 2, "tp": 2}])
def test_llama_layer_by_its_own_plan_equals_single_process(axes):
    pytest.importorskip("transformers")
    model, layer_params, x, position_embeddings = llama_layer_setup()
    expected_grads, expected = grad_and_value(llama_layer_loss)(layer_params, x, position_embeddings, model.model.layers[0])
    for loss, grads in simulated(axes).run(llama_layer_tensor_parallel, model, layer_params, x, position_embeddings):
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert grads.keys() == expected_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, expected_grads[name], rtol=1e-6, atol=1e-12, msg=name)
