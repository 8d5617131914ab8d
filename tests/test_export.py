"""Full export and import at scale: `fs.export(state, path)` and `fs.checkpoint.load_full` /
`fs.checkpoint.from_safetensors`.

- streamed export: the file loads into the plain module with `load_state_dict(strict=True)` and
  gives its outputs; it equals the in-memory export; peak memory per rank, counted by a dispatch
  mode, stays within its shards plus one flat buffer gathered whole (bound asked: two units), at
  world sizes 2 and 4 on `fs.models.GPT`; only rank 0 writes;
- Hugging Face: `LlamaForCausalLM.from_pretrained(dir)` loads an exported Llama (tied and
  untied embeddings, tied stored twice or once) with no missing or unexpected key and the same
  logits;
- import: a state made from a full safetensors file equals `step.init(params)` of the same values
  at world sizes 2 and 3 (from a meta-device tree, and into a template), each rank reading only
  its ranges; a file missing a leaf, or with a wrong shape or dtype, or an extra tensor, raises
  naming it, the caller's state untouched.
"""

from __future__ import annotations

import os
import threading

import pytest
import safetensors
import safetensors.torch
import torch

import functional_shard as fs
from functional_shard.checkpoint import CheckpointError
from functional_shard.models import GPT, GPTConfig
from _memory import AliveBytes

CONFIG = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, d_model=64)
_BUILDING = threading.Lock()  # thread-ranks share torch's global RNG: one builds at a time


def make_step(mesh, config: GPTConfig = CONFIG, seed: int = 0, units=None):
    with _BUILDING:
        torch.manual_seed(seed)
        model = GPT(config)
        apply_fn, params = fs.functionalize(model)

    def loss_fn(p, idx):
        return torch.nn.functional.cross_entropy(apply_fn(p, idx).flatten(0, 1), idx.roll(-1, 1).flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), schedule=fs.Schedule(trace=False), units=units)
    return step, params


def batch(mesh, i: int = 0):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, CONFIG.vocab_size, (8, 16), generator=g)[mesh.rank :: mesh.world_size]


# --- what the ranks run ------------------------------------------------------------------------


def trained_then_exported(mesh, path: str):
    """One step (so the values are no longer the init's), then the streamed export under a byte
    counter; returns what it measured and the in-memory export."""
    step, params = make_step(mesh)
    state, _ = step(step.init(params), batch(mesh))
    layout = state.params.layout
    with AliveBytes(existing=fs.tree_leaves(state)) as counter:
        fs.export(state, path)
    units: dict[str, int] = {}
    for spec in layout.buffers:
        units[spec.unit] = units.get(spec.unit, 0) + spec.nbytes
    return {
        "peak": counter.peak,
        "shards": sum(s.nbytes for s in state.params.shards),
        "largest_buffer": max(spec.nbytes for spec in layout.buffers),
        "largest_unit": max(units.values()),
        "full": sum(spec.numel * spec.dtype.itemsize for spec in layout.buffers),
        "exported": fs.export(state),
    }


def export_only(mesh, path: str, aliases: bool = True):
    step, params = make_step(mesh)
    fs.export(step.init(params), path, aliases=aliases)


# --- streamed export ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_streamed_export_loads_strict_and_stays_within_memory(local_world, tmp_path, world):
    path = str(tmp_path / "gpt.safetensors")
    reports = local_world(world).run(trained_then_exported, path)
    assert os.listdir(tmp_path) == ["gpt.safetensors"], "a leftover or a second file: only rank 0 writes"
    on_disk = safetensors.torch.load_file(path)
    exported = reports[0]["exported"]
    assert set(on_disk) == set(exported) and "head.weight" in on_disk
    assert all(torch.equal(on_disk[k], exported[k]) for k in exported), "the file differs from the gathered state"

    model = GPT(CONFIG)
    model.load_state_dict(on_disk, strict=True)
    apply_fn, _ = fs.functionalize(model)
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), apply_fn(fs.ModuleParams(exported), idx))

    for rank, report in enumerate(reports):
        # Beyond the shards: asked, two units' full buffers. The export gathers one buffer at a
        # time; gloo's worker thread may release the previous one's output a little late, so two
        # can be seen alive at once (about one run in three), never three.
        assert report["peak"] <= 2 * report["largest_unit"], (rank, report["peak"], report["largest_unit"])
        assert report["peak"] <= 2 * report["largest_buffer"], (rank, report["peak"], report["largest_buffer"])
        assert report["peak"] < report["full"] / 2, "the export held a large part of the model at once"


