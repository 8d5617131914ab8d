"""`fs.analysis`: analysis before running, planning on an abstract mesh, timelines, simulation.

Planning tests trace on the meta device for an `AbstractMesh` (no process group, nothing
allocated); the timeline and memory tests run a real GPT step at world size 2 (gloo).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

GPT_SHAPE = dict(vocab_size=67, block_size=32, n_layer=3, n_head=2, d_model=40)  # odd sizes: padding


def gpt_loss(apply_fn):
    def loss_fn(p, batch):
        inputs, targets = batch
        return F.cross_entropy(apply_fn(p, inputs).flatten(0, 1), targets.flatten())

    return loss_fn


def meta_gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_SHAPE))
    return fs.functionalize(model)


def meta_batch(batch: int = 2, sequence: int = 32):
    tokens = torch.empty(batch, sequence, dtype=torch.long, device="meta")
    return tokens, tokens


# Rank 0 with -m slow (suite time): rank 3's slot (an offset) at every prefetch here.
@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_mixed_precision_casts_each_shard_into_its_gathers_slot_right_before_it(prefetch, rank):
    # bf16 gathers: each all-gather (forward, and the backward's again) casts the fp32 shard
    # right before it, into this rank's slot of the buffer it gathers into (as FSDP2 does), so
    # no cast shard stays alive from the forward to the backward (it did: 4.5 MiB of the GPT
    # benchmark's bf16 peak), nor beside the gathered buffer while the gather is in flight.
    apply_fn, params = meta_gpt()
    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    analysis, compiled = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 4}, rank=rank),
        optimizer=fs.optim.adamw(lr=1e-3), schedule=fs.Schedule(prefetch=prefetch), precision=precision,
    )
    gathers = [c for c in fs.schedule.collectives(compiled.graph_module) if c.kind == "all_gather"]
    assert {c.phase for c in gathers} == {"forward", "backward"}
    aten = torch.ops.aten
    for c in gathers:
        assert c.issue.target is torch.ops._c10d_functional.all_gather_into_tensor_out.default, c.unit
        copied, full = c.issue.args[0], c.issue.kwargs["out"]
        assert copied.target is aten.copy_.default and c.issue.prev is copied, (c.unit, c.phase)
        slot, shard = copied.args
        assert shard.op == "placeholder" and shard.meta["val"].dtype == torch.float32
        n = shard.meta["val"].numel()
        assert slot.target is aten.slice.Tensor and slot.args == (full, 0, rank * n, (rank + 1) * n)
        assert full.target is aten.empty.memory_format and full.kwargs["dtype"] == torch.bfloat16
        assert full.meta["val"].numel() == 4 * n and c.nbytes == 4 * n * 2
    casts = [n for n in compiled.graph_module.graph.nodes if n.target is aten._to_copy.default and n.args[0].op == "placeholder"]
    assert not [n for n in casts if n.kwargs["dtype"] == torch.bfloat16]  # no shard cast into a copy of its own
    # The memory model counts each gathered buffer from its allocation to its last reader.
    assert analysis.memory.breakdown.gathered > 0


@pytest.mark.parametrize("bf16", [False, True])
def test_a_reduce_scatter_is_waited_before_the_next_ones_buffer_is_built(bf16):
    # One collective in flight (gloo): the reduce-scatter in flight is waited before the copies
    # that build the next one's flat gradient (its cat, and the cast to the reduce dtype), not
    # between them and the issue, so the full gradient it sent and the slices it received are
    # gone before the next full gradient exists (1.1 MiB of the bf16 GPT benchmark's peak at batch 1).
    apply_fn, params = meta_gpt()
    mesh = fs.analysis.AbstractMesh({"fsdp": 4})
    mesh.max_collectives_in_flight = 1
    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    _, compiled = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), precision=precision
    )
    gm = compiled.graph_module
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    reduces = [c for c in fs.schedule.collectives(gm) if c.kind == "reduce_scatter"]
    assert len(reduces) > 2
    aten = torch.ops.aten
    for earlier, later in zip(reduces, reduces[1:]):
        flat = later.issue.args[0]
        if bf16:
            assert flat.target is aten._to_copy.default and flat.kwargs["dtype"] == torch.float32
            flat = flat.args[0]
        if flat.target is aten.cat.default:
            built = [flat]
        else:
            # Computed into its buffer (`gradients_in_place`, where that does not raise the
            # peak): the copies of the rest (layer norms, padding) are where the cat was.
            assert flat.target is aten.empty.memory_format, later.unit
            built = [c for s in flat.users if s.target is aten.slice.Tensor for c in s.users if c.target is aten.copy_.default]
            assert built and any(s.target is aten.view.default for s in flat.users for s in s.users)
        for node in built:
            assert position[earlier.issue] < position[earlier.wait] < position[node], (earlier.unit, later.unit)


# 64 and 1024 ranks with -m slow (suite time): the same laws at 8 (and one rank's none) here.
@pytest.mark.parametrize(
    "world", [1, 8, pytest.param(64, marks=pytest.mark.slow), pytest.param(1024, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("reshard", [True, False])
def test_bytes_per_step_are_3psi_or_2psi(world, reshard):
    apply_fn, params = meta_gpt()
    mesh = fs.analysis.AbstractMesh({"fsdp": world})
    schedule = fs.Schedule(reshard_after_forward=reshard)
    analysis, compiled = fs.analysis.plan(gpt_loss(apply_fn), params, meta_batch(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), schedule=schedule)
    psi = sum(p.numel() for p in fs.tree_leaves(params))
    layout = compiled.key.layout
    padded = sum(b.padded_numel for b in layout.buffers if b.trainable)
    # Padding: less than one element per rank and buffer.
    assert psi <= padded < psi + world * len(layout.buffers)
    itemsize = 4
    if world == 1:  # one rank: every collective is the identity, and the step runs none
        assert analysis.all_gather_bytes == analysis.reduce_scatter_bytes == 0 and not analysis.collectives
        return
    gathers = 2 if reshard else 1
    assert analysis.all_gather_bytes == gathers * padded * itemsize
    assert analysis.reduce_scatter_bytes == padded * itemsize
    assert analysis.all_gather_bytes + analysis.reduce_scatter_bytes == (3 if reshard else 2) * padded * itemsize
    assert all(c.group_size == world for c in analysis.collectives if c.kind != "all_reduce")


def test_flops_per_unit_match_flop_counter():
    """The FLOPs of the traced step equal torch's FlopCounterMode over a plain forward+backward
    of the model (the optimizer and collectives add none)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SHAPE))
    apply_fn, params = fs.functionalize(model)
    analysis, _ = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 4}), optimizer=fs.optim.adamw(lr=1e-3)
    )
    tokens = torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert analysis.flops == counter.get_total_flops()
    by_unit = {u.unit: u for u in analysis.units}
    blocks = [by_unit[f"blocks.{i}"] for i in range(GPT_SHAPE["n_layer"])]
    assert len({(b.forward_flops, b.backward_flops) for b in blocks}) == 1  # identical blocks, identical costs
    assert all(b.backward_flops == 2 * b.forward_flops for b in blocks)  # dX and dW: two products per product
    assert by_unit[""].forward_flops == by_unit[""].backward_flops == 0  # the head belongs to the tied unit


