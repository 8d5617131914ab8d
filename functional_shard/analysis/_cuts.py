"""`tune_pipeline`: schedules, micro-batch counts and stage cuts of a pipelined step, ranked under
a memory budget.

A stage cut says which contiguous run of units forms each stage (what
`fs.pipeline.Pipeline(stages=...)` takes). The figures of every cut come from one reading of the
units: the step's `loss_fn` is traced once on fake tensors and cut with one stage per unit (the
step's own machinery, `cut_stages`), and per unit are read its nodes' FLOPs and time on the
machine, the storages its forward saves and those its I leaves alive (each named by the traced
node that made it), the gradients its I keeps for W, the bytes crossing the boundary after it and
its parameter elements. A stage of any run of units is composed from them:

- FLOPs and time: the units' own nodes added, and once what several units recompute or read —
  the nodes of the batch and buffers alone (masks, position ids, rotary tables: every stage that
  reads them recomputes them, once), the batch and buffer leaves; reading what the stage
  receives counts for its first unit only;
- saved and held bytes: every storage once (a value one unit makes and another saves is the
  same storage in one stage), plus the kept gradients, plus what two neighbours keep alive after
  I only when in one stage (measured once, on two cuts into pairs of units);
- sent: the boundary after its last unit (the values made at or before it and read after it,
  whatever the grouping); parameter elements: the sum.

so the composed figures are those of `plan_pipeline` on a step built with that cut (FLOPs and
time exactly, bytes within 1%: tests/test_pipeline_analysis.py). The cuts tried per schedule
(pipeline ranks x its stages per rank stages): the step's own, the default "blocks", the
time-balanced one (`min_max_cut` on the stages' composed time, as `balance_stages`), per
micro-batch count the memory-balanced one (the same program on a stage's predicted bytes: state,
gathered parameters and gradients, its in-flight micro-batches), and every contiguous cut when
there are at most `_ENUMERATE` of them.
"""

from __future__ import annotations

import math
import operator
from itertools import combinations
from typing import Any, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .._losses import StepError
from .._pipe_saved import split_bytes
from .._stage_assign import assign_stages
from .._stages import cut_stages, cut_traced, unit_of_nodes
from ..pipeline import Pipeline, build_schedule, peak_in_flight
from ..pipeline._actions import ActionKind
from ._machine import Machine, h100_sxm
from ._pipeline import _node_seconds, _plan, _stage_figures, _StageFigures, min_max_cut, update_peak
from ._ranking import rank_with_reasons

__all__ = ["PipelineCandidate", "tune_pipeline", "unit_table"]

_ENUMERATE = 200  # every contiguous cut is tried when there are at most this many


class PipelineCandidate(NamedTuple):
    """One (schedule, micro-batches, stage cut) alternative of `tune_pipeline`."""

    schedule: str
    microbatches: int
    step_s: float  # predicted makespan of the pipelined part of the step
    bubble: float  # the largest idle fraction over ranks
    peak_bytes: int  # the largest predicted bytes over ranks
    fits: bool  # peak_bytes <= the budget
    why: str  # why it ranks where it does
    stages: tuple = ()  # unit names per stage: fs.pipeline.Pipeline(schedule, stages=stages)
    cut: str = ""  # where the cut comes from: "own" (the step's), "blocks", "time", "memory", "any" (enumerated)


class _Unit(NamedTuple):
    """What one unit contributes to any stage that holds it (`unit_table`)."""

    flops: int  # its own nodes (and reading its parameters)
    seconds: float
    entry: tuple[int, float]  # reading what it receives: counted when it begins a stage
    shared: frozenset  # names of what a stage computes or reads once however many of its units need it
    saved: dict  # traced node that made a storage its forward saves -> bytes
    alive: dict  # the same for the storages its I leaves alive
    kept: int  # bytes of the gradients its I keeps for W
    sent: int  # bytes crossing the boundary after it
    elements: int  # parameter elements
    differentiable: bool  # it receives a value with a gradient (else, beginning a stage, its I has none to compute)
    lent: int = 0  # bytes crossing the boundary after it once per step (values made of parameters alone)


