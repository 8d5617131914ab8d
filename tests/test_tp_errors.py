"""Bad tensor-parallel input is refused clearly, before any collective, on every rank.

Each case is a clear error naming the leaf (or module, or rule), its shape and dimension, the
mesh axis and its size, and what to do; raised on every rank (none left waiting), with no
collective but the agreement on `step.init`'s outcome, and the caller's parameters (or model)
untouched. Simulated meshes (threads) for everything rank-independent; one gloo world for plans
that differ across ranks, where the ranks' layouts are compared and a rank whose plan fails
alone must not leave the others waiting for the collective timeout.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch import nn

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig
from _meshes import mesh_of

CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, d_model=16)

# The collectives of a mesh (what `watch` records).
COLLECTIVES = (
    "all_gather_flat",
    "reduce_scatter_flat",
    "all_reduce_flat",
    "all_gather_world",
    "all_gather_axis_flat",
    "reduce_scatter_axis_flat",
)


def world_size(axes: dict[str, int]) -> int:
    n = 1
    for s in axes.values():
        n *= s
    return n


def simulated(axes: dict[str, int]) -> fs.testing.SimulatedWorld:
    return fs.testing.SimulatedWorld(world_size(axes), axes=axes, timeout=30)


def gpt_params():
    torch.manual_seed(0)
    return fs.functionalize(GPT(CONFIG))[1]


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    options = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    options.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**options))


def watch(mesh) -> list:
    """Record the collectives this rank's mesh runs from now on: `("agree", operation)` for an
    agreement (the small all-gather of which operation each rank enters), the method's name for
    any other collective."""
    log: list = []
    inside: list = []
    agree = mesh.agree

    def agreeing(operation, value=0):
        log.append(("agree", operation))
        inside.append(operation)
        try:
            return agree(operation, value)
        finally:
            inside.pop()

    mesh.agree = agreeing
    for name in COLLECTIVES:

        def recorded(*args, _method=getattr(mesh, name), _name=name, **kwargs):
            if not inside:
                log.append(_name)
            return _method(*args, **kwargs)

        setattr(mesh, name, recorded)
    return log


def no_loss(params, batch):
    raise AssertionError("never reached")


def refused_init(mesh, params, rules):
    """`step.init(params)` with placement `rules` on this rank: (error type, message, collectives
    run, params untouched), or None if it succeeded."""
    log = watch(mesh)
    before = [t.clone() for t in fs.tree_leaves(params)]
    try:
        step = fs.sharded_step(
            no_loss, mesh, optimizer=fs.optim.adamw(1e-3), placements=rules, schedule=fs.Schedule(trace=False)
        )
        step.init(params)
    except Exception as error:  # noqa: BLE001 (returned for the test to judge)
        untouched = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(params)))
        return type(error).__name__, str(error), log, untouched
    return None


def assert_refused(axes, params, rules, kind, *parts):
    """Every rank of `axes` refuses `step.init` with a `kind` error whose message holds every
    one of `parts`; no collective but the agreement on init's outcome; params untouched."""
    results = simulated(axes).run(refused_init, params, rules)
    assert all(results), results  # every rank refuses
    for name, message, log, untouched in results:
        assert name == kind, message
        for part in parts:
            assert part in message, (part, message)
        assert [c for c in log if c != ("agree", "step.init")] == [], log
        assert untouched
    return results[0][1]


# --- a split dimension the axis does not divide ------------------------------------------------


def test_split_dimension_not_divisible_by_the_axis_is_refused():
    params = gpt_params()
    rules = [tp.rule("blocks.*.mlp.fc.weight", tp.Split(0, "tp"))]
    assert_refused(
        {"fsdp": 2, "tp": 3}, params, rules, "PlacementError",
        "leaf 'blocks.0.mlp.fc.weight'", "shape [64, 16]", "dimension 0 (size 64)", "axis 'tp' of size 3",
        "64 is not divisible by 3", "{'fsdp': 2, 'tp': 3}",
        "Choose a tp size that divides it", "pad the model's dimension to a multiple of 3", "Replicated()",
    )  # fmt: skip
    # Fused q|k|v of 4 heads of 4: whole heads per block cannot be shared by 3 ranks.
    assert_refused(
        {"tp": 3}, params, tp.gpt_rules(CONFIG, vocab_parallel=False), "PlacementError",
        "leaf 'blocks.0.attn.qkv.weight'", "[48, 16]", "dimension 0 (size 48)", "axis 'tp' of size 3",
        "4 units of 4 elements (attention heads) per block", "cannot be shared equally by 3 ranks", "multiple of 36",
    )  # fmt: skip


