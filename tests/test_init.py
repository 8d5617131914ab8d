"""Deferred, sharding-independent initialization: `step.init(meta_params, initialize=...)`.

- the same weights at 1, 2, 3, 4 ranks and two unit policies (`torch.equal` after `fs.export`),
  equal to the one-process `fs.initialize.reference`, which equals seeding each submodule's own
  `reset_parameters` by hand;
- peak memory per rank while initializing a GPT ~8x a rank's share: its shards plus one
  submodule's tensors (counted by a dispatch mode; the resident set's high-water mark reported);
- module buffers: BatchNorm statistics (SmallCNN) and a Llama's rotary `inv_freq` (a
  non-persistent buffer HF computes in `__init__`, recomputed by its `_init_weights`);
- errors: a leaf no init covers raises naming it; an init function of the path.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import functional_shard as fs
from functional_shard.initialize import InitError, seed_for
from functional_shard.models import GPT, GPTConfig, SmallCNN
from _memory import AliveBytes, peak_rss, reset_peak_rss

SMALL = GPTConfig(vocab_size=61, block_size=16, n_layer=3, n_head=2, d_model=16)


def per_leaf(path: str) -> str:
    return path  # a unit policy unlike the default: one unit per leaf


def meta_gpt(config: GPTConfig):
    with torch.device("meta"):
        model = GPT(config)
    apply_fn, params = fs.functionalize(model)
    return model, apply_fn, params


def initialized(mesh, config: GPTConfig = SMALL, seed: int = 0, per_leaf_units: bool = False):
    model, apply_fn, params = meta_gpt(config)
    step = fs.sharded_step(
        lambda p, idx: apply_fn(p, idx).sum(), mesh, optimizer=fs.optim.adamw(1e-3),
        schedule=fs.Schedule(trace=False), units=per_leaf if per_leaf_units else None,
    )
    state = step.init(params, initialize=fs.initialize.from_module(model, seed=seed))
    assert all(not t.is_meta for t in fs.tree_leaves(state))
    return fs.export(state)


def test_same_weights_at_every_world_size_and_unit_policy(local_world):
    model, _, _ = meta_gpt(SMALL)
    expected = fs.initialize.reference(model, seed=0).state_dict()
    assert all(not t.is_meta for t in expected.values())
    runs = {
        (1, False): fs.testing.SimulatedWorld(1).run(initialized),
        (3, True): fs.testing.SimulatedWorld(3).run(initialized, per_leaf_units=True),
        (2, False): local_world(2).run(initialized),
        (2, True): local_world(2).run(initialized, per_leaf_units=True),
        (4, False): local_world(4).run(initialized),
    }
    for (world, leaf_units), results in runs.items():
        for rank, exported in enumerate(results):
            assert set(exported) == set(expected)
            differ = [k for k in expected if not torch.equal(exported[k], expected[k])]
            assert not differ, f"world {world}, per-leaf units {leaf_units}, rank {rank}: {differ[:3]}"
    # The seed matters, and the tie holds.
    assert not torch.equal(fs.initialize.reference(model, seed=1)["tok_emb.weight"], expected["tok_emb.weight"])
    assert torch.equal(expected["head.weight"], expected["tok_emb.weight"])
    GPT(SMALL).load_state_dict(expected, strict=True)


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 7), nn.LayerNorm(7)])
        self.out = nn.Linear(7, 3)


def test_reference_is_each_submodule_seeded_by_its_path():
    """Independent of the library's code path: seed, reset_parameters, submodule by submodule."""
    with torch.device("meta"):
        meta = Two()
    made = fs.initialize.reference(meta, seed=5)
    by_hand = Two()
    for path in ["blocks.0", "blocks.1", "out"]:
        torch.manual_seed(seed_for(5, path))
        by_hand.get_submodule(path).reset_parameters()
    assert all(torch.equal(made[k], v) for k, v in by_hand.state_dict().items())
    assert seed_for(5, "out") == seed_for(5, "out") != seed_for(6, "out")


# --- memory ----------------------------------------------------------------------------------

LARGE = GPTConfig(vocab_size=2048, block_size=128, n_layer=5, n_head=8, d_model=512)  # ~68 MB float32


