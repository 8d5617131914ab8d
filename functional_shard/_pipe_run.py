"""The pipeline executor: one rank walks its row of a `fs.pipeline` schedule, action by action.

Each action does one thing (`docs/pipelining.md`):

- `UNSHARD s`: gather stage s's units over the shard axis (each unit once per step, shared by
  the micro-batches, as FSDP2 does under pipelining); the gathered leaves are the leaves the
  stage's backward differentiates;
- `F s m`: run stage s's program on micro-batch m (its received values, its gathered
  parameters, its batch leaves), keeping its autograd graph;
- `B s m`: the backward of `F s m` from the received cotangents (the last stage: from the
  loss, seeded with 1, or fp16 loss scaling's scale): the parameters' gradients added to the stage's sum, the inputs'
  cotangents kept for `SEND_B`; `I s m` then `W s m`: the same in two halves, the input path
  first, the weight side later, each node run once (`_split_backward`);
- `SEND_F`/`RECV_F`/`SEND_B`/`RECV_B`: point-to-point over the `pp` axis (`PointToPoint`); a
  lent value (`Boundary.lent`: made of parameters alone, a tied weight) rides only the message
  of the receiving stage's first forward, and its cotangents' sum only that of its last backward;
- `RESHARD s`: drop the gathered leaves; `REDUCE_GRAD s`: the stage's summed full gradients,
  flattened per buffer, reduce-scattered over the shard axis and summed over replicate axes.

Gradients add up in the order of the stage's B/W actions: every built-in schedule adds micro-batch
0, 1, ..., M-1 (`fs.pipeline.check(...).accumulation`), so every built-in gives GPipe's bits.

`overlap=False` is the oracle: every transfer is issued and waited where its action stands.
`overlap=True` posts a run of consecutive transfers as one batch (`batch_isend_irecv`, as torch's
pipelining does) and waits for a received tensor only where an action reads it; a send is
waited (its tensor let go) as soon as a message that could only have come after its receipt
arrives — an activation when its cotangent comes back, a cotangent when the previous stage's
next activation comes (`_sends_proved`) — else at the end of the step: the same
values, moved earlier.
"""

from __future__ import annotations

import datetime
import functools
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _canonical, _random, _tracing
from ._agreement import _group_timeout
from ._collectives import ReduceScatterFlat
from ._layout import Layout
from ._pipe_backward import Stage as _Stage
from ._pipe_backward import backward as _backward
from ._pipe_saved import Recorder, saved_bytes
from ._shard import gather_full
from ._stages import Cut
from .pipeline import Action, ActionKind, PipelineSchedule

__all__ = ["PointToPoint", "RunResult", "run_actions"]

K = ActionKind


class PointToPoint:
    """Transfers between this rank and the ranks that differ from it only on the `pp` axis."""

    def __init__(self, mesh, overlap: bool):
        self.mesh = mesh
        self.overlap = overlap
        self.pending_sends: list = []
        # A transfer waits no longer than a collective of its group may: a peer that failed (its
        # stage raised) leaves this rank's receive to time out, as a collective would, not hang.
        # (the world's timeout: the one the mesh was made with; its transfer group's is torch's default)
        self.timeout = datetime.timedelta(seconds=_group_timeout(dist.group.WORLD)) if dist.is_initialized() else None

    def wait(self, work) -> None:
        """Wait for one transfer, at most the group's collective timeout."""
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def peer(self, pp_index: int) -> int:
        """The global rank at pipeline coordinate `pp_index` with this rank's other coordinates."""
        coords = dict(self.mesh.coordinates)
        coords["pp"] = pp_index
        rank = 0
        for name, size in zip(self.mesh.axis_names, self.mesh.axis_sizes):
            rank = rank * size + coords[name]
        return rank

    def post(self, ops: list[tuple[str, torch.Tensor, int]]) -> list:
        """Issue `("send" | "recv", tensor, pp_index)` operations; returns their works (one per op)."""
        group = getattr(self.mesh, "p2p_group", None)  # the mesh's own group for transfers (`Mesh.p2p_group`)
        p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self.peer(peer), group=group) for kind, t, peer in ops]
        works = dist.batch_isend_irecv(p2p) if p2p else []
        if not self.overlap:
            for w in works:
                self.wait(w)
            return [None] * len(ops)
        return list(works)

    def finish(self) -> None:
        for w in self.pending_sends:
            self.wait(w)
        self.pending_sends = []


class RunResult(NamedTuple):
    """What one rank's walk through its actions produced."""

    grads: dict[str, torch.Tensor]  # trainable buffer name -> this rank's shard of the summed gradient
    losses: list[torch.Tensor]  # per micro-batch (the last stage only): (objective, loss, weight) each