def test_gqa_key_value_heads_not_divisible_by_tp_are_refused_by_init_and_parallelize():
    pytest.importorskip("transformers")
    model = tiny_llama()  # 4 query heads, 2 key/value heads of 16
    _, params = fs.functionalize(model)
    rules = tp.hf_rules(model)
    parts = (
        "leaf 'model.layers.0.self_attn.k_proj.weight'", "[32, 64]", "dimension 0 (size 32)", "axis 'tp' of size 4",
        "2 units of 16 elements (attention heads)", "cannot be shared equally by 4 ranks", "Choose a tp size",
    )  # fmt: skip
    assert_refused({"tp": 4}, params, rules, "PlacementError", *parts)
    # parallelize refuses the same plan before it changes any module.
    for name, message, changed in simulated({"tp": 4}).run(parallelize_refused, tiny_llama, rules):
        assert name == "PlacementError" and changed == []
        assert all(part in message for part in parts), message
    # The query heads (4) alone divide: tp 2 places the model.
    placed = tp.placements_for(params, rules, {"tp": 2})
    assert placed["model.layers.0.self_attn.k_proj.weight"] == tp.Split(0, "tp", granule=16)
    # GPT-NeoX's fused query_key_value holds each head's q, k, v rows together: cut between heads
    # (3 heads at tp 2 crashed inside transformers with a reshape error: an adversarial pass).
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    neox = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=3, tie_word_embeddings=False))  # fmt: skip
    _, neox_params = fs.functionalize(neox)
    assert_refused({"tp": 2}, neox_params, tp.hf_rules(neox), "PlacementError", "query_key_value.weight'", "3 units of 24 elements")
    neox4 = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                             num_attention_heads=4, tie_word_embeddings=False))  # fmt: skip
    placed = tp.placements_for(fs.functionalize(neox4)[1], tp.hf_rules(neox4), {"tp": 2})
    assert placed["gpt_neox.layers.0.attention.query_key_value.weight"] == tp.Split(0, "tp", granule=24)
    assert placed["gpt_neox.layers.0.attention.dense.weight"] == tp.Split(1, "tp", granule=8)
    assert placed["gpt_neox.layers.0.mlp.dense_4h_to_h.weight"] == tp.Split(1, "tp")


# --- rules that do not fit the tree --------------------------------------------------------------


def test_a_rule_that_matches_nothing_is_refused():
    rules = tp.gpt_rules(CONFIG) + [tp.rule("blocks.*.mlp.fcc.weight", tp.Split(0, "tp"))]
    assert_refused(
        {"fsdp": 2, "tp": 2}, gpt_params(), rules, "PlacementError",
        "rule('blocks.*.mlp.fcc.weight', Split(dim=0, axis='tp')) matched no leaf",
        "tok_emb.weight, pos_emb.weight, blocks.0.ln1.weight", "Fix the pattern", "required=False",
    )  # fmt: skip
    # A rule shadowed by an earlier one matches nothing either.
    shadowed = [tp.rule("blocks.*.mlp.*", tp.Replicated())] + tp.gpt_rules(CONFIG)
    assert_refused(
        {"tp": 2}, gpt_params(), shadowed, "PlacementError",
        "rule('blocks.*.mlp.fc.weight', Split(dim=0, axis='tp'))", "only leaves an earlier rule took",
    )  # fmt: skip


def test_an_unknown_axis_name_is_refused():
    # in the mesh: never a silent replica axis
    # refused before it joins a world (an earlier test of this worker may have left one: unchanged)
    joined = torch.distributed.is_initialized()
    with pytest.raises(ValueError, match=r"unknown mesh axis name 'tensor'.*'fsdp'.*'tp' \(tensor parallel\)"):
        fs.init_mesh({"tensor": 2})
    assert torch.distributed.is_initialized() == joined
    with pytest.raises(fs.RankError, match=r"unknown mesh axis name 'model'.*rename it"):
        fs.testing.SimulatedWorld(2, axes={"model": 2}).run(lambda mesh: None)
    # in a placement: the axis the mesh does not have, and the ones it has
    rules = [tp.rule("blocks.*.mlp.fc.weight", tp.Split(0, "model"))]
    assert_refused(
        {"fsdp": 2, "tp": 2}, gpt_params(), rules, "PlacementError",
        "leaf 'blocks.0.mlp.fc.weight'", "[64, 16]", "axis 'model'", "{'fsdp': 2, 'tp': 2} does not have",
        "name one of ['fsdp', 'tp'] in Split(axis=...)",
    )  # fmt: skip


