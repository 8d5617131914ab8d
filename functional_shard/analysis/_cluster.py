"""Cluster machine models from data sheets: a GPU, its node, the network, and a few named efficiencies.

`cluster_machine(H100_SXM, world_size=128)` is the `Machine` the simulator prices a step on:

- matrix products at `efficiency.matmul` of the GPU's dense peak for the product's dtype
  (bf16/fp16, tf32, fp32 from the data sheet), reached by large products; a product of `F`
  FLOPs takes `launch_s + F / (efficiency.matmul * peak)`, so small ones run slower;
- fused attention kernels at the GPU's published flash attention rate (`GPU.attention_flops`;
  `efficiency.attention` of the dense bf16 peak for a GPU without one), on the FLOPs the kernel
  does (a causal call half of those torch's counter reports);
- every other kernel (elementwise, norms, softmax, copies, the optimizer) is memory bound:
  its bytes read and written at `efficiency.memory` of the HBM bandwidth, `launch_s` at least;
- collectives: a ring over NVLink within a node (per-GPU bandwidth per direction, at
  `efficiency.bus`), and across nodes the two-level ring NCCL's channels make: each GPU's NIC
  carries its share between nodes (`network_gbps` per GPU, at `efficiency.bus`); a group is
  priced where its ranks lie (`Machine.collective_seconds(..., stride=)`, the stride read from
  the mesh axis it spans): on `{"fsdp": 64, "tp": 8}` a `tp` group is one node (NVLink), an
  `fsdp` group one rank on each of 64 nodes;
- peak memory as the CUDA caching allocator reserves it: the bytes alive at the peak times
  `1 + efficiency.allocator` (`Simulation.reserved`).

Each efficiency is either read from a published measurement (named in `Efficiency`) or fitted
on ONE published run: torchtitan's Llama 3.1 8B FSDP row (docs/planning.md). Nothing here is
measured on this machine.
"""

from __future__ import annotations

import dataclasses
import math

from ._machine import COLLECTIVE_KINDS, Machine

__all__ = ["GPU", "Efficiency", "H100_SXM", "H100_SXM_HBM2E", "A100_SXM_80GB", "FITTED", "cluster_machine"]


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU's data sheet.

    Attributes:
        name: what it is.
        dense_flops: dtype name -> dense (no sparsity) tensor-core peak FLOP/s: "bfloat16",
            "float16", "tf32", "float32" (fp32 matrix products without TF32: CUDA cores).
        hbm_bandwidth: HBM bytes/s.
        memory_bytes: HBM capacity.
        nvlink_bandwidth: NVLink bytes/s per GPU per direction (half the bidirectional figure).
        source: where the numbers come from.
        host_bandwidth: host <-> GPU bytes/s per direction (PCIe x16 from pinned memory: Gen5
            64 GB/s, Gen4 32 GB/s, of which ~80% is reached); what CPU offload's copies move at.
        attention_flops: FLOP/s of the fused flash attention kernel (FlashAttention-2, what
            `scaled_dot_product_attention` runs on these GPUs), forward and backward together,
            as published for this GPU; 0.0: none published, `Efficiency.attention` of the bf16
            peak is used. How far a GPU's flash kernel is from its peak differs between GPUs
            (FlashAttention-2 reaches 0.66 of an A100's, 0.34 of an H100's), so it is a data
            sheet figure here, not one efficiency.
        matmul_flops: the Maximum Achievable Matmul FLOP/s (MAMF) of bf16 products on this
            GPU, measured by a published shape search (Bekman, ml-engineering, "Maximum
            Achievable Matmul FLOPS comparison table": A100 SXM 271.2 TFLOP/s = 86.9% of its
            peak, H100 SXM 794.5 = 80.3%); 0.0: not published, the data sheet's peak is used.
            `Efficiency.matmul` is a fraction of it: what a training step's products reach of
            what products can reach on that GPU. Products of other dtypes scale with the data
            sheet's peaks.
    """

    name: str
    dense_flops: dict
    hbm_bandwidth: float
    memory_bytes: int
    nvlink_bandwidth: float
    source: str
    host_bandwidth: float = 0.8 * 64e9
    attention_flops: float = 0.0
    matmul_flops: float = 0.0

    def achievable(self) -> float:
        """The fraction of the data sheet's bf16 peak that large products reach (MAMF / peak; 1 if unknown)."""
        return self.matmul_flops / self.dense_flops["bfloat16"] if self.matmul_flops else 1.0


