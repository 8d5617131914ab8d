"""Choosing the N-D layout before renting the cluster: `plan_layouts`.

    result = fs.analysis.plan_layouts(build, batch, layers=80, world_size=256, global_batch=512,
                                      tokens_per_row=8192, machine=machine, budget_bytes=80 << 30,
                                      optimizer=fs.optim.adamw(lr=3e-4), precision=...)
    print(result.table(limit=10))     # ranked; every loser says why

Every candidate layout — `replicate x fsdp x tp x pp` factorizations of the world, each
activation-checkpointing policy, and with a pipeline each schedule and micro-batch count — is
predicted from steps traced on an `AbstractMesh` (meta tensors: nothing allocated) and priced
on the `Machine` (`cluster_machine`: a GPU's data sheet, NVLink, the network):

- **Depth.** A transformer's layers are alike, so a step's figures are affine in its depth:
  each candidate mesh is traced at two shallow depths (`depths`, default 3 and 4 blocks: deep
  enough that prefetching and freeing settle into the pattern every later layer repeats) and
  every figure (simulated step time, exposed communication, phases, peak and resident bytes,
  FLOPs) is extended to `layers` on the line through them. Tracing the full depth of a 70B
  model takes ~a minute per candidate; two shallow traces take seconds, and the search reuses
  them across checkpointing policies (one unscheduled trace per mesh and batch; each policy is
  a pass applied to a copy, as `autotune` does). The line is exact where each layer costs the
  same; `tests/test_layouts.py` checks it against full-depth plans.
- **Without a pipeline** the figures are the simulator's (`simulate`) on the traced step:
  FSDP's gathers and reduce-scatters, tensor parallelism's collectives on their own streams,
  the optimizer, peak memory from the tensors' lifetimes, `reserved` as the caching
  allocator holds it.
- **With a pipeline** (`pp > 1`) the stages are composed from per-layer figures of a step
  traced without one, the pipeline's ranks counted as data parallelism (`replicate x (pp *
  fsdp) x tp`: the same trace as the flat layout's, at the micro-batch's rows; a pipeline rank
  holds `pp` times that trace's shard, so its state and update are scaled by `pp`):
  a stage of `k` layers forwards in `k` times a layer's forward computation and its waits for
  tensor-parallel collectives, and backwards likewise (recomputation included); the line's
  intercept (the model's leaves outside the blocks) is computed on the last stage (the head and
  loss; an embedding's lookup costs next to nothing) and held by the first (the first unit's
  bytes: the embedding) and the last (the rest). The schedule's makespan and bubble come
  from `fs.pipeline.analyze` at those costs, activations sent between ranks priced on the link
  between their nodes. Each unit is gathered and reduce-scattered once per step (FSDP under a
  pipeline keeps a stage gathered across micro-batches, as FSDP2 does under torch's pipelining),
  beside the pipeline's computation: exposed is what does not fit in the rank's busy time, and
  at least one block's gather and reduce-scatter; then the optimizer. Where ranks share compute
  units (`Machine.shared_compute` > 1: CPU processes on fewer cores), an idle rank's share goes
  to the busy ones: the pipeline takes the longer of its critical path at a lone rank's speed and
  its ranks' work spread over the units. Memory per rank: its
  layers' state, its stages' gathered parameters (none where the stage is not sharded and no
  dtype cast is asked: it computes on the state's own tensors), the most in-flight activations and summed
  gradients alive at once (`fs.pipeline.peak_bytes`: walked along the rank's actions, a stage's
  gradients appearing with its first backward), plus the working set on top (the loss's on the
  last stage, a block's backward elsewhere).
  `plan_pipeline` predicts a pipelined step that exists; this is its planning sibling at a
  scale where tracing every stage is too slow.

Nothing runs and nothing is communicated: one process plans any world size (`workers=N`
traces the meshes in N processes: this one and forked copies, `_forked`). The traces and their
figures are `_depth`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable, NamedTuple

from ..pipeline import Costs, Pipeline, analyze as analyze_pipeline, build_schedule, peak_bytes
from ..schedule import RematPolicy, Schedule
from ._depth import Tracer
from ._machine import Machine
from ._pipeline import gathers_copies
from ._ranking import rank_with_reasons

__all__ = ["LayoutSpace", "LayoutCandidate", "LayoutPlan", "plan_layouts"]

_GIB = 2**30


@dataclasses.dataclass(frozen=True)
class LayoutSpace:
    """The layouts `plan_layouts` tries: every combination whose degrees multiply to the world.

    Attributes:
        tp: tensor-parallel degrees (within a node: at most its GPUs, usually).
        pp: pipeline degrees (1: no pipeline).
        replicate: data-parallel replicas (HSDP's outer axis); the rest of the world is `fsdp`.
        remat: `(label, Schedule.remat value)` pairs: the activation-checkpointing policies.
        schedules: pipeline schedules (built-in names) tried when `pp > 1`.
        microbatches: micro-batch counts as multiples of `pp` (M = k * pp), when `pp > 1`.
    """

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4, 8)
    replicate: tuple[int, ...] = (1,)
    remat: tuple = (("none", False), ("selective op", RematPolicy(every_other_mm=True)), ("full", True))
    schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
    microbatches: tuple[int, ...] = (1, 2)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "replicate", "microbatches"):
            values = getattr(self, name)
            if not isinstance(values, (tuple, list)) or not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
                raise ValueError(f"LayoutSpace.{name} must be a non-empty tuple of ints >= 1; got {values!r}")
            object.__setattr__(self, name, tuple(values))
        remat = tuple(self.remat.items()) if isinstance(self.remat, dict) else tuple(self.remat)
        if not remat or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in remat):
            raise ValueError(f"LayoutSpace.remat must be (label, Schedule.remat value) pairs; got {self.remat!r}")
        object.__setattr__(self, "remat", remat)
        if not isinstance(self.schedules, (tuple, list)) or not self.schedules:
            raise ValueError(f"LayoutSpace.schedules must name at least one pipeline schedule; got {self.schedules!r}")
        for s in self.schedules:
            Pipeline(s)  # an unknown name raises here, naming the built-ins
            if s in _SPLIT_BACKWARD:
                raise ValueError(
                    f"LayoutSpace.schedules: {s!r} splits each backward into I and W, and the memory a micro-batch "
                    f"holds from its I to its W is not in the per-layer figures the layouts are composed from (it "
                    f"would be priced as 1F1B's, 24 % low on a pp 2 GPT); plan it on a real step with "
                    f"fs.analysis.tune_pipeline or plan_pipeline"
                )
        labels = [label for label, _ in remat]
        if len(set(labels)) != len(labels) or any(len(set(getattr(self, n))) != len(getattr(self, n)) for n in ("tp", "pp", "replicate", "microbatches")):
            raise ValueError(f"LayoutSpace holds a degree, count or remat label twice: {self!r:.300}")
        object.__setattr__(self, "schedules", tuple(self.schedules))


_SPLIT_BACKWARD = ("zb_h1", "zbv")  # built-ins whose backward is I then W


class LayoutCandidate(NamedTuple):
    """One layout `plan_layouts` predicted."""

    axes: dict  # mesh axis -> size (replicate, fsdp, tp, pp; size-1 axes left out)
    remat: str  # the activation-checkpointing policy's label
    schedule: str  # pipeline schedule ("" without a pipeline)
    microbatches: int  # micro-batches per step (1 without a pipeline)
    step_s: float  # predicted step time (inf: could not be planned)
    tokens_per_s_per_gpu: float
    flops_utilization: float  # the FLOPs the step runs (recomputation included) / time / peak_flops (0 when not given)
    reserved_bytes: int  # predicted peak per GPU as the caching allocator reserves it (the largest rank)
    peak_bytes: int  # bytes alive at the peak (the largest rank)
    exposed_s: float  # communication the computation does not hide (pipeline: bubble time included)
    bubble: float  # pipeline: the largest idle fraction of a rank (0 without)
    fits: bool  # reserved_bytes <= the budget
    why: str  # why it ranks where it does

    @property
    def label(self) -> str:
        axes = " x ".join(f"{k} {v}" for k, v in self.axes.items())
        pipe = f", {self.schedule} M={self.microbatches}" if self.schedule else ""
        return f"{axes}, {self.remat} AC{pipe}"


class LayoutPlan(NamedTuple):
    """What `plan_layouts` returns: the candidates ranked (those that fit first, fastest first)."""

    candidates: tuple  # LayoutCandidate, ranked
    budget_bytes: int
    seconds: float  # how long the search took
    traces: int  # steps traced

    @property
    def best(self) -> LayoutCandidate:
        """The first candidate: the fastest that fits the budget; when none fits, the first of
        those that do not (check its `fits`)."""
        return self.candidates[0]

    def find(self, **axes) -> list:
        """The candidates with exactly these mesh axes (size-1 axes left out), e.g. `find(fsdp=32, tp=8)`."""
        want = {k: v for k, v in axes.items() if v > 1}
        return [c for c in self.candidates if c.axes == want]

    def table(self, *, limit: int | None = None) -> str:
        """The ranked candidates as a Markdown table (at most `limit` rows)."""
        lines = [
            f"budget {self.budget_bytes / _GIB:.1f} GiB per GPU; {len(self.candidates)} layouts, {self.traces} traces, "
            f"{self.seconds:.1f} s",
            "",
            "| # | layout | step s | tokens/s/GPU | FLOPs util. | reserved GiB | exposed s | bubble | why |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for i, c in enumerate(self.candidates[:limit], 1):
            finite = math.isfinite(c.step_s)
            lines.append(
                f"| {i} | {c.label} | {c.step_s:.3f} | {c.tokens_per_s_per_gpu:,.0f} | {c.flops_utilization:.1%} | "
                f"{c.reserved_bytes / _GIB:.1f} | {c.exposed_s:.3f} | {c.bubble:.3f} | {c.why} |"
                if finite else f"| {i} | {c.label} | | | | | | | {c.why} |"
            )
        return "\n".join(lines)


def plan_layouts(
    build: Callable[[int, Any], tuple],
    batch: Callable[[int], Any],
    *,
    layers: int,
    world_size: int,
    global_batch: int,
    tokens_per_row: int,
    machine: Machine,
    budget_bytes: int | None,
    optimizer,
    precision=None,
    schedule: Schedule | None = None,
    space: LayoutSpace = LayoutSpace(),
    depths: tuple[int, int] = (3, 4),
    peak_flops: float = 0.0,
    workers: int = 1,
) -> LayoutPlan:
    """Predict every layout of `space` for a model of `layers` blocks on `world_size` GPUs and rank
    them: those whose predicted reserved memory fits `budget_bytes` first, fastest first, each
    with why it lost (see the module docstring for how each is priced).

    Arguments:
        build: `(num_layers, mesh) -> (loss_fn, params, placements)`: the model with that many
            blocks, on the meta device, made for `mesh` (an `AbstractMesh`; with a `tp` axis,
            `fs.tensor_parallel.parallelize`d on it and its rules as `placements`; else None).
        batch: `rows -> batch`: one data-parallel rank's batch of `rows` sequences (meta tensors).
        layers: the model's blocks (the depth figures are extended to).
        world_size: GPUs.
        global_batch: sequences per step over all data-parallel ranks (each layout's data-parallel
            degree must divide it).
        tokens_per_row: tokens per sequence (for tokens/s).
        machine: the `Machine` of the cluster (`cluster_machine(gpu, world_size=...)`; one built for fewer
            ranks than `world_size` is refused).
        budget_bytes: memory per GPU (compared with the predicted reserved bytes); None: no limit.
        optimizer / precision: as for `fs.sharded_step`.
        schedule: the base `fs.Schedule` (its `remat` is replaced by each policy; default
            `Schedule(reduce_scatters_in_flight=1)`, one reduce-scatter in flight as FSDP2).
        space: the layouts to try (`LayoutSpace`).
        depths: the two shallow depths traced.
        peak_flops: the GPU's dense peak FLOP/s, for the FLOPs utilization (0: not reported).
        workers: processes tracing at once (this one and `workers - 1` forked copies of it; each
            (mesh, rows) is traced in one of them): the figures are the same, the search faster
            on as many cores (`os.cpu_count()`). Needs `fork` (Linux, macOS) and no CUDA initialized.
    """
    if not (isinstance(depths, tuple) and len(depths) == 2 and 1 <= depths[0] < depths[1]):
        raise ValueError(f"plan_layouts depths must be two depths 1 <= d1 < d2; got {depths!r}")
    counts = {"layers": layers, "world_size": world_size, "global_batch": global_batch, "tokens_per_row": tokens_per_row}
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"plan_layouts {name} must be an int >= 1; got {value!r}")
    if machine.world_size and machine.world_size < world_size:
        raise ValueError(
            f"plan_layouts world_size is {world_size} but the machine was built for {machine.world_size} ranks "
            f"({machine.name}); build it for the run (cluster_machine(gpu, world_size={world_size}))"
        )
    if budget_bytes is None:
        budget_bytes = math.inf  # no limit: every layout fits
    elif not budget_bytes > 0:
        raise ValueError(f"plan_layouts budget_bytes must be > 0 (None: no limit); got {budget_bytes!r}")
    if not (isinstance(peak_flops, (int, float)) and peak_flops >= 0 and math.isfinite(peak_flops)):
        raise ValueError(f"plan_layouts peak_flops must be a finite number >= 0 (0: no FLOPs utilization); got {peak_flops!r}")
    start = time.perf_counter()
    base = schedule if schedule is not None else Schedule(reduce_scatters_in_flight=1)
    tracer = Tracer(build, batch, optimizer, precision, base, machine, depths)
    candidates, planned = [], []  # planned: (index in candidates, the call that prices it, its (dims, rows, remats))
    for r, t, p in ((r, t, p) for r in space.replicate for t in space.tp for p in space.pp):
        if world_size % (r * t * p):
            continue
        f = world_size // (r * t * p)
        axes = {k: v for k, v in (("pp", p), ("replicate", r), ("fsdp", f), ("tp", t)) if v > 1} or {"fsdp": 1}
        dp = r * f
        if global_batch % dp:
            candidates += [_failed(axes, label, "", 1, f"the global batch of {global_batch} does not cut into {dp} data-parallel ranks")
                           for label, _ in space.remat]  # fmt: skip
            continue
        rows = global_batch // dp
        if p == 1:
            for label, remat in space.remat:
                planned.append((len(candidates), functools.partial(
                    _flat, tracer, axes, (r, f, t), rows, label, remat, layers, world_size, global_batch, tokens_per_row,
                    peak_flops), ((r, f, t), rows, (remat,))))  # fmt: skip
                candidates.append(None)
            continue
        for name in space.schedules:
            v = Pipeline(name).virtual_stages()
            for k in space.microbatches:
                m = k * p
                for label, remat in space.remat:
                    if rows % m or layers < p * v:
                        why = (f"{rows} rows per data-parallel rank do not cut into {m} micro-batches" if rows % m
                               else f"{layers} layers cannot fill {p * v} stages")  # fmt: skip
                        candidates.append(_failed(axes, label, name, m, why))
                        continue
                    planned.append((len(candidates), functools.partial(
                        _piped, tracer, axes, (r, f * p, t), p, name, v, m, rows // m, label, remat, layers, world_size,
                        global_batch, tokens_per_row, peak_flops), ((r, f * p, t), rows // m, (remat, True))))  # fmt: skip
                    candidates.append(None)
    tracer.prefetch([needs for _, _, needs in planned], workers)
    for i, price, _ in planned:
        candidates[i] = price()
    if not any(math.isfinite(c.step_s) for c in candidates):
        reasons = sorted({c.why for c in candidates if c.why})
        if not candidates:
            reasons = [f"the space holds no layout of {world_size} GPUs (replicate x tp x pp must divide it) with a "
                       f"schedule to run its pipelines: {space!r:.300}"]  # fmt: skip
        raise ValueError("plan_layouts: no layout of the space could be planned: " + "; ".join(reasons)[:600])
    ranked = _rank(candidates, budget_bytes)
    return LayoutPlan(tuple(ranked), budget_bytes, time.perf_counter() - start, tracer.traces)


def _failed(axes, remat: str, schedule: str, m: int, why: str) -> LayoutCandidate:
    return LayoutCandidate(axes, remat, schedule, m, math.inf, 0.0, 0.0, 0, 0, math.inf, 0.0, False, why)


def _flat(tracer: Tracer, axes, dims, rows, label, remat, layers, world, global_batch, tokens, peak_flops) -> LayoutCandidate:
    try:
        slope, intercept = tracer.line(dims, rows, remat)
    except Exception as error:  # noqa: BLE001 - a layout the model or the step refuses is a rejected candidate
        return _failed(axes, label, "", 1, f"not plannable: {type(error).__name__}: {str(error)[:160]}")
    at = slope.at(intercept, layers)
    peak = slope.peak_at(intercept, layers)
    reserved = round(peak * (1 + tracer.machine.allocator_overhead))
    return LayoutCandidate(
        axes, label, "", 1, at.step_s, global_batch * tokens / at.step_s / world,
        at.flops / at.step_s / peak_flops if peak_flops else 0.0, reserved, round(peak), at.exposed_s, 0.0, True, "",
    )  # fmt: skip


def _piped(tracer: Tracer, axes, dims, p, name, v, m, mb_rows, label, remat, layers, world, global_batch, tokens,
           peak_flops) -> LayoutCandidate:  # fmt: skip
    try:
        slope, intercept = tracer.line(dims, mb_rows, remat)
        sent = tracer.line(dims, mb_rows, True)[0].activations  # full remat saves each layer's input: what crosses
    except Exception as error:  # noqa: BLE001
        return _failed(axes, label, name, m, f"not plannable: {type(error).__name__}: {str(error)[:160]}")
    machine = tracer.machine
    # The traced mesh counts the pipeline's ranks as data parallelism (fsdp p times larger): a rank
    # of the pipeline holds p times the traced rank's shard, so its state and update scale by p.
    r, f, t = dims
    schedule = build_schedule(Pipeline(name, stages_per_rank=v), p, m)
    stages = p * v
    per_stage = [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]
    hop = _p2p_seconds(machine, sent, stride=r * f * t // p)
    costs = {}
    for s, k in enumerate(per_stage):
        last = s == stages - 1
        forward = k * slope.forward_s + (intercept.forward_s if last else 0.0)
        backward = k * slope.backward_s + (intercept.backward_s if last else 0.0)
        costs[s] = Costs(forward=forward, backward=backward, input_grad=backward / 2, weight_grad=backward / 2, p2p=hop)
    timeline = analyze_pipeline(schedule.compute_only(), costs)
    held = [[s for s in range(stages) if schedule.rank_of(s) == rank] for rank in range(p)]
    # per micro-batch figures (slope/intercept) -> per step: FSDP's collectives and the update happen once.
    # A rank's gathers and reduce-scatters run beside its pipeline's computation; exposed: what does not
    # fit in its busy time, and at least the first layer's gather and the last one's reduce-scatter.
    # The model's leaves outside the blocks (the line's intercept): their bytes split by the first
    # unit's share (the embedding, on the first stage) and the rest (final norm, head, loss: the last);
    # their computation, the embedding's negligible, all on the last stage (the costs above).
    first = intercept.first_gathered / intercept.gathered if intercept.gathered > 0 else 0.0
    shares = [(first if s == 0 else 0.0) + (1 - first if s == stages - 1 else 0.0) for s in range(stages)]
    # in-flight activations and summed gradients, walked action by action: a stage's gradients come
    # with its first backward, which frees a micro-batch's activations (never both at their peak)
    walked = peak_bytes(
        schedule.compute_only(), [k * slope.activations for k in per_stage],
        [k * slope.reduced + share * intercept.reduced for k, share in zip(per_stage, shares)],
    )  # fmt: skip
    copies = gathers_copies(f // p, tracer.precision)  # the traced fsdp is the stage's times p
    steps, exposed, peaks, flops = [], [], [], 0.0
    for rank in range(p):
        k = sum(per_stage[s] for s in held[rank])
        has_last = stages - 1 in held[rank]
        share = sum(shares[s] for s in held[rank])
        update = p * (k * slope.update_s + share * intercept.update_s)
        fsdp = k * slope.fsdp_s + share * intercept.fsdp_s
        exposed.append(max(slope.fsdp_s, fsdp - timeline.busy[rank]))
        steps.append(update + exposed[-1])
        state = p * (k * slope.resident + share * intercept.resident)
        parameters = (k * (slope.gathered - slope.reduced) + share * (intercept.gathered - intercept.reduced)) if copies else 0.0
        # the working set on top: the loss's on the last stage (the traced step's most), a block's elsewhere
        working = intercept.transient + slope.transient if has_last else intercept.block_transient + slope.block_transient
        # The update, after the last backward (every activation freed): the state, the new state it
        # allocates, every mean gradient shard at once, and one unit's update temporaries.
        new_state = p * (k * slope.new_state + share * intercept.new_state)
        gradients = (k * slope.reduced + share * intercept.reduced) / (f // p)
        update_peak = state + new_state + gradients + p * (slope.update_working + intercept.update_working)
        peaks.append(max(state + parameters + walked[rank] + working, update_peak))
        flops += m * (k * slope.flops + (intercept.flops if has_last else 0.0))
    # Ranks sharing compute units (CPU processes on fewer cores): an idle rank's share goes to the busy
    # ones, so the pipeline takes its critical path at a lone rank's speed, or the work of all its
    # ranks spread over the units, whichever is longer (the rates were measured with every rank busy).
    share = machine.shared_compute
    pipelined = timeline.makespan if share <= 1 else max(timeline.makespan / share, sum(timeline.busy) / p)
    step_s = pipelined + max(steps)
    peak = max(peaks)
    return LayoutCandidate(
        axes, label, name, m, step_s, global_batch * tokens / step_s / world,
        flops / p / step_s / peak_flops if peak_flops else 0.0, round(peak * (1 + machine.allocator_overhead)), round(peak),
        max(0.0, pipelined - max(timeline.busy)) + max(exposed), max(timeline.bubble), True, "",
    )  # fmt: skip


def _p2p_seconds(machine: Machine, nbytes: float, *, stride: int) -> float:
    """One send of `nbytes` to the pipeline neighbour `stride` ranks away: over NVLink within a
    node, else over the network (one NIC per GPU)."""
    same_node = machine.ranks_per_node and stride < machine.ranks_per_node
    pair_latency, pair_bus = machine.collective_curve("all_gather", 2)  # between two ranks
    bandwidth = pair_bus if same_node or not machine.network_bandwidth else machine.network_bandwidth
    latency = pair_latency + (0.0 if same_node else machine.network_latency_s)
    return latency + nbytes / bandwidth if bandwidth else latency


def _rank(candidates: list, budget: int) -> list:
    candidates = [c._replace(fits=c.reserved_bytes <= budget) if math.isfinite(c.step_s) else c for c in candidates]
    return rank_with_reasons(
        candidates, peak=lambda c: c.reserved_bytes, slower=_why_slower,
        over=lambda c: f"needs {c.reserved_bytes / _GIB:.1f} GiB, over the budget of {budget / _GIB:.1f} GiB",
        best=lambda c: f"fastest that fits ({c.reserved_bytes / _GIB:.1f} GiB)",
    )  # fmt: skip


def _why_slower(c: LayoutCandidate, best: LayoutCandidate) -> str:
    ratio = c.step_s / best.step_s
    reasons = []
    if c.bubble > best.bubble + 0.02:
        reasons.append(f"pipeline bubble {c.bubble:.2f}")
    if c.exposed_s > best.exposed_s * 1.2 + 1e-3:
        reasons.append(f"{c.exposed_s:.2f} s exposed communication vs {best.exposed_s:.2f}")
    if c.flops_utilization and best.flops_utilization and c.flops_utilization * c.step_s > 1.05 * best.flops_utilization * best.step_s:
        reasons.append("more FLOPs (recomputation)")
    return f"{ratio:.2f}x the best's time" + (": " + ", ".join(reasons) if reasons else "")