def run_actions(
    schedule: PipelineSchedule,
    row: tuple[Action, ...],
    cut: Cut,
    layout: Layout,
    shards: list[torch.Tensor],
    local_leaves: list[torch.Tensor],
    leaf_index: dict[int, int],
    micro_batches: list[list[torch.Tensor]],
    mesh,
    p2p: PointToPoint,
    backward: bool = True,
    recorder: Recorder | None = None,
    remat: frozenset = frozenset(),
    canonical: Any = None,
    seed: torch.Tensor | None = None,
) -> RunResult:
    """Run this rank's `row` of `schedule`.

    Arguments:
        schedule: the lowered schedule (for stage -> rank).
        row: this pipeline rank's actions.
        cut: the stage programs.
        layout / shards: this rank's layout (its stages' units) and shards.
        local_leaves: every module buffer, indexed like the full tree's leaves via `leaf_index`.
        leaf_index: full-tree leaf index -> leaf index in `layout` (parameters and buffers).
        micro_batches: per micro-batch, its flat batch leaves.
        mesh: the step's mesh.
        p2p: the transfers' issuer.
        backward: False for a forward-only run (evaluation): no autograd graph is kept.
        recorder: a `Recorder` to fill (profiling), or None.
        seed: what the loss's backward is seeded with (fp16 loss scaling: the scale), else 1.
        remat: the stages whose forward keeps no activations: their B (or I) recomputes it
            from the stage's inputs, with the RNG state the F saw (the same bits).
        canonical: a layout-invariant step's chunks (`_canonical.Canonical`), or None: each
            micro-batch is a chunk, seeded on stage 0 and its generator's state carried to the
            next stage with the activations (the draws of one process running the chunk), its
            gradients added in the canonical tree and reduced by `_canonical.reduce`.
    """
    stages = {s: _Stage() for s in schedule.stages_of(mesh.coordinates.get("pp", 0))}
    random_stages = set(cut.random_stages)
    last = schedule.num_stages - 1
    losses: dict[int, list] = {}
    buffer_of = {i: spec for spec in layout.buffers for i in spec.leaves}  # layout leaf -> its buffer
    index_of = {spec.name: k for k, spec in enumerate(layout.buffers)}
    # stage -> indices of its buffers in the layout
    by_unit = {s: sorted({index_of[buffer_of[leaf_index[i]].name] for i in cut.stages[s].params}) for s in stages}
    grads: dict[str, torch.Tensor] = {}
    waits: dict[tuple, list] = {}  # (kind, stage, micro-batch) of a transfer -> its works, until waited
    proves = _sends_proved(schedule, row)
    pending: list[tuple[Action, Any]] = []
    # What is lent crosses a boundary with the receiving stage's first forward and its cotangents'
    # sum comes back with that stage's last backward (I or B), in the order of its row.
    first_f, last_b = _first_and_last(schedule)

    def flush() -> None:
        if not pending:
            return
        ops = []
        for a, tensor in pending:
            peer = schedule.rank_of(a.peer_stage())
            ops.append(("send" if a.kind in (K.SEND_F, K.SEND_B) else "recv", tensor, peer))
        works = p2p.post(ops)
        for (a, tensor), w in zip(pending, works):
            if w is not None:  # a send's work holds its tensor until it is waited
                waits.setdefault((a.kind, a.stage, a.microbatch), []).append(w)
        pending.clear()

    waited = [0]  # ns spent waiting for received tensors (not compute: a profile leaves it out)

    def ready(kind, s, m) -> None:
        works = waits.pop((kind, s, m), [])
        if works:
            begin = time.perf_counter_ns()
            for w in works:
                p2p.wait(w)
            waited[0] += time.perf_counter_ns() - begin
        # What arrived proves some of this rank's sends received (`_sends_proved`): they are
        # complete (waiting cannot block), and their tensors are let go now rather than at the end
        # of the step. (Nothing received, nothing proved: those sends are waited at the end.)
        for key in proves.get((kind, s, m), ()) if works else ():
            for w in waits.pop(key, []):
                p2p.wait(w)

    clock = time.perf_counter_ns
    for a in row:
        if a.kind not in (K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B):
            flush()
        start, waited_before = (clock() if recorder is not None else 0), waited[0]
        s, m = a.stage, a.microbatch
        st = stages.get(s)
        if st is None:
            raise RuntimeError(f"action {a} is for stage {s}, which this rank does not hold")
        program = cut.stages[s]
        if a.kind is K.UNSHARD:
            leaves: dict[int, torch.Tensor] = {}
            for k in by_unit[s]:
                spec = layout.buffers[k]
                # alias: without a shard axis the "gathered" leaves are views of the shard itself (read
                # only: gradients are new tensors), not a second copy of the stage's parameters
                full = gather_full(spec, shards[k], mesh, differentiable=False, alias=True)
                leaves.update(zip(spec.leaves, layout.unflatten_buffer(spec, full)))
            st.leaves = [leaves[leaf_index[i]].detach().requires_grad_(backward and buffer_of[leaf_index[i]].trainable)
                         for i in program.params]  # fmt: skip
            st.local = [local_leaves[i] for i in program.local]
            st.sums = [None] * len(program.params)
            st.owned = [False] * len(program.params)
            # Each micro-batch's gradient joins the sum in its buffer's reduce dtype (as the plain
            # step's "full" accumulation does); a layout-invariant step adds them in the canonical tree.
            st.reduce_dtypes = [buffer_of[leaf_index[i]].reduce_dtype for i in program.params]
            st.tree = _canonical.TreeSum(len(micro_batches)) if canonical is not None else None
        elif a.kind is K.RESHARD:
            st.leaves = None
        elif a.kind is K.F:
            if st.leaves is None:
                raise RuntimeError(f"{a}: stage {s} is not gathered (no {s}UNSHARD before it)")
            if s == 0:
                inputs = []
            elif schedule.rank_of(s - 1) == schedule.rank_of(s):
                inputs = stages[s - 1].outputs.pop(m)
            else:
                ready(K.RECV_F, s, m)
                inputs = st.received.pop(m)
            if canonical is not None:  # the chunk's random stream: seeded on stage 0, carried from stage to stage
                if s == 0:
                    _random.reseed(canonical.first + m, _device(mesh))
                else:
                    torch.set_rng_state(inputs[-1])
                    inputs = inputs[:-1]
            elif s in random_stages:  # each (stage, micro-batch) its own numbers: every schedule the same masks
                _random.seed_forward(s, m, _device(mesh))
            if any(b.lent for b in program.received):  # the first forward's are kept; later ones use them
                inputs = list(inputs)
                for k, b in enumerate(program.received):
                    if b.lent:
                        if m == first_f[s]:
                            st.lent[k] = inputs[k]
                        inputs[k] = st.lent[k]
            inputs = [t.detach().requires_grad_(backward and b.differentiable) for t, b in zip(inputs, program.received)]
            batch = [micro_batches[m][i] for i in program.batch]
            keep = backward and s not in remat
            call = program.module if program.call is None else program.call
            run = functools.partial(call, st.leaves, inputs, batch, st.local)
            rng = _rng_state(mesh) if backward and s in remat else None
            with torch.set_grad_enabled(keep):
                if recorder is not None and backward:
                    refs: dict = {}
                    outputs, nbytes = saved_bytes(run, refs, [*st.leaves, *batch, *st.local, *st.lent.values()])
                    if not keep:  # rematerialized: only its inputs are held until its backward
                        nbytes, refs = sum(t.untyped_storage().nbytes() for t in inputs), {}
                    recorder.forward(s, m, nbytes, refs)
                    del refs
                else:
                    outputs = run()
            if keep:
                st.graphs[m] = (inputs, outputs)
            elif backward:  # the backward recomputes the forward from the inputs, the RNG as it was
                st.graphs[m] = (inputs, (run, rng))
            if s == last:
                losses[m] = [o.detach() for o in outputs]
            else:
                st.outputs[m] = [o.detach() for o in outputs] + ([torch.get_rng_state()] if canonical is not None else [])
            del inputs, outputs, run  # the graph is st.graphs[m]'s alone: an I frees its output side
        elif a.kind in (K.B, K.I, K.W):
            _backward(a, st, stages, program, schedule, last, ready, mesh, last_b.get(s), seed)
            if recorder is not None and a.kind in (K.B, K.W):
                recorder.backward_done(s, m)
            elif recorder is not None and a.kind is K.I and s not in remat:
                recorder.input_done(s, m, st.kept[m].kept_bytes())
        elif a.kind is K.SEND_F:
            once = m == first_f.get(s + 1)
            for t, b in zip(st.outputs.pop(m), (*program.sent, None)):
                if b is None or not b.lent or once:
                    pending.append((a, t.contiguous()))
        elif a.kind is K.RECV_F:
            bufs = [torch.empty(b.shape, dtype=b.dtype, device=_device(mesh)) if not b.lent or m == first_f[s] else None
                    for b in program.received]  # fmt: skip
            if canonical is not None:
                bufs.append(torch.empty_like(torch.get_rng_state()))
            st.received[m] = bufs
            pending.extend((a, t) for t in bufs if t is not None)
        elif a.kind is K.SEND_B:
            for t in st.input_cotangents.pop(m):
                if t is not None:  # (a lent value's, before the stage's last backward: summed, sent then)
                    pending.append((a, t.contiguous()))
        elif a.kind is K.RECV_B:
            bufs = [torch.empty(b.shape, dtype=b.dtype, device=_device(mesh)) if not b.lent or m == last_b.get(s + 1) else None
                    for b in program.sent if b.differentiable]  # fmt: skip
            st.cotangents[m] = bufs
            pending.extend((a, t) for t in bufs if t is not None)
        elif a.kind is K.REDUCE_GRAD:
            grads.update(_reduce(layout, by_unit[s], program, st, leaf_index, mesh))
        elif a.kind is K.OPTIMIZER:
            raise RuntimeError(f"{a}: the optimizer runs once after every stage's gradients (not an action)")
        if recorder is not None:
            recorder.events.append((str(a), start + waited[0] - waited_before, clock()))
    flush()
    p2p.pending_sends.extend(w for (kind, _, _), works in waits.items() if kind in (K.SEND_F, K.SEND_B) for w in works)
    p2p.finish()
    return RunResult(grads, [losses[m] for m in sorted(losses)])


