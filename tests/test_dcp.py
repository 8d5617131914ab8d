"""`fs.checkpoint.load_dcp` / `save_dcp` / `read_dcp`: torch.distributed.checkpoint (DCP) checkpoints
of FSDP2 models and their AdamW state.

- FSDP2 (`fully_shard` per block + root, a tied-weight GPT) trains 2 AdamW steps at world size 2
  and saves with torch's recipe (`get_model_state_dict` / `get_optimizer_state_dict`) and as a
  plain `model.state_dict()` of DTensors; fs loads both at world sizes 1, 2 and 4: parameters,
  `exp_avg`, `exp_avg_sq` and the step count equal FSDP2's bit for bit, and 3 more steps end no
  further from single-process training than FSDP2's own 3 more steps (the training docs'
  fs-vs-FSDP2 convention: at most 1.5x FSDP2's distance);
- fs writes DCP (`save_dcp`, from world size 4, shards cutting rows) and FSDP2 at world size 2
  loads it with `dcp.load` + `set_model_state_dict` / `set_optimizer_state_dict`, values exact;
- trust: a `.metadata` whose pickle would run `os.system`, a data item that would, and an item
  placed outside the directory are refused unexecuted;
- errors: another model (naming the missing, extra and mismatched tensors with shapes), an
  optimizer state of another kind (SGD's in the file, or an SGD template), an index-keyed
  `optimizer.state_dict()`, the wrong top-level key, step counts that differ.

Real gloo processes (`fs.testing.LocalWorld`) wherever ranks meet; one process for the files.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.checkpoint import CheckpointError
from functional_shard.checkpoint._dcp_files import read_metadata
from functional_shard.checkpoint._dcp_save import PlannedTensor, metadata_bytes
from functional_shard.models import GPT, MLP, GPTConfig

VOCAB = 50
ROWS = 4  # global batch: divisible by every world size used (1, 2, 4)
SAVED_AT = 2  # FSDP2 steps before the save
MORE = 3  # steps after it, in FSDP2 and in fs
HYPER = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
EAGER = fs.Schedule(trace=False)  # the reference semantics, which every traced schedule keeps bit for bit


def gpt(seed: int = 0, **changes) -> GPT:
    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=32)
    return GPT(GPTConfig(**{**config, **changes}))


def batch(i: int):
    g = torch.Generator().manual_seed(700 + i)
    tokens = torch.randint(0, VOCAB, (ROWS, 12), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def rows(b, mesh):
    n = ROWS // mesh.world_size
    return tuple(t[mesh.rank * n : (mesh.rank + 1) * n] for t in b)


def ce(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def torch_step(model, optimizer, b) -> None:
    optimizer.zero_grad()
    ce(model(b[0]), b[1]).backward()
    optimizer.step()


def fsdp2(mesh, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    model = gpt(seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh.device_mesh)
    fully_shard(model, mesh=mesh.device_mesh)
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def fsdp2_values(model, optimizer) -> dict[str, torch.Tensor]:
    """FSDP2's full parameters, moments and step counts (a collective: every rank)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"params/{name}"] = p.full_tensor().detach().clone()
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = state[key].full_tensor().clone()
        out[f"step/{name}"] = state["step"].clone()
    return out


def fs_values(state) -> dict[str, torch.Tensor]:
    """The same from an fs state: parameters and AdamW's moments gathered, the count."""
    out = {f"params/{k}": v for k, v in fs.gather(state.params).items()}
    sharded = state.params
    for key in ("exp_avg", "exp_avg_sq"):
        moments = getattr(state.opt_state, key)
        shards = [moments[b.name] if b.trainable else s for b, s in zip(sharded.layout.buffers, sharded.shards)]
        out.update({f"{key}/{k}": v for k, v in fs.gather(sharded.replace(shards=shards)).items()})
    out["count"] = state.opt_state.count.clone()
    return out


def fs_step(mesh, seed: int = 1, optimizer=None):
    apply_fn, params = fs.functionalize(gpt(seed))
    optimizer = optimizer or fs.optim.adamw(**HYPER)
    step = fs.sharded_step(lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=optimizer, schedule=EAGER)
    return step, params