@pytest.mark.parametrize("optimizer, per_element", [("sgd", 5), ("adamw", 13)])
def test_update_counts_its_elementwise_operations(optimizer, per_element):
    """The optimizer's work is elementwise (0 FLOPs in torch's registry), counted as XLA's
    cost_analysis does, per element of this rank's shard: the gradient's mean over ranks (1)
    and its squared norm for metrics["grad_norm"] (1), then SGD's p - lr * g as one `addcmul_`
    (3); AdamW's decay of p (1), m's `lerp_` (3), v's `mul_` + `addcmul_` (4), `sqrt` (1), the
    division (1), the addition to p (1) — each attributed to the parameter's unit."""
    opt = fs.optim.sgd(lr=0.1) if optimizer == "sgd" else fs.optim.adamw(lr=1e-3)
    params = {"w": torch.empty(1000, 10, device="meta")}
    analysis, _ = fs.analysis.plan(
        lambda p, x: (x @ p["w"]).square().mean(), params, torch.empty(4, 1000, device="meta"),
        mesh=fs.analysis.AbstractMesh({"fsdp": 4}), optimizer=opt,
    )
    (unit,) = [u for u in analysis.units if u.unit]
    shard = 10_000 // 4
    assert per_element * shard <= unit.update_ops <= per_element * shard + 4  # + a few 0-d scalars
    assert unit.update_flops == 0
    rest = [u for u in analysis.units if not u.unit][0]
    assert rest.forward_ops == 2 * 4 * 10 and rest.update_ops <= 4  # square and mean of the 4 x 10 output
    assert analysis.ops == sum(u.forward_ops + u.backward_ops + u.update_ops for u in analysis.units)
    assert "elementwise operations per rank" in analysis.summary()


