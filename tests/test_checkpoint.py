"""`fs.checkpoint`: sharded save / load of training states.

- resume is exact: N steps == N/2 steps, save, load in NEW processes, N/2 steps (torch.equal on
  every shard and optimizer tensor), traced and eager, AdamW and SGD with momentum;
- reshard on load: a checkpoint saved at world size 4 loads at 1, 2, 3, on a 2x2 hybrid mesh and
  with other unit policies (one unit per leaf, one `rest` unit), values exact, and training continues as single-process torch does;
- safety: a rank SIGKILLed mid-save leaves the previous checkpoint loadable and the partial one
  refused, naming what is missing; pickles in place of checkpoint files are refused unexecuted;
  another model's checkpoint names the first differing leaf; torch.save of a state and DCP of
  a state raise.

Real gloo processes for everything that crosses ranks; thread worlds for single-rank errors.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import threading
import zlib

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.checkpoint import CheckpointError
from functional_shard.checkpoint import _files as checkpoint_files
from functional_shard.models import MLP

GLOBAL_BATCH = 12  # divisible by every world size used here (1, 2, 3, 4)
STEPS = 4  # resume: STEPS straight vs STEPS/2, save, load, STEPS/2


class MLPWithBuffer(MLP):
    """The reference MLP plus a module buffer (kept whole per rank, stored from rank 0)."""

    def __init__(self, hidden: int = 16):
        super().__init__(13, hidden, 5, n_blocks=3)
        self.register_buffer("stat", torch.zeros(3))


_BUILDING = threading.Lock()  # thread-ranks share torch's global RNG: one builds at a time


def make_step(mesh, kind: str = "adamw", *, trace: bool = True, units=None, hidden: int = 16):
    with _BUILDING:
        torch.manual_seed(0)
        apply_fn, params = fs.functionalize(MLPWithBuffer(hidden))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    optimizer = {
        "adamw": lambda: fs.optim.adamw(1e-2, weight_decay=0.1),
        "sgd": lambda: fs.optim.sgd(0.1, momentum=0.9),
        "chain": lambda: fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(1e-2, weight_decay=0.1)),
    }[kind]()
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=fs.Schedule(trace=trace), units=units)
    return step, params


def global_batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(GLOBAL_BATCH, 13, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)


def local_batch(mesh, i: int):
    n = GLOBAL_BATCH // mesh.world_size
    return tuple(t[mesh.rank * n : (mesh.rank + 1) * n] for t in global_batch(i))


def train(step, state, mesh, steps: range):
    for i in steps:
        state, _ = step(state, local_batch(mesh, i))
    return state


def rank_tensors(state) -> list[torch.Tensor]:
    """Every tensor this rank holds: parameter shards, module buffers, optimizer state."""
    return [t.detach().clone() for t in fs.tree_leaves(state)]


def full_optimizer_state(state) -> dict[str, torch.Tensor]:
    """The optimizer state gathered to full tensors, named as a checkpoint names them."""
    from functional_shard.checkpoint._format import optimizer_key, optimizer_slots

    sharded = state.params
    layout = sharded.layout
    slots, _ = optimizer_slots(state.opt_state, layout)
    out = {}
    for slot in slots:
        if not slot.param_like:
            out[optimizer_key(slot.path)] = slot.value.clone()
            continue
        shards = [slot.value.get(spec.name, torch.zeros(spec.shard_numel, dtype=spec.dtype)) for spec in layout.buffers]
        full = fs.gather(sharded.replace(shards=shards))
        for spec in layout.buffers:
            if spec.trainable:
                for i in spec.leaves:
                    out[optimizer_key(slot.path, layout.paths[i])] = full[layout.paths[i]].detach().clone()
    return out


def full_state(state) -> dict[str, torch.Tensor]:
    """Every tensor of a state, whole, by checkpoint name (a collective)."""
    params = {f"params/{k}": v for k, v in fs.gather(state.params).items()}
    own = {"state/rng": state.rng.clone()}
    return {**{k: v.detach().clone() for k, v in params.items()}, **full_optimizer_state(state), **own}


# --- what the ranks run (module level: pickled by reference into the rank processes) --------


def straight_then_save(mesh, directory: str, kind: str, trace: bool):
    """STEPS steps straight (this rank's tensors at the end); then STEPS/2 from init, saved."""
    step, params = make_step(mesh, kind, trace=trace)
    straight = train(step, step.init(params), mesh, range(STEPS))
    half = train(step, step.init(params), mesh, range(STEPS // 2))
    fs.checkpoint.save(os.path.join(directory, f"{kind}-{trace}"), half)
    return rank_tensors(straight)


def load_and_finish(mesh, directory: str, kind: str, trace: bool):
    step, params = make_step(mesh, kind, trace=trace)
    state = fs.checkpoint.load(os.path.join(directory, f"{kind}-{trace}"), step.init(params))
    assert state.step == STEPS // 2
    return rank_tensors(train(step, state, mesh, range(STEPS // 2, STEPS)))


def train_and_save_at_4(mesh, path: str, kind: str):
    step, params = make_step(mesh, kind, trace=False)
    state = train(step, step.init(params), mesh, range(2))
    fs.checkpoint.save(path, state)
    return full_state(state), state.step


def load_anywhere(mesh, path: str, kind: str, axes=None, units: str = "default", save_to: str | None = None):
    """Load, compare with the saved tensors, train 2 more steps next to single-process torch."""
    if axes is not None:
        mesh = fs.init_mesh(axes)
    # Saved with the default units (input, blocks, output): load into one unit per leaf, or into
    # the layout of before the input/output split (one `rest`).
    policy = {"default": None, "per_leaf": lambda path: path, "rest": fs.units_by_block}[units]
    step, params = make_step(mesh, kind, trace=False, units=policy)
    state = fs.checkpoint.load(path, step.init(params))
    saved = fs.checkpoint.read(path)
    loaded = full_state(state)
    report = {
        "step": state.step,
        "num_shards": mesh.num_shards,
        "keys_equal": set(saved) == set(loaded),
        "inexact": [k for k in saved if not torch.equal(saved[k], loaded.get(k, torch.empty(0)))],
    }
    if save_to is not None:  # saved again as it was loaded: the same tensors
        fs.checkpoint.save(save_to, state)

    model = MLPWithBuffer()
    model.load_state_dict({k.removeprefix("params/"): v for k, v in saved.items() if k.startswith("params/")})
    if kind == "adamw":
        reference = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for name, p in model.named_parameters():
            count = saved["opt/count"]
            reference.state[p] = {"step": count.clone(), "exp_avg": saved[f"opt/exp_avg/{name}"].clone(), "exp_avg_sq": saved[f"opt/exp_avg_sq/{name}"].clone()}
    else:
        reference = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for name, p in model.named_parameters():
            reference.state[p] = {"momentum_buffer": saved[f"opt/momentum_buffer/{name}"].clone()}
    for i in range(2, 4):
        state, _ = step(state, local_batch(mesh, i))
        x, y = global_batch(i)
        reference.zero_grad()
        F.cross_entropy(model(x), y).backward()
        reference.step()
    trained = fs.export(state)
    report["errors"] = {
        n: float((trained[n] - p.detach()).abs().max() / p.detach().abs().max()) for n, p in model.named_parameters()
    }
    return report


def save_then_die(mesh, directory: str):
    """Save `good`; take a step; save `bad`, during which rank 1 is SIGKILLed half-way through its file."""
    step, params = make_step(mesh, "sgd")
    state = train(step, step.init(params), mesh, range(1))
    fs.checkpoint.save(os.path.join(directory, "good"), state)
    state = train(step, state, mesh, range(1, 2))
    if mesh.rank == 1:
        import safetensors.torch

        def write_half_then_die(path, tensors, metadata):
            data = safetensors.torch.save(tensors, metadata=metadata)
            with open(path.with_name(path.name + ".tmp"), "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_files.write_rank_file = write_half_then_die
    fs.checkpoint.save(os.path.join(directory, "bad"), state)


def load_after_kill(mesh, directory: str):
    step, params = make_step(mesh, "sgd")
    good = fs.checkpoint.load(os.path.join(directory, "good"), step.init(params))
    errors = {}
    for name in ["bad", *sorted(n for n in os.listdir(directory) if n.startswith("bad.partial-"))]:
        try:
            fs.checkpoint.load(os.path.join(directory, name), step.init(params))
            errors[name] = None
        except CheckpointError as error:
            errors[name] = str(error)
    return good.step, errors


def dcp_of_a_state(mesh, directory: str):
    """Hand a StepState (and its parts) to torch.distributed.checkpoint: each attempt must raise."""
    import torch.distributed.checkpoint as dcp

    step, params = make_step(mesh, "adamw", trace=False)
    state = step.init(params)
    outcomes = {}
    for name, value in [("state", {"state": state}), ("params", {"params": state.params}), ("bare", state)]:
        try:
            dcp.save(value, checkpoint_id=os.path.join(directory, name))
            outcomes[name] = None
        except BaseException as error:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            outcomes[name] = f"{type(error).__name__}: {error} {getattr(error, 'failures', '')}"
    return outcomes


# --- resume is exact ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fresh_world():
    """Processes that have saved nothing: loads here are loads in NEW processes."""
    with fs.testing.LocalWorld(2, collective_timeout=60.0) as world:
        yield world


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_resume_in_new_processes_is_exact(local_world, fresh_world, tmp_path, kind, trace):
    straight = local_world(2).run(straight_then_save, str(tmp_path), kind, trace)
    resumed = fresh_world.run(load_and_finish, str(tmp_path), kind, trace)
    for rank in range(2):
        assert len(straight[rank]) == len(resumed[rank])
        for i, (a, b) in enumerate(zip(straight[rank], resumed[rank])):
            assert torch.equal(a, b), f"rank {rank}, tensor {i}: resumed differs from straight by {(a - b).abs().max()}"


# --- reshard on load ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_at_4(local_world, tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved_at_4")
    out = {}
    for kind in ["adamw", "sgd"]:
        path = str(directory / kind)
        results = local_world(4).run(train_and_save_at_4, path, kind)
        out[kind] = path
        tensors, step = results[0]
        saved = fs.checkpoint.read(path)
        assert step == 2 and json.loads(open(os.path.join(path, "index.json")).read())["step"] == 2
        assert set(saved) == set(tensors)
        assert all(torch.equal(saved[k], tensors[k]) for k in saved), "read() differs from the gathered saved state"
    return out


RESHARDS = {
    "world1": dict(world=1),
    "world2": dict(world=2),
    "world3": dict(world=3),
    "hybrid2x2": dict(world=4, axes={"replicate": 2, "fsdp": 2}),
    "world2-leaf-units": dict(world=2, units="per_leaf"),
    "world2-rest-units": dict(world=2, units="rest"),
}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("case", list(RESHARDS))
def test_reshard_on_load(local_world, saved_at_4, tmp_path, case, kind):
    config = dict(RESHARDS[case])
    world = config.pop("world")
    save_to = str(tmp_path / "again") if case == "hybrid2x2" else None
    runner = fs.testing.SimulatedWorld(1) if world == 1 else local_world(world)  # one rank: a thread will do
    reports = runner.run(load_anywhere, saved_at_4[kind], kind, save_to=save_to, **config)
    tolerance = 1e-5  # fp32 rounding (the sums over ranks run in another order); seen: ~1e-7
    for rank, report in enumerate(reports):
        assert report["step"] == 2 and report["num_shards"] == config.get("axes", {}).get("fsdp", world)
        assert report["keys_equal"] and not report["inexact"], f"rank {rank}: not loaded exactly: {report['inexact']}"
        bad = {n: e for n, e in report["errors"].items() if e > tolerance}
        assert not bad, f"rank {rank}: 2 steps after loading, off single-process torch by more than {tolerance} x max|p|: {bad}"
    if save_to is not None:
        # A hybrid mesh saves through one replica: two files (shard 0 and shard 1), no chunk twice.
        index = json.loads(open(os.path.join(save_to, "index.json")).read())
        assert index["files"] == {"rank-00000.safetensors": 0, "rank-00001.safetensors": 1}
        assert sorted(f for f in os.listdir(save_to) if f.endswith(".safetensors")) == sorted(index["files"])
        original, again = fs.checkpoint.read(saved_at_4[kind]), fs.checkpoint.read(save_to)
        assert set(original) == set(again) and all(torch.equal(original[k], again[k]) for k in original)


# --- buffers, mismatches, pickles (one rank: threads) ---------------------------------------


def buffers_are_rank_zeros(mesh, path: str, save: bool):
    step, params = make_step(mesh, "sgd", trace=False)
    params.buffers["stat"] = torch.full((3,), float(mesh.rank + 1))  # per-rank buffer values
    state = step.init(params)
    if save:
        fs.checkpoint.save(path, state)
        return None
    return fs.checkpoint.load(path, state).params.local[0]


def chain_save_or_load(mesh, path: str, save: bool):
    step, params = make_step(mesh, "chain", trace=False)
    state = step.init(params)
    if save:
        state = train(step, state, mesh, range(2))
        fs.checkpoint.save(path, state)
        return full_state(state)
    state = fs.checkpoint.load(path, state)
    return full_state(train(step, state, mesh, range(2, 3)))


def test_nested_optimizer_state_of_a_chain(tmp_path):
    path = str(tmp_path / "c")
    saved = fs.testing.SimulatedWorld(2).run(chain_save_or_load, path, True)[0]
    on_disk = fs.checkpoint.read(path)
    assert "opt/1/count" in on_disk and "opt/1/exp_avg/blocks.0.fc1.weight" in on_disk, sorted(on_disk)[:8]
    assert set(on_disk) == set(saved) and all(torch.equal(on_disk[k], saved[k]) for k in saved)
    # Loaded at 3 ranks and at 2, one more step each: the same training to fp32 rounding.
    at_3 = fs.testing.SimulatedWorld(3).run(chain_save_or_load, path, False)[0]
    at_2 = fs.testing.SimulatedWorld(2).run(chain_save_or_load, path, False)[0]
    assert set(at_3) == set(at_2) == set(saved)
    for key in at_2:
        scale = float(at_2[key].abs().max()) or 1.0
        assert float((at_3[key] - at_2[key]).abs().max()) <= 1e-5 * scale, key


def test_module_buffers_are_rank_zeros(tmp_path):
    path = str(tmp_path / "c")
    fs.testing.SimulatedWorld(3).run(buffers_are_rank_zeros, path, True)
    for loaded in fs.testing.SimulatedWorld(2).run(buffers_are_rank_zeros, path, False):
        assert torch.equal(loaded, torch.ones(3))


def save_then_load_other(mesh, path: str, saved: dict, loaded: dict):
    step, params = make_step(mesh, **saved, trace=False)
    fs.checkpoint.save(path, step.init(params))
    step, params = make_step(mesh, **loaded, trace=False)
    template = step.init(params)
    before = rank_tensors(template)
    try:
        fs.checkpoint.load(path, template)
    except CheckpointError as error:
        untouched = all(torch.equal(a, b) for a, b in zip(before, rank_tensors(template)))
        return str(error), untouched
    return None, True


def test_other_models_checkpoint_names_first_differing_leaf(tmp_path):
    [(message, untouched)] = fs.testing.SimulatedWorld(1).run(save_then_load_other, str(tmp_path / "a"), {}, {"hidden": 32})
    assert message is not None and untouched
    assert "'params/input_proj.weight'" in message and "float32[16, 13]" in message and "float32[32, 13]" in message
    [(message, untouched)] = fs.testing.SimulatedWorld(1).run(save_then_load_other, str(tmp_path / "b"), {}, {"kind": "sgd"})
    assert message is not None and untouched
    assert "optimizer state is structured as" in message and "AdamWState" in message and "SGDState" in message


class CreatesFile:
    """A pickle payload: unpickling it creates `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def save_one(mesh, path: str):
    step, params = make_step(mesh, "adamw", trace=False)
    state = step.init(params)
    fs.checkpoint.save(path, state)
    return None


def load_one(mesh, path: str):
    step, params = make_step(mesh, "adamw", trace=False)
    try:
        fs.checkpoint.load(path, step.init(params))
    except CheckpointError as error:
        return str(error)
    return None


@pytest.mark.parametrize("replaced", ["index.json", "rank-00000.safetensors", "COMMIT"])
def test_pickle_in_place_of_a_file_is_refused_unexecuted(tmp_path, replaced):
    path = str(tmp_path / "c")
    marker = tmp_path / "executed"
    fs.testing.SimulatedWorld(1).run(save_one, path)
    assert fs.testing.SimulatedWorld(1).run(load_one, path) == [None]
    payload = pickle.dumps(CreatesFile(str(marker)))
    assert not marker.exists()
    with open(os.path.join(path, replaced), "wb") as f:
        f.write(payload)
    with open(os.path.join(path, ".metadata"), "wb") as f:  # where DCP would look: never read
        f.write(payload)
    [message] = fs.testing.SimulatedWorld(1).run(load_one, path)
    assert message is not None and replaced in message
    with pytest.raises(CheckpointError):
        fs.checkpoint.read(path)
    assert not marker.exists(), "loading a checkpoint executed code from it"


def torch_save_a_state(mesh):
    step, params = make_step(mesh, "adamw", trace=False)
    state = step.init(params)
    messages = []
    for value in (state, state.params):
        try:
            torch.save(value, io.BytesIO())
            messages.append(None)
        except TypeError as error:
            messages.append(str(error))
    return messages


def test_torch_save_of_a_state_points_to_fs_checkpoint():
    [messages] = fs.testing.SimulatedWorld(1).run(torch_save_a_state)
    assert all(m is not None and "fs.checkpoint" in m for m in messages), messages


def test_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path):
    path = str(tmp_path / "c")
    fs.testing.SimulatedWorld(1).run(save_one, path)
    with pytest.raises(fs.RankError, match="already exists"):
        fs.testing.SimulatedWorld(1).run(save_one, path)
    assert fs.testing.SimulatedWorld(1).run(load_one, path) == [None]


# --- across real ranks: DCP of a state, a rank killed during a save -------------------------


def test_dcp_of_a_state_raises(local_world, tmp_path):
    for rank, outcomes in enumerate(local_world(2).run(dcp_of_a_state, str(tmp_path))):
        for name, outcome in outcomes.items():
            assert outcome is not None, f"rank {rank}: torch.distributed.checkpoint.save of {name} did not raise"
        assert "fs.checkpoint" in outcomes["state"] and "fs.checkpoint" in outcomes["params"]


def test_rank_killed_during_save_leaves_previous_checkpoint(local_world, fresh_world, tmp_path):
    with pytest.raises(fs.RankError):
        local_world(2).run(save_then_die, str(tmp_path))
    assert not (tmp_path / "bad").exists()
    [partial] = [n for n in os.listdir(tmp_path) if n.startswith("bad.partial-")]
    step, errors = fresh_world.run(load_after_kill, str(tmp_path))[0]  # the killed world is gone
    assert step == 1
    for name, message in errors.items():
        assert message is not None, f"{name} loaded"
        assert "rank-00001.safetensors" in message and "COMMIT" in message, message
    assert partial in errors["bad"], errors["bad"]
    shutil.rmtree(tmp_path / partial)


def load_from_another_device(mesh, path: str):
    """A checkpoint whose index says it was saved from CUDA tensors, loaded onto this CPU mesh:
    refused naming both devices (template untouched), then loaded with `across_devices=True`."""
    step, params = make_step(mesh, trace=False)
    state = train(step, step.init(params), mesh, range(2))
    fs.checkpoint.save(path, state)
    if mesh.rank == 0:  # what a save on a CUDA mesh writes
        index_path = os.path.join(path, checkpoint_files.INDEX)
        with open(index_path) as f:
            index = json.load(f)
        assert index["saved_by"]["device"] == "cpu"
        index["saved_by"]["device"] = "cuda"
        data = json.dumps(index).encode()
        with open(index_path, "wb") as f:
            f.write(data)
        marker_path = os.path.join(path, checkpoint_files.COMMIT)  # and the index's checksum with it
        with open(marker_path) as f:
            marker = json.load(f)
        marker["index"] = f"{zlib.crc32(data):08x}"
        with open(marker_path, "w") as f:
            json.dump(marker, f)
    mesh.all_reduce_flat(torch.zeros(1))  # rank 0 has rewritten it
    template = step.init(params)
    before = rank_tensors(template)
    try:
        fs.checkpoint.load(path, template)
        message = None
    except CheckpointError as error:
        message = str(error)
    untouched = all(torch.equal(a, b) for a, b in zip(before, rank_tensors(template)))
    loaded = fs.checkpoint.load(path, template, across_devices=True)
    same = all(torch.equal(a, b) for a, b in zip(rank_tensors(loaded), rank_tensors(state)))
    return message, untouched, same


def test_a_state_from_another_kind_of_device_needs_saying_so(tmp_path):
    for message, untouched, same in fs.testing.SimulatedWorld(2).run(load_from_another_device, str(tmp_path / "c")):
        assert message is not None and "cuda" in message and "cpu" in message and "across_devices=True" in message, message
        assert untouched and same
