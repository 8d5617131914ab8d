"""Predict torchtitan's published FSDP runs (docs/planning.md): plan each on an abstract mesh,
simulate it on the cluster machine model, print published against predicted.

    python benchmarks/planning.py [--rows 8b-h100-8,8b-h100-128] [--fit] [--fit-peak TFLOPS]

Each row builds its Llama from a Hugging Face `LlamaConfig` on the meta device (nothing is
allocated), with attention as the fused flash kernel torchtitan runs
(`aten._scaled_dot_product_flash_attention`, causal: keys and values repeated for grouped
queries, as torchtitan's `repeat_kv`), plans one step with `fs.analysis.plan` on an
`AbstractMesh({"fsdp": N})` (bf16 parameters and compute, fp32 gradient reduction, AdamW,
the row's activation checkpointing), and simulates it with `fs.analysis.cluster_machine`.
`--fit` refits the one fitted constant (matmul efficiency) on the Table 1 "FSDP" row and prints it.
`--fit-peak T`: what if the fit platform's bf16 dense peak were T TFLOP/s (its achievable matmul and
flash attention rates scaled alike; torchtitan: its 500 W
H100s peak "between SXM and NVL", 835-989, value unknown)? Refits the matmul efficiency on the fit
row at that peak, then predicts every row with it (the sensitivity of the A100 rows, docs/planning.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

import functional_shard as fs

# Llama shapes (torchtitan's model args: Llama 2 and Llama 3 / 3.1).
SHAPES = {
    "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
    "llama3_70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256),
    "llama2_13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40, vocab_size=32000),
    "llama2_70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=32000),
}


class Row(NamedTuple):
    """One published torchtitan run (FSDP only, no Float8)."""

    name: str  # short label
    source: str  # where it is published
    model: str  # key of SHAPES
    gpu: str  # "h100" (Grand Teton: HBM2e, 500 W) or "a100"
    world: int  # GPUs (all on the fsdp axis)
    batch: int  # local batch (sequences per GPU)
    sequence: int  # tokens per sequence
    remat: str  # "none", "full" or "selective op"
    tps: float  # published tokens per second per GPU
    memory_gib: float | None  # published peak memory per GPU (max reserved), GiB; None: not published
    compile: bool = False  # torch.compile of each TransformerBlock (torchtitan's apply_compile): priced with the
    # blocks' memory-bound chains fused (`simulate(..., fused="blocks")`, analysis/_fusion.py)
    norm: str = "rmsnorm"  # the run's configuration's `norm_type`: "rmsnorm" (eager, as Hugging Face's) or
    # "fused_rmsnorm" (torchtitan's Triton kernel: one kernel forward, one backward; benchmarks/fused_rmsnorm.py)


TABLE1 = "torchtitan docs/performance.md (Dec 2024), Table 1"
ROWS = (
    Row("8b-h100-8", TABLE1, "llama3_8b", "h100", 8, 2, 8192, "selective op", 5762, 82.4),
    Row("8b-h100-128", "torchtitan docs/performance.md (Dec 2024), Table 3", "llama3_8b", "h100", 128, 2, 8192,
        "selective op", 5605, 67.0),
    Row("8b-h100-8-compile", TABLE1, "llama3_8b", "h100", 8, 2, 8192, "selective op", 6667, 77.0, compile=True),
    Row("8b-h100-128-compile", "torchtitan docs/performance.md (Dec 2024), Table 3", "llama3_8b", "h100", 128, 2, 8192,
        "selective op", 6514, 62.0, compile=True),
    # The 2024 A100 runs' configurations (torchtitan train_configs/llama3_8b.toml and llama2_13b.toml, April 2024)
    # set norm_type = "fused_rmsnorm"; the 70B ones (llama2_70b.toml, llama3_70b.toml, written for TP 8, which
    # fused_rmsnorm did not support then) and the December 2024 H100 ones (llama3_8b.toml) "rmsnorm".
    Row("l3-8b-a100-64", "torchtitan docs/performance.md (2024), Llama 3 table", "llama3_8b", "a100", 64, 1, 8192,
        "selective op", 2973, None, norm="fused_rmsnorm"),
    Row("l2-13b-a100-64-none", "torchtitan docs/performance.md (2024), Llama 2 table", "llama2_13b", "a100", 64, 2, 4096,
        "none", 2162, None, norm="fused_rmsnorm"),
    Row("l2-13b-a100-64-op", "torchtitan docs/performance.md (2024), Llama 2 table", "llama2_13b", "a100", 64, 2, 4096,
        "selective op", 1904, None, norm="fused_rmsnorm"),
    Row("l2-70b-a100-64-op", "torchtitan docs/performance.md (2024), Llama 2 table", "llama2_70b", "a100", 64, 1, 4096,
        "selective op", 355, None),
    Row("l2-70b-a100-64-full", "torchtitan docs/performance.md (2024), Llama 2 table", "llama2_70b", "a100", 64, 2, 4096,
        "full", 353, None),
    Row("l3-70b-a100-64-full", "torchtitan docs/performance.md (2024), Llama 3 table", "llama3_70b", "a100", 64, 1, 8192,
        "full", 331, None),
)


def _flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention as the fused flash kernel (what torchtitan's SDPA runs on an H100/A100);
    query (b, heads, s, d), key and value (b, kv heads, s, d) repeated to the query's heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, True, False, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def build_llama(model: str, sequence: int, norm: str = "rmsnorm"):
    """(apply_fn, params) of a Llama of `SHAPES[model]` on the meta device, flash attention, its
    RMSNorms eager (`norm="rmsnorm"`) or one fused kernel each (`"fused_rmsnorm"`)."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("fs_fused_attention", _flash_attention)
    config = LlamaConfig(**SHAPES[model], max_position_embeddings=sequence, rope_theta=500000.0,
                         tie_word_embeddings=False, attn_implementation="fs_fused_attention", dtype=torch.float32)
    with torch.device("meta"):
        llama = LlamaForCausalLM(config)
    if norm == "fused_rmsnorm":
        from fused_rmsnorm import fuse_rms_norms

        fuse_rms_norms(llama)
    elif norm != "rmsnorm":
        raise ValueError(f"norm={norm!r}: expected 'rmsnorm' or 'fused_rmsnorm'")
    return fs.functionalize(llama)


