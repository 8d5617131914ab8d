"""`fs.analysis` on tensor-parallel steps: an `AbstractMesh` with a `tp` axis, collective bytes per
mesh axis against Megatron's theory, memory per rank against 16Ψ/(fsdp·tp) and MemTracker, the
simulator's pricing of each axis's group, and the labels of TP collectives in `explain`, the
timeline and the Chrome trace.

Planning tests trace on the meta device (no process group); the memory and timeline test runs
a real step on 4 gloo processes at `{"fsdp": 2, "tp": 2}`.
"""

from __future__ import annotations

import ast
import math
import pathlib
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard import tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

GPT_CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
BATCH, LENGTH = 2, 16


def gpt_loss(apply_fn, mesh):
    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    return loss_fn


def meta_tokens(batch: int = BATCH, length: int = LENGTH):
    ids = torch.empty(batch, length, dtype=torch.long, device="meta")
    return ids, ids


def plan_gpt(axes: dict, config: GPTConfig = GPT_CONFIG, rank: int = 0, sequence_parallel: bool = False, **kwargs):
    """(analysis, compiled) of a GPT step planned on `AbstractMesh(axes)` with fs's GPT plan."""
    mesh = fs.analysis.AbstractMesh(axes, rank=rank)
    with torch.device("meta"):
        model = GPT(config)
    rules = tp.gpt_rules(config)
    tp.parallelize(model, rules, mesh, sequence_parallel=sequence_parallel)
    apply_fn, params = fs.functionalize(model)
    return fs.analysis.plan(
        gpt_loss(apply_fn, mesh), params, meta_tokens(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules, **kwargs
    )


def tp_per_unit(analysis) -> Counter:
    """(unit, phase, kind) -> bytes of the step's collectives over `tp`."""
    found: Counter = Counter()
    for c in analysis.collectives:
        if c.axis == "tp":
            found[(c.unit, c.phase, c.kind)] += c.nbytes
    return found


# --- the abstract mesh --------------------------------------------------------------------------


def test_abstract_mesh_has_axes_with_meaning_and_collectives_per_axis():
    mesh = fs.analysis.AbstractMesh({"fsdp": 64, "tp": 8}, rank=9)
    assert (mesh.world_size, mesh.num_shards, mesh.shard_axis, mesh.data_size, mesh.data_rank) == (512, 64, "fsdp", 64, 1)
    assert mesh.coordinates == {"fsdp": 1, "tp": 1} and mesh.model_axes == ("tp",)
    with torch._subclasses.fake_tensor.FakeTensorMode():  # what step.lower traces with
        x = torch.empty(6)
        assert mesh.all_gather_axis_flat(x, "tp").shape == (48,)
        assert mesh.reduce_scatter_axis_flat(torch.empty(48), "tp").shape == (6,)
    with pytest.raises(ValueError, match="unknown mesh axis name 'dp'.*'tp' \\(tensor parallel\\)"):
        fs.analysis.AbstractMesh({"dp": 2, "tp": 2})
    with pytest.raises(ValueError, match="has no axis 'cp'"):
        mesh.all_gather_axis_flat(x, "cp")
    with pytest.raises(RuntimeError, match="no other ranks"):
        mesh.all_gather_axis_flat(torch.zeros(3), "tp")


# --- bytes per axis -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan():
    return plan_gpt({"fsdp": 2, "tp": 2})


def test_tp_bytes_per_layer_are_megatrons_four_all_reduces_of_bsh(gpt_plan):
    """GPT (fused qkv, one fc): per block 2 all-reduces of b·s·h in forward (`reduce_from` after
    attn.proj and mlp.proj) and 2 in backward (`copy_to` before qkv and fc): 4·b·s·h·e bytes.
    Besides the blocks: the vocabulary-parallel embedding's forward all-reduce and the tied head's
    backward one (b·s·h each), the cross-entropy's all-gather of one fp32 max per token and rank
    and its all-reduce of two fp32 sums per token. FSDP's bytes are on `fsdp` only."""
    analysis, compiled = gpt_plan
    t, e = 2, 4
    bsh = BATCH * LENGTH * GPT_CONFIG.d_model * e
    per_unit = tp_per_unit(analysis)
    for i in range(GPT_CONFIG.n_layer):
        assert per_unit[(f"blocks.{i}", "forward", "all_reduce")] == 2 * bsh
        assert per_unit[(f"blocks.{i}", "backward", "all_reduce")] == 2 * bsh
    counts = Counter((c.unit, c.phase) for c in analysis.collectives if c.axis == "tp" and c.unit.startswith("blocks."))
    assert set(counts.values()) == {2}, counts  # two collectives each way per block, b·s·h each
    tokens = BATCH * LENGTH
    layers = GPT_CONFIG.n_layer
    by_axis = analysis.bytes_per_axis()
    assert by_axis["tp"] == {"all_reduce": (4 * layers + 2) * bsh + 2 * tokens * 4, "all_gather": tokens * t * 4}
    assert set(by_axis) == {"fsdp", "tp", "world"}  # world: the grad norm's one all-reduce over every axis
    fsdp = [c for c in analysis.collectives if c.axis == "fsdp" and c.buffer]
    assert by_axis["fsdp"]["all_gather"] == sum(c.nbytes for c in fsdp if c.kind == "all_gather")
    assert all(c.group_size == 2 for c in analysis.collectives if c.axis in ("fsdp", "tp"))
    table = compiled.explain()
    assert "tp all_reduce_issued" in table and "tp all_reduce x" in table
    assert f"tp all_reduce x{4 * layers + 3}" in table  # the blocks', the embedding's, the head's, the loss's sums
    assert "over tp: all-reduce" in analysis.summary()


def test_tp_bytes_per_layer_with_sequence_parallelism_are_gathers_and_scatters_of_bsh():
    """With sequence parallelism, per block: 2 all-gathers and 2 reduce-scatters of b·s·h in
    forward; in backward their duals (2 reduce-scatters, 2 all-gathers) plus the 2 all-gathers
    that re-gather the saved slices, and one all-reduce of h floats per whole parameter in the
    block (GPT: 2 LayerNorms' weight and bias, 2 row-parallel biases). Besides the blocks: the
    embedding's all-reduce, the cut's backward all-gather, the head's gather, re-gather and
    reduce-scatter, the final LayerNorm's 2 all-reduces. Ring bytes per layer: 10 (t-1)/t b·s·h·e,
    1.25x the 4 all-reduces' 8 (t-1)/t b·s·h·e."""
    analysis, _ = plan_gpt({"fsdp": 2, "tp": 2}, sequence_parallel=True)
    layers, h = GPT_CONFIG.n_layer, GPT_CONFIG.d_model
    bsh = BATCH * LENGTH * h * 4
    tp_collectives = [c for c in analysis.collectives if c.axis == "tp"]
    big = Counter((c.phase, c.kind) for c in tp_collectives if c.nbytes == bsh)
    assert big == {
        ("forward", "all_gather"): 2 * layers + 1,
        ("forward", "reduce_scatter"): 2 * layers,
        ("forward", "all_reduce"): 1,
        ("backward", "reduce_scatter"): 2 * layers + 1,
        ("backward", "all_gather"): 4 * layers + 2,
    }
    small = [c for c in tp_collectives if c.kind == "all_reduce" and c.phase == "backward"]
    assert len(small) == 6 * layers + 2 and {c.nbytes for c in small} == {h * 4}


def meta_llama(mesh, layers: int):
    """A small Hugging Face Llama (GQA, untied head) on the meta device, parallelized by its own
    plan on `mesh`: `(config, rules, apply_fn, params)`."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    rules = tp.hf_rules(model)
    apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh))
    return config, rules, apply_fn, params


@pytest.fixture(scope="module")
def llama_plan():
    mesh = fs.analysis.AbstractMesh({"fsdp": 2, "tp": 2})
    config, rules, apply_fn, params = meta_llama(mesh, layers=2)

    def loss_fn(p, batch):
        ids, labels = batch
        logits = apply_fn(p, input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    analysis, _ = fs.analysis.plan(loss_fn, params, meta_tokens(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules)
    return analysis, config


def test_llama_tp_bytes_per_layer_are_megatrons_four_all_reduces_of_bsh(llama_plan):
    """Hugging Face Llama by its own plan: per layer 2 all-reduces of b·s·h in forward (after
    o_proj and down_proj) and 2 in backward: attention's q/k/v and the MLP's gate/up share one
    `copy_to` per module, so the input's gradient is all-reduced once per module, not once per
    projection. The lm_head (`colwise_gather_output`) gathers the logits (b·s·V) and
    all-reduces its input's gradient (b·s·h)."""
    analysis, config = llama_plan
    bsh = BATCH * LENGTH * config.hidden_size * 4
    per_unit = tp_per_unit(analysis)
    for i in range(config.num_hidden_layers):
        assert per_unit[(f"model.layers.{i}", "forward", "all_reduce")] == 2 * bsh
        assert per_unit[(f"model.layers.{i}", "backward", "all_reduce")] == 2 * bsh
    counts = Counter((c.unit, c.phase) for c in analysis.collectives if c.axis == "tp" and c.unit.startswith("model.layers."))
    assert set(counts.values()) == {2}, counts
    assert per_unit[("output", "forward", "all_gather")] == BATCH * LENGTH * config.vocab_size * 4
    assert per_unit[("output", "backward", "all_reduce")] == bsh


# --- the simulator ------------------------------------------------------------------------------


def test_simulator_prices_tp_on_nvlink_and_fsdp_across_nodes():
    """On `{"fsdp": 16, "tp": 8}` with 8 GPUs a node, a tp group is one node (NVLink ring) and
    an fsdp group has one rank on each of 16 nodes (every byte over the network); tp
    collectives run on a stream of their own, labelled by axis and the block they serve."""
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=8, d_model=64)
    _, compiled = plan_gpt({"fsdp": 16, "tp": 8}, config)
    machine = fs.analysis.cluster_machine(fs.analysis.H100_SXM, world_size=128)
    simulation = fs.analysis.simulate(compiled, machine)
    bsh = BATCH * LENGTH * config.d_model * 4
    tp_events = [e for e in simulation.timeline if e.category == "collective" and e.name.startswith("tp ")]
    blocks = [e for e in tp_events if e.name.startswith("tp all_reduce blocks.")]
    assert len(blocks) == 4 * config.n_layer
    nvlink = fs.analysis.H100_SXM.nvlink_bandwidth * fs.analysis.FITTED.bus
    ring = 10e-6 + 2 * 7 / 8 * bsh / nvlink
    assert all(e.duration_us == pytest.approx(ring * 1e6) for e in blocks)
    assert machine.collective_seconds("all_reduce", bsh, 8) == pytest.approx(ring)
    network = 400 / 8 * 1e9 * fs.analysis.FITTED.bus
    n = 2**20
    assert machine.collective_seconds("all_gather", n, 16, stride=8) == pytest.approx(10e-6 + 5e-6 * 4 + 15 / 16 * n / network)
    assert machine.collective_seconds("all_gather", n, 16) < machine.collective_seconds("all_gather", n, 16, stride=8)
    gathers = [e for e in simulation.timeline if e.category == "collective" and e.name.startswith("all_gather blocks.")]
    nbytes = {c.issue.name: c.nbytes for c in fs.schedule.collectives(compiled.graph_module)}
    assert gathers and all(e.duration_us > 15 / 16 * min(nbytes.values()) / network * 1e6 for e in gathers)
    assert simulation.step_s >= simulation.compute_s + simulation.exposed_s - 1e-12 and simulation.exposed_s > 0
    phases = {e.phase for e in tp_events}
    assert phases == {"forward", "backward"}


