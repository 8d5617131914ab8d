"""Schedules: where in the traced step each collective is issued, waited and freed.

A traced step is one `torch.fx` graph: per-unit all-gathers, forward, backward (with a
reduce-scatter per unit), optimizer update. A *pass* moves collective nodes (never the
computation; `rematerialize` repeats some of it, op for op; `early_update` runs the optimizer's
in-place update earlier, its order constraints kept), so every schedule computes the same bits.
Passes are values — small frozen dataclasses called as `pass_(gm, context) -> gm` — and a
schedule is an ordered list of them, in the spirit of optax's `chain`: reorder, replace or drop
the built-in ones, add your own.

- config (`_schedule.py`): `Schedule` (the convenient form expands to `default_passes(...)`,
  read back as `schedule.pass_list`), `apply_schedule(gm, schedule, context)`;
- passes (`_passes.py`): `reshard_after_forward`, `prefetch`, `early_reduce_scatter`,
  `limit_in_flight`, `function_pass`, the base `Pass`, and `PassContext` (what the mesh
  allows: `max_collectives_in_flight`, world size, shards);
- buckets (`_buckets.py`): `bucket_gathers`, `bucket_reduce_scatters` (fewer, larger
  collectives);
- micro-batches (`_microbatches.py`): `gather_once`, each buffer gathered once per step instead
  of once per micro-batch (`Schedule(reshard_after_backward=False)`);
- rematerialization (`_remat.py`): `rematerialize`, the one pass that adds computation — it
  recomputes chosen units' forward values before their backward (same bits, less memory);
  `RematPolicy` keeps the outputs of the ops it names (matrix products, attention) and
  recomputes only the rest (selective activation checkpointing);
- the update (`_update.py`): `early_update`, each unit's in-place optimizer update as soon as
  its gradient is reduced (the default list's last pass);
- graph tools (`_graph.py`): the typed record of each collective (`CollectiveTag`, `tag`,
  `tag_of`), the end of the forward (`mark_forward_end`, `forward_end`), `collectives(gm)` (and
  `parameter_collectives(gm)`, the ones that move a parameter buffer: what passes move),
  `aliases`, `uses`, `move_before`, `move_early`;
- analysis (`_analysis.py`): `analyze(gm)` reads the applied schedule back out of the final
  graph as `ScheduleEvent`s; `explain`, `max_units_alive`, `max_in_flight`, `rematerialized`.
"""

from ._analysis import ScheduleEvent as ScheduleEvent
from ._analysis import analyze as analyze
from ._analysis import explain as explain
from ._analysis import max_in_flight as max_in_flight
from ._analysis import max_units_alive as max_units_alive
from ._analysis import rematerialized as rematerialized
from ._graph import ISSUE_OPS as ISSUE_OPS
from ._graph import WAIT_OP as WAIT_OP
from ._graph import Collective as Collective
from ._graph import CollectiveTag as CollectiveTag
from ._graph import Member as Member
from ._graph import aliases as aliases
from ._graph import collectives as collectives
from ._graph import parameter_collectives as parameter_collectives
from ._graph import forward_end as forward_end
from ._graph import mark_forward_end as mark_forward_end
from ._graph import move_before as move_before
from ._graph import move_early as move_early
from ._graph import tag as tag
from ._graph import tag_of as tag_of
from ._graph import uses as uses
from ._context import Pass as Pass
from ._context import PassContext as PassContext
from ._buckets import bucket_gathers as bucket_gathers
from ._buckets import bucket_reduce_scatters as bucket_reduce_scatters
from ._passes import early_reduce_scatter as early_reduce_scatter
from ._context import function_pass as function_pass
from ._passes import limit_in_flight as limit_in_flight
from ._microbatches import gather_once as gather_once
from ._passes import prefetch as prefetch
from ._passes import reshard_after_forward as reshard_after_forward
from ._remat import SAVE_DOTS as SAVE_DOTS
from ._remat import RematPolicy as RematPolicy
from ._remat import rematerialize as rematerialize
from ._update import early_update as early_update
from ._offload import Offload as Offload
from ._offload import offload_copies as offload_copies
from ._offload import stream_offload_copies as stream_offload_copies
from ._causal import causal_masks as causal_masks
from ._schedule import Schedule as Schedule
from ._schedule import apply_schedule as apply_schedule
from ._schedule import default_passes as default_passes

__all__ = [
    # config
    "Schedule",
    "default_passes",
    "apply_schedule",
    # passes
    "Pass",
    "PassContext",
    "function_pass",
    "reshard_after_forward",
    "prefetch",
    "early_reduce_scatter",
    "bucket_gathers",
    "bucket_reduce_scatters",
    "limit_in_flight",
    "gather_once",
    "rematerialize",
    "RematPolicy",
    "SAVE_DOTS",
    "early_update",
    "Offload",
    "stream_offload_copies",
    "causal_masks",
    # graph tools
    "CollectiveTag",
    "Member",
    "Collective",
    "tag",
    "tag_of",
    "mark_forward_end",
    "forward_end",
    "collectives",
    "parameter_collectives",
    "aliases",
    "uses",
    "move_before",
    "move_early",
    "offload_copies",
    # analysis
    "ScheduleEvent",
    "analyze",
    "explain",
    "max_units_alive",
    "max_in_flight",
    "rematerialized",
]
