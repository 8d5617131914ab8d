"""Unit policies (`fs.BlockUnits`, `fs.UnitPolicy`, `fs.units_by_block`, plain functions).

- the default splits the leaves outside the blocks into `input` (before the first block, in
  flatten order) and `output` (after the last); a run between two blocks is a unit of its own;
  a tree without blocks is one unit `rest`;
- `units=fs.units_by_block` keeps the layout of before (one `rest`), and per-leaf functions built
  on it still work; a `UnitPolicy` sees every path at once; bad policies raise naming the leaf;
- planned on an `AbstractMesh` (no process group): the default schedule keeps fewer units
  alive at once with the default units than with `rest`, for the untied GPT and Hugging Face
  Llama, and never more for tied models;
- a unit name a step does not have (a stale `rest`) in `reshard_after_forward` raises.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

SHAPE = dict(vocab_size=52, block_size=16, n_layer=3, n_head=2, d_model=16)


def gpt_params(**config):
    torch.manual_seed(0)
    return fs.functionalize(GPT(GPTConfig(**{**SHAPE, **config})))


@pytest.mark.parametrize(
    "paths, expected",
    [
        (
            ["tok_emb.weight", "pos_emb.weight", "blocks.0.w", "blocks.0.b", "blocks.1.w", "ln_f.weight", "head.weight"],
            ["input", "input", "blocks.0", "blocks.0", "blocks.1", "output", "output"],
        ),
        (  # an encoder-decoder: the encoder's final norm sits between the two stacks
            ["shared", "encoder.block.0.w", "encoder.block.1.w", "encoder.norm.w", "decoder.block.0.w", "decoder.norm.w", "lm_head"],
            ["input", "encoder.block.0", "encoder.block.1", "after.encoder.block.1", "decoder.block.0", "output", "output"],
        ),
        (["layers[0].w", "layers[1].w", "norm"], ["layers[0]", "layers[1]", "output"]),
        (["w", "b"], ["rest", "rest"]),  # no block at all: one unit
        ([], []),
    ],
)
def test_block_units_split_the_ends(paths, expected):
    assert fs.BlockUnits()(tuple(paths)) == expected
    assert [fs.units_by_block(p) for p in paths] == [u if u.split(".")[0] not in ("input", "output", "after") else "rest" for u in expected]


def test_default_layouts_of_tied_and_untied_gpt():
    _, tied = gpt_params()
    layout, _ = fs.make_layout(tied, num_shards=2)
    assert layout.units == ("input", "blocks.0", "blocks.1", "blocks.2", "output")
    unit_of = {layout.paths[i]: b.unit for b in layout.buffers for i in b.leaves}
    assert unit_of["tok_emb.weight"] == unit_of["pos_emb.weight"] == "input"  # the head's tied weight too
    assert unit_of["ln_f.weight"] == "output" and "head.weight" not in unit_of
    _, untied = gpt_params(tie_weights=False)
    layout, _ = fs.make_layout(untied, num_shards=2)
    unit_of = {layout.paths[i]: b.unit for b in layout.buffers for i in b.leaves}
    assert unit_of["head.weight"] == unit_of["ln_f.bias"] == "output"
    # the layout of before: one `rest` for the embeddings, final norm and head
    assert fs.make_layout(untied, num_shards=2, units=fs.units_by_block)[0].units == ("rest", "blocks.0", "blocks.1", "blocks.2")


def two_blocks_per_unit(path: str) -> str:
    """The per-leaf policy of docs/units.md."""
    unit = fs.units_by_block(path)
    if unit == "rest":
        return unit
    return f"blocks.{int(unit.split('.')[1]) // 2}"


@dataclasses.dataclass(frozen=True)
class TwoBlocksPerUnit(fs.UnitPolicy):
    """The same on top of the default, as a policy that sees every path."""

    def __call__(self, paths):
        return [f"blocks.{int(u.split('.')[1]) // 2}" if u.startswith("blocks.") else u for u in fs.BlockUnits()(paths)]


def test_custom_policies_of_both_kinds():
    _, params = gpt_params(n_layer=4)
    assert fs.make_layout(params, num_shards=2, units=two_blocks_per_unit)[0].units == ("rest", "blocks.0", "blocks.1")
    assert fs.make_layout(params, num_shards=2, units=TwoBlocksPerUnit())[0].units == ("input", "blocks.0", "blocks.1", "output")
    assert fs.make_layout(params, num_shards=2, units=fs.BlockUnits())[0] == fs.make_layout(params, num_shards=2)[0]


@dataclasses.dataclass(frozen=True)
class OneNameShort(fs.UnitPolicy):
    def __call__(self, paths):
        return ["all"] * (len(paths) - 1)


def test_bad_policies_raise_naming_the_leaf():
    _, params = gpt_params()
    with pytest.raises(fs.LayoutError, match="returned 39 unit names for 40 leaves"):
        fs.make_layout(params, num_shards=2, units=OneNameShort())
    with pytest.raises(fs.LayoutError, match="returned 3 for leaf 'tok_emb.weight'"):
        fs.make_layout(params, num_shards=2, units=lambda path: 3)
    with pytest.raises(TypeError, match="fs.UnitPolicy"):
        fs.make_layout(params, num_shards=2, units="blocks")


# --- units alive, planned on an abstract mesh --------------------------------------------------------


def gpt_problem(tie_weights: bool):
    apply_fn, params = gpt_params(tie_weights=tie_weights)

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch[0]).flatten(0, 1), batch[1].flatten())

    tokens = torch.empty(2, 16, dtype=torch.long, device="meta")
    return loss_fn, params, (tokens, tokens)


def llama_problem():
    pytest.importorskip("transformers")
    from test_training import build_hf, token_sum

    apply_fn, params = fs.functionalize(build_hf("llama"))

    def loss_fn(p, batch):
        ids, mask, labels = batch
        return token_sum(apply_fn(p, input_ids=ids, attention_mask=mask, use_cache=False).logits, labels)

    tokens = torch.empty(2, 12, dtype=torch.long, device="meta")
    return loss_fn, params, (tokens, tokens, tokens)


def planned(problem, units, schedule=None):
    loss_fn, params, batch = problem
    mesh = fs.analysis.AbstractMesh({"fsdp": 4})
    analysis, compiled = fs.analysis.plan(loss_fn, params, batch, mesh=mesh, optimizer=fs.optim.adamw(1e-3), units=units, schedule=schedule)
    return fs.schedule.max_units_alive(compiled.events), analysis


# The Llama with -m slow (suite time): an untied model with embeddings and a head outside its
# blocks, the same assertions as the untied GPT.
@pytest.mark.parametrize("model", ["gpt untied", pytest.param("llama", marks=pytest.mark.slow), "gpt tied"])
def test_default_units_keep_fewer_units_alive(model):
    problem = {"gpt untied": lambda: gpt_problem(False), "llama": llama_problem, "gpt tied": lambda: gpt_problem(True)}[model]()
    before, before_analysis = planned(problem, fs.units_by_block)
    after, after_analysis = planned(problem, None)
    assert before == 3  # `rest` from the embedding to the head, and two blocks (prefetch 1)
    if model == "gpt tied":
        # The tied weight is in `input`, read by the embedding and by the head: gathered through
        # the whole forward, as `rest` was.
        assert after == 3 and after_analysis.all_gather_bytes == before_analysis.all_gather_bytes
    else:
        # Embeddings freed before the first block, head gathered after the last one; and the
        # backward does not gather the embeddings again (an embedding's gradient does not read it).
        assert after == 2
        assert after_analysis.all_gather_bytes < before_analysis.all_gather_bytes
    # The peak stays where it was (a reduce-scatter's input, alive until its wait, can move
    # it by a few hundred bytes either way on these toy sizes).
    assert after_analysis.memory.peak <= 1.01 * before_analysis.memory.peak


def test_a_unit_the_step_does_not_have_in_reshard_after_forward_raises():
    problem = gpt_problem(False)
    with pytest.raises(ValueError, match=r"no unit named \['rest'\].*'input', 'blocks.0'"):
        planned(problem, None, fs.Schedule(reshard_after_forward={"rest": False}))
    alive, _ = planned(problem, None, fs.Schedule(reshard_after_forward={"output": False}))
    assert alive == 2


def test_frozen_leaves_keep_their_place_in_the_order_of_use():
    """`fs.functionalize` records the module's registration order (`ModuleParams.order`) when some
    parameters are frozen: the default units name a frozen embedding `input` and frozen blocks by
    their index (not `output` / `after.<last block>`, as the flatten order, trainable first, put
    them), and a pipeline's stages cut the units in that order: the frozen embedding on stage 0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=False))
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(("tok_emb", "pos_emb", "blocks.0.")))
    apply_fn, params = fs.functionalize(model)
    assert params.order == tuple(n for n, _ in model.named_parameters())
    from functional_shard._layout import make_layout

    layout, _ = make_layout(params, 1)
    unit_of = {layout.paths[i]: spec.unit for spec in layout.buffers for i in spec.leaves}
    assert unit_of["tok_emb.weight"] == "input" and unit_of["blocks.0.attn.qkv.weight"] == "blocks.0", unit_of
    assert unit_of["head.weight"] == "output", unit_of

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch[0]).flatten(0, 1), batch[1].flatten())

    stages = []
    for rank in range(2):
        mesh = fs.analysis.AbstractMesh({"pp": 2}, rank=rank)
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-3), microbatches=2,
                               pipeline=fs.pipeline.Pipeline("1f1b", stages=[["input", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "output"]]))  # fmt: skip
        stages.append(set(step.init_abstract(params).params.layout.paths))
    assert {"tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"} <= stages[0], stages[0]
    assert {"head.weight", "blocks.3.attn.qkv.weight"} <= stages[1] and "tok_emb.weight" not in stages[1], stages[1]
