"""A model's step figures per mesh, traced at two shallow depths and extended on the line to any
depth (what `plan_layouts` prices every layout with).

`Tracer` traces each (mesh, rows, depth) once, unscheduled, on an `AbstractMesh`, and applies
each checkpointing policy as passes to a copy of that trace (lowered for analysis only: no code
generation); `_read` takes a scheduled graph's figures: the simulator's step time, exposed
communication and compute per phase, peak and resident bytes, FSDP's gathered and reduced bytes,
the activations kept for the backward and the working set on top, FLOPs. Blocks are alike, so
every figure is a line in the depth once prefetching and freeing have settled (3 blocks);
`Figures.line` gives its slope per block and intercept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from torch import fx

from ..schedule import RematPolicy, Schedule
from ._abstract import AbstractMesh
from ._costs import node_cost
from ._forked import forked_map
from ._machine import Machine
from ._simulate import simulate

__all__ = ["Figures", "Tracer"]

class Figures(NamedTuple):
    """One traced step's figures (or their per-layer slope / intercept: the same fields)."""

    step_s: float
    exposed_s: float
    forward_s: float  # the forward's computation and its waits for tensor-parallel collectives
    backward_s: float  # ... the backward's (recomputation included)
    fsdp_s: float  # FSDP's collectives: the forward's all-gathers and the reduce-scatters, as priced on the link
    update_s: float  # compute time of the optimizer's update (early updates run inside the backward's span)
    peak: float
    resident: float
    activations: float  # activations alive at the end of the forward (kept for the backward)
    gathered: float  # full parameters (gather dtype) and full gradients (reduce dtype): what a stage holds gathered
    reduced: float  # ... of those, the full gradients (what a stage's first backward allocates)
    first_gathered: float  # ... of those, the first unit's (the embedding: a pipeline's first stage holds it)
    transient: float  # the most activation bytes alive at once beyond those kept for the backward
    block_transient: float  # ... while a block (neither the first unit nor the last) runs its backward
    forward_peak: float  # the most bytes alive while a forward node runs
    backward_peak: float  # ... a backward node
    update_peak: float  # ... an update node (each phase's peak is a line in depth once its place settles,
    # where the step's peak, the largest of them, may move from one phase to another: `peak_at`)
    new_state: float  # the parameters and optimizer state the update allocates (all but those it writes in place)
    update_working: float  # the most update temporaries alive at once
    flops: float

    def line(self, other: "Figures", d1: int, d2: int) -> tuple["Figures", "Figures"]:
        """(slope per layer, intercept at depth 0) of the line through (d1, self) and (d2, other)."""
        slope = Figures(*((b - a) / (d2 - d1) for a, b in zip(self, other)))
        return slope, Figures(*(a - d1 * s for a, s in zip(self, slope)))

    def at(self, intercept: "Figures", layers: float) -> "Figures":
        return Figures(*(i + layers * s for s, i in zip(self, intercept)))

    def peak_at(self, intercept: "Figures", layers: float) -> float:
        """The step's peak at `layers` blocks: the largest of the phases' peaks, each extended on
        its own line (the step's peak alone is not a line where its place moves with the depth:
        fsdp 2, bf16, full remat peaks in the backward at 3 blocks and in the update from 4 on,
        and its line through 3 and 4 was 10 % low at 6)."""
        at = self.at(intercept, layers)
        return max(at.peak, at.forward_peak, at.backward_peak, at.update_peak)