def missing_placements(mesh):
    errors = []
    for make in (
        lambda: fs.sharded_step(no_loss, mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False)),
        lambda: fs.shard({"w": torch.ones(4, 4)}, mesh),
    ):
        log = watch(mesh)
        try:
            make()
            errors.append(None)
        except Exception as error:  # noqa: BLE001
            errors.append((type(error).__name__, str(error), log))
    return errors


def test_placements_missing_on_a_tp_mesh_are_refused():
    for step_error, shard_error in simulated({"fsdp": 2, "tp": 2}).run(missing_placements):
        name, message, log = step_error
        assert name == "MeshError" and log == []
        for part in ("{'fsdp': 2, 'tp': 2}", "tensor-parallel axis 'tp'", "no placements",
                     "placements=fs.tensor_parallel.hf_rules(model)", "gpt_rules(config)", "parallelize"):  # fmt: skip
            assert part in message, (part, message)
        name, message, log = shard_error
        assert name == "MeshError" and log == []
        assert "fs.shard does not apply the model-parallel axis 'tp' (size 2)" in message, message


def test_a_split_over_a_data_axis_is_refused():
    params = gpt_params()
    assert_refused(
        {"fsdp": 2, "tp": 2}, params, [tp.rule("blocks.*.mlp.fc.weight", tp.Split(0, "fsdp"))], "PlacementError",
        "leaf 'blocks.0.mlp.fc.weight'", "[64, 16]", "split over axis 'fsdp'", "data-parallel",
        "{'fsdp': 2, 'tp': 2}", "Use Split(dim, 'tp')",
    )  # fmt: skip
    # ... also where the data axis does not divide the dimension (not "choose a replicate size").
    message = assert_refused(
        {"replicate": 3, "tp": 2}, params, [tp.rule("blocks.*.mlp.fc.weight", tp.Split(0, "replicate"))],
        "PlacementError", "leaf 'blocks.0.mlp.fc.weight'", "split over axis 'replicate'", "data-parallel",
        "Use Split(dim, 'tp')",
    )  # fmt: skip
    assert "Choose a replicate size" not in message


def test_a_split_of_a_module_buffer_is_refused():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
    _, params = fs.functionalize(model)
    rules = [tp.rule("0.weight", tp.Split(0, "tp")), tp.rule("1.running_mean", tp.Split(0, "tp"))]
    assert_refused(
        {"tp": 2}, params, rules, "PlacementError",
        "leaf '1.running_mean'", "shape [6]", "module buffer", "Split(dim=0, axis='tp')", "narrow the rule's pattern",
    )  # fmt: skip


# --- parallelize: a style fs does not apply to the module ----------------------------------------


def parallelize_refused(mesh, make, rules):
    """`parallelize(make(), rules, mesh)` on this rank: (error type, message, paths of the modules
    whose class it changed), or None if it succeeded."""
    model = make()
    classes = {name: type(m) for name, m in model.named_modules()}
    try:
        tp.parallelize(model, rules, mesh)
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), [n for n, m in model.named_modules() if type(m) is not classes[n]]
    return None


def gpt():
    torch.manual_seed(0)
    return GPT(CONFIG)


@pytest.mark.parametrize(
    "rule, parts",
    [
        (tp.Rule("blocks.*.ln1.weight", tp.Split(0, "tp"), True, "colwise"),
         ("module 'blocks.0.ln1' (LayerNorm)", "style 'colwise'", "nn.Linear", "nn.Embedding", "rule without a style")),
        (tp.Rule("tok_emb.weight", tp.Split(0, "tp"), True, "rowwise"),
         ("module 'tok_emb' (Embedding)", "style 'rowwise'", "'embedding_rowwise'")),
        (tp.Rule("blocks.*.mlp.fc.weight", tp.Split(0, "tp"), True, "embedding_rowwise"),
         ("module 'blocks.0.mlp.fc' (Linear)", "style 'embedding_rowwise'", "'colwise'")),
    ],
)  # fmt: skip
def test_parallelize_refuses_a_style_the_module_type_has_not(rule, parts):
    for name, message, changed in simulated({"tp": 2}).run(parallelize_refused, gpt, [rule]):
        assert name == "PlacementError" and changed == []
        for part in parts:
            assert part in message, (part, message)
    # A style Hugging Face names that fs cannot place is refused by the plan itself.
    with pytest.raises(tp.PlacementError, match=r"'layers\.\*\.mlp\.experts'.*style 'grouped_gemm'.*supported styles"):
        tp.rules_from_hf_plan({"layers.*.mlp.experts": "grouped_gemm"})


