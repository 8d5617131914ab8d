"""The laws of the sharding transforms, property-tested on generated pytrees.

    gather(shard(t)) == t                                   bit-exact, any shapes and dtypes
    reduce_scatter(t) == shard(all_reduce(t))               bit-exact (integer-valued data)
    sum_r <gather(s), y_r> == sum_r <s_r, reduce_scatter(y)_r>    adjointness

on real gloo process groups (world sizes 1-4) and on simulated thread meshes (1-8 ranks).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_shard as fs

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
# Awkward dimension sizes: empty, one, primes, and sizes around powers of two.
DIMS = st.sampled_from([0, 1, 2, 3, 5, 7, 16, 17])


@st.composite
def leaves(draw, dtypes=DTYPES):
    """A tensor of random shape (0-d, empty, primes, up to 257 elements) with small integer
    values, so that every sum in these tests is exact in every dtype."""
    shape = draw(st.one_of(st.just(()), st.just((257,)), st.lists(DIMS, min_size=1, max_size=3).map(tuple)))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    values = torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed))
    return values > 0 if dtype == torch.bool else values.to(dtype)


def pytrees(dtypes=DTYPES):
    """Nested dicts, lists and tuples of tensors, as params pytrees come."""
    return st.recursive(
        leaves(dtypes),
        lambda children: st.one_of(
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
        ),
        max_leaves=6,
    )


def unit_policies():
    return st.sampled_from(["blocks", "one", "per_leaf"])


def policy(name: str):
    return {"blocks": None, "one": lambda path: "all", "per_leaf": lambda path: path}[name]


def rank_variant(tree, rank: int):
    """What rank `rank` holds in the reduction laws: different values on every rank."""
    return fs.tree_map(lambda t: t if t.dtype == torch.bool else t * (rank + 1) - rank, tree)


def tree_equal(a, b) -> bool:
    la, sa = fs.tree_flatten(a)
    lb, sb = fs.tree_flatten(b)
    return sa == sb and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(la, lb))


# --- what each rank runs (module level: pickled by reference into the rank processes) --------


def roundtrip(mesh, tree, unit_policy):
    back = fs.gather(fs.shard(tree, mesh, units=policy(unit_policy)))
    return tree_equal(back, tree)


def reduce_scatter_law(mesh, tree, unit_policy):
    mine = rank_variant(tree, mesh.rank)
    units = policy(unit_policy)
    left = fs.reduce_scatter(mine, mesh, units=units)
    right = fs.shard(fs.all_reduce(mine, mesh), mesh, units=units)
    return left.layout == right.layout and all(torch.equal(a, b) for a, b in zip(left.shards, right.shards))


def adjoint_products(mesh, tree, unit_policy):
    """This rank's <gather(s), y> and <s, reduce_scatter(y)>, in float64."""
    units = policy(unit_policy)
    s = fs.shard(tree, mesh, units=units)
    y = rank_variant(tree, mesh.rank)
    full = fs.tree_leaves(fs.gather(s))
    left = sum(float((a.double() * b.double()).sum()) for a, b in zip(full, fs.tree_leaves(y)))
    scattered = fs.reduce_scatter(y, mesh, units=units)
    right = sum(float((a.double() * b.double()).sum()) for a, b in zip(s.shards, scattered.shards))
    return left, right


