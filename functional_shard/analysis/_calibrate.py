"""`calibrate(mesh)`: measure this machine's constants for the simulator (a `Machine`).

Every rank runs the same measurements, at the same time (it is a collective):

- dispatch: a one-element `aten.add` and a `aten.view`, called as a traced graph calls them;
- matrix products: square `mm`s from 32 to 1024 (FLOP/s by size, whole calls), operands
  cycled through a pool of 16 MiB per rank: a step's products read weights and activations
  that other work has just pushed out of the core's own caches (one reused operand put the
  GPT's size of product at 59 GFLOP/s per rank at 4 ranks, the pool at 28: the step's
  backward had been predicted 25 % short);
- memory traffic: `aten.add` over 10^3 to 4·10^6 elements (bytes/s by size, whole calls);
- kernel classes (`Machine.op_seconds`): one representative operation per class — `mul` of
  two tensors (elementwise), `exp` and `gelu_backward` (transcendental), a row `sum`
  (reduction), `native_layer_norm` (normalization), `clone` (copy), `where`
  (select) — over 10^2 to 4·10^6 elements, once with each input drawn from a pool larger
  than the caches (`op_seconds`), once with the same two inputs every call
  (`op_seconds_hot`: what an operation costs on the output of the one before it);
- the cache a rank may count on (`cache_bytes`): the device's last-level cache (read from
  Linux's sysfs on a CPU, from the device's properties on a GPU) shared by the ranks on
  its host;
- every compute timing is the median of `repeat` fixed wall-clock windows (`_loop_seconds`)
  that all ranks start together, so that ranks sharing cores are measured sharing them;
- the step's own overhead: a traced `sharded_step` of one small parameter, its call timed
  against its graph alone (the ranks' agreement, guards, packing);
- collectives: the mesh's own all-gather, reduce-scatter and all-reduce of full buffers from
  16 KiB to 16 MiB, each call timed as its slowest rank, the expected time per size the
  trimmed mean of 21 calls (`_expected_collective_seconds`); latency and bus bandwidth fitted
  by least squares (`Machine.collective_seconds`);
- overlap: a 16 MiB all-gather issued as a traced graph issues it (the functional
  collective, waited later) while the rank multiplies matrices for about as long: the time
  lost against perfect overlap, over the shorter of the two, is `overlap_penalty`;
- issuing: the time the call that issues a functional all-gather takes before it returns,
  at the sizes of the collective sweep, fitted as `issue_overhead_s` + `issue_seconds_per_byte`
  × full bytes (the call allocates the output and hands the input to the communication thread).

Compute constants are averaged over ranks, communication constants are the slowest rank's.
Timings are medians of repeats; on a shared machine they carry its noise. On a GPU every clock
read first waits for the work queued on the device (`_clock`), so that kernels are timed, not
their launches.
"""

from __future__ import annotations

import glob
import itertools
import os
import socket
import statistics
import time
import zlib

import torch
import torch.distributed as dist

from ._machine import Machine

__all__ = ["calibrate"]

_aten = torch.ops.aten


def _clock(device):
    """A wall clock to read once `device` has run the work queued on it so far: a GPU queues
    kernels and returns, a CPU has already run them (its clock is `time.perf_counter` itself,
    so that timing a small operation adds nothing to it)."""
    if torch.device(device).type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _median_seconds(fn, repeat: int, device) -> float:
    clock = _clock(device)
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def _loop_seconds(fn, min_loop_s: float, repeat: int = 5, *, device) -> float:
    """Seconds per call of `fn`: the median over `repeat` windows of `min_loop_s` wall-clock
    seconds each, calling `fn` until the window closes. Ranks that start together (the callers
    synchronise first) are busy for the same windows, so ranks sharing cores are measured
    sharing them for the whole window; a fixed count of calls would let a rank that finishes
    early leave the core to its neighbour for the rest of the neighbour's loop."""
    clock = _clock(device)
    fn()  # warm-up
    start = clock()
    fn()
    # Calls between clock reads: about 1/20 of a window, so the clock costs nothing measurable.
    chunk = max(1, int(min_loop_s / 20 / max(clock() - start, 1e-7)))
    per_call = []
    for _ in range(repeat):
        results = []  # kept to the window's end: each call writes fresh memory, as a step's do
        start = clock()
        deadline = start + min_loop_s
        while True:
            for _ in range(chunk):
                results.append(fn())
            now = clock()
            if now >= deadline:
                break
        per_call.append((now - start) / len(results))
    return statistics.median(per_call)