class Tracer:
    """Traces each (mesh, rows, depth) once, unscheduled, and applies each checkpointing policy
    to a copy of that trace (simulated on the machine)."""

    def __init__(self, build, batch, optimizer, precision, base: Schedule, machine: Machine, depths):
        self.build, self.batch, self.optimizer, self.precision = build, batch, optimizer, precision
        self.base, self.machine, self.depths = base, machine, depths
        self.traces = 0
        self._unscheduled: dict = {}
        self._figures: dict = {}

    def prefetch(self, needs: list, workers: int) -> None:
        """Compute the figures of every (dims, rows, remats) in `needs` with `workers` processes
        (`forked_map`: one (dims, rows) per task, its traces shared by its policies)."""
        groups: dict = {}
        for dims, rows, remats in needs:
            groups.setdefault((dims, rows), {})
            groups[(dims, rows)].update({_remat_key(remat): remat for remat in remats})
        todo = [(dims, rows, tuple(remats.values())) for (dims, rows), remats in groups.items()]

        def work(group):
            dims, rows, remats = group
            before = self.traces
            figures = {(dims, rows, d, _remat_key(remat)): self.figures(dims, rows, d, remat) for remat in remats for d in self.depths}
            return figures, self.traces - before

        for figures, traces in forked_map(work, todo, workers).values():
            if not figures.keys() <= self._figures.keys():  # a child's (this process's share is stored already)
                self._figures.update(figures)
                self.traces += traces

    def line(self, dims: tuple, rows: int, remat) -> tuple[Figures, Figures]:
        """(per-layer slope, intercept) of the step on mesh `dims` = (replicate, fsdp, tp) at `rows`
        rows, traced at the two `depths`."""
        d1, d2 = self.depths
        a, b = (self.figures(dims, rows, d, remat) for d in (d1, d2))
        return a.line(b, d1, d2)

    def figures(self, dims: tuple, rows: int, depth: int, remat) -> Figures:
        key = (dims, rows, depth, _remat_key(remat))
        if key not in self._figures:
            compiled = self._schedule(dims, rows, depth, remat)
            self._figures[key] = _read(compiled, self.machine)
        return self._figures[key]

    def _schedule(self, dims, rows, depth, remat):
        from .._jit import lower_for_mesh
        from .._make_step import sharded_step
        from ..schedule import PassContext, apply_schedule
        from ..schedule._graph import copy_graph

        key = (dims, rows, depth)
        if key not in self._unscheduled:
            r, f, t = dims
            # the layout's own mesh (plan_layouts' axes): no fsdp axis where it shards nothing, as
            # a user's {"replicate": 2} or {"tp": 2} has none (with one, its buffers are gathered)
            axes = {k: v for k, v in (("replicate", r), ("fsdp", f), ("tp", t)) if v > 1} or {"fsdp": 1}
            mesh = AbstractMesh(axes)
            loss_fn, params, placements = self.build(depth, mesh)
            step = sharded_step(loss_fn, mesh, optimizer=self.optimizer, precision=self.precision, placements=placements,
                                schedule=Schedule(passes=(), accumulate=self.base.accumulate, offload=self.base.offload,
                                                  reshard_after_update=self.base.reshard_after_update))  # fmt: skip
            self._unscheduled[key] = (step.lower(step.init_abstract(params), self.batch(rows)), mesh)
            self.traces += 1
        unscheduled, mesh = self._unscheduled[key]
        # The passes and the lowering the jit applies (`scheduled_step`), on a copy that is analyzed,
        # never run: no Python code is generated for it.
        gm = apply_schedule(_GraphOnly(unscheduled.scheduled, copy_graph(unscheduled.scheduled)),
                            dataclasses.replace(self.base, remat=remat), PassContext.for_mesh(mesh))  # fmt: skip
        lower_for_mesh(gm, mesh)
        return _Lowered(gm, unscheduled.io, unscheduled.key)


class _GraphOnly(fx.GraphModule):
    """A graph module to analyze, never to run: `recompile` (Python code generation, most of the
    passes' cost on a large graph) does nothing."""

    def recompile(self):
        return None


class _Lowered(NamedTuple):
    """What `simulate` reads of a `CompiledStep`."""

    graph_module: fx.GraphModule
    io: Any
    key: Any


def _remat_key(remat):
    return remat if isinstance(remat, (bool, RematPolicy)) else repr(remat)


