"""What fs's pipeline runner needs of a lowered schedule, beyond what `check` proves.

`check` proves a schedule consistent for any runtime (torch's included): its FSDP actions only
where the schedule has them, an `OPTIMIZER` after the stage's reduction. fs's runner
(`_pipe_run.run_actions`) sums each stage's gradients on the leaves of the one gather it makes
per step and runs the update after the schedule, for every stage at once (the global gradient
norm and clipping read them all). So a schedule a `sharded_step` runs must, per stage of each
rank, gather it once (`UNSHARD`) before its first compute and not again, reduce it once
(`REDUCE_GRAD`, training) before it is freed (`RESHARD`), hold no `OPTIMIZER`, and — once it
holds any action other than compute — carry its transfers itself. `check_runnable` refuses any
other schedule at the step's construction, before any collective, naming the first offending
action; before it, a second gather silently dropped the gradients summed on the first, and the
other cases failed mid-step while the peer rank waited for a transfer.
"""

from __future__ import annotations

from ._actions import COMPUTE, Action, ActionKind, PipelineSchedule, ScheduleError

__all__ = ["check_runnable"]

K = ActionKind


def check_runnable(schedule: PipelineSchedule, *, training: bool) -> None:
    """Raise `ScheduleError` naming the first action of `schedule` (lowered, already `check`ed)
    that fs's runner cannot run as the schedule says (see the module docstring)."""
    if schedule.num_ranks > 1 and not schedule.has_communication() and any(
        schedule.rank_of(s) != schedule.rank_of(s + 1) for s in range(schedule.num_stages - 1)
    ):  # fmt: skip
        raise ScheduleError(
            f"the pipeline schedule {schedule.name!r} holds FSDP actions but no SEND/RECV, and its stages cross ranks: "
            "give it every transfer too (fs.pipeline.with_communication lowers a compute-only schedule), or leave "
            "out the FSDP actions and the step lowers it whole"
        )
    for rank, row in enumerate(schedule.actions):
        gathered: dict[int, tuple[int, Action]] = {}
        for i, a in enumerate(row):
            if a.kind is not K.UNSHARD:
                continue
            if a.stage in gathered:
                j, first = gathered[a.stage]
                raise ScheduleError(
                    f"rank {rank}'s {a} (action {i}) gathers stage {a.stage} a second time in the step (first at action "
                    f"{j}): a sharded_step sums a stage's gradients on the leaves of its one gather per step, which a "
                    f"second gather would drop; keep the stage gathered from its first compute to its last (drop this "
                    f"{a.stage}UNSHARD and the {a.stage}RESHARD before it)", [(rank, first), (rank, a)],
                )  # fmt: skip
            gathered[a.stage] = (i, a)
        seen: dict[tuple[ActionKind, int], tuple[int, Action]] = {}
        computed: set[int] = set()
        for i, a in enumerate(row):
            where = f"rank {rank}'s {a} (action {i})"
            if a.kind is K.OPTIMIZER:
                raise ScheduleError(
                    f"{where}: a sharded_step updates every stage once after the schedule (the global gradient norm "
                    "and clipping read them all), not by an action: drop it", [(rank, a)],
                )  # fmt: skip
            if a.kind in COMPUTE:
                if (K.UNSHARD, a.stage) not in seen:
                    raise ScheduleError(
                        f"{where} runs stage {a.stage}, which this rank never gathered before it: add {a.stage}UNSHARD "
                        "before the stage's first compute (fs.pipeline.with_communication(..., fsdp=True))",
                        [(rank, a)],
                    )  # fmt: skip
                computed.add(a.stage)
            elif a.kind is K.RESHARD and training and (K.REDUCE_GRAD, a.stage) not in seen:
                raise ScheduleError(
                    f"{where} frees stage {a.stage} before its {a.stage}REDUCE_GRAD, which reads the gathered "
                    "stage's summed gradients: reduce first", [(rank, a)],
                )  # fmt: skip
            if a.kind in (K.UNSHARD, K.RESHARD, K.REDUCE_GRAD):
                seen.setdefault((a.kind, a.stage), (i, a))
        if training:
            for s in sorted(computed):
                if (K.REDUCE_GRAD, s) not in seen:
                    missing = Action(K.REDUCE_GRAD, s, None)
                    raise ScheduleError(
                        f"rank {rank} never reduces stage {s}'s gradients: add {missing} after the stage's last B/W "
                        "(its data-parallel mean, and the only way its gradients reach the update)", [(rank, missing)],
                    )  # fmt: skip


def check_metas(schedule: PipelineSchedule, rank: int, stages) -> None:
    """Raise `ScheduleError` naming the first SEND/RECV of `rank` whose declared tensor metadata
    is not what the run carries across its boundary: per micro-batch, the activations stage s
    sends to s + 1 (`stages[s].sent`, a cut's `StageProgram`s) and the cotangents of the
    differentiable ones coming back; values lent once per step (a tied weight) are not listed,
    as a schedule's metadata lists what crosses per micro-batch."""

    def meta(b):
        return tuple(b.shape), str(b.dtype).removeprefix("torch.")

    wires = {p.index: (tuple(meta(b) for b in p.sent if not b.lent), tuple(meta(b) for b in p.sent if not b.lent and b.differentiable))
             for p in stages}  # fmt: skip
    for i, a in enumerate(schedule.actions[rank]):
        if a.meta is None:
            continue
        boundary = a.stage if a.kind in (K.SEND_F, K.RECV_B) else a.stage - 1
        forward, backward = wires[boundary]
        carried = forward if a.kind in (K.SEND_F, K.RECV_F) else backward
        declared = tuple((tuple(m.shape), m.dtype) for m in a.meta)
        if declared != tuple(carried):
            text = ";".join("x".join(map(str, shape)) + ":" + dtype for shape, dtype in carried) or "nothing"
            raise ScheduleError(
                f"rank {rank}'s {a} (action {i}) declares {';'.join(map(str, a.meta))}, but the boundary between stages "
                f"{boundary} and {boundary + 1} carries {text} per micro-batch in this run", [(rank, a)],
            )  # fmt: skip