def test_peak_memory_parts_and_fit():
    apply_fn, params = meta_gpt()
    world = 8
    analysis, compiled = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": world}), optimizer=fs.optim.adamw(lr=1e-3)
    )
    memory = analysis.memory
    shard_bytes = sum(b.shard_numel for b in compiled.key.layout.buffers) * 4
    # At the peak (in the backward) the state is alive: shards, Adam's two moments, its count and
    # the per-step scalars (learning rate, ...: a few 0-d tensors).
    assert memory.breakdown.parameters == shard_bytes
    assert 2 * shard_bytes < memory.breakdown.optimizer_state <= 2 * shard_bytes + 64
    assert memory.breakdown.total == memory.peak
    assert memory.peak == max(memory.timeline) and memory.resident <= memory.peak
    largest_unit = max(b.nbytes for b in compiled.key.layout.buffers)
    assert 0 < memory.breakdown.gathered <= 2 * largest_unit  # prefetch 1: at most two units gathered
    assert analysis.fits(memory.peak) and not analysis.fits(memory.peak - 1)


def test_bucketed_gathers_are_counted():
    """The nodes `bucket_gathers` creates (the bucket's all-gather, its members' copies) get fake
    values like every traced node, so the bucket's buffers count: gathering every unit up front in
    one bucket and keeping it holds at least what keeping every unit does."""
    apply_fn, params = meta_gpt()
    peaks = {}
    for bucket_bytes in (0, 1 << 30):
        schedule = fs.Schedule(reshard_after_forward=False, bucket_bytes=bucket_bytes)
        analysis, compiled = fs.analysis.plan(
            gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 2}), optimizer=fs.optim.adamw(lr=1e-3), schedule=schedule
        )
        missing = [n.name for n in compiled.graph_module.graph.nodes if n.op == "call_function" and "val" not in n.meta]
        assert not missing, missing
        peaks[bucket_bytes] = analysis.memory.peak
        gathered = sum(b.nbytes for b in compiled.key.layout.buffers)
        assert analysis.memory.breakdown.gathered >= gathered  # kept from forward to backward: all alive at the peak
    assert peaks[1 << 30] >= peaks[0]


def test_abstract_mesh_refuses_real_tensors():
    mesh = fs.analysis.AbstractMesh({"replicate": 2, "fsdp": 4})
    assert (mesh.world_size, mesh.num_shards) == (8, 4)
    with pytest.raises(RuntimeError, match="no other ranks"):
        mesh.all_gather_flat(torch.zeros(3))
    with pytest.raises(ValueError, match="positive int"):
        fs.analysis.AbstractMesh({"fsdp": 0})


def _profile_gpt(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(**GPT_SHAPE)))
    step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(lr=1e-3))
    state = step.init(params)
    g = torch.Generator().manual_seed(mesh.rank)
    tokens = torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32), generator=g)
    batch = (tokens, tokens)
    before = [t.clone() for t in fs.tree_leaves(state)]
    result = fs.analysis.profile(step, state, batch, repeat=1)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))
    predicted = fs.analysis.analyze(step.lower(state, batch))
    return result, unchanged, [c.unit for c in predicted.collectives if c.kind == "all_gather"]


def _measured_peaks(mesh, precision):
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    # The GPT benchmark's model, where the race showed (flat gradients of 3 MiB).
    shape = dict(GPT_SHAPE, n_layer=8, block_size=128, d_model=256, n_head=4)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(**shape)))
    step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(lr=1e-3), precision=precision)
    state = step.init(params)
    g = torch.Generator().manual_seed(mesh.rank)
    tokens = torch.randint(0, shape["vocab_size"], (1, 128), generator=g)
    batch = (tokens, tokens)
    state, _ = step(state, batch)
    predicted = fs.analysis.analyze(step.lower(state, batch)).memory.peak
    peaks = []
    for _ in range(8):
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(state), *batch)
        with tracker:
            state, _ = step(state, batch)
        snapshot = tracker.get_tracker_snapshot("peak")
        peaks.append(next(int(v) for k, v in next(iter(snapshot.values())).items() if str(getattr(k, "value", k)) == "Total"))
    return predicted, peaks


