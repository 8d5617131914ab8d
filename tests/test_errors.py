"""Bad input gets a clear error naming what is at fault, and leaves the caller's state untouched;
a rank that fails does not leave the others hanging."""

from __future__ import annotations

import time

import threading

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import MLP


_MODEL_LOCK = threading.Lock()


def small_problem(mesh, **step_options):
    step_options.setdefault("schedule", fs.Schedule(trace=mesh.supports_tracing))
    with _MODEL_LOCK:  # thread ranks of a simulated world share torch's global RNG
        torch.manual_seed(0)
        model = MLP(5, 8, 3, n_blocks=2)
        batch = (torch.randn(4, 5), torch.randint(0, 3, (4,)))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), **step_options)
    return apply_fn, params, step, batch


def snapshot(state):
    return [t.clone() for t in fs.tree_leaves(state)]


def unchanged(state, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), before))


# --- mesh ------------------------------------------------------------------------------------


def mesh_of_wrong_size(mesh):
    with pytest.raises(ValueError) as info:
        fs.init_mesh({"replicate": 2, "fsdp": 3})
    return str(info.value)


def test_mesh_axes_must_multiply_to_world_size(local_world):
    for message in local_world(2).run(mesh_of_wrong_size):
        assert "{'replicate': 2, 'fsdp': 3}" in message and "6 ranks" in message and "world has 2" in message


def test_mesh_axes_must_be_named_positive_sizes():
    with pytest.raises(ValueError, match="positive int"):
        fs.init_mesh({"fsdp": 0})
    with pytest.raises(ValueError, match="non-empty dict"):
        fs.init_mesh({})
    with pytest.raises(fs.RankError, match="rank 0 failed: ValueError: mesh axes {'fsdp': 3} hold 3 ranks but the world has 4"):
        fs.testing.SimulatedWorld(4, axes={"fsdp": 3}).run(lambda mesh: None)


# --- pytrees ---------------------------------------------------------------------------------


def test_leaf_that_is_not_a_tensor_is_named():
    def body(mesh):
        _, _, step, _ = small_problem(mesh)
        with pytest.raises(fs.LayoutError, match=r"leaf 'layers\[1\].scale' is a float .*not a torch.Tensor"):
            step.init({"layers": [torch.ones(2), {"scale": 0.5}]})
        with pytest.raises(fs.LayoutError, match=r"leaf 'n' is a int"):
            fs.shard({"w": torch.ones(3), "n": 3}, mesh)

    fs.testing.SimulatedWorld(2).run(body)


def ranks_disagree(mesh):
    _, params, step, _ = small_problem(mesh)
    tree = {"w": torch.ones(3 + mesh.rank)}
    with pytest.raises(fs.MeshError) as info:
        step.init(tree)
    return str(info.value)


def test_ranks_with_different_pytrees_raise_on_every_rank(local_world):
    for message in local_world(2).run(ranks_disagree):
        assert "ranks disagree on the parameter pytree" in message and "ranks [0]" in message and "ranks [1]" in message
        assert "ranks [0] hold leaf 'w': whole [3]" in message and "ranks [1] hold leaf 'w': whole [4]" in message


# --- states ----------------------------------------------------------------------------------


def test_state_from_another_step_or_mesh_is_refused_and_untouched():
    def body(mesh):
        _, params, step, batch = small_problem(mesh)
        _, _, other_step, _ = small_problem(mesh)
        state = step.init(params)
        before = snapshot(state)
        with pytest.raises(fs.StepError, match="made by another sharded_step"):
            other_step(state, batch)
        with pytest.raises(fs.StepError, match="expects the StepState"):
            step(params, batch)
        assert unchanged(state, before)
        return state

    states = fs.testing.SimulatedWorld(2).run(body)

    def on_other_mesh(mesh, state):
        _, _, step, batch = small_problem(mesh)
        with pytest.raises(fs.StepError, match=r"made for another mesh object \(SimulatedMesh\(\{'fsdp': 2\}.*than this step's \(SimulatedMesh"):
            step(state, batch)

    fs.testing.SimulatedWorld(2).run(lambda mesh: on_other_mesh(mesh, states[mesh.rank]))


def test_corrupted_shard_is_named():
    def body(mesh):
        _, params, step, batch = small_problem(mesh)
        state = step.init(params)
        shards = list(state.params.shards)
        shards[1] = torch.zeros(shards[1].numel() + 1)
        broken = state.replace(params=state.params.replace(shards=shards))
        with pytest.raises(fs.LayoutError, match=r"shard of buffer 'blocks.0'.*must be \[\d+\] torch.float32"):
            step(broken, batch)

    fs.testing.SimulatedWorld(2).run(body)


# --- losses ----------------------------------------------------------------------------------


