"""The built-in schedules, each a pure function of the sizes, and the lowering that adds communication.

    fs.pipeline.gpipe(num_ranks, num_microbatches)                   # all forwards, then all backwards
    fs.pipeline.one_f_one_b(num_ranks, num_microbatches)             # warm-up, one F one B, cool-down
    fs.pipeline.interleaved_1f1b(num_ranks, num_microbatches, stages_per_rank=2)   # Megatron's order
    fs.pipeline.zero_bubble_h1(num_ranks, num_microbatches)          # B split into I and W (ZB-H1)
    fs.pipeline.zbv(num_ranks, num_microbatches)                     # zero bubble, V placement
    fs.pipeline.with_communication(schedule, fsdp=True)              # + SEND/RECV, UNSHARD/RESHARD, REDUCE_GRAD

The generators give compute actions only (F, B, I, W), in the orders
`torch.distributed.pipelining` computes for `ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble` and `ScheduleZBVZeroBubble`, idle
steps dropped; tests/test_pipeline_schedules.py compares them action for action.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from ._actions import BACKWARD, Action, ActionKind, PipelineSchedule, ScheduleError

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zbv", "with_communication"]

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W


def _sizes(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> None:
    sizes = (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("stages_per_rank", stages_per_rank))
    for name, value in sizes:
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: every rank forwards all M micro-batches, then backwards them in the same order.

    Arguments:
        num_ranks: P, pipeline ranks, one stage each (rank r holds stage r).
        num_microbatches: M.

    Peak in-flight activations: M micro-batches per stage. Bubble (P-1)/(M+P-1).
    """
    _sizes(num_ranks, num_microbatches)
    rows = tuple(
        tuple(Action(F, r, m) for m in range(num_microbatches))
        + tuple(Action(B, r, m) for m in range(num_microbatches))
        for r in range(num_ranks)
    )
    return PipelineSchedule(rows, num_microbatches, name="gpipe")


def one_f_one_b(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): rank r forwards min(P-1-r, M) micro-batches, then alternates one
    forward and one backward, then backwards the rest.

    Arguments:
        num_ranks: P, pipeline ranks, one stage each.
        num_microbatches: M.

    Peak in-flight activations: min(P-r, M) on stage r (at most P). Bubble (P-1)/(M+P-1).
    """
    _sizes(num_ranks, num_microbatches)
    rows = []
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, num_microbatches)
        row = [Action(F, r, m) for m in range(warmup)]
        for k in range(num_microbatches - warmup):
            row += [Action(F, r, warmup + k), Action(B, r, k)]
        row += [Action(B, r, m) for m in range(num_microbatches - warmup, num_microbatches)]
        rows.append(tuple(row))
    return PipelineSchedule(tuple(rows), num_microbatches, name="1f1b")


def _rounds(num_ranks: int, num_microbatches: int, what: str) -> int:
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds:
        raise ScheduleError(
            f"{what} runs micro-batches in rounds of about P={num_ranks}: M={num_microbatches} must be a multiple "
            f"of its {rounds} rounds (as torch's schedule requires); use M <= {num_ranks} or a multiple of {num_ranks}"
        )
    return num_microbatches // rounds


def _looped_1f1b(num_ranks, num_microbatches, stages_per_rank, rank, per_round, zero_bubble) -> list[Action]:
    """One rank's actions for the interleaved family (torch's `_get_1f1b_rank_ops`, idle steps dropped)."""
    total = stages_per_rank * num_microbatches
    factor = 1 if zero_bubble else 2
    warmup = min((stages_per_rank - 1) * per_round + factor * (num_ranks - 1 - rank), total)
    steady = total - warmup

    def forward_stage(op: int) -> int:
        return ((op // per_round) % stages_per_rank) * num_ranks + rank

    def backward_stage(op: int) -> int:
        return (stages_per_rank - 1 - ((op - warmup) // per_round) % stages_per_rank) * num_ranks + rank

    backward_kind = I if zero_bubble else B
    next_forward: dict[int, int] = defaultdict(int)
    next_backward: dict[int, int] = defaultdict(int)
    next_weight: dict[int, int] = defaultdict(int)
    backward_ops: list[int] = []
    weights_done = 0
    lag = rank  # zero bubble: rank r defers its first r weight gradients to fill its cool-down
    row: list[Action] = []

    def take(counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def weight() -> None:
        nonlocal weights_done
        stage = backward_stage(backward_ops[weights_done])
        row.append(Action(W, stage, take(next_weight, stage)))
        weights_done += 1

    for op in range(warmup + steady + warmup):
        if op < warmup + steady:
            stage = forward_stage(op)
            row.append(Action(F, stage, take(next_forward, stage)))
        if op >= warmup:
            stage = backward_stage(op)
            row.append(Action(backward_kind, stage, take(next_backward, stage)))
            backward_ops.append(op)
            if zero_bubble and op - warmup >= lag:
                weight()
    while zero_bubble and weights_done < len(backward_ops):
        weight()
    return row


def interleaved_1f1b(num_ranks: int, num_microbatches: int, stages_per_rank: int = 2) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline; torch's `ScheduleInterleaved1F1B` order).

    Rank r holds stages r, r+P, ... ("looped"); micro-batches go through a rank's stages in
    rounds of P (depth first), so the bubble shrinks by about the number of virtual stages.

    Arguments:
        num_ranks: P.
        num_microbatches: M; M <= P, or a multiple of M // P rounds (torch's condition).
        stages_per_rank: v >= 1 virtual stages per rank; the pipeline has P*v stages.
    """
    _sizes(num_ranks, num_microbatches, stages_per_rank)
    per_round = _rounds(num_ranks, num_microbatches, "interleaved 1F1B")
    rows = tuple(
        tuple(_looped_1f1b(num_ranks, num_microbatches, stages_per_rank, r, per_round, zero_bubble=False))
        for r in range(num_ranks)
    )
    return PipelineSchedule(rows, num_microbatches, stages_per_rank, "looped", name="interleaved_1f1b")


