"""Lowerings: what the step does to a scheduled graph after the passes, which must not see it.

The passes move collectives and find units by their all-gathers; these rewrites tie nodes to
where a collective (or a gradient buffer) now sits, so they run once, last
(`lower_for_mesh`, at the end), on a copy the passes never get back (`CompiledStep.scheduled` keeps
the graph before them). Each keeps the eager reference's bits: it changes where results are
written and when memory is freed, never what is computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from ._offload import offload_copies, stream_offload_copies
from ._graph import _C10D, _is_pure, _is_view, collectives, copy_graph, parameter_collectives, positions, pre_collective_cast

aten = torch.ops.aten


def drop_collectives(gm: fx.GraphModule) -> int:
    """Replace every collective of `gm` by its input, for a world of one rank, where each is
    the identity (an all-gather or reduce-scatter over one shard, a sum over one rank): the
    readers of its wait read the collective's input (the gloo reduce-scatter's local sum over
    one slice then copies it, with the same bits). Returns how many were dropped. The step
    calls it after the schedule's passes, which find units by their all-gathers. A gather's
    cast to the gather dtype (`pre_collective_cast`) moves to right before its first reader:
    with nothing to overlap, a prefetched unit's cast would only be alive early."""
    dropped = 0
    order = positions(gm)
    for c in collectives(gm):
        cast = pre_collective_cast(c.issue) if c.kind == "all_gather" else None
        c.wait.replace_all_uses_with(c.issue.args[0])
        gm.graph.erase_node(c.wait)
        gm.graph.erase_node(c.issue)
        if cast is not None and cast.users:
            min(cast.users, key=order.__getitem__).prepend(cast)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def gather_casts_in_place(gm: fx.GraphModule, shard_index: int) -> int:
    """Cast each mixed-precision shard straight into this rank's slot of its all-gather's
    output, as FSDP2 does, instead of into a copy of its own that the collective's work holds
    until it is waited for: `_to_copy(shard, dtype) -> all_gather_into_tensor(cast)` becomes
    `empty(full) -> copy_(slot, shard) -> all_gather_into_tensor_out(slot, out=full)`, where
    the slot is `shard_index`'s. The same bits (one cast, the same rounding; gloo and NCCL
    gather in place when the input is the output's own slot), one shard of memory less per
    gather in flight. The step calls it after the schedule's passes, which move a gather's
    cast with it (`pre_collective_cast`); returns how many gathers it changed."""
    changed = 0
    for c in parameter_collectives(gm):
        cast = pre_collective_cast(c.issue)
        if c.issue.target is not _C10D.all_gather_into_tensor.default or cast is None or set(cast.kwargs) != {"dtype"}:
            continue
        shard, (group_size, group) = cast.args[0], c.issue.args[1:]
        cast_val, full_val = cast.meta.get("val"), c.issue.meta.get("val")
        if not isinstance(cast_val, FakeTensor) or not isinstance(full_val, FakeTensor) or cast_val.dim() != 1:
            continue
        n = cast_val.numel()
        graph = gm.graph
        with graph.inserting_before(c.issue):
            full = _new_buffer(graph, group_size * n, cast_val)
            slot = _piece(graph, full, shard_index * n, n)
            copied = graph.call_function(aten.copy_.default, (slot, shard))
            issue = graph.call_function(_C10D.all_gather_into_tensor_out.default, (copied, group_size, group), {"out": full})
        copied.meta["val"] = slot.meta["val"]
        issue.meta.update(c.issue.meta)
        issue.meta["val"] = full.meta["val"]
        c.issue.replace_all_uses_with(issue)
        graph.erase_node(c.issue)
        if not cast.users:
            graph.erase_node(cast)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _new_buffer(graph: fx.Graph, numel: int, like: FakeTensor) -> fx.Node:
    """An `empty(numel)` node of `like`'s dtype and device, its fake value in `like`'s mode."""
    node = graph.call_function(aten.empty.memory_format, ([numel],), {"dtype": like.dtype, "device": like.device})
    with like.fake_mode:
        node.meta["val"] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return node


def _piece(graph: fx.Graph, buffer: fx.Node, start: int, n: int) -> fx.Node:
    """A `slice` node for elements `[start, start + n)` of the 1-D `buffer`, with its value."""
    node = graph.call_function(aten.slice.Tensor, (buffer, 0, start, start + n))
    node.meta["val"] = buffer.meta["val"][start : start + n]
    return node


def release(*tensors: torch.Tensor) -> None:
    """Free the memory of `tensors` now (their storages shrink to 0 bytes): a node the step
    inserts once nothing reads them any more (`free_sent_and_received`)."""
    for t in tensors:
        t.untyped_storage().resize_(0)


