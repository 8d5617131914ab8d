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
gradients are updated in place). An I frees nothing: its W still reads the stage's saved values.
"""

from __future__ import annotations

from typing import Sequence

from ._actions import ActionKind, PipelineSchedule

__all__ = ["peak_bytes"]

K = ActionKind


def peak_bytes(schedule: PipelineSchedule, saved: Sequence[float], gradients: Sequence[float]) -> tuple[float, ...]:
    """Per pipeline rank, the most bytes of activations and gradients alive at once during the step.

    Arguments:
        schedule: any schedule (compute actions are read; communication actions are ignored).
        saved: per stage, the bytes one micro-batch's forward keeps until its backward.
        gradients: per stage, the bytes of its summed (full) gradients, from its first backward on.
    """
    if len(saved) != schedule.num_stages or len(gradients) != schedule.num_stages:
        raise ValueError(
            f"saved and gradients need one figure per stage ({schedule.num_stages}); got {len(saved)} and {len(gradients)}"
        )
    peaks = []
    for row in schedule.actions:
        alive, peak, started = 0.0, 0.0, set()
        for a in row:
            if a.kind is K.F:
                alive += saved[a.stage]
            elif a.kind in (K.B, K.W):
                if a.stage not in started:
                    started.add(a.stage)
                    alive += gradients[a.stage]
                alive -= saved[a.stage]
            else:
                continue
            peak = max(peak, alive)
        peaks.append(peak)
    return tuple(peaks)
