"""The most bytes a pipeline rank holds at once beyond its state: in-flight activations and its
stages' summed gradients, walked action by action.

    fs.pipeline.peak_bytes(fs.pipeline.one_f_one_b(2, 2), saved=[4.5, 4.5], gradients=[3.2, 3.2])
    # rank 0: F0 F1 B0 B1 -> max(2 x 4.5, 1 x 4.5 + 3.2) = 9.0

Adding the peak in-flight activations of each stage to its full gradients counts bytes that are
never alive together: a stage's summed gradients come into being with its first backward, and
that backward frees the activations of the micro-batch it runs. The walk follows a rank's row:
F(s) adds stage s's saved bytes of one micro-batch; the first B (or W) of stage s adds its
gradients while freeing one micro-batch's activations (the backward's end state; its start state
is the state after the preceding action), a later one frees the activations only (the summed
gradients are updated in place). An I turns its micro-batch's bytes into `held_after_input`
where given (what its W needs: the saved values I leaves alive and the gradients it keeps for W,
`functional_shard/_split_backward.py`), else leaves them.
"""

from __future__ import annotations

from typing import Sequence

from ._actions import ActionKind, PipelineSchedule

__all__ = ["peak_bytes", "stage_peak_bytes"]

K = ActionKind


def peak_bytes(
    schedule: PipelineSchedule, saved: Sequence[float], gradients: Sequence[float],
    held_after_input: Sequence[float] | None = None,
) -> tuple[float, ...]:  # fmt: skip
    """Per pipeline rank, the most bytes of activations and gradients alive at once during the step.

    Arguments:
        schedule: any schedule (compute actions are read; communication actions are ignored).
        saved: per stage, the bytes one micro-batch's forward keeps until its backward.
        gradients: per stage, the bytes of its summed (full) gradients, from its first backward on.
        held_after_input: per stage, the bytes a micro-batch holds from its I to its W (default:
            `saved`, an I frees nothing).
    """
    if len(saved) != schedule.num_stages or len(gradients) != schedule.num_stages:
        raise ValueError(
            f"saved and gradients need one figure per stage ({schedule.num_stages}); got {len(saved)} and {len(gradients)}"
        )
    return tuple(max(_walk(row, saved, gradients, held_after_input, lambda s: 0)) for row in schedule.actions)


def stage_peak_bytes(
    schedule: PipelineSchedule, saved: Sequence[float], held_after_input: Sequence[float] | None = None
) -> tuple[float, ...]:
    """Per stage, the most bytes of its micro-batches' activations alive at once (F to B, or F to
    I then I to W at `held_after_input`): `fs.pipeline.peak_in_flight(schedule)` x `saved` where
    there is no I."""
    peaks = [0.0] * schedule.num_stages
    for row in schedule.actions:
        for s in {a.stage for a in row}:
            peaks[s] = max(peaks[s], *_walk(row, saved, [0] * schedule.num_stages, held_after_input, lambda t: t != s))
    return tuple(peaks)


def _walk(row, saved, gradients, held_after_input, skip) -> list[float]:
    """The bytes alive after each compute action of `row` (stages where `skip(stage)` left out)."""
    alive, out, started = 0.0, [0.0], set()
    for a in row:
        if skip(a.stage) or a.kind not in (K.F, K.I, K.B, K.W):
            continue
        held = saved[a.stage] if held_after_input is None else held_after_input[a.stage]
        if a.kind is K.F:
            alive += saved[a.stage]
        elif a.kind is K.I:
            alive += held - saved[a.stage]
        else:
            if a.stage not in started:
                started.add(a.stage)
                alive += gradients[a.stage]
            alive -= held if a.kind is K.W else saved[a.stage]
        out.append(alive)
    return out
