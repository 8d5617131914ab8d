"""Rematerialization inside pipeline stages: step time and in-flight bytes per remat choice.

    .venv/bin/python benchmarks/pipeline_remat.py                 # 1f1b and zbv, every arm
    .venv/bin/python benchmarks/pipeline_remat.py --schedules 1f1b --steps 3

A GPT (d_model 256, 8 blocks, sequence 128; 16 rows in 8 micro-batches) at `{"pp": 2}` on two
gloo processes, one thread each. Per schedule, every arm (no remat, `RematPolicy()`,
`RematPolicy(every_other_mm=True)`, `RematPolicy(save=())`, whole stages with `remat=True`) is
built side by side on the same processes and the timed steps are interleaved (one step of each
arm per round); a step's time is the slowest rank's, the table gives the median. In flight: the
most bytes each stage's micro-batches hold for their backward at once, measured by
`step.profile` and predicted on fake tensors by the same code (`fs.analysis`'s figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig
from functional_shard.schedule import RematPolicy

ARMS = {
    "none": False,
    "RematPolicy() (dots)": RematPolicy(),
    "RematPolicy(every_other_mm=True)": RematPolicy(every_other_mm=True),
    "RematPolicy(save=())": RematPolicy(save=()),
    "remat=True (whole stages)": True,
}


def rank_main(mesh, schedule: str, steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=8, n_head=4, d_model=256, tie_weights=False))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    x = torch.randint(0, 64, (16, 128), generator=torch.Generator().manual_seed(0))
    batch = (x, torch.roll(x, -1, 1))
    pipeline = fs.pipeline.Pipeline(schedule, stages_per_rank=2 if schedule in ("zbv", "interleaved_1f1b") else 1)
    arms = {}
    for name, remat in ARMS.items():
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), microbatches=8, pipeline=pipeline,
                               schedule=fs.Schedule(remat=remat))  # fmt: skip
        state, _ = step(step.init(params), batch)  # traced, warm
        arms[name] = [step, state, []]
    for _ in range(steps):
        for entry in arms.values():
            mesh.all_reduce_flat(torch.zeros(1))
            start = time.perf_counter()
            entry[1], _ = entry[0](entry[1], batch)
            entry[2].append(time.perf_counter() - start)
    out = {}
    for name, (step, state, times) in arms.items():
        profile = step.profile(state, batch)
        out[name] = (times, dict(profile.in_flight_bytes), dict(profile.predicted_bytes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zbv"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"# pipeline remat, GPT d_model 256, 8 blocks, pp 2, M 8; load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print("| schedule | remat | step ms (median, slowest rank) | in flight per stage, MiB (measured) | predicted |")
    print("| --- | --- | ---: | --- | --- |")
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        for schedule in args.schedules:
            results = world.run(rank_main, schedule, args.steps)
            for name in ARMS:
                times = [max(r[name][0][k] for r in results) for k in range(args.steps)]
                measured = dict(sorted((k, v) for r in results for k, v in r[name][1].items()))
                predicted = dict(sorted((k, v) for r in results for k, v in r[name][2].items()))
                mib = lambda d: ", ".join(f"{v / 2**20:.2f}" for v in d.values())  # noqa: E731
                print(f"| {schedule} | {name} | {statistics.median(times) * 1e3:.0f} | {mib(measured)} | {mib(predicted)} |", flush=True)


if __name__ == "__main__":
    main()
