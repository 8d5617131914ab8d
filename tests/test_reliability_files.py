"""Files under attack: exports and checkpoints lose nothing, mix nothing, follow no link (issue 25).

- concurrent `fs.export` to one path (two processes, many rounds): the file is always exactly one
  model, whole; the export that finished second raises `ExportError` saying so;
- a symbolic link planted at the old fixed temporary name, or at a predicted one, is never
  followed (exports and checkpoints);
- `fs.checkpoint.save(overwrite=True)` replaces a committed checkpoint and nothing else: a run
  directory, a file, a link, a checkpoint with a stranger file are refused, nothing deleted;
- a byte flipped in a rank file, or a rank file copied from an older save of the same run (same
  size), is refused on load, naming the file;
- a failed commit (a rename refused with EBUSY, a concurrent save that committed first) leaves no
  `.partial-*` directory, and the previous checkpoint in place;
- a checkpoint without loss-scale state loaded with `fs.LossScale` names what is missing and the
  way out; a 100,000-deep `index.json` is a `CheckpointError`, not a `RecursionError`.

Multi-rank behaviour runs on gloo processes (`local_world`); single-rank file checks on threads.
"""

from __future__ import annotations

import errno
import json
import os
import random
import secrets
import shutil
import threading
import time

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard import _export_file
from functional_shard.checkpoint import CheckpointError
from functional_shard.checkpoint import _files as checkpoint_files
from functional_shard.models import MLP

_BUILDING = threading.Lock()  # thread-ranks share torch's global RNG: one builds at a time


def make_step(mesh, *, seed: int = 0, hidden: int = 16, blocks: int = 2, precision=None):
    with _BUILDING:
        torch.manual_seed(seed)
        apply_fn, params = fs.functionalize(MLP(13, hidden, 5, n_blocks=blocks))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    optimizer = fs.optim.sgd(0.1, momentum=0.9)
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=fs.Schedule(trace=False), precision=precision)
    return step, params


def batch(mesh, i: int):
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(8, 13, generator=g), torch.randint(0, 5, (8,), generator=g)
    n = 8 // mesh.world_size
    return x[mesh.rank * n : (mesh.rank + 1) * n], y[mesh.rank * n : (mesh.rank + 1) * n]


def trained(mesh, steps: int, **kwargs):
    step, params = make_step(mesh, **kwargs)
    state = step.init(params)
    for i in range(steps):
        state, _ = step(state, batch(mesh, i))
    return step, params, state