def free_sent_and_received(gm: fx.GraphModule) -> int:
    """Free each reduce-scatter's full gradient right after its wait, and on gloo the slices it
    received right after their local sum, instead of whenever the last reference goes: the
    collective's work holds both, and gloo's worker thread drops its reference at a moment of
    its own, after the wait has returned; the memory then stayed allocated a while longer on
    some steps and ranks (up to 1.8 MiB more at the GPT benchmark's bf16 peak at batch 1, on one
    rank of two). Only buffers that nothing else reads and that alias nothing are freed; the
    step calls it last, after the schedule's passes. Returns how many `release` nodes it added."""
    added = 0
    for c in collectives(gm):
        if c.kind != "reduce_scatter":
            continue
        sent = c.issue.args[0]
        if isinstance(sent, fx.Node) and _owns_storage(sent) and set(sent.users) == {c.issue}:
            with gm.graph.inserting_after(c.wait):
                gm.graph.call_function(release, (sent,)).meta["val"] = None
            added += 1
        end, chain = c.wait, []
        while len(end.users) == 1 and next(iter(end.users)).target in (torch.ops.aten.view.default, torch.ops.aten.sum.dim_IntList):
            end = next(iter(end.users))
            chain.append(end)
        if chain and chain[-1].target is torch.ops.aten.sum.dim_IntList:
            with gm.graph.inserting_after(end):
                gm.graph.call_function(release, (c.wait,)).meta["val"] = None
            added += 1
    if added:
        gm.graph.lint()
        gm.recompile()
    return added


def _owns_storage(node: fx.Node) -> bool:
    """A computed tensor with a storage of its own (not a step input, not a view of another,
    also where the schema does not say so: `_unsafe_view` shares its input's storage)."""
    value = node.meta.get("val")
    if node.op != "call_function" or not _is_pure(node) or _is_view(node) or not isinstance(value, torch.Tensor):
        return False
    mine = StorageWeakRef(value.untyped_storage())
    inputs = [i.meta.get("val") for i in node.all_input_nodes]
    return not any(isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) == mine for v in inputs)


# Producers whose out= form runs the same kernel into a given contiguous tensor (the
# functional form allocates the result and calls it), and the views a gradient goes through
# on its way to the flat buffer (`t(t(mm(...)))` viewed as 1-D, `view(sum(...))`).
_OUT_FORMS = {
    aten.mm.default: aten.mm.out,
    aten.addmm.default: aten.addmm.out,
    aten.sum.dim_IntList: aten.sum.IntList_out,
}
_SAME_MEMORY = (aten.view.default, aten._unsafe_view.default, aten.t.default)


def gradients_in_place(gm: fx.GraphModule, memory_timeline: Callable[[fx.GraphModule], list[int]]) -> int:
    """Compute a unit's gradients straight into its flat gradient buffer instead of copying
    them there, where that does not raise the step's peak memory: `cat([view(mm(a, b)),
    view(sum(g, dims)), x, ...])` becomes `buffer = empty(n)`, `mm.out(a, b, out=<its slot>)`,
    `sum.out(g, dims, out=<its slot>)` and `copy_(<slot>, x)` for the rest (a layer norm's
    gradients, the padding's zeros), the buffer taking the cat's place. It saves a copy of the
    whole gradient (a pass over 2 x its bytes) and, at the cat, the second copy of it in
    memory; but the buffer lives from its first producer on, where each leaf gradient lived
    from its own, so between them memory is higher by what is not produced yet. With
    `memory_timeline(gm)` (bytes alive at each node, `analysis.memory_timeline`) a cat is
    rewritten only if that never lifts memory above the step's peak: the windows of
    different cats (each unit's backward) do not overlap, and outside its window a rewrite
    only lowers memory. A producer is rewritten when the cat is its one reader, through
    views that keep its memory order; the out= forms run the functional forms' kernels, so
    the bits are the same. Returns how many buffers it built."""
    timeline = memory_timeline(gm)
    peak = max(timeline, default=0)
    order = positions(gm)
    plans = []
    for cat in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cat.default]:
        plan = _plan(cat)
        if plan is None:
            continue
        # Memory in the window [first producer, cat): the buffer replaces the leaf gradients
        # produced so far.
        produced_at = sorted((order[p], v.nbytes) for _, v, p, _ in plan if p is not None)
        total, produced, worst = cat.meta["val"].nbytes, 0, 0
        for index, (position, nbytes) in enumerate(produced_at):
            produced += nbytes
            end = produced_at[index + 1][0] if index + 1 < len(produced_at) else order[cat]
            worst = max(worst, max(timeline[position:end], default=0) - produced + total)
        if worst <= peak:
            plans.append((cat, plan))
    for cat, plan in plans:
        _build_in_place(gm, cat, plan, order)
    if plans:
        gm.graph.lint()
        gm.recompile()
    return len(plans)


def _plan(cat: fx.Node) -> list | None:
    """(part, its value, its producer or None, its offset) for each input of a 1-D cat with at
    least one producer to rewrite, else None."""
    val = cat.meta.get("val")
    parts = cat.args[0]
    if not isinstance(val, FakeTensor) or val.dim() != 1 or (len(cat.args) > 1 and cat.args[1] not in (0, -1)):
        return None
    vals = [p.meta.get("val") if isinstance(p, fx.Node) else None for p in parts]
    if not all(isinstance(v, FakeTensor) and v.dim() == 1 and v.dtype == val.dtype for v in vals):
        return None
    plan, offset = [], 0
    for part, v in zip(parts, vals):
        plan.append((part, v, _producer(part, v), offset))
        offset += v.numel()
    return plan if any(p is not None for _, _, p, _ in plan) else None


