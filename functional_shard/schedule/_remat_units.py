"""Which forward node of a traced step belongs to which unit, for rematerialization (`_remat`).

A unit's forward nodes are those that depend on its gathered parameters (the latest parameter
read decides), per micro-batch; parameter-free tails of a unit that only the next unit reads
(a Llama block's first norm up to its weight, per-layer mask casts) are handed to that unit
(`boundaries_to_readers`), so that what a rematerialized unit keeps is its input.
"""

from __future__ import annotations

from torch import fx

from ._graph import _is_view, aliases, microbatch_label, microbatch_of_label, parameter_collectives

__all__ = ["gathered_parameters", "forward_nodes", "boundaries_to_readers"]


def gathered_parameters(gm: fx.GraphModule, position: dict, end: int) -> dict[fx.Node, str]:
    """Every view of a buffer gathered for a forward (waited by `end`, the last forward's end)
    -> its unit (a bucket: per member)."""
    out: dict[fx.Node, str] = {}
    for c in parameter_collectives(gm):
        if c.kind == "all_gather" and c.phase != "backward" and position[c.wait] <= end:
            for member in c.members():
                for alias in aliases(member.root):
                    out[alias] = member.unit
    return out


def _microbatch_label(unit: str, microbatch: int, several: bool) -> str:
    """`unit` as read in micro-batch `microbatch`'s forward: buffers gathered once for every
    micro-batch (frozen ones) take that micro-batch's label, as its own gathers have it."""
    return microbatch_label(unit, microbatch) if several and not microbatch_of_label(unit) else unit


def forward_nodes(
    gm: fx.GraphModule, parameters: dict, position: dict, ends: list[fx.Node]
) -> tuple[dict[fx.Node, int], dict[fx.Node, str]]:
    """(forward node -> its micro-batch, forward node -> its unit label).

    With micro-batches the graph runs forward 0, backward 0, forward 1, ...: micro-batch i's
    forward nodes sit between the end of forward i-1 and end i (`ends`), less the nodes of
    backward i-1 there: those that read a forward end or a backward node, or a unit's node or
    parameter of another micro-batch (what a backward reads of its own forward). A forward node's
    unit is the unit of the latest parameter read it depends on (nodes that depend on no
    parameter, such as the batch, constants and random masks, belong to no unit)."""
    several = len(ends) > 1
    microbatch_of: dict[fx.Node, int] = {}
    latest: dict[fx.Node, tuple[int, str, int]] = {}  # node -> (position of the read, unit label, micro-batch)
    backward: set[fx.Node] = set(ends)  # forward ends and an earlier backward's nodes: their readers are backward too
    microbatch = 0
    for node in gm.graph.nodes:
        if microbatch == len(ends):
            break
        here = microbatch
        if node is ends[here]:
            microbatch += 1
        if node in parameters or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        reads = [(position[node], _microbatch_label(parameters[i], here, several)) for i in inputs if i in parameters]
        inherited = [latest[i] for i in inputs if i in latest]
        if (
            any(i in backward for i in inputs)
            or any(m != here for _, _, m in inherited)
            or (several and any(microbatch_of_label(u) != str(here) for _, u in reads))
        ):
            backward.add(node)
            continue
        microbatch_of[node] = here
        if reads or inherited:
            latest[node] = (*max(reads + [(p, u) for p, u, _ in inherited]), here)
    return microbatch_of, {node: unit for node, (_, unit, _) in latest.items()}


def boundaries_to_readers(gm: fx.GraphModule, unit_of: dict, microbatch_of: dict, parameters: dict) -> dict:
    """`unit_of` with the parameter-free tails of units handed to the unit that reads them.

    A unit's value read by the next unit's forward is kept from forward to backward (it is the
    next unit's input). A Llama block's output is read twice by the next block: as its residual
    and through its first norm (`x * rsqrt(mean(x²))`, then a cast), which reads no parameter
    until the norm's weight, so by the "latest parameter read" rule the norm's first ops belong to
    the block before, and both the residual and the normalized value would be kept. Such a value
    X is handed to its reader's unit, with the chain of parameter-free nodes it is computed from,
    when that chain starts only from values kept anyway (read across units, or read by no unit):
    the reader recomputes it in its backward from what is already kept, and X is no longer kept
    (torchtitan's full activation checkpointing keeps each block's input only). Same ops on the
    same inputs: the same bits."""
    out = dict(unit_of)

    def forward_users(n):
        return [u for u in n.users if u in microbatch_of]

    def crossing(n) -> bool:  # read by another unit's forward: kept
        return n in out and any(out.get(u) not in (None, out[n]) for u in forward_users(n))

    for x in reversed(list(gm.graph.nodes)):
        unit = out.get(x)
        if x not in microbatch_of or any(i in parameters for i in x.all_input_nodes):
            continue
        if unit is not None and not crossing(x):
            continue
        readers = {out.get(u) for u in forward_users(x)} - {None}
        if len(readers) != 1 or unit in readers or any(microbatch_of[u] != microbatch_of[x] for u in forward_users(x)):
            continue
        (reader,) = readers
        chain, frontier, stack = {x}, set(), list(x.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in chain or n in frontier:
                continue
            joins = (
                n in microbatch_of and out.get(n) == unit and not (unit is not None and crossing(n))
                and not any(i in parameters for i in n.all_input_nodes)
                and all(u in chain or out.get(u) == reader for u in forward_users(n))
            )  # fmt: skip
            if not joins:
                frontier.add(n)
                continue
            chain.add(n)
            stack.extend(n.all_input_nodes)
        # The reader's backward reads the frontier instead of x: it must be kept anyway (read across
        # units, a parameter, an input of the step) or hold no storage of its own (a view).
        free = all(n.op == "placeholder" or n in parameters or crossing(n) or _is_view(n) for n in frontier)
        # Views alone allocate nothing: handing a unit nothing but views would only move where they are made.
        if free and not all(_is_view(n) for n in chain) and all(microbatch_of.get(n) == microbatch_of[x] for n in chain):
            for n in chain:
                out[n] = reader
    return out
