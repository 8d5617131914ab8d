"""`Pipeline`: how `fs.sharded_step` runs a `pp` axis, as a frozen value."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ._actions import PipelineSchedule, ScheduleError
from ._builtins import gpipe, interleaved_1f1b, one_f_one_b, zbv, zero_bubble_h1

__all__ = ["Pipeline", "BUILTINS", "build_schedule"]

# name -> (generator(P, M, v), stages per rank it needs: None for any, else exactly / at least)
BUILTINS: dict[str, Callable[..., PipelineSchedule]] = {
    "gpipe": lambda P, M, v: gpipe(P, M),
    "1f1b": lambda P, M, v: one_f_one_b(P, M),
    "interleaved_1f1b": lambda P, M, v: interleaved_1f1b(P, M, v),
    "zb_h1": lambda P, M, v: zero_bubble_h1(P, M),
    "zbv": lambda P, M, v: zbv(P, M),
}
_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "zbv": 2}


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How a step runs the mesh's `pp` axis (`fs.sharded_step(..., pipeline=fs.pipeline.Pipeline(...))`).

    Arguments:
        schedule: a built-in's name — "gpipe", "1f1b" (default), "interleaved_1f1b" (with
            `stages_per_rank` >= 2), "zb_h1" (zero bubble: B split into I and W), "zbv" (2 stages
            per rank in a V) — or a `PipelineSchedule` of your own (compute-only: it is lowered
            with its transfers and FSDP actions; or lowered already), or a function
            `(num_ranks, num_microbatches) -> PipelineSchedule`.
        stages_per_rank: virtual stages per pipeline rank (interleaving); the pipeline has
            `pp * stages_per_rank` stages. Default: what the schedule needs (2 for "zbv" and
            "interleaved_1f1b", else 1).
        stages: how units are cut into stages: "blocks" (default: the repeated blocks split
            evenly, the leaves before them on the first stage, after them on the last),
            "units" (every unit counted alike), or one sequence of unit names per stage.
    """

    schedule: Any = "1f1b"
    stages_per_rank: int | None = None
    stages: Any = None

    def __post_init__(self):
        if isinstance(self.schedule, str) and self.schedule not in BUILTINS:
            raise ScheduleError(f"unknown pipeline schedule {self.schedule!r}; built-ins: {sorted(BUILTINS)}")
        if not (isinstance(self.schedule, (str, PipelineSchedule)) or callable(self.schedule)):
            raise ScheduleError(
                f"Pipeline(schedule=...) takes a built-in's name, a PipelineSchedule or a function; got {type(self.schedule).__name__}"
            )
        if self.stages_per_rank is not None and (not isinstance(self.stages_per_rank, int) or self.stages_per_rank < 1):
            raise ScheduleError(f"stages_per_rank must be an int >= 1; got {self.stages_per_rank!r}")
        if isinstance(self.stages, list):
            object.__setattr__(self, "stages", tuple(tuple(s) for s in self.stages))

    def virtual_stages(self) -> int:
        """Stages per rank this pipeline runs."""
        if isinstance(self.schedule, PipelineSchedule):
            return self.schedule.stages_per_rank
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return _STAGES_PER_RANK.get(self.schedule, 2) if isinstance(self.schedule, str) else 1


def build_schedule(pipeline: Pipeline, num_ranks: int, num_microbatches: int) -> PipelineSchedule:
    """The schedule `pipeline` names, for `num_ranks` pipeline ranks and `num_microbatches`."""
    v = pipeline.virtual_stages()
    s = pipeline.schedule
    if isinstance(s, PipelineSchedule):
        return s
    if isinstance(s, str):
        need = _STAGES_PER_RANK.get(s)
        if need is not None and v != need:
            raise ScheduleError(f"the schedule {s!r} runs {need} stage(s) per rank; got stages_per_rank={v}")
        if s == "interleaved_1f1b" and v < 2:
            raise ScheduleError("interleaved_1f1b needs stages_per_rank >= 2")
        return BUILTINS[s](num_ranks, num_microbatches, v)
    out = s(num_ranks, num_microbatches)
    if not isinstance(out, PipelineSchedule):
        raise ScheduleError(f"the schedule function returned a {type(out).__name__}, not a PipelineSchedule")
    return out
