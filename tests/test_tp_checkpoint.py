"""`fs.checkpoint` and `fs.export` with tensor-parallel layouts (issue 26, item 5).

- a GPT (`fs.tensor_parallel.gpt_rules`) trained two AdamW steps at `{"fsdp": 2, "tp": 2}` and
  saved loads at `{"fsdp": 4}`, `{"tp": 4}`, `{"replicate": 2, "tp": 2}` (real gloo ranks),
  `{"tp": 2}` and world size 1 (thread ranks) with every parameter, AdamW moment and the count
  equal bit for bit; resumed at the same layout it continues exactly as the uninterrupted run;
- the other way: saved at `{"fsdp": 4}` and at world size 1, loaded at `{"fsdp": 2, "tp": 2}`;
- `fs.export` of a TP state (dict and streamed file) gives the full tensors, in the very file a
  state without placements writes; `load_full` reads that file back into a TP template;
- meta-device init gives the same full weights at tp 1, 2 and 4.

One world of 4 processes serves the module: its ranks make the other meshes of the same
processes with `fs.init_mesh(axes)`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading

import pytest
import torch

import functional_shard as fs
from functional_shard import tensor_parallel as tp
from functional_shard.checkpoint import CheckpointError
from functional_shard.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=60, block_size=8, n_layer=2, n_head=4, d_model=24)
GLOBAL_BATCH = 4  # divisible by every data-parallel size used here
SAVED_AT = {"fsdp": 2, "tp": 2}

_BUILDING = threading.Lock()  # thread-ranks share torch's global RNG: one builds at a time


def make_step(mesh, *, trace: bool = False):
    """The GPT, its step (AdamW) and its full parameters on `mesh`; TP rules when it has `tp`."""
    with _BUILDING:
        torch.manual_seed(0)
        model = GPT(CONFIG)
    rules = tp.gpt_rules(CONFIG) if mesh.shape.get("tp", 1) > 1 else None
    if rules is not None:
        model = tp.parallelize(copy.deepcopy(model), rules, mesh)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        idx, targets = batch
        logits = apply_fn(p, idx).flatten(0, 1)
        if rules is not None:
            return tp.vocab_parallel_cross_entropy(logits, targets.flatten(), mesh, "tp")
        return torch.nn.functional.cross_entropy(logits, targets.flatten())

    optimizer = fs.optim.adamw(1e-2, weight_decay=0.1)
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, placements=rules, schedule=fs.Schedule(trace=trace))
    return step, params


def local_batch(mesh, i: int):
    g = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size), generator=g)
    return idx.chunk(mesh.data_size)[mesh.data_rank], targets.chunk(mesh.data_size)[mesh.data_rank]


def train(step, state, mesh, steps: range):
    losses = []
    for i in steps:
        state, metrics = step(state, local_batch(mesh, i))
        losses.append(metrics["loss"].item())
    return state, losses


def full_state(state) -> dict[str, torch.Tensor]:
    """Parameters and AdamW's moments joined whole over every axis (`fs.gather(..., full=True)`),
    and the count: a collective."""
    sharded = state.params
    tree = fs.gather(sharded, full=True)
    out = {f"params/{p}": t.detach().clone() for p, t in zip(fs.tree_paths(tree), fs.tree_leaves(tree))}
    for name in ("exp_avg", "exp_avg_sq"):
        moment = getattr(state.opt_state, name)
        shards = [moment.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        tree = fs.gather(sharded.replace(shards=shards), full=True)
        trainable = {i for spec in sharded.layout.buffers if spec.trainable for i in spec.leaves}
        for i, (p, t) in enumerate(zip(fs.tree_paths(tree), fs.tree_leaves(tree))):
            if i in trainable:
                out[f"opt/{name}/{p}"] = t.detach().clone()
    out["opt/count"] = state.opt_state.count.clone()
    return out


def mesh_of(mesh, axes):
    return mesh if axes is None or axes == mesh.shape else fs.init_mesh(axes)


# --- what the ranks run (module level: pickled by reference into the rank processes) --------


def save_and_resume(mesh, directory: str, axes=None, trace: bool = False):
    """Two steps, save; two more steps straight; load the checkpoint into a fresh template and
    take the same two steps. Rank 0 returns (the saved full state, the straight run's losses and
    full state, the resumed run's)."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, trace=trace)
    state, _ = train(step, step.init(params), mesh, range(2))
    fs.checkpoint.save(os.path.join(directory, "ckpt"), state)
    saved = full_state(state)
    state, straight_losses = train(step, state, mesh, range(2, 4))
    resumed = fs.checkpoint.load(os.path.join(directory, "ckpt"), step.init(params))
    assert resumed.step == 2
    resumed, resumed_losses = train(step, resumed, mesh, range(2, 4))
    return saved, (straight_losses, full_state(state)), (resumed_losses, full_state(resumed))


def save_at(mesh, path: str, axes=None):
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh)
    state, _ = train(step, step.init(params), mesh, range(2))
    fs.checkpoint.save(path, state)
    return full_state(state)


