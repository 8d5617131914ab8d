"""Schedules as composable values: lists of passes that can be reordered, replaced and extended,
and the mesh's bound on collectives in flight read by the pass that enforces it.

- pass values are frozen, hashable and print as they are built; `Schedule(...)` expands to
  `default_passes(...)`, and `Schedule(passes=[...])` runs a list as given;
- a list that replaces, reorders and extends the built-in passes trains to the eager
  reference's bits on a 2-rank gloo world;
- `reduce_scatters_in_flight=k` bounds the reduce-scatters in flight in a traced graph when the
  context allows more than one collective in flight; on gloo `limit_in_flight` keeps one, and a
  list that leaves more raises on every rank, naming the fix.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import fx

import functional_shard as fs
from functional_shard.models import MLP
from functional_shard.schedule import (
    PassContext,
    bucket_gathers,
    early_reduce_scatter,
    early_update,
    limit_in_flight,
    prefetch,
    reshard_after_forward,
)

from test_jit import make_step, run_steps


# --- pass values -------------------------------------------------------------------------------


def test_schedule_expands_to_its_default_pass_list():
    schedule = fs.Schedule(prefetch=2, reshard_after_forward={"output": False}, bucket_bytes=1024)
    assert schedule.pass_list == (
        reshard_after_forward({"output": False}),
        prefetch(2),
        early_reduce_scatter(),
        bucket_gathers(1024),
        limit_in_flight(),
        early_update(),
    )
    assert fs.Schedule().pass_list == fs.schedule.default_passes()
    assert repr(prefetch(2)) == "prefetch(distance=2)"
    assert len({fs.Schedule(), fs.Schedule(), fs.Schedule(prefetch=0)}) == 2  # values: equal and hashable


def test_plain_functions_are_wrapped_and_explicit_lists_keep_their_order():
    def noop(gm):
        return gm

    extra = fs.Schedule(prefetch=0, extra_passes=(noop,)).pass_list
    assert extra[-3:] == (fs.schedule.function_pass(noop), limit_in_flight(), early_update())  # before the mesh's bound
    assert "function_pass(test_plain_functions_are_wrapped_and_explicit_lists_keep_their_order.<locals>.noop)" in repr(extra)
    explicit = fs.Schedule(passes=[noop, prefetch(0)]).pass_list
    assert explicit == (fs.schedule.function_pass(noop), prefetch(0))
    with pytest.raises(ValueError, match="extra_passes"):
        fs.Schedule(prefetch=0, passes=[noop])  # the fields build the default list only
    with pytest.raises(TypeError, match="callable"):
        fs.Schedule(passes=[3])
    with pytest.raises(ValueError, match="prefetch.distance"):
        prefetch(-1)


# --- reorder, replace, extend: still the eager reference's bits --------------------------------


def wait_reduce_scatters_at_once(gm: fx.GraphModule) -> fx.GraphModule:
    """A user's pass: wait for each reduce-scatter right after issuing it."""
    for c in fs.schedule.collectives(gm):
        if c.kind == "reduce_scatter":
            c.issue.append(c.wait)
    return gm


