"""Reliability of the step's numerics and of what ranks agree on (issue 25, items 6-9), on real gloo processes.

- a NaN in one rank's batch: the step is skipped on every rank (parameters, module buffers and
  optimizer state unchanged, `metrics["skipped"]`, a warning naming the rank whose loss was not
  finite), fp32 and bf16, traced and eager, traced == eager bit for bit; `nonfinite="raise"` raises
  on every rank with the state untouched, `nonfinite="apply"` applies it (the old behaviour);
- fp16 loss scaling: the scale stops at `min_scale` instead of underflowing to 0, and
  `max_consecutive_skips` skipped steps in a row raise a clear error;
- a different learning rate or optimizer on one rank: refused before any collective of the
  step, naming the rank and the value, state untouched;
- traced on one rank, eager on the other: refused before any collective, naming ranks and modes.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, MLP, GPTConfig

BATCH = 4


def _mlp():
    torch.manual_seed(0)
    return fs.functionalize(MLP(7, 16, 3, n_blocks=2))


def _batch(step: int, rank: int, nan: bool = False):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(BATCH, 7, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    if nan:
        x[1, 3] = float("nan")
    return x, y


def _step(mesh, apply_fn, *, trace=True, precision=None, optimizer=None, **kwargs):
    return fs.sharded_step(
        lambda p, b: F.cross_entropy(apply_fn(p, b[0]).float(), b[1]),
        mesh,
        optimizer=optimizer or fs.optim.adamw(lr=1e-2),
        schedule=fs.Schedule(trace=trace),
        precision=precision,
        **kwargs,
    )


def _same(a, b) -> bool:
    a, b = fs.tree_leaves(a), fs.tree_leaves(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --- 6. a non-finite gradient is skipped and reported -----------------------------------------------


def nan_in_one_rank(mesh, dtype):
    """Three steps; rank 1's batch of the second holds a NaN. Traced and eager."""
    precision = fs.Precision(param_dtype=dtype) if dtype != torch.float32 else None
    out = {}
    for trace in (True, False):
        apply_fn, params = _mlp()
        step = _step(mesh, apply_fn, trace=trace, precision=precision)
        state = step.init(params)
        state, m0 = step(state, _batch(0, mesh.rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            after, m1 = step(state, _batch(1, mesh.rank, nan=mesh.rank == 1))
        last, m2 = step(after, _batch(2, mesh.rank))
        out[trace] = {
            "skipped": [bool(m0["skipped"]), bool(m1["skipped"]), bool(m2["skipped"])],
            "unchanged": _same((state.params, state.opt_state), (after.params, after.opt_state)),
            "steps": (after.step, last.step),
            "trained": not _same(after.params, last.params) and bool(torch.isfinite(m2["grad_norm"])),
            "finite": all(bool(torch.isfinite(t).all()) for t in fs.tree_leaves(last.params)),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            "leaves": fs.tree_leaves((last.params, last.opt_state)),
        }
    traced, eager = out[True], out[False]
    same = all(torch.equal(a, b) for a, b in zip(traced.pop("leaves"), eager.pop("leaves")))
    return traced, eager, same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_nan_in_one_ranks_batch_skips_the_step_on_every_rank(local_world, dtype):
    for rank, (traced, eager, same) in enumerate(local_world(2).run(nan_in_one_rank, dtype)):
        assert same, "traced != eager"
        for run in (traced, eager):
            assert run["skipped"] == [False, True, False], run
            assert run["unchanged"] and run["trained"] and run["finite"], run
            assert run["steps"] == (2, 3)  # a skipped step counts as a step (state.step), not as an update
            if rank == 1:  # the rank whose batch held the NaN says so
                assert any("rank 1's own loss is nan" in w for w in run["warnings"]), run["warnings"]
            if rank == 0:
                assert any("skipped the update of step 1" in w for w in run["warnings"]), run["warnings"]
            if rank != 1:
                assert not any("'s own loss is" in w for w in run["warnings"]), run["warnings"]


def nonfinite_policies(mesh):
    apply_fn, params = _mlp()
    out = {}
    step = _step(mesh, apply_fn, nonfinite="raise")
    state = step.init(params)
    before = [t.clone() for t in fs.tree_leaves(state)]
    try:
        step(state, _batch(0, mesh.rank, nan=mesh.rank == 1))
        out["raise"] = "no error"
    except fs.NonFiniteError as error:
        out["raise"] = str(error)
    out["raise_untouched"] = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))
    state, _ = step(state, _batch(1, mesh.rank))  # the ranks are still in step: train on
    step = _step(mesh, apply_fn, nonfinite=fs.NonFinite.APPLY)
    poisoned, metrics = step(step.init(params), _batch(0, mesh.rank, nan=mesh.rank == 1))
    out["apply_nan"] = all(bool(torch.isnan(t).any()) for t in fs.tree_leaves(poisoned.params))
    out["apply_skipped"] = bool(metrics["skipped"])
    # donate=True cannot keep the old state: its default is "raise", and "skip" is refused.
    out["donate_default"] = _step(mesh, apply_fn, donate=True).nonfinite
    with pytest.raises(fs.StepError, match="donate=True.*nonfinite='raise'"):
        _step(mesh, apply_fn, donate=True, nonfinite="skip")
    return out


