"""The traced step against the eager reference, on the GPT of examples/train_gpt.py.

    python benchmarks/jit_vs_eager.py [--world-size 2] [--steps 30]

Arms, interleaved step by step so that drift of the machine hits all of them alike:
  eager                      fs.Schedule(trace=False)
  traced, keep parameters    fs.Schedule(prefetch=1, reshard_after_forward=False)   (same bytes as eager)
  traced, reshard            fs.Schedule(prefetch=1, reshard_after_forward=True)    (1.5x bytes)
Step time is the max over ranks of each step's wall time; printed: median, interquartile range,
ratio to eager, bytes per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.data import CharTokenizer, batches, load_text
from functional_shard.models import GPT, GPTConfig

ARMS = {
    "eager": fs.Schedule(trace=False),
    "traced, keep parameters": fs.Schedule(prefetch=1, reshard_after_forward=False),
    "traced, reshard": fs.Schedule(prefetch=1, reshard_after_forward=True),
}


def main(steps: int, warmup: int, world_size: int, batch_size: int):
    mesh = fs.init_mesh({"fsdp": world_size})
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    torch.manual_seed(0)
    # The defaults of examples/train_gpt.py.
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=2, n_head=4, d_model=128))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    runs = {}
    for name, schedule in ARMS.items():
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=3e-3, weight_decay=0.1), schedule=schedule)
        runs[name] = [step, step.init(params), [], None]
    generator = torch.Generator().manual_seed(mesh.rank)
    for i in range(warmup + steps):
        batch = batches(tokens, batch_size, 64, generator=generator)
        for name, run in runs.items():
            step, state = run[0], run[1]
            mesh.all_reduce_flat(torch.zeros(1))  # start together
            start = time.perf_counter()
            state, metrics = step(state, batch)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            slowest = float(mesh.all_gather_world(elapsed).max())
            run[1], run[3] = state, metrics
            if i >= warmup:
                run[2].append(slowest)
    report = {}
    eager_median = statistics.median(runs["eager"][2])
    for name, (step, state, times, metrics) in runs.items():
        q = statistics.quantiles(times, n=4)
        report[name] = {
            "median_ms": 1e3 * statistics.median(times),
            "iqr_ms": 1e3 * (q[2] - q[0]),
            "ratio_to_eager": statistics.median(times) / eager_median,
            "all_gather_bytes": metrics["all_gather_bytes"],
            "reduce_scatter_bytes": metrics["reduce_scatter_bytes"],
        }
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    report = fs.launch(main, world_size=args.world_size, args=(args.steps, args.warmup, args.world_size, args.batch_size))
    print(f"GPT of examples/train_gpt.py, world size {args.world_size}, {args.steps} steps after {args.warmup} warm-ups")
    print(f"{'arm':<26}{'median ms':>11}{'IQR ms':>9}{'x eager':>9}{'all-gather B':>14}{'reduce-scatter B':>18}")
    for name, r in report.items():
        print(f"{name:<26}{r['median_ms']:>11.1f}{r['iqr_ms']:>9.1f}{r['ratio_to_eager']:>9.3f}"
              f"{r['all_gather_bytes']:>14}{r['reduce_scatter_bytes']:>18}")
