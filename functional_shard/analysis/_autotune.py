"""`autotune(step, state, batch, budget_bytes=...)`: the fastest schedule that fits a memory budget.

1. Search: the step is traced once, unscheduled (`Schedule(passes=())`); every schedule of
   the search space (`SearchSpace`: prefetch depth, which units stay gathered from forward to
   backward, which units are rematerialized, all-gather bucket size) schedules a copy of that
   graph (`fs.schedule.apply_schedule`, what the jit itself runs) and is simulated
   (`fs.analysis.simulate`): predicted step time and peak memory. Every rank predicts every
   schedule for its own batch; the figures kept are the largest over ranks.
2. Filter: a schedule whose predicted peak exceeds the budget is never returned.
3. Confirm: the `confirm` fastest predicted schedules that fit, plus the step's own schedule
   (the reference), are measured on every rank, interleaved (`_measure`): their scheduled
   graphs run on the caller's state and batch. The returned schedule is the fastest measured
   whose predicted and measured peaks both fit the budget, and whose own lowering (a fresh
   trace, `sharded_step(..., schedule=...).lower`: what the user's step will run) is predicted
   to fit too.

Every figure a decision reads is the same on every rank (gathered, then the max), so ranks
cannot choose differently; at the end they check that they did not.

Not searched: the unit policy (`units=`). It decides the layout, hence the state's shards:
comparing policies means re-sharding the state (`fs.export`, then `step.init`) per policy.
Nor `reduce_scatters_in_flight`: gloo allows one collective in flight, so it changes nothing
there; nor `compile`, `accumulate` and `extra_passes`, which are kept as the step has them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import NamedTuple

from .. import schedule as schedule_lib
from .._jit import copy_graph_module, scheduled_step
from .._step import ShardedStep
from ..schedule import Schedule
from ..schedule._graph import unit_of_label
from ._calibrate import _everyone, calibrate
from ._machine import Machine
from ._measure import measure, with_schedule
from ._regions import node_roles
from ._simulate import simulate

__all__ = ["SearchSpace", "TuneCandidate", "TuneResult", "autotune"]

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """The schedules `autotune` tries: every combination of the values below, each applied to
    the step's own `Schedule` (its other fields kept). Unit counts are fractions of the step's
    units, rounded up, so that one space fits any model.

    Attributes:
        prefetch: values of `Schedule.prefetch`.
        keep_gathered: fractions of the units that are *not* resharded after forward (their
            full parameters stay alive from forward to backward: no second all-gather), taken
            in the order their backward starts (the first units the backward needs first). 0:
            every unit resharded (ZeRO-3); 1: none (ZeRO-2-like, most memory).
        remat: fractions of the units rematerialized (`Schedule.remat`), taken in the order
            their forward ends. 0: none; 1: every unit.
        bucket_units: all-gather buckets (`Schedule.bucket_bytes`) as a multiple of the largest
            unit's gathered bytes; 0 (or 1): no buckets. 2 merges neighbouring units in pairs, and so on.

    With micro-batches, every combination that keeps all units gathered is also tried gathered
    once per step (`Schedule.reshard_after_backward=False`: all-gather bytes independent of the
    number of micro-batches, every unit's full parameters alive across them).
    """

    prefetch: tuple[int, ...] = (0, 1, 2)
    keep_gathered: tuple[float, ...] = (0.0, 0.5, 1.0)
    remat: tuple[float, ...] = (0.0, 0.5, 1.0)
    bucket_units: tuple[int, ...] = (0, 2)

    def __post_init__(self) -> None:
        checks = {
            "prefetch": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "keep_gathered": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
            "remat": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
            "bucket_units": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        }
        for name, ok in checks.items():
            values = tuple(getattr(self, name)) if isinstance(getattr(self, name), (tuple, list)) else None
            if not values or not all(ok(v) for v in values):
                kind = "fractions in [0, 1]" if name in ("keep_gathered", "remat") else "ints >= 0"
                raise ValueError(f"SearchSpace.{name} must be a non-empty tuple of {kind}; got {getattr(self, name)!r}")
            object.__setattr__(self, name, values)

    @property
    def size(self) -> int:
        """How many combinations the space holds (before duplicates are dropped and without the
        micro-batch variants)."""
        return len(self.prefetch) * len(self.keep_gathered) * len(self.remat) * len(self.bucket_units)

    def schedules(
        self, base: Schedule, *, backward_order, forward_end_order, largest_gather_bytes: int, microbatches: int = 1
    ) -> list[tuple[str, Schedule]]:
        """`(label, schedule)` for every combination, duplicates dropped, in a fixed order.

        Arguments:
            base: the step's schedule; the searched fields replace its own.
            backward_order: the units in the order their backward starts.
            forward_end_order: the units in the order their forward ends.
            largest_gather_bytes: the largest all-gather of one unit (full bytes).
            microbatches: the step's; above 1, the gathered-once variants are added.
        """
        found: dict[Schedule, str] = {}
        n = len(backward_order)
        for prefetch in self.prefetch:
            for keep in self.keep_gathered:
                kept = tuple(backward_order[: math.ceil(keep * n - 1e-9)])
                reshard = True if not kept else False if len(kept) == n else {u: False for u in kept}
                for fraction in self.remat:
                    chosen = tuple(forward_end_order[: math.ceil(fraction * n - 1e-9)])
                    remat = False if not chosen else True if len(chosen) == n else chosen
                    once_options = (True, False) if reshard is False and microbatches > 1 else (True,)
                    for buckets, reshard_after_backward in itertools.product(self.bucket_units, once_options):
                        schedule = dataclasses.replace(
                            base,
                            prefetch=prefetch,
                            reshard_after_forward=reshard,
                            default_reshard=True,
                            bucket_bytes=buckets * largest_gather_bytes if buckets >= 2 else 0,
                            remat=remat,
                            reshard_after_backward=reshard_after_backward,
                        )
                        label = (
                            f"prefetch {prefetch}, keep {len(kept)}/{n} gathered, remat {len(chosen)}/{n}, "
                            + (f"buckets of {buckets} units" if buckets >= 2 else "no buckets")
                            + ("" if reshard_after_backward else ", gathered once per step")
                        )
                        found.setdefault(schedule, label)
        return [(label, schedule) for schedule, label in found.items()]


class TuneCandidate(NamedTuple):
    """One schedule `autotune` considered (identical on every rank)."""

    label: str  # what it is, in the search space's terms (or "the step's own")
    schedule: Schedule  # the schedule itself
    predicted_s: float | None  # simulated step time, largest over ranks (None: could not be scheduled)
    predicted_peak: int | None  # simulated peak bytes per rank, largest over ranks
    measured_s: float | None  # median measured step time (slowest rank per run); None: not measured
    measured_peak: int | None  # measured peak bytes (MemTracker), largest over ranks; None: not measured
    times_s: tuple  # every timed run's slowest-rank time (empty: not measured)
    verdict: str  # "chosen", or why it was not chosen


class TuneResult(NamedTuple):
    """What `autotune` returns (identical on every rank)."""

    schedule: Schedule  # the chosen schedule: pass it to `fs.sharded_step(..., schedule=...)`
    budget_bytes: int  # the budget it was chosen for
    candidates: tuple  # a TuneCandidate per schedule considered; the step's own first, then the search order
    machine: Machine  # the machine model the predictions used

    @property
    def chosen(self) -> TuneCandidate:
        """The chosen schedule's `TuneCandidate`."""
        return next(c for c in self.candidates if c.verdict == "chosen")

    @property
    def reference(self) -> TuneCandidate:
        """The step's own schedule's `TuneCandidate` (always measured)."""
        return self.candidates[0]

    def table(self, *, limit: int | None = None) -> str:
        """The candidates as a Markdown table: measured ones first, then by predicted time
        (at most `limit` rows; None: all)."""

        def ms(value):
            return "" if value is None else f"{value * 1e3:.1f}"

        def mib(value):
            return "" if value is None else f"{value / _MIB:.2f}"

        rows = sorted(
            self.candidates,
            key=lambda c: (c.measured_s is None, c.measured_s or 0.0, c.predicted_s is None, c.predicted_s or 0.0),
        )
        lines = [
            f"budget {mib(self.budget_bytes)} MiB per rank; chosen: {self.schedule!r}",
            "",
            "| schedule | predicted ms | predicted MiB | measured ms | measured MiB | verdict |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
        ]
        for c in rows[:limit]:
            lines.append(
                f"| {c.label} | {ms(c.predicted_s)} | {mib(c.predicted_peak)} | {ms(c.measured_s)} | "
                f"{mib(c.measured_peak)} | {c.verdict} |"
            )
        return "\n".join(lines)


def autotune(
    step: ShardedStep,
    state,
    batch,
    *,
    budget_bytes: int,
    machine: Machine | None = None,
    space: SearchSpace = SearchSpace(),
    confirm: int = 3,
    rounds: int = 4,
    steps: int = 2,
    warmup: int = 1,
    confidence: float = 0.9,
) -> TuneResult:
    """Search the schedules of `step` for the fastest one whose peak memory fits `budget_bytes`.

    A collective: every rank calls it, with the same arguments except its own `state` and
    `batch`, and every rank gets the same result. The state is not advanced (measured steps run
    the step's graph on it without keeping their results), and the caller's random number
    generator is left as it was.

    Arguments:
        step: a traced `fs.sharded_step` on a real mesh; its schedule's fields are the starting
            point (`Schedule(passes=...)` is not searched: raise).
        state: its `StepState` (from `step.init`); read, never modified.
        batch: this rank's batch, as the step will take it (shapes decide memory and time).
        budget_bytes: the most bytes one rank may hold during a step (the state included, as
            `fs.analysis.analyze` and MemTracker count them).
        machine: the `Machine` the simulator predicts with; None calibrates this mesh
            (`fs.analysis.calibrate`, a collective: seconds).
        space: the schedules to try (`SearchSpace`).
        confirm: how many of the fastest predicted schedules that fit are measured, besides
            the step's own.
        rounds / steps / warmup: measurement: after `warmup` untimed runs each, `rounds`
            rounds in which every measured schedule runs `steps` times, the order rotating;
            a schedule's time is the median of its `rounds * steps` runs.
        confidence: how sure the measurements must make it that a schedule is faster than the
            step's own before it replaces it (when the step's own fits the budget): it must be
            faster in so many of the `rounds * steps` runs paired in time with the step's own
            that chance alone would do it with probability at most `1 - confidence` (a sign
            test; with 8 pairs and 0.9, in 7 of them). 0 takes the fastest median.

    Returns a `TuneResult`: the chosen `schedule`, every candidate with its predicted and
    measured figures and why it was not chosen (`result.table()`).

    Raises ValueError, before measuring anything, if no schedule's predicted peak fits the
    budget (naming the budget and the smallest predicted peak), and if none of the measured
    ones fits it as measured.
    """
    _check_arguments(step, budget_bytes, confirm, rounds, steps, warmup, confidence)
    mesh = step.mesh
    mesh.agree("fs.analysis.autotune")
    machine = machine if machine is not None else calibrate(mesh)
    # The trace is the step's own: ZeRO-1 and CPU offload change what is traced, not only passes.
    unscheduled = with_schedule(step, Schedule(
        passes=(), accumulate=step.schedule.accumulate, reshard_after_update=step.schedule.reshard_after_update,
        offload=step.schedule.offload,
    ))  # fmt: skip
    base = unscheduled.lower(state, batch)
    backward_order, forward_end_order = _unit_orders(base)
    largest = max((c.nbytes for c in schedule_lib.collectives(base.graph_module) if c.kind == "all_gather"), default=0)
    labelled = space.schedules(
        step.schedule, backward_order=backward_order, forward_end_order=forward_end_order, largest_gather_bytes=largest,
        microbatches=step.microbatches,
    )
    own = next((label for label, s in labelled if s == step.schedule), None)
    labelled = [(f"{own or repr(step.schedule)} (the step's own)", step.schedule)] + [
        (label, s) for label, s in labelled if s != step.schedule
    ]
    errors: dict[int, str] = {}
    scheduled: dict[int, object] = {}
    local = []
    for i, (_, schedule) in enumerate(labelled):
        try:
            scheduled[i] = _scheduled(base, schedule, mesh)
            local.append(_simulated(scheduled[i], machine))
        except Exception as error:  # noqa: BLE001 - a schedule the passes refuse is a rejected candidate
            errors[i] = f"{type(error).__name__}: {str(error)[:200]}"
            local.append((math.inf, math.inf))
    predicted = _largest_over_ranks(mesh, local)
    fits = [i for i, (_, peak) in enumerate(predicted) if peak <= budget_bytes]
    if not fits:
        smallest = min(range(len(predicted)), key=lambda i: predicted[i][1])
        raise ValueError(
            f"autotune: no schedule fits the budget of {budget_bytes} bytes ({budget_bytes / _MIB:.2f} MiB) per rank: "
            f"the smallest predicted peak is {int(predicted[smallest][1])} bytes "
            f"({predicted[smallest][1] / _MIB:.2f} MiB), by {labelled[smallest][1]!r}, among {len(labelled)} "
            f"schedules. Raise the budget, shrink the per-rank batch, use more ranks, or search a space with "
            f"more rematerialization (SearchSpace(remat=(1.0,)))"
        )
    ranked = sorted(fits, key=lambda i: (predicted[i][0], i))
    # The step's own schedule is the reference: measured even when it does not fit.
    measured_order = ranked[:confirm] + ([0] if 0 not in ranked[:confirm] and 0 not in errors else [])
    inputs = unscheduled.graph_inputs(state, batch)
    for i in measured_order:
        mesh.check_same_sequence(f"the collectives of the step with {labelled[i][1]!r}", scheduled[i].sequence)
    runs = [(scheduled[i], inputs) for i in measured_order]
    measurements = measure(mesh, runs, donate=step.donate, rounds=rounds, steps=steps, warmup=warmup)
    measured = dict(zip(measured_order, measurements))
    chosen, own_lowering, evidence = _choose(step, state, batch, machine, labelled, predicted, measured, budget_bytes, confidence)
    candidates = []
    for i, (label, schedule) in enumerate(labelled):
        time_s, peak = predicted[i]
        m = measured.get(i)
        candidates.append(
            TuneCandidate(
                label=label,
                schedule=schedule,
                predicted_s=None if math.isinf(time_s) else time_s,
                predicted_peak=None if math.isinf(peak) else int(peak),
                measured_s=m.step_s if m else None,
                measured_peak=m.peak_bytes if m else None,
                times_s=m.times_s if m else (),
                verdict=_verdict(i, chosen, predicted[i], m, budget_bytes, errors, confirm, measured[chosen], own_lowering, evidence),
            )
        )
    return TuneResult(labelled[chosen][1], budget_bytes, tuple(candidates), machine)


def _choose(step, state, batch, machine, labelled, predicted, measured, budget, confidence) -> tuple[int, dict, dict]:
    """The fastest measured schedule that fits the budget (predicted and measured) and, unless
    it is the step's own schedule (index 0) or that one does not fit, beats the step's own in
    the interleaved runs beyond chance (a sign test over the runs paired in time); then its
    own lowering (what `sharded_step(..., schedule=...)` traces) must be predicted to fit too.

    Returns `(its index, {index: own lowering's predicted peak}, {index: (wins, pairs, p)} of the
    schedules that fit but did not beat the step's own convincingly)`."""
    fits = [i for i, m in measured.items() if predicted[i][1] <= budget and m.peak_bytes <= budget]
    incumbent = 0 in fits
    evidence = {i: _sign_test(measured[i].times_s, measured[0].times_s) for i in fits if i != 0 and incumbent}

    def convincing(i: int) -> bool:
        return not incumbent or i == 0 or (evidence[i][2] <= 1 - confidence and measured[i].step_s < measured[0].step_s)

    eligible = sorted((i for i in fits if convincing(i)), key=lambda i: (measured[i].step_s, i))
    own_lowering: dict[int, float] = {}
    for i in eligible:
        compiled = with_schedule(step, labelled[i][1]).lower(state, batch)
        own_lowering[i] = _largest_over_ranks(step.mesh, [_simulated(compiled, machine)])[0][1]
        if own_lowering[i] <= budget:
            step.mesh.check_same("the schedule autotune chose", repr(labelled[i][1]))
            return i, own_lowering, {j: e for j, e in evidence.items() if not convincing(j)}
    found = "; ".join(
        f"{labelled[i][0]}: predicted {predicted[i][1] / _MIB:.2f} MiB, measured {m.peak_bytes / _MIB:.2f} MiB"
        for i, m in measured.items()
    )
    raise ValueError(
        f"autotune: no measured schedule fits the budget of {budget / _MIB:.2f} MiB per rank both as predicted and as "
        f"measured ({found}): the prediction missed memory the step allocates. Tune with a lower budget_bytes, "
        f"leaving that much room, or confirm more schedules (confirm=...)"
    )


def _sign_test(times: tuple, reference: tuple) -> tuple[int, int, float]:
    """(runs faster than the reference's run paired with it, pairs, the chance of at least that
    many if neither were faster: a one-sided sign test)."""
    pairs = len(reference)
    wins = sum(t < r for t, r in zip(times, reference))
    return wins, pairs, sum(math.comb(pairs, k) for k in range(wins, pairs + 1)) / 2**pairs


def _verdict(i, chosen, predicted, measured, budget, errors, confirm, best, own_lowering, evidence) -> str:
    if i == chosen:
        return "chosen"
    if i in errors:
        return f"could not be scheduled ({errors[i]})"
    if math.isinf(predicted[1]):
        return "could not be scheduled on another rank"
    over = (predicted[1] - budget) / _MIB
    if measured is None:
        return f"predicted peak over the budget by {over:.2f} MiB" if over > 0 else f"not measured: predicted slower than the {confirm} measured"
    if over > 0:
        return f"measured as the reference; predicted peak over the budget by {over:.2f} MiB"
    if measured.peak_bytes > budget:
        return f"measured peak over the budget by {(measured.peak_bytes - budget) / _MIB:.2f} MiB"
    if own_lowering.get(i, 0) > budget:
        return f"its own lowering's predicted peak is over the budget by {(own_lowering[i] - budget) / _MIB:.2f} MiB"
    if i in evidence:
        wins, pairs, p = evidence[i]
        return f"not reliably faster than the step's own: faster in {wins} of {pairs} paired runs (sign test p = {p:.2f})"
    return f"measured slower than the chosen ({measured.step_s / best.step_s:.2f}x)"


def _check_arguments(step, budget_bytes, confirm, rounds, steps, warmup, confidence) -> None:
    if not isinstance(step, ShardedStep):
        raise TypeError(f"autotune needs the fs.sharded_step to tune; got {type(step).__name__}")
    if not step.schedule.trace or step.schedule.passes is not None:
        raise ValueError(
            f"autotune searches the fields of a traced fs.Schedule; the step's schedule is {step.schedule!r}. "
            f"Make the step with fs.Schedule(...) fields (no trace=False, no passes=...)"
        )
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"autotune budget_bytes must be a positive int (bytes per rank); got {budget_bytes!r}")
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 <= confidence < 1:
        raise ValueError(f"autotune confidence must be a number in [0, 1); got {confidence!r}")
    for name, value, minimum in (("confirm", confirm, 1), ("rounds", rounds, 1), ("steps", steps, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"autotune {name} must be an int >= {minimum}; got {value!r}")


def _unit_orders(compiled) -> tuple[list[str], list[str]]:
    """The units in the order their backward starts, and in the order their forward ends."""
    regions = node_roles(compiled.graph_module).regions
    forward = [r for r in regions if r.phase == "forward"]
    backward = sorted((r for r in regions if r.phase == "backward"), key=lambda r: r.start)
    units = list(dict.fromkeys(_unit(r) for r in sorted(forward, key=lambda r: r.start)))
    backward_order = list(dict.fromkeys([_unit(r) for r in backward] + units))
    forward_end_order = list(dict.fromkeys([_unit(r) for r in sorted(forward, key=lambda r: r.end)] + units))
    return backward_order, forward_end_order


def _unit(region) -> str:
    return unit_of_label(region.unit)


def _scheduled(base, schedule: Schedule, mesh):
    """The `CompiledStep` of `schedule`: its passes applied to a copy of the unscheduled graph
    of `base`, then lowered, as the jit does right after tracing (`scheduled_step`)."""
    return scheduled_step(copy_graph_module(base.scheduled), schedule, mesh, key=base.key, io=base.io, guards=base.guards)


def _simulated(compiled, machine: Machine) -> tuple[float, float]:
    simulation = simulate(compiled, machine)
    return simulation.step_s, float(simulation.memory.peak)


def _largest_over_ranks(mesh, pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Every rank's (time, peak) per candidate -> the largest of each over ranks, on every rank."""
    rows = _everyone(mesh, [x for pair in pairs for x in pair])
    largest = [max(row[k] for row in rows) for k in range(2 * len(pairs))]
    return [(largest[k], largest[k + 1]) for k in range(0, len(largest), 2)]
