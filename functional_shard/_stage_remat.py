"""Rematerialization inside a pipeline stage, unit by unit, under a `RematPolicy`.

A pipeline stage is a graph of aten operations run eagerly under autograd (`_stages`); its
backward is autograd's. `StageRemat.run` runs the stage's graph node by node with
saved-tensor hooks: a tensor autograd saves that is the output of a *recomputable* node of a
chosen unit is not kept — its handle names the node — and the first read of such a handle in
the backward recomputes the unit's recomputable nodes (under `no_grad`, from the values the unit
keeps), as `torch.utils.checkpoint` does for a block, and as the non-pipelined step's graph pass
(`fs.schedule.rematerialize`) decides it:

- recomputable: a pure aten call of a chosen unit (not random, not a collective, writing
  nothing, its storages written by nothing after it), read by no other unit and not returned;
- kept: everything else — the unit's inputs (the residual stream), the outputs of the ops the
  policy saves (`RematPolicy.save`, `every_other_mm` per unit), random ops' outputs (the same
  dropout masks, no RNG replay), collectives' outputs — and the values a recomputation reads.

The same ops run on the same inputs, so the backward reads the forward's values: the bits of the
stage without rematerialization. A recomputed value is dropped once every handle of it has been
read (a zero-bubble stage's W, which reads some again after its I, recomputes them again).
Saved-tensor hooks already in force when the stage runs (a memory measurement's, a user's) see
every tensor that is kept, and the values kept for recomputation: they compose.

The loss's unit is never recomputed (its backward follows its forward at once), as in the
non-pipelined step.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .schedule._graph import WAIT_OP, positions
from .schedule._remat import RematPolicy, _kept_by_policy, _recomputable, _storages, rematerialize

__all__ = ["StageRemat"]

_FREE = -1


class StageRemat:
    """A stage program's forward with its chosen units rematerialized (`run`, the program's
    `call`). `leaf_units`: per parameter the program takes, its unit's position; `names`: the
    units' names by position; `last`: whether this is the last stage (its last unit computes the
    loss)."""

    def __init__(self, module: fx.GraphModule, leaf_units: Sequence[int | None], names: Sequence[str],
                 policy: RematPolicy, last: bool):  # fmt: skip
        self.module, self.policy, self.names = module, policy, tuple(names)
        graph = module.graph
        nodes = list(graph.nodes)
        params = next(n for n in nodes if n.op == "placeholder")  # (params, received, batch, local)
        unit: dict[fx.Node, int] = {}
        for n in nodes:
            if n.op == "call_function" and n.target is operator.getitem and n.args[0] is params:
                unit[n] = _FREE if leaf_units[n.args[1]] is None else leaf_units[n.args[1]]
            elif n.op in ("call_function", "call_method", "call_module"):
                unit[n] = max((unit.get(i, _FREE) for i in n.all_input_nodes), default=_FREE)
        output = next(n for n in nodes if n.op == "output")
        loss_unit = max((unit.get(i, _FREE) for i in output.all_input_nodes), default=_FREE) if last else None
        choose = rematerialize(policy.units)
        chosen = {u for u in set(unit.values()) if u != _FREE and u != loss_unit and choose.chooses(names[u])}
        position = positions(module)
        root, last_write = _storages(module, position)
        kept = _kept_by_policy(module, unit, chosen, policy)
        recompute: list[fx.Node] = []
        for n in nodes:
            if unit.get(n) not in chosen or n in kept or not _recomputable(n, root, last_write, position):
                continue
            if n.op != "call_function" or n.target is WAIT_OP or getattr(n.target, "namespace", "") == "_c10d_functional":
                continue  # a collective's output is kept: recomputing it would be a collective in the backward
            if any(u.op == "output" or unit.get(u) != unit[n] for u in n.users):
                continue
            recompute.append(n)
        self.recomputed = frozenset(recompute)
        # per unit, its recomputed nodes in graph order; the values they read from outside
        self._by_unit: dict[int, list[fx.Node]] = {}
        for n in recompute:
            self._by_unit.setdefault(unit[n], []).append(n)
        self._unit = {n: unit[n] for n in recompute}
        # per unit, after each of its recomputed nodes, the recomputed values no later one reads
        self._dead: dict[fx.Node, list[fx.Node]] = {}
        for nodes_of_unit in self._by_unit.values():
            last_read = {n: n for n in nodes_of_unit}
            for n in nodes_of_unit:
                for i in n.all_input_nodes:
                    if i in last_read:
                        last_read[i] = n
            for value, reader in last_read.items():
                self._dead.setdefault(reader, []).append(value)
        # per unit, the values its recomputation reads from outside it (what a forward keeps for it)
        self._sources_of: dict[int, frozenset] = {
            u: frozenset(i for n in ns for i in n.all_input_nodes if i not in self.recomputed) for u, ns in self._by_unit.items()
        }  # fmt: skip
        self.sources = frozenset().union(*self._sources_of.values())
        self.releasing = False  # inside `full_backward`
        # when each value of the forward is last read (freed after that node)
        last_use: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            for i in n.all_input_nodes:
                last_use[i] = n
        self._frees: dict[fx.Node, list[fx.Node]] = {}
        for value, reader in last_use.items():
            self._frees.setdefault(reader, []).append(value)
        self._nodes = nodes

    @contextlib.contextmanager
    def full_backward(self):
        """Around a full backward (B) of this stage: each unit is recomputed once, so the values
        its recomputation read go with it (autograd frees its own references node by node). I
        and W keep them: W recomputes its units again."""
        self.releasing = True
        try:
            yield
        finally:
            self.releasing = False

    def describe(self) -> dict[str, int]:
        """How many nodes are recomputed, per unit name."""
        return {self.names[u]: len(ns) for u, ns in self._by_unit.items()}

    def run(self, params: list, received: list, batch: list, local: list) -> list:
        """The program's outputs, its chosen units' recomputable values left to the backward."""
        if not self.recomputed:  # no chosen unit here: the program as it is
            return self.module(params, received, batch, local)
        inst = _Instance(self, torch._C._autograd._top_saved_tensors_default_hooks(False))
        pending: list[_Handle] = []

        def pack(t: Any):
            h = _Handle(t)
            pending.append(h)
            return h

        args = iter((params, received, batch, local))
        env: dict[fx.Node, Any] = {}
        with torch.autograd.graph.saved_tensors_hooks(pack, inst.unpack):
            for n in self._nodes:
                if n.op == "placeholder":
                    env[n] = next(args)
                    if n in self.sources:
                        inst.keep_source(n, env[n])
                    continue
                if n.op == "output":
                    out = fx.graph.map_arg(n.args[0], env.__getitem__)
                    break
                value = _call(self.module, n, env)
                env[n] = value
                if n in self.recomputed:
                    inst.register(n, value)
                if pending:
                    inst.resolve(pending)
                    pending.clear()
                if n in self.sources:
                    inst.keep_source(n, value)
                for dead in self._frees.get(n, ()):
                    env.pop(dead, None)
        inst.forward_done()
        return out


def _call(module: fx.GraphModule, n: fx.Node, env: dict) -> Any:
    args = fx.graph.map_arg(n.args, env.__getitem__)
    kwargs = fx.graph.map_arg(n.kwargs, env.__getitem__)
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "get_attr":
        target: Any = module
        for part in str(n.target).split("."):
            target = getattr(target, part)
        return target
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return module.get_submodule(str(n.target))(*args, **kwargs)


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    return value


class _Handle:
    """What autograd holds for one saved tensor: the tensor (kept: through the outer hooks' pack
    when there are any), or the recomputed node and output index it is read from."""

    __slots__ = ("packed", "node", "index")

    def __init__(self, tensor: Any):
        self.packed, self.node, self.index = tensor, None, None


class _Instance:
    """One forward of a stage under `StageRemat`: what its backward recomputes from.

    A unit is recomputed at its first read; each recomputed value is dropped once each of its
    handles has been read. Autograd reads every saved tensor of a node it runs, so a zero-bubble
    W, which runs the weight side's nodes after I ran them, reads some handles a second time:
    their unit is recomputed again, and that later copy is kept until another unit's later
    recomputation replaces it (one unit's values at a time) or the graph goes."""

    def __init__(self, remat: StageRemat, outer: tuple[Callable, Callable] | None):
        self.remat, self.outer = remat, outer
        self.made: dict[int, list] = {}  # storage -> (weak ref, view, node, output index) of recomputable outputs
        self.sources: dict[fx.Node, Any] = {}  # values the recomputations read (detached; outer-packed)
        self.handles: dict[fx.Node, list[_Handle]] = {}  # node -> the handles that read it
        self.cache: dict[fx.Node, Any] = {}  # recomputed values some handle has not read yet
        self.unread: dict[fx.Node, set[int]] = {}  # node -> ids of its handles not read since it was recomputed
        self.recomputed: set[int] = set()  # units recomputed at least once
        self.readers: dict[fx.Node, set[int]] = {}  # source -> the units whose recomputation still reads it
        self.late: int | None = None  # the unit whose later recomputation is cached

    def register(self, n: fx.Node, value: Any) -> None:
        items = enumerate(value) if isinstance(value, (tuple, list)) else [(None, value)]
        for k, t in items:
            if isinstance(t, torch.Tensor) and not t.is_sparse:
                ref = StorageWeakRef(t.untyped_storage())
                self.made.setdefault(ref.cdata, []).append((ref, _view_key(t), n, k))

    def _match(self, t: torch.Tensor) -> tuple[fx.Node, int | None] | None:
        made = self.made.get(t.untyped_storage()._cdata)
        if made is None:
            return None
        key = _view_key(t)
        for held, view, n, k in made:
            if not held.expired() and view == key:
                return n, k
        return None

    def resolve(self, pending: list[_Handle]) -> None:
        """The handles packed while the last node ran: dropped to a node's name where they hold
        one of a recomputable node's outputs, else kept (through the outer pack)."""
        for h in pending:
            t = h.packed
            found = self._match(t) if isinstance(t, torch.Tensor) else None
            if found is None:
                h.packed = self.outer[0](t) if self.outer is not None else _detached(t)
            else:
                h.packed = None
                h.node, h.index = found
                self.handles.setdefault(h.node, []).append(h)

    def keep_source(self, n: fx.Node, value: Any) -> None:
        packed = self.outer is not None and isinstance(value, torch.Tensor)
        self.sources[n] = (packed, self.outer[0](value) if packed else _detached(value))

    def forward_done(self) -> None:
        self.made.clear()  # no more packs: nothing to match
        units = {self.remat._unit[n] for n in self.handles}
        needed = frozenset().union(*(self.remat._sources_of[u] for u in units))
        self.sources = {n: v for n, v in self.sources.items() if n in needed}  # what no recomputation reads goes
        self.readers = {n: {u for u in units if n in self.remat._sources_of[u]} for n in self.sources}

    def _source(self, n: fx.Node) -> Any:
        packed, value = self.sources[n]
        return self.outer[1](value) if packed else value

    def unpack(self, h: _Handle) -> Any:
        if h.node is None:
            return self.outer[1](h.packed) if self.outer is not None else h.packed
        n = h.node
        if n not in self.cache:
            u = self.remat._unit[n]
            if u in self.recomputed:  # a later read (a W): one unit's later copy at a time
                if self.late is not None and self.late != u:
                    for m in self.remat._by_unit[self.late]:
                        self.cache.pop(m, None)
                        self.unread.pop(m, None)
                self.late = u
            first = u not in self.recomputed
            self.recomputed.add(u)
            self._recompute(u)
            if first and self.remat.releasing:  # a B: no later recomputation of u reads its sources
                for m in self.remat._sources_of[u]:
                    readers = self.readers.get(m)
                    if readers is not None:
                        readers.discard(u)
                        if not readers:
                            del self.sources[m], self.readers[m]
        value = self.cache[n]
        unread = self.unread[n]
        unread.discard(id(h))
        if not unread:
            del self.cache[n], self.unread[n]
        return value if h.index is None else value[h.index]

    def _recompute(self, u: int) -> None:
        """Unit `u`'s recomputable nodes again, from the kept values; those some handle reads are
        cached until each of their handles has read them."""
        env: dict[fx.Node, Any] = {}
        get = lambda i: env[i] if i in env else self._source(i)  # noqa: E731
        dead = self.remat._dead
        with torch.no_grad():
            for n in self.remat._by_unit[u]:
                env[n] = n.target(*fx.graph.map_arg(n.args, get), **fx.graph.map_arg(n.kwargs, get))
                if n in self.handles and n not in self.cache:
                    self.cache[n] = env[n]
                    self.unread[n] = {id(h) for h in self.handles[n]}
                for gone in dead.get(n, ()):  # as the forward did: a value goes after its last reader
                    del env[gone]


def _view_key(t: torch.Tensor) -> tuple:
    return (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
