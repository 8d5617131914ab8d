"""Optimizers that compose: a user optimizer (Lion) written only from `fs.optim`'s public
blocks, `chain`, `clip_by_global_norm` and `global_norm`.

- Lion against a plain single-process transcription, bit for bit, and in `fs.sharded_step`
  (2 gloo ranks, eager and traced) against single-process training on the concatenated batch;
- `chain(clip_by_global_norm(c), adamw(...))` in `fs.sharded_step` against
  `torch.nn.utils.clip_grad_norm_` + `torch.optim.AdamW` on a flat (2 ranks) and a hybrid
  ({"replicate": 2, "fsdp": 2}) mesh, with clipping active;
- `global_norm` of the sharded gradients against torch's total norm, on the same meshes.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import functional_shard as fs
from functional_shard import optim
from functional_shard.models import MLP

PER_RANK_BATCH = 3
STEPS = 4
CLIP = 0.5  # the MLP's gradient norm is ~1-2 on these batches: clipping is active


# ------------------------------------------------------------ Lion, from the public blocks


class LionState(NamedTuple):
    # Updates applied so far: a 0-d int64 CPU tensor.
    count: torch.Tensor
    # Momentum; the structure, shapes and dtypes of params.
    exp_avg: Any


def lion(lr, *, betas=(0.9, 0.99), weight_decay=0.0) -> optim.Optimizer:
    """Lion (Chen et al. 2023): `c = b1 m + (1 - b1) g; p = p (1 - lr wd) - lr sign(c);
    m = b2 m + (1 - b2) g`, written only with `fs.optim`'s public blocks."""
    lr_at = optim.as_schedule(lr)
    beta1, beta2 = betas

    def init(params):
        optim.check_params(params)
        return LionState(torch.zeros((), dtype=torch.int64), optim.zeros_like(params))

    def scalars(state):
        step_lr = lr_at(int(state.count))
        return {"lr": optim.scalar(step_lr), "decay": optim.scalar(1 - step_lr * weight_decay)}

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None):
        def step_leaf(param, grad, exp_avg):
            c = exp_avg * beta1 + grad * (1 - beta1)
            param.mul_(scalars["decay"]).sub_(torch.sign(c) * scalars["lr"])
            exp_avg.mul_(beta2).add_(grad * (1 - beta2))

        new_params, new = optim.apply_per_leaf(step_leaf, grads, params, {"exp_avg": state.exp_avg}, inplace=inplace)
        return new_params, LionState(state.count + 1, new["exp_avg"])

    return optim.make_optimizer(init, scalars, apply)


def lion_reference(params, grads_per_step, lrs, betas, weight_decay):
    """Plain Lion on a list of tensors, Python-float hyperparameters."""
    b1, b2 = betas
    params = [p.clone() for p in params]
    moments = [torch.zeros_like(p) for p in params]
    for lr, grads in zip(lrs, grads_per_step):
        for i, (p, g, m) in enumerate(zip(params, grads, moments)):
            c = m * b1 + g * (1 - b1)
            params[i] = p * (1 - lr * weight_decay) - lr * torch.sign(c)
            moments[i] = m * b2 + g * (1 - b2)
    return params, moments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("inplace", [False, True])
def test_lion_from_public_blocks_matches_plain_reference(dtype, inplace):
    gen = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (17,), (3, 5), (257,)]
    init = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(5)]
    schedule = lambda count: 0.1 / (1 + count)  # noqa: E731
    betas, wd = (0.9, 0.99), 0.1
    want_p, want_m = lion_reference(init, grads, [schedule(i) for i in range(5)], betas, wd)

    opt = lion(schedule, betas=betas, weight_decay=wd)
    params = [t.clone() for t in init]
    state = opt.init(params)
    for g in grads:
        snapshot = [t.clone() for t in params]
        if inplace:  # the update overwrites the donated params
            new_params, state = opt.apply(g, state, params, opt.scalars(state), inplace=True)
            assert all(a.data_ptr() == b.data_ptr() for a, b in zip(new_params, params) if a.numel())
        else:  # update never writes into its inputs
            new_params, state = opt.update(g, state, params)
            assert all(torch.equal(a, b) for a, b in zip(params, snapshot))
        params = new_params
    assert all(torch.equal(a, b) for a, b in zip(params, want_p))
    assert all(torch.equal(a, b) for a, b in zip(state.exp_avg, want_m))
    assert int(state.count) == 5


# -------------------------------------------------------------- chain and transformations


