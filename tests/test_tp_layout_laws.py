"""Laws of the N-D layout: tensor-parallel placements first, FSDP's flat buffers of the pieces.

With hypothesis, on simulated meshes of up to 8 ranks (`{"tp": t}`, `{"fsdp": f, "tp": t}`,
`{"replicate": r, "fsdp": f, "tp": t}`), for trees with awkward leaves (odd sizes, 0-d, empty,
sizes no fsdp degree divides, every role and several dtypes), fused blocks (`chunks`) and
granules (whole heads):

- `fs.gather(fs.shard(tree, mesh, placements=rules), full=True) == tree`, bit for bit, on every rank;
- `fs.gather(fs.shard(...))` is exactly `split_tensor` of each leaf at the rank's tp coordinate
  (the TP-local pieces), whole leaves whole;
- a split the axis does not divide evenly (or a split of a 0-d leaf) is refused by `fs.shard`
  with a `PlacementError` naming the leaf, its shape, the dimension and the axis, on every rank,
  with no collective and the tree untouched.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard._tree import ModuleParams


@st.composite
def mesh_axes(draw, limit: int = 8) -> dict[str, int]:
    """`{"tp": t}`, `{"fsdp": f, "tp": t}` or `{"replicate": r, "fsdp": f, "tp": t}`, f·t·r <= 8."""
    form = draw(st.sampled_from(["fsdp, tp", "replicate, fsdp, tp", "tp"]))
    t = draw(st.sampled_from([2, 1, 3, 4, 8]))
    f = draw(st.sampled_from([s for s in (2, 1, 3, 4, 8) if s * t <= limit])) if form != "tp" else 1
    r = draw(st.sampled_from([s for s in (2, 1, 3, 4) if s * f * t <= limit])) if form.startswith("replicate") else 1
    if form == "tp":
        return {"tp": t}
    if form == "fsdp, tp":
        return {"fsdp": f, "tp": t}
    return {"replicate": r, "fsdp": f, "tp": t}


FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OTHERS = [torch.int64, torch.int32, torch.uint8, torch.bool]
ODD = [1, 3, 5, 7, 13]


def world_size(axes: dict[str, int]) -> int:
    n = 1
    for s in axes.values():
        n *= s
    return n


def values(shape, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, 100, shape, generator=generator).to(dtype)


def exact(path: str):
    return re.compile("^" + re.escape(path) + "$")


@st.composite
def leaf_specs(draw, tp_size: int):
    """(role, dtype, shape, placement or None) of one leaf."""
    role = draw(st.sampled_from(["trainable", "trainable", "frozen", "buffer"]))
    dtype = draw(st.sampled_from(FLOATS if role == "trainable" else FLOATS + OTHERS))
    kind = draw(st.sampled_from(["split", "split", "whole", "scalar", "empty"] if role != "buffer" else ["whole", "scalar", "empty"]))
    if kind == "scalar":
        return role, dtype, (), None
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from(ODD)) for _ in range(ndim)]
    if kind == "empty":
        shape[draw(st.integers(0, ndim - 1))] = 0
    if kind != "split":
        return role, dtype, tuple(shape), None
    dim = draw(st.integers(-ndim, ndim - 1))
    chunks = draw(st.sampled_from([1, 1, 2, 3]))
    granule = draw(st.sampled_from([1, 1, 2, 3]))
    shape[dim] = draw(st.sampled_from([1, 2, 0, 1, 3])) * chunks * granule * tp_size
    return role, dtype, tuple(shape), tp.Split(dim, "tp", chunks, granule)


@st.composite
def layout_cases(draw):
    """A mesh, a `ModuleParams` tree of awkward leaves (blocks and leaves around them), its
    placement rules and the placement of every split leaf (path -> Split)."""
    axes = draw(mesh_axes())
    count = draw(st.integers(1, 7))
    names = draw(st.lists(st.sampled_from(
        ["emb", "pos", "blocks.0.qkv", "blocks.0.proj", "blocks.0.norm", "blocks.1.qkv", "blocks.1.fc",
         "blocks.1.step", "norm", "head"]), min_size=count, max_size=count, unique=True))  # fmt: skip
    seed = draw(st.integers(0, 2**16))
    roles: dict[str, dict] = {"trainable": {}, "frozen": {}, "buffer": {}}
    splits, rules = {}, []
    for i, name in enumerate(names):
        role, dtype, shape, split = draw(leaf_specs(axes["tp"]))
        path = f"{name}.weight"
        roles[role][path] = values(shape, dtype, seed + i)
        if split is not None:
            splits[path] = split
            rules.append(tp.rule(exact(path), split))
        elif draw(st.booleans()):
            rules.append(tp.rule(exact(path), tp.Replicated()))
    tree = ModuleParams(roles["trainable"], roles["frozen"], roles["buffer"])
    return axes, tree, rules, splits


def round_trip(mesh, tree, rules, splits):
    """On this rank: (`gather(full=True)` is the tree, `gather` is each leaf's `split_tensor`)."""
    sharded = fs.shard(tree, mesh, placements=rules)
    full = fs.gather(sharded, full=True)
    local = fs.gather(sharded)
    paths, leaves = fs.tree_paths(tree), fs.tree_leaves(tree)
    assert fs.tree_paths(full) == paths and fs.tree_paths(local) == paths
    same = all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(fs.tree_leaves(full), leaves)
    )
    index, size = mesh.coordinates["tp"], mesh.shape["tp"]
    pieces = True
    for path, leaf, piece in zip(paths, leaves, fs.tree_leaves(local)):
        expected = tp.split_tensor(leaf, splits[path], index, size) if path in splits else leaf
        pieces &= piece.dtype == expected.dtype and piece.shape == expected.shape and torch.equal(piece, expected)
    return same, pieces


HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]


def check_round_trip(case):
    axes, tree, rules, splits = case
    results = fs.testing.SimulatedWorld(world_size(axes), axes=axes).run(round_trip, tree, rules, splits)
    assert all(same for same, _ in results), (axes, tree)
    assert all(pieces for _, pieces in results), (axes, tree)


@settings(max_examples=40, deadline=None, suppress_health_check=HEALTH)
@given(case=layout_cases())
def test_full_gather_of_shard_is_identity_and_gather_is_the_tp_pieces(case):
    check_round_trip(case)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=HEALTH)
@given(case=layout_cases())
def test_full_gather_of_shard_is_identity_and_gather_is_the_tp_pieces_sweep(case):
    check_round_trip(case)


def test_a_fused_qkv_of_heads_round_trips_at_every_mesh_of_8():
    """q|k|v blocks of 4 heads of 3, split whole heads per block; a bias no fsdp degree divides."""
    qkv = values((3 * 4 * 3, 5), torch.float32, 0)
    tree = ModuleParams({"blocks.0.qkv.weight": qkv, "blocks.0.qkv.bias": values((7,), torch.float32, 1)})
    split = tp.Split(0, "tp", chunks=3, granule=3)
    for axes in ({"fsdp": 2, "tp": 4}, {"replicate": 2, "fsdp": 2, "tp": 2}, {"tp": 2, "fsdp": 3}):
        check_round_trip((axes, tree, [tp.rule("*.qkv.weight", split)], {"blocks.0.qkv.weight": split}))
    # Rank 1 of tp 2 holds heads 2 and 3 of q, of k and of v.
    rows = tp.split_tensor(torch.arange(36)[:, None], split, 1, 2)[:, 0].tolist()
    assert rows == [*range(6, 12), *range(18, 24), *range(30, 36)]


# --- uneven splits are refused -------------------------------------------------------------------


def refused_shard(mesh, tree, rules):
    """`fs.shard` on this rank: (error type, message, collectives run, tree untouched)."""
    calls = []
    exchange = mesh._rendezvous.exchange

    def counted(rank, x):
        calls.append(x.shape)
        return exchange(rank, x)

    mesh._rendezvous = type("Counting", (), {"exchange": staticmethod(counted), "barrier": mesh._rendezvous.barrier})()
    before = [t.clone() for t in fs.tree_leaves(tree)]
    try:
        fs.shard(tree, mesh, placements=rules)
    except Exception as error:  # noqa: BLE001
        untouched = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(tree)))
        return type(error).__name__, str(error), calls, untouched
    return None


@st.composite
def uneven_cases(draw):
    """A layout case with one more leaf whose split the axis does not divide (or a 0-d leaf split)."""
    axes, tree, rules, splits = draw(layout_cases())
    t = axes["tp"]
    chunks = draw(st.sampled_from([1, 2, 3]))
    granule = draw(st.sampled_from([1, 2, 4]))
    unit = chunks * granule * t
    ndim = draw(st.integers(0 if unit > 1 else 1, 3))
    if unit == 1 or ndim == 0:
        shape, dim = (), 0  # a split of a 0-d leaf: no dimension to split
    else:
        dim = draw(st.integers(0, ndim - 1))
        shape = [draw(st.sampled_from(ODD)) for _ in range(ndim)]
        shape[dim] = draw(st.integers(0, 3)) * unit + draw(st.integers(1, unit - 1))
        shape = tuple(shape)
    path = "blocks.9.uneven.weight"
    trainable = dict(tree.trainable, **{path: values(shape, torch.float32, 7)})
    tree = ModuleParams(trainable, tree.frozen, tree.buffers)
    rules = rules + [tp.rule(exact(path), tp.Split(dim, "tp", chunks, granule))]
    return axes, tree, rules, path, shape, dim


@settings(max_examples=15, deadline=None, suppress_health_check=HEALTH)
@given(case=uneven_cases())
def test_uneven_tp_splits_are_refused_clearly_on_every_rank(case):
    axes, tree, rules, path, shape, dim = case
    results = fs.testing.SimulatedWorld(world_size(axes), axes=axes).run(refused_shard, tree, rules)
    for result in results:
        assert result is not None, (axes, shape, rules[-1])
        name, message, calls, untouched = result
        assert name == "PlacementError" and calls == [] and untouched, result
        assert f"leaf {path!r}" in message and str(list(shape)) in message, message
        if shape == ():
            assert "(0 dimensions)" in message and "narrow its pattern" in message, message
        else:
            size = shape[dim]
            for part in (f"dimension {dim} (size {size})", f"axis 'tp' of size {axes['tp']}", "Replicated()"):
                assert part in message, (part, message)
