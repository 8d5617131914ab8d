"""Rematerialization (`fs.Schedule(remat=...)`): peak memory and step time, none, full and selective.

    python benchmarks/remat_memory.py [--world-size 2] [--steps 10] [--n-layer 8] [--d-model 128]

A GPT (examples/train_gpt.py's corpus and tokenizer, block size 64, 4 heads) trained with AdamW,
batch 16 sequences of 64 tokens per rank. Arms, interleaved step by step so that drift of the
machine hits all of them alike:
  no remat      fs.Schedule()                 (prefetch 1, reshard after forward)
  remat all     fs.Schedule(remat=True)       (every unit's forward recomputed before its backward)
  selective     fs.Schedule(remat=fs.schedule.RematPolicy())   (matrix products kept, the rest recomputed)
Printed per arm: peak tensor memory of one untimed step on rank 0 (`MemTracker`, 'Total', the
state and the batch registered with `track_external` first, as benchmarks/_runner.py does), the
state's own bytes, peak minus state (what the step allocates: activations, gathered parameters,
gradients), the median and interquartile range of the step time (max over ranks), and whether
the trained parameters are bit-identical to the no-remat arm's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs
from _gpt import corpus_gpt, cpu_total
from functional_shard.data import batches
from functional_shard.models import GPT

ARMS = {
    "no remat": fs.Schedule(),
    "remat all": fs.Schedule(remat=True),
    "selective": fs.Schedule(remat=fs.schedule.RematPolicy()),
}


def _state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in fs.tree_leaves(state) if isinstance(t, torch.Tensor))


def run(mesh_axes: dict, steps: int, warmup: int, batch_size: int, n_layer: int, d_model: int) -> dict:
    mesh = fs.init_mesh(mesh_axes)
    tokens, config, params, loss_fn = corpus_gpt(n_layer, d_model)

    runs = {}
    for name, schedule in ARMS.items():
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=3e-3, weight_decay=0.1), schedule=schedule)
        runs[name] = {"step": step, "state": step.init(params), "times": []}
    generator = torch.Generator().manual_seed(1 + mesh.rank)
    for i in range(warmup + steps):
        batch = batches(tokens, batch_size, 64, generator=generator)
        for run_ in runs.values():
            mesh.all_reduce_flat(torch.zeros(1))  # start together
            start = time.perf_counter()
            run_["state"], _ = run_["step"](run_["state"], batch)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            if i >= warmup:
                run_["times"].append(float(mesh.all_gather_world(elapsed).max()))
    batch = batches(tokens, batch_size, 64, generator=generator)
    report = {}
    for name, run_ in runs.items():
        step, state = run_["step"], run_["state"]
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(state), *batch)
        mesh.all_reduce_flat(torch.zeros(1))
        with tracker:
            state, _ = step(state, batch)
        run_["state"] = state
        q = statistics.quantiles(run_["times"], n=4)
        report[name] = {
            "peak_bytes": cpu_total(tracker, "peak"),
            "state_bytes": _state_bytes(state),
            "median_ms": 1e3 * statistics.median(run_["times"]),
            "iqr_ms": 1e3 * (q[2] - q[0]),
            "rematerialized": fs.schedule.rematerialized(step.schedule_events),
        }
    reference = fs.tree_leaves(runs["no remat"]["state"])
    for name, run_ in runs.items():
        report[name]["same_bits"] = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(run_["state"]), reference))
    report["config"] = {"n_layer": n_layer, "d_model": d_model, "vocab_size": config.vocab_size, "params": GPT(config).num_params()}
    return report


def print_report(report: dict, world_size: int, batch_size: int, steps: int) -> None:
    config = report.pop("config")
    mib = 2**20
    print(
        f"GPT n_layer={config['n_layer']} d_model={config['d_model']} n_head=4 vocab={config['vocab_size']} "
        f"({config['params'] / 1e6:.2f}M parameters), world size {world_size}, batch {batch_size} x 64 tokens per rank, "
        f"{steps} timed steps"
    )
    print(f"{'arm':<11}{'peak MiB':>10}{'state MiB':>11}{'peak-state MiB':>16}{'median ms':>11}{'IQR ms':>8}{'same bits':>11}")
    for name, r in report.items():
        print(
            f"{name:<11}{r['peak_bytes'] / mib:>10.1f}{r['state_bytes'] / mib:>11.1f}"
            f"{(r['peak_bytes'] - r['state_bytes']) / mib:>16.1f}{r['median_ms']:>11.1f}{r['iqr_ms']:>8.1f}{str(r['same_bits']):>11}"
        )
    base = report["no remat"]
    for name in ("remat all", "selective"):
        remat = report[name]
        print(
            f"{name}: peak {100 * (1 - remat['peak_bytes'] / base['peak_bytes']):.1f}% lower, "
            f"step time x{remat['median_ms'] / base['median_ms']:.2f}; units recomputed: {', '.join(remat['rematerialized'])}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    args = parser.parse_args()
    report = fs.launch(
        run,
        world_size=args.world_size,
        args=({"fsdp": args.world_size}, args.steps, args.warmup, args.batch_size, args.n_layer, args.d_model),
    )
    print_report(report, args.world_size, args.batch_size, args.steps)