def test_chain_structure_and_errors():
    params = {"w": torch.ones(3)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(0.1))
    assert isinstance(opt, optim.Optimizer)
    state = opt.init(params)
    assert isinstance(state, tuple) and state[0] == optim.EmptyState() and isinstance(state[1], optim.AdamWState)
    sc = opt.scalars(state)
    assert sc[0] == {} and set(sc[1]) == {"lr", "decay", "neg_step_size", "bias_correction2_sqrt"}
    assert all(t.shape == () and t.dtype == torch.float64 for t in optree.tree_leaves(sc))
    assert isinstance(optim.chain(optim.clip_by_global_norm(1.0)), optim.GradientTransformation)
    with pytest.raises(TypeError, match="component 0 is an Optimizer"):
        optim.chain(optim.adamw(0.1), optim.clip_by_global_norm(1.0))
    with pytest.raises(TypeError, match="component 1 is a function"):
        optim.chain(optim.clip_by_global_norm(1.0), lambda g: g)
    with pytest.raises(ValueError, match="at least one"):
        optim.chain()
    with pytest.raises(ValueError, match="state must be a tuple of 2"):
        opt.update({"w": torch.ones(3)}, state[1], params)


def test_every_public_name_is_documented():
    for name in optim.__all__:
        value = getattr(optim, name)
        if inspect.isfunction(value) or inspect.isclass(value):  # type aliases have comments
            assert value.__doc__ and value.__doc__.strip(), name


def test_make_optimizer_wants_the_keyword_arguments():
    def apply(grads, state, params, scalars, *, inplace=False):
        return params, state

    with pytest.raises(TypeError, match=r"must accept the keyword arguments `inplace` and `mesh` \(missing: mesh\)"):
        optim.make_optimizer(lambda p: (), lambda s: {}, apply)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan")])
def test_clip_by_global_norm_refuses_non_positive_max_norm(bad):
    with pytest.raises(ValueError, match=f"max_norm must be positive, got {bad!r}"):
        optim.clip_by_global_norm(bad)


def _torch_clip_adamw(init, grads_per_step, clip, **kw):
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = torch.optim.AdamW(params, **kw)
    norms = []
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        norms.append(torch.nn.utils.clip_grad_norm_(params, clip))
        opt.step()
    return [p.detach() for p in params], norms


def test_chain_clip_adamw_single_process_matches_torch():
    # One process, mesh=None: whole tensors as leaves (torch's layout), clipping active.
    gen = torch.Generator().manual_seed(1)
    shapes = [(), (17,), (3, 5), (257,)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    want, norms = _torch_clip_adamw(init, grads, 2.0, lr=1e-2, weight_decay=0.1)
    opt = optim.chain(optim.clip_by_global_norm(2.0), optim.adamw(1e-2, weight_decay=0.1))
    params = list(init)
    state = opt.init(params)
    for g, norm in zip(grads, norms):
        assert norm > 2.0  # clipping is active
        assert abs(float(optim.global_norm(g, None)) / float(norm) - 1) <= 1e-6
        params, state = opt.update(g, state, params)
    for got, ref in zip(params, want):
        # The clip coefficient may differ from torch's in its last bit (norms summed in another
        # order); Adam's normalisation carries that through a few steps as fp32 rounding.
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_clip_inplace_scales_the_donated_updates_and_only_then():
    params = {"a": torch.zeros(4), "s": torch.zeros((), dtype=torch.bfloat16)}
    updates = {"a": torch.full((4,), 3.0), "s": torch.tensor(4.0, dtype=torch.bfloat16)}
    clip = optim.clip_by_global_norm(1.0)
    out, _ = clip.update(updates, clip.init(params), params)
    assert torch.equal(updates["a"], torch.full((4,), 3.0))  # not mutated
    assert out["s"].dtype == torch.bfloat16 and out["s"].shape == ()
    norm = torch.tensor(float(torch.tensor([3.0] * 4 + [4.0]).norm()))
    assert torch.equal(out["a"], updates["a"] * torch.clamp(1.0 / (norm + 1e-6), max=1.0))
    donated, _ = clip.apply(updates, clip.init(params), params, {}, inplace=True)
    assert donated["a"].data_ptr() == updates["a"].data_ptr() and torch.equal(updates["a"], out["a"])


def test_traced_chain_single_process_replays_like_update():
    # No mesh, hence no collective: make_fx of the chain's apply, replayed every step.
    gen = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(17, generator=gen), "b": torch.randn(5, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) * 3 for k, v in params.items()} for _ in range(4)]
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1, momentum=0.9))
    state = opt.init(params)
    gm = make_fx(lambda g, s, p, c: opt.apply(g, s, p, c), tracing_mode="fake")(grads[0], state, params, opt.scalars(state))
    traced = eager = (params, state)
    for g in grads:
        traced = gm(g, traced[1], traced[0], opt.scalars(traced[1]))
        eager = opt.update(g, eager[1], eager[0])
        for a, b in zip(optree.tree_leaves(traced), optree.tree_leaves(eager)):
            assert torch.equal(a, b)