def _build_in_place(gm: fx.GraphModule, cat: fx.Node, plan: list, order: dict) -> None:
    graph = gm.graph
    first = min((p for _, _, p, _ in plan if p is not None), key=order.__getitem__)
    with graph.inserting_before(first):
        buffer = _new_buffer(graph, cat.meta["val"].numel(), cat.meta["val"])
    for part, v, producer, start in plan:
        if producer is None:
            if v.numel():  # copied where the cat was
                with graph.inserting_before(cat):
                    piece = _piece(graph, buffer, start, v.numel())
                    graph.call_function(aten.copy_.default, (piece, part)).meta["val"] = piece.meta["val"]
            continue
        shape = list(producer.meta["val"].shape)
        with graph.inserting_before(producer):
            piece = _piece(graph, buffer, start, v.numel())
            slot = graph.call_function(aten.view.default, (piece, shape))
            written = graph.call_function(_OUT_FORMS[producer.target], producer.args, {**producer.kwargs, "out": slot})
        slot.meta["val"] = written.meta["val"] = piece.meta["val"].view(shape)
        written.meta.update({k: value for k, value in producer.meta.items() if k != "val"})
        producer.replace_all_uses_with(written)
        graph.erase_node(producer)
    cat.replace_all_uses_with(buffer)
    graph.erase_node(cat)
    for part, _, _, _ in plan:  # the views that led a rewritten gradient to the cat read nothing now
        node = part
        while isinstance(node, fx.Node) and not node.users and node.target in _SAME_MEMORY:
            source = node.args[0]
            graph.erase_node(node)
            node = source


def _producer(part: fx.Node, val) -> fx.Node | None:
    """The node whose output `part` (a 1-D input of a cat) views whole and in memory order,
    if its out= form can write it into the cat's buffer (`_OUT_FORMS`), else None."""
    if not isinstance(part, fx.Node) or len(part.users) != 1 or not _fresh_1d(val):
        return None
    node = part
    while node.target in _SAME_MEMORY:
        node = node.args[0]
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
    produced = node.meta.get("val")
    if (
        node.op != "call_function"
        or node.target not in _OUT_FORMS
        or not isinstance(produced, FakeTensor)
        or not produced.is_contiguous()
        or produced.storage_offset() != 0
        or produced.numel() != val.numel()
        or StorageWeakRef(produced.untyped_storage()) != StorageWeakRef(val.untyped_storage())
    ):
        return None
    return node


def _fresh_1d(val) -> bool:
    return (
        isinstance(val, FakeTensor)
        and val.dim() == 1
        and val.storage_offset() == 0
        and (val.numel() <= 1 or val.stride(0) == 1)
    )


def runnable(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` that calls each operator's C++ entry point (`OpOverload._op`) instead
    of the `OpOverload` object, whose `__call__` is one more Python frame per node: about
    0.5 us of a node's 2-3 us on a CPU, some 1 ms a step for a 2,000-node GPT step. The same
    kernels, so the same results; `gm` (what the analyses read) keeps its targets. Each entry
    point is wrapped in a `functools.partial` named after its operator, which FX's code
    generation can bind as a global (the bare entry point it cannot name), and which keeps the
    operator in its `overload` attribute."""
    graph = copy_graph(gm)
    entry: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if node.target not in entry:
                call = functools.partial(node.target._op)
                call.__name__ = str(node.target).replace(".", "_").replace("::", "_")  # type: ignore[attr-defined]
                call.overload = node.target  # type: ignore[attr-defined]  # what a failure names (_replay)
                entry[node.target] = call
            node.target = entry[node.target]
    return fx.GraphModule(gm, graph)


def lower_for_mesh(gm: fx.GraphModule, mesh, *, in_place: bool = False) -> None:
    """What runs after the passes, which must not see it (this module: they move
    collectives, and these nodes are tied to where a collective sits): with one rank, no
    collective at all (each is the identity); else mixed-precision casts made in their
    gather's slot, and the buffers a reduce-scatter sent and received freed at fixed points
    of the graph; then, with `in_place` (`Schedule(gradients_in_place=True)`, experimental),
    gradients computed straight into their unit's flat buffer."""
    if mesh.world_size == 1:
        if drop_collectives(gm) and offload_copies(gm):
            # a gradient's copy to the host read its reduce-scatter's wait, which sat late: it
            # now reads the gradient itself, and goes right after it (CPU offload)
            stream_offload_copies()(gm, None)
            gm.recompile()
    else:
        gather_casts_in_place(gm, mesh.shard_index)
        free_sent_and_received(gm)
    if in_place:
        from ._liveness import memory_timeline

        gradients_in_place(gm, memory_timeline)