# With -m slow (~30-40 s, 8 measured steps): the predicted peak is MemTracker's to 0.1% in the
# default set on real ranks in test_remat.py::test_selective_remat_peak_is_predicted (bf16 GPT,
# with and without remat) and, over 2 steps, test_tp_analysis.py's
# test_parameter_and_optimizer_bytes_are_16_psi_over_fsdp_tp_exactly; the release points that keep
# it the same every step in test_reduce_scatter_buffers_are_freed_at_a_point_of_the_graph.
@pytest.mark.slow
def test_predicted_peak_is_what_memtracker_measures_on_every_rank_and_step(local_world):
    # Real ranks, bf16 mixed precision on the GPT benchmark's model: MemTracker's peak is the
    # same on every step (to a few scalars, which gloo's thread still releases: 16 bytes) and
    # what the memory model predicts, to 0.1%.
    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for predicted, peaks in local_world(2).run(_measured_peaks, precision):
        assert max(peaks) - min(peaks) <= 64, peaks
        assert abs(max(peaks) - predicted) <= 1e-3 * predicted, (predicted, peaks)


def _release_and_local_sums(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(**GPT_SHAPE)))
    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(lr=1e-3), precision=precision)
    state = step.init(params)
    tokens = torch.zeros(2, 32, dtype=torch.long)
    gm = step.lower(state, (tokens, tokens)).graph_module
    release = fs.schedule._lower.release
    found = []
    for c in fs.schedule.collectives(gm):
        if c.kind != "reduce_scatter":
            continue
        sent = c.issue.args[0]
        # The full gradient it sent is freed right after the wait, the slices it received right
        # after their local sum (view, sum), by `release` nodes, not by gloo's worker thread.
        after_wait = c.wait.next
        found.append(after_wait.target is release and after_wait.args == (sent,))
        local_sum = after_wait.next.next
        found.append(
            after_wait.next.target is torch.ops.aten.view.default
            and local_sum.target is torch.ops.aten.sum.dim_IntList
            and local_sum.next.target is release
            and local_sum.next.args == (c.wait,)
        )
    return found


def test_reduce_scatter_buffers_are_freed_at_a_point_of_the_graph(local_world):
    for found in local_world(2).run(_release_and_local_sums):
        assert found and all(found), found


def test_profile_chrome_trace(local_world, tmp_path):
    results = local_world(2).run(_profile_gpt)
    result, unchanged, gathered_units = results[0]
    assert all(r[1] for r in results), "profile must not modify the state"
    path = tmp_path / "trace.json"
    fs.analysis.save_chrome_trace(result, str(path))
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] in ("X", "i")]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e) and (e["ph"] == "i" or e["dur"] >= 0), e
    assert {e["pid"] for e in events} == {0, 1}
    names = {(m["pid"], m["tid"]): m["args"]["name"] for m in trace["traceEvents"] if m["ph"] == "M" and m["name"] == "thread_name"}
    assert names == {(0, 0): "compute", (0, 1): "communication", (1, 0): "compute", (1, 1): "communication"}
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        compute = sorted((e for e in mine if e["tid"] == 0 and e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"]))
        # Complete events on one thread nest: each one lies inside or after the ones before it.
        stack: list[float] = []
        for e in compute:
            while stack and e["ts"] >= stack[-1] - 1e-3:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1] + 1e-3, f"{e['name']} overlaps its enclosing event"
            stack.append(e["ts"] + e["dur"])
        phases = [e for e in compute if e["cat"] == "phase"]
        assert [e["name"] for e in phases] == ["forward", "backward", "update"]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(phases, phases[1:]))
        regions = {e["name"] for e in compute if e["cat"] == "region"}
        blocks = [f"blocks.{i}" for i in range(GPT_SHAPE["n_layer"])]
        assert {f"{b} forward" for b in blocks} | {f"{b} backward" for b in blocks} <= regions
        # Forward regions in block order, backward regions in reverse.
        start = {e["name"]: e["ts"] for e in compute if e["cat"] == "region"}
        assert [start[f"{b} forward"] for b in blocks] == sorted(start[f"{b} forward"] for b in blocks)
        assert [start[f"{b} backward"] for b in blocks] == sorted((start[f"{b} backward"] for b in blocks), reverse=True)
        # Every collective is issued before it is waited, and each wait lies in its collective's flight.
        flights = [e for e in mine if e["tid"] == 1]
        assert [e["name"] for e in flights if e["name"].startswith("all_gather")] == [f"all_gather {u}" for u in gathered_units]
        waits = [e for e in compute if e["cat"] == "wait"]
        assert len(waits) == len(flights)
        for wait, flight in zip(sorted(waits, key=lambda e: e["ts"]), sorted(flights, key=lambda e: e["ts"])):
            assert wait["name"] == "wait " + flight["name"]
            assert flight["ts"] <= wait["ts"] + 1e-3 and wait["ts"] + wait["dur"] <= flight["ts"] + flight["dur"] + 1e-3
        frees = [e for e in mine if e["ph"] == "i"]
        assert len(frees) == len(gathered_units)
    assert result.marks > 0 and result.plain_step_s > 0 and result.marked_step_s > 0
    fs.analysis.plot_gantt(result, str(tmp_path / "gantt.png"))
    assert (tmp_path / "gantt.png").stat().st_size > 10_000