# --- roles of nodes -----------------------------------------------------------------------------


def test_backward_stays_backward_with_tp_collectives_and_weighted_losses(gpt_plan):
    """Only a parameter buffer's reduce-scatter and the update's all-reduces start the update
    phase: a TP all-reduce in the backward, or a WeightedLoss's sum of weights (which seeds the
    backward), used to turn the rest of the backward into "update" (its FLOPs counted there)."""
    analysis, _ = gpt_plan
    blocks = [u for u in analysis.units if u.unit.startswith("blocks.")]
    assert blocks and all(u.backward_flops == 2 * u.forward_flops and u.update_flops == 0 for u in blocks)
    with torch.device("meta"):
        model = GPT(GPT_CONFIG)
    apply_fn, params = fs.functionalize(model)

    def weighted(p, batch):
        ids, targets = batch
        total = F.cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), reduction="sum")
        return fs.WeightedLoss(total / ids.numel(), ids.numel())

    plain, _ = fs.analysis.plan(weighted, params, meta_tokens(), mesh=fs.analysis.AbstractMesh({"fsdp": 2}), optimizer=fs.optim.adamw(lr=1e-3))
    blocks = [u for u in plain.units if u.unit.startswith("blocks.")]
    assert blocks and all(u.backward_flops == 2 * u.forward_flops and u.update_flops == 0 for u in blocks)


