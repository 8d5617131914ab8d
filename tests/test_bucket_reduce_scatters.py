"""`fs.schedule.bucket_reduce_scatters`: fewer, larger reduce-scatters, the same bits.

On every float dtype and world sizes 1-4 (gloo worlds of `local_world`), a traced step whose
reduce-scatters are bucketed gives parameters, optimizer state and loss bit-identical to the
eager reference (`Schedule(trace=False)`), with fewer reduce-scatters and the same bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import MLP
from functional_shard.schedule import PassContext, bucket_reduce_scatters

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def bucketed_against_eager(mesh, dtype: torch.dtype, bucket_bytes: int) -> dict:
    torch.manual_seed(0)
    # Awkward sizes: every unit's buffer is padded to the world size.
    model = MLP(13, 17, 5, n_blocks=4).to(dtype)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.mse_loss(apply_fn(p, x).float(), y)

    def make(schedule):
        return fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=schedule)

    bucketed = make(fs.Schedule(extra_passes=(bucket_reduce_scatters(bucket_bytes),)))
    plain, eager = make(fs.Schedule()), make(fs.Schedule(trace=False))
    states = {name: step.init(params) for name, step in (("bucketed", bucketed), ("plain", plain), ("eager", eager))}
    losses = {}
    generator = torch.Generator().manual_seed(mesh.rank)
    for _ in range(2):
        batch = (torch.randn(3, 13, generator=generator).to(dtype), torch.randn(3, 5, generator=generator))
        for name, step in (("bucketed", bucketed), ("plain", plain), ("eager", eager)):
            states[name], metrics = step(states[name], batch)
            losses[name] = metrics["loss"]

    def same(a, b) -> bool:
        return all(_bits_equal(x, y) for x, y in zip(fs.tree_leaves(states[a]), fs.tree_leaves(states[b])))

    def scatters(step):
        return [e for e in step.schedule_events if e.event == "reduce_scatter_issued"]

    def collectives(step):
        gm = step.cache[next(iter(step.cache))].graph_module
        return [c for c in fs.schedule.collectives(gm) if c.kind == "reduce_scatter"]

    return {
        "bucketed == eager": same("bucketed", "eager") and _bits_equal(losses["bucketed"], losses["eager"]),
        "finite": all(bool(torch.isfinite(x).all()) for x in fs.tree_leaves(states["eager"]) if x.is_floating_point()),
        "plain == eager": same("plain", "eager"),
        "reduce-scatters": (len(collectives(bucketed)), len(collectives(plain))),
        "bytes": (sum(e.nbytes for e in scatters(bucketed)), sum(e.nbytes for e in scatters(plain))),
        "events per buffer": len(scatters(bucketed)) == len(scatters(plain)),
        "in flight per group": _max_per_group(bucketed, mesh),
    }


def _bits_equal(x, y) -> bool:
    """Same dtype, shape and bits (a NaN equals a NaN of the same bits)."""
    if not isinstance(x, torch.Tensor):
        return x == y
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8))


def _max_per_group(step, mesh) -> bool:
    gm = step.cache[next(iter(step.cache))].graph_module
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    bound = PassContext.for_mesh(mesh).max_in_flight_per_group
    for members in fs.schedule._passes.by_group(fs.schedule.collectives(gm)).values():
        spans = [(position[c.issue], position[c.wait]) for c in members]
        if bound is not None and any(sum(s <= p < e for s, e in spans) > bound for p, _ in spans):
            return False
    return True


# World size 1 (no collective left after lowering) runs with the slow tests: suite budget. So do 3
# and 4 (suite budget): every float dtype at 2 ranks here, with the same checks (the awkward sizes
# pad every buffer at 2 ranks too).
@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, marks=pytest.mark.slow),
        2,
        pytest.param(3, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.slow),
    ],
)
def test_bucketed_reduce_scatters_are_bit_identical_on_every_float_dtype(local_world, world_size):
    for dtype in DTYPES:
        for report in local_world(world_size).run(bucketed_against_eager, dtype, 1 << 30):
            assert report["bucketed == eager"] and report["plain == eager"], (dtype, report)
            bucketed, plain = report["reduce-scatters"]
            if world_size == 1:  # one rank: the step runs no collective at all
                assert bucketed == plain == 0 and report["bytes"][0] == report["bytes"][1] == 0, (dtype, report)
                continue
            assert bucketed < plain, (dtype, report)  # buckets were made
            assert report["bytes"][0] == report["bytes"][1] and report["events per buffer"], (dtype, report)
            assert report["in flight per group"], (dtype, report)


def test_bucket_bytes_bound_the_buckets(local_world):
    # A bucket of at most one unit's gradient merges nothing; 0 changes nothing.
    for bucket_bytes in (0, 1):
        for report in local_world(2).run(bucketed_against_eager, torch.float32, bucket_bytes):
            assert report["bucketed == eager"], report
            assert report["reduce-scatters"][0] == report["reduce-scatters"][1], report


def test_bucket_reduce_scatters_is_a_checked_value():
    assert bucket_reduce_scatters(1024) == bucket_reduce_scatters(1024)
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_reduce_scatters(-1)