# --- FSDP2 -> fs ----------------------------------------------------------------------------------


def fsdp2_train_and_save(mesh, directory: str):
    """FSDP2 at world size 2: SAVED_AT steps, save both ways, MORE steps; and single-process
    training from the saved values (the reference both continuations are measured against)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, optimizer = fsdp2(mesh)
    for i in range(SAVED_AT):
        torch_step(model, optimizer, rows(batch(i), mesh))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(sd, checkpoint_id=os.path.join(directory, "recipe"))
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, "plain"))
    saved = fsdp2_values(model, optimizer)
    for i in range(SAVED_AT, SAVED_AT + MORE):
        torch_step(model, optimizer, rows(batch(i), mesh))
    end = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    reference = gpt()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(saved[f"params/{name}"])
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)
    for name, p in reference.named_parameters():
        ref_opt.state[p] = {k: saved[f"{k}/{name}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
    for i in range(SAVED_AT, SAVED_AT + MORE):
        torch_step(reference, ref_opt, batch(i))
    return saved, end, {n: p.detach().clone() for n, p in reference.named_parameters()}


def fs_load_and_continue(mesh, directory: str):
    step, params = fs_step(mesh)  # seed 1: other values than the checkpoint's
    state = fs.checkpoint.load_dcp(os.path.join(directory, "recipe"), step.init(params))
    loaded, number = fs_values(state), state.step
    for i in range(SAVED_AT, SAVED_AT + MORE):
        state, _ = step(state, rows(batch(i), mesh))
    plain = fs.checkpoint.load_dcp(os.path.join(directory, "plain"), step.init(params), model_key=None, optim_key=None)
    return loaded, number, dict(fs.export(state)), fs_values(plain), plain.step


@pytest.fixture(scope="module")
def fsdp2_checkpoint(local_world, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fsdp2")
    saved, end, reference = local_world(2).run(fsdp2_train_and_save, str(directory))[0]
    return str(directory), saved, end, reference


def distance(params: dict, reference: dict) -> float:
    """The largest per-tensor distance, relative to the tensor's largest magnitude."""
    return max(float((params[n] - r).abs().max()) / float(r.abs().max()) for n, r in reference.items())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fsdp2_checkpoint_loads_exactly_and_trains_on(local_world, fsdp2_checkpoint, world_size):
    directory, saved, fsdp2_end, reference = fsdp2_checkpoint
    loaded, number, fs_end, plain, plain_step = local_world(world_size).run(fs_load_and_continue, directory)[0]
    names = [k.removeprefix("params/") for k in saved if k.startswith("params/")]
    for name in names:
        for key in ("params", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[f"{key}/{name}"], saved[f"{key}/{name}"]), (key, name)
        assert torch.equal(loaded["count"], saved[f"step/{name}"])
        assert torch.equal(plain[f"params/{name}"], saved[f"params/{name}"]), name
    assert number == SAVED_AT
    if world_size == 2:  # FSDP2's world size: the same sums in the same order, so FSDP2's own bits
        assert all(torch.equal(fs_end[n], fsdp2_end[n]) for n in fsdp2_end)
    assert plain_step == 0 and float(plain["count"]) == 0
    assert all(not v.any() for k, v in plain.items() if k.startswith("exp_avg"))  # the template's fresh state
    fs_err, fsdp2_err = distance(fs_end, reference), distance(fsdp2_end, reference)
    assert fs_err <= 1.5 * fsdp2_err + 1e-6, (fs_err, fsdp2_err)


# --- fs -> FSDP2 ----------------------------------------------------------------------------------


def adamw_param_group() -> dict:
    """Every field of a torch.optim.AdamW parameter group with HYPER (what dcp.load asks for)."""
    group = torch.optim.AdamW([torch.zeros(1)], **HYPER).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def fs_export(mesh, source: str, directory: str):
    step, params = fs_step(mesh)
    state = fs.checkpoint.load_dcp(source, step.init(params))
    state, _ = step(state, rows(batch(SAVED_AT), mesh))  # values of fs's own
    fs.checkpoint.save_dcp(os.path.join(directory, "groups"), state, param_groups=[adamw_param_group()])
    fs.checkpoint.save_dcp(os.path.join(directory, "partial"), state)
    return fs_values(state), state.step