def test_export_names_and_tied_copies(tmp_path):
    fs.testing.SimulatedWorld(2).run(export_only, str(tmp_path / "copies.safetensors"))
    fs.testing.SimulatedWorld(2).run(export_only, str(tmp_path / "once.safetensors"), aliases=False)
    with safetensors.safe_open(str(tmp_path / "copies.safetensors"), "pt") as f:
        copies = set(f.keys())
        assert f.metadata()["format"] == "pt"
    with safetensors.safe_open(str(tmp_path / "once.safetensors"), "pt") as f:
        once = set(f.keys())
    assert copies == set(GPT(CONFIG).state_dict()) and copies - once == {"head.weight"}


def export_bad_dtype(mesh, path: str):
    tree = {"ok": torch.ones(3), "bad": torch.ones(2, dtype=torch.complex64)}
    return fs.export(fs.shard(tree, mesh), path)


def test_export_of_a_dtype_safetensors_cannot_store_names_the_leaf(tmp_path):
    with pytest.raises(fs.RankError, match=r"leaf 'bad'.*complex64"):
        fs.testing.SimulatedWorld(2).run(export_bad_dtype, str(tmp_path / "x.safetensors"))
    assert not os.listdir(tmp_path)


# --- Hugging Face ------------------------------------------------------------------------------


def llama_export(mesh, params, apply_fn, path: str, aliases: bool):
    step = fs.sharded_step(lambda p, ids: apply_fn(p, ids).logits.sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
    state = step.init(params)
    fs.export(state, path, aliases=aliases)
    return fs.export(state)


@pytest.mark.parametrize("tie, aliases", [(False, True), (True, True), (True, False)], ids=["untied", "tied-copies", "tied-once"])
def test_from_pretrained_loads_an_exported_llama(tmp_path, tie, aliases):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    apply_fn, params = fs.functionalize(model)
    exported = fs.testing.SimulatedWorld(2).run(llama_export, params, apply_fn, str(tmp_path / "model.safetensors"), aliases)[0]
    config.save_pretrained(tmp_path)
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = transformers.LlamaForCausalLM(config).eval()
    plain.load_state_dict(exported, strict=True)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, plain(ids).logits)
        assert torch.equal(plain(ids).logits, model(ids).logits)


# --- import from a full safetensors file -------------------------------------------------------


def imported_equals_init(mesh, path: str):
    """step.init(params) vs the same values read from `path`, from a meta tree and into a template."""
    step, params = make_step(mesh, seed=1)
    expected = step.init(params)
    with torch.device("meta"):
        meta_model = GPT(CONFIG)
    _, meta_params = fs.functionalize(meta_model)
    initializer = fs.checkpoint.from_safetensors(path)
    from_meta = step.init(meta_params, initialize=initializer)
    other_step, other_params = make_step(mesh, seed=2)
    template = step.init(other_params)
    before = [t.clone() for t in fs.tree_leaves(template)]
    into_template = fs.checkpoint.load_full(path, template)

    def same(a, b):
        return [torch.equal(x, y) for x, y in zip(fs.tree_leaves(a), fs.tree_leaves(b))]

    return {
        "from_meta": same(from_meta, expected),
        "into_template": same(into_template, expected),
        "template_untouched": all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(template))),
        "read": initializer.elements_read,
        "kept": sum(s.numel() for s in expected.params.shards),
        "leaf_elements_kept": sum(_leaf_elements(spec, mesh.shard_index) for spec in expected.params.layout.buffers),
    }