def test_a_nonfinite_gradient_raises_or_is_applied_on_request(local_world):
    for out in local_world(2).run(nonfinite_policies):
        assert "step 0 is not finite (grad_norm nan)" in out["raise"], out["raise"]
        assert "nonfinite='raise'" in out["raise"] and out["raise_untouched"]
        assert out["apply_nan"] and not out["apply_skipped"], out
        assert out["donate_default"] is fs.NonFinite.RAISE


def test_bad_nonfinite_policies_are_named():
    def body(mesh):
        apply_fn, _ = _mlp()
        with pytest.raises(ValueError, match="nonfinite must be 'skip', 'raise' or 'apply'"):
            _step(mesh, apply_fn, trace=False, nonfinite="ignore")
        fp16 = fs.Precision(param_dtype=torch.float16, loss_scale=fs.LossScale())
        with pytest.raises(fs.StepError, match="loss scaling skips"):
            _step(mesh, apply_fn, trace=False, precision=fp16, nonfinite="apply")

    fs.testing.SimulatedWorld(1).run(body)


# --- 7. the fp16 loss scale floors, and persistent skips raise -----------------------------------------


def test_loss_scale_stops_at_its_floor():
    scale = fs.LossScale(init_scale=8.0, min_scale=2.0, growth_interval=3)
    state, overflow, finite = scale.init(), torch.tensor(False), torch.tensor(True)
    scales, streaks = [], []
    for _ in range(5):
        state = scale.next(state, overflow)
        scales.append(float(state.scale))
        streaks.append(int(state.good_steps))
    assert scales == [4.0, 2.0, 2.0, 2.0, 2.0]  # torch's GradScaler: 4, 2, 1, 0.5, 0.25, ... 0
    assert streaks == [-1, -2, -3, -4, -5]  # skipped steps in a row, counted negative
    for _ in range(3):
        state = scale.next(state, finite)
    assert float(state.scale) == 4.0 and int(state.good_steps) == 0  # grew after 3 finite steps
    with pytest.raises(ValueError, match="min_scale must be > 0 and <= init_scale"):
        fs.LossScale(init_scale=1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="max_consecutive_skips must be an int >= 1 or None"):
        fs.LossScale(max_consecutive_skips=0)


def fp16_always_overflows(mesh, trace: bool):
    apply_fn, params = _mlp()
    loss_scale = fs.LossScale(init_scale=2.0**4, min_scale=1.0, max_consecutive_skips=8)
    precision = fs.Precision(param_dtype=torch.float16, loss_scale=loss_scale)
    step = fs.sharded_step(
        lambda p, b: F.cross_entropy(apply_fn(p, b[0]).float(), b[1]) * float("inf"),  # never finite
        mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=fs.Schedule(trace=trace), precision=precision,
    )
    state = step.init(params)
    before = [t.clone() for t in fs.tree_leaves(state.params)]
    scales = []
    try:
        for i in range(20):
            previous = state
            state, metrics = step(state, _batch(i, mesh.rank))
            assert bool(metrics["skipped"])
            scales.append(float(state.loss_scale.scale))
        message = "no error"
    except fs.NonFiniteError as error:
        message = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(previous.params)))
    return scales, message, unchanged, previous.step


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
def test_fp16_loss_scale_floors_then_raises_after_consecutive_skips(local_world, trace):
    for scales, message, unchanged, steps in local_world(2).run(fp16_always_overflows, trace):
        assert scales == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0], scales  # the 8th skip raises
        assert steps == 7 and unchanged
        assert "skipped 8 steps in a row" in message and "min_scale=1.0" in message, message
        assert "max_consecutive_skips" in message


# --- 8. ranks agree on the optimizer ---------------------------------------------------------------


def _timed_refusal(step, state, batch):
    before = [t.clone() for t in fs.tree_leaves(state)]
    start = time.monotonic()
    try:
        step(state, batch)
        message = "no error"
    except fs.MeshError as error:
        message = str(error)
    elapsed = time.monotonic() - start
    return message, elapsed, all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))


def optimizer_per_rank(mesh, trace: bool, what: str):
    apply_fn, params = _mlp()
    if what == "lr":
        optimizer = fs.optim.adamw(lr=1.0 if mesh.rank == 1 else 1e-3)
    else:
        optimizer = fs.optim.sgd(lr=1e-3) if mesh.rank == 1 else fs.optim.adamw(lr=1e-3)
    step = _step(mesh, apply_fn, trace=trace, optimizer=optimizer)
    state = step.init(params)
    return _timed_refusal(step, state, _batch(0, mesh.rank))