def test_parallelize_refusing_a_later_module_leaves_the_earlier_ones_untouched():
    late_norm = [tp.Rule("blocks.*.ln2.weight", tp.Split(0, "tp"), True, "colwise")] + tp.gpt_rules(CONFIG)
    split_bias = [tp.Rule("blocks.*.mlp.proj.bias", tp.Split(0, "tp"), True, "rowwise")] + tp.gpt_rules(CONFIG)
    for rules, part in ((late_norm, "module 'blocks.0.ln2' (LayerNorm)"),
                        (split_bias, "module 'blocks.0.mlp.proj' is row-parallel ('rowwise') but its bias is split")):  # fmt: skip
        for name, message, changed in simulated({"tp": 2}).run(parallelize_refused, gpt, rules):
            assert name == "PlacementError" and part in message, message
            assert changed == []  # at d1db00c: tok_emb, blocks.0.attn.qkv, blocks.0.attn.proj (and mlp.fc) changed


# --- plans that differ across ranks (real processes) -------------------------------------------


def init_with_rank_plan(_, plans: dict):
    """`step.init` on `{"fsdp": 2, "tp": 2}` where rank r passes the rules `plans.get(r, "gpt")`
    names; (error type, message, seconds) or (None, None, seconds)."""
    mesh = fs.init_mesh(TP_MESH)  # over the session's world of 4
    torch.manual_seed(0)
    _, params = fs.functionalize(GPT(CONFIG))
    rules = {
        "gpt": tp.gpt_rules(CONFIG),
        "not vocab parallel": tp.gpt_rules(CONFIG, vocab_parallel=False),
        "matches nothing": tp.gpt_rules(CONFIG) + [tp.rule("blocks.*.mlp.fcc.weight", tp.Split(0, "tp"))],
    }[plans.get(mesh.rank, "gpt")]
    schedule = fs.Schedule(trace=False)
    step = fs.sharded_step(no_loss, mesh, optimizer=fs.optim.sgd(0.1), placements=rules, schedule=schedule)
    start = time.monotonic()
    try:
        step.init(params)
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error), time.monotonic() - start
    return None, None, time.monotonic() - start


TP_MESH = {"fsdp": 2, "tp": 2}


def test_plans_that_differ_across_ranks_are_named_on_every_rank(local_world):
    gloo_world = local_world(4)
    # Rank 1 replicates the vocabulary its peers split: the layouts differ, and every rank says
    # which ranks hold which placement of which leaf.
    for name, message, seconds in gloo_world.run(init_with_rank_plan, {1: "not vocab parallel"}):
        assert name == "MeshError", message
        for part in ("ranks [0, 2, 3]", "ranks [1]", "'tok_emb.weight'", "Split(dim=0, axis='tp')",
                     "piece [32, 16] of [64, 16]", "whole [64, 16]", "placements="):  # fmt: skip
            assert part in message, (part, message)
        assert seconds < 10
    # Rank 3's plan fails on its own: it raises its error, the others name it at once instead
    # of waiting for it until the collective timeout (60 s).
    results = gloo_world.run(init_with_rank_plan, {3: "matches nothing"})
    name, message, seconds = results[3]
    assert name == "PlacementError" and "'blocks.*.mlp.fcc.weight'" in message
    for name, message, seconds in results[:3]:
        assert name == "PeerError", message
        assert "rank [3]" in message or "ranks [3]" in message, message
        assert "placements=" in message and seconds < 10
    # The world goes on: the same plan everywhere initializes.
    assert [r[0] for r in gloo_world.run(init_with_rank_plan, {})] == [None] * 4


