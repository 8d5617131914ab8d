"""`fs.checkpoint` and `fs.export` with pipelined states (issue 27, "Checkpoints").

A pipelined step's ranks hold only their stages' leaves (sharded over `fsdp` among the ranks of
one pipeline coordinate). Here, with real gloo ranks:

- a GPT trained two AdamW steps at `{"pp": 2, "fsdp": 2}` and saved loads at `{"pp": 4}`,
  `{"fsdp": 4}` (a plain step) and world size 1 with every parameter, AdamW moment and the count
  equal bit for bit to what the ranks held, and saved again from there holds the same bytes;
  resumed at the same layout it continues exactly as the uninterrupted run;
- the other way: saved at `{"fsdp": 4}`, loaded at `{"pp": 2, "fsdp": 2}` and `{"pp": 4}`;
- a tied GPT (embedding and head one leaf, held by the first stage) the same;
- `fs.export` of a pipelined state is the full state dict on every rank, the one a plain step
  exports from the same checkpoint; streamed to a file, the plain step's file byte for byte
  (1F1B; interleaved: the same tensors under the same names);
- a checkpoint that lacks leaves of the state, or holds leaves no rank's state has, is refused
  on every rank, naming the leaf;
- `save_dcp` of a pipelined state is the plain step's DCP checkpoint (the same keys and tensors;
  torch reads it), and `load_dcp` loads a DCP checkpoint into a pipelined state exactly.

One world of 4 processes serves the module: its ranks make the other meshes of the same
processes with `fs.init_mesh(axes)`.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import functional_shard as fs
from functional_shard.checkpoint import CheckpointError
from functional_shard.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=False)
TIED = dataclasses.replace(CONFIG, tie_weights=True)
SAVED_AT = {"pp": 2, "fsdp": 2}
GLOBAL_BATCH = 4  # divisible by every data-parallel size here, times the micro-batches
MICROBATCHES = 2

_BUILDING = threading.Lock()  # thread-ranks share torch's global RNG: one builds at a time


def make_step(mesh, config=CONFIG, *, trace: bool = False, schedule: str = "1f1b", frozen: tuple[str, ...] = ()):
    """The GPT's step (AdamW; `schedule`, 1F1B, over `MICROBATCHES` on a mesh with `pp`) and its
    parameters; those whose names start with one of `frozen` frozen."""
    torch.set_num_threads(1)
    with _BUILDING:
        torch.manual_seed(0)
        model = GPT(config)
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(frozen) if frozen else True)
        apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        idx, targets = batch
        return F.cross_entropy(apply_fn(p, idx).flatten(0, 1), targets.flatten())

    pipeline = {"microbatches": MICROBATCHES, "pipeline": fs.pipeline.Pipeline(schedule)} if "pp" in mesh.shape else {}
    optimizer = fs.optim.adamw(1e-2, weight_decay=0.1)
    return fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=fs.Schedule(trace=trace), **pipeline), params


def local_batch(mesh, i: int):
    g = torch.Generator().manual_seed(100 + i)
    idx = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.block_size), generator=g)
    targets = torch.roll(idx, -1, 1)
    return idx.chunk(mesh.data_size)[mesh.data_rank], targets.chunk(mesh.data_size)[mesh.data_rank]


def train(step, state, mesh, steps: range):
    losses = []
    for i in steps:
        state, metrics = step(state, local_batch(mesh, i))
        losses.append(metrics["loss"].item())
    return state, losses


def held(state) -> dict[str, torch.Tensor]:
    """What this rank's state holds, by checkpoint name: its leaves and AdamW's moments of them,
    gathered whole over `fsdp` (a collective), and the count."""
    sharded = state.params
    tree = fs.gather(sharded, full=True)
    out = {f"params/{p}": t.detach().clone() for p, t in zip(fs.tree_paths(tree), fs.tree_leaves(tree))}
    trainable = {i for spec in sharded.layout.buffers if spec.trainable for i in spec.leaves}
    for name in ("exp_avg", "exp_avg_sq"):
        moment = getattr(state.opt_state, name)
        shards = [moment.get(spec.name, torch.zeros_like(s)) for spec, s in zip(sharded.layout.buffers, sharded.shards)]
        tree = fs.gather(sharded.replace(shards=shards), full=True)
        for i, (p, t) in enumerate(zip(fs.tree_paths(tree), fs.tree_leaves(tree))):
            if i in trainable:
                out[f"opt/{name}/{p}"] = t.detach().clone()
    out["opt/count"] = state.opt_state.count.clone()
    return out


def union(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """The ranks' `held` joined; a tensor two ranks hold must be the same bits on both."""
    out: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(per_rank):
        for key, value in part.items():
            if key in out:
                assert torch.equal(out[key], value), f"{key} differs between ranks (rank {rank})"
            out[key] = value
    return out