def zero_bubble_h1(num_ranks: int, num_microbatches: int, stages_per_rank: int = 1) -> PipelineSchedule:
    """Zero bubble ZB-H1 (Qi et al. 2024): 1F1B with each backward split into I (input gradient,
    sent upstream at once) and W (weight gradient); rank r defers its first r W's, which fill
    its cool-down bubble. torch's `ScheduleInterleavedZeroBubble` order (ZB1P when stages_per_rank > 1).

    Arguments:
        num_ranks: P.
        num_microbatches: M (with stages_per_rank > 1, the interleaved condition on M holds).
        stages_per_rank: 1 for ZB-H1; v > 1 gives torch's interleaved zero-bubble order.

    Peak in-flight activations as 1F1B (P); bubble (P-1)/(3M+P-1) with F = I = W.
    """
    _sizes(num_ranks, num_microbatches, stages_per_rank)
    per_round = _rounds(num_ranks, num_microbatches, "zero bubble") if stages_per_rank > 1 else num_microbatches
    rows = tuple(
        tuple(_looped_1f1b(num_ranks, num_microbatches, stages_per_rank, r, per_round, zero_bubble=True))
        for r in range(num_ranks)
    )
    return PipelineSchedule(rows, num_microbatches, stages_per_rank, "looped", name="zb_h1")


def zbv(num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """Zero bubble ZB-V (Qi et al. 2024, section 6; torch's `ScheduleZBVZeroBubble` order): two
    stages per rank placed in a V (rank r holds stages r and 2P-1-r, so rank 0 holds the first
    and the last), B split into I and W.

    Arguments:
        num_ranks: P.
        num_microbatches: M.
    """
    _sizes(num_ranks, num_microbatches)
    P, M = num_ranks, num_microbatches
    stages = 2 * P
    n = max(2 * P - 1, M)  # torch plans at least 2P-1 micro-batches and drops the extra ones
    rows = []
    for rank in range(P):
        down, up = rank, stages - 1 - rank  # the V's two arms on this rank
        row: list[Action] = []
        count = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}

        def add(kind: ActionKind, stage: int, key: str) -> None:
            row.append(Action(kind, stage, count[key]))
            if kind is not W:
                count[key] += 1

        for _ in range(2 * (P - rank) - 1):
            add(F, down, "f0")
        for _ in range(rank):
            add(F, up, "f1")
            add(F, down, "f0")
        for _ in range(P - rank):
            add(F, up, "f1")
            row.append(Action(I, up, count["b1"]))
            add(W, up, "b1")
            count["b1"] += 1
        while count["f1"] < count["f0"] or count["f0"] < n:
            if count["f0"] < n:
                add(F, down, "f0")
            row.append(Action(I, down, count["b0"]))
            row.append(Action(W, down, count["b0"]))
            count["b0"] += 1
            add(F, up, "f1")
            row.append(Action(I, up, count["b1"]))
            row.append(Action(W, up, count["b1"]))
            count["b1"] += 1
        w0, w1 = count["b0"], count["b1"]
        for _ in range(rank):
            row.append(Action(I, down, count["b0"]))
            count["b0"] += 1
            row.append(Action(I, up, count["b1"]))
            count["b1"] += 1
        for _ in range(P - rank):
            row.append(Action(I, down, count["b0"]))
            count["b0"] += 1
            row.append(Action(W, down, w0))
            w0 += 1
        row += [Action(W, up, m) for m in range(w1, count["b1"])]
        row += [Action(W, down, m) for m in range(w0, count["b0"])]
        rows.append(tuple(a for a in row if a.microbatch < M))
    return PipelineSchedule(tuple(rows), M, 2, "v", name="zbv")


