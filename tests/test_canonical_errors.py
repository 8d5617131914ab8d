"""A layout that cannot give the same bits (`sharded_step(..., canonical_chunks=G)`) is refused
with an error naming what is at fault and what to do, before any collective, on every rank:

- a data-parallel degree that is not a power of two dividing `G` (8 at 3 ranks, 6 at 3 and at
  4 ranks): `ValueError` from `sharded_step` (rank 0 alone builds the step: no collective);
- `microbatches` other than 1 or `G / D`: `ValueError` from `sharded_step`;
- a per-rank batch that does not split into `G / D` equal chunks: `StepError` at the step on
  every rank, the state untouched, the world usable after (eager and traced);
  the message names canonical_chunks, the leaf, its shape and the global batch it asks for;
- ranks whose batches have different numbers of rows (each cutting into its chunks, but not the
  same global batch's chunks): the batch rows are among the step's facts, so every rank raises
  before any collective;
- ranks with different torch thread counts (which change kernels, hence bits): `MeshError` at
  the first step on every rank, naming "torch threads" and saying to call
  `torch.set_num_threads` alike, at once (no hang).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import MLP


def build(mesh, chunks: int = 8, *, microbatches: int = 1, trace: bool = True, threads: int = 1):
    torch.set_num_threads(threads)  # before the step is built: it records the count
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=2))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(
        loss_fn,
        mesh,
        optimizer=fs.optim.adamw(1e-2),
        schedule=fs.Schedule(trace=trace),
        canonical_chunks=chunks,
        microbatches=microbatches,
    )
    return step, params


def rows(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def snapshot(state):
    return [t.clone() for t in fs.tree_leaves(state)]


def unchanged(state, before) -> bool:
    return all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), before))


# --- what the ranks run (module level: pickled by reference) ---------------------------------


def build_on_rank_zero_alone(mesh, chunks: int, microbatches: int = 1):
    """Rank 0 builds the step, the others do nothing: a collective in `sharded_step` would hang
    rank 0 (until the collective timeout), so an error here comes before any."""
    if mesh.rank != 0:
        return None
    with pytest.raises(ValueError) as info:
        build(mesh, chunks, microbatches=microbatches)
    return str(info.value)


def step_on_rows(mesh, n: int, trace: bool):
    """One step on `n` rows per rank (the same on every rank): the error, the state untouched,
    and a step on good rows after it."""
    step, params = build(mesh, trace=trace)
    state = step.init(params)
    before = snapshot(state)
    with pytest.raises(fs.StepError) as info:
        step(state, rows(n))
    assert unchanged(state, before)
    state, metrics = step(state, rows(8))  # the same step goes on with a batch that splits
    assert torch.isfinite(metrics["loss"])
    return str(info.value)


def step_with_threads(mesh, threads_of_rank_one: int):
    """Rank 1 builds its step with another thread count; the first step raises on every rank."""
    try:
        step, params = build(mesh, threads=threads_of_rank_one if mesh.rank == 1 else 1)
        state = step.init(params)
        before = snapshot(state)
        start = time.monotonic()
        with pytest.raises(fs.MeshError) as info:
            step(state, rows(4))
        elapsed = time.monotonic() - start
        assert unchanged(state, before)
        return str(info.value), elapsed
    finally:
        torch.set_num_threads(1)  # the session world goes on with one thread per rank


def step_with_rows_of_rank(mesh, n_of_rank: tuple[int, ...]):
    """Data-parallel rank r steps on n_of_rank[r] rows: the error, or None if it trained."""
    step, params = build(mesh)
    state = step.init(params)
    try:
        step(state, rows(n_of_rank[mesh.data_rank]))
    except (fs.MeshError, fs.StepError) as error:
        return str(error)
    return None


# --- the data-parallel degree and the micro-batches: at sharded_step ---------------------------


@pytest.mark.parametrize(
    "world, chunks, valid",
    [(3, 8, "[1, 2, 4, 8]"), (3, 6, "[1, 2]"), (4, 6, "[1, 2]")],
    ids=["G8-at-3", "G6-at-3", "G6-at-4"],
)
def test_degree_that_is_not_a_power_of_two_dividing_G(local_world, world, chunks, valid):
    message = local_world(world).run(build_on_rank_zero_alone, chunks)[0]
    assert f"canonical_chunks={chunks}" in message
    assert f"at {world} data-parallel ranks (data axes: fsdp={world})" in message  # the mesh at fault
    assert "power of two that divides canonical_chunks" in message and f"one of {valid} here" in message
    assert "Pick canonical_chunks as a multiple of every degree you will run at" in message  # what to do


def test_microbatches_that_disagree_with_G_over_D(local_world):
    message = local_world(4).run(build_on_rank_zero_alone, 8, 4)[0]
    assert "canonical_chunks=8 at 4 data-parallel ranks" in message
    assert "its 2 chunk(s) as its micro-batches" in message and "microbatches=4" in message
    assert "Leave microbatches at 1 (or pass 2)" in message


# --- the per-rank batch: at the step ----------------------------------------------------------


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_batch_that_does_not_split_into_chunks(local_world, trace):
    # G = 8 at 2 ranks: 4 chunks per rank; 3 rows do not split into 4 equal chunks.
    for message in local_world(2).run(step_on_rows, 3, trace):
        assert "batch leaf '[0]' has shape [3, 5]" in message  # the leaf and its shape
        assert "not a multiple of 4" in message and "fs.data.local_batch" in message  # what to do


def test_batch_split_error_names_canonical_chunks(local_world):
    for message in local_world(2).run(step_on_rows, 3, True):
        assert "canonical_chunks=8" in message and "2 data-parallel ranks" in message
        assert "multiple of 8" in message  # the global batch's rows


def test_ranks_with_different_batch_rows_raise_on_every_rank(local_world):
    for message in local_world(2).run(step_with_rows_of_rank, (4, 8)):
        assert message is not None and "rows" in message


# --- the threads: at the first step, on every rank --------------------------------------------


def test_ranks_with_different_thread_counts(local_world):
    results = local_world(2).run(step_with_threads, 2)
    for rank, (message, elapsed) in enumerate(results):
        assert "torch threads=2" in message and "torch threads=1" in message, (rank, message)
        assert "rank 1: canonical_chunks=8, torch threads=2" in message  # the rank at fault
        assert "nothing of a training step ran on any rank" in message
        assert elapsed < 10.0, f"rank {rank} took {elapsed:.1f} s to raise"


def test_thread_count_error_says_what_to_do(local_world):
    for message, _ in local_world(2).run(step_with_threads, 2):
        assert "torch.set_num_threads" in message
