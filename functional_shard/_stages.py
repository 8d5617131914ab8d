"""Pipeline stages cut from one trace of `loss_fn`: the user writes one function, not one per stage.

`loss_fn(params, micro_batch)` is traced once per micro-batch signature with fake tensors
(`make_fx`, no real computation, under torch.export's graph semantics), as a function of the
flat parameter leaves and the flat batch leaves. Every node of the graph then gets a stage:

- a parameter placeholder: the stage of its unit (units are contiguous runs assigned to stages
  by `assign_stages`);
- a node reading a parameter-derived value: the latest stage among its inputs (so the residual
  stream flows forward and no value ever flows back);
- a node that depends on the batch, module buffers and constants only (masks, position ids, the
  labels' count of tokens): *free* — recomputed by every stage that reads it, never sent;
- then a computation read only on later stages moves to the earliest of them where fewer bytes
  cross the boundaries (`_sink`: the parameter-free start of the next stage's first block, such
  as a Llama RMSNorm's square, mean and rsqrt, instead of sending its result beside the residual).

A value made on stage a and read on stage c > a crosses every boundary between them (relayed by
the stages in between): the boundary `s -> s+1` carries, in graph order, every value made at or
before `s` and read after it. A value made of parameters alone (a tied embedding's weight read by
the head, its transpose) is the same on every micro-batch: it is *lent* (`Boundary.lent`), sent
once per step and its cotangents' sum returned once (`_pipe_run`).

Stage `s`'s program is a `torch.fx.GraphModule` `(params, received, batch, local) -> sent` (the
last stage's `sent` is what the loss returns: `(objective, loss, weight)`), built by copying the
nodes of its stage and the free nodes it needs. Running the stages one after another gives the
traced `loss_fn`'s values; each is differentiated on its own (`fs`'s pipeline executor).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from . import _tracing
from ._losses import StepError, WeightedLoss, check_loss, split_loss
from ._pytree import tree_flatten, tree_unflatten

__all__ = ["Boundary", "StageProgram", "Cut", "boundary_bytes", "cut_stages", "cut_traced", "unit_of_nodes"]

_FREE = -1  # the stage of a value every stage may recompute (from the batch, buffers, constants)


class Boundary(NamedTuple):
    """One value crossing a stage boundary."""

    name: str  # the traced node's name (for messages and the plan)
    shape: tuple[int, ...]
    dtype: torch.dtype
    differentiable: bool  # floating and derived from a parameter: its cotangent flows back
    lent: bool = False  # made of parameters alone: crosses once per step (`Cut.relaying()`: per micro-batch)


class StageProgram(NamedTuple):
    """What one stage computes, as a graph of its own."""

    index: int  # the global stage index
    module: fx.GraphModule  # module(params, received, batch, local) -> list of sent values
    params: tuple[int, ...]  # full-tree leaf indices of the parameters it takes, in its input order
    received: tuple[Boundary, ...]  # values from stage index - 1, in order (none on stage 0)
    sent: tuple[Boundary, ...]  # values to stage index + 1, in order (the last stage: its loss outputs)
    batch: tuple[int, ...]  # batch leaf indices it reads
    local: tuple[int, ...]  # full-tree leaf indices of module buffers it reads
    call: Any = None  # `module`'s torch.compile'd form (a step with compile=True), or None: run `module`
    remat: Any = None  # the `StageRemat` whose `run` is `call` (a step with a remat policy), or None


class Cut(NamedTuple):
    """A traced `loss_fn` cut into stages."""

    stages: tuple[StageProgram, ...]
    weighted: bool  # loss_fn returns an fs.WeightedLoss: the last stage sends (objective, loss, weight)
    summed: bool  # WeightedLoss(summed=True): the objective is the loss itself
    loss_dtype: torch.dtype
    random_stages: tuple[int, ...] = ()  # the stage of each random operation, in the order loss_fn draws
    aux: Any = None  # has_aux: the tree of aux's tensors, which follow the loss values in the last stage's outputs

    def bytes_between(self, stage: int) -> int:
        """Bytes stage `stage` sends to the next one per micro-batch (its activations; what is
        lent crosses once per step: `lent_between`)."""
        return sum(boundary_bytes(b) for b in self.stages[stage].sent if not b.lent)

    def lent_between(self, stage: int) -> int:
        """Bytes stage `stage` sends to the next one once per step (values made of parameters alone)."""
        return sum(boundary_bytes(b) for b in self.stages[stage].sent if b.lent)

    def relaying(self) -> "Cut":
        """The same cut with every value sent per micro-batch (nothing lent): a layout-invariant
        step's canonical sums take each micro-batch's gradients whole."""
        plain = lambda bs: tuple(b._replace(lent=False) for b in bs)  # noqa: E731
        return self._replace(stages=tuple(p._replace(received=plain(p.received), sent=plain(p.sent)) for p in self.stages))

    def describe(self) -> str:
        lines = []
        for p in self.stages:
            sent = ", ".join(f"{b.name}{list(b.shape)}:{str(b.dtype).removeprefix('torch.')}{' (once per step)' if b.lent else ''}"
                             for b in p.sent)  # fmt: skip
            lines.append(f"stage {p.index}: {len(p.module.graph.nodes)} nodes, {len(p.params)} parameter leaves -> {sent}")
        return "\n".join(lines)


def boundary_bytes(b: Boundary) -> int:
    """Bytes of one crossing value."""
    return _numel(b.shape) * b.dtype.itemsize


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _loss_outputs(out: Any, has_aux: bool, mesh) -> tuple[list[torch.Tensor], bool, bool]:
    """(objective, loss, weight) from what loss_fn returned, as `_reference._objective` computes them."""
    loss, _ = split_loss(out, has_aux, mesh)
    if isinstance(loss, WeightedLoss):
        value, weight, summed = loss
        weight = torch.as_tensor(weight, dtype=torch.float32)
        check_loss(value, has_aux, mesh, out)
        if summed:
            w = weight.to(value.dtype)
            return [value, torch.where(w > 0, value / w, torch.zeros_like(value)), weight], True, True
        return [value * weight.to(value.dtype), value, weight], True, False
    check_loss(loss, has_aux, mesh, out)
    return [loss, loss], False, False


def cut_stages(
    loss_fn: Callable[..., Any],
    treedef: Any,
    param_leaves: Sequence[torch.Tensor],
    stage_of_leaf: Sequence[int | None],
    micro_batch: Any,
    num_stages: int,
    mesh: Any,
    has_aux: bool = False,
) -> Cut:
    """Trace `loss_fn(params, micro_batch)` with fake tensors and cut it into `num_stages` programs.

    Arguments:
        loss_fn: the step's loss function (a plain loss or an `fs.WeightedLoss`; no aux).
        treedef: the structure of the parameter tree loss_fn receives.
        param_leaves: every leaf of that tree in flatten order (any device, meta included: only
            shapes, dtypes and devices are read).
        stage_of_leaf: per leaf, its stage, or None for a module buffer (every stage holds them).
        micro_batch: one micro-batch (its tensors' shapes and dtypes are read).
        num_stages: the stages of the pipeline (0: return the traced graph, uncut; `cut_traced`
            cuts it, as often as wanted).
        mesh: the step's mesh (for `split_loss` messages).
        has_aux: loss_fn returns `(loss, aux)`: aux's tensors (detached) follow the loss values
            among the last stage's outputs (`Cut.aux`: their tree).
    """
    batch_leaves, batch_def = tree_flatten(micro_batch)
    if any(not isinstance(b, torch.Tensor) for b in batch_leaves):
        raise StepError("a pipelined step's batch must hold tensors only (put static values in loss_fn)")
    info: dict[str, Any] = {}

    def flat(params, batch):
        with _tracing.graph_semantics(), _tracing.adjoint_ops():
            out = loss_fn(tree_unflatten(treedef, list(params)), tree_unflatten(batch_def, list(batch)))
        values, weighted, summed = _loss_outputs(out, has_aux, mesh)
        aux = None
        if has_aux:
            leaves, aux = tree_flatten(split_loss(out, has_aux, mesh)[1])
            bad = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor)]
            if bad:
                raise StepError(f"a pipelined loss_fn's aux must hold tensors only (they travel to every pipeline rank); it holds {bad}")
            values = values + [x.detach() for x in leaves]
        info.update(weighted=weighted, summed=summed, dtype=values[0].dtype, aux=aux)
        return values

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        device = torch.device("cpu") if t.device.type == "meta" else t.device
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)

    with mode:
        fp = [fake(t) for t in param_leaves]
        for t, s in zip(fp, stage_of_leaf):  # autograd records above the trace: see _custom_functions
            if s is not None and t.dtype.is_floating_point:
                t.requires_grad_(True)
        fb = [fake(t) for t in batch_leaves]
        outputs: list = []
        gm = make_fx(lambda p, b: _keep(flat(p, b), outputs), tracing_mode="real")(fp, fb)
    custom = _custom_functions(outputs)
    if custom:
        raise StepError(
            f"loss_fn uses the autograd.Function(s) {', '.join(custom)}: a pipeline stage is a graph of aten "
            f"operations differentiated by their own formulas, which would silently replace a custom backward "
            f"(tensor-parallel collectives, straight-through estimators, ...). Pipelining does not compose with "
            f"them yet (docs/pipelining.md): run without pp, or write the operation from differentiable torch ops"
        )
    gm.meta["fs_loss"] = info
    if num_stages == 0:  # the trace alone (`unit_of_nodes`, `cut_traced`)
        return gm
    return cut_traced(gm, len(param_leaves), stage_of_leaf, num_stages)


def cut_traced(gm: fx.GraphModule, num_params: int, stage_of_leaf: Sequence[int | None], num_stages: int) -> Cut:
    """The trace `cut_stages(..., num_stages=0)` returned, cut into `num_stages` programs (no new
    trace: the programs' nodes are copies of `gm`'s, their `meta` shared)."""
    return _cut(gm, num_params, stage_of_leaf, num_stages, gm.meta["fs_loss"])


def unit_of_nodes(gm: fx.GraphModule, num_params: int, position_of_leaf: Sequence[int | None]) -> dict[fx.Node, int]:
    """Each computing node of a traced `loss_fn` (`cut_stages(..., num_stages=0)`) -> the position of
    the latest unit it reads (the units in order of use), -1 for nodes of the batch alone: the
    stage rule of `_cut` at the granularity of units, what a cost-balanced cut weighs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position: dict[fx.Node, int] = {}
    for k, n in enumerate(placeholders):
        p = position_of_leaf[k] if k < num_params else None
        position[n] = _FREE if p is None else p
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        position[n] = max((position.get(i, _FREE) for i in n.all_input_nodes), default=_FREE)
    return {n: p for n, p in position.items() if n.op == "call_function"}


def _keep(values: list, into: list) -> list:
    into.extend(values)
    return values


def _custom_functions(outputs: list) -> list[str]:
    """Names of the user-defined autograd.Functions in the autograd graph behind `outputs`."""
    seen, found, stack = set(), [], [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        forward_cls = getattr(node, "_forward_cls", None)
        carried = forward_cls is not None and forward_cls.__module__.startswith("torch._library")  # a custom op's own
        if isinstance(node, torch.autograd.function.BackwardCFunction) and not carried:
            name = type(node).__name__.removesuffix("Backward")
            if name not in found:
                found.append(name)
        stack.extend(n for n, _ in node.next_functions)
    return found


def _cut(gm: fx.GraphModule, num_params: int, stage_of_leaf, num_stages: int, info) -> Cut:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params, batch = placeholders[:num_params], placeholders[num_params:]
    stage: dict[fx.Node, int] = {}
    param_index = {n: i for i, n in enumerate(params)}
    batch_index = {n: i for i, n in enumerate(batch)}
    derived: set[fx.Node] = set()  # depends on a trainable value (differentiable if floating)
    param_only: set[fx.Node] = set()  # made of parameters alone (no batch, no randomness): lent, not relayed
    for n in params:
        s = stage_of_leaf[param_index[n]]
        stage[n] = _FREE if s is None else s
        if s is not None:
            derived.add(n)
            param_only.add(n)
    for n in batch:
        stage[n] = _FREE
    output = None
    for n in graph.nodes:
        if n.op in ("placeholder",):
            continue
        if n.op == "output":
            output = n
            continue
        if n.op == "get_attr":
            stage[n] = _FREE
            continue
        inputs = n.all_input_nodes
        stage[n] = max((stage[i] for i in inputs), default=_FREE)
        if any(i in derived for i in inputs):
            derived.add(n)
        if (n.op == "call_function" and inputs and all(i in param_only or i.op == "get_attr" for i in inputs)
                and any(i in param_only for i in inputs) and _deterministic(n)):  # fmt: skip
            param_only.add(n)
        if stage[n] == _FREE and not _deterministic(n):
            raise StepError(
                f"loss_fn draws random numbers ({n.target}) from the batch alone, before any parameter is used: a "
                f"pipeline recomputes such values on every stage that reads them, which would draw different numbers. "
                f"Draw them from a value that depends on the parameters, or outside loss_fn (in the batch)"
            )
    assert output is not None
    outs = list(output.args[0])
    last = num_stages - 1
    _sink(graph, stage, last, set(params))
    # Where each value is read: the latest stage of a consumer (the output is read by the last stage).
    read_last: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op == "output":
            for v in outs:
                read_last[v] = last
            continue
        for i in n.all_input_nodes:
            if stage.get(n, _FREE) != _FREE:
                read_last[i] = max(read_last.get(i, _FREE), stage[n])
    order = {n: k for k, n in enumerate(graph.nodes)}

    def value(n: fx.Node) -> Boundary:
        meta = n.meta.get("val")
        if not isinstance(meta, torch.Tensor):
            raise StepError(
                f"the value {n.name} ({n.target}) crosses a pipeline stage boundary but is not a tensor ({type(meta).__name__}); "
                "cut the stages elsewhere (stages=...)"
            )
        return Boundary(n.name, tuple(meta.shape), meta.dtype, n in derived and meta.dtype.is_floating_point, n in param_only)

    boundaries = []  # boundaries[s]: the values stage s sends to s + 1
    for s in range(last):
        crossing = sorted((n for n, r in read_last.items() if stage[n] != _FREE and stage[n] <= s < r), key=order.get)
        boundaries.append(crossing)
    programs = []
    for s in range(num_stages):
        received = boundaries[s - 1] if s > 0 else []
        sent_nodes = boundaries[s] if s < last else outs
        programs.append(_program(graph, s, stage, received, sent_nodes, params, batch, param_index, batch_index, stage_of_leaf, gm, value))
    if any(stage[v] == _FREE for v in outs) and all(stage[v] == _FREE for v in outs[:1]):
        raise StepError(
            "loss_fn's loss depends on no trainable parameter: the pipeline would train nothing. Compute it from the "
            "params argument (apply_fn(params, x))"
        )
    random = tuple(stage[n] for n in graph.nodes if n.op == "call_function" and not _deterministic(n))
    return Cut(tuple(programs), info["weighted"], info["summed"], info["dtype"], random, info.get("aux"))


def _deterministic(n: fx.Node) -> bool:
    return not (isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags)


def _bytes(n: fx.Node) -> int | None:
    """Bytes of a node's tensor value (None: not a tensor)."""
    meta = n.meta.get("val")
    return _numel(meta.shape) * meta.dtype.itemsize if isinstance(meta, torch.Tensor) else None


def _movable(n: fx.Node, params: set) -> bool:
    """A pure aten computation on tensors that reads no parameter directly: computing it on a later
    stage changes where it runs, not what it computes."""
    target = n.target
    if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if target._schema.is_mutable or not _deterministic(n) or _bytes(n) is None:
        return False
    return not any(i in params or _bytes(i) is None for i in n.all_input_nodes)


def _sink(graph: fx.Graph, stage: dict, last: int, params: set, depth: int = 12) -> None:
    """Move computations forward to the stage that reads them where that sends fewer bytes.

    The first rule gives a node the latest stage among its inputs, so a computation on the
    residual stream alone that the *next* stage's block starts with (a Llama block's RMSNorm up
    to its weight: square, mean, rsqrt, product) lands on the earlier stage, and the boundary
    carries its result beside the residual it was computed from: two activations where torch's
    stage modules send one. Walking the graph backwards, a node every reader of which is on a
    later stage moves to the earliest of those stages, with those of its ancestors read by
    nothing else (up to `depth` deep), when the bytes that then cross the boundaries (inputs
    not already read on that stage) are fewer than the node's own. Where a value is computed
    never changes what it is: every stage runs the same kernels on the same values."""

    def readers(n: fx.Node) -> list:
        """n's users whose values are used (a `detach` the trace left unused reads nothing)."""
        return [u for u in n.users if u.op == "output" or u.users]

    def reach(n: fx.Node, moving: set) -> tuple[int, bool]:
        """(the latest stage reading n outside `moving`, whether any reader outside it exists)."""
        others = [u for u in readers(n) if u not in moving]
        return max((last if u.op == "output" else stage.get(u, _FREE) for u in others), default=_FREE), bool(others)

    def arrive(n: fx.Node, target: int, moving: set, budget: int) -> tuple[int, list]:
        """(bytes crossing boundaries, nodes to move) for n's value to be read on stage `target`:
        n sent from its stage, or n moved too and its inputs brought there."""
        s = stage.get(n, _FREE)
        if s == _FREE or s >= target:
            return 0, []
        latest, others = reach(n, moving)
        if latest >= target:
            return 0, []
        stay = _bytes(n) * (target - max(s, latest))
        if others or budget == 0 or not _movable(n, params):
            return stay, []
        total, moved = bring(n, target, moving, budget - 1)
        return (total, [n, *moved]) if total < stay else (stay, [])

    def bring(n: fx.Node, target: int, moving: set, budget: int) -> tuple[int, list]:
        """(bytes crossing boundaries, ancestors to move along) for n's inputs to be read on `target`."""
        total, moved = 0, []
        for i in n.all_input_nodes:
            cost, more = arrive(i, target, moving | {n, *moved}, budget)
            total += cost
            moved += more
        return total, moved

    for n in reversed(list(graph.nodes)):
        s = stage.get(n, _FREE)
        if s == _FREE or n.op != "call_function" or not readers(n) or not _movable(n, params):
            continue
        target = min(last if u.op == "output" else stage.get(u, _FREE) for u in readers(n))
        if target <= s:
            continue
        total, moved = bring(n, target, set(), depth)
        if total < _bytes(n) * (target - s):
            for m in (n, *moved):
                stage[m] = target
                for unused in set(m.users) - set(readers(m)):  # computed with its input, wherever that is
                    stage[unused] = max(stage.get(unused, _FREE), target)


def _program(graph, s, stage, received, sent_nodes, params, batch, param_index, batch_index, stage_of_leaf, gm, value) -> StageProgram:
    """Stage `s`'s graph: its nodes and the free nodes they read, from `received` to `sent_nodes`."""
    needed: set[fx.Node] = set()
    received_set = set(received)
    stack = list(sent_nodes)
    while stack:  # every node between the received values (and placeholders) and what is sent
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n in received_set or n.op == "placeholder":
            continue
        stack.extend(n.all_input_nodes)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    p_in = new.placeholder("params")
    r_in = new.placeholder("received")
    b_in = new.placeholder("batch")
    l_in = new.placeholder("local")
    own_params = [n for n in params if n in needed and n not in received_set and stage_of_leaf[param_index[n]] is not None]
    local = [n for n in params if n in needed and stage_of_leaf[param_index[n]] is None]
    reads = [n for n in batch if n in needed]
    for k, n in enumerate(own_params):
        env[n] = new.call_function(operator.getitem, (p_in, k))
    for k, n in enumerate(received):
        env[n] = new.call_function(operator.getitem, (r_in, k))
    for k, n in enumerate(reads):
        env[n] = new.call_function(operator.getitem, (b_in, k))
    for k, n in enumerate(local):
        env[n] = new.call_function(operator.getitem, (l_in, k))
    for n in (*own_params, *received, *reads, *local):  # what the input stands for (the analysis reads shapes)
        env[n].meta["val"] = n.meta.get("val")
    for n in graph.nodes:
        if n in needed and n not in env and n.op not in ("placeholder", "output"):
            env[n] = new.node_copy(n, lambda x: env[x])
    new.output([env[n] for n in sent_nodes])
    module = fx.GraphModule(gm, new)
    sent = tuple(value(n) for n in sent_nodes)
    return StageProgram(
        s,
        module,
        tuple(param_index[n] for n in own_params),
        tuple(value(n) for n in received),
        sent,
        tuple(batch_index[n] for n in reads),
        tuple(param_index[n] for n in local),
    )