def composed_schedule(mesh, model_name):
    reference, reference_metrics, _ = run_steps(mesh, model_name, fs.Schedule(trace=False))
    _, _, plain = run_steps(mesh, model_name, fs.Schedule())
    unit_bytes = max(b.nbytes for b in reference.params.layout.buffers)
    schedule = fs.Schedule(
        passes=(
            reshard_after_forward({"blocks.0": False}),  # replaced: keep blocks.0 from forward to backward
            bucket_gathers(2 * unit_bytes),  # moved: bucketing before prefetching
            early_reduce_scatter(),
            wait_reduce_scatters_at_once,  # added: a user's pass in the middle
            prefetch(2),
            limit_in_flight(),
        )
    )
    state, metrics, step = run_steps(mesh, model_name, schedule)
    gm = step.cache[next(iter(step.cache))].graph_module
    events = step.schedule_events
    scatters = {e.node: e.position for e in events if e.event == "reduce_scatter_issued"}
    waits = [e for e in events if e.event == "reduce_scatter_waited"]
    return {
        "same bits": all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), fs.tree_leaves(reference))),
        "same loss": torch.equal(metrics["loss"], reference_metrics["loss"]),
        "backward gathers of blocks.0": [e for e in events if e.event == "gather_issued" and e.phase == "backward" and e.unit == "blocks.0"],
        "backward gathers of blocks.1": [e for e in events if e.event == "gather_issued" and e.phase == "backward" and e.unit == "blocks.1"],
        "gathers": len([c for c in fs.schedule.collectives(gm) if c.kind == "all_gather"]),
        "unbucketed gathers": len([c for c in fs.schedule.collectives(plain.cache[next(iter(plain.cache))].graph_module) if c.kind == "all_gather"]),
        "reduce-scatters waited at once": all(any(e.position == p + 1 for p in scatters.values()) for e in waits),
        "in flight": fs.schedule.max_in_flight(events),
    }


@pytest.mark.parametrize("model_name", ["gpt", "mlp"])
def test_reordered_replaced_and_extended_passes_are_bit_identical(local_world, model_name):
    for report in local_world(2).run(composed_schedule, model_name):
        assert report["same bits"] and report["same loss"], report
        assert not report["backward gathers of blocks.0"] and report["backward gathers of blocks.1"], report
        assert report["gathers"] < report["unbucketed gathers"], report
        assert report["reduce-scatters waited at once"] and report["in flight"] == 1, report


# --- collectives in flight: the schedule's bound and the mesh's -----------------------------------


def in_flight_bounds(mesh):
    torch.manual_seed(0)
    step, params = make_step(mesh, "mlp", fs.Schedule(passes=()), model=MLP(13, 16, 5, n_blocks=6))
    state = step.init(params)
    step(state, (torch.randn(3, 13), torch.randint(0, 5, (3,))))  # the unscheduled graph: one in flight
    raw = step.cache[next(iter(step.cache))].graph_module
    unbounded = PassContext(max_collectives_in_flight=None, world_size=mesh.world_size, num_shards=mesh.num_shards)
    gloo = PassContext.for_mesh(mesh)

    def scheduled(schedule, context):
        events = fs.schedule.analyze(fs.schedule.apply_schedule(copy.deepcopy(raw), schedule, context))
        return fs.schedule.max_in_flight(events, "reduce_scatter"), fs.schedule.max_in_flight(events)

    out = {"raw": fs.schedule.max_in_flight(step.schedule_events), "mesh": mesh.max_collectives_in_flight, "gloo": gloo}
    for k in (None, 1, 2, 3):
        out[k, "unbounded"] = scheduled(fs.Schedule(prefetch=2, reduce_scatters_in_flight=k), unbounded)
        out[k, "gloo"] = scheduled(fs.Schedule(prefetch=2, reduce_scatters_in_flight=k), gloo)
    out["limit 2"] = scheduled([*fs.Schedule(prefetch=2).pass_list[:-1], limit_in_flight(2)], unbounded)
    with pytest.raises(ValueError) as info:
        scheduled([prefetch(2), early_reduce_scatter()], gloo)
    out["error"] = str(info.value)
    return out


def test_reduce_scatters_in_flight_bounds_the_graph_and_gloo_keeps_one(local_world):
    for out in local_world(2).run(in_flight_bounds):
        assert out["raw"] == 1 and out["mesh"] == 1 and out["gloo"].max_collectives_in_flight == 1, out
        scatters_unbounded, _ = out[None, "unbounded"]
        assert scatters_unbounded > 3, out  # without a bound, more than 3 are in flight: the bounds below bite
        for k in (1, 2, 3):
            scatters, everything = out[k, "unbounded"]
            assert scatters == k and everything > k, out
            assert out[k, "gloo"] == (1, 1), out
        assert out["limit 2"][1] == 2, out
        assert "leave 2 collectives in flight" in out["error"] and "fs.schedule.limit_in_flight()" in out["error"]


