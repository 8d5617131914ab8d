"""`fs.testing.compare_layouts`: train at several layouts, report the first step and leaf whose
bits differ.

A tiny GPT with dropout, clipping + AdamW: with `canonical_chunks=8` the run at `{"fsdp": 1}`
and at `{"fsdp": 2}` is reported identical; without it, the report names the first difference
(step 0 or 1, a leaf path, the layouts, how many elements, how far apart). Arguments are checked
before any process starts.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

VOCAB = 31


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=24, dropout=0.1))


def make_step(mesh, chunks: int | None = None):
    apply_fn, _ = fs.functionalize(_model())

    def loss_fn(p, batch):
        x, y = batch
        logits = apply_fn(p, x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(lr=1e-2, weight_decay=0.1))
    return fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=fs.Schedule(trace=False), canonical_chunks=chunks)


def params_fn():
    return fs.functionalize(_model())[1]


def batch_fn(i: int):
    g = torch.Generator().manual_seed(100 + i)
    tokens = torch.randint(0, VOCAB, (16, 11), generator=g)
    return tokens, torch.roll(tokens, -1, 1)


LAYOUTS = [{"fsdp": 1}, {"fsdp": 2}]


def test_canonical_chunks_are_reported_identical_and_the_default_step_is_not():
    same = fs.testing.compare_layouts(functools.partial(make_step, chunks=8), params_fn, batch_fn, layouts=LAYOUTS, steps=2)
    assert same.identical, str(same)
    assert same.first is None and same.first_leaf is None
    assert same.layouts == tuple(LAYOUTS) and same.steps == 2
    assert len(same.losses) == 2 and same.losses[0] == same.losses[1] and len(same.losses[0]) == 2
    assert str(same).startswith("Identical bits at {'fsdp': 1}, {'fsdp': 2} over 2 step(s)")

    differ = fs.testing.compare_layouts(make_step, params_fn, batch_fn, layouts=LAYOUTS, steps=2, every_step=True)
    assert not differ.identical
    first, leaf = differ.first, differ.first_leaf
    assert first.step in (0, 1) and first.what in ("loss", "param", "optimizer state")
    assert first.layouts == ({"fsdp": 1}, {"fsdp": 2})
    assert leaf is not None and leaf.step in (0, 1) and leaf.what in ("param", "optimizer state")
    paths = fs.tree_paths(params_fn())
    leaf_path = leaf.leaf if leaf.what == "param" else leaf.leaf.split("/")[-1]
    assert leaf_path in paths, (leaf.leaf, paths)
    assert 0 < leaf.differing <= leaf.numel and leaf.max_abs_diff > 0
    report = str(differ)
    assert report.startswith("Bits differ at {'fsdp': 1}, {'fsdp': 2} over 2 step(s). First: ")
    assert f"after step {leaf.step}" in report and repr(leaf.leaf) in report
    assert f"{leaf.differing} of {leaf.numel} element(s)" in report


def _closure_step():
    def make(mesh):  # a closure: cannot be pickled into the rank processes
        return None

    return make


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"make_step": lambda mesh: None}, r"make_step .* cannot be pickled .* module-level function"),
        ({"make_step": _closure_step()}, r"make_step .* cannot be pickled"),
        ({"layouts": [{"fsdp": 2}]}, r"two or more layouts"),
        ({"layouts": [{"fsdp": 1}, {"fsdp": 0}]}, r"mesh axis -> size >= 1"),
        ({"layouts": [{"fsdp": 1}, [2]]}, r"mesh axis -> size >= 1"),
        ({"steps": 0}, r"steps must be an int >= 1"),
        ({"threads": 0}, r"threads must be an int >= 1"),
        ({"batch_fn": 3}, r"batch_fn must be callable"),
    ],
    ids=["lambda", "closure", "one-layout", "size-0", "not-a-dict", "steps", "threads", "not-callable"],
)
def test_bad_arguments_are_named_before_any_process_starts(kwargs, match):
    arguments = {"make_step": make_step, "params_fn": params_fn, "batch_fn": batch_fn, **kwargs}
    with pytest.raises(ValueError, match=match):
        fs.testing.compare_layouts(arguments.pop("make_step"), arguments.pop("params_fn"), arguments.pop("batch_fn"), **arguments)
