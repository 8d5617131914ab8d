"""fp16 dynamic loss scaling on a pipelined step (`fs.Precision(param_dtype=torch.float16,
loss_scale=fs.LossScale(...))`): the last stage seeds the loss's backward with the scale, the mean
gradient is divided by it after the mean (as the plain step does), the update of a step whose
gradient is not finite is skipped and the scale backs off, on every rank alike (the norm is
global).

A GPT (untied) at `{"pp": 2}` (1F1B and ZB-V, 2 micro-batches) from a scale too large for fp16
(2**20, growing after 2 good steps), 8 steps, against the plain step (no pipeline, one rank, the
eager reference, the same micro-batches): the same steps skipped (four, then it trains), the
same scales (halved, then doubled after two good steps), the same losses and the same parameters,
bit for bit; the skipped steps leave the state as it was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig
from test_pipeline_step import distance  # Euclidean distance over every parameter element

VOCAB, ROWS, LENGTH, M, STEPS = 32, 4, 8, 2, 8
FP16 = fs.Precision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                    loss_scale=fs.LossScale(init_scale=2.0**20, growth_interval=2))  # fmt: skip


def run(mesh, schedule):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=4, n_head=2, d_model=16, tie_weights=False))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1).float(), y.flatten())

    extra = {"pipeline": fs.pipeline.Pipeline(schedule)} if schedule else {"schedule": fs.Schedule(trace=False)}
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), microbatches=M, precision=FP16, **extra)
    state = step.init(params)
    start = {k: v.clone() for k, v in fs.gather(state.params, full=True).trainable.items()}
    out = {"skipped": [], "scale": [], "loss": [], "unchanged": []}
    for i in range(STEPS):
        x = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(10 + i))
        before = [t.clone() for t in fs.tree_leaves(state.params)]
        state, metrics = step(state, (x, torch.roll(x, -1, 1)))
        out["skipped"].append(bool(metrics["skipped"]))
        out["scale"].append(float(metrics["loss_scale"]))
        out["loss"].append(float(metrics["loss"]))
        out["unchanged"].append(all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state.params))))
    out["params"] = fs.gather(state.params, full=True).trainable
    out["start"] = start
    return out


def test_fp16_loss_scaling_skips_and_scales_as_the_plain_step():
    (plain,) = fs.testing.SimulatedWorld(1, axes={"fsdp": 1}).run(run, None)
    assert plain["skipped"][0] and not all(plain["skipped"]), plain["skipped"]  # the scale had to come down
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        for schedule in ("1f1b", "zbv"):
            results = world.run(run, schedule)
            params = {k: v for r in results for k, v in r["params"].items()}
            assert params.keys() == plain["params"].keys()
            moved = distance(plain["params"], plain["start"])
            apart = distance(params, plain["params"])
            print(schedule, {"apart": apart, "moved": moved, "skipped": results[0]["skipped"], "scale": results[0]["scale"]})
            for rank, r in enumerate(results):
                assert r["skipped"] == plain["skipped"] and r["scale"] == plain["scale"], (schedule, rank, r["skipped"], r["scale"])
                assert r["loss"] == plain["loss"], (schedule, rank, r["loss"], plain["loss"])
                assert all(u for u, s in zip(r["unchanged"], r["skipped"]) if s), (schedule, rank)
            assert moved > 0 and apart == 0, (schedule, apart, moved)