def test_simulate_on_h100_spec_plans_and_orders_schedules():
    """The simulator on a data-sheet machine: a step's time is at least its compute and its
    exposed communication, and resharding (more bytes) is never predicted faster than
    keeping the gathered parameters, nor prefetching slower than gathering on demand."""
    apply_fn, params = meta_gpt()
    machine = fs.analysis.h100_sxm(world_size=64)
    results = {}
    for name, schedule in {
        "default": fs.Schedule(),
        "prefetch 0": fs.Schedule(prefetch=0),
        "no reshard": fs.Schedule(reshard_after_forward=False),
    }.items():
        _, compiled = fs.analysis.plan(
            gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 64}), optimizer=fs.optim.adamw(lr=1e-3), schedule=schedule
        )
        sim = fs.analysis.simulate(compiled, machine)
        assert sim.step_s >= sim.compute_s + sim.exposed_s - 1e-12
        assert sim.exposed_s <= sim.communication_s + 1e-12
        assert sim.memory.peak == fs.analysis.analyze(compiled).memory.peak
        results[name] = sim
    assert results["no reshard"].communication_s < results["default"].communication_s
    assert results["default"].exposed_s <= results["prefetch 0"].exposed_s
    trace = fs.analysis.chrome_trace(results["default"].as_profile())
    assert any(e["ph"] == "X" and e["tid"] == 1 for e in trace["traceEvents"])
    # A machine built for fewer ranks (its links chosen for 8: NVLink) is refused, naming both.
    for small in (fs.analysis.h100_sxm(), fs.analysis.cluster_machine(fs.analysis.H100_SXM, world_size=32)):
        with pytest.raises(ValueError, match=f"spans 64 ranks, but the machine was built for {small.world_size}"):
            fs.analysis.simulate(compiled, small)
    with pytest.raises(ValueError, match="world_size >= 1"):
        fs.analysis.h100_sxm(world_size=0)


def test_machine_json_round_trip(tmp_path):
    machine = fs.analysis.h100_sxm()
    machine.save(str(tmp_path / "m.json"))
    assert fs.analysis.load_machine(str(tmp_path / "m.json")) == machine
    with pytest.raises(ValueError, match="all_reduce"):
        fs.analysis.Machine("x", ((1, 1.0),), ((1, 1.0),), 0.0, 0.0, {"all_gather": 0, "reduce_scatter": 0}, {"all_gather": 1, "reduce_scatter": 1})


