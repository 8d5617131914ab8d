"""Layout invariance with the pipeline axis (issue 28, "with the pipeline axis"; issue 27):
`canonical_chunks=G` at `{"pp": 2, "fsdp": 2}` gives the bits of world size 1 without a pipeline.

A pipelined layout-invariant step computes each chunk as a micro-batch, stage by stage: stage 0
seeds the chunk's random stream and the generator's state travels to the next stage with the
activations (the draws of one process running the chunk through the whole model), each stage
adds its chunks' gradients in the canonical tree and reduces them in it, the last stage's chunk
losses meet in the tree, and the gradient norm adds every buffer in the whole model's order.
Checked: GPT with dropout, AdamW with clipping, G = 8, 3 steps — every parameter, every
optimizer moment, per-step mean loss and grad norm, and `step.evaluate`'s loss, `torch.equal`.
Slow: the Hugging Face Llama (padding, -100 labels, `fs.WeightedLoss`) in bf16 mixed precision at
`{"pp": 2, "fsdp": 2}`, `{"pp": 4}` and `{"replicate": 2, "pp": 2}` against world size 1.
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs
from test_canonical import G, build, global_batch, local_rows, precision_of


def train(mesh, model="gpt", precision="fp32", steps=3, pipeline=None):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params, loss_fn = build(model, 0.1)
        optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(lr=1e-2, weight_decay=0.1))
        extra = {"pipeline": pipeline} if pipeline else {}
        step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, precision=precision_of(precision), canonical_chunks=G, **extra)
        state = step.init(params)
        losses, norms = [], []
        for i in range(steps):
            state, metrics = step(state, local_rows(global_batch(model, i), mesh))
            losses.append(metrics["loss"].detach().clone())
            norms.append(metrics["grad_norm"].detach().clone())
        evaluated = step.evaluate(state, local_rows(global_batch(model, 10_000), mesh))["loss"].detach().clone()
        moments = {}
        for path, t in zip(fs.tree_paths(state.opt_state), fs.tree_leaves(state.opt_state)):
            if t.dim() == 1 and mesh.num_shards > 1:  # a shard of a buffer's moment: joined over fsdp
                t = mesh.all_gather_axis_flat(t.contiguous(), mesh.shard_axis)
            moments[path] = t.detach().clone()
        return losses, norms, evaluated, fs.export(state), moments
    finally:
        torch.set_num_threads(threads)


def compare(pipelined, single) -> list[str]:
    out = []
    losses, norms, evaluated, params, _ = single
    moments = {}
    for rank, (l, n, e, p, m) in enumerate(pipelined):
        for i, (a, b) in enumerate(zip(l, losses)):
            if not torch.equal(a, b):
                out.append(f"rank {rank}: loss of step {i}: {a.item()!r} vs {b.item()!r}")
        for i, (a, b) in enumerate(zip(n, norms)):
            if not torch.equal(a, b):
                out.append(f"rank {rank}: grad_norm of step {i}: {a.item()!r} vs {b.item()!r}")
        if not torch.equal(e, evaluated):
            out.append(f"rank {rank}: evaluate loss {e.item()!r} vs {evaluated.item()!r}")
        out += [f"rank {rank}: parameter {k}" for k in params if not torch.equal(p[k], params[k])]
        moments.update(m)
    assert set(moments) == set(single[4]), "the pipeline ranks' optimizer states do not cover the whole model's"
    out += [f"optimizer leaf {k} (max |diff| {(moments[k].float() - v.float()).abs().max().item():.3g})"
            for k, v in single[4].items() if not torch.equal(moments[k], v)]  # fmt: skip
    return out


@pytest.fixture(scope="module")
def single_gpt():
    return _single("gpt", "fp32")


def _single(model, precision):
    with fs.testing.LocalWorld(1, axes={"fsdp": 1}) as world:
        return world.run(train, model, precision)[0]


def test_a_pipelined_canonical_step_gives_the_bits_of_one_process(single_gpt):
    with fs.testing.LocalWorld(4, axes={"pp": 2, "fsdp": 2}) as world:
        pipelined = world.run(train, "gpt", "fp32", 3, "1f1b")
    assert compare(pipelined, single_gpt) == []


@pytest.mark.slow
@pytest.mark.parametrize("axes", [{"pp": 2, "fsdp": 2}, {"pp": 4}, {"replicate": 2, "pp": 2}])
def test_a_pipelined_canonical_llama_in_bf16_gives_the_bits_of_one_process(axes):
    single = _single("llama", "bf16")
    with fs.testing.LocalWorld(4, axes=axes) as world:
        pipelined = world.run(train, "llama", "bf16", 3, fs.pipeline.Pipeline("zb_h1", stages="units"))
    assert compare(pipelined, single) == []