def mesh_of(mesh, axes):
    return mesh if axes is None or axes == mesh.shape else fs.init_mesh(axes)


# --- what the ranks run (module level: pickled by reference into the rank processes) --------


def save_and_resume(mesh, directory: str, config=CONFIG, trace: bool = False):
    """Two steps, save; two more steps straight; load the checkpoint into a fresh template and
    take the same two steps. Every rank returns (what it held when saving, the straight run's
    losses and state, the resumed run's)."""
    step, params = make_step(mesh, config, trace=trace)
    state, _ = train(step, step.init(params), mesh, range(2))
    fs.checkpoint.save(os.path.join(directory, "ckpt"), state)
    saved = held(state)
    state, straight_losses = train(step, state, mesh, range(2, 4))
    resumed = fs.checkpoint.load(os.path.join(directory, "ckpt"), step.init(params))
    assert resumed.step == 2
    resumed, resumed_losses = train(step, resumed, mesh, range(2, 4))
    return saved, (straight_losses, held(state)), (resumed_losses, held(resumed))


def save_at(mesh, path: str, axes=None, config=CONFIG, steps: int = 2, frozen: tuple[str, ...] = ()):
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, config, frozen=frozen)
    state, _ = train(step, step.init(params), mesh, range(steps))
    fs.checkpoint.save(path, state)
    return held(state)


def load_at(mesh, path: str, axes=None, save_to: str | None = None, config=CONFIG, frozen: tuple[str, ...] = ()):
    """Load `path` at `axes` (and save it again to `save_to`, from there)."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, config, frozen=frozen)
    state = fs.checkpoint.load(path, step.init(params))
    if save_to is not None:
        fs.checkpoint.save(save_to, state)
    return held(state), state.step


def export_at(mesh, path: str, axes=None, config=CONFIG, out: str | None = None, schedule: str = "1f1b"):
    """Load `path` at `axes` (under `schedule` if pipelined) and export it as a dict (and, streamed,
    to the file `out`)."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, config, schedule=schedule)
    state = fs.checkpoint.load(path, step.init(params))
    exported = fs.export(state)
    if out is not None:
        fs.export(state, out)
    return exported


def dcp_at(mesh, path: str, out: str, axes=None, config=CONFIG, schedule: str = "1f1b") -> None:
    """Load `path` at `axes` (under `schedule` if pipelined) and save it as a DCP checkpoint at `out`."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, config, schedule=schedule)
    state = fs.checkpoint.load(path, step.init(params))
    group = {k: v for k, v in torch.optim.AdamW([torch.zeros(1)], lr=1e-2, weight_decay=0.1).param_groups[0].items() if k != "params"}
    fs.checkpoint.save_dcp(out, state, param_groups=[group])


def from_dcp(mesh, path: str, config=CONFIG, schedule: str = "1f1b"):
    """`load_dcp` of `path` into this mesh's (pipelined) template: what the ranks hold, or the error."""
    step, params = make_step(mesh, config, schedule=schedule)
    try:
        return held(fs.checkpoint.load_dcp(path, step.init(params)))
    except CheckpointError as error:
        return str(error)