def forgot_parallelize(mesh):
    """A tiny Llama whose rules are passed to the step but whose modules were never parallelized:
    the step refuses it on the first call instead of training the unsummed pieces."""
    model = tiny_llama()
    rules = fs.tensor_parallel.hf_rules(model)
    apply_fn, params = fs.functionalize(model)  # no fs.tensor_parallel.parallelize(model, rules, mesh)
    step = fs.sharded_step(lambda p, ids: apply_fn(p, input_ids=ids).logits.float().mean(), mesh,
                           optimizer=fs.optim.sgd(0.1), placements=rules, schedule=fs.Schedule(trace=False))  # fmt: skip
    state = step.init(params, values="trust")  # (thread ranks draw different initial weights)
    try:
        step(state, torch.zeros(2, 8, dtype=torch.long))
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return None


def test_styled_rules_on_a_model_never_parallelized_are_refused():
    pytest.importorskip("transformers")
    for result in simulated({"tp": 2}).run(forgot_parallelize):
        assert result is not None, "the step trained an unparallelized model on split pieces"
        name, message = result
        assert name == "PlacementError", (name, message)
        for part in ("'colwise' over 'tp'", "no tensor-parallel collective", "fs.tensor_parallel.parallelize(model, rules, mesh)"):
            assert part in message, (part, message)


