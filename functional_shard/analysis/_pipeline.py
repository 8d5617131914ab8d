"""Pipelined steps before they run: costs per stage, bubble, memory per rank, point-to-point bytes.

    plan = fs.analysis.plan_pipeline(step, state, batch)   # this step, as it is configured
    print(plan.explain())

Everything is read from the step's stage programs (`PipelineStep`): per stage the forward's FLOPs
and its time on a `Machine` (`fs.analysis`'s node costs; a backward costs twice its forward, an
input-gradient and a weight-gradient half once each), the bytes one micro-batch's forward saves
for its backward (on fake tensors), the bytes crossing each boundary; then the schedule's makespan
and bubble per rank (`fs.pipeline.analyze` at those costs, transfers on the machine's link), the
peak in-flight activations per stage (`fs.pipeline.peak_in_flight`) and the bytes each rank
holds. No collective: each rank can plan alone. `balance_stages` cuts the units by predicted
time; `tune_pipeline` (`_cuts`) searches schedules, micro-batch counts and stage cuts with `_plan`
and `min_max_cut`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..pipeline import Costs, analyze, build_schedule, Pipeline, peak_bytes, peak_in_flight
from ..pipeline._peaks import stage_peak_bytes
from ._costs import node_cost
from ._machine import Machine, h100_sxm

__all__ = ["StagePlan", "PipelinePlan", "plan_pipeline", "pipeline_chrome_trace", "balance_stages", "min_max_cut"]


class StagePlan(NamedTuple):
    """One stage of a pipelined step, per micro-batch."""

    stage: int
    rank: int  # the pipeline rank that holds it
    forward_flops: int  # FLOPs of one micro-batch's forward
    forward_s: float  # its time on the plan's machine
    saved_bytes: int  # bytes its forward saves for the backward (the activations in flight)
    held_after_input_bytes: int  # bytes a micro-batch holds from its I to its W (zero bubble; else unused)
    sent_bytes: int  # bytes it sends to the next stage (activations; cotangents come back as many or fewer)
    param_elements: int  # parameter elements of its units (whole, before fsdp)
    # bytes it sends to the next stage once per step (values made of parameters alone: a tied
    # weight; their cotangents' sum comes back once), held by every later stage that reads them
    lent_bytes: int = 0


class PipelinePlan(NamedTuple):
    """A pipelined step's predicted figures (`plan_pipeline`)."""

    schedule: str  # the schedule's name
    num_ranks: int
    num_microbatches: int
    stages: tuple[StagePlan, ...]
    makespan_s: float  # the pipelined part of one step (forward and backward of every micro-batch)
    bubble: tuple[float, ...]  # per pipeline rank: idle fraction
    peak_in_flight: tuple[int, ...]  # per stage: micro-batches held at once
    activation_bytes: tuple[int, ...]  # per rank: peak bytes of in-flight activations (`fs.pipeline.stage_peak_bytes` per stage)
    state_bytes: tuple[int, ...]  # per rank: parameter shards, optimizer state and gradient shards
    gathered_bytes: tuple[int, ...]  # per rank: its stages' gathered parameters and summed full gradients
    p2p_bytes: tuple[int, ...]  # per rank: bytes it sends in one step (activations forward, cotangents back)
    bytes_per_element: int  # state bytes per parameter element (param + Adam moments + gradient)
    fsdp: int  # ranks each stage's parameters are sharded over
    # per rank: state + gathered parameters + the most in-flight activations and summed gradients
    # alive at once (`fs.pipeline.peak_bytes`: a stage's gradients appear with its first backward),
    # or the update's peak (`update_bytes`), whichever is more
    peak_bytes: tuple[int, ...]
    update_bytes: tuple[int, ...] = ()  # per rank: state and gradient shards plus what the optimizer's update makes beside them

    def explain(self) -> str:
        lines = [
            f"pipeline {self.schedule}: {self.num_ranks} ranks, {len(self.stages)} stages, {self.num_microbatches} "
            f"micro-batches; predicted {self.makespan_s * 1e3:.2f} ms; bubble per rank "
            + ", ".join(f"{b:.3f}" for b in self.bubble)
        ]
        lines.append("| stage | rank | forward GFLOP | forward ms | saved MiB / mb | in flight | sent KiB / mb | params |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for s in self.stages:
            lines.append(
                f"| {s.stage} | {s.rank} | {s.forward_flops / 1e9:.3f} | {s.forward_s * 1e3:.3f} | "
                f"{s.saved_bytes / 2**20:.2f} | {self.peak_in_flight[s.stage]} | {s.sent_bytes / 1024:.1f} | {s.param_elements} |"
            )
        lines.append("| rank | state MiB | gathered MiB | activations MiB | update MiB | peak MiB | p2p MiB / step |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in range(self.num_ranks):
            update = f"{self.update_bytes[r] / 2**20:.2f}" if self.update_bytes else "-"
            lines.append(
                f"| {r} | {self.state_bytes[r] / 2**20:.2f} | {self.gathered_bytes[r] / 2**20:.2f} | "
                f"{self.activation_bytes[r] / 2**20:.2f} | {update} | {self.peak_bytes[r] / 2**20:.2f} | {self.p2p_bytes[r] / 2**20:.2f} |"
            )
        return "\n".join(lines)


def _node_seconds(node, machine: Machine) -> tuple[int, float]:
    """One node's FLOPs and time on `machine` (a stage's are the sums over its program's nodes)."""
    cost = node_cost(node)
    if node.op != "call_function":
        return cost.flops, 0.0
    return cost.flops, machine.compute_seconds(
        cost.flops, cost.bytes, view=cost.kind == "view", kind=cost.kind, numel=cost.numel, dtype=cost.dtype,
        attention=cost.attention, causal=cost.causal,
    )  # fmt: skip


def _stage_seconds(module, machine: Machine) -> tuple[int, float]:
    flops, seconds = 0, 0.0
    for node in module.graph.nodes:
        f, t = _node_seconds(node, machine)
        flops, seconds = flops + f, seconds + t
    return flops, seconds


def plan_pipeline(step: Any, state: Any, batch: Any, *, machine: Machine | None = None, schedule: Any = None,
                  microbatches: int | None = None) -> PipelinePlan:  # fmt: skip
    """The predicted figures of `step` (a `PipelineStep`) on `batch`, or of the same stages under
    another `schedule` (a name or `fs.pipeline.Pipeline`) and number of `microbatches` (the batch
    cut into that many: per-micro-batch costs scale with its rows). Local: no collective.

    Arguments:
        step / state / batch: the pipelined step, its state, one batch of this rank.
        machine: what a rank computes and sends per second (default `fs.analysis.h100_sxm()`;
            `fs.analysis.calibrate` measures this machine).
        schedule / microbatches: an alternative to plan (default: the step's own).
    """
    machine = machine if machine is not None else h100_sxm()
    return _plan(step, state, _stage_figures(step, state, batch, machine), machine, schedule, microbatches,
                 step.update_bytes(state), step.batch_rows(batch))  # fmt: skip


class _StageFigures(NamedTuple):
    """One stage's figures at the step's own micro-batch size (what every plan scales)."""

    flops: int
    seconds: float
    saved: int
    held: int  # from its I to its W
    sent: int
    elements: int
    largest: int = 0  # elements of its largest unit (the optimizer's update works one buffer at a time)
    lent: int = 0  # bytes sent once per step


def _stage_figures(step: Any, state: Any, batch: Any, machine: Machine) -> list[_StageFigures]:
    """Per stage, read from its program once: FLOPs and time on `machine`, bytes saved per micro-batch
    (fake tensors), bytes sent forward, parameter elements."""
    cut = step.stage_cut(state, batch)
    sizes = step.split_bytes_per_microbatch(cut, batch)  # (saved, held from I to W) per stage
    elements = step.stage_param_elements()
    per_unit = step.stage_param_elements(step._unit_of_leaf)
    largest = {}
    for u, s in zip(step._unit_of_leaf, step._stage_of_leaf):
        if u is not None and s is not None:
            largest[s] = max(largest.get(s, 0), per_unit[u])
    out = []
    for p in cut.stages:
        flops, seconds = _stage_seconds(p.module, machine)
        inner = p.index < len(cut.stages) - 1
        sent, lent = (cut.bytes_between(p.index), cut.lent_between(p.index)) if inner else (0, 0)
        out.append(_StageFigures(flops, seconds, *sizes[p.index], sent, elements[p.index], largest.get(p.index, 0), lent))
    return out


def _plan(step: Any, state: Any, figures: list[_StageFigures], machine: Machine, schedule: Any,
          microbatches: int | None, update: tuple[float, float], rows: int | None = None) -> PipelinePlan:  # fmt: skip
    """`update`: `step.update_bytes(state)` (the same for every schedule and cut of the step);
    `rows`: the batch's rows, which `microbatches` must cut into equal micro-batches."""
    m0 = step.microbatches
    m = microbatches if microbatches is not None else m0
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"plan_pipeline microbatches must be an int >= 1; got {m!r}")
    if rows is not None and rows % m:
        raise ValueError(f"plan_pipeline: {rows} rows per batch do not cut into microbatches={m} equal micro-batches")
    pipeline = step.pipeline if schedule is None else (schedule if isinstance(schedule, Pipeline) else Pipeline(schedule))
    compute = build_schedule(pipeline, step.num_ranks, m)
    if compute.num_stages != len(figures):
        raise ValueError(
            f"the schedule {compute.name!r} has {compute.num_stages} stages but the step was cut into {len(figures)}: "
            f"plan schedules with the same stages per rank ({len(figures) // step.num_ranks})"
        )
    scale = m0 / m  # per-micro-batch figures scale with the rows of a micro-batch
    stages = [
        StagePlan(i, compute.rank_of(i), int(f.flops * scale), f.seconds * scale, int(f.saved * scale),
                  int(f.held * scale), int(f.sent * scale), f.elements, f.lent)  # fmt: skip
        for i, f in enumerate(figures)
    ]
    link = machine.collective_curve("all_gather", 2)[1] or 1.0
    costs = [
        Costs(forward=s.forward_s, backward=2 * s.forward_s, input_grad=s.forward_s, weight_grad=s.forward_s,
              p2p=(s.sent_bytes + s.lent_bytes / m) / link)  # fmt: skip
        for s in stages
    ]
    analysis = analyze(compute.compute_only(), dict(enumerate(costs)))
    peaks = peak_in_flight(compute)
    saved, after_input = [s.saved_bytes for s in stages], [s.held_after_input_bytes for s in stages]
    per_stage = stage_peak_bytes(compute, saved, after_input)
    fsdp = step.mesh.num_shards
    per_element = step.state_bytes_per_element(state)
    gather_bytes = step.gather_bytes_per_element()
    ranks = range(step.num_ranks)
    held = [[s for s in stages if s.rank == r] for r in ranks]
    states = tuple(sum(s.param_elements for s in held[r]) * per_element // fsdp for r in ranks)
    gathered_bytes = tuple(sum(s.param_elements for s in held[r]) * gather_bytes for r in ranks)
    # gathered = parameters + their summed gradients, alike in size: the gradients come in the walk
    walked = peak_bytes(compute.compute_only(), saved, [s.param_elements * gather_bytes // 2 for s in stages], after_input)
    p2p = []
    for r in ranks:
        out = 0
        for s in held[r]:
            if s.stage + 1 < len(stages) and compute.rank_of(s.stage + 1) != r:
                out += s.sent_bytes * m + s.lent_bytes
            if s.stage > 0 and compute.rank_of(s.stage - 1) != r:
                out += stages[s.stage - 1].sent_bytes * m + stages[s.stage - 1].lent_bytes  # cotangents of what it received
        p2p.append(out)
    # what is lent, held by each later stage for the step with its cotangents' sum (fp32)
    lent_held = tuple(sum(2 * stages[s.stage - 1].lent_bytes for s in held[r] if s.stage > 0) for r in ranks)
    copies = gathers_copies(fsdp, step.precision)  # else their summed gradients alone are walked
    # The optimizer's update, after the pipeline: the state and gradient shards, and what the update
    # makes beside them: per element of the rank's shards, and of its largest buffer (a unit's shard).
    updates = tuple(round(update_peak(states[r], sum(s.param_elements for s in held[r]),
                                      max((figures[s.stage].largest for s in held[r]), default=0), update, fsdp))
                    for r in ranks)  # fmt: skip
    return PipelinePlan(
        compute.name, step.num_ranks, m, tuple(stages), analysis.makespan, tuple(analysis.bubble), tuple(peaks),
        tuple(round(sum(per_stage[s.stage] for s in held[r])) for r in ranks),
        states, gathered_bytes,
        tuple(p2p), per_element, fsdp,
        tuple(max(state + (gathered // 2 if copies else 0) + round(w) + lent, update)
              for state, gathered, w, update, lent in zip(states, gathered_bytes, walked, updates, lent_held)),
        updates,
    )  # fmt: skip


def update_peak(state: float, elements: float, largest: float, update: tuple[float, float], shards: int) -> float:
    """A rank's bytes during the optimizer's update: its `state` bytes and what the update makes
    beside them (`update`: `step.update_bytes(state)`, bytes per element of the rank's parameters
    and of its largest buffer, each sharded over `shards`)."""
    every, big = update
    return state + (every * elements + big * largest) / shards


def gathers_copies(fsdp: int, precision) -> bool:
    """Whether a pipeline stage holds gathered copies of its parameters beside its state: when it is
    sharded (`fsdp` > 1) or its parameters are cast (`precision.param_dtype`); an unsharded stage
    with no cast computes on its state's own tensors."""
    return fsdp > 1 or (precision is not None and precision.param_dtype is not None)


def pipeline_chrome_trace(profiles) -> dict:
    """A Chrome trace (chrome://tracing, Perfetto) of one profiled pipelined step: a track per
    pipeline rank, an event per action (`PipelineStep.profile` on every rank, gathered by the
    caller), in microseconds from the first action of any rank."""
    zero = min(e[1] for p in profiles for e in p.events)
    events = []
    for p in profiles:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": p.rank, "args": {"name": f"pp rank {p.rank}"}})
        for name, start, end in p.events:
            events.append({"name": name, "ph": "X", "pid": 0, "tid": p.rank, "ts": (start - zero) / 1e3, "dur": (end - start) / 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def balance_stages(loss_fn: Any, params: Any, micro_batch: Any, num_stages: int, *, units: Any = None,
                   machine: Machine | None = None) -> tuple[tuple[str, ...], ...]:  # fmt: skip
    """A cut of the units into `num_stages` contiguous stages that balances their predicted time:
    pass it as `fs.pipeline.Pipeline(stages=...)`. Local, on fake tensors (params may be on meta).

    Each node of the traced `loss_fn` is charged to the latest unit it reads (the stage rule of the
    cut, at the granularity of units), and its time on `machine` (default `fs.analysis.h100_sxm()`;
    the forward's, which the backward's follows at twice) is summed per unit; the units are then
    split, in order, so that the slowest stage is as fast as it can be (dynamic programming over
    the contiguous cuts). The default cut splits the blocks evenly and puts the embedding on the
    first stage and the head and loss on the last; with a large vocabulary the head and the loss
    weigh a block or more, which this cut accounts for.

    Arguments:
        loss_fn / params: as for `fs.sharded_step` and `step.init` (full tree; any device).
        micro_batch: one micro-batch (shapes and dtypes are read).
        num_stages: pipeline ranks x stages per rank.
        units: the unit policy (as `fs.sharded_step`'s).
    """
    from .._pytree import tree_flatten, tree_paths
    from .._stages import cut_stages, unit_of_nodes
    from .._tree import BUFFER, leaf_roles
    from .._units import assign_units
    from ._abstract import AbstractMesh

    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"balance_stages num_stages must be an int >= 1; got {num_stages!r}")
    machine = machine if machine is not None else h100_sxm()
    leaves, treedef = tree_flatten(params)
    paths, roles = tree_paths(params), leaf_roles(params)
    sharded = [p for p, r in zip(paths, roles) if r != BUFFER]
    unit_names = dict(zip(sharded, assign_units(units, sharded)))
    order = list(dict.fromkeys(unit_names[p] for p in sharded))
    if num_stages > len(order):
        raise ValueError(f"{num_stages} stages but only {len(order)} units ({order}): use fewer stages or a finer unit policy")
    position = [None if r == BUFFER else order.index(unit_names[p]) for p, r in zip(paths, roles)]
    gm = cut_stages(loss_fn, treedef, leaves, position, micro_batch, 0, AbstractMesh({"fsdp": 1}))
    seconds = [0.0] * len(order)
    for node, p in unit_of_nodes(gm, len(leaves), position).items():
        if p >= 0:
            seconds[p] += _node_seconds(node, machine)[1]
    prefix = [0.0]
    for x in seconds:
        prefix.append(prefix[-1] + x)
    bounds = min_max_cut(len(order), num_stages, lambda stage, i, j: prefix[j] - prefix[i])
    return tuple(tuple(order[a:b]) for a, b in bounds)


def min_max_cut(n: int, num_stages: int, cost) -> list[tuple[int, int]]:
    """The cut of `n` items in order into `num_stages` contiguous non-empty runs whose largest
    `cost(stage, start, end)` (items[start:end] as stage `stage`) is the smallest: dynamic
    programming over the contiguous cuts, `[(start, end), ...]` per stage."""
    # best[k][i]: the smallest possible largest cost cutting items[:i] into k stages; cut[k][i] where the last begins
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf:
                    continue
                value = max(best[k - 1][j], cost(k - 1, j, i))
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]
