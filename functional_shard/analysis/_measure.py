"""Measuring schedules of one step on every rank: step time and peak memory, interleaved.

What `autotune` confirms its predictions with. Each schedule's graph (what
`sharded_step(..., schedule=s)` would run) is run by hand on the caller's state and batch, as
`fs.analysis.profile` does: the state is never
advanced (a donating step runs on copies), and the caller's random number generator is left
as it was. A collective: every rank runs every measurement, and every figure is the same on
every rank (each run's time is the slowest rank's, each peak the largest rank's), so
decisions taken from them cannot differ between ranks.

Timing is made robust to a shared, noisy machine: one untimed run per schedule (under the
memory tracker) and `warmup` more, then `rounds` rounds in which every schedule runs `steps`
times, the order of the schedules rotating from round to round, so that drift of the machine
hits every schedule alike; a schedule's time is the median of all its timed runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._make_step import sharded_step
from .._step import ShardedStep
from ._calibrate import _everyone

__all__ = ["Measurement", "measure", "with_schedule"]


class Measurement(NamedTuple):
    """One schedule of a step, measured on every rank (identical on every rank)."""

    step_s: float  # median over the timed runs of the slowest rank's wall time
    times_s: tuple  # every timed run's slowest-rank wall time, in the order they ran
    peak_bytes: int  # MemTracker's peak ('Total', the state and batch included) of one run, largest over ranks


def with_schedule(step: ShardedStep, schedule) -> ShardedStep:
    """A step like `step` (loss, mesh, optimizer, units, precision, donation, micro-batches,
    what it does with a gradient that is not finite, tensor-parallel placements) with another
    `fs.Schedule`."""
    return sharded_step(
        step.loss_fn,
        step.mesh,
        optimizer=step.optimizer,
        schedule=schedule,
        units=step.units,
        has_aux=step.has_aux,
        donate=step.donate,
        precision=step.precision,
        microbatches=step.microbatches,
        nonfinite=step.nonfinite,
        placements=step.placements,
    )


def measure(mesh, runs: Sequence[tuple[Any, list]], *, donate: bool, rounds: int, steps: int, warmup: int) -> list[Measurement]:
    """Measure every `(compiled, inputs)` of `runs`, interleaved; a collective.

    Arguments:
        mesh: the step's mesh.
        runs: `(compiled, graph inputs)` per schedule (a `CompiledStep`: its `run` is called);
            every rank passes the same schedules in the same order.
        donate: the step updates its inputs in place: each run gets copies.
        rounds / steps / warmup: see the module's docstring.
    """
    device = getattr(mesh, "device", torch.device("cpu"))
    peaks = [_peak(mesh, compiled, inputs, donate, device) for compiled, inputs in runs]
    for _ in range(warmup):
        for compiled, inputs in runs:
            _timed(mesh, compiled, inputs, donate, device)
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(rounds):
        order = [(round_ + i) % len(runs) for i in range(len(runs))]
        for i in order:
            compiled, inputs = runs[i]
            for _ in range(steps):
                times[i].append(_timed(mesh, compiled, inputs, donate, device))
    return [Measurement(statistics.median(t), tuple(t), peak) for t, peak in zip(times, peaks)]


def _fresh(inputs: list, donate: bool) -> list:
    # A donating step's graph updates its inputs in place: keep the caller's state intact.
    return [t.clone() for t in inputs] if donate else inputs


def _run(compiled, args: list, device: torch.device) -> None:
    # The graph draws from the global generator (dropout): restore the caller's afterwards.
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        compiled.run(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(mesh, compiled, inputs: list, donate: bool, device: torch.device) -> float:
    args = _fresh(inputs, donate)
    mesh.all_reduce_flat(torch.zeros(1, device=device))  # start together
    start = time.perf_counter()
    _run(compiled, args, device)
    elapsed = time.perf_counter() - start
    return max(row[0] for row in _everyone(mesh, [elapsed]))


def _peak(mesh, compiled, inputs: list, donate: bool, device: torch.device) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    args = _fresh(inputs, donate)
    tracker = MemTracker()
    tracker.track_external(*args)
    mesh.all_reduce_flat(torch.zeros(1, device=device))
    with tracker:
        _run(compiled, args, device)
    return int(max(row[0] for row in _everyone(mesh, [float(_tracked_total(tracker, device.type))])))


def _tracked_total(tracker, device_type: str) -> int:
    """MemTracker's peak 'Total' bytes on devices of `device_type` (what benchmarks/_gpt.py's
    `cpu_total` reads for the CPU)."""
    total = 0
    for device, categories in tracker.get_tracker_snapshot("peak").items():
        if torch.device(device).type == device_type:
            total += int(next((v for k, v in categories.items() if str(getattr(k, "value", k)) == "Total"), 0))
    return total
