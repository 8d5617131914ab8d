"""Machine models: the constants the simulator turns FLOPs, bytes and messages into seconds.

A `Machine` is measured on the machine at hand (`fs.analysis.calibrate`) or written from a
data sheet (`h100_sxm()`). Compute: a matrix product costs its FLOPs at the throughput
products of its size reach; any other node costs, when the machine has a measured time curve
for its class of kernel (`op_seconds`: elementwise, transcendental, reduction, normalization,
copy, select — a CPU spends several times longer per element on an `exp` than on an `add`),
the time that curve gives for its number of elements — between the curve measured with
inputs out of the caches and the one measured with inputs just used (`op_seconds_hot`), by
the share of its input bytes the simulator finds still cached; else the larger of a fixed
dispatch overhead and its bytes at memory bandwidth (a roofline). Communication: an alpha-beta model per collective kind, with bus bandwidth
(the ring algorithms' convention): an all-gather or reduce-scatter of a full buffer of `n`
bytes over `p` ranks takes `latency + (p - 1) / p * n / bandwidth`; an all-reduce twice that.
A machine of several nodes (`ranks_per_node`, `network_bandwidth`: `cluster_machine`) prices a
group that spans nodes hierarchically, as NCCL's rings do (see `Machine.collective_seconds`).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math

__all__ = ["Machine", "h100_sxm", "load_machine"]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # what a Machine prices


def _interpolate(points: tuple, x: float, *, log_values: bool = False) -> float:
    """The value at size `x` from (size, value) points sorted by size: interpolated linearly in
    log(size) (and in log(value) with `log_values`); the end points' values beyond the ends."""
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    sizes = [p[0] for p in points]
    i = bisect.bisect_right(sizes, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    if log_values:
        return math.exp(math.log(y0) + w * (math.log(y1) - math.log(y0)))
    return y0 + w * (y1 - y0)


def _interpolate_seconds(points: tuple, x: float) -> float:
    """Seconds at size `x` from measured (size, seconds) points: log-log interpolation between
    them, the smallest size's time below them (the dispatch floor), proportional beyond them."""
    if x > points[-1][0]:
        return points[-1][1] * x / points[-1][0]
    return _interpolate(points, x, log_values=True)


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "bool": 1, "uint8": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class Machine:
    """What one rank's device and its links do per second.

    Attributes:
        name: a description (where the numbers come from).
        matmul_flops: ((FLOPs of one product, FLOP/s it runs at), ...), sorted by size.
        memory_bandwidth: ((bytes one op reads + writes, bytes/s), ...), sorted by size.
        op_overhead_s: fixed cost of one computing node (Python dispatch of the graph's
            node, the kernel launch).
        view_overhead_s: cost of a node that only makes a view (view, split, getitem).
        collective_latency_s: kind -> alpha (seconds), kinds "all_gather",
            "reduce_scatter", "all_reduce".
        collective_bandwidth: kind -> bus bandwidth (bytes/s).
        issue_overhead_s: time the compute thread spends issuing a collective (fixed part).
        issue_seconds_per_byte: and per byte of the collective's full buffer.
        overlap_penalty: the fraction of the time a collective and computation overlap that
            is lost anyway (0: perfect overlap, as with separate copy engines; 1: none, as
            when the communication thread takes the cores the computation needs).
        op_seconds: kernel class -> ((elements, seconds of one whole call), ...), measured
            (`calibrate`); a class not in it is costed by the roofline. Classes:
            `fs.analysis` `OP_CLASSES` less "matmul" and "view".
        step_overhead_s: what a call of a traced step costs besides its graph (the ranks'
            agreement on what runs, guards, packing inputs and outputs).
        op_seconds_hot: the same curves with every input just used (in the caches): what an
            operation costs on the output of the one before it. A class not in it costs its
            `op_seconds` curve however recent its inputs.
        cache_bytes: how many bytes one rank may touch between two uses of a tensor and still
            find it cached (its share of the last-level cache); 0: no cache model.
        ranks_per_node: GPUs per node joined by `collective_bandwidth` (NVLink); 0: one flat
            network (every group priced by `collective_bandwidth`).
        network_bandwidth: bytes/s each rank sends and receives between nodes (its NIC's
            share, bus efficiency included); used for groups larger than `ranks_per_node`.
        network_latency_s: latency added per doubling of the nodes a group spans.
        matmul_dtype_scale: dtype name -> its dense peak over the peak `matmul_flops` was
            made for (e.g. {"float32": 0.0676} on an H100: 66.9 of 989 TFLOP/s); a matrix
            product of a dtype not listed runs at `matmul_flops`.
        attention_flops: FLOP/s a fused attention kernel (`_scaled_dot_product_*`, forward or
            backward) reaches on the FLOPs it does (a causal call skips half of those torch
            counts); 0: priced as a matrix product.
        allocator_overhead: what the CUDA caching allocator reserves beyond the bytes alive at
            the peak, as a fraction of them (`Simulation.reserved`): fragmentation of its
            segments and the rounding of blocks.
        op_curves_by_bytes: the `op_seconds` curves were measured on float32 and their time
            follows the bytes moved (a GPU's kernels are bound by its memory): an operation on
            `n` elements of a 2-byte dtype is read at `n / 2` (`calibrate` sets it on a GPU).
            False (a CPU's): the curves are read at the element count whatever the dtype.
        host_bandwidth: bytes/s of a copy between host memory and the device (CPU offload's
            `offload_copy` nodes: PCIe from pinned memory on a GPU); 0: priced as a copy in
            memory (a CPU, where host and device are one).
        shared_compute: ranks per compute unit (CPU processes x threads over cores; 1 where each
            rank has its own GPU): the rates above are what a rank computes at while every rank
            computes (`calibrate` measures them so); a rank alone runs up to this many times
            faster. A pipeline's idle ranks give their share to the busy ones (`plan_layouts`).
        collective_groups: "kind/size" -> (latency s, bus bytes/s) of that collective over
            groups of `size` ranks, measured with every such group of the world running it at
            once (`calibrate`: the sub-groups of a mesh's axes run together in a step); a group
            size not in it is priced by `collective_latency_s` / `collective_bandwidth` (the
            whole world's). On a GPU cluster the NVLink/network model says it; on ranks
            sharing cores and a gloo ring a 2-rank group is not a 4-rank one made smaller.
        world_size: the ranks of the run the machine was built for (`h100_sxm`, `cluster_machine`:
            its links are chosen for that many); `simulate` refuses a step with a collective over
            more. 0: not said (a calibrated machine, a hand-made one).
    """

    name: str
    matmul_flops: tuple
    memory_bandwidth: tuple
    op_overhead_s: float
    view_overhead_s: float
    collective_latency_s: dict
    collective_bandwidth: dict
    issue_overhead_s: float = 0.0
    overlap_penalty: float = 0.0
    op_seconds: dict = dataclasses.field(default_factory=dict)
    step_overhead_s: float = 0.0
    issue_seconds_per_byte: float = 0.0
    op_seconds_hot: dict = dataclasses.field(default_factory=dict)
    cache_bytes: int = 0
    ranks_per_node: int = 0
    network_bandwidth: float = 0.0
    network_latency_s: float = 0.0
    matmul_dtype_scale: dict = dataclasses.field(default_factory=dict)
    attention_flops: float = 0.0
    allocator_overhead: float = 0.0
    op_curves_by_bytes: bool = False
    host_bandwidth: float = 0.0
    shared_compute: float = 1.0
    collective_groups: dict = dataclasses.field(default_factory=dict)
    world_size: int = 0

    def __post_init__(self) -> None:
        for field in ("op_seconds", "op_seconds_hot"):
            curves = {}
            for kind, points in dict(getattr(self, field)).items():
                points = tuple(sorted((float(a), float(b)) for a, b in points))
                if not points or any(a <= 0 or b <= 0 for a, b in points):
                    raise ValueError(f"Machine.{field}[{kind!r}] must hold (elements, positive seconds) pairs; got {points!r}")
                curves[kind] = points
            object.__setattr__(self, field, curves)
        if self.cache_bytes < 0:
            raise ValueError(f"Machine.cache_bytes must be >= 0; got {self.cache_bytes}")
        for field in ("matmul_flops", "memory_bandwidth"):
            points = tuple(sorted((float(a), float(b)) for a, b in getattr(self, field)))
            if not points or any(b <= 0 for _, b in points):
                raise ValueError(f"Machine.{field} must hold (size, positive rate) pairs; got {getattr(self, field)!r}")
            object.__setattr__(self, field, points)
        for kind in COLLECTIVE_KINDS:
            if kind not in self.collective_bandwidth or kind not in self.collective_latency_s:
                raise ValueError(f"Machine needs a latency and a bandwidth for {kind!r}; got {sorted(self.collective_bandwidth)}")
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 0:
            raise ValueError(f"Machine.world_size must be an int >= 0 (0: not said); got {self.world_size!r}")
        if self.ranks_per_node < 0 or (self.ranks_per_node and self.network_bandwidth <= 0):
            raise ValueError(
                f"Machine.ranks_per_node ({self.ranks_per_node}) needs a positive network_bandwidth between nodes; "
                f"got {self.network_bandwidth}"
            )
        groups = {}
        for key, value in dict(self.collective_groups).items():
            kind, _, size = str(key).partition("/")
            latency, bus = (float(v) for v in value)
            if kind not in COLLECTIVE_KINDS or not size.isdigit() or latency < 0 or bus <= 0:
                raise ValueError(f"Machine.collective_groups wants 'kind/size' -> (latency >= 0, bandwidth > 0); got {key!r}: {value!r}")
            groups[key] = (latency, bus)
        object.__setattr__(self, "collective_groups", groups)
        if not self.shared_compute >= 1.0:
            raise ValueError(f"Machine.shared_compute must be >= 1 (ranks per compute unit); got {self.shared_compute}")
        if self.allocator_overhead < 0:
            raise ValueError(f"Machine.allocator_overhead must be >= 0; got {self.allocator_overhead}")
        if not 0.0 <= self.overlap_penalty <= 1.0:
            raise ValueError(f"Machine.overlap_penalty must be in [0, 1]; got {self.overlap_penalty}")

    def __hash__(self) -> int:
        return hash((self.name, self.matmul_flops, self.memory_bandwidth))

    def compute_seconds(
        self, flops: int, nbytes: int, *, view: bool = False, kind: str = "", numel: int = 0, cached: float = 0.0,
        dtype: str = "", attention: bool = False, causal: bool = False,
    ) -> float:
        """The time of one node: a view's overhead; a non-product of a class in `op_seconds`,
        that curve at `numel` elements (moved toward its `op_seconds_hot` curve by `cached`,
        the share of its input bytes still in the caches); else max(overhead, FLOPs /
        throughput, bytes / bandwidth). The throughputs are what whole calls reach at that
        size (dispatch included), so the overhead is a floor, not an addend. A fused attention
        kernel (`attention`) runs at `attention_flops` when the machine has it, on half its
        FLOPs when `causal`; a product's throughput is scaled by `matmul_dtype_scale[dtype]`."""
        if view:
            return self.view_overhead_s
        if kind == "offload" and self.host_bandwidth:
            return max(self.op_overhead_s, nbytes / 2 / self.host_bandwidth)  # its bytes count in and out
        if not flops and kind in self.op_seconds:
            if self.op_curves_by_bytes and dtype in _ITEMSIZE:
                numel = numel * _ITEMSIZE[dtype] // 4
            cold = _interpolate_seconds(self.op_seconds[kind], max(numel, 1))
            if cached <= 0.0 or kind not in self.op_seconds_hot:
                return cold
            return cold + min(cached, 1.0) * (_interpolate_seconds(self.op_seconds_hot[kind], max(numel, 1)) - cold)
        seconds = nbytes / _interpolate(self.memory_bandwidth, max(nbytes, 1))
        if flops and attention and self.attention_flops:
            seconds = max(seconds, (flops / 2 if causal else flops) / self.attention_flops)
        elif flops:
            rate = _interpolate(self.matmul_flops, flops) * self.matmul_dtype_scale.get(dtype, 1.0)
            seconds = max(seconds, flops / rate)
        return max(self.op_overhead_s, seconds)

    def collective_curve(self, kind: str, group_size: int) -> tuple[float, float]:
        """(latency s, bus bytes/s) of `kind` over `group_size` ranks: the curve measured for that
        group size (`collective_groups`) where there is one, else the whole world's."""
        world = (self.collective_latency_s[kind], self.collective_bandwidth[kind])
        return self.collective_groups.get(f"{kind}/{group_size}", world)

    def collective_seconds(self, kind: str, nbytes: int, group_size: int, *, stride: int = 1) -> float:
        """The time of one collective moving a full buffer of `nbytes` over `group_size` ranks
        whose global ranks are `stride` apart (1: neighbours, e.g. a mesh's last axis; a
        `{"fsdp": 64, "tp": 8}` mesh's fsdp groups have stride 8: one rank per node of 8).

        Nodes hold consecutive ranks, `ranks_per_node` each, so `g = ranks_per_node // stride`
        of the group's ranks share a node (at least 1, at most `group_size`), over `m =
        group_size / g` nodes. Within one node (or with `ranks_per_node` 0) a ring: `latency +
        (p - 1) / p * n / bandwidth`, twice the bytes for an all-reduce. Over `m` nodes the
        two-level ring: within each node over NVLink, `(g - 1) / g * n / bandwidth`, plus
        between nodes, where each of the node's `g` ranks carries `1 / g` of the data over its
        own NIC (NCCL's channels, one per NIC on a rail-optimized network): `(m - 1) / m * n /
        (g * network_bandwidth)`; latency `latency + network_latency_s * log2(m)`.
        """
        latency, bus = self.collective_curve(kind, group_size)
        if group_size <= 1:
            return latency
        factor = 2 if kind == "all_reduce" else 1
        per_node = self.ranks_per_node
        local = max(1, min(group_size, per_node // max(stride, 1))) if per_node else group_size
        if local >= group_size:
            return latency + factor * (group_size - 1) / group_size * nbytes / bus
        nodes = math.ceil(group_size / local)
        within = (local - 1) / local * nbytes / bus
        between = (nodes - 1) / nodes * nbytes / (local * self.network_bandwidth)
        return latency + self.network_latency_s * math.log2(nodes) + factor * (within + between)

    def to_json(self) -> str:
        """The machine as JSON text (what `save` writes and `load_machine` reads)."""
        return json.dumps(dataclasses.asdict(self), indent=1)

    def save(self, path: str) -> None:
        """Write `to_json()` to `path`."""
        with open(path, "w") as f:
            f.write(self.to_json())


def load_machine(path: str) -> Machine:
    """A `Machine` saved with `Machine.save` (e.g. by `fs.analysis.calibrate(mesh, path=...)`)."""
    with open(path) as f:
        data = json.load(f)
    curves = ("matmul_flops", "memory_bandwidth")
    data = {k: tuple(map(tuple, v)) if k in curves else v for k, v in data.items()}
    for field in ("op_seconds", "op_seconds_hot"):
        data[field] = {k: tuple(map(tuple, v)) for k, v in data.get(field, {}).items()}
    return Machine(**data)


def h100_sxm(*, ranks_per_node: int = 8, world_size: int = 8) -> Machine:
    """An NVIDIA H100 SXM from public specifications (no measurement): 989 TFLOP/s dense
    bf16, 3.35 TB/s HBM3, NVLink 4 at 450 GB/s per direction within a node of
    `ranks_per_node` GPUs, InfiniBand NDR at 400 Gb/s (50 GB/s) per GPU beyond it. Peak
    rates are discounted to what large kernels reach (70% of matmul peak, 80% of HBM,
    80% of link and of PCIe Gen5's 64 GB/s to the host), and small ops pay a few microseconds
    of launch."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (ranks_per_node, world_size)):
        raise ValueError(f"h100_sxm needs ranks_per_node >= 1 and world_size >= 1; got {ranks_per_node!r}, {world_size!r}")
    within_node = world_size <= ranks_per_node
    link = (450e9 if within_node else 50e9) * 0.8
    latency = 10e-6 if within_node else 25e-6
    return Machine(
        name=f"H100 SXM (public specs; {'NVLink' if within_node else 'InfiniBand NDR'} for {world_size} ranks)",
        matmul_flops=((1e6, 0.05 * 989e12), (1e9, 0.5 * 989e12), (1e11, 0.7 * 989e12)),
        memory_bandwidth=((1e4, 0.05 * 3.35e12), (1e7, 0.6 * 3.35e12), (1e9, 0.8 * 3.35e12)),
        op_overhead_s=4e-6,
        view_overhead_s=0.0,
        collective_latency_s={"all_gather": latency, "reduce_scatter": latency, "all_reduce": latency},
        collective_bandwidth={"all_gather": link, "reduce_scatter": link, "all_reduce": link},
        issue_overhead_s=5e-6,
        overlap_penalty=0.1,
        host_bandwidth=0.8 * 64e9,  # PCIe Gen5 x16 from pinned memory (CPU offload's copies)
        world_size=world_size,
    )