@pytest.mark.parametrize("trace", [True, False], ids=["traced", "eager"])
def test_a_different_learning_rate_on_one_rank_is_refused(local_world, trace):
    for message, elapsed, untouched in local_world(2).run(optimizer_per_rank, trace, "lr"):
        assert "ranks disagree on what a training step is" in message, message
        assert "rank 0: optimizer scalar lr = 0.001" in message, message
        assert "rank 1: optimizer scalar lr = 1.0" in message, message
        assert elapsed < 10 and untouched


def test_a_different_optimizer_on_one_rank_is_refused(local_world):
    for message, elapsed, untouched in local_world(2).run(optimizer_per_rank, True, "optimizer"):
        assert "ranks disagree on what a training step is" in message, message
        assert "rank 0: optimizer fs.optim.adamw;" in message, message
        assert "rank 1: optimizer fs.optim.sgd." in message, message
        assert elapsed < 10 and untouched


# --- 9. ranks agree on the mode ---------------------------------------------------------------------


def mode_per_rank(mesh, program: str):
    apply_fn, params = _mlp()
    step = _step(mesh, apply_fn, trace=mesh.rank == 0)
    state = step.init(params)
    if program == "evaluate":
        state = state  # evaluate agrees on the mode too
        before = [t.clone() for t in fs.tree_leaves(state)]
        start = time.monotonic()
        try:
            step.evaluate(state, _batch(0, mesh.rank))
            message = "no error"
        except fs.MeshError as error:
            message = str(error)
        return message, time.monotonic() - start, all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))
    return _timed_refusal(step, state, _batch(0, mesh.rank))


@pytest.mark.parametrize("program", ["step", "evaluate"])
def test_traced_on_one_rank_and_eager_on_another_is_refused(local_world, program):
    for message, elapsed, untouched in local_world(2).run(mode_per_rank, program):
        assert "rank 0: traced (fs.Schedule(trace=True)); rank 1: eager (fs.Schedule(trace=False))" in message, message
        assert elapsed < 10 and untouched


# --- a non-finite loss whose gradient is finite; a micro-batch that weighs nothing -------------


def _tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16))


def loss_without_gradient(mesh, policy):
    """A loss of -inf on rank 1 from a term no parameter reaches: its gradient is finite."""
    apply_fn, params = fs.functionalize(_tiny_gpt())

    def loss_fn(p, b):
        x, y, flag = b
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten()) + torch.log(1 - flag.max())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(0.1), nonfinite=policy, schedule=fs.Schedule(trace=False))
    state = step.init(params)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(mesh.rank))
    flag = torch.zeros(4)
    flag[0] = float(mesh.rank == 1)
    before = [t.clone() for t in state.params.shards]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            state, metrics = step(state, (x, torch.roll(x, -1, 1), flag))
        except fs.NonFiniteError as error:
            return str(error)
    return bool(metrics["skipped"]), all(torch.equal(a, b) for a, b in zip(before, state.params.shards))


def test_a_nonfinite_loss_with_a_finite_gradient_is_not_applied(local_world):
    """The verdict reads the mean loss too: before, such a step was applied on every rank, under
    'skip' and 'raise' alike, with no warning."""
    assert local_world(2).run(loss_without_gradient, "skip") == [(True, True), (True, True)]
    for message in local_world(2).run(loss_without_gradient, "raise"):
        assert "step 0 is not finite (its gradient is finite, but the loss is -inf)" in message, message


def weighted_with_an_empty_microbatch(mesh):
    apply_fn, params = fs.functionalize(_tiny_gpt())

    def loss_fn(p, b):
        x, y = b
        return fs.WeightedLoss(F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten()), (y != -100).sum())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(0.1), microbatches=2, schedule=fs.Schedule(trace=False))
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    y[:2] = -100  # micro-batch 0: no tokens (its mean cross-entropy is 0/0)
    _, metrics = step(step.init(params), (x, y))
    canonical = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(0.1), canonical_chunks=2, schedule=fs.Schedule(trace=False))
    evaluated = canonical.evaluate(canonical.init(params), (x, y))  # chunk 0: no tokens
    model = _tiny_gpt()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return float(metrics["loss"]), float(metrics["grad_norm"]), bool(metrics["skipped"]), float(evaluated["loss"]), float(loss.detach()), float(norm)


def test_a_microbatch_without_tokens_weighs_nothing_in_the_reported_loss():
    """WeightedLoss's mean form: 0 x NaN made metrics['loss'] NaN; the gradient was right. The
    same in a layout-invariant step's evaluate, whose chunk of weight 0 made its loss NaN."""
    (loss, norm, skipped, evaluated, expected_loss, expected_norm), = fs.testing.SimulatedWorld(1).run(weighted_with_an_empty_microbatch)
    assert not skipped and abs(loss - expected_loss) < 1e-5 and abs(norm / expected_norm - 1) < 1e-5, (loss, expected_loss, norm)
    assert abs(evaluated - expected_loss) < 1e-5, (evaluated, expected_loss)