class _Split(nn.Module):
    """A column-parallel layer whose output is all ones, dropout, a row-parallel layer: with one
    input row, d(sum of outputs) / d proj.weight[0, j] is 2 x the mask of hidden unit j."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc, self.drop, self.proj = nn.Linear(4, hidden), nn.Dropout(0.5), nn.Linear(hidden, 1)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.bias.fill_(1.0)

    def forward(self, x):
        return self.proj(self.drop(self.fc(x)))


SPLIT_RULES = [tp.Rule("fc.weight", tp.Split(0, "tp"), True, "colwise"), tp.Rule("fc.bias", tp.Split(0, "tp"), True, "colwise"),
               tp.Rule("proj.weight", tp.Split(1, "tp"), True, "rowwise"), tp.Rule("proj.bias", tp.Replicated(), True, "rowwise")]  # fmt: skip


def dropout_under_tp(mesh, trace: bool):
    """At {"tp": 2}: (1) the masks of a dropout between a column- and a row-parallel layer, read
    off the gradient, for the whole hidden layer; (2) a GPT with dropout 0.1 everywhere trained
    two steps (its attention dropout on the rank's own heads, its residual and embedding dropout
    on activations both ranks hold); (3) a Hugging Face Llama whose sdpa gets dropout_p, refused."""
    mesh = mesh_of(mesh, {"tp": 2})
    torch.manual_seed(0)
    model = tp.parallelize(_Split(), SPLIT_RULES, mesh)
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, x: apply_fn(p, x).sum(), mesh, optimizer=fs.optim.sgd(0.1), placements=SPLIT_RULES,
                           schedule=fs.Schedule(trace=trace))  # fmt: skip
    x = torch.randn(1, 4, generator=torch.Generator().manual_seed(0))
    grads, _ = step.grad(step.init(params, seed=0), x)
    mask = (fs.gather(grads, full=True).trainable["proj.weight"][0] / 2).tolist()

    config = dataclasses.replace(CONFIG, dropout=0.1)
    rules = fs.tensor_parallel.gpt_rules(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    trained = {}
    for t in (trace, False):
        torch.manual_seed(0)
        apply_fn, params = fs.functionalize(fs.tensor_parallel.parallelize(GPT(config), rules, mesh))
        step = fs.sharded_step(lambda p, ids: apply_fn(p, ids).float().mean(), mesh, optimizer=fs.optim.sgd(0.1),
                               placements=rules, schedule=fs.Schedule(trace=t))  # fmt: skip
        state = step.init(params, values="trust")
        for _ in range(2):
            state, _ = step(state, ids)
        trained[t] = fs.gather(state.params, full=True).trainable
    whole = fs.tree_leaves({k: v for k, v in trained[trace].items() if "ln" in k or "pos_emb" in k or "proj.bias" in k})
    same = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(trained[trace]), fs.tree_leaves(trained[False])))

    llama = tiny_llama(attention_dropout=0.1, attn_implementation="sdpa")
    hf_rules = fs.tensor_parallel.hf_rules(llama)
    apply_fn, params = fs.functionalize(fs.tensor_parallel.parallelize(llama, hf_rules, mesh))
    step = fs.sharded_step(lambda p, ids: apply_fn(p, input_ids=ids).logits.float().mean(), mesh, optimizer=fs.optim.sgd(0.1),
                           placements=hf_rules, schedule=fs.Schedule(trace=trace))  # fmt: skip
    try:
        step(step.init(params, values="trust"), torch.zeros(2, 8, dtype=torch.long))
        refused = None
    except fs.StepError as error:
        refused = str(error)
    return mask, whole, same, refused


@pytest.mark.parametrize("trace", [False, True])
def test_dropout_on_a_split_activation_draws_per_rank(local_world, trace):
    """Before, both ranks drew the same mask for their halves (32 of 32 bits equal: an adversarial
    pass); now each rank keeps its own of the masks drawn for all (Megatron's per-rank stream)."""
    pytest.importorskip("transformers")
    (mask0, whole0, same0, refused0), (mask1, whole1, same1, refused1) = local_world(2).run(dropout_under_tp, trace)
    assert mask0 == mask1 and set(mask0) == {0.0, 1.0}, mask0  # the gathered gradient: the same on both ranks
    assert mask0[:32] != mask0[32:] and 8 < sum(mask0) < 56, mask0  # independent halves, p = 0.5
    assert same0 and same1  # traced == eager
    assert whole0 and all(torch.equal(a, b) for a, b in zip(whole0, whole1))  # one mask on what both ranks hold
    for refused in (refused0, refused1):
        assert refused is not None and "(scaled_dot_product_attention, dropout_p=0.1)" in refused and "split over ['tp']" in refused, refused
        assert "fs draws per rank for F.dropout / nn.Dropout only" in refused


def pipelined_dropout(mesh, sequence_parallel: bool):
    """A GPT with dropout 0.1 at {"pp": 2, "tp": 2}, 1F1B: its attention dropout drawn per rank,
    or with sequence parallelism every dropout the whole activation's mask. Both draws are made
    from the activation (`new_empty`): a draw that reads no value was refused by the pipeline's
    cut ("random numbers from the batch alone": an adversarial pass)."""
    mesh = mesh_of(mesh, {"pp": 2, "tp": 2})
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.1)
    rules = tp.gpt_rules(config)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(tp.parallelize(GPT(config), rules, mesh, sequence_parallel=sequence_parallel))

    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), placements=rules, microbatches=2,
                           pipeline=fs.pipeline.Pipeline("1f1b"))  # fmt: skip
    state = step.init(params, seed=0)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        state, metrics = step(state, (ids, ids.roll(-1, 1)))
    return float(metrics["local_loss"]), mesh.coordinates["pp"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipelined_tensor_parallel_dropout_trains(local_world, sequence_parallel):
    got = local_world(4).run(pipelined_dropout, sequence_parallel)
    losses = {pp: {loss for loss, p in got if p == pp} for pp in (0, 1)}
    assert all(len(v) == 1 for v in losses.values()), got  # the tp partners of a stage agree


def whole_leaf_on_split_heads(mesh, sequence_parallel: bool):
    from transformers import PhiConfig, PhiForCausalLM

    torch.manual_seed(0)
    model = PhiForCausalLM(PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, qk_layernorm=True))  # fmt: skip
    rules = tp.hf_rules(model)
    apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh, sequence_parallel=sequence_parallel))
    step = fs.sharded_step(lambda p, ids: apply_fn(p, input_ids=ids).logits.float().mean(), mesh,
                           optimizer=fs.optim.sgd(0.1), placements=rules, schedule=fs.Schedule(trace=False))  # fmt: skip
    try:
        step(step.init(params, values="trust"), torch.zeros(2, 8, dtype=torch.long))
    except tp.PlacementError as error:
        return str(error)
    return None


def test_a_whole_parameter_used_on_split_activations_is_refused():
    """Phi's per-head q/k LayerNorms are not in its tensor-parallel plan: kept whole, they ran on
    each rank's own heads, and each rank applied its part of their gradient (99 % off single-process
    training, the replicas drifting apart: an adversarial pass; also Apertus' xIELU, Cohere's
    per-head norms). Refused, naming the leaf and the fixes; with sequence parallelism, which
    all-reduces every whole parameter's gradient, it trains."""
    pytest.importorskip("transformers")
    for message in simulated({"tp": 2}).run(whole_leaf_on_split_heads, False):
        assert message is not None and "leaf 'model.layers.0.self_attn.q_layernorm.weight' is whole on every rank of ['tp']" in message
        assert "'replicated_with_grad_allreduce'" in message and "sequence_parallel=True" in message, message
    assert simulated({"tp": 2}).run(whole_leaf_on_split_heads, True) == [None, None]
