"""Cluster machine models (`fs.analysis.cluster_machine`) and planning published runs.

- the machine's numbers are the data sheets' constants times the named efficiencies;
- collectives: within a node the flat ring; across nodes the two-level ring, monotone in bytes
  and in the group's size, never faster than within a node;
- fused attention is priced at the attention efficiency on the FLOPs a causal kernel does;
- `Simulation.reserved` is the peak alive times 1 + the allocator overhead;
- the fused RMSNorm of the A100 rows (benchmarks/fused_rmsnorm.py) has autograd's gradients and
  traces to one node forward and one backward, priced by the bytes they read and write;
- slow: torchtitan's Llama 3.1 8B FSDP row (the fit point) planned in under a minute and
  predicted within 5% (TPS) and 10% (memory) of what was published.
(Selective remat keeping the bits: tests/test_remat.py, `test_selective_remat_*`.)
"""

from __future__ import annotations

import dataclasses

import math
import os
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import functional_shard as fs
from functional_shard.analysis._costs import node_cost
from functional_shard.models import GPT, GPTConfig

A = fs.analysis


def test_h100_and_a100_are_their_data_sheets():
    assert A.H100_SXM.dense_flops == {"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}
    assert (A.H100_SXM.hbm_bandwidth, A.H100_SXM.nvlink_bandwidth) == (3.35e12, 450e9)
    assert (A.H100_SXM_HBM2E.hbm_bandwidth, A.H100_SXM_HBM2E.dense_flops) == (2.4e12, A.H100_SXM.dense_flops)
    assert A.A100_SXM_80GB.dense_flops == {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12}
    # published measurements: MAMF (ml-engineering) and FlashAttention-2's forward + backward rate
    assert (A.H100_SXM.matmul_flops, A.A100_SXM_80GB.matmul_flops) == (794.5e12, 271.2e12)
    assert A.H100_SXM.attention_flops == 335e12
    assert A.A100_SXM_80GB.attention_flops == pytest.approx(0.656 * 312e12, rel=1e-3)
    assert (A.A100_SXM_80GB.hbm_bandwidth, A.A100_SXM_80GB.nvlink_bandwidth) == (2.039e12, 300e9)
    for gpu in (A.H100_SXM, A.A100_SXM_80GB):
        e = A.FITTED
        m = A.cluster_machine(gpu, world_size=64, network_gbps=200)
        # Large products reach matmul efficiency x peak; large kernels efficiency x HBM bandwidth.
        assert m.matmul_flops[-1][1] == pytest.approx(e.matmul * gpu.matmul_flops, rel=1e-3)  # of its achievable rate
        assert m.memory_bandwidth[-1][1] == pytest.approx(e.memory * gpu.hbm_bandwidth, rel=1e-2)
        assert m.collective_bandwidth["all_gather"] == pytest.approx(e.bus * gpu.nvlink_bandwidth)
        assert m.network_bandwidth == pytest.approx(e.bus * 200e9 / 8)
        assert m.attention_flops == gpu.attention_flops  # the published flash attention rate of that GPU
        assert m.matmul_dtype_scale["float32"] == pytest.approx(gpu.dense_flops["float32"] / gpu.dense_flops["bfloat16"])
        assert m.allocator_overhead == e.allocator
        # An fp32 product runs at fp32's peak; a small one pays the launch.
        big = 1e13
        fp32 = e.matmul * gpu.achievable() * gpu.dense_flops["float32"]  # MAMF's fraction, at fp32's peak
        assert m.compute_seconds(big, 0, dtype="float32") == pytest.approx(big / fp32, rel=1e-3)
        assert m.compute_seconds(1e3, 0) >= e.launch_s
    with pytest.raises(ValueError, match="matmul"):
        A.Efficiency(matmul=0.0)
    with pytest.raises(ValueError, match="int8"):
        A.cluster_machine(A.H100_SXM, compute_dtype="int8")


def test_collectives_are_the_flat_ring_within_a_node_and_two_levels_across():
    m = A.cluster_machine(A.H100_SXM, world_size=1024, ranks_per_node=8, network_gbps=400)
    nvlink, nic = m.collective_bandwidth["all_gather"], m.network_bandwidth
    n = 2**30
    for p in (2, 4, 8):  # within a node: exactly the ring over NVLink
        for kind, factor in (("all_gather", 1), ("reduce_scatter", 1), ("all_reduce", 2)):
            assert m.collective_seconds(kind, n, p) == pytest.approx(10e-6 + factor * (p - 1) / p * n / nvlink)
    flat = dict(vars(m), ranks_per_node=0)
    flat.pop("__dict__", None)
    assert fs.analysis.Machine(**flat).collective_seconds("all_gather", n, 64) == pytest.approx(10e-6 + 63 / 64 * n / nvlink)
    # 16 nodes: NVLink within, each GPU's NIC carries 1/8 of the data between nodes.
    expected = 10e-6 + 5e-6 * 4 + 7 / 8 * n / nvlink + 15 / 16 * n / (8 * nic)
    assert m.collective_seconds("all_gather", n, 128) == pytest.approx(expected)
    # Monotone in bytes and group size; crossing nodes never faster than staying in one.
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        for nbytes in (2**10, 2**20, 2**30):
            times = [m.collective_seconds(kind, nbytes, p) for p in sizes]
            assert times == sorted(times), (kind, nbytes, times)
        for p in sizes:
            times = [m.collective_seconds(kind, b, p) for b in (2**10, 2**20, 2**25, 2**30)]
            assert times == sorted(times), (kind, p, times)
    # A slower network makes a multi-node group slower, and leaves a node's alone.
    slow = A.cluster_machine(A.H100_SXM, world_size=1024, network_gbps=100)
    assert slow.collective_seconds("all_gather", n, 64) > m.collective_seconds("all_gather", n, 64)
    assert slow.collective_seconds("all_gather", n, 8) == m.collective_seconds("all_gather", n, 8)


def test_fused_causal_attention_is_priced_on_the_flops_it_does():
    def attention(q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]

    q = torch.empty(2, 32, 8192, 128, dtype=torch.bfloat16, device="meta")  # large: compute bound
    gm = make_fx(attention)(q, q, q)
    (node,) = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    cost = node_cost(node)
    assert cost.attention and cost.causal and cost.dtype == "bfloat16" and cost.flops == 4 * 2 * 32 * 8192**2 * 128
    m = A.cluster_machine(A.H100_SXM)
    options = dict(kind=cost.kind, dtype=cost.dtype, attention=True)
    causal = m.compute_seconds(cost.flops, cost.bytes, causal=True, **options)
    assert causal == pytest.approx(cost.flops / 2 / 335e12)  # FlashAttention-2's published rate on an H100
    # a GPU without a published flash rate: Efficiency.attention of its bf16 peak
    bare = A.cluster_machine(dataclasses.replace(A.H100_SXM, attention_flops=0.0))
    assert bare.compute_seconds(cost.flops, cost.bytes, causal=True, **options) == pytest.approx(
        cost.flops / 2 / (A.FITTED.attention * 989.4e12))
    assert m.compute_seconds(cost.flops, cost.bytes, causal=False, **options) == pytest.approx(2 * causal)


def test_reserved_memory_is_the_peak_with_the_allocator_overhead():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, d_model=32))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        logits = apply_fn(p, batch[0])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    ids = torch.empty(2, 32, dtype=torch.long, device="meta")
    analysis, compiled = A.plan(loss_fn, params, (ids, ids), mesh=A.AbstractMesh({"fsdp": 16}), optimizer=fs.optim.adamw(1e-3))
    for allocator in (0.0, 0.25):
        machine = A.cluster_machine(A.H100_SXM, world_size=16, efficiency=A.Efficiency(matmul=0.5, allocator=allocator))
        simulation = A.simulate(compiled, machine)
        assert simulation.memory.peak == analysis.memory.peak
        assert simulation.reserved == round(analysis.memory.peak * (1 + allocator))
        assert simulation.step_s > 0 and math.isfinite(simulation.step_s)


