"""`fs.analysis`: analysis before running, planning on an abstract mesh, timelines, simulation.

Planning tests trace on the meta device for an `AbstractMesh` (no process group, nothing
allocated); the timeline and memory tests run a real GPT step at world size 2 (gloo).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

GPT_SHAPE = dict(vocab_size=67, block_size=32, n_layer=3, n_head=2, d_model=40)  # odd sizes: padding


def gpt_loss(apply_fn):
    def loss_fn(p, batch):
        inputs, targets = batch
        return F.cross_entropy(apply_fn(p, inputs).flatten(0, 1), targets.flatten())

    return loss_fn


def meta_gpt():
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_SHAPE))
    return fs.functionalize(model)


def meta_batch(batch: int = 2, sequence: int = 32):
    tokens = torch.empty(batch, sequence, dtype=torch.long, device="meta")
    return tokens, tokens


@pytest.mark.parametrize("world", [1, 8, 64, 1024])
@pytest.mark.parametrize("reshard", [True, False])
def test_bytes_per_step_are_3psi_or_2psi(world, reshard):
    apply_fn, params = meta_gpt()
    mesh = fs.analysis.AbstractMesh({"fsdp": world})
    schedule = fs.Schedule(reshard_after_forward=reshard)
    analysis, compiled = fs.analysis.plan(gpt_loss(apply_fn), params, meta_batch(), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3), schedule=schedule)
    psi = sum(p.numel() for p in fs.tree_leaves(params))
    layout = compiled.key.layout
    padded = sum(b.padded_numel for b in layout.buffers if b.trainable)
    # Padding: less than one element per rank and buffer.
    assert psi <= padded < psi + world * len(layout.buffers)
    itemsize = 4
    gathers = 2 if reshard else 1
    assert analysis.all_gather_bytes == gathers * padded * itemsize
    assert analysis.reduce_scatter_bytes == padded * itemsize
    assert analysis.all_gather_bytes + analysis.reduce_scatter_bytes == (3 if reshard else 2) * padded * itemsize
    assert all(c.group_size == world for c in analysis.collectives if c.kind != "all_reduce")


def test_flops_per_unit_match_flop_counter():
    """The FLOPs of the traced step equal torch's FlopCounterMode over a plain forward+backward
    of the model (the optimizer and collectives add none)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_SHAPE))
    apply_fn, params = fs.functionalize(model)
    analysis, _ = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 4}), optimizer=fs.optim.adamw(lr=1e-3)
    )
    tokens = torch.randint(0, GPT_SHAPE["vocab_size"], (2, 32))
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert analysis.flops == counter.get_total_flops()
    by_unit = {u.unit: u for u in analysis.units}
    blocks = [by_unit[f"blocks.{i}"] for i in range(GPT_SHAPE["n_layer"])]
    assert len({(b.forward_flops, b.backward_flops) for b in blocks}) == 1  # identical blocks, identical costs
    assert all(b.backward_flops == 2 * b.forward_flops for b in blocks)  # dX and dW: two products per product
    assert by_unit[""].forward_flops == by_unit[""].backward_flops == 0  # the head belongs to the tied unit


def test_peak_memory_parts_and_fit():
    apply_fn, params = meta_gpt()
    world = 8
    analysis, compiled = fs.analysis.plan(
        gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": world}), optimizer=fs.optim.adamw(lr=1e-3)
    )
    memory = analysis.memory
    shard_bytes = sum(b.shard_numel for b in compiled.key.layout.buffers) * 4
    # At the peak (in the backward) the state is alive: shards, Adam's two moments, its count and
    # the per-step scalars (learning rate, ...: a few 0-d tensors).
    assert memory.breakdown.parameters == shard_bytes
    assert 2 * shard_bytes < memory.breakdown.optimizer_state <= 2 * shard_bytes + 64
    assert memory.breakdown.total == memory.peak
    assert memory.peak == max(memory.timeline) and memory.resident <= memory.peak
    largest_unit = max(b.nbytes for b in compiled.key.layout.buffers)
    assert 0 < memory.breakdown.gathered <= 2 * largest_unit  # prefetch 1: at most two units gathered
    assert analysis.fits(memory.peak) and not analysis.fits(memory.peak - 1)


def test_abstract_mesh_refuses_real_tensors():
    mesh = fs.analysis.AbstractMesh({"replicate": 2, "fsdp": 4})
    assert (mesh.world_size, mesh.num_shards) == (8, 4)
    with pytest.raises(RuntimeError, match="no other ranks"):
        mesh.all_gather_flat(torch.zeros(3))
    with pytest.raises(ValueError, match="positive int"):
        fs.analysis.AbstractMesh({"fsdp": 0})
