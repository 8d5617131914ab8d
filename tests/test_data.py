"""Data per rank (`fs.data.DataParallelSampler`, `fs.data.local_batch`, `fs.data.data_rank`): at
world sizes 1-4 and on a hybrid mesh, every sample is seen once per epoch across the data-parallel
ranks, ranks along a model-parallel axis get the same samples, the order is deterministic, and a
run resumed from a step gets the batches an uninterrupted run would have. Only mesh metadata (and
one small agreement) is read, so thread worlds (`SimulatedWorld`) run most of it; one test runs
real gloo ranks with a `DataLoader`."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import functional_shard as fs
from functional_shard.models import MLP

DATA_PARALLEL = [{"fsdp": 1}, {"fsdp": 2}, {"fsdp": 3}, {"fsdp": 4}, {"replicate": 2, "fsdp": 2}]
# Ranks along `tp` split the model, not the batch: they must be fed the same samples.
WITH_MODEL_PARALLEL = [{"fsdp": 2, "tp": 2}, {"tp": 2, "fsdp": 2}]
LENGTH, BATCH = 37, 12  # 3 full global batches and 1 sample over; 12 divides over 1, 2, 3 and 4 ranks


def ids(axes: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in axes.items())


def run(axes: dict[str, int], fn, *args, **kwargs) -> list:
    world_size = 1
    for size in axes.values():
        world_size *= size
    return fs.testing.SimulatedWorld(world_size, axes=axes).run(fn, *args, **kwargs)


def epochs_on_rank(mesh, epochs: int, *, length=LENGTH, batch_size=BATCH, start_step=0, **options):
    """(this rank's DataRank, {epoch: [indices of each step]}) for epochs up to `epochs`, resumed at `start_step`."""
    sampler = fs.data.DataParallelSampler(length, mesh, batch_size=batch_size, start_step=start_step, **options)
    seen = {}
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        seen[epoch] = list(sampler)
        assert len(seen[epoch]) == len(sampler)
    return sampler.rank, seen


def global_batches(results: list, epoch: int) -> list[list[int]]:
    """Each step's global batch: the data-parallel ranks' parts concatenated in index order, after
    checking that ranks with the same data-parallel index hold the same part."""
    parts = {}
    for rank, seen in results:
        if rank.index in parts:
            assert parts[rank.index] == seen[epoch], "ranks along a model-parallel axis must get the same samples"
        parts[rank.index] = seen[epoch]
    size = results[0][0].size
    assert sorted(parts) == list(range(size))
    steps = len(parts[0])
    return [[i for index in range(size) for i in parts[index][step]] for step in range(steps)]


def distributed_sampler_order(length: int, seed: int, epoch: int) -> list[int]:
    sampler = DistributedSampler(range(length), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize("axes", DATA_PARALLEL + WITH_MODEL_PARALLEL, ids=ids)
def test_every_sample_once_per_epoch_across_the_data_parallel_ranks(axes):
    results = run(axes, epochs_on_rank, 3, seed=5)
    orders = []
    for epoch in range(3):
        batches = global_batches(results, epoch)
        order = distributed_sampler_order(LENGTH, seed=5, epoch=epoch)  # the same shuffle as DistributedSampler's
        assert batches == [order[k * BATCH : (k + 1) * BATCH] for k in range(LENGTH // BATCH)]
        seen = [i for batch in batches for i in batch]
        assert len(seen) == len(set(seen)) == 36  # drop_last: the one sample last in this epoch's order waits
        orders.append(order)
    assert orders[0] != orders[1] != orders[2]  # a new order every epoch


@pytest.mark.parametrize("axes", DATA_PARALLEL, ids=ids)
def test_the_same_samples_per_step_as_distributed_sampler_with_a_dataloader(axes):
    # DistributedSampler(drop_last=True) + DataLoader(batch_size=b, drop_last=True) on every rank:
    # the same samples in each step, spread over the ranks in contiguous parts instead of strided.
    results = run(axes, epochs_on_rank, 2, seed=3)
    size = results[0][0].size
    for epoch in range(2):
        theirs = []
        for rank in range(size):
            sampler = DistributedSampler(range(LENGTH), num_replicas=size, rank=rank, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(epoch)
            theirs.append(list(DataLoader(range(LENGTH), batch_size=BATCH // size, sampler=sampler, drop_last=True)))
        expected = [sorted(int(i) for rank in range(size) for i in theirs[rank][step]) for step in range(len(theirs[0]))]
        assert [sorted(batch) for batch in global_batches(results, epoch)] == expected


@pytest.mark.parametrize("axes", [{"fsdp": 1}, {"fsdp": 3}, {"replicate": 2, "fsdp": 2}], ids=ids)
def test_without_drop_last_the_last_batch_is_completed_with_the_epochs_first_samples(axes):
    results = run(axes, epochs_on_rank, 1, seed=1, drop_last=False)
    batches = global_batches(results, 0)
    order = distributed_sampler_order(LENGTH, seed=1, epoch=0)
    assert len(batches) == 4 and all(len(b) == BATCH for b in batches)  # every step a full batch: no retrace
    assert [i for b in batches for i in b] == order + order[: 4 * BATCH - LENGTH]


def test_the_order_is_deterministic_and_follows_the_seed():
    axes = {"replicate": 2, "fsdp": 2}
    first, again = run(axes, epochs_on_rank, 2, seed=7), run(axes, epochs_on_rank, 2, seed=7)
    other = run(axes, epochs_on_rank, 2, seed=8)
    assert first == again and first != other
    in_order = run(axes, epochs_on_rank, 2, shuffle=False)
    assert global_batches(in_order, 0) == global_batches(in_order, 1) == [list(range(k * 12, k * 12 + 12)) for k in range(3)]


@pytest.mark.parametrize("axes", DATA_PARALLEL + WITH_MODEL_PARALLEL[:1], ids=ids)
@pytest.mark.parametrize("drop_last", [True, False])
def test_a_run_resumed_at_any_step_gets_the_batches_of_an_uninterrupted_one(axes, drop_last):
    epochs = 3
    uninterrupted = run(axes, epochs_on_rank, epochs, seed=11, drop_last=drop_last)
    steps_per_epoch = len(uninterrupted[0][1][0])
    flat = [[part for epoch in range(epochs) for part in seen[epoch]] for _, seen in uninterrupted]
    for start_step in range(epochs * steps_per_epoch):  # mid-epoch, at an epoch's first step, the very last
        resumed = run(axes, epochs_on_rank, epochs, seed=11, drop_last=drop_last, start_step=start_step)
        assert min(resumed[0][1]) == start_step // steps_per_epoch  # the sampler starts in the step's epoch
        for rank, (_, seen) in enumerate(resumed):
            assert [part for epoch in sorted(seen) for part in seen[epoch]] == flat[rank][start_step:], (rank, start_step)


def indices_by_step(mesh, steps: int):
    sampler = fs.data.DataParallelSampler(LENGTH, mesh, batch_size=BATCH, seed=2, start_step=5)
    return [sampler.indices(step) for step in range(steps)]


def test_indices_of_a_step_are_those_the_iteration_yields():
    axes = {"replicate": 2, "fsdp": 2}
    by_step = run(axes, indices_by_step, 9)
    iterated = run(axes, epochs_on_rank, 3, seed=2)
    for rank in range(4):
        assert by_step[rank] == [part for epoch in range(3) for part in iterated[rank][1][epoch]]


def sampler_on(mesh, **options):
    return fs.data.DataParallelSampler(LENGTH, mesh, batch_size=BATCH, **options)


def test_the_sampler_pickles_and_holds_neither_mesh_nor_dataset():
    sampler = run({"fsdp": 2}, sampler_on, start_step=4)[1]
    copy = pickle.loads(pickle.dumps(sampler))
    assert list(copy) == list(sampler) and len(sampler) == 2 and sampler.epoch == 1
    assert "DataParallelSampler(37 samples, batch_size=12 (6 on data-parallel rank 1 of 2)" in repr(sampler)


# --- this rank's part of a global batch ---------------------------------------------------------


def part_of(mesh, batch):
    return fs.data.data_rank(mesh), fs.data.local_batch(batch, mesh)


@pytest.mark.parametrize("axes", DATA_PARALLEL + WITH_MODEL_PARALLEL, ids=ids)
def test_local_batch_cuts_a_global_batch_into_the_data_parallel_parts(axes):
    batch = {"x": torch.arange(48.0).view(12, 4), "y": torch.arange(12), "name": "tales", "weight": 0.5}
    results = run(axes, part_of, batch)
    parts = {}
    for rank, part in results:
        assert part["name"] == "tales" and part["weight"] == 0.5  # not tensors: every rank gets them as they are
        assert part["x"].untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()  # a view, no copy
        if rank.index in parts:
            assert all(torch.equal(part[k], parts[rank.index][k]) for k in ("x", "y"))
        parts[rank.index] = part
    size = results[0][0].size
    for key in ("x", "y"):
        assert torch.equal(torch.cat([parts[i][key] for i in range(size)]), batch[key])


def error_of(mesh, fn, *args, **kwargs) -> str:
    try:
        fn(*args, mesh, **kwargs)
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_local_batch_names_the_leaf_at_fault():
    axes = {"replicate": 2, "fsdp": 2}
    indivisible = {"input_ids": torch.zeros(10, 5, dtype=torch.long), "labels": torch.zeros(10, dtype=torch.long)}
    message = run(axes, error_of, fs.data.local_batch, indivisible)[0]
    assert message == (
        "ValueError: batch leaf 'input_ids' has shape [10, 5]: its batch dimension 10 does not divide over 4 "
        "data-parallel ranks (mesh axes replicate=2 x fsdp=2); use a global batch size that is a multiple of 4"
    )
    scalar = (torch.zeros(8, 3), torch.tensor(2.0))
    assert run(axes, error_of, fs.data.local_batch, scalar)[0].startswith(
        "ValueError: batch leaf '[1]' is a 0-d tensor: it has no batch dimension to split over the 4 data-parallel ranks"
    )
    ragged = {"x": torch.zeros(8, 3), "mask": torch.zeros(4, 3)}
    assert run(axes, error_of, fs.data.local_batch, ragged)[0] == (
        "ValueError: batch leaves 'mask' and 'x' have leading dimensions 4 and 8 (shape [8, 3]): every tensor of a "
        "global batch must have the same batch size"
    )


# --- which ranks are data-parallel ------------------------------------------------------------------


def data_rank_of(mesh, axes=None):
    return fs.data.data_rank(mesh, axes)


def test_data_rank_reads_the_data_axes_of_the_mesh():
    hybrid = {"replicate": 2, "fsdp": 2}
    assert run(hybrid, data_rank_of) == [fs.data.DataRank(r, 4, ("replicate", "fsdp")) for r in range(4)]
    # Given explicitly (in any order): only the fsdp coordinate counts; replicas get the same data.
    assert [r.index for r in run(hybrid, data_rank_of, ("fsdp",))] == [0, 1, 0, 1]
    assert run(hybrid, data_rank_of, ["fsdp", "replicate"])[3] == fs.data.DataRank(3, 4, ("replicate", "fsdp"))
    assert [(r.index, r.size) for r in run({"fsdp": 2, "tp": 2}, data_rank_of)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [r.index for r in run({"tp": 2, "fsdp": 2}, data_rank_of)] == [0, 1, 0, 1]
    assert run({"fsdp": 2}, error_of, lambda axes, mesh: fs.data.data_rank(mesh, axes), ("dp",))[0] == (
        "ValueError: data axes ['dp'] must be distinct axes of the mesh {'fsdp': 2}; not axes of it: ['dp']"
    )
    # a model-parallel axis named as a data axis gave the tp partners different samples (an adversarial pass)
    got = run({"fsdp": 2, "tp": 2}, error_of, lambda axes, mesh: fs.data.data_rank(mesh, axes), ("tp",))
    assert all("data axes ['tp'] name model-parallel axes ['tp']" in g and "must get the same samples" in g for g in got), got


# --- settings refused --------------------------------------------------------------------------------


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def make_sampler(dataset, mesh, **options):
    return fs.data.DataParallelSampler(dataset, mesh, **options)


def test_the_sampler_refuses_what_it_cannot_split():
    hybrid = {"replicate": 2, "fsdp": 2}
    assert run(hybrid, error_of, make_sampler, 40, batch_size=10)[0] == (
        "ValueError: batch_size=10 is the global batch size: it must be a positive multiple of the 4 data-parallel "
        "ranks (mesh axes replicate=2 x fsdp=2)"
    )
    assert run(hybrid, error_of, make_sampler, 7, batch_size=8)[0] == (
        "ValueError: the dataset has 7 samples, fewer than one global batch of 8 (drop_last=True leaves no step); "
        "use a smaller batch_size or drop_last=False"
    )
    assert run({"fsdp": 1}, error_of, make_sampler, Stream(), batch_size=2)[0].startswith(
        "TypeError: DataParallelSampler needs a map-style dataset (with __len__ and __getitem__) or its length; got Stream"
    )
    assert run({"fsdp": 1}, error_of, make_sampler, 10, batch_size=2, start_step=1.5)[0] == (
        "TypeError: start_step must be an int; got 1.5"
    )


def sampler_seeded_by_rank(mesh):
    return fs.data.DataParallelSampler(LENGTH, mesh, batch_size=BATCH, seed=mesh.rank)


def test_ranks_that_disagree_on_the_settings_are_stopped():
    # A seed that depends on the rank would give ranks overlapping samples, silently.
    with pytest.raises(fs.RankError) as info:
        run({"fsdp": 2}, sampler_seeded_by_rank)
    assert "ranks disagree on fs.data.DataParallelSampler's settings" in str(info.value)
    assert "seed 1" in str(info.value) or "seed 0" in str(info.value)


# --- training: resumed from a step, the same parameters ------------------------------------------------


def train(mesh, steps: int, resume_at: int | None):
    """`steps` eager AdamW steps of a tiny MLP on the sampler's batches (3 steps per epoch); with
    `resume_at`, a new sampler (as after loading a checkpoint) continues from that step."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: the ranks are threads of one process
    data = TensorDataset(torch.randn(LENGTH, 5, generator=generator), torch.randint(0, 3, (LENGTH,), generator=generator))
    model = MLP(5, 8, 3, n_blocks=1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=fs.Schedule(trace=False))
    state = step.init(params)
    sampler = fs.data.DataParallelSampler(data, mesh, batch_size=BATCH, seed=4)
    while state.step < steps:
        if state.step == resume_at:
            sampler = fs.data.DataParallelSampler(data, mesh, batch_size=BATCH, seed=4, start_step=state.step)
        sampler.set_epoch(state.step // sampler.steps_per_epoch)
        for batch in DataLoader(data, batch_sampler=sampler):
            state, _ = step(state, batch)
            if state.step in (steps, resume_at):
                break
    return fs.export(state)


def test_training_resumed_mid_epoch_reaches_the_parameters_of_an_uninterrupted_run():
    hybrid = {"replicate": 2, "fsdp": 2}
    uninterrupted = run(hybrid, train, 7, None)[0]
    resumed = run(hybrid, train, 7, 4)[0]  # step 4: the second step of epoch 1
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    different = run(hybrid, train, 6, None)[0]
    assert any(not torch.equal(uninterrupted[k], different[k]) for k in uninterrupted)


# --- real ranks ------------------------------------------------------------------------------------


def loader_batches(mesh):
    data = TensorDataset(torch.arange(LENGTH), torch.arange(LENGTH) * 10)
    sampler = fs.data.DataParallelSampler(data, mesh, batch_size=BATCH, seed=9, start_step=2)
    return [(x, y) for x, y in DataLoader(data, batch_sampler=sampler)]


def test_gloo_ranks_with_a_dataloader_get_their_parts(local_world):
    results = local_world(2).run(loader_batches)
    order = distributed_sampler_order(LENGTH, seed=9, epoch=0)
    assert len(results[0]) == len(results[1]) == 1  # start_step=2: the last step of epoch 0
    x = torch.cat([results[0][0][0], results[1][0][0]])
    assert x.tolist() == order[2 * BATCH : 3 * BATCH] and torch.equal(torch.cat([results[0][0][1], results[1][0][1]]), x * 10)
