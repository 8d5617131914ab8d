"""The training options' costs: peak memory per rank and bytes moved per step, option by option.

    python benchmarks/training_memory.py [--world-size 2] [--n-layer 8] [--d-model 128] [--batch-size 16]
                                         [--arms NAME ...]

A GPT (block size 64, 4 heads, the shipped corpus) trained with AdamW, batch 16 sequences of 64
tokens per rank. For each arm, one warm-up step (it traces), then one step under `MemTracker`
on rank 0 (the state and the batch registered with `track_external` first, as
benchmarks/_runner.py does). Printed: peak tensor memory, the state's own bytes, peak minus state
(what the step allocates), all-gather and reduce-scatter bytes per step (`metrics`).
Memory figures are deterministic for a given graph; no timing is taken.
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs
from _gpt import corpus_gpt, cpu_total
from functional_shard.data import batches
from functional_shard.models import GPT

BF16 = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ARMS = {
    "fp32 (default)": dict(),
    "bf16 params, fp32 reduce": dict(precision=BF16),
    "4 micro-batches, sharded": dict(microbatches=4),
    "4 micro-batches, full": dict(microbatches=4, schedule=fs.Schedule(accumulate="full")),
    "remat every unit": dict(schedule=fs.Schedule(remat=True)),
    "bf16 + remat": dict(precision=BF16, schedule=fs.Schedule(remat=True)),
    "4 micro-batches, sharded + remat": dict(microbatches=4, schedule=fs.Schedule(remat=True)),
    "4 micro-batches, full + remat": dict(microbatches=4, schedule=fs.Schedule(accumulate="full", remat=True)),
    "4 micro-batches, gathered once": dict(
        microbatches=4, schedule=fs.Schedule(reshard_after_forward=False, reshard_after_backward=False)
    ),
    "4 micro-batches, full, gathered once": dict(
        microbatches=4, schedule=fs.Schedule(accumulate="full", reshard_after_forward=False, reshard_after_backward=False)
    ),
    "no reshard after forward": dict(schedule=fs.Schedule(reshard_after_forward=False)),
    "clip 1.0 (chain)": dict(optimizer=fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.adamw(lr=3e-3))),
}


def run(world_size: int, batch_size: int, n_layer: int, d_model: int, arms: list[str]) -> dict:
    mesh = fs.init_mesh({"fsdp": world_size})
    tokens, config, params, loss_fn = corpus_gpt(n_layer, d_model)

    report = {}
    generator = torch.Generator().manual_seed(1 + mesh.rank)
    for name in arms:
        options = {"optimizer": fs.optim.adamw(lr=3e-3, weight_decay=0.1), **ARMS[name]}
        step = fs.sharded_step(loss_fn, mesh, **options)
        state = step.init(params)
        batch = batches(tokens, batch_size, 64, generator=generator)
        state, _ = step(state, batch)  # traces
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(state), *batch)
        with tracker:
            state, metrics = step(state, batch)
        report[name] = {
            "peak": cpu_total(tracker, "peak"),
            "state": sum(t.numel() * t.element_size() for t in fs.tree_leaves(state)),
            "gathered": metrics["all_gather_bytes"],
            "scattered": metrics["reduce_scatter_bytes"],
        }
    report["params"] = GPT(config).num_params()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), metavar="NAME",
                        help=f"run only these arms (default: all of {list(ARMS)})")
    args = parser.parse_args()
    report = fs.launch(
        run, world_size=args.world_size, args=(args.world_size, args.batch_size, args.n_layer, args.d_model, args.arms)
    )
    params = report.pop("params")
    mib = 2**20
    print(
        f"GPT n_layer={args.n_layer} d_model={args.d_model} ({params / 1e6:.2f}M parameters), world size "
        f"{args.world_size}, batch {args.batch_size} x 64 tokens per rank; rank 0"
    )
    print("| arm | peak MiB | state MiB | peak - state MiB | all-gather MiB/step | reduce-scatter MiB/step |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in report.items():
        print(
            f"| {name} | {r['peak'] / mib:.1f} | {r['state'] / mib:.1f} | {(r['peak'] - r['state']) / mib:.1f} | "
            f"{r['gathered'] / mib:.2f} | {r['scattered'] / mib:.2f} |"
        )