def _read(compiled, machine: Machine) -> Figures:
    from .. import schedule as schedule_lib
    from ._regions import node_roles

    gm = compiled.graph_module
    sim = simulate(compiled, machine)
    tp_waits = {phase: sum(e.duration_us for e in sim.timeline if e.category == "wait" and e.phase == phase
                           and e.name.startswith("wait tp")) / 1e6 for phase in ("forward", "backward")}  # fmt: skip
    fsdp = sum(e.duration_us for e in sim.timeline if e.category == "collective" and (
        (e.name.startswith("all_gather") and e.phase == "forward") or e.name.startswith("reduce_scatter"))) / 1e6
    held = [c for c in schedule_lib.parameter_collectives(gm)  # FSDP's: the forward's gathers and the reductions
            if (c.kind == "all_gather" and c.phase == "forward") or c.kind == "reduce_scatter"]  # fmt: skip
    first_unit = next((c.unit for c in held if c.kind == "all_gather"), None)
    roles = node_roles(gm)  # one pass over the graph, for the phases' peaks and `_activations`
    saved, transient, block_transient, new_state, update_working = _activations(compiled, roles)
    phase_of = roles.phase
    by_phase = {"forward": 0, "backward": 0, "update": 0}
    for node, alive in zip(gm.graph.nodes, sim.memory.timeline):
        phase = phase_of.get(node)
        if phase in by_phase:
            by_phase[phase] = max(by_phase[phase], alive)
    return Figures(
        sim.step_s, sim.exposed_s, sim.phases["forward"] + tp_waits["forward"], sim.phases["backward"] + tp_waits["backward"],
        fsdp, sim.phases.get("update", 0.0),
        float(sim.memory.peak), float(sim.memory.resident), float(saved), float(sum(c.nbytes for c in held)),
        float(sum(c.nbytes for c in held if c.kind == "reduce_scatter")),
        float(sum(c.nbytes for c in held if c.unit == first_unit)), float(transient), float(block_transient),
        float(by_phase["forward"]), float(by_phase["backward"]), float(by_phase["update"]),
        float(new_state), float(update_working),
        float(sum(node_cost(n).flops for n in gm.graph.nodes if n.op == "call_function")),
    )  # fmt: skip


def _activations(compiled, roles) -> tuple[int, int, int, int, int]:
    """(bytes of activations alive at the end of the forward: what the forward keeps for the
    backward, and what each micro-batch in flight holds under a pipeline; the most bytes of other
    activations and update temporaries alive at once: the working set on top; the same while a
    block, not the first or last unit, runs its backward; bytes of the new parameters and
    optimizer state the update allocates; the most update temporaries alive at once). `roles`:
    `node_roles` of the compiled graph."""
    from .. import schedule as schedule_lib
    from ..schedule._liveness import lifetimes
    from ._memory import _categories

    gm = compiled.graph_module
    nodes = list(gm.graph.nodes)
    end = nodes.index(schedule_lib.forward_end(gm))
    storage_of, first, last, size, root = lifetimes(nodes)
    category = _categories(nodes, storage_of, root, roles, compiled.io)
    working = [k for k in first if category[k] in ("activations", "update_temporaries")]
    saved = [k for k in working if category[k] == "activations" and first[k] <= end < last[k]]
    curve = _alive(len(nodes), set(working) - set(saved), first, last, size)
    regions = roles.regions
    order = [r.unit for r in sorted((r for r in regions if r.phase == "forward"), key=lambda r: r.start)]
    ends = {order[0], order[-1]} if order else set()
    blocks = [max(curve[r.start : r.end + 1], default=0) for r in regions if r.phase == "backward" and r.unit not in ends]
    new_state = sum(size[k] for k in first if category[k] in ("parameters", "optimizer_state") and root[k].op != "placeholder")
    temporaries = _alive(len(nodes), [k for k in first if category[k] == "update_temporaries"], first, last, size)
    update = max((temporaries[i] for i, n in enumerate(nodes) if roles.phase.get(n) == "update"), default=0)
    return sum(size[k] for k in saved), max(curve, default=0), max(blocks, default=0), new_state, update


def _alive(count: int, keys, first: dict, last: dict, size: dict) -> list[int]:
    """Bytes of the storages `keys` alive while each of `count` nodes runs."""
    delta = [0] * (count + 1)
    for k in keys:
        delta[first[k]] += size[k]
        delta[last[k] + 1] -= size[k]
    alive, curve = 0, []
    for d in delta[:-1]:
        alive += d
        curve.append(alive)
    return curve
