"""A pipelined step with `fs.Schedule(compile=True)`: each stage program `torch.compile`d (inductor).

On real gloo processes, GPT at `{"pp": 2}`, 4 micro-batches, 5 AdamW steps, 1F1B (and, `-m slow`,
interleaved 1F1B: 4 stages); ~50 s on a cold inductor cache, most of it compiling:

- the first step's gradients within 1e-5 relative, tensor by tensor, of the uncompiled pipelined
  step's (which equal single-process training's: tests/test_pipeline_step.py); the losses of
  every step within 1e-5 relative; the parameters after 5 steps within 1e-3 of the distance
  training moved them (inductor's kernels round differently: not the same bits);
- whole-stage remat under compile (a stage's backward calls the compiled forward again) gives
  the compiled step's bits exactly: the same kernels on the same inputs (`-m slow`: its forward
  without autograd is one more compile per stage);
- compile with a schedule that splits backwards into I and W, and compile with the eager oracle
  (`trace=False`), are refused when the step is made: tests/test_pipeline_errors.py.
"""

from __future__ import annotations

import pytest
import torch

import functional_shard as fs
from test_pipeline_checkpoint import held
from test_pipeline_step import LR, STEPS, build, distance, global_batch, make_loss, mesh_of, part

AXES = {"pp": 2}
M = 4
VARIANTS = {
    "uncompiled": fs.Schedule(),
    "compiled": fs.Schedule(compile=True),
    "compiled_remat": fs.Schedule(compile=True, remat=True),
}


def train(world_mesh, schedule_name: str, variants: tuple[str, ...]) -> dict:
    torch.set_num_threads(1)
    mesh = mesh_of(world_mesh, AXES)
    apply_fn, params = fs.functionalize(build("gpt", 4))
    batches = [part(global_batch("gpt", i), 0, 1) for i in range(STEPS)]
    out = {}
    for name in variants:
        schedule = VARIANTS[name]
        step = fs.sharded_step(make_loss("gpt", apply_fn), mesh, optimizer=fs.optim.adamw(LR), microbatches=M,
                               pipeline=fs.pipeline.Pipeline(schedule_name), schedule=schedule)  # fmt: skip
        state = step.init(params)
        grads = fs.gather(step.grad(state, batches[0])[0], full=True)
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        out[name] = {"grads": {k: v.clone() for k, v in grads.trainable.items()}, "losses": losses, "held": held(state)}
    return out


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("interleaved_1f1b", marks=pytest.mark.slow)])
def test_compiled_stages_train_like_the_uncompiled_pipeline(local_world, schedule):
    check(local_world(2).run(train, schedule, ("uncompiled", "compiled")), schedule)


@pytest.mark.slow
def test_remat_under_compile_gives_the_compiled_bits(local_world):
    check(local_world(2).run(train, "1f1b", tuple(VARIANTS)), "1f1b")


def check(results: list[dict], schedule: str) -> None:
    start = {f"params/{k}": p.detach() for k, p in build("gpt", 4).named_parameters()}
    for rank, got in enumerate(results):
        plain, compiled = got["uncompiled"], got["compiled"]
        errors = {k: float((compiled["grads"][k] - g).norm() / g.norm()) for k, g in plain["grads"].items()}
        assert max(errors.values()) <= 1e-5, (rank, errors)
        assert compiled["losses"] == pytest.approx(plain["losses"], rel=1e-5), (rank, compiled["losses"], plain["losses"])
        params = [k for k in plain["held"] if k.startswith("params/")]
        assert params, rank
        apart = distance({k: compiled["held"][k] for k in params}, {k: plain["held"][k] for k in params})
        moved = distance({k: plain["held"][k] for k in params}, {k: start[k] for k in params})
        print(schedule, rank, {"grad_error": max(errors.values()), "apart": apart, "moved": moved})
        assert apart <= 1e-3 * moved, (rank, apart, moved)
        if "compiled_remat" not in got:
            continue
        # remat recomputes each stage's forward with the same compiled kernels: the same bits
        remat = got["compiled_remat"]
        assert remat["losses"] == compiled["losses"], rank
        differ = [k for k in compiled["held"] if not torch.equal(compiled["held"][k], remat["held"][k])]
        assert not differ, (rank, differ[:5])
