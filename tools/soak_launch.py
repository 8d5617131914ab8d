"""Soak the local launcher: many two-rank launches, each in a fresh `python` process.

Every run is `python tools/soak_launch.py --one`: an `fs.launch` of a few traced
`fs.sharded_step` steps on a small MLP. A fresh interpreter per run is the point: a crash at
interpreter shutdown (the gloo teardown race, "terminate called without an active exception"
then SIGABRT) shows only in the exit status and stderr of a process that really exits.

    python tools/soak_launch.py --runs 300

A run is abnormal if its exit code is not 0, a signal ended it, it timed out, or its stderr
holds "terminate called". Prints one line per abnormal run, then the counts and timings;
exits 1 if any run was abnormal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(steps: int) -> float:
    """The body of every rank: `steps` traced sharded steps on a small MLP; the last loss."""
    import torch
    import torch.nn.functional as F

    import functional_shard as fs
    from functional_shard.models import MLP

    mesh = fs.init_mesh({"fsdp": int(os.environ["WORLD_SIZE"])}, timeout=60)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(16, 32, 4, n_blocks=2))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2))
    state = step.init(params)
    generator = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator))
    for _ in range(steps):
        state, metrics = step(state, batch)
    return float(metrics["loss"])


def one(steps: int, world_size: int) -> None:
    import functional_shard as fs

    loss = fs.launch(train, world_size=world_size, args=(steps,))
    print(f"final loss {loss:.4f}")


def soak(runs: int, steps: int, world_size: int, timeout: float) -> int:
    environment = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(Path(__file__).resolve()), "--one", "--steps", str(steps), "--world-size", str(world_size)]
    durations: list[float] = []
    abnormal: dict[str, int] = {"exit code": 0, "signal": 0, "terminate called": 0, "timed out": 0}
    bad_runs = 0
    start = time.monotonic()
    for index in range(runs):
        began = time.monotonic()
        try:
            done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            abnormal["timed out"] += 1
            bad_runs += 1
            print(f"run {index}: timed out after {timeout} s; stderr tail: {(expired.stderr or '')[-500:]!r}", flush=True)
            continue
        durations.append(time.monotonic() - began)
        reasons = []
        if done.returncode < 0:
            abnormal["signal"] += 1
            reasons.append(f"signal {-done.returncode}")
        elif done.returncode != 0:
            abnormal["exit code"] += 1
            reasons.append(f"exit code {done.returncode}")
        if "terminate called" in done.stderr:
            abnormal["terminate called"] += 1
            reasons.append('"terminate called" in stderr')
        if reasons:
            bad_runs += 1
            print(f"run {index}: {', '.join(reasons)}; stderr tail: {done.stderr[-800:]!r}", flush=True)
        if (index + 1) % 10 == 0:
            print(f"{index + 1}/{runs} runs, {bad_runs} abnormal, {time.monotonic() - start:.0f} s", flush=True)
    total = time.monotonic() - start
    print(f"\n{runs} launches of {world_size} ranks x {steps} traced steps: {bad_runs} abnormal {abnormal}")
    if durations:
        ordered = sorted(durations)
        print(
            f"seconds per launch (fresh interpreter included): mean {statistics.mean(ordered):.2f}, "
            f"median {statistics.median(ordered):.2f}, p90 {ordered[int(0.9 * (len(ordered) - 1))]:.2f}, "
            f"max {ordered[-1]:.2f}; total {total:.0f} s"
        )
    return 1 if bad_runs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300, help="number of launches (default 300)")
    parser.add_argument("--steps", type=int, default=3, help="traced steps per launch (default 3)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per launch (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one launch may take (default 300)")
    parser.add_argument("--one", action="store_true", help="run a single launch in this process (what each run does)")
    options = parser.parse_args()
    if options.one:
        one(options.steps, options.world_size)
        return 0
    return soak(options.runs, options.steps, options.world_size, options.timeout)


if __name__ == "__main__":
    sys.exit(main())
