"""fs.pipeline: pipeline-parallel schedules as data, checked before they run.

A schedule is a value — per pipeline rank, an ordered tuple
of actions (`0F1`, `1SEND_F0`, `2I3`, `0UNSHARD`, ...) in `torch.distributed.pipelining`'s
compact form — that users print, edit, save and load (text, CSV), generate with the built-ins,
lower with communication, prove consistent and deadlock-free, and analyze; `Pipeline` says how
`fs.sharded_step(..., pipeline=...)` runs them on a mesh's `pp` axis (docs/pipelining.md).

    schedule = fs.pipeline.one_f_one_b(num_ranks=4, num_microbatches=8)
    lowered = fs.pipeline.with_communication(schedule, fsdp=True)   # + SEND/RECV, UNSHARD, REDUCE_GRAD
    fs.pipeline.check(lowered, sends="rendezvous")                  # or ScheduleError naming the actions
    print(fs.pipeline.explain(schedule))                            # bubble, in-flight, the grid
    edited = fs.pipeline.PipelineSchedule.from_csv(open("mine.csv").read())

The package is plain Python (no torch, no import of the step): schedules are planned anywhere.
"""

from ._actions import Action as Action
from ._actions import ActionKind as ActionKind
from ._actions import PipelineSchedule as PipelineSchedule
from ._actions import ScheduleError as ScheduleError
from ._actions import TensorMeta as TensorMeta
from ._actions import stage_to_rank as stage_to_rank
from ._analysis import Analysis as Analysis
from ._analysis import Costs as Costs
from ._analysis import Interval as Interval
from ._analysis import analyze as analyze
from ._analysis import explain as explain
from ._analysis import peak_in_flight as peak_in_flight
from ._builtins import gpipe as gpipe
from ._builtins import interleaved_1f1b as interleaved_1f1b
from ._builtins import one_f_one_b as one_f_one_b
from ._builtins import with_communication as with_communication
from ._builtins import zbv as zbv
from ._builtins import zero_bubble_h1 as zero_bubble_h1
from ._check import CheckResult as CheckResult
from ._check import check as check
from ._config import Pipeline as Pipeline
from ._config import build_schedule as build_schedule
from ._peaks import peak_bytes as peak_bytes

__all__ = [
    "Action",
    "ActionKind",
    "Analysis",
    "CheckResult",
    "Costs",
    "Interval",
    "Pipeline",
    "PipelineSchedule",
    "ScheduleError",
    "TensorMeta",
    "analyze",
    "build_schedule",
    "check",
    "explain",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "peak_bytes",
    "peak_in_flight",
    "stage_to_rank",
    "with_communication",
    "zbv",
    "zero_bubble_h1",
]