def from_file(mesh, path: str, how: str, schedule: str = "1f1b"):
    """A pipelined state from the safetensors state dict at `path`: `step.init` of meta
    parameters with `from_safetensors` ("init"), or `load_full` into a template ("load"); its
    export, or the error."""
    step, params = make_step(mesh, schedule=schedule)
    try:
        if how == "init":
            with torch.device("meta"):
                _, meta = fs.functionalize(GPT(CONFIG))
            state = step.init(meta, initialize=fs.checkpoint.from_safetensors(path))
        else:
            state = fs.checkpoint.load_full(path, step.init(params))
    except CheckpointError as error:
        return str(error)
    return fs.export(state)


def export_error(mesh, path: str, out: str) -> str | None:
    """Load `path` here and stream its export to `out`: the error this rank raises."""
    step, params = make_step(mesh)
    state = fs.checkpoint.load(path, step.init(params))
    try:
        fs.export(state, out)
    except Exception as error:  # noqa: BLE001 (rank 0 raises its own, the others ExportError)
        return f"{type(error).__name__}: {error}"
    return None


def load_error(mesh, path: str, axes=None, config=CONFIG):
    """The message `load` raises on this rank."""
    mesh = mesh_of(mesh, axes)
    step, params = make_step(mesh, config)
    template = step.init(params)
    try:
        fs.checkpoint.load(path, template)
    except CheckpointError as error:
        return str(error)
    return None


# --- the tests ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world():
    with fs.testing.LocalWorld(4, axes=SAVED_AT) as world:
        yield world


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    """A checkpoint saved at {"pp": 2, "fsdp": 2}, what the ranks held, and the resumed runs."""
    directory = str(tmp_path_factory.mktemp("pp_checkpoint"))
    results = world.run(save_and_resume, directory)
    expected = union([r[0] for r in results])
    straight = ([r[1][0] for r in results], union([r[1][1] for r in results]))
    resumed = ([r[2][0] for r in results], union([r[2][1] for r in results]))
    return os.path.join(directory, "ckpt"), expected, straight, resumed


def assert_same(expected: dict, got: dict, where: str) -> None:
    assert set(expected) == set(got), (where, sorted(set(expected) ^ set(got))[:6])
    inexact = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not inexact, f"{where}: {inexact}"


def assert_stored(expected: dict, path: str, where: str) -> None:
    stored = fs.checkpoint.read(path)
    assert set(stored) - set(expected) == {"state/rng"}, where
    assert_same(expected, {k: stored[k] for k in expected if k in stored}, where)


def test_saved_pipelined_state_is_what_the_ranks_held(saved):
    """Every tensor of the model is in the checkpoint once, whole, as the ranks held it."""
    path, expected, _, _ = saved
    assert sum(k.startswith("params/") for k in expected) == len(dict(GPT(CONFIG).named_parameters()))
    assert_stored(expected, path, "saved at pp2xfsdp2")


def test_resume_at_the_same_layout_is_exact(saved):
    _, _, (straight_losses, straight), (resumed_losses, resumed) = saved
    assert resumed_losses == straight_losses
    assert_same(straight, resumed, "resumed at pp2xfsdp2")


@pytest.mark.parametrize("axes", [{"pp": 4}, {"fsdp": 4}], ids=str)
def test_pipelined_checkpoint_loads_exactly_at_other_layouts(world, saved, axes, tmp_path):
    """And saved again from there, it holds the same bytes."""
    path, expected, _, _ = saved
    results = world.run(load_at, path, axes, str(tmp_path / "again"))
    assert all(step == 2 for _, step in results)
    assert_same(expected, union([got for got, _ in results]), f"loaded at {axes}")
    assert_stored(expected, str(tmp_path / "again"), f"saved again at {axes}")


def test_pipelined_checkpoint_loads_exactly_at_world_size_1(saved, tmp_path):
    path, expected, _, _ = saved
    (got, step), = fs.testing.SimulatedWorld(1, axes={"fsdp": 1}).run(load_at, path, None, str(tmp_path / "again"))
    assert step == 2
    assert_same(expected, got, "loaded at world size 1")
    assert_stored(expected, str(tmp_path / "again"), "saved again at world size 1")


