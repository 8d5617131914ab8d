"""Layout-invariant training, the whole acceptance matrix of issue 28 (slow; the default suite's
test_canonical.py runs a corner of it).

`fs.models.GPT` with dropout 0.1 and a Hugging Face Llama (attention dropout 0.1, right padding,
`-100` labels, `fs.WeightedLoss` by token count), each in fp32 and in bf16 mixed precision
(bf16 parameters, fp32 reduce), AdamW with clipping, `canonical_chunks=8`, 20 steps, traced
with the canonical step's default schedule (each unit gathered once per step) at world sizes 1
(8 micro-batches), 2, 4 and 8 (`{"fsdp": n}`), at `{"replicate": 2, "fsdp": 2}`, at 2 with
`microbatches=4` passed explicitly and at 2 with per-chunk gathers (`fs.Schedule()`); eager at 1
and 4: every parameter, every
optimizer moment (shards joined in shard order), every per-step mean loss and grad norm, and
`step.evaluate`'s loss bit-identical (`torch.equal`) across all of them.
"""

from __future__ import annotations

import pytest

import functional_shard as fs

from test_canonical import assert_same, joined, train

STEPS = 20

# (label, world key, trace, microbatches); the reference is the first.
RUNS = [
    ("world 1 traced (8 micro-batches)", 1, True, None),
    ("world 1 eager", 1, False, None),
    ("world 2 traced", 2, True, None),
    ("world 2 traced, per-chunk gathers (fs.Schedule())", 2, "per chunk", None),
    ("world 2 traced, microbatches=4 passed", 2, True, 4),
    ("world 4 traced", 4, True, None),
    ("world 4 eager", 4, False, None),
    ("world 8 traced", 8, True, None),
    ('world {"replicate": 2, "fsdp": 2} traced', "hybrid", True, None),
]


@pytest.fixture(scope="module")
def worlds(local_world):
    """World sizes 1, 2, 4 (the session's), 8 and replicate 2 x fsdp 2 (this module's)."""
    eight = fs.testing.LocalWorld(8, collective_timeout=120.0, call_timeout=900.0)
    hybrid = fs.testing.LocalWorld(4, axes={"replicate": 2, "fsdp": 2}, collective_timeout=120.0, call_timeout=900.0)
    try:
        yield {1: local_world(1), 2: local_world(2), 4: local_world(4), 8: eight, "hybrid": hybrid}
    finally:
        eight.close()
        hybrid.close()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_same_bits_at_every_layout(worlds, model, precision):
    runs = iter(RUNS)
    label, key, trace, microbatches = next(runs)
    reference = joined(worlds[key].run(train, model, precision, STEPS, trace, 8, microbatches))
    assert len(reference["losses"]) == STEPS and len(reference["opt"]) > 0
    for label, key, trace, microbatches in runs:
        other = joined(worlds[key].run(train, model, precision, STEPS, trace, 8, microbatches))
        assert_same(reference, other, f"{model} {precision} {label}")