def load_at(mesh, path: str, axes=None, save_to: str | None = None):
    """Load `path` at `axes` (and save it again to `save_to`, from there)."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh)
    state = fs.checkpoint.load(path, step.init(params))
    if save_to is not None:
        fs.checkpoint.save(save_to, state)
    return full_state(state), state.step


def export_at(mesh, checkpoint: str, out: str, axes=None):
    """Load `checkpoint` at `axes`, export it as a dict and to the file `out`, and read that file
    back into a fresh template with `load_full`."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh)
    state = fs.checkpoint.load(checkpoint, step.init(params))
    exported = fs.export(state)
    fs.export(state, out)
    back = fs.checkpoint.load_full(out, step.init(params))
    return exported, full_state(back)


def dcp_round_trip(mesh, checkpoint: str, directory: str):
    """At {"fsdp": 2, "tp": 2}: load `checkpoint`, `save_dcp` it (`tp`); at {"fsdp": 4}: `load_dcp`
    that (full state 1) and `save_dcp` it again (`plain`); at {"fsdp": 2, "tp": 2}: `load_dcp`
    that (full state 2)."""
    step, params = make_step(mesh)
    state = fs.checkpoint.load(checkpoint, step.init(params))
    fs.checkpoint.save_dcp(os.path.join(directory, "tp"), state)
    plain_mesh = fs.init_mesh({"fsdp": 4})
    plain_step, plain_params = make_step(plain_mesh)
    plain = fs.checkpoint.load_dcp(os.path.join(directory, "tp"), plain_step.init(plain_params))
    fs.checkpoint.save_dcp(os.path.join(directory, "plain"), plain)
    back = fs.checkpoint.load_dcp(os.path.join(directory, "plain"), step.init(params))
    return full_state(plain), full_state(back)


def meta_init_at(mesh, axes=None):
    mesh = mesh_of(mesh, axes)
    with torch.device("meta"):
        model = GPT(CONFIG)
    rules = tp.gpt_rules(CONFIG) if mesh.shape.get("tp", 1) > 1 else None
    if rules is not None:
        model = tp.parallelize(model, rules, mesh)
    _, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, b: None, mesh, optimizer=fs.optim.sgd(0.1), placements=rules)
    state = step.init(params, initialize=fs.initialize.from_module(model, seed=0))
    tree = fs.gather(state.params, full=True)
    return {p: t.clone() for p, t in zip(fs.tree_paths(tree), fs.tree_leaves(tree))}


# --- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    with fs.testing.LocalWorld(4, axes=SAVED_AT) as world:
        yield world


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """A checkpoint saved at {"fsdp": 2, "tp": 2}, and what rank 0 saw."""
    directory = str(tmp_path_factory.mktemp("tp_checkpoint"))
    saved, straight, resumed = world.run(save_and_resume, directory)[0]
    return os.path.join(directory, "ckpt"), saved, straight, resumed


def assert_same(expected: dict, got: dict, where: str) -> None:
    assert set(expected) == set(got), (where, set(expected) ^ set(got))
    inexact = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not inexact, f"{where}: {inexact}"


def test_resume_at_the_same_layout_is_exact(saved):
    _, _, (straight_losses, straight), (resumed_losses, resumed) = saved
    assert resumed_losses == straight_losses
    assert_same(straight, resumed, "resumed at fsdp2xtp2")


def assert_stored(expected: dict, path: str, where: str) -> None:
    stored = fs.checkpoint.read(path)
    assert_same(expected, {k: stored[k] for k in expected if k in stored}, where)


@pytest.mark.slow
def test_traced_resume_at_the_same_layout_is_exact(world, tmp_path):
    _, (straight_losses, straight), (resumed_losses, resumed) = world.run(save_and_resume, str(tmp_path), None, True)[0]
    assert resumed_losses == straight_losses
    assert_same(straight, resumed, "traced, resumed at fsdp2xtp2")


@pytest.mark.slow
def test_tp_checkpoint_loads_exactly_at_tp2_in_gloo_processes(saved, tmp_path):
    path, expected, _, _ = saved
    with fs.testing.LocalWorld(2, axes={"tp": 2}) as pair:
        got, step = pair.run(load_at, path, None, str(tmp_path / "again"))[0]
    assert step == 2
    assert_same(expected, got, "loaded at {'tp': 2} (gloo)")
    assert_stored(expected, str(tmp_path / "again"), "saved again at {'tp': 2} (gloo)")


@pytest.mark.parametrize("axes", [{"fsdp": 4}, {"tp": 4}, {"replicate": 2, "tp": 2}], ids=str)
def test_tp_checkpoint_loads_exactly_at_other_layouts(world, saved, axes, tmp_path):
    """And saved again from there (meshes without a shard axis included), it holds the same."""
    path, expected, _, _ = saved
    got, step = world.run(load_at, path, axes, str(tmp_path / "again"))[0]
    assert step == 2
    assert_same(expected, got, f"loaded at {axes}")
    assert_stored(expected, str(tmp_path / "again"), f"saved again at {axes}")