def _pool(numel: int, device, pool_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, y, y > 0) triples of distinct random tensors of `numel` elements, together at least
    `pool_bytes`: cycling through them keeps the inputs out of the caches, as most of a step's
    are. The mask is made here: it is an input of the step's `where`, not part of its work."""
    count = max(2, pool_bytes // (4 * numel))
    if torch.device(device).type == "cuda":  # small operations there are bound by their launch
        count = min(count, 4096)
    tensors = [torch.randn(numel, device=device) for _ in range(count)]
    return [(x, y, _aten.gt.Scalar(y, 0.0)) for x, y in zip(tensors, tensors[1:] + tensors[:1])]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as rows of 256 elements (one row if its size is not a multiple)."""
    width = min(x.numel(), 256)
    return x.view(-1, width) if x.numel() % width == 0 else x.view(1, -1)


# kernel class -> representative operations (x, y, mask) -> result
_CLASS_OPERATIONS = {
    "elementwise": (lambda x, y, mask: _aten.mul.Tensor(x, y),),
    "transcendental": (lambda x, y, mask: _aten.exp.default(x), lambda x, y, mask: _aten.gelu_backward.default(x, y)),
    "reduction": (lambda x, y, mask: _aten.sum.dim_IntList(_rows(x), [-1]),),
    "normalization": (lambda x, y, mask: _aten.native_layer_norm.default(_rows(x), [_rows(x).shape[-1]], None, None, 1e-5),),
    "copy": (lambda x, y, mask: _aten.clone.default(x),),
    "select": (lambda x, y, mask: _aten.where.self(mask, x, y),),
}


def _op_seconds(mesh, device, sizes, min_loop_s: float, pool_bytes: int) -> dict:
    """kernel class -> ((elements, seconds per call), ...), this rank's (`pool_bytes` 0: two
    inputs reused by every call, in the caches)."""
    curves: dict = {kind: [] for kind in _CLASS_OPERATIONS}
    for numel in sizes:
        pool = _pool(numel, device, pool_bytes)
        for kind, operations in _CLASS_OPERATIONS.items():
            seconds = []
            for op in operations:
                inputs = itertools.cycle(pool)
                mesh.all_reduce_flat(torch.zeros(1, device=device))  # every rank measures at once
                seconds.append(_loop_seconds(lambda op=op, inputs=inputs: op(*next(inputs)), min_loop_s, device=device))
            curves[kind].append((numel, statistics.mean(seconds)))
    return curves


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
    min_loop_s = 0.005 if quick else 0.04
    mesh.all_reduce_flat(torch.zeros(1, device=device))
    overhead = _loop_seconds(lambda: _aten.add.Tensor(one, one), min_loop_s, device=device)
    view_overhead = _loop_seconds(lambda: _aten.view.default(one, [1]), min_loop_s, device=device)

    pool_bytes = (8 if quick else 16) << 20  # the matrix products' operands, per rank
    gpu = device.type == "cuda"
    dtype_scale, attention = {}, 0.0
    if gpu:
        matmul, dtype_scale, attention = _gpu_products(mesh, device, min_loop_s, quick)
    else:
        matmul = _products(mesh, device, (32, 128, 512) if quick else (32, 64, 128, 256, 512, 1024), torch.float32, min_loop_s, pool_bytes)
    bandwidth = []
    for numel in (1_000, 100_000, 1_000_000) if quick else (1_000, 10_000, 100_000, 1_000_000, 4_000_000):
        x = torch.randn(numel, device=device)
        seconds = _median_seconds(lambda: _aten.add.Tensor(x, x), 3 if quick else 7, device)
        bandwidth.append((12.0 * numel, 12.0 * numel / seconds))
    op_sizes = (1_000, 100_000, 1_000_000) if quick else (100, 1_000, 10_000, 100_000, 1_000_000, 4_000_000)
    cold_pool = (8 if quick else 64) << 20
    if gpu:  # a step's activations run to tens of millions of elements; a GPU's L2 holds 50-60 MB
        op_sizes = (1_000, 1_000_000, 16_000_000) if quick else (1_000, 100_000, 1_000_000, 4_000_000, 16_000_000, 64_000_000)
        cold_pool = 1 << 30
    op_seconds = _op_seconds(mesh, device, op_sizes, min_loop_s, cold_pool)
    op_seconds_hot = _op_seconds(mesh, device, op_sizes, min_loop_s, 0)

    sizes = (1 << 14, 1 << 20, 1 << 22) if quick else (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    curves = _collective_curves(mesh, mesh, device, sizes, 3 if quick else 21)
    latency = {kind: value[0] for kind, value in curves.items()}
    bus = {kind: value[1] for kind, value in curves.items()}
    groups = _group_collectives(mesh, device, sizes[:: 2 if quick else 1], 3 if quick else 21)
    penalty = _overlap(mesh, device, 1 << 22 if quick else 1 << 24)
    issue_fixed, issue_per_byte = _issue_cost(mesh, device, sizes, 3 if quick else 7)
    machine = Machine(
        name=name or f"calibrated: {mesh.describe()}, {torch.get_num_threads()} threads per rank",
        matmul_flops=_average(mesh, matmul),
        memory_bandwidth=_average(mesh, bandwidth),
        op_overhead_s=_mean(mesh, overhead),
        view_overhead_s=_mean(mesh, view_overhead),
        collective_latency_s=latency,
        collective_bandwidth=bus,
        issue_overhead_s=issue_fixed,
        issue_seconds_per_byte=issue_per_byte,
        overlap_penalty=min(1.0, max(0.0, _slowest(mesh, penalty))),
        op_seconds={kind: _average(mesh, points) for kind, points in op_seconds.items()},
        step_overhead_s=_slowest(mesh, _step_overhead(mesh, 5 if quick else 20)),
        op_seconds_hot={kind: _average(mesh, points) for kind, points in op_seconds_hot.items()},
        cache_bytes=_cache_share(mesh, device),
        matmul_dtype_scale={name: _mean(mesh, value) for name, value in dtype_scale.items()},
        attention_flops=_mean(mesh, attention) if attention else 0.0,
        op_curves_by_bytes=gpu,
        host_bandwidth=_mean(mesh, _host_bandwidth(device, quick)) if gpu else 0.0,
        shared_compute=1.0 if gpu else _shared_compute(mesh),
        collective_groups=groups,
    )
    if path is not None and mesh.rank == 0:
        machine.save(path)
    return machine


def _products(mesh, device, sizes, dtype, min_loop_s: float, pool_bytes: int) -> list[tuple[float, float]]:
    """((FLOPs of one square product, FLOP/s), ...) of `dtype` products at `sizes`, operands
    cycled through a pool of `pool_bytes`."""
    points = []
    size = torch.empty((), dtype=dtype).element_size()
    for n in sizes:
        count = max(2, min(256, pool_bytes // (size * n * n)))
        operands = itertools.cycle([torch.randn(n, n, device=device, dtype=dtype) for _ in range(count)])
        mesh.all_reduce_flat(torch.zeros(1, device=device))
        seconds = _loop_seconds(lambda: _aten.mm.default(next(operands), next(operands)), min_loop_s, device=device)
        points.append((2.0 * n**3, 2.0 * n**3 / seconds))
    return points


def _gpu_products(mesh, device, min_loop_s: float, quick: bool) -> tuple[list, dict, float]:
    """A GPU's products: the bfloat16 curve (its tensor cores: what a mixed-precision step's
    products run at) from 128 to 8192, float32 and float16 as a scale of it (the median ratio
    over the sizes from 1024 up), and the rate of the fused causal attention kernel (forward and
    backward of `scaled_dot_product_attention`, bfloat16, 32 heads of 128, 2048 positions) on the
    FLOPs it does (half of what torch counts for a causal call)."""
    sizes = (128, 1024, 4096) if quick else (128, 256, 512, 1024, 2048, 4096, 8192)
    pool = 256 << 20  # larger than any GPU's L2: operands come from memory, as a step's do
    curve = _products(mesh, device, sizes, torch.bfloat16, min_loop_s, pool)
    scale = {}
    for dtype in (torch.float32, torch.float16):
        other = _products(mesh, device, [n for n in sizes if n >= 1024], dtype, min_loop_s, pool)
        rates = dict(curve)
        scale[str(dtype).removeprefix("torch.")] = statistics.median(r / rates[f] for f, r in other)
    b, h, s, d = 2, 32, 2048, 128
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)

    def attend():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    mesh.all_reduce_flat(torch.zeros(1, device=device))
    seconds = _loop_seconds(attend, min_loop_s, device=device)
    done = 3 * 4 * b * h * s * s * d / 2  # forward 2 products, backward 4; causal: half
    return curve, scale, done / seconds


def _host_bandwidth(device, quick: bool) -> float:
    """Bytes/s of a copy from pinned host memory to the GPU (CPU offload's copies), 256 MiB."""
    host = torch.empty(64 << 20, dtype=torch.float32).pin_memory()
    seconds = _median_seconds(lambda: host.to(device, non_blocking=True), 3 if quick else 7, device)
    return host.numel() * host.element_size() / seconds


def _last_level_cache(device) -> int:
    """Bytes of the last-level cache of `device` (0 if it cannot be read)."""
    if torch.device(device).type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with open(path) as f:
            text = f.read().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=0)


