"""Pipelined steps planned before they run (issue 27, analysis): on `fs.analysis.AbstractMesh`,
in this process, no ranks and no memory.

- `plan_pipeline`: the schedule's bubble at the stages' predicted costs, the in-flight
  activations per rank = `fs.pipeline.peak_in_flight` x the bytes one micro-batch's forward saves,
  point-to-point bytes = what crosses each boundary x M (activations forward, cotangents back);
- `tune_pipeline`: schedules x micro-batch counts x stage cuts, those within the budget first,
  fastest first, each with its reason; a cut's figures composed from per-unit ones equal those of
  a step built with that cut; a heavy head gets a cut of its own, a tight budget a lighter cut;
- `balance_stages`: a contiguous cut covering every unit that is never slower (predicted) than
  the default cut, and gives the heavy head of a large vocabulary a stage of its own;
- a 3-D layout (`{"pp": 2, "fsdp": 2, "tp": 2}`) of a Hugging Face Llama plans.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig


def _gpt(vocab=64, layers=4, d=32):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=layers, n_head=2, d_model=d, tie_weights=False))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    return loss_fn, params


def _batch(rows=8, length=32):
    x = torch.empty(rows, length, dtype=torch.long, device="meta")
    return x, x


def test_plan_and_tune_a_pipelined_gpt_on_an_abstract_mesh():
    loss_fn, params = _gpt()
    mesh = fs.analysis.AbstractMesh({"pp": 2, "fsdp": 2})
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=4, pipeline="1f1b")
    state = step.init_abstract(params)
    assert all(s.device.type == "meta" for s in state.params.shards)
    plan = fs.analysis.plan_pipeline(step, state, _batch())
    assert plan.num_ranks == 2 and len(plan.stages) == 2 and plan.peak_in_flight == (2, 1)
    for r in range(2):
        held = [s for s in plan.stages if s.rank == r]
        assert plan.activation_bytes[r] == sum(plan.peak_in_flight[s.stage] * s.saved_bytes for s in held)
    # what stage 0 sends forward per micro-batch comes back as cotangents: each rank sends M x that
    assert plan.stages[0].sent_bytes == 4 * 32 * 32 * 4 // 2  # [rows / M, length, d] float32: the residual stream
    assert plan.p2p_bytes == (4 * plan.stages[0].sent_bytes, 4 * plan.stages[0].sent_bytes)
    assert 0 < min(plan.bubble) <= max(plan.bubble) < 0.5
    assert "pipeline 1f1b" in plan.explain()
    gpipe = fs.analysis.plan_pipeline(step, state, _batch(), schedule="gpipe")
    assert gpipe.peak_in_flight == (4, 4) and gpipe.activation_bytes[0] > plan.activation_bytes[0]
    budget = (max(plan.peak_bytes) + max(gpipe.peak_bytes)) // 2  # 1F1B at M=4 fits, GPipe at M=4 does not
    ranked = fs.analysis.tune_pipeline(step, state, _batch(), budget_bytes=budget, cuts=False)  # the step's own cut
    assert all(c.cut == "own" and c.stages == (("input", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "output")) for c in ranked)
    assert all(c.why for c in ranked)
    fits = [c.fits for c in ranked]
    assert fits == sorted(fits, reverse=True)  # every candidate within the budget ranks first
    within = [c for c in ranked if c.fits]
    assert [c.step_s for c in within] == sorted(c.step_s for c in within)
    assert any(c.schedule == "1f1b" and c.microbatches == 4 for c in within)
    assert not any(c.schedule == "gpipe" and c.microbatches == 4 and c.fits for c in ranked)


def test_peak_bytes_walks_activations_and_gradients_action_by_action():
    a, g = 4.5, 3.2  # one micro-batch's saved bytes per stage, a stage's summed gradients
    # 1F1B, 2 ranks, 2 micro-batches: rank 0 F0 F1 B0 B1 holds 2 micro-batches before any gradient,
    # then 1 micro-batch and the gradients; rank 1 F0 B0 F1 B1: one micro-batch, then the gradients and one
    assert fs.pipeline.peak_bytes(fs.pipeline.one_f_one_b(2, 2), [a, a], [g, g]) == (2 * a, a + g)
    # with gradients larger than a micro-batch the steady state is the peak: 1F1B at M=4 on rank 0:
    # F0 F1 B0 F2 B1 F3 B2 B3 -> after B0, F2: 2 micro-batches and the gradients
    assert fs.pipeline.peak_bytes(fs.pipeline.one_f_one_b(2, 4), [a, a], [10.0, 10.0])[0] == 2 * a + 10.0
    # GPipe: every forward first, then the first backward frees one micro-batch as the gradients come
    assert fs.pipeline.peak_bytes(fs.pipeline.gpipe(2, 4), [a, a], [g, g]) == (4 * a, 4 * a)
    assert fs.pipeline.peak_bytes(fs.pipeline.gpipe(2, 4), [a, a], [9.0, 9.0]) == (3 * a + 9.0, 3 * a + 9.0)
    # a split backward frees a micro-batch at its W (the I leaves the stage's saved values to the W)
    zb = fs.pipeline.zero_bubble_h1(2, 4)
    walked = fs.pipeline.peak_bytes(zb, [a, a], [0.0, 0.0])
    assert walked == tuple(k * a for k in fs.pipeline.peak_in_flight(zb))
    # interleaved: a rank's two stages walked together, never more than their separate peaks added
    inter = fs.pipeline.interleaved_1f1b(2, 4)
    sep = fs.pipeline.peak_in_flight(inter)
    walked = fs.pipeline.peak_bytes(inter, [1.0] * 4, [0.5] * 4)
    for r in range(2):
        stages = inter.stages_of(r)
        assert max(sep[s] for s in stages) <= walked[r] <= sum(sep[s] for s in stages) + 0.5 * len(stages)


def test_balance_stages_gives_a_heavy_head_its_own_stage():
    loss_fn, params = _gpt(vocab=65536, layers=6, d=256)
    cut = fs.analysis.balance_stages(loss_fn, params, _batch(8, 32), 3)
    units = ["input", *(f"blocks.{i}" for i in range(6)), "output"]
    assert [u for stage in cut for u in stage] == units and all(cut)
    assert len(cut[-1]) < 3  # the head and loss over 65536 classes weigh more than a block: fewer blocks with them
    mesh = fs.analysis.AbstractMesh({"pp": 3})
    times = {}
    for name, stages in (("default", None), ("balanced", cut)):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=3,
                               pipeline=fs.pipeline.Pipeline("1f1b", stages=stages))  # fmt: skip
        state = step.init_abstract(params)
        times[name] = fs.analysis.plan_pipeline(step, state, _batch(24, 32)).makespan_s
    assert times["balanced"] < times["default"]


def test_a_three_dimensional_layout_of_a_hugging_face_llama_plans():
    from transformers import LlamaConfig, LlamaForCausalLM

    mesh = fs.analysis.AbstractMesh({"pp": 2, "fsdp": 2, "tp": 2})
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    rules = tp.hf_rules(model)
    apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh))

    def loss_fn(p, batch):
        ids, labels = batch
        return F.cross_entropy(apply_fn(p, input_ids=ids).logits.flatten(0, 1), labels.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=4, pipeline="zb_h1",
                           placements=rules)  # fmt: skip
    plan = fs.analysis.plan_pipeline(step, step.init_abstract(params), _batch(8, 16))
    assert plan.fsdp == 2 and plan.peak_in_flight == (2, 2)
    # each rank holds half the model's pieces (tp 2 already cut them): elements of its stages
    total = sum(s.param_elements for s in plan.stages)
    whole = sum(p.numel() for p in model.parameters())
    assert whole // 2 < total < whole


def _llama(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        ids, labels = batch
        return F.cross_entropy(apply_fn(p, input_ids=ids).logits.flatten(0, 1), labels.flatten())

    return loss_fn, params


def test_a_cut_composed_from_units_plans_as_a_step_built_with_that_cut():
    # Llama: rotary tables every block recomputes (once per stage), a stage's I keeping more than its
    # blocks' alone (the pair corrections), zero bubble (the bytes held from I to W count)
    from functional_shard.analysis._cuts import unit_table

    loss_fn, params = _llama()
    mesh, batch = fs.analysis.AbstractMesh({"pp": 2}), _batch(8, 16)
    cut = (("input", "model.layers.0"), ("model.layers.1", "model.layers.2", "model.layers.3", "output"))
    steps = {}
    for stages in (None, cut):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=4,
                               pipeline=fs.pipeline.Pipeline("zb_h1", stages=stages))  # fmt: skip
        steps[stages] = step, step.init_abstract(params)
    real = fs.analysis.plan_pipeline(*steps[cut], batch)
    step, state = steps[None]  # the default cut ("blocks": 3 + 3 units), composed into the other
    table = unit_table(step, state, batch, fs.analysis.h100_sxm())
    assert table.units == tuple(u for stage in cut for u in stage)
    composed = table.figures([(0, 2), (2, 6)])
    close = lambda a, b: abs(a - b) <= 0.01 * b  # noqa: E731
    for r, c in zip(real.stages, composed):
        assert c.flops == r.forward_flops and c.elements == r.param_elements and c.sent == r.sent_bytes
        assert close(c.seconds, r.forward_s) and close(c.saved, r.saved_bytes) and close(c.held, r.held_after_input_bytes)
    assert composed[1].held > composed[1].saved  # the kept gradients: zero bubble's held bytes are not the saved ones
    (candidate,) = fs.analysis.tune_pipeline(step, state, batch, schedules=("zb_h1",), microbatches=(4,), cuts=[cut])
    assert candidate.stages == cut and candidate.cut == "given"
    assert close(candidate.step_s, real.makespan_s) and close(candidate.peak_bytes, max(real.peak_bytes))
    # a given cut for another stage count names why nothing was planned; counts and schedules are checked
    three = (cut[0][:1], cut[0][1:], cut[1])
    (lost,) = fs.analysis.tune_pipeline(step, state, batch, schedules=("zb_h1",), microbatches=(4,), cuts=[three])
    assert not lost.fits and "none of the given cuts has 2 stages (they have [3])" in lost.why, lost.why
    for bad, match in [(dict(microbatches=(0,)), "counts >= 1"), (dict(schedules=()), "at least one schedule")]:
        with pytest.raises(ValueError, match=match):
            fs.analysis.tune_pipeline(step, state, batch, **bad)
    with pytest.raises(ValueError, match="do not cut into microbatches=3"):
        fs.analysis.plan_pipeline(step, state, batch, microbatches=3)


def test_tune_pipeline_cuts_a_heavy_head_off_and_predicts_it_faster():
    loss_fn, params = _gpt(vocab=65536, layers=6, d=256)
    mesh = fs.analysis.AbstractMesh({"pp": 3})
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=3, pipeline="1f1b")
    state = step.init_abstract(params)
    ranked = fs.analysis.tune_pipeline(step, state, _batch(24, 32), schedules=("1f1b", "zb_h1"), microbatches=(3, 6))
    blocks = (("input", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3"), ("blocks.4", "blocks.5", "output"))
    best = ranked[0]
    assert best.fits and best.stages != blocks and len(best.stages[-1]) < 3  # fewer blocks beside the head
    (same,) = [c for c in ranked if (c.schedule, c.microbatches, c.stages) == (best.schedule, best.microbatches, blocks)]
    assert same.cut == "own" and best.step_s < 0.95 * same.step_s
    assert "slowest stage" in same.why
    # every contiguous cut of 8 units into 3 stages (21) was planned, once, per schedule and count
    assert len(ranked) == 2 * 2 * 21 and len({(c.schedule, c.microbatches, c.stages) for c in ranked}) == len(ranked)


def test_tune_pipeline_under_a_tight_budget_takes_a_lighter_cut():
    # 1F1B at pp 2: stage 0 holds 2 micro-batches, stage 1 one; moving blocks to stage 1 lightens rank 0
    loss_fn, params = _gpt(vocab=64, layers=6, d=64)
    mesh = fs.analysis.AbstractMesh({"pp": 2})
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=4, pipeline="1f1b")
    state = step.init_abstract(params)
    batch = _batch(16, 64)
    tune = lambda budget: fs.analysis.tune_pipeline(step, state, batch, budget_bytes=budget, schedules=("1f1b",),  # noqa: E731
                                                    microbatches=(4,))  # fmt: skip
    free = tune(None)
    fastest = free[0]
    (memory,) = [c for c in free if c.cut == "memory"]
    assert memory.peak_bytes == min(c.peak_bytes for c in free) < fastest.peak_bytes
    assert len(memory.stages[0]) < len(memory.stages[1])
    budget = (memory.peak_bytes + fastest.peak_bytes) // 2
    ranked = tune(budget)
    assert ranked[0].fits and ranked[0].stages != fastest.stages
    over = [c for c in ranked if not c.fits]
    assert over and over[0].step_s < ranked[0].step_s  # a faster cut ranked below: it does not fit
    assert "fits at this schedule and micro-batches" in over[0].why


def test_a_tied_gpt_plans_with_its_weight_lent_once_per_step_and_its_cut_composes():
    # the head's matmul reads the tied weight's transpose, made on stage 0 and received: a stage
    # input made of parameters alone, sent with the first micro-batch only (`Boundary.lent`)
    from functional_shard.analysis._cuts import unit_table

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, d_model=32, tie_weights=True))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    step = fs.sharded_step(loss_fn, fs.analysis.AbstractMesh({"pp": 2}), optimizer=fs.optim.adamw(lr=1e-3), microbatches=4,
                           pipeline="1f1b")  # fmt: skip
    state = step.init_abstract(params)
    plan = fs.analysis.plan_pipeline(step, state, _batch())
    assert plan.stages[0].sent_bytes == 2 * 32 * 32 * 4  # the residual stream, per micro-batch
    assert plan.stages[0].lent_bytes == 64 * 32 * 4  # the tied weight, once per step (its cotangents' sum back once)
    assert plan.p2p_bytes == (4 * 2 * 32 * 32 * 4 + 64 * 32 * 4,) * 2
    composed = unit_table(step, state, _batch(), fs.analysis.h100_sxm()).figures([(0, 3), (3, 6)])
    for r, c in zip(plan.stages, composed):
        assert (c.flops, c.sent, c.lent, c.elements) == (r.forward_flops, r.sent_bytes, r.lent_bytes, r.param_elements)
        assert abs(c.saved - r.saved_bytes) <= 0.01 * r.saved_bytes and abs(c.seconds - r.forward_s) <= 0.01 * r.forward_s


def test_a_cut_sends_one_activation_where_the_next_block_starts_with_a_parameter_free_norm():
    """A Llama block starts with an RMSNorm whose square, mean, rsqrt and product read the residual
    stream alone: the stage rule (the latest stage among a node's inputs) would compute them on the
    earlier stage and send their result beside the residual (two activations per boundary, and two
    cotangents back, where torch's stage modules send one). They are computed on the stage that
    reads them: each boundary carries the residual stream only, for every cut and stage count."""
    loss_fn, params = _llama(layers=4)
    batch = _batch(8, 16)
    for axes, stages in (({"pp": 2}, None), ({"pp": 2}, (("input", "model.layers.0"), ("model.layers.1", "model.layers.2",
                         "model.layers.3", "output"))), ({"pp": 4}, None)):  # fmt: skip
        step = fs.sharded_step(loss_fn, fs.analysis.AbstractMesh(axes), optimizer=fs.optim.adamw(lr=1e-3), microbatches=4,
                               pipeline=fs.pipeline.Pipeline("1f1b", stages=stages))  # fmt: skip
        cut = step.stage_cut(step.init_abstract(params), batch)
        for program in cut.stages[:-1]:
            assert [b.shape for b in program.sent] == [(2, 16, 64)], (axes, stages, cut.describe())
            assert [b.shape for b in cut.stages[program.index + 1].received] == [(2, 16, 64)]
        assert all("pow" not in str(n.target) for n in cut.stages[0].module.graph.nodes if n.op == "call_function"
                   and any(u.op == "output" for u in n.users)), cut.describe()  # fmt: skip


def test_the_default_cut_of_a_hugging_face_model_is_its_pp_plan():
    """Hugging Face names where a model may be cut for pipelining: `config.base_model_pp_plan`
    (Llama: `embed_tokens`, the `layers` list, `norm`, each with the tensors it takes and gives)
    and the head's `_pp_plan` (`lm_head`). fs's default cut is that cut, from the module
    structure alone: the first planned module on stage 0, the list's layers whole and split
    evenly in order (the first stages one more), the later modules and the head on the last
    stage; and each boundary carries the plan's `hidden_states` only — the attention mask and the
    rotary tables, which the plan passes along, are recomputed from the batch by every stage."""
    loss_fn, params = _llama(layers=5)
    from transformers import LlamaConfig, LlamaForCausalLM

    plan = list(LlamaConfig().base_model_pp_plan) + [f"../{k}" for k in LlamaForCausalLM._pp_plan]
    assert plan == ["embed_tokens", "layers", "norm", "../lm_head"]
    names = fs.tree_paths(params)
    for pp, per_stage in ((2, (3, 2)), (4, (2, 1, 1, 1))):
        step = fs.sharded_step(loss_fn, fs.analysis.AbstractMesh({"pp": pp}), optimizer=fs.optim.adamw(lr=1e-3),
                               microbatches=pp, pipeline="1f1b")  # fmt: skip
        cut = step.stage_cut(step.init_abstract(params), _batch(8, 16))
        stage_of = {names[i]: p.index for p in cut.stages for i in p.params}
        layers = [{stage_of[n] for n in stage_of if n.startswith(f"model.layers.{k}.")} for k in range(5)]
        assert all(len(s) == 1 for s in layers), layers  # each layer whole on one stage
        assert [sum(s == {i} for s in layers) for i in range(pp)] == list(per_stage), layers
        assert {stage_of[n] for n in stage_of if n.startswith("model.embed_tokens.")} == {0}
        assert {stage_of[n] for n in stage_of if n.startswith(("model.norm.", "lm_head."))} == {pp - 1}
        for program in cut.stages[:-1]:  # the plan's hidden_states: [rows of a micro-batch, sequence, hidden]
            assert [b.shape for b in program.sent] == [(8 // pp, 16, 64)], cut.describe()


def test_an_update_that_cannot_run_on_meta_tensors_is_named():
    """`plan_pipeline` sizes the optimizer's update by running it on meta tensors; an update that
    reads a value (a data-dependent step) cannot run there and is refused with the reason."""

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None):
        if float(next(iter(grads.values())).abs().max()) > 1.0:  # reads a value: not on meta
            grads = {n: g / 2 for n, g in grads.items()}
        return {n: p - 0.1 * grads[n] for n, p in params.items()}, state

    loss_fn, params = _gpt()
    optimizer = fs.optim.make_optimizer(lambda params: fs.optim.EmptyState(), lambda state: {}, apply)
    step = fs.sharded_step(loss_fn, fs.analysis.AbstractMesh({"pp": 2}), optimizer=optimizer, microbatches=4, pipeline="1f1b")
    with pytest.raises(ValueError, match="could not run on meta tensors"):
        fs.analysis.plan_pipeline(step, step.init_abstract(params), _batch())


# --- a tied weight lent once per step ----------------------------------------------------------

VOCAB_TIED = 1024  # the tied weight (1024 x 32 floats: 128 KiB) far larger than a micro-batch's activations (4 KiB)


def _tied_run(mesh, schedule: str, tied: bool = True) -> dict:
    """A tied GPT at pp 2: the bytes this rank sends in one step (counted where the transfers are
    posted), the plan's, and the measured bytes its last stage saves per micro-batch."""
    from functional_shard import _pipe_run

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB_TIED, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=tied))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=4,
                           pipeline=fs.pipeline.Pipeline(schedule))  # fmt: skip
    state = step.init(params)
    x = torch.randint(0, VOCAB_TIED, (8, 16), generator=torch.Generator().manual_seed(1))
    batch = (x, torch.roll(x, -1, 1))
    sent = [0]
    post = _pipe_run.PointToPoint.post

    def counted(self, ops):
        sent[0] += sum(t.numel() * t.element_size() for kind, t, _ in ops if kind == "send")
        return post(self, ops)

    _pipe_run.PointToPoint.post = counted
    try:
        state, _ = step(state, batch)
        measured = sent[0]
    finally:
        _pipe_run.PointToPoint.post = post
    plan = fs.analysis.plan_pipeline(step, state, batch)
    profile = step.profile(state, batch)
    return {"sent": measured, "plan": plan.p2p_bytes[mesh.rank], "lent": plan.stages[0].lent_bytes,
            "activations": plan.stages[0].sent_bytes, "saved": profile.saved_per_microbatch,
            "held": profile.in_flight_bytes, "cut": step.stage_cut(state, batch).describe()}  # fmt: skip