def test_checkpoint_without_pipeline_loads_exactly_with_one(world, tmp_path):
    path = str(tmp_path / "ckpt")
    expected = union(world.run(save_at, path, {"fsdp": 4}))
    for axes in (SAVED_AT, {"pp": 4}):
        results = world.run(load_at, path, axes, str(tmp_path / f"again-{axes['pp']}"))
        assert all(step == 2 for _, step in results)
        assert_same(expected, union([got for got, _ in results]), f"saved at fsdp4, loaded at {axes}")
        assert_stored(expected, str(tmp_path / f"again-{axes['pp']}"), f"saved again at {axes}")


def test_tied_gpt_checkpoint_across_pipeline_degrees(world, tmp_path):
    """The tied embedding/head is one leaf of the first stage: saved at pp2 x fsdp2, loaded at
    pp4 and at fsdp4, exact; saved at fsdp4, loaded at pp2 x fsdp2, exact."""
    path = str(tmp_path / "ckpt")
    expected = union(world.run(save_at, path, None, TIED, 1))
    assert "params/head.weight" not in expected and "params/tok_emb.weight" in expected
    for axes in ({"pp": 4}, {"fsdp": 4}):
        results = world.run(load_at, path, axes, None, TIED)
        assert_same(expected, union([got for got, _ in results]), f"tied, loaded at {axes}")
    plain = str(tmp_path / "plain")
    expected = union(world.run(save_at, plain, {"fsdp": 4}, TIED, 1))
    results = world.run(load_at, plain, None, None, TIED)
    assert_same(expected, union([got for got, _ in results]), "tied, saved at fsdp4, loaded at pp2xfsdp2")


def test_a_stage_of_frozen_units_saves_and_loads(world, tmp_path):
    """The last stage's units all frozen (a fine-tuned trunk, its head and last blocks fixed): the
    ranks of that stage hold no optimizer state (`{}` for each moment) and still agree with the
    others on the checkpoint's structure; saved at pp2 x fsdp2, loaded there and at fsdp4, exact."""
    frozen = ("blocks.2.", "blocks.3.", "ln_f.", "head.")
    path = str(tmp_path / "ckpt")
    expected = union(world.run(save_at, path, None, CONFIG, 1, frozen))
    assert "opt/exp_avg/head.weight" not in expected and "opt/exp_avg/blocks.0.attn.qkv.weight" in expected
    for axes in (None, {"fsdp": 4}):
        results = world.run(load_at, path, axes, None, CONFIG, frozen)
        assert_same(expected, union([got for got, _ in results]), f"frozen last stage, loaded at {axes}")


