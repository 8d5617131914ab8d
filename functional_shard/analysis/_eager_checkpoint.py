"""What torch's eager selective activation checkpointing holds that a traced step does not.

`torch.utils.checkpoint` with a policy (`create_selective_checkpoint_contexts`; torchtitan's
"selective op" mode) caches, during the forward, the output of every op its policy saves
(`_CachingTorchDispatchMode`) — before anything knows whether the block's backward reads it —
and holds it until the block's recomputation in the backward. fs's rematerialization is a graph
pass and keeps only what the backward reads; AOTAutograd's partitioner does the same for a
`torch.compile`d block. The difference is the policy's outputs that no backward node reads: in a
Llama block under torchtitan's op mode (every `mm` but every second one), the last product,
`down_proj`, read only by the residual add, whose backward needs no input.

    extra = fs.analysis.eager_checkpoint_cache_bytes(compiled, fs.schedule.RematPolicy(every_other_mm=True))

Each is alive from its block's forward to its backward, so all of them at once where the
backward starts (where a step's peak usually is): add `extra` to the predicted peak to predict
an eager torch run of the same policy (benchmarks/planning.py does, for torchtitan's runs).
"""

from __future__ import annotations

from ..schedule._remat import _RECOMPUTED_KEY, RematPolicy, _kept_by_policy
from ._costs import _nbytes
from ._regions import node_roles

__all__ = ["eager_checkpoint_cache_bytes"]


def eager_checkpoint_cache_bytes(compiled, policy: RematPolicy) -> int:
    """Bytes of the outputs `policy` saves in the units the step rematerializes that none of the
    backward's nodes reads (directly, or through a recomputed copy): what torch's eager selective
    checkpointing of those units caches for nothing. `compiled`: a `CompiledStep` traced with
    `Schedule(remat=policy)` (`step.lower`, `fs.analysis.plan`)."""
    if not isinstance(policy, RematPolicy):
        raise TypeError(f"eager_checkpoint_cache_bytes: policy must be an fs.schedule.RematPolicy; got {policy!r}")
    gm = compiled.graph_module
    roles = node_roles(gm)
    chosen = {n.meta[_RECOMPUTED_KEY] for n in gm.graph.nodes if _RECOMPUTED_KEY in n.meta}
    forward = {
        n: roles.unit.get(n, "")
        for n in gm.graph.nodes
        if n.op == "call_function" and roles.phase.get(n) == "forward" and _RECOMPUTED_KEY not in n.meta
    }
    unread = [
        n for n in _kept_by_policy(gm, forward, chosen, policy)
        if all(u in forward for u in n.users)  # read by original forward nodes only: no backward, no recomputation
    ]  # fmt: skip
    return sum(_nbytes(n.meta["val"]) for n in unread)