H100_SXM = GPU(
    name="H100 SXM5 80GB",
    dense_flops={"bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12},
    hbm_bandwidth=3.35e12,
    memory_bytes=80 * 10**9,
    nvlink_bandwidth=450e9,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 1,979 TFLOP/s bf16 with sparsity = 989.4 dense; "
    "tf32 494.7 dense; fp32 66.9; HBM3 3.35 TB/s; NVLink 4 900 GB/s bidirectional); flash attention: "
    "FlashAttention-2 paper (Dao 2023, section 4.1, Fig. 7), forward + backward on H100 'up to 335 TFLOPs/s'; "
    "achievable matmul: ml-engineering MAMF table, H100 SXM bf16 794.5 TFLOP/s",
    attention_flops=335e12,
    matmul_flops=794.5e12,
)

# torchtitan's benchmark platform (Grand Teton): the same GPU with 96 GB of HBM2e at 2.4 TB/s,
# power-limited to 500 W; torchtitan's docs say its peak lies between the SXM's and the NVL's
# and is not known exactly, so the SXM's peak (and its MAMF) is kept and `Efficiency.matmul`
# absorbs the rest.
H100_SXM_HBM2E = dataclasses.replace(
    H100_SXM,
    name="H100 SXM HBM2e 96GB, 500 W (Grand Teton)",
    hbm_bandwidth=2.4e12,
    memory_bytes=96 * 2**30,
    source="torchtitan docs/performance.md (Dec 2024): 96 GB HBM2e, 2.4 TB/s, 500 W; FLOP/s and NVLink: H100 SXM5 datasheet",
)

A100_SXM_80GB = GPU(
    name="A100 SXM4 80GB",
    dense_flops={"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    hbm_bandwidth=2.039e12,
    memory_bytes=80 * 10**9,
    nvlink_bandwidth=300e9,
    source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: bf16 312 TFLOP/s dense, tf32 156, fp32 19.5; "
    "HBM2e 2,039 GB/s; NVLink 3 600 GB/s bidirectional); flash attention: FlashAttention-2 paper (Dao 2023, "
    "section 1 and 4.1) on an A100 80GB SXM4, forward 'up to 73%' and backward 'up to 63%' of the peak, "
    "the backward doing 2.5x the forward's FLOPs: 3.5 / (1/0.73 + 2.5/0.63) = 0.656 of 312 = 204.6 TFLOP/s; "
    "achievable matmul: ml-engineering MAMF table, A100 SXM bf16 271.2 TFLOP/s",
    host_bandwidth=0.8 * 32e9,
    attention_flops=3.5 / (1 / 0.73 + 2.5 / 0.63) * 312e12,
    matmul_flops=271.2e12,
)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The fractions of the data sheet's peaks a training step reaches (each in (0, 1], but
    `allocator` >= 0), and where each comes from.

    Attributes:
        matmul: of what large matrix products reach on the GPU (`GPU.matmul_flops`, its
            published MAMF; the dense tensor-core peak where there is none), by a training
            step's products. FITTED on torchtitan's Llama 3.1 8B FSDP run (8 H100s, Table 1
            "FSDP": 5,762 TPS/GPU), the only fitted time constant: it absorbs that platform's
            500 W power limit (its MAMF is not published; the 700 W SXM's is used) and
            everything the model leaves out (the step's product shapes, the CPU's dispatch).
        attention: of the dense bf16 peak, by the fused flash attention kernel, forward and
            backward together, for a GPU whose data sheet has no `attention_flops` (the data
            sheets here all have one: H100 335 TFLOP/s = 0.34 of its peak, A100 204.6 = 0.66 of
            its, both from the FlashAttention-2 paper); default 0.34 (FlashAttention-2 on an
            H100). Not fitted.
        memory: of the HBM bandwidth, by memory-bound kernels on large tensors: 0.8 (what
            large copies and elementwise kernels reach on A100/H100 in STREAM-like measurements,
            e.g. NVIDIA's bandwidthTest and BabelStream reports: 80-90%). Not fitted.
        bus: of the NVLink and NIC bandwidth, by NCCL's all-gather and reduce-scatter on large
            messages: 0.8 (nccl-tests bus bandwidth on DGX H100: about 360 of 450 GB/s within a
            node; 40 of 50 GB/s per 400 Gb/s NIC between nodes). Not fitted.
        allocator: what the CUDA caching allocator reserves beyond the bytes alive at the
            peak, as a fraction of them (fragmentation of segments, block rounding): FITTED on
            the same run's memory (82.4 GiB reserved).
        launch_s: the least time one kernel takes on the GPU (launch and tail): 4 us.
        collective_latency_s: a collective's fixed time within a node (NCCL on NVLink, small
            messages): 10 us; between nodes 5 us more per doubling of the nodes spanned.
    """

    matmul: float
    attention: float = 0.34
    memory: float = 0.8
    bus: float = 0.8
    allocator: float = 0.0
    launch_s: float = 4e-6
    collective_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for name in ("matmul", "attention", "memory", "bus"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{name} must be in (0, 1]; got {value!r}")
        for name in ("allocator", "launch_s", "collective_latency_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Efficiency.{name} must be a finite number >= 0; got {value!r}")


# Fitted on torchtitan docs/performance.md (Dec 2024) Table 1, row "FSDP": Llama 3.1 8B, 8 H100
# (H100_SXM_HBM2E), local batch 2 x 8192 tokens, bf16 compute, fp32 reduce, AdamW, selective op
# activation checkpointing (RematPolicy(every_other_mm=True)): 5,762 TPS/GPU, 82.4 GiB reserved
# (of 66.0 GiB alive: the traced step's 62.1 plus the 3.9 GiB torch's eager selective checkpointing
# caches and never reads, `eager_checkpoint_cache_bytes`, analysis/_eager_checkpoint.py).
# `python benchmarks/planning.py --fit` recomputes both.
FITTED = Efficiency(matmul=0.666, allocator=0.248)


def cluster_machine(
    gpu: GPU = H100_SXM,
    *,
    world_size: int = 8,
    ranks_per_node: int = 8,
    network_gbps: float = 400.0,
    efficiency: Efficiency = FITTED,
    compute_dtype: str = "bfloat16",
) -> Machine:
    """The `Machine` of a cluster of `gpu`s, `ranks_per_node` to a node joined by NVLink, nodes
    joined by a network of `network_gbps` per GPU, for `fs.analysis.simulate`.

    Arguments:
        gpu: `H100_SXM`, `H100_SXM_HBM2E`, `A100_SXM_80GB`, or your own `GPU`.
        world_size: ranks of the run (`simulate` refuses a step with a collective over more; a
            collective's group size and where its ranks lie come from the graph).
        ranks_per_node: GPUs per node (NVLink domain).
        network_gbps: inter-node bandwidth per GPU, Gbit/s per direction (400: H100 clusters
            with one 400 Gb/s RDMA NIC per GPU; 200: A100 clusters).
        efficiency: the named efficiencies (`FITTED` by default).
        compute_dtype: the dtype of the step's matrix products (the peak of `matmul_flops`);
            products of other dtypes are scaled by their peak over this one.
    """
    if compute_dtype not in gpu.dense_flops:
        raise ValueError(f"cluster_machine: {gpu.name} has no peak for {compute_dtype!r}; it has {sorted(gpu.dense_flops)}")
    if ranks_per_node < 1 or world_size < 1 or not (network_gbps > 0 and math.isfinite(network_gbps)):
        raise ValueError(
            f"cluster_machine needs world_size >= 1, ranks_per_node >= 1 and network_gbps > 0; got "
            f"{world_size}, {ranks_per_node}, {network_gbps}"
        )
    e = efficiency
    peak = gpu.dense_flops[compute_dtype] * gpu.achievable() * e.matmul
    hbm = gpu.hbm_bandwidth * e.memory
    # A kernel of F FLOPs (B bytes) takes launch_s + F / rate: the curves hold F / that time.
    matmul = tuple((f, f / (e.launch_s + f / peak)) for f in (1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13))
    memory = tuple((b, b / (e.launch_s + b / hbm)) for b in (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10))
    nvlink = gpu.nvlink_bandwidth * e.bus
    nodes = -(-world_size // ranks_per_node)
    return Machine(
        name=f"{gpu.name}: {world_size} ranks, {ranks_per_node} per node (NVLink), {nodes} node(s), "
        f"{network_gbps:g} Gb/s per GPU between nodes; {e}",
        matmul_flops=matmul,
        memory_bandwidth=memory,
        op_overhead_s=e.launch_s,
        view_overhead_s=0.0,
        collective_latency_s={k: e.collective_latency_s for k in COLLECTIVE_KINDS},
        collective_bandwidth={k: nvlink for k in COLLECTIVE_KINDS},
        issue_overhead_s=5e-6,
        overlap_penalty=0.1,
        ranks_per_node=ranks_per_node,
        network_bandwidth=network_gbps / 8 * 1e9 * e.bus,
        network_latency_s=5e-6,
        matmul_dtype_scale={k: v / gpu.dense_flops[compute_dtype] for k, v in gpu.dense_flops.items()},
        attention_flops=gpu.attention_flops or gpu.dense_flops["bfloat16"] * e.attention,
        allocator_overhead=e.allocator,
        host_bandwidth=gpu.host_bandwidth,
        world_size=world_size,
    )