def test_export_of_a_pipelined_state_is_the_full_state_dict(world, saved, tmp_path):
    """In memory: the plain step's state dict on every rank. Streamed (each pipeline coordinate's
    buffers gathered in turn, sent to rank 0): the plain step's file byte for byte under 1F1B
    (stages in the model's order); under interleaved 1F1B (rank 0 holds stages 0 and 2) the same
    tensors under the same names, and a module loads it strictly."""
    path, expected, _, _ = saved
    results = world.run(export_at, path, None, CONFIG, str(tmp_path / "pp.safetensors"))
    plain = world.run(export_at, path, {"fsdp": 4}, CONFIG, str(tmp_path / "plain.safetensors"))[0]
    for rank, exported in enumerate(results):
        assert set(exported) == set(plain), rank
        assert all(torch.equal(exported[k], plain[k]) for k in plain), rank
    assert (tmp_path / "pp.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    world.run(export_at, path, {"pp": 2, "fsdp": 2}, CONFIG, str(tmp_path / "interleaved.safetensors"), "interleaved_1f1b")
    interleaved = load_file(tmp_path / "interleaved.safetensors")
    assert interleaved.keys() == plain.keys() and all(torch.equal(interleaved[k], plain[k]) for k in plain)
    assert not [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]
    model = GPT(CONFIG)
    model.load_state_dict(load_file(tmp_path / "pp.safetensors"), strict=True)
    assert torch.equal(model.tok_emb.weight, expected["params/tok_emb.weight"])
    assert torch.equal(model.head.weight, expected["params/head.weight"])


@pytest.mark.parametrize("config", [CONFIG, pytest.param(TIED, marks=pytest.mark.slow)], ids=["untied", "tied"])  # (suite time)
def test_a_pipelined_state_saves_as_dcp_as_a_plain_one(world, tmp_path, config):
    """`save_dcp` of a pipelined state (each pipeline coordinate's ranks write their stages'
    boxes; rank 0 the index of all): the same tensors, values and keys as the plain step's
    `save_dcp` of the same checkpoint (fs's reader and torch's own, `dcp_to_torch_save`), under
    1F1B and interleaved 1F1B (rank 0 holds stages 0 and 2)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = str(tmp_path / "ckpt")
    world.run(save_at, path, None, config)
    world.run(dcp_at, path, str(tmp_path / "plain"), {"fsdp": 4}, config)
    expected = fs.checkpoint.read_dcp(tmp_path / "plain")
    assert "model.head.weight" in expected and "optim.state.tok_emb.weight.exp_avg_sq" in expected
    for schedule in ("1f1b", "interleaved_1f1b"):
        world.run(dcp_at, path, str(tmp_path / schedule), None, config, schedule)
        got = fs.checkpoint.read_dcp(tmp_path / schedule)
        assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))[:6]
        for key, value in expected.items():
            if key.endswith(".params"):  # a parameter group's names: in stage order (the same set)
                got[key], value = sorted(got[key]), sorted(value)
            assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, (schedule, key)
        dcp_to_torch_save(tmp_path / schedule, tmp_path / f"{schedule}.pt")  # torch's reader
        loaded = torch.load(tmp_path / f"{schedule}.pt", weights_only=True)
        flat = {f"model.{k}": v for k, v in loaded["model"].items()}
        flat.update({f"optim.state.{n}.{m}": v for n, moments in loaded["optim"]["state"].items() for m, v in moments.items()})
        tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
        assert flat.keys() == tensors.keys() and all(torch.equal(flat[k], tensors[k]) for k in tensors), schedule


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("interleaved_1f1b", marks=pytest.mark.slow)])  # (suite time)
def test_a_dcp_checkpoint_loads_into_a_pipelined_state(world, saved, tmp_path, schedule):
    """`load_dcp` into a pipelined template (each rank reads its stages' leaves; a tensor is extra
    only if no rank's stages take it): what the ranks held when the fs checkpoint was saved, bit
    for bit. A 2-layer pipelined template is refused the 4-layer checkpoint's blocks on every rank."""
    path, expected, _, _ = saved
    world.run(dcp_at, path, str(tmp_path / "dcp"), {"fsdp": 4})
    assert_same(expected, union(world.run(from_dcp, str(tmp_path / "dcp"), CONFIG, schedule)), f"load_dcp, {schedule}")
    if schedule == "1f1b":  # (2 blocks make no 4 interleaved stages)
        errors = world.run(from_dcp, str(tmp_path / "dcp"), dataclasses.replace(CONFIG, n_layer=2), schedule)
        assert all(isinstance(e, str) and "'blocks.2.ln1.weight'" in e for e in errors), errors


@pytest.mark.parametrize("schedule", [pytest.param("1f1b", marks=pytest.mark.slow), "interleaved_1f1b"])  # (suite time)
def test_a_pipelined_state_starts_from_a_full_safetensors_file(world, tmp_path, schedule):
    """A model's state dict in one safetensors file (what `save_pretrained` or `fs.export`
    writes) initializes a pipelined step's meta parameters (`from_safetensors`) and loads into
    its template (`load_full`): each rank reads its stages' leaves, a tensor of the file counts
    as extra only if no stage takes it. The exports equal the file; a file with one tensor more
    is refused on every rank, naming it."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    expected = {k: v.contiguous() for k, v in GPT(CONFIG).state_dict().items()}
    save_file(expected, tmp_path / "model.safetensors")
    for how in ("init", "load"):
        for got in world.run(from_file, str(tmp_path / "model.safetensors"), how, schedule):
            assert not isinstance(got, str), got
            assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected), how
    save_file({**expected, "extra.weight": torch.zeros(3)}, tmp_path / "extra.safetensors")
    for how in ("init", "load"):
        errors = world.run(from_file, str(tmp_path / "extra.safetensors"), how, schedule)
        assert all(isinstance(e, str) and "'extra.weight'" in e for e in errors), (how, errors)


def test_a_pipelined_export_rank_0_cannot_write_fails_on_every_rank(world, saved, tmp_path):
    """Rank 0 cannot create the file (its directory is a file): it still receives every other
    pipeline coordinate's buffers (no rank hangs), and every rank raises; nothing is left."""
    path, _, _, _ = saved
    (tmp_path / "a_file").write_text("")
    errors = world.run(export_error, path, str(tmp_path / "a_file" / "model.safetensors"))
    assert errors[0] is not None and "a_file" in errors[0], errors
    assert all(e.startswith("ExportError: rank 0 could not write") for e in errors[1:]), errors
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_checkpoint_that_does_not_fit_a_pipelined_state_is_refused(world, saved, tmp_path):
    """A 2-layer GPT's checkpoint lacks the 4-layer state's last blocks (the second stage's
    ranks name the leaf, the others them); the 4-layer checkpoint holds blocks that no rank of a
    2-layer pipelined state holds (every rank names the first)."""
    path, _, _, _ = saved
    small = dataclasses.replace(CONFIG, n_layer=2)
    small_path = str(tmp_path / "small")
    world.run(save_at, small_path, {"fsdp": 4}, small, 0)
    errors = world.run(load_error, small_path)
    assert all("'params/blocks.2." in e and "is not in the checkpoint" in e for e in errors[2:]), errors
    assert all("ranks [2, 3] could not load" in e for e in errors[:2]), errors
    errors = world.run(load_error, path, None, small)
    assert all("'params/blocks.2." in e and "is in the checkpoint but not in this state" in e for e in errors), errors


@pytest.mark.slow
def test_traced_resume_at_the_same_layout_is_exact(world, tmp_path):
    results = world.run(save_and_resume, str(tmp_path), CONFIG, True)
    assert [r[2][0] for r in results] == [r[1][0] for r in results]
    assert_same(union([r[1][1] for r in results]), union([r[2][1] for r in results]), "traced, resumed at pp2xfsdp2")


@pytest.mark.slow
def test_tied_resume_and_world_size_1(world, tmp_path):
    results = world.run(save_and_resume, str(tmp_path), TIED)
    assert [r[2][0] for r in results] == [r[1][0] for r in results]
    assert_same(union([r[1][1] for r in results]), union([r[2][1] for r in results]), "tied, resumed at pp2xfsdp2")
    expected = union([r[0] for r in results])
    (got, _), = fs.testing.SimulatedWorld(1, axes={"fsdp": 1}).run(load_at, str(tmp_path / "ckpt"), None, None, TIED)
    assert_same(expected, got, "tied, loaded at world size 1")


def test_export_of_a_tied_pipelined_state_names_the_tied_head(world, tmp_path):
    path = str(tmp_path / "ckpt")
    world.run(save_at, path, {"fsdp": 4}, TIED, 0)
    plain = world.run(export_at, path, {"fsdp": 4}, TIED, str(tmp_path / "plain.safetensors"))[0]
    for exported in world.run(export_at, path, None, TIED, str(tmp_path / "pp.safetensors")):
        assert set(exported) == set(plain)
        assert all(torch.equal(exported[k], plain[k]) for k in plain)
    assert (tmp_path / "pp.safetensors").read_bytes() == (tmp_path / "plain.safetensors").read_bytes()
    assert "head.weight" in load_file(tmp_path / "pp.safetensors")