def _fused_rmsnorm():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import fused_rmsnorm

    return fused_rmsnorm


def test_the_fused_rmsnorm_has_autograds_gradients_and_is_one_kernel_each_way():
    """torchtitan's `fused_rmsnorm` (its 2024 A100 configurations) as the planner prices it: the
    same values and gradients as the eager RMSNorm of Hugging Face's Llama, and one memory-bound
    node forward and one backward, where the eager norm is about seven each way."""
    fused = _fused_rmsnorm()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    eager = LlamaRMSNorm(24, eps=1e-5).double()
    torch.nn.init.normal_(eager.weight)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    module = fused.FusedRMSNorm(eager.weight, eager.variance_epsilon)
    close = dict(rtol=1e-5, atol=1e-6)  # Hugging Face's norm computes in float32 whatever its input
    torch.testing.assert_close(module(x), eager(x), **close)
    g = torch.randn(3, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(module(x), (x, eager.weight), g),
                               torch.autograd.grad(eager(x), (x, eager.weight), g), **close)
    assert torch.autograd.gradcheck(lambda x, w: fused.fused_rms_norm(x, w, 1e-5), (x, eager.weight.detach().requires_grad_()))

    def step(x, w):
        return torch.autograd.grad(fused.fused_rms_norm(x, w, 1e-5).sum(), (x, w))

    x = torch.empty(2, 4096, 5120, dtype=torch.bfloat16, device="meta", requires_grad=True)
    w = torch.empty(5120, dtype=torch.bfloat16, device="meta", requires_grad=True)
    gm = make_fx(step)(x, w)
    kernels = [n for n in gm.graph.nodes if "fused_rms_norm" in str(n.target)]
    assert [str(n.target) for n in kernels] == ["fs_bench._fused_rms_norm.default", "fs_bench._fused_rms_norm_backward.default"]
    forward, backward = (node_cost(n) for n in kernels)
    act, rstd = 2 * 4096 * 5120 * 2, 2 * 4096 * 4  # bf16 activation, fp32 inverse RMS per row
    assert (forward.kind, forward.bytes) == ("normalization", act + 5120 * 2 + act + rstd)  # reads x, w; writes y, rstd
    assert (backward.kind, backward.bytes) == ("normalization", 3 * act + 2 * 5120 * 2 + rstd)  # g, x, w, rstd -> dx, dw
    m = A.cluster_machine(A.A100_SXM_80GB)
    seconds = m.compute_seconds(forward.flops, forward.bytes, kind=forward.kind, numel=forward.numel, dtype=forward.dtype)
    # memory bound: a launch plus its bytes at the fraction of HBM (the machine's curve interpolates it)
    assert seconds == pytest.approx(A.FITTED.launch_s + forward.bytes / (A.FITTED.memory * 2.039e12), rel=0.02)
    with torch.device("meta"):
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                             num_attention_heads=4, vocab_size=32))
    assert fused.fuse_rms_norms(llama) == 2 * 3 + 1
    assert not any(type(m).__name__ == "LlamaRMSNorm" for m in llama.modules())