def _sends_proved(schedule: PipelineSchedule, row: tuple[Action, ...]) -> dict[tuple, list[tuple]]:
    """(RECV kind, stage, micro-batch) of a receive in `row` -> the (SEND kind, stage, micro-batch)
    of this rank's sends that its arrival proves received:

    - `SEND_F s m` by `RECV_B s m`: stage s + 1 sends m's cotangent from its backward of m, after
      its forward of m, which read the activation;
    - `SEND_B s m` by the `RECV_F s n` of the first activation stage s - 1 sends after its B (or I)
      of m, which waits for the cotangent before that send is posted."""
    out: dict[tuple, list[tuple]] = {}
    for a in row:
        if a.kind is K.SEND_F:
            out.setdefault((K.RECV_B, a.stage, a.microbatch), []).append((K.SEND_F, a.stage, a.microbatch))
        elif a.kind is K.SEND_B:
            previous = a.stage - 1
            peer = schedule.actions[schedule.rank_of(previous)]
            at = next((i for i, b in enumerate(peer) if b.kind in (K.B, K.I) and b.stage == previous and b.microbatch == a.microbatch), None)
            later = None if at is None else next((b for b in peer[at + 1 :] if b.kind is K.SEND_F and b.stage == previous), None)
            if later is not None:
                out.setdefault((K.RECV_F, a.stage, later.microbatch), []).append((K.SEND_B, a.stage, a.microbatch))
    return out