def test_kernel_class_curves_cost_nodes_and_survive_json(tmp_path):
    """A machine with measured per-class curves costs a node by its class and size: the
    dispatch floor below the smallest size, log-log between sizes, proportional beyond."""
    import dataclasses

    from functional_shard.analysis._costs import node_cost

    base = fs.analysis.h100_sxm()
    curves = {"elementwise": ((100, 1e-5), (10_000, 1e-4)), "transcendental": ((100, 2e-5), (10_000, 8e-4))}
    machine = dataclasses.replace(base, op_seconds=curves)
    assert machine.compute_seconds(0, 4, kind="elementwise", numel=1) == 1e-5
    assert machine.compute_seconds(0, 4000, kind="elementwise", numel=1000) == pytest.approx(10 ** -4.5)
    assert machine.compute_seconds(0, 4e5, kind="transcendental", numel=100_000) == pytest.approx(8e-3)
    assert machine.compute_seconds(0, 4e5, kind="reduction", numel=100_000) == base.compute_seconds(0, 4e5)  # no curve: roofline
    machine.save(str(tmp_path / "m.json"))
    assert fs.analysis.load_machine(str(tmp_path / "m.json")) == machine
    with pytest.raises(ValueError, match="op_seconds"):
        dataclasses.replace(base, op_seconds={"copy": ((10, 0.0),)})

    # Measured with inputs just used: `cached` (the share of input bytes in the caches) moves
    # a node's time from the cold curve to the hot one.
    hot = dataclasses.replace(machine, op_seconds_hot={"elementwise": ((100, 1e-6), (10_000, 1e-5))}, cache_bytes=1 << 20)
    assert hot.compute_seconds(0, 4e4, kind="elementwise", numel=10_000) == pytest.approx(1e-4)
    assert hot.compute_seconds(0, 4e4, kind="elementwise", numel=10_000, cached=1.0) == pytest.approx(1e-5)
    assert hot.compute_seconds(0, 4e4, kind="elementwise", numel=10_000, cached=0.5) == pytest.approx(5.5e-5)
    assert hot.compute_seconds(0, 4e5, kind="transcendental", numel=100_000, cached=1.0) == pytest.approx(8e-3)  # no hot curve
    hot.save(str(tmp_path / "hot.json"))
    assert fs.analysis.load_machine(str(tmp_path / "hot.json")) == hot
    with pytest.raises(ValueError, match="cache_bytes"):
        dataclasses.replace(base, cache_bytes=-1)

    def f(x, y):
        return torch.exp(x) + y, (x @ y).sum(), x.view(-1), torch.matmul(x.view(2, 4, 8), y)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(8, 8), torch.randn(8, 8))
    kinds = {str(n.target): node_cost(n) for n in gm.graph.nodes if n.op == "call_function"}
    # `_unsafe_view` returns a view although its schema does not say so: no kernel, no bytes.
    assert kinds["aten._unsafe_view.default"] == node_cost(next(n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default))
    assert kinds["aten.exp.default"].kind == "transcendental" and kinds["aten.exp.default"].numel == 64
    assert kinds["aten.add.Tensor"].kind == "elementwise"
    assert kinds["aten.mm.default"].kind == "matmul" and kinds["aten.mm.default"].flops == 2 * 8**3
    assert kinds["aten.sum.default"].kind == "reduction"
    assert kinds["aten.view.default"].kind == "view"


def test_reuse_distance_decides_what_is_cached():
    """The simulator prices an input at the cached speed when the distinct bytes touched since
    it was last produced or read, plus its own, fit `Machine.cache_bytes`; a view is its base."""
    from functional_shard.analysis._costs import node_cost
    from functional_shard.analysis._simulate import _Recency

    def f(x, big):
        b = torch.exp(x) + 1
        c = big * 2  # reads 1 MiB, writes 1 MiB
        return b.view(-1) + x, c

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(64), torch.randn(2**18))
    costs = {n: node_cost(n) for n in gm.graph.nodes if n.op == "call_function"}

    def walk(cache_bytes: int) -> dict:
        recency = _Recency(cache_bytes, 100)
        return {n.name: recency.visit(n, {}, {}, costs) for n in gm.graph.nodes}

    small, large, none = walk(1 << 20), walk(8 << 20), walk(0)
    assert small["exp"] == large["exp"] == 0.0  # x never touched before
    assert small["add"] == large["add"] == 1.0  # exp's output, just produced
    assert small["mul"] == 0.0  # big never touched before
    assert small["add_1"] == 0.0 and large["add_1"] == 1.0  # b (through its view) and x: 2 MiB ago
    assert set(none.values()) == {0.0}