@pytest.mark.slow
def test_the_fitted_fsdp_row_reproduces_its_fit_point():
    """torchtitan docs/performance.md Table 1 "FSDP" (Llama 3.1 8B, 8 H100s, batch 2 x 8192,
    selective op AC): 5,762 TPS/GPU, 82.4 GiB; planned in under a minute."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import planning

    row = planning.ROWS[0]
    assert row.name == "8b-h100-8" and (row.tps, row.memory_gib) == (5762, 82.4)
    analysis, compiled, seconds = planning.plan_row(row)
    prediction = planning.predict(row, analysis, compiled)
    assert seconds < 60, seconds
    assert abs(prediction.tps / row.tps - 1) < 0.05, prediction
    assert abs(prediction.reserved_gib / row.memory_gib - 1) < 0.10, prediction


def test_eager_checkpoint_cache_is_the_policys_outputs_no_backward_reads():
    """torch's eager selective checkpointing caches every output its policy saves; fs keeps only
    what the backward reads. In a Llama block the last product (`down_proj`) feeds only the
    residual add: cached for nothing in every block but the last (whose output the final norm's
    backward reads through its recomputation). Nothing when the policy saves no product."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        ids, labels = batch
        return torch.nn.functional.cross_entropy(apply_fn(p, input_ids=ids, use_cache=False).logits.flatten(0, 1), labels.flatten())

    ids = torch.empty(2, 16, dtype=torch.long, device="meta")
    down_proj = 2 * 16 * 64 * 4  # one block's product output, fp32
    for policy, expected in ((fs.schedule.RematPolicy(every_other_mm=True), 3 * down_proj),
                             (fs.schedule.RematPolicy(), 3 * down_proj), (fs.schedule.RematPolicy(save=("sdpa",)), 0)):  # fmt: skip
        _, compiled = A.plan(loss_fn, params, (ids, ids), mesh=A.AbstractMesh({"fsdp": 2}), optimizer=fs.optim.adamw(1e-3),
                             schedule=fs.Schedule(remat=policy))  # fmt: skip
        assert A.eager_checkpoint_cache_bytes(compiled, policy) == expected, policy
    with pytest.raises(TypeError, match="RematPolicy"):
        A.eager_checkpoint_cache_bytes(compiled, True)


