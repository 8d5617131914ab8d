"""`Schedule`: how `sharded_step` runs a step, and the list of passes that schedules it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from torch import fx

from ._analysis import analyze, in_flight_intervals
from . import _passes
from ._context import Pass, PassContext, as_pass
from ._buckets import bucket_gathers
from ._graph import fill_values
from ._microbatches import gather_once
from ._offload import Offload, stream_offload_copies
from ._passes import _FrozenMapping
from ._remat import RematPolicy, rematerialize, remat_value
from ._update import early_update


def default_passes(
    *,
    prefetch: int = 1,
    reshard_after_forward: bool | Mapping[str, bool] = True,
    default_reshard: bool = True,
    reduce_scatters_in_flight: int | None = None,
    bucket_bytes: int = 0,
    extra_passes: Sequence = (),
    remat=False,
    reshard_after_backward: bool = True,
    offload=None,
) -> tuple[Pass, ...]:
    """The pass list `Schedule(...)` expands to, in order:

        rematerialize(remat),                # only when remat is not False
        gather_once(),                       # only when reshard_after_backward is False
        reshard_after_forward(reshard_after_forward, default=default_reshard),
        prefetch(prefetch),
        early_reduce_scatter(in_flight=reduce_scatters_in_flight),
        stream_offload_copies(),             # only with offload
        bucket_gathers(bucket_bytes),        # only when bucket_bytes > 0
        *extra_passes,                       # plain functions gm -> gm are wrapped
        limit_in_flight(),                   # the mesh's max_collectives_in_flight
        early_update(),                      # moves no collective: runs after the bound
        stream_offload_copies(),             # only with offload: again, after the update moved

    `rematerialize` comes first because it adds computation to the backward that reads the
    units' gathered parameters: `reshard_after_forward` then gives those reads, like every
    other backward read, the backward's own all-gather (after it, they would keep the
    forward's gathered copy alive until the backward), and `prefetch` places that gather
    before the first recomputed node, which is the unit's first backward use.
    """
    passes = [rematerialize(remat)] if remat is not False and remat != () else []
    if not reshard_after_backward:
        passes.append(gather_once())
    passes += [
        _passes.reshard_after_forward(reshard_after_forward, default=default_reshard),
        _passes.prefetch(prefetch),
        _passes.early_reduce_scatter(in_flight=reduce_scatters_in_flight),
    ]
    if offload is not None:
        passes.append(stream_offload_copies())
    if bucket_bytes:
        passes.append(bucket_gathers(bucket_bytes))
    tail = (_passes.limit_in_flight(), early_update()) + ((stream_offload_copies(),) if offload is not None else ())
    return (*passes, *(as_pass(p) for p in extra_passes), *tail)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How `sharded_step` runs a step: eagerly, or traced and scheduled by a list of passes.

    The fields `prefetch`, `reshard_after_forward`, `default_reshard`,
    `reduce_scatters_in_flight`, `bucket_bytes`, `extra_passes`, `remat` and
    `reshard_after_backward` are the convenient form:
    they build the default pass list (`default_passes`, read back as `pass_list`). `passes`
    gives the list itself instead (then those fields must keep their defaults).

    Attributes:
        trace: True (default) traces the step once per input signature into one graph,
            applies the passes, and replays the graph; False runs the eager reference
            (gather everything, `grad(loss ∘ gather)`, update) — slower, same bits.
        prefetch: a unit's all-gather is issued `prefetch` units ahead of its first use and
            waited right before it (0: gathered on demand). In forward and in backward.
        reshard_after_forward: True frees a unit's full parameters after its last forward use
            and gathers them again for its backward (ZeRO-3: 1.5x the bytes, far less memory);
            False keeps them from forward to backward. A dict `unit -> bool` overrides it per
            unit (units not in it take `default_reshard`).
        default_reshard: the value for units a dict `reshard_after_forward` leaves out.
        reduce_scatters_in_flight: None waits each reduce-scatter as late as possible (right
            before its result is read); an int k waits it once k later ones have been issued,
            which bounds how many full-size gradients are alive at once. The mesh's own bound
            (`limit_in_flight`; 1 on gloo) applies on top.
        bucket_bytes: 0 gathers each unit with its own collective; more merges the all-gathers
            of units next to each other in issue order (same pass, same dtype) into one
            collective of at most this many bytes (full buffers).
        extra_passes: your own passes, run after the built-in ones and before
            `limit_in_flight()`: pass values (`fs.schedule.Pass`) or plain functions
            `GraphModule -> GraphModule`.
        passes: None (default) for the list the fields above build; else the whole list of
            passes, run in the order given (plain functions are wrapped in `function_pass`).
            On a mesh that bounds the collectives in flight (gloo), the scheduled graph must
            respect that bound: end the list with `fs.schedule.limit_in_flight()`.
        remat: rematerialization (activation checkpointing, `fs.schedule.rematerialize`): the
            chosen units' forward values that the backward reads are recomputed right before
            their backward, instead of being kept from forward to backward; what stays alive
            is each unit's input (the residual stream between blocks). True for every unit,
            a tuple of unit names, or a function `unit -> bool`; False (default) for none; a
            `fs.schedule.RematPolicy` for selective remat (keep the matrix products' and
            attention's outputs, recompute the elementwise ops between them).
            Same bits, less memory, about one more forward of compute. Traced steps only. With
            micro-batches each micro-batch's units are recomputed in its own backward.
        compile: hand the scheduled graph to `torch.compile` (inductor); results then agree
            with the eager reference to fp32 rounding instead of bit for bit.
        accumulate: with `sharded_step(..., microbatches=k)`, how gradients add up over the
            micro-batches. `"sharded"` (default, FSDP2's): each micro-batch's gradient is
            reduce-scattered and summed into shards — low memory, k reduce-scatters per step.
            `"full"`: each unit's full gradient is summed over the micro-batches and
            reduce-scattered once per step — the reduce-scatter bytes do not grow with k, but
            every unit's full gradient stays alive across the micro-batches. The two sum in
            different orders: each is bit-identical to its own eager reference, and both equal
            one big batch to fp32 rounding.
        reshard_after_backward: with `sharded_step(..., microbatches=k)`, True (default) gathers
            every unit again in each micro-batch (k times the all-gather bytes, as FSDP2 and
            ZeRO-3 do by default); False gathers each unit once per step and keeps its full
            parameters from one micro-batch to the next (`fs.schedule.gather_once`; FSDP2's
            `set_reshard_after_backward(False)`): all-gather bytes independent of k, every
            unit's full parameters alive across the micro-batches. Needs
            `reshard_after_forward=False` (a unit kept across micro-batches is kept from its
            forward to its backward too). Same bits. Traced steps only.
        gradients_in_place: experimental, off by default: a lowering after the passes
            (`schedule/_lower.py`, `gradients_in_place`) computes each unit's gradients straight
            into its flat gradient buffer (`mm.out` / `sum.out` into its slot) instead of
            copying them there, for units where that does not raise the predicted peak. Same
            bits; its measured effect on time is within noise (0.96-1.02x), and one CI run
            with it on crashed in a benchmark rank with a heap corruption that could not be
            reproduced or traced to it, so it stays opt-in. Not with `compile=True`.
        reshard_after_update: True (default) keeps only shards between steps (ZeRO-3: every
            unit is gathered in the step). False is ZeRO-1: every rank keeps every buffer's full
            parameters (in their gather dtype: the bf16 copies under mixed precision) from one
            step to the next (`StepState.gathered`), the optimizer state and the master shards
            stay sharded, gradients are reduce-scattered, and each updated shard is all-gathered
            once, right after the update: one all-gather per step, of the trainable buffers'
            full bytes (Ψ × the gather dtype's size, plus padding), none in the forward or the
            backward. Same bits as True with the same `accumulate`. Memory: the full
            parameters stay alive between steps. Eager and traced; not with
            `canonical_chunks` or a pipeline.
        offload: CPU offload (`fs.schedule.Offload`; True: every unit, update on the device):
            the chosen units' parameter shards and optimizer state live in host memory (pinned
            where there is a GPU) between steps. Each shard is copied to the device with its
            all-gather (moved ahead with it by `prefetch`), each reduced gradient shard back as
            it is produced, and with `Offload(update="device")` each buffer's update runs on the
            device, streamed (`stream_offload_copies`: copied there right before, back right
            after): the default step's bits. `update="host"` updates on the host's tensors.
            The copies are `functional_shard::offload_copy` nodes of the graph
            (`step.explain()`, `fs.analysis`: host and device bytes apart). Eager and traced;
            not with `reshard_after_update=False`, `canonical_chunks` or a pipeline. It changes
            what is traced, so it goes with `passes=(...)` too (put `stream_offload_copies()`
            in your list, else the copies stay where the trace made them).
        causal_masks: True (default): a fused attention whose mask the trace built from
            constants alone (no input of the step) and which is exactly causal runs with
            `is_causal=True` and no mask (`fs.schedule.causal_masks`): what a Hugging Face
            model runs eagerly on a batch without padding, where under tracing it builds the
            mask as a tensor (the masked kernel: 2.8x the attention time on an H200). A mask
            computed from the batch is kept. False keeps every mask as traced (a model that
            passes a constant causal mask to attention eagerly then keeps the masked kernel's
            bits). Traced steps only.
    """

    trace: bool = True
    prefetch: int = 1
    reshard_after_forward: bool | Mapping[str, bool] = True
    default_reshard: bool = True
    reduce_scatters_in_flight: int | None = None
    bucket_bytes: int = 0
    extra_passes: tuple = ()
    passes: tuple[Pass, ...] | None = None
    compile: bool = False
    accumulate: str = "sharded"
    remat: bool | tuple[str, ...] | Callable[[str], bool] | RematPolicy = False
    gradients_in_place: bool = False
    reshard_after_backward: bool = True
    reshard_after_update: bool = True
    offload: Any = None
    causal_masks: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.causal_masks, bool):
            raise ValueError(f"Schedule.causal_masks must be a bool; got {self.causal_masks!r}")
        if self.offload is True:
            object.__setattr__(self, "offload", Offload())
        if self.offload is not None and not isinstance(self.offload, Offload):
            raise ValueError(f"Schedule.offload must be None, True or an fs.schedule.Offload(...); got {self.offload!r}")
        if self.offload is not None and not self.reshard_after_update:
            raise ValueError(
                "Schedule(offload=...) keeps parameters in host memory and reshard_after_update=False (ZeRO-1) keeps "
                "them whole on the device between steps: choose one"
            )
        if not isinstance(self.reshard_after_update, bool):
            raise ValueError(f"Schedule.reshard_after_update must be a bool; got {self.reshard_after_update!r}")
        if not isinstance(self.reshard_after_backward, bool):
            raise ValueError(f"Schedule.reshard_after_backward must be a bool; got {self.reshard_after_backward!r}")
        if not self.reshard_after_backward and self.reshard_after_forward is not False:
            raise ValueError(
                f"Schedule(reshard_after_backward=False) keeps every unit gathered from one micro-batch to the next, "
                f"so from its forward to its backward too: it needs reshard_after_forward=False (got "
                f"{self.reshard_after_forward!r})"
            )
        if self.accumulate not in ("sharded", "full"):
            raise ValueError(f"Schedule.accumulate must be 'sharded' or 'full'; got {self.accumulate!r}")
        if isinstance(self.reshard_after_forward, Mapping):
            # Frozen dataclasses should hold hashable values: keep the mapping as sorted pairs.
            object.__setattr__(self, "reshard_after_forward", _FrozenMapping(self.reshard_after_forward))
        object.__setattr__(self, "extra_passes", tuple(as_pass(p) for p in self.extra_passes))
        if self.remat is not False:
            # Checked and normalized (a list becomes a tuple) as the pass value does it.
            object.__setattr__(self, "remat", remat_value(self.remat))
        if self.passes is not None:
            object.__setattr__(self, "passes", tuple(as_pass(p) for p in self.passes))
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if f.name in _CONVENIENT_FIELDS and getattr(self, f.name) != f.default
            ]
            if changed:
                raise ValueError(
                    f"Schedule(passes=...) is the whole list of passes, so {', '.join(changed)} would have no "
                    f"effect. Put the built-in passes in the list yourself (see fs.schedule.default_passes, e.g. "
                    f"fs.schedule.prefetch(0)), or keep the fields and add your passes with extra_passes=(...)"
                )
        for name, minimum in (("prefetch", 0), ("bucket_bytes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"Schedule.{name} must be an int >= {minimum}; got {value!r}")
        if self.reduce_scatters_in_flight is not None and self.reduce_scatters_in_flight < 1:
            raise ValueError("Schedule.reduce_scatters_in_flight must be None or >= 1")

    def __repr__(self) -> str:
        # Only what differs from the defaults: `Schedule(prefetch=2)`, `Schedule(passes=(...))`.
        fields = dataclasses.fields(self)
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields if getattr(self, f.name) != f.default]
        return f"Schedule({', '.join(changed)})"

    @property
    def pass_list(self) -> tuple[Pass, ...]:
        """The passes this schedule runs, in order: `passes`, or the default list of the fields."""
        if self.passes is not None:
            return self.passes
        return default_passes(
            prefetch=self.prefetch,
            reshard_after_forward=self.reshard_after_forward,
            default_reshard=self.default_reshard,
            reduce_scatters_in_flight=self.reduce_scatters_in_flight,
            bucket_bytes=self.bucket_bytes,
            extra_passes=self.extra_passes,
            remat=self.remat,
            reshard_after_backward=self.reshard_after_backward,
            offload=self.offload,
        )

    def reshards(self, unit: str) -> bool:
        """Whether the convenient form reshards `unit` (freed after forward, gathered again)."""
        return _passes.reshard_after_forward(self.reshard_after_forward, default=self.default_reshard).reshards(unit)


_CONVENIENT_FIELDS = {
    "prefetch",
    "reshard_after_forward",
    "default_reshard",
    "reduce_scatters_in_flight",
    "bucket_bytes",
    "extra_passes",
    "remat",
    "reshard_after_backward",
}


def apply_schedule(
    gm: fx.GraphModule, schedule: Schedule | Sequence, context: PassContext
) -> fx.GraphModule:
    """Run the passes of `schedule` (a `Schedule`, or a list of passes) on `gm` in order, then
    recompile it.

    Every pass gets `context`. After each pass the graph is linted (a pass that puts a value
    after one of its readers fails here), and the nodes it created get the fake values
    (`meta["val"]`) tracing gives every node, which the analyses read. At the end, if `context.max_collectives_in_flight`
    is a number and the graph has more collectives in flight at once, this raises ValueError
    rather than appending `limit_in_flight()` itself: a pass appended behind the user's back
    could undo what their last pass did, and an error names the fix (end the list with
    `fs.schedule.limit_in_flight()`). A list that respects the bound without it runs as it is.
    """
    passes = schedule.pass_list if isinstance(schedule, Schedule) else tuple(as_pass(p) for p in schedule)
    for pass_ in passes:
        result = pass_(gm, context)
        gm = gm if result is None else result
        gm.graph.lint()
        fill_values(gm)
    _check_in_flight(gm, passes, context)
    gm.recompile()
    return gm


def _check_in_flight(gm: fx.GraphModule, passes: Sequence[Pass], context: PassContext) -> None:
    fix = "(gloo deadlocks, rarely, with more). End the pass list with fs.schedule.limit_in_flight()"
    per_group = context.max_in_flight_per_group
    if per_group is not None:
        position = _passes.positions(gm)
        for group, members in _passes.by_group(_passes.collectives(gm)).items():
            spans = [(position[c.issue], c.issue.name, position[c.wait]) for c in members]
            too_many = _more_in_flight_than(per_group, spans)
            if too_many:
                raise ValueError(
                    f"the schedule's passes {list(passes)} leave {len(too_many)} collectives in flight at once on "
                    f"process group {group} ({', '.join(too_many)}), but this mesh allows at most {per_group} per "
                    f"group {fix}"
                )
    bound = context.max_collectives_in_flight
    if bound is None:
        return
    too_many = _more_in_flight_than(bound, in_flight_intervals(analyze(gm)))
    if too_many:
        raise ValueError(
            f"the schedule's passes {list(passes)} leave {len(too_many)} collectives in flight at once "
            f"({', '.join(too_many)}), but this mesh allows at most {bound} (its max_collectives_in_flight; {fix}"
        )


def _more_in_flight_than(bound: int, spans: Sequence[tuple]) -> list[str] | None:
    """The collectives in flight at the first issue where more than `bound` are; spans are
    `(issue position, name, wait position)`."""
    for point, _, _ in spans:
        in_flight = [name for start, name, end in spans if start <= point < end]
        if len(in_flight) > bound:
            return in_flight
    return None