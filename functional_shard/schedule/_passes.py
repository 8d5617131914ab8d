"""Passes as values: small frozen dataclasses that move a traced step's collectives.

A pass value is called as `pass_(gm, context) -> gm`: it moves collective nodes (and the views
and bookkeeping around them), never the computation, so every list of passes computes the
same bits. `context` (`PassContext`) says what the mesh allows. Being values, passes compare,
hash and print as what they are (`prefetch(distance=2)`), and a schedule is a list of them
that can be reordered, replaced or cut (see `Schedule` and `default_passes`).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
from torch import fx

from ._context import Pass, PassContext
from ._graph import (
    _C10D,
    Collective,
    aliases,
    check_units_named,
    collectives,
    parameter_collectives,
    forward_end,
    microbatch_of_label,
    move_before,
    move_early,
    move_issue_before,
    pre_collective_cast,
    preparation,
    positions,
    tag,
    unit_of_label,
    uses,
)


class _FrozenMapping(tuple):
    """An immutable, hashable `unit -> bool` mapping (sorted pairs)."""

    def __new__(cls, mapping: Mapping):
        return super().__new__(cls, sorted((str(k), bool(v)) for k, v in dict(mapping).items()))

    def get(self, key: str, default: bool) -> bool:
        return dict(self).get(key, default)

    def __repr__(self) -> str:
        return repr(dict(self))


def _check_int(owner: str, name: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise ValueError(f"{owner}.{name} must be {allowed}; got {value!r}")


# --- the built-in passes -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class reshard_after_forward(Pass):
    """Gather again, for the backward, every buffer of a unit that reshards and that the
    backward reads: the backward's reads are redirected to a copy of the all-gather (and of
    the views it went through), so the forward's copy dies after its last forward use
    (ZeRO-3: 1.5x the gathered bytes, far less memory).

    Arguments:
        reshard: True reshards every unit, False none; a mapping `unit -> bool` decides per
            unit (units not in it take `default`).
        default: the value for units a mapping leaves out.

    Run it before `bucket_gathers`: a bucket's members are read through copies, which this
    pass does not follow (it would keep them from forward to backward; the bits are the same).
    """

    reshard: bool | Mapping[str, bool] = True
    default: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.reshard, Mapping):
            # Frozen values should hold hashable values: keep the mapping as sorted pairs.
            object.__setattr__(self, "reshard", _FrozenMapping(self.reshard))

    def reshards(self, unit: str) -> bool:
        """Whether `unit` is freed after forward and gathered again for backward (a unit's
        gathers for micro-batch i, labelled `<unit>@mb<i>`, follow the unit's setting)."""
        if isinstance(self.reshard, _FrozenMapping):
            return self.reshard.get(unit_of_label(unit), self.default)
        return bool(self.reshard)

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        if isinstance(self.reshard, _FrozenMapping):
            # A unit name the step does not have (a stale `rest`, a typo) would be silently ignored.
            gathered = [c for c in parameter_collectives(gm) if c.kind == "all_gather" and c.phase == "forward"]
            known = list(dict.fromkeys(unit_of_label(m.unit) for c in gathered for m in c.members()))
            check_units_named("reshard_after_forward", [unit for unit, _ in self.reshard], known)
        for c in parameter_collectives(gm):
            if c.kind == "all_gather" and c.phase == "forward" and self.reshards(c.unit):
                _gather_again_for_backward(gm, c, forward_end(gm, after=c.wait))
        gm.graph.lint()
        return gm


def _gather_again_for_backward(gm: fx.GraphModule, c: Collective, end_node: fx.Node) -> None:
    position = positions(gm)
    end = position[end_node]
    alias_list = aliases(c.wait)
    alias_set = set(alias_list)
    # Reads from the backward, through aliases made in the forward (an alias made in the
    # backward reads its forward input, so redirecting that input covers it).
    backward_reads = [(user, a) for a in alias_list if position[a] <= end for user in list(a.users) if position[user] > end]
    if not backward_reads:
        return
    first = min((user for user, _ in backward_reads), key=position.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(node: fx.Node) -> fx.Node:
        if node not in copies:
            with gm.graph.inserting_before(first):
                if node is c.wait:
                    # Cast again too (mixed precision): else the forward's cast shard stays
                    # alive from the forward's gather to the backward's.
                    cast = pre_collective_cast(c.issue)
                    recast = gm.graph.node_copy(cast) if cast is not None else None
                    issue = gm.graph.node_copy(c.issue, lambda n: recast if n is cast else n)
                    tag(issue, dataclasses.replace(c.tag, phase="backward"))
                    copies[node] = gm.graph.node_copy(c.wait, lambda n: issue)
                else:
                    args = {a: copy_of(a) for a in node.all_input_nodes if a in alias_set}
                    copies[node] = gm.graph.node_copy(node, lambda n: args.get(n, n))
        return copies[node]

    for user, read in backward_reads:
        user.replace_input_with(read, copy_of(read))


@dataclasses.dataclass(frozen=True)
class prefetch(Pass):
    """Issue each unit's all-gather `distance` units ahead of its first use, in forward and in
    backward separately, and wait for it (and build its views) right before its first use
    (`distance=0`: gathered on demand). With micro-batches, within each micro-batch's forward
    and backward: a micro-batch's first unit is gathered on demand (as FSDP2's root is), not
    during the previous micro-batch."""

    distance: int = 1

    def __post_init__(self) -> None:
        _check_int("prefetch", "distance", self.distance, 0)

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        for phase in ("forward", "backward"):
            gathers = [c for c in parameter_collectives(gm) if c.kind == "all_gather" and c.phase == phase]
            if gathers:
                self._place(gm, gathers)
        gm.graph.lint()
        return gm

    def _place(self, gm: fx.GraphModule, gathers: list[Collective]) -> None:
        position = positions(gm)
        first_use: dict[str, fx.Node] = {}
        for c in gathers:
            readers = uses(c.wait)
            if readers:
                node = min(readers, key=position.__getitem__)
                if c.unit not in first_use or position[node] < position[first_use[c.unit]]:
                    first_use[c.unit] = node
        order = sorted(first_use, key=lambda u: position[first_use[u]])
        # Wait (and view) right before the first use, then issue `distance` units earlier.
        # Moving one unit's nodes never reorders another unit's nodes relative to each other,
        # so the positions taken once before the moves still order each unit against its anchor.
        for c in gathers:
            if c.unit in first_use:
                anchor = first_use[c.unit]
                move_before([n for n in aliases(c.wait) if position[n] < position[anchor]], anchor)
        position = positions(gm)
        block_start = {u: min((c.wait for c in gathers if c.unit == u), key=position.__getitem__) for u in order}
        # Never across micro-batches (`<unit>@mb<i>`): micro-batch i+1's first unit issued
        # during micro-batch i's forward would stay gathered through i's whole backward.
        first_of_microbatch = {}
        for index, unit in enumerate(order):
            first_of_microbatch.setdefault(microbatch_of_label(unit), index)
        for c in gathers:
            if c.unit in first_use:
                index = order.index(c.unit)
                earliest = max(first_of_microbatch[microbatch_of_label(c.unit)], index - self.distance)
                move_issue_before(c.issue, block_start[order[earliest]])


@dataclasses.dataclass(frozen=True)
class early_reduce_scatter(Pass):
    """Issue every reduce-scatter as soon as its gradient is complete, and wait for it right
    before its result is read — or, with `in_flight=k`, once k later reduce-scatters have been
    issued, which bounds how many are in flight (and how many full-size gradients are alive).

    The autograd engine runs the backward of the flattening (the `cat` of a unit's leaf
    gradients) late, after every other ready node, so the gradient buffer is first moved, with
    its pure ancestors, to right after the last leaf gradient it needs."""

    in_flight: int | None = None

    def __post_init__(self) -> None:
        _check_int("early_reduce_scatter", "in_flight", self.in_flight, 1, optional=True)

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        scatters = [c for c in parameter_collectives(gm) if c.kind == "reduce_scatter"]
        for c in scatters:
            producer = c.issue.args[0]
            if isinstance(producer, fx.Node) and producer.op != "placeholder":
                move_early(producer)
                producer.append(c.issue)
            readers = list(c.wait.users)
            if readers:
                position = positions(gm)
                move_before([c.wait], min(readers, key=position.__getitem__))
        if self.in_flight is not None:
            # In the order they are issued now: moving each issue after its gradient may have
            # reordered them (a tensor-parallel collective between two units' gradients does).
            position = positions(gm)
            _wait_before_later_issue(gm, sorted(scatters, key=lambda c: position[c.issue]), self.in_flight)
        gm.graph.lint()
        return gm


@dataclasses.dataclass(frozen=True)
class limit_in_flight(Pass):
    """Wait for each collective before the k-th next one is issued, so that at most k are in
    flight at once, and at most `context.max_in_flight_per_group` on any one process group
    (moving waits earlier only; compute still overlaps the ones in flight).

    k is the mesh's `max_collectives_in_flight` (from the pass context), or `max_in_flight`
    when that is smaller; with neither, and no bound per group, the pass changes nothing.

    Why gloo needs one per group: a gloo group runs its collectives on worker threads that
    share one context; with two collectives in flight on one group, ranks were seen to deadlock
    inside gloo (one rank spinning in a ring all-reduce's buffer teardown, the other waiting
    for a later collective), about once in a few thousand steps. `Mesh` therefore gives
    all-gathers and reduce-scatters separate groups (separate contexts and threads), and
    bounds each to one in flight: a unit's reduce-scatter overlaps the next unit's all-gather
    and the backward, and prefetching k > 1 units means unit i+k's gather is issued while unit
    i computes, once unit i+k-1's has arrived."""

    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        _check_int("limit_in_flight", "max_in_flight", self.max_in_flight, 1, optional=True)

    def bound(self, context: PassContext) -> int | None:
        """The most collectives in flight this pass allows under `context` (None: no limit)."""
        bounds = [b for b in (self.max_in_flight, context.max_collectives_in_flight) if b is not None]
        return min(bounds) if bounds else None

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        per_group = context.max_in_flight_per_group
        if per_group is not None:
            for members in by_group(collectives(gm)).values():
                _wait_before_later_issue(gm, members, per_group)
        bound = self.bound(context)
        if bound is not None:
            _wait_before_later_issue(gm, collectives(gm), bound)
        gm.graph.lint()
        return gm


def group_of(c: Collective) -> str:
    """The name of the process group collective `c` runs on (the last argument of its node)."""
    return str(c.issue.args[-1])


def by_group(ordered: list[Collective]) -> dict[str, list[Collective]]:
    """`ordered`'s collectives by process group, each list in the order given."""
    out: dict[str, list[Collective]] = {}
    for c in ordered:
        out.setdefault(group_of(c), []).append(c)
    return out


def _wait_before_later_issue(gm: fx.GraphModule, ordered: list[Collective], k: int) -> None:
    """Move each collective's wait before the issue of the k-th collective after it in
    `ordered` (in issue order), where it is not already, and before the copies that build that
    issue's buffer right before it (`preparation`); then finish gloo's local sums."""
    position = positions(gm)
    for c, later in zip(ordered, ordered[k:]):
        anchor = preparation(later.issue)
        if position[anchor] <= position[c.issue]:
            anchor = later.issue
        if position[c.wait] > position[anchor]:
            move_before([c.wait], anchor)
            position = positions(gm)
    _finish_local_sums(gm)


def _finish_local_sums(gm: fx.GraphModule) -> None:
    """Sum a gloo reduce-scatter's received slices right after its wait (Mesh.reduce_scatter_flat:
    all-to-all, then view + sum): the received buffer is full-size, the sum a shard."""
    finishing = {torch.ops.aten.view.default, torch.ops.aten.sum.dim_IntList}
    for c in collectives(gm):
        if c.issue.target is not _C10D.all_to_all_single.default:
            continue
        anchor = c.wait
        while len(anchor.users) == 1 and next(iter(anchor.users)).target in finishing:
            user = next(iter(anchor.users))
            if anchor.next is not user:
                anchor.append(user)
            anchor = user