def init_memory(mesh):
    model, apply_fn, params = meta_gpt(LARGE)
    step = fs.sharded_step(lambda p, idx: apply_fn(p, idx).sum(), mesh, optimizer=fs.optim.sgd(1e-3), schedule=fs.Schedule(trace=False))
    torch.zeros(1 << 20).add_(1)  # warm the allocator and thread pools before measuring
    rss_before = reset_peak_rss()
    with AliveBytes() as counter:
        state = step.init(params, initialize=fs.initialize.from_module(model, seed=0))
    rss_peak = peak_rss() - rss_before
    layout = state.params.layout
    units: dict[str, int] = {}
    for spec in layout.buffers:
        units[spec.unit] = units.get(spec.unit, 0) + spec.numel * spec.dtype.itemsize
    owners: dict[str, int] = {}
    for name, t in model.named_parameters():
        owner = name.rpartition(".")[0]
        owners[owner] = owners.get(owner, 0) + t.numel() * t.element_size()
    return {
        "peak": counter.peak,
        "shards": sum(s.nbytes for s in state.params.shards),
        "largest_unit": max(units.values()),
        "largest_owner": max(owners.values()),
        "full": sum(units.values()),
        "rss_peak": rss_peak,
    }


def test_init_memory_is_shards_plus_one_submodule(local_world):
    reports = local_world(4).run(init_memory)
    for rank, r in enumerate(reports):
        assert r["full"] > 3.5 * r["shards"], r
        # Shards + one unit (asked); built for shards + one submodule's tensors.
        assert r["peak"] <= r["shards"] + r["largest_unit"], (rank, r)
        # (+ the NaN check's 64 KiB chunk of bools, and a little)
        assert r["peak"] <= r["shards"] + r["largest_owner"] + (1 << 17), (rank, r)
        assert r["peak"] < r["full"] / 2


# --- buffers ---------------------------------------------------------------------------------


def cnn_buffers(mesh):
    with torch.device("meta"):
        model = SmallCNN()
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, x: apply_fn(p, x).sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
    return fs.export(step.init(params, initialize=fs.initialize.from_module(model, seed=3)))