@pytest.mark.slow  # ~19 s: the suite's time; the simulator itself is tested above
def test_simulator_benchmark_quick_mode_runs_and_reports():
    """`benchmarks/simulator.py --quick`: calibrates, predicts and measures one case, prints
    the table (no threshold on the figures: timings here are noisy)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "simulator.py"), "--quick"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-12000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("mlp | default | 2 |")]
    assert len(rows) == 1, out.stdout
    predicted_ms, measured = rows[0].split(" | ")[3:5]
    assert float(predicted_ms) > 0 and float(measured.split()[0]) > 0
    assert "within 15%" in out.stdout


# 2 ranks with -m slow (suite time): 1 and 4 ranks, both batches, here.
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_gradients_in_place_never_raises_the_peak(world, batch):
    # The lowering computes a unit's gradients into its flat buffer (mm.out / sum.out into the
    # slots) instead of a cat copying them there; the buffer then lives from its first
    # producer, so a unit whose backward starts at the step's peak must keep its cat. Same
    # scheduled graph lowered with and without it, and with the memory guard switched off.
    from functional_shard._jit import copy_graph_module, lower_for_mesh
    from functional_shard.analysis._memory import memory_timeline
    from functional_shard.schedule._lower import gradients_in_place

    aten = torch.ops.aten
    apply_fn, params = meta_gpt()
    mesh = fs.analysis.AbstractMesh({"fsdp": world})
    mesh.max_collectives_in_flight = 1
    # Experimental, off by default. Every unit's update moved early, also on one rank (where the
    # default moves only what the peak needs, and the backward then stays near the peak: no
    # unit's window fits under it and the guarded lowering rewrites none).
    passes = (*fs.schedule.default_passes()[:-1], fs.schedule.early_update(guided=False))
    schedule = fs.Schedule(gradients_in_place=True, passes=passes)
    _, compiled = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(batch), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), donate=True, schedule=schedule
    )
    peaks, built = {}, {}
    for name in ("cat", "guarded", "unguarded"):
        gm = copy_graph_module(compiled.scheduled)
        lower_for_mesh(gm, mesh, in_place=False)
        cats = sum(n.target is aten.cat.default for n in gm.graph.nodes)
        if name == "guarded":
            built[name] = gradients_in_place(gm, memory_timeline)
        elif name == "unguarded":
            # A timeline whose peak no window can reach: every unit is rewritten.
            built[name] = gradients_in_place(gm, lambda g: [1 << 62] + [0] * (len(g.graph.nodes) - 1))
        assert sum(n.target is aten.cat.default for n in gm.graph.nodes) == cats - built.get(name, 0)
        peaks[name] = max(memory_timeline(gm))
        if name == "guarded":
            assert gm.code == compiled.graph_module.code  # what the step runs
            outs = [n for n in gm.graph.nodes if n.target in (aten.mm.out, aten.sum.IntList_out)]
            assert all(n.kwargs["out"].args[0].args[0].target is aten.empty.memory_format for n in outs)
    assert built["guarded"] >= 1 and built["unguarded"] >= built["guarded"], built
    assert peaks["guarded"] <= peaks["cat"], peaks
    # Here the guard matters: rewriting the first unit of the backward as well would raise it.
    assert built["unguarded"] > built["guarded"] and peaks["unguarded"] > peaks["cat"], (built, peaks)


def test_collective_groups_price_collectives_over_their_group_size(tmp_path):
    """A machine with measured curves per group size (`calibrate` on ranks sharing cores: a
    2-rank gloo ring among 4 ranks is not the 4-rank ring made smaller) prices a collective over
    that many ranks by them, any other size by the world's; they survive JSON."""
    import dataclasses

    base = fs.analysis.h100_sxm()
    machine = dataclasses.replace(base, ranks_per_node=0, collective_groups={"all_gather/2": (1e-3, 1e9)})
    n = 1 << 20
    assert machine.collective_seconds("all_gather", n, 2) == pytest.approx(1e-3 + 0.5 * n / 1e9)
    assert machine.collective_seconds("all_gather", n, 4) == dataclasses.replace(base, ranks_per_node=0).collective_seconds("all_gather", n, 4)
    assert machine.collective_seconds("all_reduce", n, 2) == dataclasses.replace(base, ranks_per_node=0).collective_seconds("all_reduce", n, 2)
    machine.save(str(tmp_path / "g.json"))
    assert fs.analysis.load_machine(str(tmp_path / "g.json")) == machine
    with pytest.raises(ValueError, match="collective_groups"):
        dataclasses.replace(base, collective_groups={"all_gather": (1e-3, 1e9)})