# ------------------------------------------------- in fs.sharded_step, against one process


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP(13, 16, 5, n_blocks=3)


def _global_batch(world_size: int, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    n = world_size * PER_RANK_BATCH
    return torch.randn(n, 13, generator=g), torch.randint(0, 5, (n,), generator=g)


def _max_relative_errors(exported: dict, reference: dict) -> dict[str, float]:
    return {
        n: float((exported[n] - p).abs().max() / p.abs().max()) for n, p in reference.items()
    }


def train_lion(mesh, trace: bool) -> dict:
    """fs.sharded_step with Lion vs Lion on one process, on the concatenated batch."""
    apply_fn, params = fs.functionalize(_build())

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    make = lambda: lion(lambda count: 1e-2 / (1 + count), weight_decay=0.1)  # noqa: E731
    step = fs.sharded_step(loss_fn, mesh, optimizer=make(), schedule=fs.Schedule(trace=trace))
    state = step.init(params)
    reference = _build()
    ref_params = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_opt = make()
    ref_state = ref_opt.init(ref_params)
    for i in range(STEPS):
        x, y = _global_batch(mesh.world_size, i)
        rows = slice(mesh.rank * PER_RANK_BATCH, (mesh.rank + 1) * PER_RANK_BATCH)
        state, _ = step(state, (x[rows], y[rows]))
        grads = torch.func.grad(lambda p: F.cross_entropy(torch.func.functional_call(reference, p, (x,)), y))(ref_params)
        ref_params, ref_state = ref_opt.update(grads, ref_state, ref_params)
    return _max_relative_errors(fs.export(state), ref_params)


def train_clip_adamw(mesh, trace: bool) -> dict:
    """fs.sharded_step with chain(clip_by_global_norm, adamw) vs clip_grad_norm_ + AdamW."""
    apply_fn, params = fs.functionalize(_build())

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    config = dict(lr=1e-2, weight_decay=0.1)
    optimizer = optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(**config))
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=fs.Schedule(trace=trace))
    state = step.init(params)
    reference = _build()
    ref_opt = torch.optim.AdamW(reference.parameters(), **config)
    norms = []  # (fs global_norm, torch total norm) per step
    for i in range(STEPS):
        x, y = _global_batch(mesh.world_size, i)
        rows = slice(mesh.rank * PER_RANK_BATCH, (mesh.rank + 1) * PER_RANK_BATCH)
        grads, _ = step.grad(state, (x[rows], y[rows]))
        fs_norm = optim.global_norm(list(grads.shards), mesh)
        state, _ = step(state, (x[rows], y[rows]))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        norms.append((float(fs_norm), float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP))))
        ref_opt.step()
    reference_params = {n: p.detach() for n, p in reference.named_parameters()}
    return {"param_errors": _max_relative_errors(fs.export(state), reference_params), "norms": norms}


@pytest.fixture(scope="module")
def hybrid_world():
    world = fs.testing.LocalWorld(4, axes={"replicate": 2, "fsdp": 2}, collective_timeout=60.0, call_timeout=300.0)
    yield world
    world.close()


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_lion_sharded_step_matches_single_process(local_world, trace):
    for errors in local_world(2).run(train_lion, trace):
        assert max(errors.values()) <= 1e-6, errors


def _check_clip_adamw(reports):
    for report in reports:
        assert max(report["param_errors"].values()) <= 1e-5, report
        for fs_norm, torch_norm in report["norms"]:
            assert torch_norm > CLIP  # clipping is active at every step
            assert abs(fs_norm / torch_norm - 1) <= 1e-6, report["norms"]


def test_clip_adamw_sharded_step_matches_torch_flat(local_world):
    _check_clip_adamw(local_world(2).run(train_clip_adamw, False))


def test_clip_adamw_sharded_step_matches_torch_hybrid(hybrid_world):
    _check_clip_adamw(hybrid_world.run(train_clip_adamw, False))


def test_clip_adamw_traced_sharded_step_matches_torch_flat(local_world):
    _check_clip_adamw(local_world(2).run(train_clip_adamw, True))


def test_clip_adamw_traced_sharded_step_matches_torch_hybrid(hybrid_world):
    _check_clip_adamw(hybrid_world.run(train_clip_adamw, True))