def loss_errors(mesh):
    """Run on a simulated mesh (eager) and on a gloo mesh (traced)."""
    schedule = fs.Schedule(trace=mesh.supports_tracing)
    apply_fn, params, _, batch = small_problem(mesh)
    step = fs.sharded_step(lambda p, b: apply_fn(p, b[0]).sum(0), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=schedule)
    state = step.init(params)
    before = snapshot(state)
    with pytest.raises(fs.StepError, match=r"0-d floating tensor.*returned a tensor of shape \[3\] and dtype float32"):
        step(state, batch)
    assert unchanged(state, before)
    tuple_step = fs.sharded_step(
        lambda p, b: (apply_fn(p, b[0]).sum(), 1), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=schedule
    )
    with pytest.raises(fs.StepError, match="has_aux=True"):
        tuple_step(tuple_step.init(params), batch)
    aux_step = fs.sharded_step(
        lambda p, b: (apply_fn(p, b[0]).sum(), {"out": apply_fn(p, b[0])}),
        mesh,
        optimizer=fs.optim.sgd(lr=0.1),
        has_aux=True,
        schedule=schedule,
    )
    _, metrics = aux_step(aux_step.init(params), batch)
    assert metrics["aux"]["out"].shape == (4, 3)

    def raising_loss(p, b):
        apply_fn(p, b[0])
        raise RuntimeError("bad batch")

    raising = fs.sharded_step(raising_loss, mesh, optimizer=fs.optim.adamw(lr=0.1), schedule=schedule)
    state = raising.init(params)
    before = snapshot(state)
    with pytest.raises(RuntimeError, match="bad batch"):
        raising(state, batch)
    assert unchanged(state, before)


def test_loss_errors_are_clear_and_leave_state_untouched_eager():
    fs.testing.SimulatedWorld(3).run(loss_errors)


def test_loss_errors_are_clear_and_leave_state_untouched_traced(local_world):
    local_world(2).run(loss_errors)


def test_simulated_mesh_refuses_to_trace():
    def body(mesh):
        with pytest.raises(fs.StepError, match=r"Schedule\(trace=False\)"):
            fs.sharded_step(lambda p, b: p.sum(), mesh, optimizer=fs.optim.sgd(lr=0.1))

    fs.testing.SimulatedWorld(2).run(body)


# --- failing ranks under fs.launch -------------------------------------------------------------


def rank_one_fails_mid_step(collective_timeout: float):
    mesh = fs.init_mesh({"fsdp": 2}, timeout=collective_timeout)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, batch):
        out = apply_fn(p, batch)
        if mesh.rank == 1:
            raise RuntimeError("rank one cannot go on")
        return out.square().mean()

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1))
    state = step.init(params)
    step(state, torch.randn(4, 5))  # rank 0 waits for rank 1 in the gradient's reduce-scatter
    return "rank 0 finished"


def test_rank_that_raises_mid_step_does_not_hang_the_others():
    start = time.monotonic()
    with pytest.raises(fs.RankError) as info:
        # grace above the collective timeout: rank 0 must fail by itself, from its collective.
        fs.launch(rank_one_fails_mid_step, world_size=2, args=(3.0,), grace=60.0)
    elapsed = time.monotonic() - start
    error = info.value
    assert error.rank == 1
    assert "rank 1 failed: RuntimeError: rank one cannot go on" in str(error)
    assert "Traceback" in error.remote_traceback and "loss_fn" in error.remote_traceback
    assert 0 in error.failures and error.failures[0].kind is not fs.FailureKind.STOPPED, error.failures
    assert elapsed < 45, f"took {elapsed:.0f} s"


def rank_one_fails_while_rank_zero_is_busy():
    fs.init_mesh({"fsdp": 2})
    if int(__import__("os").environ["RANK"]) == 1:
        raise RuntimeError("rank one cannot go on")
    time.sleep(120)  # busy elsewhere: no collective will notice that rank 1 is gone


def test_launcher_stops_ranks_after_grace():
    start = time.monotonic()
    with pytest.raises(fs.RankError) as info:
        fs.launch(rank_one_fails_while_rank_zero_is_busy, world_size=2, grace=1.0)
    assert info.value.rank == 1
    assert info.value.failures[0].kind is fs.FailureKind.STOPPED
    assert "stopped by the launcher 1 s after rank 1 failed" in info.value.failures[0].message
    assert time.monotonic() - start < 45


def returns_rank_info():
    mesh = fs.init_mesh({"fsdp": 2})
    return {"rank": mesh.rank, "world": mesh.world_size, "threads": torch.get_num_threads()}


# With -m slow (suite time): rank 0's result, world and one thread per rank in
# test_launch.py::test_one_call_runs_main_under_a_local_launch_and_under_torchrun and
# test_rank_zero_returns_a_state_dict_and_2000_tensors.
@pytest.mark.slow
def test_launch_returns_rank_zero_result():
    assert fs.launch(returns_rank_info, world_size=2) == {"rank": 0, "world": 2, "threads": 1}


def rank_one_stalls_mid_step(collective_timeout: float, stall: float):
    mesh = fs.init_mesh({"fsdp": 2}, timeout=collective_timeout)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, batch):
        if mesh.rank == 1:
            time.sleep(stall)  # alive, but not at the collective
        return apply_fn(p, batch).square().mean()

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1))
    step(step.init(params), torch.randn(4, 5))


def test_stalled_rank_makes_the_others_time_out():
    """A rank that stops taking part (without dying) fails the others after the collective
    timeout the user set."""
    start = time.monotonic()
    with pytest.raises(fs.RankError) as info:
        fs.launch(rank_one_stalls_mid_step, world_size=2, args=(3.0, 8.0), grace=60.0)
    assert info.value.rank == 0, str(info.value)
    assert "timed out" in str(info.value).lower() or "timeout" in str(info.value).lower(), str(info.value)[:2000]
    assert time.monotonic() - start < 40
