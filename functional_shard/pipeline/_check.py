"""The static check: prove a schedule's per-rank action lists consistent and free of deadlock
before any rank sends anything.

What `check(schedule)` proves, or refuses with a `ScheduleError` naming the first offending
actions:

1. Placement and sizes: each action's stage exists and lives on the rank that lists it, each
   micro-batch index is below M; optionally, the schedule's ranks, stages and micro-batches are
   those of the run (`num_ranks=`, `num_stages=`, `num_microbatches=`).
2. Per stage: every micro-batch forwarded exactly once and backwarded exactly once (B, or I
   then W), or never backwarded at all (a forward-only schedule); F before its B/I, I before its
   W; every B/W before the stage's REDUCE_GRAD, which comes before its OPTIMIZER; compute on a
   stage that has UNSHARD/RESHARD actions only while it is unsharded.
3. Communication (when the schedule holds any SEND/RECV): every stage boundary that crosses
   ranks is crossed by a SEND and its RECV on the peer rank (same boundary, micro-batch,
   direction, tensor metadata when both give it); the SEND after the action that produces the
   tensor, the RECV before the one that consumes it; and, since point-to-point messages between
   two ranks match in the order they are posted (NCCL and gloo as torch uses them: no tags),
   rank a's sends to rank b are in the order of rank b's receives from a.
4. No deadlock: a simulated run in which each rank executes its list in order and blocks on
   what it needs: F(s, m) on F(s-1, m) and B/I(s, m) on the cotangent of B/I(s+1, m) (compute-only
   schedules: the data dependencies themselves); with communication, a RECV blocks until its SEND
   has been posted, and a SEND either never blocks (`sends="nonblocking"`, torch's batched
   isend/irecv) or blocks until the peer reaches its RECV (`sends="rendezvous"`, the stricter
   model: a synchronous send, as large NCCL sends behave). A blocking receive is stricter than
   torch's runtime, which posts irecv at the RECV and waits at the consumer: a schedule proved
   here runs there too. A cycle of waits is reported rank by rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from ._actions import BACKWARD, RECVS, SENDS, Action, ActionKind, PipelineSchedule, ScheduleError

__all__ = ["check", "CheckResult"]

K = ActionKind


class CheckResult(NamedTuple):
    """What a successful check found."""

    order: tuple[tuple[int, Action], ...]  # a global order of (rank, action) in which the step can run
    backward: bool  # False for a forward-only schedule
    # per stage, the micro-batches in the order their B/W add to the stage's gradients: floating-point
    # sums depend on it; (0, 1, ..., M-1) everywhere gives the bits of GPipe and of fs's micro-batch loop
    accumulation: tuple[tuple[int, ...], ...]


def _fail(message: str, *actions: tuple[int | None, Action]) -> ScheduleError:
    return ScheduleError(message, actions)


def _expect(schedule: PipelineSchedule, num_ranks, num_stages, num_microbatches) -> None:
    shape = f"{schedule.num_ranks} ranks x {schedule.stages_per_rank} stage(s) per rank, {schedule.placement}"
    for what, given, have in (
        ("ranks", num_ranks, schedule.num_ranks),
        ("stages", num_stages, schedule.num_stages),
        ("micro-batches", num_microbatches, schedule.num_microbatches),
    ):
        if given is not None and given != have:
            raise _fail(
                f"the schedule {schedule.name!r} is for {have} {what} ({shape}, M={schedule.num_microbatches}) "
                f"but the run has {given}: build it for the run's sizes"
            )


def _where(rank: int, index: int, a: Action) -> str:
    return f"rank {rank}'s {a} (action {index})"


def _static(schedule: PipelineSchedule) -> bool:
    """Checks 1-3 of the module docstring; returns whether the schedule has backward actions."""
    S, M = schedule.num_stages, schedule.num_microbatches
    lowered = schedule.has_communication()
    forwards: dict[tuple[int, int], tuple[int, int]] = {}  # (stage, mb) -> (rank, index)
    backwards: dict[tuple[int, int], tuple[int, Action]] = {}  # (stage, mb) -> (index, B or I action)
    weights: set[tuple[int, int]] = set()
    p2p: dict[Action, tuple[int, int]] = {}  # (meta-less) SEND/RECV -> (rank, index)
    metas: dict[Action, Action] = {}
    any_backward = False
    for rank, row in enumerate(schedule.actions):
        reduced: dict[int, tuple[int, Action]] = {}
        optimized: dict[int, tuple[int, Action]] = {}
        unsharded: dict[int, bool] = {}  # stage -> currently gathered (stages with UNSHARD/RESHARD only)
        for stage in {a.stage for a in row if a.kind in (K.UNSHARD, K.RESHARD)}:
            unsharded[stage] = False
        for i, a in enumerate(row):
            here = (rank, a)
            if a.stage >= S:
                raise _fail(f"{_where(rank, i, a)} names stage {a.stage}, but the schedule has {S} stages", here)
            if schedule.rank_of(a.stage) != rank:
                raise _fail(
                    f"{_where(rank, i, a)}: stage {a.stage} is placed on rank {schedule.rank_of(a.stage)} "
                    f"({schedule.placement} placement, {schedule.stages_per_rank} stage(s) per rank)",
                    here,
                )
            if a.microbatch is not None and a.microbatch >= M:
                raise _fail(f"{_where(rank, i, a)}: micro-batch {a.microbatch} >= M = {M}", here)
            key = (a.stage, a.microbatch)
            if a.is_compute or a.kind is K.OPTIMIZER:
                if a.stage in unsharded and not unsharded[a.stage] and a.is_compute:
                    raise _fail(f"{_where(rank, i, a)} runs stage {a.stage} while its parameters are not gathered "
                                f"(add {a.stage}UNSHARD before it, or move {a.stage}RESHARD after it)", here)
                if a.stage in optimized and a.kind is not K.OPTIMIZER:
                    j, o = optimized[a.stage]
                    raise _fail(f"{_where(rank, i, a)} runs after {o} (action {j}) updated stage {a.stage}: "
                                "the update comes after the stage's last compute", here, (rank, o))
                if a.stage in reduced and a.kind in (K.B, K.W, K.I):
                    j, r = reduced[a.stage]
                    raise _fail(f"{_where(rank, i, a)} adds to stage {a.stage}'s gradients after {r} (action {j}) "
                                "reduced them: move the reduction after the stage's last B/W", here, (rank, r))
            if a.kind is K.F:
                if key in forwards:
                    raise _fail(f"{_where(rank, i, a)} forwards micro-batch {a.microbatch} through stage {a.stage} "
                                f"a second time (first at action {forwards[key][1]})", here)
                forwards[key] = (rank, i)
            elif a.kind in BACKWARD:
                any_backward = True
                if key not in forwards:
                    raise _fail(f"{_where(rank, i, a)} runs before its forward {a.stage}F{a.microbatch}", here)
                if key in backwards:
                    raise _fail(f"{_where(rank, i, a)} backwards micro-batch {a.microbatch} through stage "
                                f"{a.stage} a second time (after {backwards[key][1]})", here)
                backwards[key] = (i, a)
            elif a.kind is K.W:
                if key not in backwards or backwards[key][1].kind is not K.I:
                    what = "after a full backward B" if key in backwards else "before its input-gradient backward"
                    raise _fail(f"{_where(rank, i, a)} runs {what} {a.stage}I{a.microbatch} is needed first", here)
                if key in weights:
                    raise _fail(f"{_where(rank, i, a)} runs a second time", here)
                weights.add(key)
            elif a.kind is K.REDUCE_GRAD:
                if a.stage in optimized:
                    raise _fail(f"{_where(rank, i, a)} comes after {optimized[a.stage][1]}, which needs the reduced "
                                "gradients: reduce first", here)
                if a.stage in reduced:
                    raise _fail(f"{_where(rank, i, a)} reduces stage {a.stage}'s gradients a second time", here)
                reduced[a.stage] = (i, a)
            elif a.kind is K.OPTIMIZER:
                if a.stage in optimized:
                    raise _fail(f"{_where(rank, i, a)} updates stage {a.stage} a second time", here)
                optimized[a.stage] = (i, a)
            elif a.kind is K.UNSHARD:
                if unsharded[a.stage]:
                    raise _fail(f"{_where(rank, i, a)} gathers stage {a.stage}, already gathered", here)
                unsharded[a.stage] = True
            elif a.kind is K.RESHARD:
                if not unsharded[a.stage]:
                    raise _fail(f"{_where(rank, i, a)} frees stage {a.stage}, which is not gathered", here)
                unsharded[a.stage] = False
            else:  # SEND / RECV
                peer = a.peer_stage()
                if not 0 <= peer < S:
                    raise _fail(f"{_where(rank, i, a)} crosses to stage {peer}, which does not exist ({S} stages)",
                                here)
                if schedule.rank_of(peer) == rank:
                    raise _fail(f"{_where(rank, i, a)}: stages {a.stage} and {peer} are both on rank {rank}, which "
                                "passes the tensor directly: drop it", here)
                bare = Action(a.kind, a.stage, a.microbatch)
                if bare in p2p:
                    raise _fail(f"{_where(rank, i, a)} appears twice (first at action {p2p[bare][1]})", here)
                p2p[bare] = (rank, i)
                metas[bare] = a
                if a.kind is K.SEND_F and key not in forwards:
                    raise _fail(f"{_where(rank, i, a)} sends an activation before {a.stage}F{a.microbatch} "
                                "computes it", here)
                if a.kind is K.SEND_B and key not in backwards:
                    raise _fail(f"{_where(rank, i, a)} sends a cotangent before {a.stage}B/I{a.microbatch} "
                                "computes it", here)
                if a.kind is K.RECV_F and key in forwards:
                    raise _fail(f"{_where(rank, i, a)} receives after {a.stage}F{a.microbatch} used it", here)
                if a.kind is K.RECV_B and key in backwards:
                    raise _fail(f"{_where(rank, i, a)} receives after {backwards[key][1]} used it", here)
            if lowered and a.is_compute and a.kind is not K.W:
                need = None
                if a.kind is K.F and a.stage > 0 and schedule.rank_of(a.stage - 1) != rank:
                    need = Action(K.RECV_F, a.stage, a.microbatch)
                elif a.kind in BACKWARD and a.stage < S - 1 and schedule.rank_of(a.stage + 1) != rank:
                    need = Action(K.RECV_B, a.stage, a.microbatch)
                if need is not None and need not in p2p:
                    raise _fail(f"{_where(rank, i, a)} needs a tensor from rank {schedule.rank_of(need.peer_stage())}, "
                                f"but rank {rank} has no {need} before it", here, (rank, need))
    # completeness per stage
    for s in range(S):
        rank = schedule.rank_of(s)
        for m in range(M):
            if (s, m) not in forwards:
                raise _fail(f"stage {s} never forwards micro-batch {m}: rank {rank} lacks {s}F{m}",
                            (rank, Action(K.F, s, m)))
            if any_backward and (s, m) not in backwards:
                raise _fail(f"stage {s} never backwards micro-batch {m}: rank {rank} lacks {s}B{m} "
                            f"(or {s}I{m} + {s}W{m})",
                            (rank, Action(K.B, s, m)))
            if (s, m) in backwards and backwards[(s, m)][1].kind is K.I and (s, m) not in weights:
                raise _fail(f"rank {rank} runs {s}I{m} but never its weight gradient {s}W{m}",
                            (rank, Action(K.W, s, m)))
    if lowered:
        _check_transfers(schedule, p2p, metas)
    return any_backward


def _check_transfers(schedule: PipelineSchedule, p2p: dict, metas: dict) -> None:
    S = schedule.num_stages
    for a, (rank, i) in sorted(p2p.items(), key=lambda item: item[1]):
        other = a.matching()
        peer = schedule.rank_of(other.stage)
        if other not in p2p:
            raise _fail(f"{_where(rank, i, a)} has no matching {other} on rank {peer}", (rank, a), (peer, other))
        mine, theirs = metas[a].meta, metas[other].meta
        if mine is not None and theirs is not None and mine != theirs:
            raise _fail(f"{_where(rank, i, metas[a])} and rank {peer}'s {metas[other]} disagree on the tensors' "
                        "shapes/dtypes", (rank, a), (peer, other))
    # compute that produces a tensor for another rank must send it
    for r, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            send = None
            if a.kind is K.F and a.stage < S - 1 and schedule.rank_of(a.stage + 1) != r:
                send = Action(K.SEND_F, a.stage, a.microbatch)
            elif a.kind in BACKWARD and a.stage > 0 and schedule.rank_of(a.stage - 1) != r:
                send = Action(K.SEND_B, a.stage, a.microbatch)
            if send is not None and send not in p2p:
                raise _fail(f"{_where(r, i, a)} produces a tensor rank {schedule.rank_of(send.peer_stage())} needs, "
                            f"but rank {r} never runs {send}", (r, a), (r, send))
    # messages between two ranks match in posting order
    sends: dict[tuple[int, int], list[Action]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for r, row in enumerate(schedule.actions):
        for a in row:
            if a.kind in SENDS:
                sends[(r, schedule.rank_of(a.peer_stage()))].append(Action(a.kind, a.stage, a.microbatch))
            elif a.kind in RECVS:
                recvs[(schedule.rank_of(a.peer_stage()), r)].append(Action(a.kind, a.stage, a.microbatch))
    for (src, dst), posted in sorted(sends.items()):
        for n, (send, recv) in enumerate(zip(posted, recvs[(src, dst)])):
            if recv.matching() != send:
                raise _fail(
                    f"messages from rank {src} to rank {dst} match in the order they are posted: rank {src}'s send "
                    f"#{n} is {send} but rank {dst}'s receive #{n} is {recv} (it would get {send}'s tensor); "
                    "order the receives as the sends",
                    (src, send), (dst, recv),
                )


def _simulate(schedule: PipelineSchedule, sends: str) -> tuple[tuple[int, Action], ...]:
    """Run the lists with blocking semantics; return the order, or raise naming the cycle of waits."""
    S = schedule.num_stages
    rows = schedule.actions
    lowered = schedule.has_communication()
    done: set[tuple] = set()  # (kind, stage, microbatch) of finished actions; grads under ("grad", s, m)
    pc = [0] * len(rows)
    backward_of = {(a.stage, a.microbatch): a for row in rows for a in row if a.kind in BACKWARD}
    order: list[tuple[int, Action]] = []

    def needs(rank: int, a: Action):
        """(what, rank that provides it) a waits for, or None when it can run now."""
        if a.kind is K.F and a.stage > 0 and (not lowered or schedule.rank_of(a.stage - 1) == rank):
            want = (K.F, a.stage - 1, a.microbatch)
            return None if want in done else (Action(K.F, a.stage - 1, a.microbatch), schedule.rank_of(a.stage - 1))
        if a.kind in BACKWARD and a.stage < S - 1 and (not lowered or schedule.rank_of(a.stage + 1) == rank):
            if ("grad", a.stage + 1, a.microbatch) in done:
                return None
            want = backward_of.get((a.stage + 1, a.microbatch), Action(K.B, a.stage + 1, a.microbatch))
            return want, schedule.rank_of(a.stage + 1)
        if a.kind in RECVS or (a.kind in SENDS and sends == "rendezvous"):
            other = a.matching()
            peer = schedule.rank_of(other.stage)
            if a.kind in RECVS and sends != "rendezvous":
                return None if (other.kind, other.stage, other.microbatch) in done else (other, peer)
            at = rows[peer][pc[peer]] if pc[peer] < len(rows[peer]) else None
            if at is not None and Action(at.kind, at.stage, at.microbatch) == other:
                return None
            return other, peer
        return None

    def finish(rank: int) -> None:
        a = rows[rank][pc[rank]]
        pc[rank] += 1
        done.add((a.kind, a.stage, a.microbatch))
        if a.kind in BACKWARD:
            done.add(("grad", a.stage, a.microbatch))
        order.append((rank, a))

    while True:
        progress = False
        for rank, row in enumerate(rows):
            while pc[rank] < len(row):
                a = row[pc[rank]]
                if needs(rank, a) is not None:
                    break
                if sends == "rendezvous" and a.is_p2p:  # both ends complete together
                    peer = schedule.rank_of(a.peer_stage())
                    finish(rank)
                    finish(peer)
                else:
                    finish(rank)
                progress = True
        if all(p == len(row) for p, row in zip(pc, rows)):
            return tuple(order)
        if not progress:
            raise _deadlock(schedule, pc, needs)


def _deadlock(schedule: PipelineSchedule, pc: list[int], needs) -> ScheduleError:
    rows = schedule.actions
    waits = {}
    for rank, row in enumerate(rows):
        if pc[rank] < len(row):
            waits[rank] = (row[pc[rank]],) + needs(rank, row[pc[rank]])
    start = min(waits)
    cycle = [start]
    while waits[cycle[-1]][2] not in cycle and waits[cycle[-1]][2] in waits:
        cycle.append(waits[cycle[-1]][2])
    first = cycle.index(waits[cycle[-1]][2]) if waits[cycle[-1]][2] in cycle else 0
    cycle = cycle[first:]
    parts = []
    for n, rank in enumerate(cycle):
        at, want, peer = waits[rank]
        lead = ("rank {} waits" if n == 0 else "which waits").format(rank) + f" at {at} (action {pc[rank]})"
        if peer == rank:
            parts.append(f"{lead} for its own {want}, which comes later in its list")
        else:
            parts.append(f"{lead} for rank {peer} ({want})")
    return _fail(
        "deadlock: " + ", ".join(parts) + "; reorder the actions so that each wait is met",
        *[(rank, waits[rank][0]) for rank in cycle],
    )


def check(
    schedule: PipelineSchedule,
    *,
    sends: str = "nonblocking",
    num_ranks: int | None = None,
    num_stages: int | None = None,
    num_microbatches: int | None = None,
) -> CheckResult:
    """Prove `schedule` consistent and deadlock-free, or raise `ScheduleError` naming the first
    offending actions (see the module docstring for exactly what is proved).

    Arguments:
        schedule: a `PipelineSchedule`, compute-only or lowered (`with_communication`).
        sends: "nonblocking" (torch's batched isend/irecv: a SEND never waits, a RECV waits for
            its SEND) or "rendezvous" (a SEND also waits until the peer reaches its RECV).
        num_ranks, num_stages, num_microbatches: the run's sizes, when known; a schedule built
            for other sizes is refused.

    Returns a `CheckResult` whose `order` is one global order of the (rank, action) pairs that
    respects every wait: the order in which a single process can execute the schedule.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise ScheduleError(f"check expects a fs.pipeline.PipelineSchedule, got {type(schedule).__name__}")
    if sends not in ("nonblocking", "rendezvous"):
        raise ScheduleError(f"sends must be 'nonblocking' or 'rendezvous', got {sends!r}")
    _expect(schedule, num_ranks, num_stages, num_microbatches)
    backward = _static(schedule)
    order = _simulate(schedule, sends)
    accumulation = tuple(
        tuple(a.microbatch for a in schedule.actions[schedule.rank_of(s)] if a.stage == s and a.kind in (K.B, K.W))
        for s in range(schedule.num_stages)
    )
    return CheckResult(order, backward, accumulation)
