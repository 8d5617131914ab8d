"""`has_aux=True` on a pipelined step: `loss_fn` returns `(loss, aux)`, and `metrics["aux"]` is
on every pipeline rank, as a plain step's is — the micro-batch's tree with one micro-batch, else
the list of the micro-batches' trees — from the training step, `step.grad` and `step.evaluate`.

Real gloo ranks, a GPT at `{"pp": 2}` under 1F1B (the last stage on rank 1) and ZB-V (the last
stage on rank 0), 2 micro-batches: aux holds a float computed from the logits on the last stage,
an integer count, a value of the batch alone and one of a first-stage parameter alone (lent to
the last stage once per step); every rank's aux equals, bit for bit, what the plain step (no
pipeline, one rank, the same micro-batches) returns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

VOCAB, ROWS, LENGTH, M = 32, 4, 8, 2


def make(mesh, schedule: str | None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=4, n_head=2, d_model=16)))

    def loss_fn(p, batch):
        x, y = batch
        logits = apply_fn(p, x)
        aux = {
            "confidence": logits.softmax(-1).amax(-1).mean(),  # the last stage's
            "right": (logits.argmax(-1) == y).sum(),  # an integer
            "tokens": (x >= 0).sum(),  # the batch's alone
            "embedding_norm": p["tok_emb.weight"].norm(),  # a first-stage parameter's alone
        }
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), aux

    # the plain step: the eager reference (a simulated rank cannot trace)
    pipe = {"pipeline": fs.pipeline.Pipeline(schedule)} if schedule else {"schedule": fs.Schedule(trace=False)}
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), microbatches=M, has_aux=True, **pipe)
    return step, step.init(params)


def batch():
    x = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(3))
    return x, torch.roll(x, -1, 1)


def run(mesh, schedule):
    step, state = make(mesh, schedule)
    out = {"grad": step.grad(state, batch())[1]["aux"], "evaluate": step.evaluate(state, batch())["aux"]}
    _, metrics = step(state, batch())
    out["step"] = metrics["aux"]
    return out


def same(a, b) -> bool:
    return len(a) == len(b) == M and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def test_aux_is_on_every_pipeline_rank_as_the_plain_step_returns_it():
    (plain,) = fs.testing.SimulatedWorld(1, axes={"fsdp": 1}).run(run, None)
    assert isinstance(plain["step"], list) and plain["step"][0]["right"].dtype == torch.int64
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        for schedule in ("1f1b", "zbv"):
            for rank, got in enumerate(world.run(run, schedule)):
                for what in ("step", "grad"):
                    assert same(got[what], plain[what]), (schedule, rank, what, got[what], plain[what])
                # evaluate: the same forward (its aux is the training step's)
                assert same(got["evaluate"], plain["step"]), (schedule, rank, got["evaluate"], plain["step"])


def refused(mesh):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=4, n_head=2, d_model=16)))

    def loss_fn(p, batch):
        logits = apply_fn(p, batch[0])
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten()), {"note": "not a tensor"}

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), microbatches=M, has_aux=True,
                           pipeline=fs.pipeline.Pipeline("1f1b"))  # fmt: skip
    try:
        step(step.init(params), batch())
    except Exception as error:  # noqa: BLE001
        return type(error).__name__, str(error)
    return None


def test_an_aux_that_is_not_tensors_is_refused_on_every_rank():
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        got = world.run(refused)
    assert got[0] is not None and got[0][0] == "StepError" and "aux must hold tensors only" in got[0][1], got
    assert got[1] is not None and got[1][0] in ("StepError", "PeerError"), got