def llama_loss(apply_fn):
    def loss_fn(p, batch):
        ids, labels = batch
        logits = apply_fn(p, input_ids=ids, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss_fn


def remat_of(remat: str):
    return {"none": False, "full": True, "selective op": fs.schedule.RematPolicy(every_other_mm=True)}[remat]


def plan_row(row: Row):
    """(analysis, compiled, planning seconds) of one row's step, planned on an abstract mesh."""
    start = time.perf_counter()
    apply_fn, params = build_llama(row.model, row.sequence, row.norm)
    ids = torch.empty(row.batch, row.sequence, dtype=torch.long, device="meta")
    analysis, compiled = fs.analysis.plan(
        llama_loss(apply_fn), params, (ids, ids), mesh=fs.analysis.AbstractMesh({"fsdp": row.world}),
        optimizer=fs.optim.adamw(lr=3e-4, weight_decay=0.1),
        precision=fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        schedule=fs.Schedule(remat=remat_of(row.remat), reduce_scatters_in_flight=1, compile=row.compile),
    )
    return analysis, compiled, time.perf_counter() - start


def machine_of(row: Row, efficiency=None, h100=None):
    """The row's cluster: Grand Teton H100s (400 Gb/s per GPU; `h100` in place of
    `H100_SXM_HBM2E`) or A100 80GB (200 Gb/s per GPU)."""
    gpu, gbps = (h100 or fs.analysis.H100_SXM_HBM2E, 400.0) if row.gpu == "h100" else (fs.analysis.A100_SXM_80GB, 200.0)
    return fs.analysis.cluster_machine(gpu, world_size=row.world, network_gbps=gbps, efficiency=efficiency or fs.analysis.FITTED)


class Prediction(NamedTuple):
    """One row predicted."""

    tps: float  # tokens per second per GPU
    mfu: float  # FLOPs utilization: the FLOPs the step runs (torch's count, recomputation included) / time / bf16 dense peak
    reserved_gib: float  # peak memory as the caching allocator reserves it
    allocated_gib: float  # peak bytes alive: the analysis' peak, plus torch's eager checkpoint cache where the run has one
    step_s: float  # predicted step time
    exposed_s: float  # communication not hidden behind computation


def alive_bytes(row: Row, sim, compiled) -> int:
    """The row's peak bytes alive: the simulation's peak (the graph's lifetimes, compiled blocks'
    fused intermediates never allocated), plus the outputs torch's eager selective checkpointing
    caches for nothing (`fs.analysis.eager_checkpoint_cache_bytes`) when the row runs it eagerly (torchtitan
    compiles each block whole under `torch.compile`: AOTAutograd saves what the backward reads)."""
    eager = row.remat == "selective op" and not row.compile
    cache = fs.analysis.eager_checkpoint_cache_bytes(compiled, remat_of(row.remat)) if eager else 0
    return sim.memory.peak + cache


def simulate_row(row: Row, compiled, machine):
    """The row's step simulated on `machine`: compiled blocks fused (torchtitan's per-block compile), else eager."""
    return fs.analysis.simulate(compiled, machine, fused="blocks" if row.compile else False)


def predict(row: Row, analysis, compiled, efficiency=None, h100=None) -> Prediction:
    machine = machine_of(row, efficiency, h100)
    sim = simulate_row(row, compiled, machine)
    peak = (h100 or fs.analysis.H100_SXM_HBM2E if row.gpu == "h100" else fs.analysis.A100_SXM_80GB).dense_flops["bfloat16"]
    alive = alive_bytes(row, sim, compiled)
    return Prediction(
        tps=row.batch * row.sequence / sim.step_s,
        mfu=analysis.flops / sim.step_s / peak,
        reserved_gib=alive * (1 + machine.allocator_overhead) / 2**30,
        allocated_gib=alive / 2**30,
        step_s=sim.step_s,
        exposed_s=sim.exposed_s,
    )


def fit(row: Row, analysis, compiled, h100=None):
    """The matmul efficiency that predicts the row's TPS (bisection), and the allocator overhead
    that predicts its reserved memory."""
    low, high = 0.05, 1.0
    for _ in range(20):
        middle = (low + high) / 2
        tps = predict(row, analysis, compiled, fs.analysis.Efficiency(matmul=middle), h100).tps
        low, high = (middle, high) if tps < row.tps else (low, middle)
    sim = simulate_row(row, compiled, machine_of(row, None, h100))
    allocator = row.memory_gib * 2**30 / alive_bytes(row, sim, compiled) - 1
    return (low + high) / 2, allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(r.name for r in ROWS))
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--fit-peak", type=float, default=0.0, help="the fit platform's bf16 dense TFLOP/s (what-if)")
    args = parser.parse_args()
    h100, efficiency = None, None
    if args.fit_peak:
        base = fs.analysis.H100_SXM_HBM2E
        scale = args.fit_peak * 1e12 / base.dense_flops["bfloat16"]
        h100 = dataclasses.replace(base, dense_flops={k: v * scale for k, v in base.dense_flops.items()},
                                   matmul_flops=base.matmul_flops * scale, attention_flops=base.attention_flops * scale)
        (point,) = [r for r in ROWS if r.memory_gib and r.gpu == "h100" and r.world == 8 and not r.compile]
        analysis, compiled, _ = plan_row(point)
        matmul, allocator = fit(point, analysis, compiled, h100)
        efficiency = fs.analysis.Efficiency(matmul=matmul, allocator=allocator)
        print(f"fit platform at {args.fit_peak:.0f} TFLOP/s: matmul efficiency {matmul:.4f} (FITTED: {fs.analysis.FITTED.matmul})")
    print(f"{'row':<22}{'published TPS':>14}{'predicted':>10}{'error':>8}{'MFU':>7}{'published GiB':>14}{'predicted':>10}"
          f"{'error':>8}{'alloc GiB':>10}{'planned s':>10}")
    for row in ROWS:
        if row.name not in args.rows.split(","):
            continue
        analysis, compiled, seconds = plan_row(row)
        if args.fit and row.memory_gib and not row.compile:
            print(f"fit on {row.name}: matmul efficiency {{:.4f}}, allocator overhead {{:.4f}}".format(*fit(row, analysis, compiled)))
        p = predict(row, analysis, compiled, efficiency, h100)
        memory = f"{row.memory_gib:>14.1f}{p.reserved_gib:>10.1f}{100 * (p.reserved_gib / row.memory_gib - 1):>+7.1f}%" if row.memory_gib else f"{'-':>14}{p.reserved_gib:>10.1f}{'':>8}"
        print(f"{row.name:<22}{row.tps:>14,.0f}{p.tps:>10,.0f}{100 * (p.tps / row.tps - 1):>+7.1f}%{100 * p.mfu:>6.1f}%"
              f"{memory}{p.allocated_gib:>10.1f}{seconds:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