class UnitTable:
    """Per-unit figures of a pipelined step and the stages composed from them (`stage(a, b)`:
    units[a:b] as one stage, at the step's own micro-batch size). `joined[u]`: the (saved, held)
    bytes units u and u + 1 add when in one stage, beyond their composed figures (measured on
    pairs: see `unit_table`)."""

    def __init__(self, units: tuple[str, ...], rows: list[_Unit], shared: dict[str, tuple[int, float]]):
        self.units, self.rows, self.shared = units, rows, shared
        self.joined = [(0, 0)] * max(len(units) - 1, 0)
        self._stages: dict[tuple[int, int], _StageFigures] = {}

    def stage(self, a: int, b: int) -> _StageFigures:
        if (a, b) not in self._stages:
            rows = self.rows[a:b]
            shared = frozenset().union(*(r.shared for r in rows))
            saved: dict = {}
            alive: dict = {}
            for r in rows:  # a storage's bytes: where the stage first meets it (made, or received)
                for k, n in r.saved.items():
                    saved.setdefault(k, n)
                for k, n in r.alive.items():
                    alive.setdefault(k, n)
            flops = rows[0].entry[0] + sum(r.flops for r in rows) + sum(self.shared[k][0] for k in shared)
            seconds = rows[0].entry[1] + sum(r.seconds for r in rows) + sum(self.shared[k][1] for k in shared)
            joined = self.joined[a : b - 1]
            nbytes = sum(saved.values()) + sum(j[0] for j in joined)
            # a stage receiving no gradient-carrying value has no I: its W is the whole backward, all saved held
            held = sum(alive.values()) + sum(r.kept for r in rows) + sum(j[1] for j in joined) if rows[0].differentiable else nbytes
            sent, lent = (rows[-1].sent, rows[-1].lent) if b < len(self.units) else (0, 0)
            self._stages[a, b] = _StageFigures(flops, seconds, nbytes, held, sent, sum(r.elements for r in rows),
                                               max(r.elements for r in rows), lent)  # fmt: skip
        return self._stages[a, b]

    def figures(self, bounds: Sequence[tuple[int, int]]) -> list[_StageFigures]:
        return [self.stage(a, b) for a, b in bounds]


class _Keyed(fx.Interpreter):
    """Runs a stage program of the per-unit cut, naming each storage by the traced node that made
    it first (a view shares its base's): `keys[storage id] = name`. Every value stays alive while
    it runs, so no storage id is reused; an operation's storages no node takes stay unnamed (the
    unit's own)."""

    def __init__(self, program, names: list[str], num_params: int, keys: dict):
        super().__init__(program.module, garbage_collect_values=False)
        self.program, self.names, self.num_params, self.keys = program, names, num_params, keys

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):  # a tuple's tensors: named by the getitem nodes that take them
            self.keys.setdefault(StorageWeakRef(out.untyped_storage()).cdata, _key(n, self.program, self.names, self.num_params))
        return out


def _key(n: fx.Node, program, names: list[str], num_params: int) -> str | None:
    """The traced node (its name) a program node copies or reads: a copied node's origin, the
    placeholder of a parameter, batch or buffer leaf, the node a received value was made by."""
    origin = n.meta.get("fs_origin")
    if origin is not None:
        return origin
    if n.op == "call_function" and n.target is operator.getitem and n.args[0].op == "placeholder":
        kind, k = n.args[0].name, n.args[1]
        if kind == "received":
            return program.received[k].name
        if kind == "batch":
            return names[num_params + program.batch[k]]
        return names[{"params": program.params, "local": program.local}[kind][k]]
    return None


