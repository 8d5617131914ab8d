"""`fs.functionalize`: roles of leaves, tied weights, buffers, and the units they fall into."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig, SmallCNN


def test_roles_aliases_and_state_dict_names():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    apply_fn, params = fs.functionalize(model)
    assert "tok_emb.weight" in params.trainable and "head.weight" not in params.trainable
    assert ("head.weight", "tok_emb.weight") in params.aliases
    assert params.non_persistent == ("scratch",)
    assert set(params.state_dict()) == set(model.state_dict())
    x = torch.randint(0, 11, (2, 5))
    assert torch.equal(apply_fn(params, x), model(x))
    # copies: the module's own tensors are not the leaves
    assert params["tok_emb.weight"].data_ptr() != model.tok_emb.weight.data_ptr()


def test_frozen_parameters_and_buffers():
    model = SmallCNN(num_classes=4, in_channels=3)
    _, params = fs.functionalize(model)
    assert set(params.frozen) == {"stem.weight", "stem.bias"}
    assert "stem_norm.running_mean" in params.buffers and "stem_norm.num_batches_tracked" in params.buffers
    assert fs.make_layout(params, num_shards=1)[0].roles.count("buffer") == len(params.buffers)


def test_default_units_are_input_blocks_output():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, d_model=8))
    _, params = fs.functionalize(model)
    layout, _ = fs.make_layout(params, num_shards=2)
    assert layout.units == ("input", "blocks.0", "blocks.1", "blocks.2", "output")
    sequential = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    _, params = fs.functionalize(sequential)
    assert fs.make_layout(params, num_shards=2)[0].units == ("0", "2")


def test_custom_unit_policy():
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=3, n_head=2, d_model=8))
    _, params = fs.functionalize(model)
    layout, _ = fs.make_layout(params, num_shards=2, units=lambda path: "attn" if ".attn." in path else "other")
    assert layout.units == ("other", "attn")


def per_rank_batchnorm(mesh, initial: nn.Module):
    """Each rank's BatchNorm statistics come from its own batch, as in FSDP."""
    model = copy.deepcopy(initial)  # thread-ranks share torch's global RNG: build models outside
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(trace=False))
    state = step.init(params)
    g = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randn(3, 3, 8, 8, generator=g), torch.randint(0, 4, (3,), generator=g))
    new_state, _ = step(state, batch)
    exported = fs.export(new_state)
    model(batch[0])  # plain module, same initial weights, this rank's batch
    expected = model.state_dict()
    buffers_match = all(torch.equal(exported[n], expected[n]) for n in params.buffers)
    old_untouched = all(torch.equal(a, b) for a, b in zip(state.params.local, params.buffers.values()))
    return buffers_match, old_untouched, exported["stem_norm.running_mean"]


def test_buffers_are_per_rank():
    torch.manual_seed(0)
    out = fs.testing.SimulatedWorld(2).run(per_rank_batchnorm, SmallCNN(num_classes=4, in_channels=3))
    assert all(match and untouched for match, untouched, _ in out)
    assert not torch.equal(out[0][2], out[1][2])  # different batches, different statistics