def _device(mesh) -> torch.device:
    return getattr(mesh, "device", torch.device("cpu"))


def _rng_state(mesh) -> tuple:
    device = getattr(mesh, "device", torch.device("cpu"))
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _first_and_last(schedule: PipelineSchedule) -> tuple[dict[int, int], dict[int, int]]:
    """Per stage, the micro-batch of its first F and of its last I or B, in its rank's row."""
    first, last = {}, {}
    for row in schedule.actions:
        for a in row:
            if a.kind is K.F:
                first.setdefault(a.stage, a.microbatch)
            elif a.kind in (K.B, K.I):
                last[a.stage] = a.microbatch
    return first, last


def _reduce(layout: Layout, buffers: list[int], program, st: _Stage, leaf_index, mesh) -> dict[str, torch.Tensor]:
    """Stage `program`'s summed full gradients, per trainable buffer, reduce-scattered."""
    sums = st.tree.result() if st.tree is not None else st.sums
    by_leaf = {leaf_index[i]: (sums[j], st.leaves[j]) for j, i in enumerate(program.params)}
    out = {}
    for k in buffers:
        spec = layout.buffers[k]
        if not spec.trainable:
            continue
        parts = []
        for i in spec.leaves:
            g, p = by_leaf.get(i, (None, None))
            shape = layout.shapes[i]
            parts.append(torch.zeros(shape, dtype=spec.reduce_dtype, device=_device(mesh)) if g is None else g.to(spec.reduce_dtype))
        parts = [t.reshape(-1) for t in parts]
        parts.append(torch.zeros(spec.padded_numel - spec.numel, dtype=spec.reduce_dtype, device=_device(mesh)))
        full = torch.cat(parts)
        if st.tree is not None:
            with _tracing.moving(spec):
                grad = _canonical.reduce(full, mesh)
        else:
            grad = ReduceScatterFlat.apply(full.contiguous(), mesh, spec)
        out[spec.name] = grad if grad.dtype == spec.dtype else grad.to(spec.dtype)
    return out