def _tied_runs(mesh) -> dict:
    return {(schedule, tied): _tied_run(mesh, schedule, tied) for schedule in ("1f1b", "zbv") for tied in (True, False)}


def test_a_tied_weight_crosses_once_per_step_as_planned():
    """The tied GPT's head reads the embedding's weight (transposed) on the last stage: it crosses
    with the first micro-batch and its cotangents' sum comes back with the last backward, so each
    rank sends exactly what `plan_pipeline` says (M x the activations + the weight once), where a
    per-micro-batch relay sends the weight M times; no stage's micro-batches save a copy of the
    weight each (measured by `step.profile`, and predicted). (zbv: stage 0 and the head's stage
    share rank 0, the weight still goes through stages 1 and 2 on rank 1, once.)"""
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        runs = world.run(_tied_runs)
    weight = VOCAB_TIED * 32 * 4
    for rank, by in enumerate(runs):
        for schedule in ("1f1b", "zbv"):
            r, untied = by[schedule, True], by[schedule, False]
            assert "(once per step)" in r["cut"] and "(once per step)" not in untied["cut"], r["cut"]
            assert r["lent"] == weight and r["sent"] == r["plan"], (rank, schedule, r)
            assert r["sent"] < 2 * weight + 8 * r["activations"] * 4, (rank, schedule, r)  # relayed per micro-batch: 8 x weight
            # every stage's micro-batches save what the untied model's save (predicted per micro-batch;
            # measured at their most under 1F1B): the weight is held once, not by each micro-batch.
            # (zbv holds less between I and W: the head's weight gradient is the lent value's
            # cotangent, an input gradient computed in I, where the untied head's waits for W.)
            assert r["saved"] == untied["saved"], (rank, schedule, r, untied)
            if schedule == "1f1b":
                assert r["held"] == untied["held"], (rank, schedule, r, untied)
            else:
                assert all(r["held"][s] <= untied["held"][s] for s in r["held"]), (rank, schedule, r, untied)