def test_batchnorm_buffers_and_frozen_parameters_are_materialized():
    runs = [fs.testing.SimulatedWorld(n).run(cnn_buffers)[0] for n in (1, 2)]
    assert runs[0]["blocks.0.norm.running_var"].eq(1).all() and runs[0]["stem_norm.running_mean"].eq(0).all()
    assert runs[0]["blocks.0.norm.num_batches_tracked"].dtype == torch.int64
    assert set(runs[0]) == set(SmallCNN().state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def llama_init(mesh, config):
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, ids: apply_fn(p, ids).logits.sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
    state = step.init(params, initialize=fs.initialize.from_module(model, seed=0))
    return fs.export(state), [t.clone() for t in state.params.local]


def test_llama_from_meta_including_rotary_buffers():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    (one, buffers_one), = fs.testing.SimulatedWorld(1).run(llama_init, config)
    two, buffers_two = fs.testing.SimulatedWorld(2).run(llama_init, config)[1]
    assert all(torch.equal(one[k], two[k]) for k in one)
    real = transformers.LlamaForCausalLM(config)
    real_buffers = dict(real.named_buffers())
    assert torch.equal(buffers_one[0], real_buffers["model.rotary_emb.inv_freq"])  # computed, not garbage
    assert all(torch.equal(a, b) for a, b in zip(buffers_one, buffers_two))
    assert one["model.norm.weight"].eq(1).all() and 0.015 < float(one["model.embed_tokens.weight"].std()) < 0.025
    real.load_state_dict(one, strict=True)


# --- errors and init functions ----------------------------------------------------------------


class Scale(nn.Module):
    """A parameter its module does not initialize (no reset_parameters)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))


def uncovered(mesh):
    with torch.device("meta"):
        model = Scale()
    _, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, x: x.sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
    step.init(params, initialize=fs.initialize.from_module(model))


def test_a_leaf_no_init_covers_is_named():
    with pytest.raises(fs.RankError, match=r"leaf 'gain'.*submodule '<root>' \(Scale\).*init=") as info:
        fs.testing.SimulatedWorld(1).run(uncovered)
    assert isinstance(info.value.__cause__, InitError)
    # Ranks whose shard does not touch it raise too, instead of waiting at the next collective.
    with pytest.raises(fs.RankError, match=r"InitError"):
        fs.testing.SimulatedWorld(2).run(uncovered)


def from_a_function(mesh, units=None):
    tree = {"a": torch.empty(17, 3, device="meta"), "b": [torch.empty(5, device="meta"), torch.arange(4.0)]}
    step = fs.sharded_step(lambda p, x: x.sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False), units=units)
    init = fs.initialize.from_function(lambda path, like: torch.randn(like.shape) * (2 if path == "a" else 1))
    return fs.export(step.init(tree, initialize=init))


def test_an_init_function_of_the_path():
    results = [fs.testing.SimulatedWorld(n).run(from_a_function, units=u)[0] for n, u in [(1, None), (3, per_leaf)]]
    for out in results:
        torch.manual_seed(seed_for(0, "a"))
        assert torch.equal(out["a"], torch.randn(17, 3) * 2)
        torch.manual_seed(seed_for(0, "b[0]"))
        assert torch.equal(out["b"][0], torch.randn(5))
        assert torch.equal(out["b"][1], torch.arange(4.0))  # not on meta: kept


def test_meta_leaves_without_an_initializer_point_to_one():
    with pytest.raises(fs.RankError, match=r"meta device.*initialize=fs.initialize.from_module"):
        fs.testing.SimulatedWorld(1).run(uncovered_without_initializer)


def uncovered_without_initializer(mesh):
    _, _, params = meta_gpt(SMALL)
    fs.sharded_step(lambda p, x: x.sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False)).init(params)


def test_axis_names_mean_one_thing_and_model_parallel_axes_are_not_silent_replicas():
    """Issue 26: `{"fsdp": 2, "tp": 2}` was accepted and `tp` became a replica axis. An unknown axis
    name is refused, listing the known ones; a step on a `tp` mesh without placements, a step on
    a `pp` mesh, and `fs.shard` / `fs.reduce_scatter` without placements are refused before anything
    runs, naming the axis."""
    with pytest.raises(ValueError, match=r"unknown mesh axis name 'data'.*'replicate'.*'fsdp'.*'tp'"):
        fs.init_mesh({"data": 1})
    with pytest.raises(fs.RankError, match=r"unknown mesh axis name 'dp'"):
        fs.testing.SimulatedWorld(4, axes={"fsdp": 2, "dp": 2}).run(lambda mesh: None)

    def body(mesh):
        apply_fn, params = fs.functionalize(nn.Linear(4, 3))
        errors = []
        step = lambda: fs.sharded_step(  # noqa: E731
            lambda p, x: apply_fn(p, x).sum(), mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False)
        )
        if "tp" in mesh.shape:
            with pytest.raises(fs.MeshError, match=r"tensor-parallel axis 'tp' but fs.sharded_step was given no placements"):
                step()
        else:
            with pytest.raises(fs.MeshError, match=r"model-parallel axis 'pp' \(size 2\)"):
                step()
        axis = "tp" if "tp" in mesh.shape else "pp"
        for call in (lambda: fs.shard(params, mesh), lambda: fs.reduce_scatter(params, mesh)):
            with pytest.raises(fs.MeshError, match=rf"model-parallel axis '{axis}' \(size 2\)") as caught:
                call()
            errors.append(str(caught.value))
        return errors

    for axes in ({"fsdp": 2, "tp": 2}, {"pp": 2, "fsdp": 2}):
        for errors in fs.testing.SimulatedWorld(4, axes=axes).run(body):
            assert errors[0].startswith("fs.shard ") and errors[1].startswith("fs.reduce_scatter")
    # A model-parallel axis of size 1 changes nothing.
    one = fs.testing.SimulatedWorld(2, axes={"fsdp": 2, "tp": 1}).run(lambda mesh: fs.shard({"w": torch.ones(3)}, mesh).mesh.num_shards)
    assert one == [2, 2]
