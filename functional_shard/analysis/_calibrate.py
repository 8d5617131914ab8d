"""`calibrate(mesh)`: measure this machine's constants for the simulator (a `Machine`).

Every rank runs the same measurements, at the same time (it is a collective):

- dispatch: a one-element `aten.add` and a `aten.view`, called as a traced graph calls them;
- matrix products: square `mm`s from 32 to 1024 (FLOP/s by size, whole calls);
- memory traffic: `aten.add` over 10^3 to 4·10^6 elements (bytes/s by size, whole calls);
- collectives: the mesh's own all-gather, reduce-scatter and all-reduce of full buffers from
  16 KiB to 16 MiB, each timed as its slowest rank; latency and bus bandwidth fitted by least
  squares (`Machine.collective_seconds`);
- overlap: a 16 MiB all-gather issued asynchronously (`torch.distributed`, default group)
  while the rank multiplies matrices for about as long: the time lost against perfect
  overlap, over the shorter of the two, is `overlap_penalty`.

Compute constants are averaged over ranks, communication constants are the slowest rank's.
Timings are medians of repeats; on a shared machine they carry its noise.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ._machine import Machine

__all__ = ["calibrate"]

_aten = torch.ops.aten


def _median_seconds(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _per_call(fn, calls: int) -> float:
    def loop():
        for _ in range(calls):
            fn()

    return _median_seconds(loop, 5) / calls


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares `t = a + b x` over (x, t); a and b clamped to be non-negative."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (t - my) for x, t in points) / sxx if sxx else 0.0
    b = max(b, 1e-15)
    a = max(my - b * mx, 0.0)
    return a, b


def calibrate(mesh, *, path: str | None = None, name: str | None = None, quick: bool = False) -> Machine:
    """Measure this machine's compute and communication constants (a collective: every rank calls it).

    Arguments:
        mesh: the `fs.Mesh` to measure (its collectives, at its size).
        path: if given, the `Machine` is also saved there as JSON (`fs.analysis.load_machine`).
        name: a description to store (default: the mesh and the torch thread count).
        quick: fewer sizes and repeats (seconds instead of tens of seconds), for tests.

    Returns the `Machine`; identical on every rank.
    """
    device = getattr(mesh, "device", torch.device("cpu"))
    one = torch.ones(1, device=device)
    overhead = _per_call(lambda: _aten.add.Tensor(one, one), 2000 if not quick else 300)
    view_overhead = _per_call(lambda: _aten.view.default(one, [1]), 2000 if not quick else 300)

    matmul = []
    for n in (32, 128, 512) if quick else (32, 64, 128, 256, 512, 1024):
        a = torch.randn(n, n, device=device)
        seconds = _median_seconds(lambda: _aten.mm.default(a, a), 3 if quick else 5)
        matmul.append((2.0 * n**3, 2.0 * n**3 / seconds))
    bandwidth = []
    for numel in (1_000, 100_000, 1_000_000) if quick else (1_000, 10_000, 100_000, 1_000_000, 4_000_000):
        x = torch.randn(numel, device=device)
        seconds = _median_seconds(lambda: _aten.add.Tensor(x, x), 3 if quick else 7)
        bandwidth.append((12.0 * numel, 12.0 * numel / seconds))

    latency, bus = {}, {}
    p = mesh.num_shards
    sizes = (1 << 14, 1 << 20, 1 << 22) if quick else (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    operations = {
        "all_gather": lambda full: mesh.all_gather_flat(torch.empty(full // 4 // p, device=device)),
        "reduce_scatter": lambda full: mesh.reduce_scatter_flat(torch.ones(full // 4 // p * p, device=device)),
        "all_reduce": lambda full: mesh.all_reduce_flat(torch.ones(full // 4, device=device)),
    }
    for kind, run in operations.items():
        points = []
        for full in sizes:
            seconds = _slowest(mesh, _collective_seconds(mesh, lambda: run(full), 2 if quick else 4))
            share = (p - 1) / p * (2 if kind == "all_reduce" else 1) if p > 1 else 1.0
            points.append((share * full, seconds))
        latency[kind], per_byte = _fit(points)
        bus[kind] = 1.0 / per_byte
    issue, penalty = _overlap(mesh, device, 1 << 22 if quick else 1 << 24)
    machine = Machine(
        name=name or f"calibrated: {mesh.describe()}, {torch.get_num_threads()} threads per rank",
        matmul_flops=_average(mesh, matmul),
        memory_bandwidth=_average(mesh, bandwidth),
        op_overhead_s=_mean(mesh, overhead),
        view_overhead_s=_mean(mesh, view_overhead),
        collective_latency_s=latency,
        collective_bandwidth=bus,
        issue_overhead_s=_slowest(mesh, issue),
        overlap_penalty=min(1.0, max(0.0, _slowest(mesh, penalty))),
    )
    if path is not None and mesh.rank == 0:
        machine.save(path)
    return machine


def _collective_seconds(mesh, fn, repeat: int) -> float:
    times = []
    fn()
    for _ in range(repeat):
        mesh.all_reduce_flat(torch.zeros(1, device=getattr(mesh, "device", "cpu")))  # start together
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _everyone(mesh, values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    return mesh.all_gather_world(mine.to(getattr(mesh, "device", "cpu"))).view(mesh.world_size, -1).cpu().tolist()


def _slowest(mesh, value: float) -> float:
    return max(row[0] for row in _everyone(mesh, [value]))


def _mean(mesh, value: float) -> float:
    return statistics.mean(row[0] for row in _everyone(mesh, [value]))


def _average(mesh, points: list[tuple[float, float]]) -> tuple:
    rows = _everyone(mesh, [rate for _, rate in points])
    return tuple((size, statistics.mean(row[i] for row in rows)) for i, (size, _) in enumerate(points))


def _overlap(mesh, device, full_bytes: int) -> tuple[float, float]:
    """(seconds to issue an asynchronous all-gather, overlap penalty) on this rank."""
    if not dist.is_initialized() or mesh.world_size == 1:
        return 0.0, 0.0
    world = dist.get_world_size()
    shard = torch.ones(full_bytes // 4 // world, device=device)
    out = torch.empty(shard.numel() * world, device=device)

    def communicate():
        dist.all_gather_into_tensor(out, shard)

    a = torch.randn(256, 256, device=device)
    comm = _collective_seconds(mesh, communicate, 3)
    per_mm = _median_seconds(lambda: a @ a, 5)
    count = max(1, int(comm / per_mm))

    def compute():
        for _ in range(count):
            a @ a

    compute_s = _median_seconds(compute, 3)
    issues, boths = [], []
    for _ in range(3):
        mesh.all_reduce_flat(torch.zeros(1, device=device))
        start = time.perf_counter()
        work = dist.all_gather_into_tensor(out, shard, async_op=True)
        issued = time.perf_counter()
        compute()
        work.wait()
        boths.append(time.perf_counter() - start)
        issues.append(issued - start)
    both = statistics.median(boths)
    penalty = (both - max(comm, compute_s)) / min(comm, compute_s)
    return statistics.median(issues), penalty