def unit_table(step: Any, state: Any, batch: Any, machine: Machine) -> UnitTable:
    """Each unit's figures on `batch`, read from the step's `loss_fn` cut with one stage per unit
    (one trace, one fake forward and I per unit; local, no collective); then, from two cuts into
    pairs of units ((0, 1), (2, 3), ... and (1, 2), (3, 4), ...), what two neighbours add when
    in one stage: a stage's I keeps alive some storages a unit saves when more of the stage
    follows it (a Llama block's middle residual and its norm's rsqrt), which the units alone free."""
    step._check_state(state, "fs.analysis.tune_pipeline(step, state, batch)")
    micro = step._micro(batch)[0]
    position, num_params, n = step._unit_of_leaf, len(step._meta), len(step._units)
    gm = cut_stages(step.loss_fn, step._treedef, step._meta, position, micro, 0, step.mesh, has_aux=step.has_aux)
    for node in gm.graph.nodes:
        node.meta["fs_origin"] = node.name  # the programs' copies keep it (node_copy copies meta)
    names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
    # read once per stage: nodes of the batch and buffers alone, batch leaves, buffer leaves
    once = {node.name for node, p in unit_of_nodes(gm, num_params, position).items() if p < 0}
    once |= {names[i] for i, p in enumerate(position) if p is None} | set(names[num_params:])
    shared: dict[str, tuple[int, float]] = {}

    def measure(group: Sequence[int]) -> list[_Unit]:  # the stages of the cut unit u -> stage group[u]
        stage_of_leaf = [None if u is None else group[u] for u in position]
        return _measure(step, cut_traced(gm, num_params, stage_of_leaf, group[-1] + 1), stage_of_leaf, batch, machine,
                        names, once, shared)  # fmt: skip

    table = UnitTable(step._units, measure(range(n)), shared)
    for start in (0, 1):  # pairs beginning at even units, then at odd ones
        if n - start < 2:
            continue
        pairs = measure([(u + start) // 2 for u in range(n)])
        for k, row in enumerate(pairs):
            u = 2 * k - start
            if u < 0 or u + 1 >= n:
                continue
            alone = table.stage(u, u + 2)
            held = sum(row.alive.values()) + row.kept if row.differentiable else sum(row.saved.values())
            table.joined[u] = (sum(row.saved.values()) - alone.saved, held - alone.held)
    table._stages.clear()
    return table


def _measure(step: Any, cut, stage_of_leaf: list, batch: Any, machine: Machine, names: list[str], once: set,
             shared: dict) -> list[_Unit]:  # fmt: skip
    """One `_Unit` per stage of `cut` (fake tensors: one forward and I per stage); what a stage
    reads once goes to `shared`, name -> (FLOPs, seconds)."""
    last, num_params = len(cut.stages) - 1, len(stage_of_leaf)
    elements = step.stage_param_elements(stage_of_leaf)

    def measure(p, run, params, received, persistent):
        keys: dict = {}
        storages: dict = {}

        def call(*inputs):
            interpreter = _Keyed(p, names, num_params, keys)
            try:
                return interpreter.run(*inputs)
            finally:
                interpreter.env.clear()

        held = split_bytes(lambda: run(call), received, params, p.index == last, p.sent, storages, persistent)[1]
        return keys, storages, held

    measured = step._fake_stages(cut, batch, measure)
    rows = []
    for p in cut.stages:
        flops, seconds, entry, reads = 0, 0.0, [0, 0.0], set()
        for node in p.module.graph.nodes:
            f, t = _node_seconds(node, machine)
            key = _key(node, p, names, num_params)
            if key in once:
                shared[key] = (f, t)
                reads.add(key)
            elif "fs_origin" not in node.meta and key is not None and node.args[0].name == "received":
                entry[0], entry[1] = entry[0] + f, entry[1] + t
            else:
                flops, seconds = flops + f, seconds + t
        keys, storages, held = measured[p.index]
        saved, alive = {}, {}
        for k, (nbytes, live) in storages.items():
            name = keys.get(k, ("storage", p.index, k))  # made inside an operation: this stage's own
            saved[name] = nbytes
            if live:
                alive[name] = nbytes
        sent, lent = (cut.bytes_between(p.index), cut.lent_between(p.index)) if p.index < last else (0, 0)
        rows.append(_Unit(flops, seconds, tuple(entry), frozenset(reads), saved, alive, held - sum(alive.values()), sent,
                          elements.get(p.index, 0), any(b.differentiable for b in p.received), lent))  # fmt: skip
    return rows


def tune_pipeline(step: Any, state: Any, batch: Any, *, budget_bytes: int | None = None, machine: Machine | None = None,
                  schedules: tuple = ("gpipe", "1f1b", "zb_h1"), microbatches: tuple | None = None,
                  cuts: Any = True) -> list[PipelineCandidate]:  # fmt: skip
    """Every (schedule, micro-batch count, stage cut) of a pipelined step, ranked: those that fit
    `budget_bytes` (per rank) first, fastest predicted makespan first; each with why it ranks there.

    Arguments:
        step / state / batch: a `PipelineStep`, its state and one batch of this rank.
        budget_bytes: the memory a rank may use (None: no limit).
        machine: as for `plan_pipeline`.
        schedules: built-in names (or `fs.pipeline.Pipeline`s); each with the stages its ranks x
            stages per rank give.
        microbatches: counts to try (default: every divisor of the batch's rows from the pipeline
            ranks up, and the step's own).
        cuts: True (default): per schedule the step's own cut, "blocks", the time-balanced and
            (per count) the memory-balanced cut, and every contiguous cut when there are at most
            200; False: the step's own cut only; or a sequence of cuts (unit names per stage).
    """
    machine = machine if machine is not None else h100_sxm()
    rows = step.batch_rows(batch)
    if not schedules:
        raise ValueError("tune_pipeline schedules must name at least one schedule")
    if microbatches is not None and (not microbatches or not all(isinstance(k, int) and k >= 1 for k in microbatches)):
        raise ValueError(f"tune_pipeline microbatches must be counts >= 1 (or None: every divisor of the rows); got {microbatches!r}")
    counts = microbatches or tuple(sorted({k for k in range(1, rows + 1) if rows % k == 0 and k >= step.num_ranks} | {step.microbatches}))
    if not any(rows % k == 0 for k in counts):
        raise ValueError(f"tune_pipeline: none of microbatches={tuple(counts)} cuts the batch's {rows} rows into equal micro-batches")
    units = step._units
    of = {u: s for u, s in zip(step._unit_of_leaf, step._stage_of_leaf) if u is not None}
    own = _bounds([[u for u in range(len(units)) if of[u] == s] for s in range(step.num_stages)])
    table, unsearched = None, ""
    if cuts is not False:
        try:
            table = unit_table(step, state, batch, machine)
        except StepError as error:  # a value that is not a tensor crosses a unit boundary: the step's own cut only
            table, unsearched = None, f"; other stage cuts not searched: {str(error)[:200]}"
    own_figures = _stage_figures(step, state, batch, machine) if table is None else None
    update = step.update_bytes(state)  # the same for every candidate
    out, plans = [], {}
    for entry in schedules:
        pipeline = entry if isinstance(entry, Pipeline) else Pipeline(entry)
        name = entry if isinstance(entry, str) else getattr(pipeline.schedule, "name", str(pipeline.schedule))
        num_stages = step.num_ranks * pipeline.virtual_stages()
        tried = {own: "own"} if table is None else _cuts(table, num_stages, own, cuts)
        for m in counts:
            if rows % m:
                continue
            try:
                compute = build_schedule(pipeline, step.num_ranks, m)
            except Exception as error:  # noqa: BLE001 - a schedule that does not exist at these sizes
                out.append(PipelineCandidate(name, m, float("inf"), 1.0, 0, False, f"not buildable: {str(error)[:120]}"))
                continue
            if not tried:
                given = (f"; none of the given cuts has {num_stages} stages (they have {sorted({len(c) for c in cuts})})"
                         if cuts not in (True, False) else "")  # fmt: skip
                why = f"not buildable: {num_stages} stages, {len(units)} units ({', '.join(units)}){given}"
                out.append(PipelineCandidate(compute.name, m, float("inf"), 1.0, 0, False, why))
                continue
            here = {k: v for k, v in tried.items() if v != "any"}  # the named cuts, then the enumerated ones
            if table is not None and cuts is True and num_stages <= len(units):
                here.setdefault(_memory_cut(step, state, table, compute, m, update), "memory")
            for k, v in tried.items():
                here.setdefault(k, v)
            for bounds, label in here.items():
                figures = own_figures if table is None else table.figures(bounds)
                stages = tuple(tuple(units[a:b]) for a, b in bounds)
                try:
                    plan = _plan(step, state, figures, machine, pipeline, m, update)
                except Exception as error:  # noqa: BLE001 - the schedule has another number of stages
                    out.append(PipelineCandidate(compute.name, m, float("inf"), 1.0, 0, False,
                                                 f"not buildable: {str(error)[:120]}", stages, label))  # fmt: skip
                    continue
                peak = max(plan.peak_bytes)
                fits = budget_bytes is None or peak <= budget_bytes
                c = PipelineCandidate(plan.schedule, m, plan.makespan_s, max(plan.bubble), peak, fits, "", stages, label)
                plans[c.schedule, m, stages] = plan
                out.append(c)
    fitting: dict = {}  # (schedule, micro-batches) -> the fastest candidate that fits
    for c in out:
        key = c.schedule, c.microbatches
        if c.fits and (key not in fitting or c.step_s < fitting[key].step_s):
            fitting[key] = c
    ranked = rank_with_reasons(out, peak=lambda c: c.peak_bytes, over=lambda c: _over(c, fitting, budget_bytes),
                               best=lambda c: f"fastest that fits: bubble {c.bubble:.3f}, peak {c.peak_bytes / 2**20:.1f} MiB, {_label(c)}",
                               slower=lambda c, best: _slower(c, best, plans))  # fmt: skip
    return [c._replace(why=c.why + unsearched) for c in ranked] if unsearched else ranked


def _bounds(groups: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((g[0], g[-1] + 1) for g in groups)


def _label(c: PipelineCandidate) -> str:
    return f"{c.cut} cut " + "+".join(str(len(s)) for s in c.stages)


def _cuts(table: UnitTable, num_stages: int, own: tuple, cuts: Any) -> dict[tuple, str]:
    """Cut (per stage (first unit, end)) -> where it comes from, first names kept."""
    units, n = table.units, len(table.units)
    out: dict[tuple, str] = {}
    if cuts is not True:  # the caller's cuts
        for cut in cuts:
            if len(cut) == num_stages:
                of = assign_stages(units, num_stages, cut)
                out.setdefault(_bounds([[u for u in range(n) if of[units[u]] == s] for s in range(num_stages)]), "given")
        return out
    if len(own) == num_stages:
        out[own] = "own"
    if num_stages > n:
        return out
    try:
        of = assign_stages(units, num_stages, "blocks")
        out.setdefault(_bounds([[u for u in range(n) if of[units[u]] == s] for s in range(num_stages)]), "blocks")
    except StepError:
        pass  # fewer blocks than stages
    out.setdefault(tuple(min_max_cut(n, num_stages, lambda s, i, j: table.stage(i, j).seconds)), "time")
    if math.comb(n - 1, num_stages - 1) <= _ENUMERATE:
        for inner in combinations(range(1, n), num_stages - 1):
            edges = (0, *inner, n)
            out.setdefault(tuple(zip(edges, edges[1:])), "any")
    return out


def _memory_cut(step: Any, state: Any, table: UnitTable, compute, m: int, update: tuple[float, float]) -> tuple:
    """The cut whose largest stage holds the fewest predicted bytes under `compute` at `m`
    micro-batches: its state, gathered parameters and their gradients, and its in-flight
    micro-batches (`peak_in_flight`) at their saved bytes (with a split backward, the larger of
    saved and held after I), or its update's bytes (`update`: `step.update_bytes(state)`),
    whichever is more."""
    in_flight = peak_in_flight(compute)
    scale = step.microbatches / m
    shards = step.mesh.num_shards
    state_bytes = step.state_bytes_per_element(state) / shards
    per_element = state_bytes + step.gather_bytes_per_element()
    split = any(a.kind is ActionKind.I for row in compute.actions for a in row)  # micro-batches held from I to W

    def cost(s: int, i: int, j: int) -> float:
        f = table.stage(i, j)
        pipelined = f.elements * per_element + in_flight[s] * (max(f.saved, f.held) if split else f.saved) * scale
        return max(pipelined, update_peak(f.elements * state_bytes, f.elements, f.largest, update, shards))

    return tuple(min_max_cut(len(table.units), compute.num_stages, cost))


def _over(c: PipelineCandidate, fitting: dict, budget: int | None) -> str:
    why = f"needs {c.peak_bytes / 2**20:.1f} MiB per rank, over the budget of {(budget or 0) / 2**20:.1f} MiB"
    other = fitting.get((c.schedule, c.microbatches))
    if other is not None:  # its cut is what puts it over
        why += f"; the {_label(other)} fits at this schedule and micro-batches ({other.peak_bytes / 2**20:.1f} MiB)"
    return why


def _slower(c: PipelineCandidate, best: PipelineCandidate, plans: dict) -> str:
    why = f"{c.step_s / best.step_s:.2f}x the best's time (bubble {c.bubble:.3f} vs {best.bubble:.3f})"
    if c.stages != best.stages:
        slowest = [max(s.forward_s for s in plans[x.schedule, x.microbatches, x.stages].stages) * x.microbatches for x in (c, best)]
        why += f"; {_label(c)}: slowest stage {slowest[0] / slowest[1]:.2f}x the best's"
    return why