def _loss_parallel():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import loss_parallel

    return loss_parallel


def _loss_parallel_at_tp2(_):
    torch.set_num_threads(1)
    mesh = fs.init_mesh({"tp": 2})
    x, targets = _logits_and_targets()
    half = x.shape[1] // 2
    mine = x[:, mesh.coordinates["tp"] * half :][:, :half].clone().requires_grad_()
    loss = _loss_parallel().loss_parallel_cross_entropy(mine, targets, mesh, "tp")
    return loss.detach(), torch.autograd.grad(loss, mine)[0]


def _logits_and_targets():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 50, dtype=torch.float64, generator=g)
    targets = torch.randint(0, 50, (12,), generator=g)
    targets[3] = -100
    return x, targets


def test_torchs_loss_parallel_as_planned_is_cross_entropy_and_holds_torchs_buffers(local_world):
    """torch's `loss_parallel` (torchtitan's loss) as the planner traces it: `F.cross_entropy`'s
    value and gradient, split over 1 and 2 ranks; its backward holds four buffers of the local
    logits' size at once (the saved log-probabilities, `grad_input`, `grad_input + exp` and the
    gradient, as torch's eager code does), one more than fs's `vocab_parallel_cross_entropy`."""
    lp = _loss_parallel()
    x, targets = _logits_and_targets()
    full = x.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(full, targets)
    want_grad = torch.autograd.grad(want, full)[0]
    one = x.clone().requires_grad_()
    loss = lp.loss_parallel_cross_entropy(one, targets, fs.init_mesh({"tp": 1}), "tp")
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(torch.autograd.grad(loss, one)[0], want_grad)
    for rank, (loss, grad) in enumerate(local_world(2).run(_loss_parallel_at_tp2)):
        torch.testing.assert_close(loss, want)
        torch.testing.assert_close(grad, want_grad[:, rank * 25 : (rank + 1) * 25])

    from functional_shard.schedule._liveness import lifetimes

    mesh, tokens, vocab = fs.analysis.AbstractMesh({"tp": 2}), 64, 1000

    def buffers(loss_fn) -> float:  # the most bytes alive at once, in logits of [tokens, vocab] fp32
        def step(x, t):
            return torch.autograd.grad(loss_fn(x, t, mesh, "tp"), x)

        x = torch.empty(tokens, vocab, device="meta", requires_grad=True)
        gm = make_fx(step)(x, torch.empty(tokens, dtype=torch.long, device="meta"))
        nodes = list(gm.graph.nodes)
        _, first, last, size, _ = lifetimes(nodes)
        return max(sum(size[k] for k in size if first[k] <= i <= last[k]) for i in range(len(nodes))) / (tokens * vocab * 4)

    # the logits themselves (an input here) and four; fs's own loss: the logits and three
    assert buffers(lp.loss_parallel_cross_entropy) == pytest.approx(5, abs=0.01)
    assert buffers(fs.tensor_parallel.vocab_parallel_cross_entropy) == pytest.approx(4, abs=0.01)