def test_steps_built_by_the_analysis_keep_the_placements():
    """The autotuner's steps (`with_schedule`) keep the tensor-parallel rules (a tp mesh refuses a
    step without them)."""
    from functional_shard.analysis._measure import with_schedule

    mesh = fs.analysis.AbstractMesh({"fsdp": 2, "tp": 2})
    rules = tp.gpt_rules(GPT_CONFIG)
    step = fs.sharded_step(lambda p, b: p["w"].sum(), mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules)
    again = with_schedule(step, fs.Schedule(prefetch=0))
    assert again.placements is rules and again.schedule.prefetch == 0


def test_schedule_never_imports_analysis():
    """The layers: the schedule (and the jit) read no analysis module, not even late inside a
    function; the analysis reads the schedule (the memory timeline lives in `schedule._liveness`)."""
    root = pathlib.Path(fs.__file__).parent
    for path in [*sorted((root / "schedule").glob("*.py")), root / "_jit.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.split(".")[0] == "analysis" and "analysis" not in node.module.split(".")[:2], (path, node.module)


# --- a real step at {"fsdp": 2, "tp": 2} --------------------------------------------------------


def _tracked_total(snapshot) -> int:
    return next(int(v) for k, v in next(iter(snapshot.values())).items() if str(getattr(k, "value", k)) == "Total")


def memory_and_labels(_):
    """On one rank of {"fsdp": 2, "tp": 2}: the layout, the analysis of the traced step and of the
    abstract plan, MemTracker's bytes before and at the peak of the step, the explain table and
    the profiled timeline's names."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mesh = fs.init_mesh({"fsdp": 2, "tp": 2})
    torch.manual_seed(0)
    model = GPT(GPT_CONFIG)
    rules = tp.gpt_rules(GPT_CONFIG)
    full = {name: p.numel() for name, p in model.named_parameters()}
    split = {path for path, placement in tp.placements_for(list((n, tuple(p.shape)) for n, p in model.named_parameters()), rules, mesh).items() if isinstance(placement, tp.Split)}
    tp.parallelize(model, rules, mesh)
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(gpt_loss(apply_fn, mesh), mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules)
    state = step.init(params)
    g = torch.Generator().manual_seed(mesh.data_rank)
    ids = torch.randint(0, GPT_CONFIG.vocab_size, (BATCH, LENGTH), generator=g)
    batch = (ids, torch.roll(ids, -1, 1))
    state, _ = step(state, batch)
    analysis = fs.analysis.analyze(step.lower(state, batch), mesh=mesh)
    out = {
        "split": sum(full[p] for p in split),
        "whole": sum(n for p, n in full.items() if p not in split),
        "shard_numel": sum(b.shard_numel for b in state.params.layout.buffers),
        "trainable_numel": sum(b.shard_numel for b in state.params.layout.buffers if b.trainable),
        "padding": sum(b.shard_numel * b.num_shards - b.numel for b in state.params.layout.buffers),
        "state_bytes": sum(t.untyped_storage().nbytes() for t in fs.tree_leaves(state) if isinstance(t, torch.Tensor)),
        "analysis": analysis,
        "explain": step.explain(),
    }
    before, peaks = [], []
    for _ in range(2):
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(state), *batch)
        with tracker:
            before.append(_tracked_total(tracker.get_tracker_snapshot("current")))
            state, _ = step(state, batch)
        peaks.append(_tracked_total(tracker.get_tracker_snapshot("peak")))
    out["measured_before"], out["measured_peaks"] = before, peaks
    profile = fs.analysis.profile(step, state, batch, repeat=1)
    out["trace_names"] = {e["name"] for e in fs.analysis.chrome_trace(profile)["traceEvents"] if e.get("cat") == "collective"}
    if mesh.rank != 0:
        return out
    # The same step planned in one process on an abstract mesh playing this rank (one rank: the
    # others' pieces have the same sizes).
    abstract = fs.analysis.AbstractMesh({"fsdp": 2, "tp": 2}, rank=mesh.rank)
    with torch.device("meta"):
        meta_model = GPT(GPT_CONFIG)
    tp.parallelize(meta_model, rules, abstract)
    meta_apply, meta_params = fs.functionalize(meta_model)
    out["planned"], _ = fs.analysis.plan(
        gpt_loss(meta_apply, abstract), meta_params, meta_tokens(), mesh=abstract, optimizer=fs.optim.adamw(lr=1e-3), placements=rules
    )
    return out


@pytest.fixture(scope="module")
def gloo_reports(local_world):
    return local_world(4).run(memory_and_labels)


def test_parameter_and_optimizer_bytes_are_16_psi_over_fsdp_tp_exactly(gloo_reports):
    """fp32 AdamW: 4 bytes of parameter, 4 of gradient and 8 of moments per element this rank
    holds, which is Ψ_split/(fsdp·tp) + Ψ_whole/fsdp (+ the flat buffers' padding / fsdp). The
    analysis of the traced step, the plan on an abstract mesh and the state itself agree to the
    byte; MemTracker sees the state and batch before the step, and the predicted peak at it."""
    fsdp, t = 2, 2
    for report in gloo_reports:
        psi = report["shard_numel"]
        assert psi * fsdp == report["split"] // t + report["whole"] + report["padding"]
        analysis = report["analysis"]
        resident = analysis.memory.resident_breakdown
        assert resident.parameters == 4 * psi
        scalars = resident.optimizer_state - 8 * psi  # AdamW's count, the step counter, lr and bias corrections
        assert 0 < scalars <= 64
        gradients = sum(c.nbytes // c.group_size for c in analysis.collectives if c.axis == "fsdp" and c.kind == "reduce_scatter")
        assert gradients == 4 * report["trainable_numel"] == 4 * psi
        assert resident.parameters + gradients + resident.optimizer_state - scalars == 16 * psi
        assert gloo_reports[0]["planned"].memory.resident_breakdown == resident
        # MemTracker: the state and batch before the step (the optimizer's per-call scalars are
        # made inside the step: 24 bytes the analysis counts as inputs).
        assert report["measured_before"] == [report["state_bytes"] + resident.batch] * 2
        assert 0 <= analysis.memory.resident - report["measured_before"][0] <= 32
        predicted = analysis.memory.peak
        assert all(abs(p - predicted) <= 1e-3 * predicted for p in report["measured_peaks"]), (predicted, report["measured_peaks"])


def test_tp_collectives_are_labelled_in_explain_and_the_timeline(gloo_reports):
    """Named by axis and the unit they serve, never as a unit's buffer or the loss (GPT's head is
    tied to the embedding, of unit `input`: the head's and the cross-entropy's are `input`'s)."""
    for report in gloo_reports:
        assert "tp all_reduce_issued" in report["explain"]
        expected = {"tp all_reduce blocks.0", "tp all_reduce blocks.1", "tp all_reduce input", "tp all_gather input"}
        assert expected <= report["trace_names"]
        assert {c.axis for c in report["analysis"].collectives} == {"fsdp", "tp", "world"}
        assert not any(name.startswith("all_reduce blocks") for name in report["trace_names"])


# --- a 70B Llama ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_70b_plans_at_fsdp64_tp8_in_one_process():
    """Llama 3 70B's shape (hidden 8192, 80 layers, 64 heads, 8 key/value heads, MLP 28672,
    vocabulary 128256) on the meta device, by its own plan, planned at {"fsdp": 64, "tp": 8}
    (512 ranks) in one process: bf16 compute, so each TP all-reduce is b·s·h·2 bytes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    start = time.perf_counter()
    mesh = fs.analysis.AbstractMesh({"fsdp": 64, "tp": 8})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    rules = tp.hf_rules(model)
    tp.parallelize(model, rules, mesh)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        ids, labels = batch
        return F.cross_entropy(apply_fn(p, input_ids=ids, use_cache=False).logits.flatten(0, 1).float(), labels.flatten())

    b, s = 1, 2048
    analysis, compiled = fs.analysis.plan(
        loss_fn, params, meta_tokens(b, s), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules,
        precision=fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), schedule=fs.Schedule(remat=True),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    bsh = b * s * config.hidden_size * 2
    per_unit = tp_per_unit(analysis)
    # forward: the two all-reduces after the row-parallel products, and under full remat the ones the
    # backward recomputes: the attention's (the post-attention norm's backward reads the residual it
    # makes); on the last block the MLP's too (the final norm's backward reads the block's output)
    assert all(per_unit[(f"model.layers.{i}", "forward", "all_reduce")] == 3 * bsh for i in range(79))
    assert per_unit[("model.layers.79", "forward", "all_reduce")] == 4 * bsh
    assert all(per_unit[(f"model.layers.{i}", "backward", "all_reduce")] == 2 * bsh for i in range(80))
    resident = analysis.memory.resident_breakdown
    # fp32 shards of Ψ_split / (64 * 8) + Ψ_whole / 64 elements (Llama's plan leaves the embedding and
    # the norms whole over tp), up to the padding of each flat buffer to 64 shards (< 1 element each).
    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    placements = tp.placements_for(shapes, rules, mesh)
    split = sum(math.prod(shape) for name, shape in shapes if isinstance(placements[name], tp.Split))
    whole = sum(math.prod(shape) for name, shape in shapes) - split
    psi = (split // 8 + whole) / 64
    assert 0 <= resident.parameters - 4 * psi < 4 * 200, (resident, psi)
    assert 0 <= resident.optimizer_state - 8 * psi < 8 * 200 + 64
    machine = fs.analysis.cluster_machine(fs.analysis.H100_SXM, world_size=512)
    simulation = fs.analysis.simulate(compiled, machine)
    tp_s = sum(e.duration_us for e in simulation.timeline if e.category == "collective" and e.name.startswith("tp ")) / 1e6
    tokens_per_gpu = b * s / simulation.step_s / 8  # a tp group of 8 GPUs shares one sequence
    mfu = analysis.flops / simulation.step_s / fs.analysis.H100_SXM.dense_flops["bfloat16"]
    assert 0 < simulation.exposed_s < simulation.step_s and tp_s > 0
    print(f"70B at fsdp 64 x tp 8 planned in {seconds:.0f} s; {analysis.num_nodes} nodes; psi {psi}")
    print(analysis.summary())
    print(
        f"simulated step {simulation.step_s:.3f} s (compute {simulation.compute_s:.3f}, exposed {simulation.exposed_s:.3f}, "
        f"tp collectives {tp_s:.3f} s), {tokens_per_gpu:.0f} tokens/s per GPU, MFU {mfu:.2f}, "
        f"reserved {simulation.reserved / 2**30:.1f} GiB"
    )


def test_a_bounded_number_of_reduce_scatters_in_flight_plans_with_tp_collectives_between_them():
    """`reduce_scatters_in_flight=1` bounded the reduce-scatters in the order they had before
    `early_reduce_scatter` moved each after its gradient; with tensor-parallel collectives between
    units' gradients that order had changed, and a wait was moved before its own issue (an
    invalid graph). The pass now bounds them in the order they are issued."""
    mesh = fs.analysis.AbstractMesh({"fsdp": 2, "tp": 2})
    _, rules, apply_fn, params = meta_llama(mesh, layers=3)

    def loss_fn(p, batch):
        ids, labels = batch
        return apply_fn(p, input_ids=ids, labels=labels, use_cache=False).loss

    schedule = fs.Schedule(reduce_scatters_in_flight=1)
    analysis, compiled = fs.analysis.plan(
        loss_fn, params, meta_tokens(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), placements=rules, schedule=schedule
    )
    scatters = [e for e in compiled.events if e.event.startswith("reduce_scatter") and e.buffer]
    issued = [e.position for e in scatters if e.event == "reduce_scatter_issued"]
    waited = [e.position for e in scatters if e.event == "reduce_scatter_waited"]
    assert len(issued) == len(waited) > 2
    # One in flight: each wait comes before the next issue.
    assert all(w < i for w, i in zip(sorted(waited), sorted(issued)[1:]))