def gradient_is_reduce_scatter(mesh, tree):
    """grad/vjp of loss ∘ gather (through torch.func, and through make_fx on real meshes) ==
    reduce_scatter of the full gradient of every rank's loss. (make_fx patches module globals
    while it traces, so thread-ranks cannot trace at once.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    weights = rank_variant(tree, mesh.rank)

    def loss(full):
        return sum((leaf * w).sum() for leaf, w in zip(fs.tree_leaves(full), fs.tree_leaves(weights)))

    s = fs.shard(tree, mesh)
    grads = torch.func.grad(lambda s: loss(fs.gather(s)))(s)
    expected = fs.reduce_scatter(weights, mesh)  # d loss / d full == weights, summed over ranks
    _, vjp_fn = torch.func.vjp(fs.gather, s)
    (vjp_grads,) = vjp_fn(weights)
    if isinstance(mesh, fs.Mesh):
        traced = make_fx(torch.func.grad(lambda shards: loss(fs.gather(s.replace(shards=shards)))))(s.shards)
        traced_grads = traced(s.shards)
        ops = {str(n.target) for n in traced.graph.nodes}
    else:
        traced_grads = expected.shards
        ops = {"_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default"}
    return (
        all(torch.equal(a, b) for a, b in zip(grads.shards, expected.shards))
        and all(torch.equal(a, b) for a, b in zip(vjp_grads.shards, expected.shards))
        and all(torch.equal(a, b) for a, b in zip(traced_grads, expected.shards))
        and "_c10d_functional.all_gather_into_tensor.default" in ops
        # gloo reduce-scatters with an all-to-all and a local sum (Mesh.reduce_scatter_flat)
        and bool(ops & {"_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default"})
    )


# --- real process groups ------------------------------------------------------------------

HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@settings(max_examples=25, deadline=None, suppress_health_check=HEALTH)
@given(tree=pytrees(), unit_policy=unit_policies())
def test_gather_shard_roundtrip_gloo(local_world, world_size, tree, unit_policy):
    assert all(local_world(world_size).run(roundtrip, tree, unit_policy))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@settings(max_examples=15, deadline=None, suppress_health_check=HEALTH)
@given(tree=pytrees([d for d in DTYPES if d != torch.bool]), unit_policy=unit_policies())
def test_reduce_scatter_is_shard_of_all_reduce_gloo(local_world, world_size, tree, unit_policy):
    assert all(local_world(world_size).run(reduce_scatter_law, tree, unit_policy))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@settings(max_examples=15, deadline=None, suppress_health_check=HEALTH)
@given(tree=pytrees(FLOAT_DTYPES), unit_policy=unit_policies())
def test_gather_and_reduce_scatter_are_adjoint_gloo(local_world, world_size, tree, unit_policy):
    products = local_world(world_size).run(adjoint_products, tree, unit_policy)
    left, right = sum(p[0] for p in products), sum(p[1] for p in products)
    assert left == right  # integer-valued data: every product and sum is exact


@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=8, deadline=None, suppress_health_check=HEALTH)
@given(tree=pytrees([torch.float32, torch.float64]))
def test_gradient_of_gather_is_reduce_scatter_gloo(local_world, world_size, tree):
    assert all(local_world(world_size).run(gradient_is_reduce_scatter, tree))


# --- simulated meshes up to 8 ranks --------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 8), tree=pytrees(), unit_policy=unit_policies())
def test_gather_shard_roundtrip_simulated(world_size, tree, unit_policy):
    assert all(fs.testing.SimulatedWorld(world_size).run(roundtrip, tree, unit_policy))


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 8), tree=pytrees([d for d in DTYPES if d != torch.bool]), unit_policy=unit_policies())
def test_reduce_scatter_is_shard_of_all_reduce_simulated(world_size, tree, unit_policy):
    assert all(fs.testing.SimulatedWorld(world_size).run(reduce_scatter_law, tree, unit_policy))


@settings(max_examples=40, deadline=None)
@given(world_size=st.integers(1, 8), tree=pytrees(FLOAT_DTYPES), unit_policy=unit_policies())
def test_gather_and_reduce_scatter_are_adjoint_simulated(world_size, tree, unit_policy):
    products = fs.testing.SimulatedWorld(world_size).run(adjoint_products, tree, unit_policy)
    assert sum(p[0] for p in products) == sum(p[1] for p in products)


@settings(max_examples=20, deadline=None)
@given(world_size=st.integers(1, 8), tree=pytrees([torch.float32, torch.float64]))
def test_gradient_of_gather_is_reduce_scatter_simulated(world_size, tree):
    assert all(fs.testing.SimulatedWorld(world_size).run(gradient_is_reduce_scatter, tree))


@settings(max_examples=30, deadline=None)
@given(world_size=st.integers(1, 8), tree=pytrees())
def test_each_rank_keeps_one_padded_slice(world_size, tree):
    """Shards are equal-sized slices of the padded buffer, at least one element each."""
    shards = fs.testing.SimulatedWorld(world_size).run(lambda mesh, t: fs.shard(t, mesh), tree)
    for spec_index, spec in enumerate(shards[0].layout.buffers):
        assert spec.shard_numel == max(1, math.ceil(spec.numel / world_size))
        assert all(s.shards[spec_index].shape == (spec.shard_numel,) for s in shards)
        padding = torch.cat([s.shards[spec_index] for s in shards])[spec.numel :]
        assert not padding.any()


def test_hybrid_mesh_gather_and_gradient():
    """On a {"replicate": 2, "fsdp": 2} mesh, shards are cut along fsdp only, and the gradient of
    a replicated parameter is summed over every rank."""

    def body(mesh):
        tree = {"w": torch.arange(7, dtype=torch.float64)}
        s = fs.shard(tree, mesh)
        g = torch.func.grad(lambda s: (fs.gather(s)["w"] * (mesh.rank + 1)).sum())(s)
        return s.shards[0], fs.gather(g)["w"], tree_equal(fs.gather(s), tree)

    out = fs.testing.SimulatedWorld(4, axes={"replicate": 2, "fsdp": 2}).run(body)
    assert all(ok for _, _, ok in out)
    assert torch.equal(out[0][0], out[2][0]) and not torch.equal(out[0][0], out[1][0])
    assert all(torch.equal(g, torch.full((7,), 10.0, dtype=torch.float64)) for _, g, _ in out)