def missing_limit(mesh):
    step, params = make_step(mesh, "mlp", fs.Schedule(passes=(prefetch(2), early_reduce_scatter())))
    with pytest.raises(ValueError) as info:
        step(step.init(params), (torch.randn(3, 13), torch.randint(0, 5, (3,))))
    return str(info.value)


def test_a_list_that_breaks_the_mesh_bound_raises_on_every_rank(local_world):
    for message in local_world(2).run(missing_limit):
        assert "this mesh allows at most 1" in message and "limit_in_flight()" in message, message


# --- the typed record ----------------------------------------------------------------------------


def test_collective_tags_are_one_frozen_record():
    record = fs.schedule.CollectiveTag("all_gather", "blocks.0", "blocks.0", "forward", 64)
    assert dataclasses.replace(record, phase="backward").phase == "backward"
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.phase = "update"
    graph = fx.Graph()
    node = graph.placeholder("x")
    fs.schedule.tag(node, record)
    fs.schedule.mark_forward_end(node)
    graph.output(node)
    assert fs.schedule.tag_of(node) is record
    assert fs.schedule.forward_end(fx.GraphModule(torch.nn.Module(), graph)) is node


# --- buckets under mixed precision -----------------------------------------------------------------


def bucketed_bf16(mesh):
    """bf16 gathers bucketed over 2 micro-batches (each member's shard is cast right before its
    own gather: the bucket's concatenation reads every cast at the first member's place), with
    and without gathering once per step: the eager reference's bits."""
    out = {}
    for name, options in {
        "bucketed": dict(bucket_bytes=1 << 20),
        "bucketed, once per step": dict(bucket_bytes=1 << 20, reshard_after_forward=False, reshard_after_backward=False),
    }.items():
        states = []
        for schedule in (fs.Schedule(trace=False), fs.Schedule(**options)):
            torch.manual_seed(0)
            apply_fn, params = fs.functionalize(MLP(13, 16, 5, n_blocks=3))
            step = fs.sharded_step(
                lambda p, b: torch.nn.functional.cross_entropy(apply_fn(p, b[0]).float(), b[1]), mesh,
                optimizer=fs.optim.adamw(1e-2), microbatches=2, schedule=schedule,
                precision=fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            )
            state = step.init(params)
            g = torch.Generator().manual_seed(mesh.rank)
            for _ in range(2):
                state, metrics = step(state, (torch.randn(4, 13, generator=g), torch.randint(0, 5, (4,), generator=g)))
            states.append(fs.tree_leaves(state))
        gm = step.cache[next(iter(step.cache))].graph_module
        out[name] = (
            all(torch.equal(a, b) for a, b in zip(*states)),
            len([c for c in fs.schedule.collectives(gm) if c.kind == "all_gather"]),
            metrics["all_gather_bytes"],
        )
    out["bf16 bytes of every buffer"] = sum(b.padded_numel * 2 for b in state.params.layout.buffers)
    return out


def test_buckets_gather_bf16_shards(local_world):
    out = local_world(2).run(bucketed_bf16)[0]
    assert out["bucketed"][0] and out["bucketed, once per step"][0], out
    # A bucket per micro-batch and pass (forward, backward): never a later micro-batch's units
    # gathered early into an earlier one's bucket.
    assert out["bucketed"][1] == 4, out
    assert out["bucketed, once per step"][1] == 1, out  # every unit in one bucket, once
    assert out["bucketed, once per step"][2] == out["bf16 bytes of every buffer"], out
    assert out["bucketed"][2] > 3 * out["bf16 bytes of every buffer"], out  # per micro-batch, and again in backward