@pytest.mark.parametrize("axes", [{"tp": 2}, {"fsdp": 1}], ids=str)
def test_tp_checkpoint_loads_exactly_at_smaller_worlds(saved, axes, tmp_path):
    path, expected, _, _ = saved
    size = 1
    for n in axes.values():
        size *= n
    for got, step in fs.testing.SimulatedWorld(size, axes=axes).run(load_at, path, None, str(tmp_path / "again")):
        assert step == 2
        assert_same(expected, got, f"loaded at {axes}")
    assert_stored(expected, str(tmp_path / "again"), f"saved again at {axes}")


def test_tp_checkpoint_is_read_whole_and_checked(saved, tmp_path):
    """`read` gives each tensor whole in C order, whatever order it is stored in; a changed byte
    in the file of a rank at tp coordinate 1 is refused naming the file (`verify=`)."""
    path, expected, _, _ = saved
    assert_stored(expected, path, "read")
    index = json.loads(open(os.path.join(path, "index.json")).read())
    assert index["version"] == 3 and sorted(index["files"].values()) == [0, 1, 2, 3]
    split = {e["key"]: e.get("split") for e in index["entries"]}
    assert split["params/blocks.0.attn.qkv.weight"] == [0, 3, 2]  # q|k|v each split
    assert split["params/blocks.0.mlp.proj.weight"] == [1, 1, 2]  # row-parallel
    assert split["params/tok_emb.weight"] is None  # dimension 0: C order keeps pieces contiguous
    copy_of = tmp_path / "ckpt"
    shutil.copytree(path, copy_of)
    target = copy_of / "rank-00001.safetensors"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rank-00001.safetensors.*CRC-32"):
        fs.checkpoint.read(copy_of)


@pytest.mark.parametrize("saved_at", [{"fsdp": 4}, {"fsdp": 1}], ids=str)
def test_checkpoints_without_placements_load_at_fsdp2_tp2(world, tmp_path, saved_at):
    path = str(tmp_path / "ckpt")
    if saved_at == {"fsdp": 1}:
        expected = fs.testing.SimulatedWorld(1, axes=saved_at).run(save_at, path)[0]
    else:
        expected = world.run(save_at, path, saved_at)[0]
    got, step = world.run(load_at, path)[0]
    assert step == 2
    assert_same(expected, got, f"saved at {saved_at}, loaded at {SAVED_AT}")


def test_export_of_a_tp_state_is_the_export_without_placements(world, saved, tmp_path):
    path, expected, _, _ = saved
    exported, back = world.run(export_at, path, str(tmp_path / "tp.safetensors"))[0]
    plain, _ = world.run(export_at, path, str(tmp_path / "plain.safetensors"), {"fsdp": 4})[0]
    assert (tmp_path / "tp.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert set(exported) == set(plain)
    assert all(torch.equal(exported[k], plain[k]) for k in plain)
    assert torch.equal(exported["head.weight"], expected["params/tok_emb.weight"])  # tied: both names
    params = {k: v for k, v in expected.items() if k.startswith("params/")}
    assert_same(params, {k: v for k, v in back.items() if k.startswith("params/")}, "load_full at fsdp2xtp2")


def test_dcp_of_a_tp_state_holds_full_tensors_and_loads_back(world, saved, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path, expected, _, _ = saved
    plain, back = world.run(dcp_round_trip, path, str(tmp_path))[0]
    assert_same(expected, plain, "save_dcp at fsdp2xtp2, load_dcp at fsdp4")
    assert_same(expected, back, "save_dcp at fsdp4, load_dcp at fsdp2xtp2")
    stored = fs.checkpoint.read_dcp(tmp_path / "tp")
    for key, value in expected.items():
        name = key.split("/")[-1]
        dcp_key = f"model.{name}" if key.startswith("params/") else f"optim.state.{name}.{key.split('/')[1]}"
        if key != "opt/count":
            assert torch.equal(stored[dcp_key], value), dcp_key
    assert torch.equal(stored["model.head.weight"], expected["params/tok_emb.weight"])
    # torch's own reader, into full tensors of the model's shapes
    model = {k: torch.zeros_like(v) for k, v in stored.items() if k.startswith("model.")}
    dcp.load({"model": {k.removeprefix("model."): v for k, v in model.items()}}, checkpoint_id=str(tmp_path / "tp"),
             planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)  # fmt: skip
    assert all(torch.equal(model[k], stored[k]) for k in model)


def test_meta_init_gives_the_same_weights_at_any_tp_degree(world):
    with torch.device("meta"):
        model = GPT(CONFIG)
    reference = fs.initialize.reference(model, seed=0)
    expected = dict(zip(fs.tree_paths(reference), fs.tree_leaves(reference)))
    for axes in ({"fsdp": 4}, SAVED_AT, {"tp": 4}):
        got = world.run(meta_init_at, axes)[0]
        assert_same(expected, got, f"meta init at {axes}")
