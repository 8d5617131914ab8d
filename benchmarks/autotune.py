"""The autotuner's acceptance: on the GPT benchmark workload, with a budget equal to the default
schedule's measured peak, `fs.analysis.autotune` returns a schedule at least as fast as the
default (measured) and within the budget (measured).

    python benchmarks/autotune.py [--world-size 2] [--batch-size 4] [--rounds 6] [--steps 2] [--budget-factor 1.0]

Workload: compare.py's GPT (`_workloads.Workload("gpt")`: 8 layers, d_model 256, 4 heads,
sequence 128, untied head), AdamW (lr 1e-3, weight decay 0.1), donate=True as compare.py's fs
arms, gloo, one thread per rank. Every rank:

1. default: `fs.sharded_step(..., schedule=fs.Schedule())`, one warm-up step, then one step
   under `MemTracker` (the state and batch tracked as external memory, as the other memory
   benchmarks do): its peak, the largest over ranks, is the budget (times `--budget-factor`,
   1 for the acceptance; more shows what the tuner does with room to spare);
2. `fs.analysis.calibrate(mesh)`, then `fs.analysis.autotune(step, state, batch,
   budget_bytes=budget, machine=...)` with the default search space (54 schedules);
3. the check, independent of the tuner's own measurements: two fresh steps, one with the chosen
   schedule and one with the default, train side by side, interleaved step by step (`--rounds`
   rounds of `--steps` steps each, the order alternating: an even number of rounds puts each
   arm first equally often), times the slowest rank's; then one step of each under
   `MemTracker`. Met: the tuned median step time is at most the default's (or the tuner kept
   the default schedule: then both arms run the same schedule, and what the check shows is the
   machine's noise), and its measured peak at most the budget.

Timings on a shared machine are noisy: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs
from _gpt import cpu_total
from _workloads import Workload

MIB = 2**20


def _slowest(mesh, seconds: float) -> float:
    return float(mesh.all_gather_world(torch.tensor([seconds], dtype=torch.float64)).max())


def _timed_step(mesh, step, state, batch):
    mesh.all_reduce_flat(torch.zeros(1))  # start together
    start = time.perf_counter()
    state, _ = step(state, batch)
    return state, _slowest(mesh, time.perf_counter() - start)


def _peak(mesh, step, state, batch):
    tracker = MemTracker()
    tracker.track_external(*fs.tree_leaves(state), *batch)
    mesh.all_reduce_flat(torch.zeros(1))
    with tracker:
        state, _ = step(state, batch)
    return state, int(mesh.all_gather_world(torch.tensor([cpu_total(tracker)])).max())


def run(world_size: int, batch_size: int, rounds: int, steps: int, budget_factor: float) -> dict:
    mesh = fs.init_mesh({"fsdp": world_size})
    torch.set_num_threads(1)
    workload = Workload("gpt")
    apply_fn, params = fs.functionalize(workload.build(0))

    def loss_fn(p, batch):
        return workload.loss(apply_fn(p, batch[0]), batch[1])

    def make(schedule):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3, weight_decay=0.1), schedule=schedule, donate=True)
        return step, step.init(params)

    def batch_at(i: int):
        return workload.batch(batch_size, seed=0, rank=mesh.rank, step=i)

    load_before = os.getloadavg()
    default, default_state = make(fs.Schedule())
    default_state, _ = default(default_state, batch_at(0))  # traces
    default_state, default_peak = _peak(mesh, default, default_state, batch_at(1))
    budget = int(default_peak * budget_factor)

    start = time.perf_counter()
    machine = fs.analysis.calibrate(mesh)
    calibration_s = time.perf_counter() - start
    start = time.perf_counter()
    result = fs.analysis.autotune(default, default_state, batch_at(2), budget_bytes=budget, machine=machine)
    tuning_s = time.perf_counter() - start

    # Both arms made afresh, side by side, after the tuning's garbage is collected: neither
    # gets an older state or a warmer cache than the other.
    del default, default_state
    gc.collect()
    arms = {}
    for name, schedule in (("default", fs.Schedule()), ("tuned", result.schedule)):
        step, state = make(schedule)
        state, _ = step(state, batch_at(0))  # traces
        arms[name] = [step, state, []]
    for r in range(rounds):
        order = ["default", "tuned"] if r % 2 == 0 else ["tuned", "default"]
        for s in range(steps):
            batch = batch_at(3 + r * steps + s)
            for name in order:
                arm = arms[name]
                arm[1], seconds = _timed_step(mesh, arm[0], arm[1], batch)
                arm[2].append(seconds)
    peaks = {}
    for name, arm in arms.items():
        arm[1], peaks[name] = _peak(mesh, arm[0], arm[1], batch_at(1000))
    figures = {}
    for name, (_, _, times) in arms.items():
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        figures[name] = {"median_s": statistics.median(times), "q1_s": q[0], "q3_s": q[2], "peak": peaks[name], "times_s": times}
    return {
        "budget": budget,
        "result": result,
        "figures": figures,
        "calibration_s": calibration_s,
        "tuning_s": tuning_s,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "threads": torch.get_num_threads(),
    }


def report(out: dict, args) -> None:
    result, figures, budget = out["result"], out["figures"], out["budget"]
    print(
        f"GPT benchmark workload (8 layers, d_model 256, sequence 128), batch {args.batch_size} per rank, world size "
        f"{args.world_size}, AdamW, donate=True, {out['threads']} thread per rank"
    )
    print(f"load average before {out['load_before'][0]:.2f}, after {out['load_after'][0]:.2f} (1 min)")
    factor = "" if args.budget_factor == 1 else f" x {args.budget_factor:g}"
    print(f"budget = the default schedule's measured peak{factor}: {budget / MIB:.2f} MiB ({budget} bytes)")
    print(f"calibration {out['calibration_s']:.1f} s, autotune {out['tuning_s']:.1f} s over {len(result.candidates)} schedules\n")
    print(result.table(limit=12))
    print(f"\n(+ {max(0, len(result.candidates) - 12)} more rows)\n")
    print(f"independent check: {args.rounds} rounds x {args.steps} steps per arm, interleaved; peak by MemTracker")
    print("| arm | schedule | median ms | IQR ms | peak MiB |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, schedule in (("default", fs.Schedule()), ("tuned", result.schedule)):
        f = figures[name]
        print(f"| {name} | {schedule!r} | {f['median_s'] * 1e3:.1f} | {(f['q3_s'] - f['q1_s']) * 1e3:.1f} | {f['peak'] / MIB:.2f} |")
    kept = result.schedule == fs.Schedule()
    faster = kept or figures["tuned"]["median_s"] <= figures["default"]["median_s"]
    within = figures["tuned"]["peak"] <= budget
    ratio = figures["tuned"]["median_s"] / figures["default"]["median_s"]
    wins = sum(t < d for t, d in zip(figures["tuned"]["times_s"], figures["default"]["times_s"]))
    verdict = "the same schedule (the tuner kept the default)" if kept else ("at least as fast" if faster else "slower")
    print(
        f"\ntuned / default median step time x{ratio:.2f}, tuned faster in {wins} of {len(figures['tuned']['times_s'])} "
        f"paired steps: {verdict}; peak {figures['tuned']['peak'] / MIB:.2f} MiB "
        f"{'within' if within else 'over'} the budget of {budget / MIB:.2f} MiB"
    )
    print(f"acceptance: {'met' if faster and within else 'missed'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-factor", type=float, default=1.0)
    args = parser.parse_args()
    run_args = (args.world_size, args.batch_size, args.rounds, args.steps, args.budget_factor)
    out = fs.launch(run, world_size=args.world_size, args=run_args, threads_per_rank=1)
    report(out, args)


if __name__ == "__main__":
    main()
