"""`gather_once()`: with micro-batches, gather each buffer once per step instead of once per micro-batch.

A step with `microbatches=k` traces k forwards and backwards, and each micro-batch gathers every
unit it computes: k times the all-gather bytes of one batch (FSDP2 and DeepSpeed ZeRO-3 do the
same by default). The shards do not change between micro-batches — the optimizer runs after the
last one — so every gather of a buffer after the first moves the same bytes again. This pass
makes each later gather read the first one's result and removes it (with the cast that fed it,
under mixed precision): each buffer is gathered once per step and stays gathered from its
first use to its last, across micro-batches. That is FSDP2's
`set_reshard_after_backward(False)` with `reshard_after_forward=False`: all-gather bytes no
longer grow with k, and every unit's full parameters are alive across the micro-batches.

It moves no computation, so the bits stay the eager reference's. `Schedule(reshard_after_backward=False)`
puts it first in the default pass list (with `reshard_after_forward=False`).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from ._context import Pass, PassContext
from ._graph import collectives, pre_collective_cast


@dataclasses.dataclass(frozen=True)
class gather_once(Pass):
    """Every all-gather of a buffer after its first reads the first's result (see the module).

    Gathers are the same when they move the same buffer, into the same dtype, over the same
    group. Buckets (`bucket_gathers`) are made by a later pass and are left alone, and so are
    gathers over one shard: identities that the step drops, whose "gathered" value is the
    shard itself (which an early update may write in place).
    """

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        first: dict = {}
        for c in collectives(gm):
            if c.kind != "all_gather" or c.tag.members or not c.buffer or c.issue.args[1] == 1:
                continue
            value = c.issue.meta.get("val")
            key = (c.buffer, getattr(value, "dtype", None), tuple(map(str, c.issue.args[1:])))
            if key not in first:
                first[key] = c
                continue
            cast = pre_collective_cast(c.issue)
            c.wait.replace_all_uses_with(first[key].wait)
            gm.graph.erase_node(c.wait)
            gm.graph.erase_node(c.issue)
            if cast is not None and not cast.users:
                gm.graph.erase_node(cast)
        return gm

