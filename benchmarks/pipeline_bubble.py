"""Measured pipeline bubble per rank against theory, and the Gantt chart of one pipelined step.

    .venv/bin/python benchmarks/pipeline_bubble.py            # pp 2, M 4 and 8, every built-in schedule
    .venv/bin/python benchmarks/pipeline_bubble.py --quick    # one schedule, M 4, few repeats

A GPT whose stages are balanced (8 blocks at pp 2: 4 each; the embedding joins stage 0, the small
head and the loss the last) trains a few steps, then `step.profile` times every action of
`repeats` steps on every rank (one clock for the machine, `time.perf_counter_ns`; waits for
received tensors left out of compute). Per rank, the idle fraction is
1 - (time in F/B/I/W) / (the step's makespan: first compute start to last compute end over the
ranks); the table gives its median over the repeats beside the theory of `fs.pipeline.analyze`
at costs F = 1, B = 2 (I = W = 1): (P-1)/(M+P-1) for GPipe and 1F1B. The chart
(docs/images/pipeline_gantt.png) shows one 1F1B step at M = 8, a row per rank.

Only 2 ranks: on a 2-core machine more processes than cores time-share them and the bubble is
the scheduler's, not the pipeline's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig
from functional_shard.pipeline import Action, Costs, analyze

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def rank_main(mesh, schedule: str, microbatches: int, repeats: int, d_model: int, layers: int):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=layers, n_head=4, d_model=d_model, tie_weights=False))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=microbatches, pipeline=schedule)
    state = step.init(params)
    x = torch.randint(0, 64, (2 * microbatches, 64), generator=torch.Generator().manual_seed(0))
    batch = (x, torch.roll(x, -1, 1))
    for _ in range(2):
        state, _ = step(state, batch)
    return [step.profile(state, batch) for _ in range(repeats)], step.schedule


def idle_fractions(profiles) -> list[float]:
    compute = [[(b, e) for a, b, e in p.events if Action.parse(a).is_compute] for p in profiles]
    start, end = min(c[0][0] for c in compute), max(c[-1][1] for c in compute)
    return [1 - p.compute_ns / (end - start) for p in profiles]


def gantt(profiles, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "#4c72b0", "B": "#55a868", "I": "#8172b2", "W": "#ccb974"}
    compute = [[(a, b, e) for a, b, e in p.events if Action.parse(a).is_compute] for p in profiles]
    zero = min(c[0][1] for c in compute)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.7 * len(profiles)))
    for row, events in enumerate(compute):
        for name, b, e in events:
            a = Action.parse(name)
            ax.barh(row, (e - b) / 1e6, left=(b - zero) / 1e6, color=colours[a.kind.value], edgecolor="white")
            ax.text((b + e - 2 * zero) / 2e6, row, f"{a.kind.value}{a.microbatch}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(profiles)), [f"pp rank {p.rank}" for p in profiles])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--gantt", default=os.path.join(os.path.dirname(__file__), "..", "docs", "images", "pipeline_gantt.png"))
    args = parser.parse_args()
    runs = [("1f1b", 4)] if args.quick else [(s, m) for m in (4, 8) for s in SCHEDULES]
    repeats = 2 if args.quick else args.repeats
    d, layers = (64, 4) if args.quick else (args.d_model, args.layers)
    print(f"# pipeline bubble, pp 2, GPT d_model {d}, {layers} blocks, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| schedule | M | idle rank 0 | idle rank 1 | theory (F=1, B=2) | in flight per stage, measured | predicted bytes / measured |")
    print("|---|---|---|---|---|---|---|")
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        for schedule, m in runs:
            results = world.run(rank_main, schedule, m, repeats, d, layers)
            per_repeat = [idle_fractions([r[0][k] for r in results]) for k in range(repeats)]
            medians = [statistics.median(x[rank] for x in per_repeat) for rank in range(2)]
            theory = analyze(results[0][1].compute_only(), Costs(forward=1, backward=2, input_grad=1, weight_grad=1))
            last = [r[0][-1] for r in results]
            peaks = {s: v for p in last for s, v in sorted(p.in_flight_peak.items())}
            ratio = max(p.predicted_bytes[s] / p.in_flight_bytes[s] for p in last for s in p.in_flight_bytes)
            print(f"| {schedule} | {m} | {medians[0]:.3f} | {medians[1]:.3f} | {theory.bubble[0]:.3f} | {peaks} | {ratio:.4f} |")
            sys.stdout.flush()
            if schedule == "1f1b" and (m == 8 or args.quick) and args.gantt:
                gantt(last, args.gantt, f"fs 1F1B, pp 2, M {m} (GPT d {d}, {layers} blocks): compute per rank")


if __name__ == "__main__":
    main()
