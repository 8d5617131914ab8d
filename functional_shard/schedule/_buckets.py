"""Buckets: fewer, larger collectives, the same bits.

`bucket_gathers` merges neighbouring all-gathers of one pass and dtype into one collective of
the concatenated shards; `bucket_reduce_scatters` merges neighbouring reduce-scatters of one
dtype and group, each member's slices copied back into a buffer of its own shape before the
local sum. Both only move data, so every schedule keeps the eager reference's bits.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from ._context import Pass, PassContext
from ._graph import (
    _C10D,
    WAIT_OP,
    Collective,
    CollectiveTag,
    Member,
    collectives,
    parameter_collectives,
    microbatch_of_label,
    positions,
    pre_collective_cast,
    tag,
)
from ._passes import _check_int


@dataclasses.dataclass(frozen=True)
class _Bucketing(Pass):
    """What both bucket passes share: `bucket_bytes` (checked; 0 changes nothing), and the
    grouping of consecutive candidates into buckets."""

    bucket_bytes: int

    def __post_init__(self) -> None:
        _check_int(type(self).__name__, "bucket_bytes", self.bucket_bytes, 0)

    @staticmethod
    def _buckets(candidates, fits) -> list[list[Collective]]:
        """`candidates` in order, each joining the bucket before it when `fits(bucket, c)`;
        the buckets of two or more."""
        buckets: list[list[Collective]] = []
        for c in candidates:
            if buckets and fits(buckets[-1], c):
                buckets[-1].append(c)
            else:
                buckets.append([c])
        return [b for b in buckets if len(b) > 1]


@dataclasses.dataclass(frozen=True)
class bucket_gathers(_Bucketing):
    """Merge all-gathers of the same pass and dtype, next to each other in issue order, into
    buckets of at most `bucket_bytes` (full buffers): one collective gathers the concatenated
    shards, issued where the first member was, waited where the first member was waited; each
    member's full buffer is then copied out of the rank-major result, and its readers read the
    copy. The bucket's `CollectiveTag` lists its members, so `analyze` reports them one by one.
    Bits are unchanged (an all-gather only moves data). `bucket_bytes=0` changes nothing."""

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        if self.bucket_bytes <= 0:
            return gm
        for phase in ("forward", "backward"):
            candidates = [c for c in parameter_collectives(gm) if c.kind == "all_gather" and c.phase == phase]
            for bucket in self._buckets(candidates, self._fits):
                _merge_gathers(gm, bucket)
        gm.graph.lint()
        return gm

    def _fits(self, bucket: list[Collective], c: Collective) -> bool:
        first = bucket[0].issue
        return (
            sum(m.nbytes for m in bucket) + c.nbytes <= self.bucket_bytes
            and c.issue.args[1:] == first.args[1:]
            and c.issue.args[0].meta["val"].dtype == first.args[0].meta["val"].dtype
            and not c.tag.members
            # A micro-batch's gathers only: merged with the next micro-batch's, its units would
            # be gathered a whole micro-batch early, every copy alive at once.
            and microbatch_of_label(c.unit) == microbatch_of_label(bucket[0].unit)
        )


def _merge_gathers(gm: fx.GraphModule, bucket: list[Collective]) -> None:
    aten = torch.ops.aten
    position = positions(gm)
    shards = [c.issue.args[0] for c in bucket]
    lengths = [s.meta["val"].numel() for s in shards]
    num_shards = bucket[0].issue.args[1]
    first_issue = min((c.issue for c in bucket), key=position.__getitem__)
    first_wait = min((c.wait for c in bucket), key=position.__getitem__)
    for c, shard in zip(bucket, shards):
        # Under mixed precision a member's shard is cast right before its own gather: the
        # concatenation reads it at the first member's place, so the cast (made from the
        # step's inputs alone) goes there.
        if position[shard] > position[first_issue] and pre_collective_cast(c.issue) is shard:
            first_issue.prepend(shard)
    with gm.graph.inserting_before(first_issue):
        joined = gm.graph.call_function(aten.cat.default, (shards,))
        issue = gm.graph.call_function(bucket[0].issue.target, (joined, *bucket[0].issue.args[1:]))
    with gm.graph.inserting_before(first_wait):
        wait = gm.graph.call_function(WAIT_OP, (issue,))
        rows = gm.graph.call_function(aten.view.default, (wait, [num_shards, sum(lengths)]))
        members, offset = [], 0
        for c, length in zip(bucket, lengths):
            part = gm.graph.call_function(aten.slice.Tensor, (rows, 1, offset, offset + length))
            copy = gm.graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
            full = gm.graph.call_function(aten.view.default, (copy, [num_shards * length]))
            c.wait.replace_all_uses_with(full)
            members.append(Member(c.buffer, c.unit, full, c.nbytes))
            offset += length
    _replace_members(gm, bucket, issue, members)


@dataclasses.dataclass(frozen=True)
class bucket_reduce_scatters(_Bucketing):
    """Merge reduce-scatters of the same dtype and process group, next to each other in issue
    order, into buckets of at most `bucket_bytes` (full buffers): one collective reduces the
    members' full gradients laid side by side rank by rank (`[num_shards, n_i]` each, joined
    along the second axis), issued where the last member was (every member's gradient is
    complete there), waited where the first member was waited; each member's result is then
    copied out of it into a buffer of its own shape, and its readers read the copy, so every
    sum is computed by the same kernel on the same shapes as without buckets: bit-identical.

    A member joins a bucket only if no member before it was waited before it is issued (a
    bucket never waits later than its members did). `bucket_bytes=0` changes nothing. Run it
    after `early_reduce_scatter` and before `limit_in_flight`."""

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        if self.bucket_bytes <= 0:
            return gm
        position = positions(gm)
        candidates = [c for c in parameter_collectives(gm) if c.kind == "reduce_scatter" and c.issue.target in _SCATTER_OPS]
        for bucket in self._buckets(candidates, lambda bucket, c: self._fits(bucket, c, position)):
            _merge_scatters(gm, bucket)
        gm.graph.lint()
        return gm

    def _fits(self, bucket: list[Collective], c: Collective, position: dict[fx.Node, int]) -> bool:
        first = bucket[0].issue
        return (
            sum(m.nbytes for m in bucket) + c.nbytes <= self.bucket_bytes
            and c.issue.target is first.target
            and _scatter_group(c.issue) == _scatter_group(first)
            and _scatter_shards(c.issue) == _scatter_shards(first)
            and c.issue.args[0].meta["val"].dtype == first.args[0].meta["val"].dtype
            and not c.tag.members
            and all(position[m.wait] > position[c.issue] for m in bucket)
        )


# The two forms of a reduce-scatter in a traced step (see Mesh.reduce_scatter_flat):
# reduce_scatter_tensor(full, op, num_shards, group) and, on gloo, all_to_all_single(full,
# output_splits, input_splits, group) followed by a local sum of the received slices.
_SCATTER_OPS = (_C10D.reduce_scatter_tensor.default, _C10D.all_to_all_single.default)


def _scatter_group(issue: fx.Node) -> str:
    return str(issue.args[-1])


def _scatter_shards(issue: fx.Node) -> int:
    return issue.args[2] if issue.target is _C10D.reduce_scatter_tensor.default else len(issue.args[1])


def _merge_scatters(gm: fx.GraphModule, bucket: list[Collective]) -> None:
    aten = torch.ops.aten
    position = positions(gm)
    first = bucket[0].issue
    num_shards = _scatter_shards(first)
    fulls = [c.issue.args[0] for c in bucket]
    lengths = [f.meta["val"].numel() // num_shards for f in fulls]
    total = sum(lengths)
    last_issue = max((c.issue for c in bucket), key=position.__getitem__)
    first_wait = min((c.wait for c in bucket), key=position.__getitem__)
    anchor = last_issue.next
    with gm.graph.inserting_before(anchor):
        rows = [gm.graph.call_function(aten.view.default, (f, [num_shards, n])) for f, n in zip(fulls, lengths)]
        joined = gm.graph.call_function(aten.cat.default, (rows, 1))
        flat = gm.graph.call_function(aten.view.default, (joined, [num_shards * total]))
        if first.target is _C10D.all_to_all_single.default:
            args = (flat, [total] * num_shards, [total] * num_shards, first.args[3])
        else:
            args = (flat, *first.args[1:])
        issue = gm.graph.call_function(first.target, args)
    with gm.graph.inserting_before(first_wait):
        wait = gm.graph.call_function(WAIT_OP, (issue,))
    received_rows = first.target is _C10D.all_to_all_single.default
    if received_rows:
        with gm.graph.inserting_after(wait):
            received = gm.graph.call_function(aten.view.default, (wait, [num_shards, total]))
    members, offset = [], 0
    for c, length in zip(bucket, lengths):
        with gm.graph.inserting_before(c.wait):
            if received_rows:
                # This member's slices from every rank, as one contiguous [num_shards * n] buffer:
                # what its own all-to-all would have received.
                part = gm.graph.call_function(aten.slice.Tensor, (received, 1, offset, offset + length))
                copy = gm.graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
                result = gm.graph.call_function(aten.view.default, (copy, [num_shards * length]))
            else:
                part = gm.graph.call_function(aten.slice.Tensor, (wait, 0, offset, offset + length))
                result = gm.graph.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
        c.wait.replace_all_uses_with(result)
        members.append(Member(c.buffer, c.unit, result, c.nbytes))
        offset += length
    _replace_members(gm, bucket, issue, members)


def _replace_members(gm: fx.GraphModule, bucket: list[Collective], issue: fx.Node, members: list[Member]) -> None:
    """Erase the members' own collectives (their readers read the bucket's copies by now) and
    tag the bucket's `issue` with its members, so that analyses report them one by one."""
    for c in bucket:
        gm.graph.erase_node(c.wait)
        gm.graph.erase_node(c.issue)
    tag(issue, CollectiveTag(
        kind=bucket[0].kind,
        buffer="+".join(m.buffer for m in members),
        unit="+".join(dict.fromkeys(m.unit for m in members)),
        phase=bucket[0].phase,
        nbytes=sum(m.nbytes for m in members),
        members=tuple(members),
    ))