def fsdp2_load(mesh, directory: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    out = []
    for name, planner in (("groups", None), ("partial", DefaultLoadPlanner(allow_partial_load=True))):
        model, optimizer = fsdp2(mesh, seed=2)
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(sd, checkpoint_id=os.path.join(directory, name), planner=planner)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])
        out.append((fsdp2_values(model, optimizer), dict(optimizer.param_groups[0])))
    return out


def test_fs_writes_dcp_that_fsdp2_loads(local_world, fsdp2_checkpoint, tmp_path):
    directory, *_ = fsdp2_checkpoint
    values, number = local_world(4).run(fs_export, os.path.join(directory, "recipe"), str(tmp_path))[0]
    assert number == SAVED_AT + 1
    for loaded, group in local_world(2).run(fsdp2_load, str(tmp_path))[0]:
        names = [k.removeprefix("params/") for k in loaded if k.startswith("params/")]
        assert sorted(names) == sorted(k.removeprefix("params/") for k in values if k.startswith("params/"))
        for name in names:
            for key in ("params", "exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded[f"{key}/{name}"], values[f"{key}/{name}"]), (key, name)
            assert torch.equal(loaded[f"step/{name}"], values["count"]), name
        assert group["lr"] == HYPER["lr"] and group["weight_decay"] == HYPER["weight_decay"]
    # Written from 4 ranks, some of a leaf's ranges are not whole rows: stored as several boxes.
    tensors = read_metadata(tmp_path / "groups").tensors.values()
    cut = [t.key for t in tensors if len(t.shape) > 1 and any(c.sizes[-1] < t.shape[-1] for c in t.chunks)]
    assert "model.blocks.0.mlp.fc.weight" in cut and "model.tok_emb.weight" in cut, cut
    index = fs.checkpoint.read_dcp(tmp_path / "groups")
    assert index["optim.param_groups.0.lr"] == HYPER["lr"]
    assert torch.equal(index["model.head.weight"], values["params/tok_emb.weight"])  # the tied name, same bytes


class Buffered(MLP):
    """An MLP with a frozen input projection, a module buffer and a non-persistent one."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__(7, 16, 3, n_blocks=2)
        self.input_proj.requires_grad_(False)
        self.register_buffer("stat", torch.randn(5))
        self.register_buffer("scratch", torch.full((3,), float(seed)), persistent=False)


def buffered_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """A single-process DCP checkpoint of `Buffered` after one AdamW step; its values by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = Buffered(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
    x, y = torch.randn(8, 7, generator=torch.Generator().manual_seed(5)), torch.arange(8) % 3
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(sd, checkpoint_id=directory, no_dist=True)
    out = {f"params/{n}": t.detach().clone() for n, t in model.state_dict().items()}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out.update({f"{k}/{name}": optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")})
    return out


def load_buffered(mesh, source: str, target: str):
    apply_fn, params = fs.functionalize(Buffered(1))
    step = fs.sharded_step(lambda p, b: 0, mesh, optimizer=fs.optim.adamw(**HYPER), schedule=EAGER)
    state = fs.checkpoint.load_dcp(source, step.init(params))
    fs.checkpoint.save_dcp(target, state)
    return fs_values(state), {n: t.clone() for n, t in fs.export(state).items()}


def test_buffers_and_frozen_leaves_round_trip(local_world, tmp_path):
    """Frozen leaves (no optimizer state) and module buffers load from a torch DCP checkpoint, a
    non-persistent buffer keeps the template's value; fs writes back the same keys and values."""
    saved = buffered_checkpoint(str(tmp_path / "torch"))
    values, exported = local_world(2).run(load_buffered, str(tmp_path / "torch"), str(tmp_path / "fs"))[0]
    for key, value in saved.items():
        got = exported[key.removeprefix("params/")] if key.startswith("params/") else values[key]
        assert torch.equal(got, value), key
    assert torch.equal(values["params/scratch"], torch.full((3,), 1.0))  # the template's (seed 1)
    original, written = fs.checkpoint.read_dcp(tmp_path / "torch"), fs.checkpoint.read_dcp(tmp_path / "fs")
    tensors = sorted(k for k, v in original.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(written) and all(torch.equal(original[k], written[k]) for k in tensors)
    assert "model.stat" in written
    assert not any(k.startswith("optim.state.input_proj") for k in written)  # frozen: no optimizer state


# --- trust ----------------------------------------------------------------------------------------


class RunsACommand:
    """What an attacker's pickle does: its reduce calls os.system."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_pickle_that_runs_code_is_refused_unexecuted(fsdp2_checkpoint, tmp_path):
    directory, *_ = fsdp2_checkpoint
    copy = tmp_path / "evil"
    shutil.copytree(os.path.join(directory, "recipe"), copy)
    marker = tmp_path / "ran"
    (copy / ".metadata").write_bytes(pickle.dumps(RunsACommand(str(marker))))
    with pytest.raises(CheckpointError, match=r"\.metadata was refused, unexecuted: refused global posix\.system"):
        fs.checkpoint.read_dcp(copy)

    def body(mesh):
        step, params = fs_step(mesh)
        fs.checkpoint.load_dcp(copy, step.init(params))

    with pytest.raises(fs.RankError, match="refused global posix.system"):
        fs.testing.SimulatedWorld(1).run(body)
    assert not marker.exists()
    # The pickle does run when loaded as torch does (pickle.load): what was refused.
    pickle.loads((copy / ".metadata").read_bytes())
    assert marker.exists()


class _Bait:
    pass


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as Python 3.11.2 does: `getattr(<enum class>, <member name>)`."""

    def reducer_override(self, obj):
        import enum

        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        if isinstance(obj, _Bait):
            return getattr, (torch.Size, "mro")  # a getattr on anything else: refused
        return NotImplemented


def test_enum_members_pickled_by_getattr_load_and_other_getattrs_are_refused(fsdp2_checkpoint, tmp_path):
    """The memory-format enum in DCP's metadata pickles as a call (Python 3.11.7+) or as a getattr
    (3.11.2, CI's interpreter): both read the same; a getattr of anything else is refused."""
    import io

    from torch.distributed.checkpoint.filesystem import FileSystemReader

    directory, *_ = fsdp2_checkpoint
    metadata = FileSystemReader(os.path.join(directory, "recipe")).read_metadata()  # trusted: our own test file
    for name, obj, refused in (("getattr", metadata, False), ("bait", [metadata, _Bait()], True)):
        copy = tmp_path / name
        shutil.copytree(os.path.join(directory, "recipe"), copy)
        buffer = io.BytesIO()
        _EnumsByGetattr(buffer).dump(obj)
        assert b"getattr" in buffer.getvalue()
        (copy / ".metadata").write_bytes(buffer.getvalue())
        if refused:
            with pytest.raises(CheckpointError, match=r"refused getattr\(.*'mro'\)"):
                read_metadata(copy)
        else:
            assert read_metadata(copy)._replace(directory=None) == read_metadata(os.path.join(directory, "recipe"))._replace(directory=None)


def test_a_data_item_that_runs_code_or_lies_outside_is_refused(tmp_path):
    marker = tmp_path / "ran"
    for name, file in (("evil", "__0_0.distcp"), ("outside", "../__0_0.distcp")):
        directory = tmp_path / name
        directory.mkdir()
        with open(tmp_path / "__0_0.distcp" if name == "outside" else directory / "__0_0.distcp", "wb") as f:
            torch.save(RunsACommand(str(marker)), f)
            length = f.tell()
        tensor = PlannedTensor("x", ("x",), (2,), torch.float32, [((0,), (2,), file, 0, length)])
        (directory / ".metadata").write_bytes(metadata_bytes([tensor], []))
    refused = r"bytes of 'x' in .*evil/__0_0.distcp were refused by torch.load\(weights_only=True\)"
    with pytest.raises(CheckpointError, match=refused):
        fs.checkpoint.read_dcp(tmp_path / "evil")
    outside = r"places 'x' in '\.\./__0_0.distcp', which is not a file name in the checkpoint's directory"
    with pytest.raises(CheckpointError, match=outside):
        fs.checkpoint.read_dcp(tmp_path / "outside")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"not a torch.distributed.checkpoint checkpoint \(no \.metadata file"):
        fs.checkpoint.read_dcp(tmp_path)


# --- errors ---------------------------------------------------------------------------------------


def torch_checkpoints(directory):
    """Single-process DCP checkpoints of a plain GPT: AdamW with differing step counts, SGD with
    momentum, and AdamW keyed by index (`optimizer.state_dict()`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    for name, make in (
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("steps", lambda ps: torch.optim.AdamW(ps, **HYPER)),
        ("indexed", lambda ps: torch.optim.AdamW(ps, **HYPER)),
    ):
        model = gpt()
        optimizer = make(model.parameters())
        torch_step(model, optimizer, batch(0))
        if name == "steps":
            optimizer.state[model.ln_f.bias]["step"] += 1
        optim = optimizer.state_dict() if name == "indexed" else get_optimizer_state_dict(model, optimizer)
        sd = {"model": model.state_dict(), "optim": optim}
        dcp.save(sd, checkpoint_id=os.path.join(directory, name), no_dist=True)


def errors(mesh, directory: str, recipe: str, plain: str):
    def attempt(path, template, **kwargs):
        try:
            fs.checkpoint.load_dcp(path, template, **kwargs)
        except CheckpointError as error:
            return str(error)
        return "loaded"

    step, params = fs_step(mesh)
    template, fresh = step.init(params), step.init(params)
    other_step, other_params = fs_step(mesh)
    _, bigger = fs.functionalize(gpt(n_layer=3, d_model=48))
    sgd_step = fs.sharded_step(lambda p, b: 0, mesh, optimizer=fs.optim.sgd(0.1, momentum=0.9), schedule=EAGER)
    return {
        "model": attempt(recipe, other_step.init(bigger)),
        "sgd_file": attempt(os.path.join(directory, "sgd"), template),
        "sgd_template": attempt(recipe, sgd_step.init(params)),
        "sgd_model_only": attempt(recipe, sgd_step.init(params), optim_key=None),
        "steps": attempt(os.path.join(directory, "steps"), template),
        "indexed": attempt(os.path.join(directory, "indexed"), template),
        "plain_as_recipe": attempt(plain, template),
        "unchanged": all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(template), fs.tree_leaves(fresh))),
    }


def test_mismatches_are_named(fsdp2_checkpoint, tmp_path):
    directory, *_ = fsdp2_checkpoint
    torch_checkpoints(str(tmp_path))
    out = fs.testing.SimulatedWorld(1).run(
        errors, str(tmp_path), os.path.join(directory, "recipe"), os.path.join(directory, "plain")
    )[0]
    model = out["model"]
    assert "does not fit this state's model" in model
    assert "missing from the checkpoint: 'blocks.2.ln1.weight' (float32[48])" in model
    assert "different: 'tok_emb.weight' is float32[50, 32] in the checkpoint, float32[50, 48] in this state" in model
    assert "(12 in all)" in model and "(28 in all)" in model  # the third block's 12 leaves, the 28 others' shapes
    sgd = "holds optimizer state of another kind: 'momentum_buffer' for 'tok_emb.weight' (torch.optim.SGD's state"
    assert sgd in out["sgd_file"]
    sgd = "optimizer state (a SGDState) is of another kind than a DCP checkpoint's torch.optim.AdamW state: it holds no"
    assert sgd in out["sgd_template"]
    assert out["sgd_model_only"] == "loaded"
    assert "counts differ ('optim.state.tok_emb.weight.step' = 1, 'optim.state.ln_f.bias.step' = 2)" in out["steps"]
    assert "keyed by parameter index (['0', '1', '2']...: optimizer.state_dict())" in out["indexed"]
    plain = "no model tensors under 'model' (it holds 29 tensors at the top level ('tok_emb.weight',"
    assert plain in out["plain_as_recipe"]
    assert "pass model_key=None" in out["plain_as_recipe"]
    assert out["unchanged"]
