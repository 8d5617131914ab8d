"""What a schedule costs before it runs: its timeline under given action costs, the idle
(bubble) fraction per rank, the peak in-flight activations per stage, and a text grid.

    a = fs.pipeline.analyze(fs.pipeline.one_f_one_b(4, 8))     # F = 1, B = 2 time units
    a.bubble            # per rank: (P-1)/(M+P-1) = 3/11 on every rank
    a.peak_in_flight    # per stage: (4, 3, 2, 1) micro-batches (GPipe: M on every stage)
    print(fs.pipeline.explain(fs.pipeline.one_f_one_b(4, 8)))

The timeline places each compute action (F, B, I, W) as early as its rank and its data allow:
after the rank's previous compute, F(s, m) after F(s-1, m), B/I(s, m) after B/I(s+1, m), plus
`Costs.p2p` when the two stages are on different ranks (a transfer's latency). SEND/RECV,
UNSHARD, RESHARD, REDUCE_GRAD and OPTIMIZER take no time here (receives are waited at the
consumer, as torch's runtime does).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Mapping, NamedTuple, Union

from ._actions import BACKWARD, Action, ActionKind, PipelineSchedule
from ._check import check
from ._peaks import stage_peak_bytes

__all__ = ["Costs", "Interval", "Analysis", "analyze", "explain"]

K = ActionKind


class Costs(NamedTuple):
    """Time of one action of one stage, in any unit (integers keep the figures exact)."""

    forward: float = 1  # F
    backward: float = 2  # B (input and weight gradients)
    input_grad: float = 1  # I
    weight_grad: float = 1  # W
    p2p: float = 0  # latency added to a dependency between stages on different ranks

    def of(self, kind: ActionKind) -> float:
        return {K.F: self.forward, K.B: self.backward, K.I: self.input_grad, K.W: self.weight_grad}.get(kind, 0)


CostsLike = Union[Costs, Mapping[int, Costs]]  # one Costs for all stages, or one per stage index


class Interval(NamedTuple):
    """One compute action on the timeline."""

    rank: int  # the pipeline rank that runs it
    action: Action  # what it runs
    start: float  # when it starts
    end: float  # when it ends (start + its cost)


class Analysis(NamedTuple):
    """A schedule's figures under the given costs."""

    makespan: float  # time from the first action's start to the last one's end
    busy: tuple[float, ...]  # per rank: time spent computing
    bubble: tuple[float, ...]  # per rank: idle fraction 1 - busy / makespan
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches forwarded and not yet fully backwarded
    intervals: tuple[Interval, ...]  # the timeline, in start order per rank

    @property
    def max_bubble(self) -> float:
        return max(self.bubble)


def _costs_for(costs: CostsLike, stage: int) -> Costs:
    if isinstance(costs, Costs):
        return costs
    return costs.get(stage, Costs())


def peak_in_flight(schedule: PipelineSchedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once: forwarded and not yet
    through their backward (B, or W for split backwards: W still reads the stage's input)."""
    return tuple(round(n) for n in stage_peak_bytes(schedule, [1] * schedule.num_stages))  # one "byte" per micro-batch


def analyze(schedule: PipelineSchedule, costs: CostsLike = Costs()) -> Analysis:
    """The schedule's timeline, bubble per rank and peak in-flight activations per stage.

    Arguments:
        schedule: a `PipelineSchedule` (checked first: a schedule that fails `check` raises).
        costs: a `Costs` for every stage, or a mapping stage index -> `Costs` (missing stages
            get the default F = 1, B = 2, I = W = 1).
    """
    order = check(schedule).order
    S = schedule.num_stages
    free = [0] * schedule.num_ranks
    ends: dict[tuple, float] = {}
    intervals: list[Interval] = []
    for rank, a in order:
        if not a.is_compute:
            continue
        c = _costs_for(costs, a.stage)
        ready = free[rank]
        dep = None
        if a.kind is K.F and a.stage > 0:
            dep = (K.F, a.stage - 1, a.microbatch)
            hop = schedule.rank_of(a.stage - 1) != rank
        elif a.kind in BACKWARD and a.stage < S - 1:
            dep = ("grad", a.stage + 1, a.microbatch)
            hop = schedule.rank_of(a.stage + 1) != rank
        if dep is not None:
            ready = max(ready, ends[dep] + (c.p2p if hop else 0))
        end = ready + c.of(a.kind)
        free[rank] = end
        ends[(a.kind, a.stage, a.microbatch)] = end
        if a.kind in BACKWARD:
            ends[("grad", a.stage, a.microbatch)] = end
        intervals.append(Interval(rank, a, ready, end))
    start = min((iv.start for iv in intervals), default=0)
    makespan = max((iv.end for iv in intervals), default=0) - start
    busy = [0] * schedule.num_ranks
    for iv in intervals:
        busy[iv.rank] += iv.end - iv.start
    bubble = tuple((1 - b / makespan) if makespan else 0.0 for b in busy)
    intervals.sort(key=lambda iv: (iv.rank, iv.start))
    return Analysis(makespan, tuple(busy), bubble, peak_in_flight(schedule), tuple(intervals))


def _unit(values) -> Fraction:
    fractions = [Fraction(v).limit_denominator(1000) for v in values if v]
    if not fractions:
        return Fraction(1)
    unit = fractions[0]
    for f in fractions[1:]:
        common = unit.denominator * f.denominator
        unit = Fraction(math.gcd(unit.numerator * f.denominator, f.numerator * unit.denominator), common)
    return unit


def explain(schedule: PipelineSchedule, costs: CostsLike = Costs(), *, max_columns: int = 400) -> str:
    """A text report: the sizes, bubble per rank, peak in-flight per stage, and the grid of
    ranks (rows) x time (columns, one per time unit) under `costs`; '.' is idle, '-' continues
    the action to its left.

    Arguments:
        schedule: a `PipelineSchedule`.
        costs: as for `analyze`.
        max_columns: grids wider than this many time units are cut (the figures above stay whole).
    """
    a = analyze(schedule, costs)
    lines = [
        f"pipeline {schedule.name}: {schedule.num_ranks} ranks x {schedule.stages_per_rank} stage(s) per rank "
        f"({schedule.placement}), {schedule.num_microbatches} micro-batches",
        f"makespan {a.makespan:g}; bubble per rank: " + ", ".join(f"{b:.3f}" for b in a.bubble),
        "peak in-flight micro-batches per stage: " + ", ".join(map(str, a.peak_in_flight)),
    ]
    unit = _unit([iv.end - iv.start for iv in a.intervals] + [iv.start for iv in a.intervals])
    columns = int(Fraction(a.makespan).limit_denominator(1000) / unit) if a.makespan else 0
    width = max((len(str(iv.action)) for iv in a.intervals), default=1)
    start = min((iv.start for iv in a.intervals), default=0)
    for rank in range(schedule.num_ranks):
        cells = ["." * width] * min(columns, max_columns)
        for iv in a.intervals:
            if iv.rank != rank:
                continue
            first = int((Fraction(iv.start - start).limit_denominator(1000)) / unit)
            count = int(Fraction(iv.end - iv.start).limit_denominator(1000) / unit)
            for k in range(first, min(first + count, len(cells))):
                cells[k] = str(iv.action).ljust(width) if k == first else "-" * width
        lines.append(f"rank {rank} | " + " ".join(cells) + (" ..." if columns > max_columns else ""))
    return "\n".join(lines) + "\n"
