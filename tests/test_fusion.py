"""The analysis's model of `torch.compile` (`functional_shard/analysis/_fusion.py`): memory-bound
chains between products fused into one kernel each, priced once, their intermediates never
allocated; never across a product (a kernel is convex)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functional_shard as fs
from functional_shard.analysis._costs import COLLECTIVE_OPS, node_cost
from functional_shard.analysis._fusion import block_nodes, fuse, runs_compiled
from tests.test_analysis import gpt_loss, meta_batch, meta_gpt


def _costs(gm):
    return {n: node_cost(n) for n in gm.graph.nodes if n.op == "call_function" and n.target not in COLLECTIVE_OPS}


def _names(kernel):
    return [n.target.overloadpacket.__name__ for n in kernel if hasattr(n.target, "overloadpacket")]


def test_a_chain_between_products_is_one_kernel_read_once_written_once():
    def f(x, w, b, s):
        h = torch.relu(x @ w + b) * s  # add, relu, mul: one kernel
        return h @ w

    x, w, b, s = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32), torch.randn(64, 32)
    gm = make_fx(f, tracing_mode="fake")(x, w, b, s)
    costs = _costs(gm)
    fusion = fuse(gm, costs)
    assert len(fusion.kernels) == 1
    kernel = fusion.kernels[0]
    assert sorted(_names(kernel)) == ["add", "mul", "relu"]
    cost = fusion.costs[kernel[-1]]
    # Reads: the product (64x32), the bias (32), the scale (64x32); writes: the result (64x32).
    assert cost.bytes == 4 * (64 * 32 + 32 + 64 * 32 + 64 * 32)
    assert sum(costs[n].bytes for n in kernel) > cost.bytes  # unfused: every intermediate written and read again
    assert {n for n in kernel if n is not kernel[-1]} == set(fusion.unmaterialized)
    assert all(n not in fusion.costs for n in kernel[:-1])  # priced once, on its last node


def test_a_kernel_never_spans_a_product_that_reads_it():
    def f(x, w):
        y = torch.relu(x)
        z = y @ w  # reads y
        return y + z  # fusing the add with relu would run the add before the product it reads

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    fusion = fuse(gm, _costs(gm))
    assert fusion.kernels == ()  # relu and add are in different kernels of one node each
    assert fusion.unmaterialized == frozenset()


def test_a_compiled_step_is_priced_fused_and_lighter():
    """On a meta GPT at 64 ranks of the H100 data sheet: the step planned with `compile=True`
    is priced with fused kernels (fewer bytes and calls: faster, a lower peak), kernels hold no
    product, attention or collective, and `fused=False` prices the same graph as the eager one."""
    apply_fn, params = meta_gpt()
    machine = fs.analysis.h100_sxm(world_size=64)
    plans = {}
    for compile_ in (False, True):
        analysis, compiled = fs.analysis.plan(
            gpt_loss(apply_fn), params, meta_batch(), mesh=fs.analysis.AbstractMesh({"fsdp": 64}),
            optimizer=fs.optim.adamw(lr=1e-3), schedule=fs.Schedule(compile=compile_),
        )
        assert runs_compiled(compiled.graph_module) is compile_
        plans[compile_] = (analysis, compiled)
    eager = fs.analysis.simulate(plans[False][1], machine)
    compiled = fs.analysis.simulate(plans[True][1], machine)
    unfused = fs.analysis.simulate(plans[True][1], machine, fused=False)
    assert unfused.step_s == eager.step_s and unfused.memory.peak == eager.memory.peak
    assert compiled.compute_s < eager.compute_s
    assert compiled.memory.peak < eager.memory.peak
    assert plans[True][0].memory.peak == compiled.memory.peak  # analyze agrees with simulate
    # torchtitan's per-block compile: the embedding, output layer, loss and update stay eager.
    blocks = fs.analysis.simulate(plans[True][1], machine, fused="blocks")
    assert compiled.compute_s < blocks.compute_s < eager.compute_s
    gm_blocks = plans[True][1].graph_module
    inside = block_nodes(gm_blocks)
    assert all(n in inside for k in fuse(gm_blocks, _costs(gm_blocks), inside).kernels for n in k)
    with pytest.raises(ValueError, match="fused="):
        fs.analysis.simulate(plans[True][1], machine, fused="everything")
    gm = plans[True][1].graph_module
    fusion = fuse(gm, _costs(gm))
    assert len(fusion.kernels) > 10
    for kernel in fusion.kernels:
        costs = [node_cost(n) for n in kernel]
        assert not any(c.flops or c.attention for c in costs)
        assert not any(n.target in COLLECTIVE_OPS for n in kernel)
        # Convex: nothing outside the kernel that a member feeds feeds a member again.
        inside = set(kernel)
        frontier = [u for n in kernel for u in n.users if u not in inside]
        seen = set()
        while frontier:
            u = frontier.pop()
            if u in seen:
                continue
            seen.add(u)
            assert u not in inside, f"kernel ending at {kernel[-1].name} is re-entered through {u.name}"
            frontier.extend(u.users)
