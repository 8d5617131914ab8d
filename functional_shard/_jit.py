"""The jit of `sharded_step`: trace the reference step once per input signature, schedule it, replay it.

Tracing runs the very function the eager reference runs (`_reference.update`) under
`make_fx(tracing_mode="fake")`: no real computation and no real collective happens while
tracing. The collectives in it are labelled as they are issued (`_tracing`), the end of the
forward pass is marked, the schedule's passes move the collectives, and the graph is cached
under a `CacheKey`.

Ranks decide together (`Jit.run`): every step starts with one small all-gather in which each
rank states the digest of the collectives of the graph it is about to run, or that it has to
trace. If any rank traces, every rank then compares the whole sequence of collectives before
any of them runs, so ranks whose batches have different shapes (variable-length batches) run
different graphs that issue the same collectives, and ranks that would issue different ones
raise together instead of pairing mismatched messages.

The replay runs the graph's generated function (`_replay.replay`), so that an operation that
fails names the user's line; what a trace leaves in torch's process-wide caches (FX's
generated sources, fake-tensor cache entries) goes with its graph when the bounded cache
evicts it (`_retained`).
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torch._subclasses.fake_tensor
import torch.fx.experimental.symbolic_shapes
from torch import fx

from . import _mesh, _tracing
from . import schedule as schedule_lib
from ._flat_io import FlatIO, TraceError, describe_batch
from ._layout import Layout
from ._pytree import tree_flatten, tree_paths
from ._replay import culprit_frame, make_fx_with_sources, replay
from ._retained import Retained
from .schedule._graph import copy_graph, microbatch_label
from .schedule._causal import causal_masks
from .schedule._lower import lower_for_mesh, runnable  # noqa: F401 - lower_for_mesh: re-exported (analysis._depth, tests)

__all__ = ["CacheKey", "CompiledStep", "FlatIO", "Jit", "TraceError", "agree"]


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """What a traced graph is specialised on: compared by value, hashable.

    Attributes:
        program: which computation ("a training step", "step.evaluate").
        layout: the parameters' layout (paths, shapes, dtypes, units, padding, precision).
        state_structure / state: the structure of the rest of the state (local leaves,
            optimizer state, loss scale, optimizer scalars), and its leaves' shapes and dtypes.
        batch_structure / batch: the batch's structure, and per leaf `("tensor", shape, dtype,
            device type)` or `("static", type name, value)` for values baked into the graph.
    """

    program: str
    layout: Layout
    state_structure: optree.PyTreeSpec
    state: tuple
    batch_structure: optree.PyTreeSpec
    batch: tuple

    def describe(self) -> str:
        parts = [f"{str(d[2]).removeprefix('torch.')}{list(d[1])}" if d[0] == "tensor" else repr(d[2]) for d in self.batch]
        return f"{self.program}, batch (" + ", ".join(parts) + ")"


@dataclasses.dataclass
class CompiledStep:
    """One traced, scheduled program, cached per `CacheKey` (and its guards).

    Attributes:
        key: what it was traced for.
        graph_module: the scheduled `torch.fx.GraphModule` (flat inputs and outputs, see `FlatIO`).
        io: packs its inputs and unpacks its outputs.
        guards: Python values it was specialised on (e.g. train/eval mode), re-read each call.
        events: the applied schedule, read back from the graph (`fs.schedule.ScheduleEvent`s).
        sequence: its collectives in issue order, as text (what ranks compare).
        digest: a 63-bit hash of `sequence`, never 0.
        all_gather_bytes / reduce_scatter_bytes: bytes of the full buffers moved per call.
        run: what is called each step (`graph_module` calling the operators' C++ entry points,
            `schedule._lower.runnable`, or its `torch.compile`d form).
        scheduled: the graph after the schedule's passes, before `lower_for_mesh` (what
            `fs.analysis.autotune` schedules again: passes must never see lowered nodes).
        release: forgets what its trace left in torch's process-wide caches (FX's generated
            sources, fake-tensor cache entries: `_retained`); called when the jit evicts it,
            else when it is garbage collected. It still runs afterwards.
    """

    key: CacheKey
    graph_module: fx.GraphModule
    io: FlatIO
    guards: list
    events: list
    sequence: list[str]
    digest: int
    all_gather_bytes: int
    reduce_scatter_bytes: int
    run: Callable
    scheduled: fx.GraphModule | None = None
    release: Callable[[], Any] = dataclasses.field(default=lambda: None, repr=False, compare=False)

    def explain(self) -> str:
        text = schedule_lib.explain(self.events, title=f"schedule of {self.key.describe()}")
        masks = self.graph_module.meta.get("causal_masks", ())  # schedule/_causal.py
        return text + "".join(f"\nattention mask: {line}" for line in masks)

    def guards_hold(self) -> bool:
        return all(g.read() == g.value for g in self.guards)


_DATA_DEPENDENT = tuple(
    t
    for t in (
        getattr(torch._subclasses.fake_tensor, "DataDependentOutputException", None),
        getattr(torch._subclasses.fake_tensor, "DynamicOutputShapeException", None),
        getattr(torch.fx.experimental.symbolic_shapes, "GuardOnDataDependentSymNode", None),
    )
    if t is not None
)


def trace(program: Callable[..., NamedTuple], mesh, key: CacheKey, io: FlatIO, inputs: list, schedule) -> CompiledStep:
    """Trace `program(shards, state, batch)` for `key` with fake tensors, label its
    collectives, apply `schedule`."""

    def flat_program(*flat):
        return io.outputs(program(*io.split_inputs(flat)))

    retained = Retained()  # what the trace adds to torch's process-wide caches
    with _tracing.recording() as (log, guards):
        try:
            # In a context of its own: make_fx sets a new context variable per trace (a config
            # patch), which would otherwise stay in the caller's context for good.
            gm = contextvars.copy_context().run(make_fx_with_sources(flat_program), *inputs)
        except Exception as error:
            retained.forget()
            if not isinstance(error, _DATA_DEPENDENT):
                raise
            op = getattr(error, "func", None)
            if op is None:  # a guard on an unbacked value: bool()/int()/float()/.item() of a tensor
                op = "aten._local_scalar_dense (bool(), int(), float() or .item() of a tensor)"
            detail = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
            raise TraceError(
                f"sharded_step could not trace loss_fn: the operation {op} needs the value of a tensor, at "
                f"{culprit_frame(error)} ({type(error).__name__}: {detail}). A traced step replays one graph for "
                f"every batch, so it cannot branch on data (Python if/while on a tensor, .item(), .tolist(), outputs "
                f"whose shape depends on values). Run this loss eagerly with fs.Schedule(trace=False), or write the "
                f"branch with torch.where"
            ) from error
    _label_collectives(gm, log)
    if schedule.causal_masks:
        causal_masks(gm)
    for index in io.forward_ends:
        _mark_forward_end(gm, index)
    return scheduled_step(gm, schedule, mesh, key=key, io=io, guards=list(guards), retained=retained)


def scheduled_step(
    gm: fx.GraphModule, schedule, mesh, *, key: CacheKey, io: FlatIO, guards: list, retained: Retained | None = None
) -> CompiledStep:
    """Apply `schedule`'s passes to the traced graph `gm` (in place), keep a copy, lower the
    result for `mesh` (`lower_for_mesh`) and make it a `CompiledStep`. What it (and the trace
    `retained` was made before) adds to torch's process-wide caches is released with it."""
    retained = retained if retained is not None else Retained()
    try:
        gm = schedule_lib.apply_schedule(gm, schedule, schedule_lib.PassContext.for_mesh(mesh))
        scheduled = copy_graph_module(gm)
        lower_for_mesh(gm, mesh, in_place=schedule.gradients_in_place and not schedule.compile)
        events = schedule_lib.analyze(gm)
        kinds = {
            "gather_issued": "all_gather", "reduce_scatter_issued": "reduce_scatter", "all_reduce_issued": "all_reduce"
        }
        issued = [e for e in events if e.event in kinds]
        # Compared across ranks before any runs: each collective with the axis of its group, so a
        # rank that would pair a tensor-parallel collective with another axis's is named.
        sequence = [f"{kinds[e.event]} of {e.buffer or 'a value'} over {e.axis or '?'} ({e.nbytes} bytes)" for e in issued]
        run = torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False) if schedule.compile else runnable(gm)
        gm.meta["inductor"] = schedule.compile  # how the analysis prices it (analysis/_fusion.py)
    except BaseException:
        retained.forget()
        raise
    compiled = CompiledStep(
        key=key,
        graph_module=gm,
        io=io,
        guards=guards,
        events=events,
        sequence=sequence,
        digest=_mesh._digest("\n".join(sequence)) or 1,
        # the state's buffers: a tensor-parallel collective moves activations (what eager counts too)
        all_gather_bytes=sum(e.nbytes for e in events if e.event == "gather_issued" and e.axis not in _mesh.MODEL_PARALLEL_AXES),
        reduce_scatter_bytes=sum(e.nbytes for e in events if e.event == "reduce_scatter_issued" and e.axis not in _mesh.MODEL_PARALLEL_AXES),
        run=run,
        scheduled=scheduled,
    )
    compiled.release = retained.own(compiled, (gm, scheduled, run))
    return compiled


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A module over a copy of `gm`'s graph (`schedule._graph.copy_graph`)."""
    return fx.GraphModule(gm, copy_graph(gm))


def _label_collectives(gm: fx.GraphModule, log: list[_tracing.Issued]) -> None:
    """Match the collectives recorded while tracing with the graph's collective nodes, in order."""
    issued = [n for n in gm.graph.nodes if n.target in schedule_lib.ISSUE_OPS]
    if len(issued) != len(log):
        raise RuntimeError(
            f"internal: the graph has {len(issued)} collectives but {len(log)} were issued while tracing; "
            f"is a collective issued outside the mesh's methods?"
        )
    for node, entry in zip(issued, log):
        if schedule_lib.ISSUE_OPS[node.target] != entry.kind:
            raise RuntimeError(f"internal: collective {node.name} is a {node.target} but was recorded as {entry.kind}")
        unit = entry.buffer.unit if entry.buffer is not None else ""
        if unit and entry.microbatch is not None:
            unit = microbatch_label(unit, entry.microbatch)  # each micro-batch gathers its own copy
        schedule_lib.tag(
            node,
            schedule_lib.CollectiveTag.for_node(
                node, buffer=entry.buffer.name if entry.buffer is not None else "", unit=unit, phase=entry.phase
            ),
        )


def _mark_forward_end(gm: fx.GraphModule, output_index: int) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    node = output.args[0][output_index]
    while node.op == "call_function" and node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        node = node.args[0]
    schedule_lib.mark_forward_end(node)


def agree(mesh, operation: str, facts: tuple[str, ...], value: int = 0) -> bool:
    """Every rank states the collective operation it enters, what it is (`facts`: lines such
    as the step's mode and optimizer, which every rank must hold alike) and an int (`value`,
    a traced graph's digest, or 0), hashed into the one int of the agreement every collective
    operation opens with (`BaseMesh.agree`). Returns whether every rank stated the same facts
    and value.

    Ranks whose facts differ raise `MeshError` together, before any other collective, naming
    the first fact that differs and what each rank holds there (found by a few all-gathers,
    only when the ints differ); so do ranks in different operations (`BaseMesh.agree`)."""
    if not facts:
        return len(set(mesh.agree(operation, value))) == 1
    if len(set(mesh.agree(operation, _mesh._digest("\n".join((*facts, str(value))))))) == 1:
        return True
    try:
        mesh.check_same_sequence(f"what {operation} is", list(facts))
    except _mesh.MeshError as error:
        groups: dict[str, list[int]] = {}
        for rank, fact in error.differences.items():
            groups.setdefault(fact, []).append(rank)
        held = "; ".join(f"rank {r[0]}: {fact}" if len(r) == 1 else f"ranks {r}: {fact}" for fact, r in groups.items())
        raise _mesh.MeshError(
            f"ranks disagree on what {operation} is: {held}. Every rank must make the same step (the same "
            f"optimizer, hyperparameters and learning rate schedule, fs.Schedule(trace=...), microbatches, loss "
            f"scale and nonfinite policy) and give it states at the same point: nothing of {operation} ran on any "
            f"rank, and its state is untouched",
            error.differences,
        ) from None
    return False


# How a rank that failed to trace fills its place in the ranks' comparison of collectives.
_FAILED = "<could not trace the step>"


class Jit:
    """The traced programs of one `ShardedStep`: a bounded cache, the ranks' agreement, the replay.

    Arguments:
        program: `program(shards, state, batch) -> NamedTuple with a .loss`; `state` is the
            tuple of the other inputs (local leaves, optimizer state, ...).
        name: what ranks call it when they agree (`BaseMesh.agree`), e.g. "a training step".
        mesh: the mesh.
        schedule: the `fs.Schedule` applied to every trace.
        max_traces: how many traced graphs to keep; past it the least recently used is
            dropped, and a warning names what keeps changing in the batch.
    """

    def __init__(self, program: Callable[..., NamedTuple], name: str, mesh, schedule, *, max_traces: int):
        self.program = program
        self.name = name
        self.mesh = mesh
        self.schedule = schedule
        self.max_traces = max_traces
        self.cache: collections.OrderedDict[CacheKey, list[CompiledStep]] = collections.OrderedDict()
        self.last: CompiledStep | None = None
        self.traces = 0  # graphs traced so far (a retrace after eviction counts again)
        self._warned = False

    def lower(self, layout: Layout, shards, state, batch) -> CompiledStep:
        """The traced, scheduled program for these inputs, without running it and without any
        collective (tensors may be fake or on the meta device; the cache is not touched)."""
        key, io, inputs, _ = self._key_and_inputs(layout, shards, state, batch)
        return trace(self._bound(layout), self.mesh, key, io, inputs, self.schedule)

    def graph_inputs(self, layout: Layout, shards, state, batch) -> list:
        """The flat inputs of the graph for these arguments."""
        return self._key_and_inputs(layout, shards, state, batch)[2]

    def _bound(self, layout: Layout):
        return lambda shards, state, batch: self.program(layout, shards, state, batch)

    def _key_and_inputs(self, layout: Layout, shards, state, batch):
        state_leaves, state_structure = tree_flatten(state)
        batch_leaves, batch_structure = tree_flatten(batch)
        key = CacheKey(
            program=self.name,
            layout=layout,
            state_structure=state_structure,
            state=tuple((tuple(t.shape), t.dtype) for t in state_leaves),
            batch_structure=batch_structure,
            batch=describe_batch(batch_leaves),
        )
        compiled = next((c for c in self.cache.get(key, ()) if c.guards_hold()), None)
        io = compiled.io if compiled is not None else FlatIO(layout, state_structure, batch_structure, batch_leaves)
        return key, io, io.inputs(shards, state_leaves, batch_leaves), compiled

    def run(self, layout: Layout, shards, state, batch, facts: tuple[str, ...] = ()) -> tuple[Any, CompiledStep]:
        """Run the program traced: look it up, agree with the other ranks on `facts` (what the
        program is: `agree`) and the graph (tracing where needed), replay."""
        key, io, inputs, compiled = self._key_and_inputs(layout, shards, state, batch)
        same = agree(self.mesh, self.name, facts, compiled.digest if compiled is not None else 0)
        if compiled is None or not same:
            compiled = self._agree_on_trace(key, io, inputs, compiled, layout, batch)
        self.cache.move_to_end(key)
        self.last = compiled
        with torch.no_grad():
            outputs = replay(compiled.run, inputs)
        return compiled.io.split_outputs(outputs), compiled

    def _agree_on_trace(self, key: CacheKey, io: FlatIO, inputs: list, compiled, layout: Layout, batch) -> CompiledStep:
        """Trace where this rank must (no collective runs while tracing), then compare every
        rank's sequence of collectives; a rank that failed to trace says so in the comparison,
        so that the others raise with it instead of waiting for its collectives."""
        mesh = self.mesh
        failure: BaseException | None = None
        if compiled is None:
            try:
                compiled = trace(self._bound(layout), mesh, key, io, inputs, self.schedule)
            except Exception as error:  # noqa: BLE001 - reported to every rank, then re-raised here
                failure = error
            else:
                self._insert(key, compiled, batch)
        sequence = compiled.sequence if compiled is not None else [
            f"{_FAILED} {type(failure).__name__}: {str(failure)[:300]}"
        ]
        try:
            mesh.check_same_sequence(f"the traced collectives of {self.name}", sequence)
        except _mesh.MeshError as error:
            if failure is not None:
                raise failure from None
            failed = [r for r, item in error.differences.items() if item.startswith(_FAILED)]
            if failed:
                raise _mesh.PeerError(
                    f"rank {failed[0]} could not trace {self.name}, so rank {mesh.rank} stops with it (no collective "
                    f"of it ran): {error.differences[failed[0]].removeprefix(_FAILED).strip()}",
                    failed[0],
                ) from None
            raise
        if failure is not None:
            raise failure
        assert compiled is not None
        return compiled

    def _insert(self, key: CacheKey, compiled: CompiledStep, batch) -> None:
        self.traces += 1
        self.cache.setdefault(key, []).append(compiled)
        self.cache.move_to_end(key)
        if sum(len(v) for v in self.cache.values()) > self.max_traces:
            oldest = next(iter(self.cache))
            self.cache[oldest].pop(0).release()
            if not self.cache[oldest]:
                del self.cache[oldest]
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"sharded_step traced {self.traces} graphs of {self.name} and keeps at most "
                    f"max_traces={self.max_traces}: {_what_changes(list(self.cache), batch)}. Each new shape or "
                    f"static value costs a trace (seconds, and memory for its graph): pad or bucket it to a few "
                    f"sizes, pass changing numbers as tensors, or raise max_traces",
                    RuntimeWarning,
                    stacklevel=5,
                )


def _what_changes(keys: list[CacheKey], batch) -> str:
    """Which batch leaf dimensions or static values took several values across `keys`."""
    paths = tree_paths(batch)
    changes = []
    if len({k.batch_structure for k in keys}) > 1:
        changes.append("the batch's structure changes")
    for i, path in enumerate(paths):
        described = [k.batch[i] for k in keys if len(k.batch) == len(paths)]
        kinds = {d[0] for d in described}
        if kinds == {"tensor"}:
            shapes = [d[1] for d in described]
            for dim in range(max(len(s) for s in shapes)):
                values = sorted({s[dim] for s in shapes if dim < len(s)})
                if len(values) > 1:
                    changes.append(f"batch leaf {path!r} dim {dim} took {len(values)} values {values[:8]}")
        elif len({d[2] for d in described}) > 1:
            changes.append(f"batch value {path!r} took {len({d[2] for d in described})} values")
    if len({(k.layout, k.state_structure, k.state) for k in keys}) > 1:
        changes.append("the state's structure or the optimizer's scalars changed")
    return "; ".join(changes) or "the batch's shapes or static values keep changing"