def tree_of(path) -> dict[str, bytes | None]:
    """Every entry under `path` (names relative to it) with a file's bytes, a link's target."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            key = os.path.relpath(full, path)
            if os.path.islink(full):
                out[key] = ("link", os.readlink(full))
            elif os.path.isfile(full):
                out[key] = open(full, "rb").read()
            else:
                out[key] = None
    return out


def leftovers(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".partial" in n or ".old-" in n)


# --- 1. concurrent exports to one path ---------------------------------------------------------

EXPORT_ROUNDS = 12
EXPORT_WIDTH = 384  # MLP 13 -> 384 -> 5 with 8 blocks: 4.9 MB of float32 per file


def export_model(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return MLP(13, EXPORT_WIDTH, 5, n_blocks=8).state_dict()


def export_rounds(mesh, seed: int, path: str, rounds: int):
    def one_rank(mesh1):
        with _BUILDING:
            torch.manual_seed(seed)
            apply_fn, params = fs.functionalize(MLP(13, EXPORT_WIDTH, 5, n_blocks=8))
        step = fs.sharded_step(lambda p, b: apply_fn(p, b).sum(), mesh1, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
        return step.init(params)

    world = fs.testing.SimulatedWorld(1)  # a world of one in this process: two independent launches
    [state] = world.run(one_rank)
    models = [export_model(0), export_model(1)]

    def what_is(file: str) -> str:
        got = safetensors.torch.load_file(file)
        for k, model in enumerate(models):
            if set(got) == set(model) and all(torch.equal(got[n], model[n]) for n in model):
                return f"model {k}"
        return "a mix"

    mesh.all_gather_world(torch.zeros(1))  # both processes start together
    outcomes, seen = [], []
    jitter = random.Random(1000 + seed)  # (each process its own: neither stays ahead of the other every round)
    for _ in range(rounds):
        time.sleep(jitter.uniform(0.0, 0.1))
        try:
            world.run(lambda mesh1: fs.export(state, path))
            outcomes.append("wrote")
        except fs.RankError as error:
            cause = error.__cause__ or error
            outcomes.append(f"{type(cause).__name__}: {cause}")
        seen.append(what_is(path) if os.path.exists(path) else "nothing")
    mesh.all_gather_world(torch.zeros(1))
    return outcomes, seen, what_is(path)


def test_concurrent_exports_never_mix(local_world, tmp_path):
    path = str(tmp_path / "model.safetensors")
    results = local_world(2).run(export_rounds_by_rank, path, EXPORT_ROUNDS)
    for rank, (outcomes, seen, final) in enumerate(results):
        assert "a mix" not in seen, f"process {rank} read a file mixing both models: {seen}"
        assert final in ("model 0", "model 1"), final
        for outcome in outcomes:
            assert outcome == "wrote" or ("ExportError" in outcome and "changed while this export was writing" in outcome), outcome
        assert "wrote" in outcomes, f"process {rank} never won: {outcomes}"
    assert leftovers(tmp_path) == [], "an export left its temporary file"


def export_rounds_by_rank(mesh, path: str, rounds: int):
    return export_rounds(mesh, mesh.rank, path, rounds)


# --- 2. links planted at temporary names -------------------------------------------------------


def export_once(mesh, path: str):
    step, params = make_step(mesh)
    fs.export(step.init(params), path)


def save_once(mesh, path: str, steps: int = 0, overwrite: bool = False):
    step, params, state = trained(mesh, steps)
    fs.checkpoint.save(path, state, overwrite=overwrite)


def test_export_never_follows_a_planted_link(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "model.safetensors"
    os.symlink(victim, str(path) + ".partial")  # the name every export used to write to
    fs.testing.SimulatedWorld(1).run(export_once, str(path))
    assert victim.read_bytes() == b"precious"
    assert set(safetensors.torch.load_file(path)) and os.path.islink(str(path) + ".partial")

    predicted = tmp_path / "model.safetensors.partial-0123456789abcdef"  # as if the name leaked
    os.symlink(victim, predicted)
    monkeypatch.setattr(_export_file, "temporary_name", lambda p: predicted)
    before = tree_of(tmp_path)
    with pytest.raises(fs.RankError, match="planted there"):
        fs.testing.SimulatedWorld(1).run(export_once, str(path))
    assert victim.read_bytes() == b"precious" and tree_of(tmp_path) == before


@pytest.mark.parametrize("planted", ["link", "directory"])
def test_checkpoint_never_writes_through_a_planted_link(tmp_path, monkeypatch, planted):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_bytes(b"precious")
    monkeypatch.setattr(secrets, "randbits", lambda bits: 0x122)  # the save's token, predicted: 0x123
    if planted == "link":
        os.symlink(victim, tmp_path / "ckpt.partial-0000000000000123")
    else:
        shutil.copytree(victim, tmp_path / "ckpt.partial-0000000000000123")
    before = tree_of(tmp_path)
    with pytest.raises(fs.RankError, match="planted there"):
        fs.testing.SimulatedWorld(1).run(save_once, str(tmp_path / "ckpt"))
    assert tree_of(tmp_path) == before


# --- 3. overwrite replaces a checkpoint, nothing else ------------------------------------------


def save_over(mesh, path: str, steps: int):
    try:
        save_once(mesh, path, steps, overwrite=True)
    except CheckpointError as error:
        return str(error)
    return None


def load_step(mesh, path: str):
    step, params = make_step(mesh)
    return fs.checkpoint.load(path, step.init(params)).step


def plant(kind: str, path, tmp_path, local_world) -> None:
    if kind == "run directory":  # a run's log and another framework's checkpoint
        os.makedirs(path / "dcp")
        (path / "train.log").write_text("step 1000 loss 2.1\n")
        (path / "dcp" / ".metadata").write_bytes(b"\x80\x04other framework")
        (path / "dcp" / "__0_0.distcp").write_bytes(b"\x00" * 64)
    elif kind == "file":
        path.write_bytes(b"not a directory")
    elif kind == "link to a checkpoint":
        local_world(2).run(save_once, str(tmp_path / "elsewhere"), 1)
        os.symlink(tmp_path / "elsewhere", path)
    elif kind == "checkpoint with a stranger file":
        local_world(2).run(save_once, str(path), 1)
        (path / "notes.txt").write_text("mine")
    elif kind == "empty directory":
        path.mkdir()


@pytest.mark.parametrize("kind", ["run directory", "file", "link to a checkpoint", "checkpoint with a stranger file", "empty directory"])
def test_overwrite_refuses_what_is_not_a_checkpoint(local_world, tmp_path, kind):
    path = tmp_path / "run"
    plant(kind, path, tmp_path, local_world)
    before = tree_of(tmp_path)
    messages = local_world(2).run(save_over, str(path), 2)
    assert messages[0] is not None and "is not a functional_shard checkpoint" in messages[0], messages
    assert str(path) in messages[0] and "nothing was deleted" in messages[0]
    assert messages[1] is not None, "rank 1 went on as if the save had worked"
    assert tree_of(tmp_path) == before, "the refused overwrite changed something"


def test_overwrite_replaces_a_checkpoint(local_world, tmp_path):
    path = str(tmp_path / "ckpt")
    local_world(2).run(save_once, path, 1)
    assert local_world(2).run(save_over, path, 2) == [None, None]
    assert local_world(2).run(load_step, path) == [2, 2]
    assert leftovers(tmp_path) == []


# --- 4. integrity: a flipped byte, a rank file from another save ------------------------------


def try_load(mesh, path: str, verify: bool = True):
    try:
        step, params = make_step(mesh)
        fs.checkpoint.load(path, step.init(params), verify=verify)
    except CheckpointError as error:
        return str(error)
    return None


def data_offset(file) -> int:
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.fixture(scope="module")
def two_saves(local_world, tmp_path_factory):
    """Two checkpoints of one run, after 1 and 2 steps, at 2 ranks."""
    directory = tmp_path_factory.mktemp("two_saves")
    for steps in (1, 2):
        local_world(2).run(save_once, str(directory / f"step-{steps}"), steps)
    return directory


@pytest.mark.parametrize("file", ["rank-00000.safetensors", "rank-00001.safetensors"])
@pytest.mark.parametrize("damage", ["flipped byte", "file of an older save"])
def test_damaged_rank_file_is_refused_naming_it(local_world, two_saves, tmp_path, damage, file):
    path = tmp_path / "damaged"
    shutil.copytree(two_saves / "step-2", path)
    target = path / file
    if damage == "flipped byte":
        data = bytearray(target.read_bytes())
        at = (data_offset(target) + len(data)) // 2  # the middle of the tensor data
        data[at] ^= 0x01
        target.write_bytes(bytes(data))
    else:
        older = two_saves / "step-1" / file
        assert older.stat().st_size == target.stat().st_size, "the older file must have the same size"
        shutil.copyfile(older, target)
    assert local_world(2).run(try_load, str(two_saves / "step-2")) == [None, None]
    messages = local_world(2).run(try_load, str(path))
    assert all(m is not None for m in messages), f"loaded a damaged checkpoint: {messages}"
    named = [m for m in messages if str(target) in m]
    assert named, messages
    expected = "corrupted" if damage == "flipped byte" else "written by another save"
    assert all(expected in m for m in named), named
    with pytest.raises(CheckpointError, match=file):
        fs.checkpoint.read(path)
    # The opt-out skips the per-byte check only: a file of another save is refused still.
    unverified = local_world(2).run(try_load, str(path), False)
    if damage == "flipped byte":
        assert unverified == [None, None], unverified
    else:
        assert any(m is not None and str(target) in m and "written by another save" in m for m in unverified), unverified



@pytest.mark.parametrize("edit", ["step", "reformatted"])
def test_an_edited_index_is_refused(local_world, two_saves, tmp_path, edit):
    """The index is bound to its save too: the marker holds its CRC-32. An edited step count, or
    a fused weight's chunk order that still tiles it, loaded silently before; now any changed
    byte is refused, the same values written another way included."""
    path = tmp_path / "edited"
    shutil.copytree(two_saves / "step-2", path)
    index = path / "index.json"
    text = index.read_text()
    if edit == "step":
        edited = text.replace('"step": 2', '"step": 9', 1)
    else:
        edited = json.dumps(json.loads(text))
    assert edited != text
    index.write_text(edited)
    with pytest.raises(CheckpointError, match="does not match the index committed with it"):
        fs.checkpoint.read(path)
    messages = local_world(2).run(try_load, str(path))
    assert all(m is not None and "index.json" in m and "changed or damaged" in m for m in messages), messages

# --- 5. a failed commit leaves no partial directory --------------------------------------------


def save_failing_commit(mesh, path: str, winner: str, how: str):
    """Save 2 steps to `path`; on rank 0 the commit fails: the rename of the partial directory
    raises EBUSY (overwriting a checkpoint), or a concurrent save (`winner`) commits first."""
    real_rename, real_commit = os.rename, checkpoint_files.commit

    def busy_rename(src, dst, *args, **kwargs):
        if ".partial-" in os.fspath(src):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), os.fspath(dst))
        return real_rename(src, dst, *args, **kwargs)

    def commit_after_another(tmp, path_, *args, **kwargs):
        shutil.copytree(winner, path_)
        return real_commit(tmp, path_, *args, **kwargs)

    if mesh.rank == 0:
        if how == "ebusy":
            os.rename = busy_rename
        else:
            checkpoint_files.commit = commit_after_another
    try:
        save_once(mesh, path, 2, overwrite=how == "ebusy")
    except (CheckpointError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        os.rename, checkpoint_files.commit = real_rename, real_commit
    return None


@pytest.mark.parametrize("how", ["ebusy", "concurrent winner"])
def test_failed_commit_leaves_no_partial_directory(local_world, tmp_path, how):
    path, winner = tmp_path / "ckpt", tmp_path / "winner"
    local_world(2).run(save_once, str(winner), 3)
    if how == "ebusy":
        local_world(2).run(save_once, str(path), 1)  # the checkpoint the overwrite would replace
    messages = local_world(2).run(save_failing_commit, str(path), str(winner), how)
    assert all(m is not None for m in messages), messages
    assert ("Device or resource busy" if how == "ebusy" else "already exists") in messages[0], messages[0]
    assert leftovers(tmp_path) == [], f"a failed save left {leftovers(tmp_path)}"
    assert local_world(2).run(load_step, str(path)) == ([1, 1] if how == "ebusy" else [3, 3])


# --- 15. a missing loss scale, a deep index ----------------------------------------------------


def fp16():
    return fs.Precision(param_dtype=torch.float16, loss_scale=fs.LossScale(), cast_inputs=True)


def load_into_loss_scaled(mesh, path: str):
    step, params = make_step(mesh, precision=fp16())
    template = step.init(params)
    try:
        fs.checkpoint.load(path, template)
        message = None
    except CheckpointError as error:
        message = str(error)
    # The way out the message gives: load without loss scaling, start the scale afresh.
    state = fs.checkpoint.load(path, template.replace(loss_scale=None)).replace(loss_scale=template.loss_scale)
    state, metrics = step(state, batch(mesh, 5))
    return message, state.step, bool(torch.isfinite(metrics["loss"]))


def test_missing_loss_scale_state_is_named(local_world, tmp_path):
    path = str(tmp_path / "fp32")
    local_world(2).run(save_once, path, 2)
    for message, step, finite in local_world(2).run(load_into_loss_scaled, path):
        assert message is not None and "'state/loss_scale/scale'" in message and "fs.LossScale" in message, message
        assert "template.replace(loss_scale=None)" in message
        assert step == 3 and finite


@pytest.mark.parametrize("file", ["index.json", "COMMIT"])
def test_deeply_nested_json_is_a_checkpoint_error(tmp_path, file):
    path = tmp_path / "ckpt"
    fs.testing.SimulatedWorld(1).run(save_once, str(path))
    (path / file).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=file):
        fs.checkpoint.read(path)
    [message] = fs.testing.SimulatedWorld(1).run(try_load, str(path))
    assert message is not None and file in message
    (path / file).write_text(json.dumps({"format": "functional_shard.checkpoint", "x": [[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]}))
    with pytest.raises(CheckpointError, match="nested"):
        fs.checkpoint.read(path)