def _leaf_elements(spec, shard_index: int) -> int:
    """Elements of shard `shard_index` of `spec` that belong to leaves (not padding)."""
    start = shard_index * spec.shard_numel
    return max(0, min(start + spec.shard_numel, spec.numel) - start)


@pytest.fixture(scope="module")
def gpt_file(tmp_path_factory):
    """GPT(seed 1) saved with safetensors' own `save_model` (tied weight stored once)."""
    torch.manual_seed(1)
    path = str(tmp_path_factory.mktemp("full") / "gpt.safetensors")
    safetensors.torch.save_model(GPT(CONFIG), path)
    return path


@pytest.mark.parametrize("world", [2, 3])
def test_import_equals_init_of_the_same_values(local_world, gpt_file, world):
    # 2: processes; 3: thread-ranks (no third process world to start: this file stays fast)
    runner = local_world(world) if world == 2 else fs.testing.SimulatedWorld(world)
    reports = runner.run(imported_equals_init, gpt_file)
    total = sum(p.numel() for p in GPT(CONFIG).parameters())
    for rank, report in enumerate(reports):
        assert all(report["from_meta"]), f"rank {rank}: a state made from the file differs from step.init(params)"
        assert all(report["into_template"]), f"rank {rank}: load_full differs from step.init(params)"
        assert report["template_untouched"]
        # Exactly the elements this rank keeps (no module buffers in GPT): nothing more is read.
        assert report["read"] == report["leaf_elements_kept"] <= report["kept"], (rank, report["read"], report["kept"])
    assert sum(r["read"] for r in reports) == total


def load_broken(mesh, path: str):
    step, params = make_step(mesh)
    template = step.init(params)
    before = [t.clone() for t in fs.tree_leaves(template)]
    try:
        fs.checkpoint.load_full(path, template)
        message = None
    except CheckpointError as error:
        message = str(error)
    return message, all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(template)))


@pytest.mark.parametrize(
    "change, expected",
    [
        ("missing", r"lacks 'blocks\.1\.attn\.qkv\.weight'.*\[192, 64\]"),
        ("shape", r"'blocks\.1\.attn\.qkv\.weight' as float32\[192, 32\].*float32\[192, 64\]"),
        ("dtype", r"'blocks\.1\.attn\.qkv\.weight' as float16\[192, 64\].*float32\[192, 64\]"),
        ("extra", r"holds 'extra\.weight', which no leaf"),
        ("tied-missing", r"lacks 'tok_emb\.weight' \(nor under its aliases \['head\.weight'\]\)"),
        ("tied-differ", r"holds 'tok_emb\.weight' and 'head\.weight' with different values, but this state ties them"),
    ],
)
def test_a_file_that_does_not_fit_names_the_first_difference(tmp_path, change, expected):
    torch.manual_seed(0)
    tensors = {k: v.clone() for k, v in GPT(CONFIG).state_dict().items()}
    name = "blocks.1.attn.qkv.weight"
    if change == "missing":
        del tensors[name]
    elif change == "shape":
        tensors[name] = tensors[name][:, :32].clone()
    elif change == "dtype":
        tensors[name] = tensors[name].half()
    elif change == "extra":
        tensors["extra.weight"] = torch.zeros(2)
    elif change == "tied-differ":  # an untied model's file: torch's load_state_dict keeps the last, fs kept the first
        tensors["head.weight"] = tensors["head.weight"] + 1
    else:
        del tensors["tok_emb.weight"], tensors["head.weight"]
    path = str(tmp_path / "broken.safetensors")
    safetensors.torch.save_file(tensors, path)
    for message, untouched in fs.testing.SimulatedWorld(2).run(load_broken, path):
        assert message is not None and untouched
        assert __import__("re").search(expected, message), message
