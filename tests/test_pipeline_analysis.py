"""Pipelined steps planned before they run (issue 27, analysis): on `fs.analysis.AbstractMesh`,
in this process, no ranks and no memory.

- `plan_pipeline`: the schedule's bubble at the stages' predicted costs, the in-flight
  activations per rank = `fs.pipeline.peak_in_flight` x the bytes one micro-batch's forward saves,
  point-to-point bytes = what crosses each boundary x M (activations forward, cotangents back);
- `tune_pipeline`: schedules x micro-batch counts, those within the budget first, fastest first,
  each with its reason;
- `balance_stages`: a contiguous cut covering every unit that is never slower (predicted) than
  the default cut, and gives the heavy head of a large vocabulary a stage of its own;
- a 3-D layout (`{"pp": 2, "fsdp": 2, "tp": 2}`) of a Hugging Face Llama plans.
"""

from __future__ import annotations

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
    ranked = fs.analysis.tune_pipeline(step, state, _batch(), budget_bytes=budget)
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