def _fsdp_actions(row: list[Action], fsdp: bool, reduce_grad: bool) -> list[Action]:
    """UNSHARD before a stage's first compute, REDUCE_GRAD after its last B/W, RESHARD after its last compute."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    last_grad: dict[int, int] = {}
    for i, a in enumerate(row):
        if a.is_compute:
            first.setdefault(a.stage, i)
            last[a.stage] = i
            if a.kind in (B, W):
                last_grad[a.stage] = i
    out: list[Action] = []
    for i, a in enumerate(row):
        if fsdp and a.is_compute and first[a.stage] == i:
            out.append(Action(ActionKind.UNSHARD, a.stage))
        out.append(a)
        if reduce_grad and last_grad.get(a.stage) == i:
            out.append(Action(ActionKind.REDUCE_GRAD, a.stage))
        if fsdp and a.is_compute and last[a.stage] == i:
            out.append(Action(ActionKind.RESHARD, a.stage))
    return out


def with_communication(
    schedule: PipelineSchedule, *, fsdp: bool = False, reduce_grad: bool | None = None
) -> PipelineSchedule:
    """Lower a compute-only schedule: add the point-to-point transfers between adjacent stages on
    different ranks (and, with `fsdp`, each stage's gather, free and gradient reduction).

    After each F whose next stage lives on another rank, `SEND_F` on this rank and the matching
    `RECV_F` appended to the peer's list at the same moment of a simulated run (torch's
    `_add_send_recv`), so each receive lands before its consumer and the messages between two
    ranks are received in the order they are sent; likewise `SEND_B`/`RECV_B` after each B or I.

    Arguments:
        schedule: a compute-only schedule (F, B, I, W), checked first by `fs.pipeline.check`.
        fsdp: add `UNSHARD` before a stage's first compute on its rank and `RESHARD` after its
            last (each stage's units gathered once per step across the micro-batches, as
            FSDP2 does under pipelining), and `REDUCE_GRAD` after the stage's last B or W.
        reduce_grad: add `REDUCE_GRAD` (default: as `fsdp`; True for data-parallel replicas).
    """
    from ._check import check

    if schedule.has_communication() or any(not a.is_compute for row in schedule.actions for a in row):
        raise ScheduleError(
            f"with_communication lowers a compute-only schedule, but {schedule.name} already holds non-compute "
            "actions; lower schedule.compute_only() instead"
        )
    check(schedule)
    reduce_grad = fsdp if reduce_grad is None else reduce_grad
    pending = [_fsdp_actions(list(row), fsdp, reduce_grad) for row in schedule.actions]
    rank_of: Callable[[int], int] = schedule.rank_of
    last = schedule.num_stages - 1
    out: list[list[Action]] = [[] for _ in pending]
    done: list[set[tuple]] = [set() for _ in pending]  # per rank: (kind, stage, microbatch) placed so far

    def ready(rank: int, a: Action) -> bool:
        if a.kind is F and a.stage > 0:
            received = (ActionKind.RECV_F, a.stage, a.microbatch) in done[rank]
            return received or (F, a.stage - 1, a.microbatch) in done[rank]
        if a.kind in BACKWARD and a.stage < last:
            return (ActionKind.RECV_B, a.stage, a.microbatch) in done[rank] or any(
                (k, a.stage + 1, a.microbatch) in done[rank] for k in BACKWARD
            )
        return True

    def place(rank: int, a: Action) -> None:
        out[rank].append(a)
        done[rank].add((a.kind, a.stage, a.microbatch))

    positions = [0] * len(pending)
    while any(p < len(row) for p, row in zip(positions, pending)):
        progress = False
        for rank, row in enumerate(pending):
            if positions[rank] >= len(row) or not ready(rank, row[positions[rank]]):
                continue
            a = row[positions[rank]]
            positions[rank] += 1
            progress = True
            place(rank, a)
            if a.kind is F and a.stage < last and rank_of(a.stage + 1) != rank:
                send = Action(ActionKind.SEND_F, a.stage, a.microbatch)
                place(rank, send)
                place(rank_of(a.stage + 1), send.matching())
            elif a.kind in BACKWARD and a.stage > 0 and rank_of(a.stage - 1) != rank:
                send = Action(ActionKind.SEND_B, a.stage, a.microbatch)
                place(rank, send)
                place(rank_of(a.stage - 1), send.matching())
        if not progress:  # check() proved the compute order runs; this would be a bug here
            raise ScheduleError(f"with_communication: no rank can proceed at {positions} (please report)")
    return schedule.replace(actions=tuple(tuple(row) for row in out))
