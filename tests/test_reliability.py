"""Reliability of the step (issue 7): a run that is correct on one rank is correct on all, or stops loudly.

On real gloo processes:
- variable-length batches, a different length on each rank at each step, traced: the ranks agree
  on retracing, train, and match the eager reference bit for bit;
- parameters that require grad (`dict(model.named_parameters())`): state tensors carry no autograd
  history and memory stays flat over 500 traced steps;
- ranks whose initial values differ are refused (naming the buffer), or take rank 0's values;
- a rank that cannot trace makes every rank raise at once, naming it (no collective timeout);
- `fs.export` on one rank while another steps: both raise, naming what each called;
- a batch dimension that changes every step: bounded cache, a warning naming the dimension;
- collectives of the user (`fs.all_reduce` in `loss_fn`) trace and match the eager reference;
- sparse, quantized, meta and complex parameters: errors naming the leaf.
"""

from __future__ import annotations

import gc
import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, MLP, GPTConfig

LENGTHS = (5, 8, 11)


def _gpt_problem(mesh, schedule):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(vocab_size=23, block_size=16, n_layer=2, n_head=2, d_model=16)))

    def loss_fn(p, tokens):
        logits = apply_fn(p, tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=schedule)
    return step, params


def variable_lengths(mesh, steps: int):
    """Each rank draws its own sequence length per step; traced and eager from the same draws."""
    results = {}
    for name, schedule in (("eager", fs.Schedule(trace=False)), ("traced", fs.Schedule())):
        step, params = _gpt_problem(mesh, schedule)
        state = step.init(params)
        g = torch.Generator().manual_seed(100 + mesh.rank)
        losses = []
        for _ in range(steps):
            length = LENGTHS[int(torch.randint(0, len(LENGTHS), (1,), generator=g))]
            state, metrics = step(state, torch.randint(0, 23, (2, length), generator=g))
            losses.append(float(metrics["loss"]))
        results[name] = (fs.tree_leaves(state), losses, step.traces if schedule.trace else 0)
    same = all(torch.equal(a, b) for a, b in zip(results["eager"][0], results["traced"][0]))
    return same, results["traced"][1], results["traced"][2]


def test_variable_length_batches_per_rank_train_like_the_reference(local_world):
    for same, losses, traces in local_world(2).run(variable_lengths, 8):
        assert same
        assert all(l == l and l < 10 for l in losses)  # finite: every rank ran every step
        assert 1 <= traces <= len(LENGTHS)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def leak_check(mesh, steps: int):
    torch.manual_seed(0)
    model = MLP(32, 64, 4, n_blocks=3)
    apply_fn = fs.functionalize(model)[0]
    params = dict(model.named_parameters())  # requires_grad=True leaves, as users pass them

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3))
    state = step.init(params)
    history = any(t.requires_grad or t.grad_fn is not None for t in fs.tree_leaves(state))
    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    rss = []
    for i in range(steps):
        state, _ = step(state, batch)
        if i in (steps // 5, steps - 1):
            gc.collect()
            rss.append(_rss_mib())
    history = history or any(t.requires_grad or t.grad_fn is not None for t in fs.tree_leaves(state))
    return history, rss


def test_parameters_that_require_grad_do_not_leak(local_world):
    for history, (early, late) in local_world(2).run(leak_check, 500):
        assert not history
        # 400 steps that each leaked the previous step's graph grew by hundreds of MiB.
        assert late - early < 20, f"RSS grew from {early:.0f} to {late:.0f} MiB"


def mixed_values(mesh, mode: str):
    torch.manual_seed(mesh.rank)  # a different model on every rank
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    if mode == "check":
        with pytest.raises(fs.MeshError) as info:
            step.init(params)
        return str(info.value)
    state = step.init(params, values=mode)
    torch.manual_seed(0)
    rank0 = fs.functionalize(MLP(5, 8, 3, n_blocks=2))[1]
    exported = fs.export(state)
    return all(torch.equal(exported[k], rank0[k]) for k in rank0)


def test_ranks_with_different_initial_values_are_refused_or_broadcast(local_world):
    for message in local_world(2).run(mixed_values, "check"):
        assert "ranks [1] hold parameter values that differ from rank 0's" in message
        assert "values='broadcast'" in message
    assert all(local_world(2).run(mixed_values, "broadcast"))


def one_rank_cannot_trace(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, x):
        out = apply_fn(p, x)
        if mesh.rank == 1 and x.shape[0] == 4:
            raise ValueError("rank one's loss cannot take this batch")
        return out.square().mean()

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1))
    state = step.init(params)
    start = time.monotonic()
    try:
        step(state, torch.randn(4, 5))
        outcome = "no error"
    except fs.PeerError as error:
        outcome = f"PeerError rank {error.rank}: {error}"
    except ValueError as error:
        outcome = f"own error: {error}"
    elapsed = time.monotonic() - start
    # The user catches it and carries on: the ranks are still in step with each other.
    state, metrics = step(state, torch.randn(3, 5))
    return outcome, elapsed, float(metrics["loss"])