def _cache_share(mesh, device) -> int:
    """What one rank may count on of its device's last-level cache: a CPU's is shared by the
    ranks on its host (counted by host name across the mesh), a GPU's is its own. The same on
    every rank: the smallest cache over the busiest host."""
    gpu = torch.device(device).type == "cuda"
    rows = _everyone(mesh, [float(_last_level_cache(device)), _host_id()])
    hosts = [row[1] for row in rows]
    sharing = 1 if gpu else max(hosts.count(h) for h in hosts)
    return int(min(row[0] for row in rows) // sharing)


def _group_collectives(mesh, device, sizes, repeat: int) -> dict:
    """`Machine.collective_groups`: for each group size that divides the world (above 1, below
    the world), every collective swept over the world cut into groups of that many consecutive
    ranks — a mesh `{"replicate": world / size, "fsdp": size}`, whose collectives are the ones a
    step issues on such groups (gloo's reduce-scatter as fs runs it) — every group running it at
    once (a mesh axis's groups do in a step), fitted as the world's. Nothing on one rank, a world
    of prime size, or ranks as threads."""
    from .._mesh import Mesh, init_mesh

    world = mesh.world_size
    out: dict = {}
    if not isinstance(mesh, Mesh) or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world:
        return out  # ranks as threads (SimulatedMesh), or a mesh over part of the processes
    for size in (g for g in range(2, world) if world % g == 0):
        groups = init_mesh({"replicate": world // size, "fsdp": size})
        out.update({f"{kind}/{size}": curve for kind, curve in _collective_curves(mesh, groups, device, sizes, repeat).items()})
    return out


def _collective_curves(mesh, on, device, sizes, repeat: int) -> dict:
    """Each collective over `on`'s shard axis (its groups all running it at once), timed with
    `mesh` over full buffers of `sizes` bytes and fitted: kind -> (latency s, bus bytes/s)."""
    p = on.num_shards
    operations = {
        "all_gather": lambda full: on.all_gather_flat(torch.empty(full // 4 // p, device=device)),
        "reduce_scatter": lambda full: on.reduce_scatter_flat(torch.ones(full // 4 // p * p, device=device)),
        "all_reduce": lambda full: on.all_reduce_flat(torch.ones(full // 4, device=device), (on.shard_axis,)),
    }
    out = {}
    for kind, run in operations.items():
        share = (p - 1) / p * (2 if kind == "all_reduce" else 1) if p > 1 else 1.0
        points = [(share * full, _expected_collective_seconds(mesh, lambda: run(full), repeat)) for full in sizes]
        latency, per_byte = _fit(points)
        out[kind] = (latency, 1.0 / per_byte)
    return out


def _collective_times(mesh, fn, repeat: int) -> list[float]:
    """This rank's seconds for each of `repeat` calls of the collective `fn` (after one
    untimed), every rank starting each call together."""
    device = getattr(mesh, "device", "cpu")
    clock = _clock(device)
    times = []
    fn()
    for _ in range(repeat):
        mesh.all_reduce_flat(torch.zeros(1, device=device))  # start together
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def _collective_seconds(mesh, fn, repeat: int) -> float:
    """This rank's median seconds per call of the collective `fn`."""
    return statistics.median(_collective_times(mesh, fn, repeat))


def _expected_collective_seconds(mesh, fn, repeat: int) -> float:
    """What one call of the collective `fn` costs on average: every rank times `repeat` calls,
    all ranks starting each together; a call's time is its slowest rank's (the collective ends
    for the step when every rank is done); the result is the mean of those times with the
    fastest and slowest tenth left out (a stray descheduling).

    A mean, not a median: a step's time is a sum of tens of collectives, so what predicts it is
    each one's expected time. With more ranks than cores the times are multimodal (gloo's
    threads get the core within one scheduler slice or the next: 1.3, 3.4 or 5.5 ms for the
    same 16 KiB all-gather at 4 ranks on 2 cores), and a median of 7 jumped between the modes
    from one calibration to the next (fitted all-gather latency 2.5-4.3 ms, bandwidth
    490-710 MB/s, three sweeps a few seconds apart)."""
    times = _collective_times(mesh, fn, repeat)
    rows = _everyone(mesh, times)
    slowest = sorted(max(row[i] for row in rows) for i in range(repeat))
    cut = repeat // 10
    return statistics.mean(slowest[cut : repeat - cut])


def _everyone(mesh, values: list[float]) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64)
    return mesh.all_gather_world(mine.to(getattr(mesh, "device", "cpu"))).view(mesh.world_size, -1).cpu().tolist()


def _host_id() -> float:
    """This process's host, as a number every rank can compare (below 2**32: exact as a float64)."""
    return float(zlib.crc32(socket.gethostname().encode()))


def _shared_compute(mesh) -> float:
    """CPU threads of a host's ranks per core a rank may use (>= 1): how many ranks share a core
    while every rank computes. The same on every rank: the busiest host's (as `_cache_share`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rows = _everyone(mesh, [_host_id(), float(torch.get_num_threads()), float(cores)])
    hosts = {row[0] for row in rows}
    return max(1.0, max(sum(r[1] for r in rows if r[0] == h) / min(r[2] for r in rows if r[0] == h) for h in hosts))


def _slowest(mesh, value: float) -> float:
    return max(row[0] for row in _everyone(mesh, [value]))


def _mean(mesh, value: float) -> float:
    return statistics.mean(row[0] for row in _everyone(mesh, [value]))


def _average(mesh, points: list[tuple[float, float]]) -> tuple:
    """(size, value) points with each value the mean over the ranks of theirs at that size
    (a rate or a time: every rank measured the same sizes)."""
    rows = _everyone(mesh, [value for _, value in points])
    return tuple((size, statistics.mean(row[i] for row in rows)) for i, (size, _) in enumerate(points))


def _step_overhead(mesh, repeat: int) -> float:
    """What a traced step's call costs beyond its graph, on this rank: a step of one small
    parameter timed whole and as its graph alone."""
    from .._make_step import sharded_step
    from ..optim import sgd

    device = getattr(mesh, "device", torch.device("cpu"))
    clock = _clock(device)
    # No rule splits "w": whole on every rank of a tensor-parallel axis (placements are required there).
    step = sharded_step(lambda p, x: (p["w"] * x).sum(), mesh, optimizer=sgd(lr=0.1), placements=())
    state = step.init({"w": torch.ones(64, device=device)})
    x = torch.ones(64, device=device)
    state, _ = step(state, x)  # traces
    graph = step.lower(state, x).graph_module
    whole, alone = [], []
    with torch.no_grad():
        for _ in range(repeat):
            mesh.all_reduce_flat(torch.zeros(1, device=device))
            start = clock()
            state, _ = step(state, x)
            whole.append(clock() - start)
            inputs = step.graph_inputs(state, x)
            mesh.all_reduce_flat(torch.zeros(1, device=device))
            start = clock()
            graph(*inputs)
            alone.append(clock() - start)
    return max(0.0, statistics.median(whole) - statistics.median(alone))


def _issue_cost(mesh, device, sizes, repeat: int) -> tuple[float, float]:
    """(fixed seconds, seconds per full byte) of issuing a functional all-gather, fitted over
    `sizes` on the slowest rank's medians."""
    if not dist.is_initialized() or mesh.world_size == 1:
        return 0.0, 0.0
    world, group = dist.get_world_size(), dist.group.WORLD.group_name
    clock = _clock(device)
    points = []
    for full in sizes:
        shard = torch.ones(max(1, full // 4 // world), device=device)
        times = []
        for _ in range(repeat):
            mesh.all_reduce_flat(torch.zeros(1, device=device))
            start = clock()  # the call's own time: no sync after it
            work = torch.ops._c10d_functional.all_gather_into_tensor(shard, world, group)
            times.append(time.perf_counter() - start)
            torch.ops._c10d_functional.wait_tensor(work)
        points.append((float(full), _slowest(mesh, statistics.median(times))))
    fixed, per_byte = _fit(points)
    return fixed, per_byte if per_byte > 1e-14 else 0.0


def _overlap(mesh, device, full_bytes: int) -> float:
    """The overlap penalty on this rank (`Machine.overlap_penalty`)."""
    if not dist.is_initialized() or mesh.world_size == 1:
        return 0.0
    world = dist.get_world_size()
    group = dist.group.WORLD.group_name
    clock = _clock(device)
    shard = torch.ones(full_bytes // 4 // world, device=device)

    def issue():  # as a traced graph issues it: the functional collective, waited later
        return torch.ops._c10d_functional.all_gather_into_tensor(shard, world, group)

    def communicate():
        torch.ops._c10d_functional.wait_tensor(issue())

    a = torch.randn(256, 256, device=device)
    comm = _collective_seconds(mesh, communicate, 3)
    per_mm = _median_seconds(lambda: a @ a, 5, device)
    count = max(1, int(comm / per_mm))

    def compute():
        for _ in range(count):
            a @ a

    compute_s = _median_seconds(compute, 3, device)
    boths = []
    for _ in range(3):
        mesh.all_reduce_flat(torch.zeros(1, device=device))
        start = clock()
        work = issue()
        compute()
        torch.ops._c10d_functional.wait_tensor(work)
        boths.append(clock() - start)
    both = statistics.median(boths)
    return (both - max(comm, compute_s)) / min(comm, compute_s)