def test_a_rank_that_cannot_trace_stops_every_rank_at_once(local_world):
    (zero, t0, loss0), (one, t1, loss1) = local_world(2).run(one_rank_cannot_trace)
    assert zero.startswith("PeerError rank 1") and "rank one's loss cannot take this batch" in zero
    assert one == "own error: rank one's loss cannot take this batch"
    assert t0 < 10 and t1 < 10
    assert loss0 == loss1


def export_on_one_rank(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    state = step.init(params)
    with pytest.raises(fs.MeshError) as info:
        if mesh.rank == 0:
            fs.export(state)
        else:
            step(state, torch.randn(2, 5))
    return str(info.value)


def test_a_collective_called_on_a_subset_of_ranks_is_named(local_world):
    for message in local_world(2).run(export_on_one_rank):
        assert "rank 0: fs.export; rank 1: a training step" in message


def retrace_every_step(mesh, steps: int):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))
    step = fs.sharded_step(
        lambda p, x: apply_fn(p, x).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1), max_traces=4
    )
    state = step.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            state, _ = step(state, torch.randn(2 + i, 5))
    return len(step.cache), step.traces, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_retracing_is_bounded_and_names_what_changes(local_world):
    for cached, traces, messages in local_world(2).run(retrace_every_step, 7):
        assert cached == 4 and traces == 7
        assert len(messages) == 1
        assert "batch leaf '<root>' dim 0 took 4 values" in messages[0] and "pad or bucket" in messages[0]


def collective_in_loss(mesh, trace: bool):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, batch):
        x, y = batch
        per_example = F.cross_entropy(apply_fn(p, x), y, reduction="sum")
        # A loss weighted by the global count of examples: a collective inside loss_fn.
        count = fs.all_reduce(torch.tensor(float(x.shape[0])), mesh)
        return per_example / count * mesh.world_size

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=fs.Schedule(trace=trace))
    state = step.init(params)
    g = torch.Generator().manual_seed(mesh.rank)
    for i in range(3):
        n = 2 + mesh.rank + i
        state, _ = step(state, (torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)))
    return fs.tree_leaves(state)


def test_collectives_inside_loss_fn_trace(local_world):
    world = local_world(2)
    for eager, traced in zip(world.run(collective_in_loss, False), world.run(collective_in_loss, True)):
        assert all(torch.equal(a, b) for a, b in zip(eager, traced))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_leaves_a_step_cannot_train_are_named():
    mesh = fs.testing.SimulatedWorld(1)

    def body(mesh, tree, error, match):
        step = fs.sharded_step(lambda p, b: b, mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(trace=False))
        with pytest.raises(error, match=match):
            step.init(tree)

    cases = [
        ({"emb": torch.eye(3).to_sparse()}, fs.LayoutError, r"leaf 'emb' .* torch.sparse_coo tensor.*to_dense"),
        ({"q": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)}, fs.LayoutError, r"leaf 'q' .*quantized"),
        ({"m": torch.empty(3, device="meta")}, fs.StepError, r"leaf 'm' .*meta device"),
        ({"c": torch.ones(2, dtype=torch.complex64)}, fs.StepError, r"leaf 'c' .*complex.*view_as_real"),
    ]
    for tree, error, match in cases:
        mesh.run(body, tree, error, match)
