"""Rematerialization (activation checkpointing) as a pass over the traced step.

`torch.utils.checkpoint` cannot run under `torch.func`'s transforms (which the step runs
`loss_fn` under), so the step recomputes on its graph instead: for each chosen unit, the
forward nodes whose values the backward reads are copied, and the copies — computed from the
values the unit keeps — are inserted right before the unit's first backward read, which now
reads them. The originals then die during the forward, as a checkpointed block's activations
do: what stays alive from forward to backward is each unit's inputs (the residual stream
between blocks), the values that cannot be recomputed, and the parameters' shards.

The same ops run on the same inputs, so every value, and the step's result, keeps its bits.
Never recomputed (their outputs are kept): random ops (`bernoulli`, `native_dropout`,
`rand*`: recomputing would draw new masks), ops that write their inputs and nodes whose
storage is written after them, collectives, and views of the gathered parameters (the
recomputed nodes read those, so `reshard_after_forward`, run after this pass, redirects them
to the backward's own all-gather like any other backward read).

With micro-batches the graph runs forward 0, backward 0, forward 1, ... (one marked forward end
per micro-batch): each micro-batch's units are recomputed in that micro-batch's backward.

Which forward node belongs to which unit is `_remat_units`'s (with the hand-over of a unit's
parameter-free tail to the unit that reads it).

Selective rematerialization (`RematPolicy`): the outputs of the ops a policy names (matrix
products and attention, by default) are kept like a unit's input, and only the rest — the
cheap elementwise ops, norms, softmax — is recomputed, from those kept values. This is
torchtitan's "selective op" activation checkpointing and JAX's `dots_saveable`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import torch
from torch import fx

from ._context import Pass, PassContext
from ._remat_units import boundaries_to_readers, forward_nodes, gathered_parameters
from ._graph import (
    _FORWARD_END_KEY,
    WAIT_OP,
    _is_view,
    _schema,
    check_units_named,
    forward_end,
    positions,
    tag_of,
    unit_of_label,
)

# The `node.meta` key of a recomputed node: the unit whose forward it recomputes.
_RECOMPUTED_KEY = "fs_recomputed"

Units = bool | tuple[str, ...] | Callable[[str], bool]

# Op names `RematPolicy(save=...)` accepts for groups of ops: "sdpa" is every fused attention
# kernel (`_scaled_dot_product_flash_attention`, `..._efficient_attention`, `..._for_cpu`, ...).
SAVE_DOTS = ("mm", "addmm", "bmm", "baddbmm", "sdpa")


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """Selective rematerialization: which forward values of the rematerialized units are kept
    for the backward instead of recomputed (`fs.Schedule(remat=RematPolicy(...))`).

    A rematerialized unit keeps its input and, under a policy, the outputs of the ops `save`
    names; everything else its backward reads is recomputed right before its backward, from
    those kept values. The default keeps matrix products and attention, the expensive ops,
    and recomputes the cheap elementwise ones (norms, activations, softmax, rotary, casts):
    most of the memory of full rematerialization is saved for a few percent of the compute.

        fs.Schedule(remat=fs.schedule.RematPolicy())                     # save the dots
        fs.Schedule(remat=fs.schedule.RematPolicy(every_other_mm=True))  # torchtitan's "op" mode
        fs.Schedule(remat=fs.schedule.RematPolicy(save=()))              # = remat=True

    Equivalences: JAX's `checkpoint_policies.dots_saveable` is `RematPolicy(save=("mm", "addmm",
    "bmm", "baddbmm"))` (JAX has no fused attention op), `nothing_saveable` is `save=()` (the
    same as `remat=True`), `everything_saveable` is `remat=False`. torchtitan's selective op
    checkpointing (`_save_list`: `aten.mm`, the `_scaled_dot_product_*` attention kernels; every
    second `mm` of a block recomputed) is `RematPolicy(every_other_mm=True)`.

    Same bits as without remat: the same ops run on the same inputs.

    In a pipelined step (`sharded_step(..., pipeline=...)`) a policy rematerializes each chosen
    unit of a stage on its own, in the stage's backward (`functional_shard/_stage_remat.py`);
    `remat=True` there recomputes whole stages.

    Arguments:
        save: op names (aten overload packets, e.g. `"mm"`, `"addmm"`, `"bmm"`, `"_softmax"`;
            `"sdpa"` for every `_scaled_dot_product_*` attention kernel) whose outputs are kept.
            Default `SAVE_DOTS`: `mm`, `addmm`, `bmm`, `baddbmm`, `sdpa`.
        units: which units are rematerialized, as `Schedule(remat=...)` takes it: True (every
            unit), a tuple of unit names, or a function `unit -> bool`.
        every_other_mm: recompute every second linear layer's product of each unit (`mm`, or
            `addmm` for a layer with a bias; in forward order: the 2nd, 4th, ...) instead of
            keeping it, as torchtitan's selective op checkpointing does for `mm` (its Llama's
            linear layers have no bias); the other ops of `save` are kept. More compute, less
            memory.
    """

    save: tuple[str, ...] = SAVE_DOTS
    units: Units = True
    every_other_mm: bool = False

    def __post_init__(self) -> None:
        save = (self.save,) if isinstance(self.save, str) else self.save
        if not isinstance(save, (tuple, list, set, frozenset)) or not all(isinstance(n, str) for n in save):
            raise TypeError(f"RematPolicy.save must be a tuple of op names such as ('mm', 'sdpa'); got {self.save!r}")
        unknown = [n for n in save if n != "sdpa" and not hasattr(torch.ops.aten, n)]
        if unknown:
            raise ValueError(
                f"RematPolicy.save names ops aten does not have: {unknown}; use aten overload packet names "
                f"(e.g. 'mm', 'addmm', 'bmm', '_softmax') or 'sdpa' for the fused attention kernels"
            )
        object.__setattr__(self, "save", tuple(sorted(set(save), key=list(save).index)))
        object.__setattr__(self, "units", rematerialize(self.units).units)
        if not isinstance(self.every_other_mm, bool):
            raise TypeError(f"RematPolicy.every_other_mm must be a bool; got {self.every_other_mm!r}")

    def saves(self, node: fx.Node) -> bool:
        """Whether the policy names `node`'s op (before `every_other_mm`)."""
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if not name:
            return False
        return name in self.save or ("sdpa" in self.save and "scaled_dot_product" in name)


def remat_value(remat):
    """`Schedule.remat` checked and normalized: a `RematPolicy` as it is, else the units
    (`rematerialize(remat).units`: a list becomes a tuple)."""
    return remat if isinstance(remat, RematPolicy) else rematerialize(remat).units

# Ops that write arguments their schema does not mark as written: batch norm in training mode
# updates its running statistics (arguments 3 and 4) in place. Op -> indices of those arguments.
_UNDECLARED_WRITES = {
    op: (3, 4)
    for op in (
        getattr(getattr(torch.ops.aten, name, None), "default", None)
        for name in ("native_batch_norm", "batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm")
    )
    if op is not None
}


@dataclasses.dataclass(frozen=True)
class rematerialize(Pass):
    """Recompute the chosen units' forward values right before their backward reads them,
    instead of keeping them from forward to backward (activation checkpointing per unit).

    A forward node belongs to the unit whose gathered parameters it reads, or, reading none,
    to the unit of the latest parameter read it depends on (a block's nodes to that block;
    a final norm and head to the unit that holds them). A unit keeps the values it reads from
    outside (its input: the residual stream) and the values other units read from it; the rest
    of what its backward reads is recomputed, in one place, before the first such read.

    The unit whose forward computes the loss is not recomputed: the backward reads its values
    as soon as the forward ends, so recomputing them would cost compute and save nothing.

    With micro-batches (`sharded_step(..., microbatches=k)`) the graph runs forward 0,
    backward 0, forward 1, ...: each micro-batch's units (`<unit>@mb<i>`, as its gathers are
    labelled) are recomputed in that micro-batch's backward, so one micro-batch's activations
    are alive at a time, as without remat, and fewer of them.

    Arguments:
        units: True recomputes every unit, False none; a tuple of unit names (e.g.
            `("blocks.0", "blocks.1")`) those; a function `unit -> bool` the units it accepts
            (with micro-batches it is asked about the unit's name, `blocks.0`, not its label).

        policy: a `RematPolicy` whose `save` ops' outputs are kept rather than recomputed
            (None: nothing is kept but the units' inputs). A `RematPolicy` passed as `units`
            is taken apart into the two.

    Run it before `reshard_after_forward`: the recomputed nodes read the unit's gathered
    parameters in the backward, and that pass gives such reads the backward's own all-gather
    (run after it, they would keep the forward's gathered copy alive; the bits are the same).
    """

    units: Units = True
    policy: RematPolicy | None = None

    def __post_init__(self) -> None:
        units = self.units
        if isinstance(units, RematPolicy):
            if self.policy is not None:
                raise TypeError("rematerialize: give a RematPolicy as units or as policy, not both")
            object.__setattr__(self, "policy", units)
            units = units.units
        if isinstance(units, str):
            units = (units,)
        elif isinstance(units, (list, set, frozenset)):
            units = tuple(sorted(units)) if isinstance(units, (set, frozenset)) else tuple(units)
        if isinstance(units, tuple):
            if not all(isinstance(u, str) for u in units):
                raise TypeError(f"rematerialize.units must name units with strings; got {units!r}")
        elif not isinstance(units, bool) and not callable(units):
            raise TypeError(
                f"rematerialize.units must be a bool, a tuple of unit names or a function unit -> bool; got {units!r}"
            )
        object.__setattr__(self, "units", units)

    def chooses(self, unit: str) -> bool:
        """Whether `unit` is asked to be recomputed (the loss's unit never is, see above)."""
        if isinstance(self.units, bool):
            return self.units
        if isinstance(self.units, tuple):
            return unit in self.units
        return bool(self.units(unit))

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule:
        if self.units is False or self.units == ():
            return gm
        position = positions(gm)
        # Each micro-batch's loss ends its forward (one mark per micro-batch, graph order).
        ends = [node for node in gm.graph.nodes if node.meta.get(_FORWARD_END_KEY)] or [forward_end(gm)]
        parameters = gathered_parameters(gm, position, position[ends[-1]])
        known = list(dict.fromkeys(unit_of_label(u) for u in parameters.values()))
        if isinstance(self.units, tuple):
            check_units_named("rematerialize", self.units, known)
        microbatch_of, unit_of = forward_nodes(gm, parameters, position, ends)
        unit_of = boundaries_to_readers(gm, unit_of, microbatch_of, parameters)
        losses = {unit_of.get(end) for end in ends}
        chosen = {u for u in unit_of.values() if self.chooses(unit_of_label(u)) and u not in losses}
        kept = _kept_by_policy(gm, unit_of, chosen, self.policy)
        recomputed: dict[str, list[fx.Node]] = {}
        for node in _recomputed_nodes(gm, unit_of, microbatch_of, chosen, position):
            if node in kept:
                continue
            recomputed.setdefault(unit_of[node], []).append(node)
        for unit, nodes in recomputed.items():
            _recompute(gm, unit, nodes, position, position[ends[microbatch_of[nodes[0]]]])
        gm.graph.lint()
        return gm


def recomputed_units(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """unit -> its recomputed nodes (graph order), as `rematerialize` marked them."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        unit = node.meta.get(_RECOMPUTED_KEY)
        if unit is not None:
            out.setdefault(unit, []).append(node)
    return out


def _kept_by_policy(gm: fx.GraphModule, unit_of: dict, chosen: set, policy: RematPolicy | None) -> set[fx.Node]:
    """The chosen units' forward nodes whose outputs `policy` keeps (with `every_other_mm`,
    each unit's 2nd, 4th, ... `mm` or `addmm` in graph order is not kept)."""
    if policy is None:
        return set()
    kept: set[fx.Node] = set()
    mm_count: dict[str, int] = {}
    for node in gm.graph.nodes:
        unit = unit_of.get(node)
        if unit not in chosen or node.op != "call_function" or not policy.saves(node):
            continue
        if policy.every_other_mm and node.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            mm_count[unit] = mm_count.get(unit, 0) + 1
            if mm_count[unit] % 2 == 0:
                continue
        kept.add(node)
    return kept


# --- which nodes may be recomputed ----------------------------------------------------------------


def _arguments(node: fx.Node, schema) -> list[tuple[object, object]]:
    """(argument schema, value) pairs of a call, positional then keyword."""
    out = []
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            out.append((argument, node.args[i]))
        elif argument.name in node.kwargs:
            out.append((argument, node.kwargs[argument.name]))
    return out


def _nodes_in(value) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


def written_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes a call writes in place: its schema's written arguments (an `out=`, the
    self of `mul_`, each tensor of a `_foreach_*_` list) and `_UNDECLARED_WRITES`."""
    schema = _schema(node)
    if schema is None:
        return []
    written = [n for i in _UNDECLARED_WRITES.get(node.target, ()) for n in _nodes_in(node.args[i] if i < len(node.args) else None)]
    for argument, value in _arguments(node, schema):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _nodes_in(value)
    return written


def _storages(gm: fx.GraphModule, position: dict) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, int]]:
    """(node -> the node whose storage its output lives in, storage -> position of its last write)."""
    root: dict[fx.Node, fx.Node] = {}
    last_write: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        root[node] = node
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            root[node] = root[node.args[0]]
            continue
        schema = _schema(node)
        if schema is None:
            continue
        for n in written_inputs(node):
            last_write[root[n]] = position[node]
        returned = set().union(*(r.alias_info.before_set for r in schema.returns if r.alias_info is not None))
        for argument, value in _arguments(node, schema):
            info = argument.alias_info
            if info is None:
                continue
            for n in _nodes_in(value):
                if info.before_set & returned and root[node] is node:
                    root[node] = root[n]
    return root, last_write


def _is_random(node: fx.Node) -> bool:
    """An op that draws random numbers: tagged so by torch, unless its only randomness is a
    dropout whose probability is 0 (the fused attention kernels with `dropout_p=0.0` are
    deterministic: recomputing one gives its bits)."""
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    schema = _schema(node)
    given = {argument.name: value for argument, value in _arguments(node, schema)} if schema is not None else {}
    declared = {a.name: a for a in schema.arguments} if schema is not None else {}
    if "dropout_p" not in declared:
        return True
    dropout = given.get("dropout_p", declared["dropout_p"].default_value)
    return not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout == 0)


def _recomputable(node: fx.Node, root: dict, last_write: dict, position: dict) -> bool:
    """A pure call whose inputs and output hold, in the backward, what they held when it ran."""
    if node.op != "call_function":
        return False
    if node.target is not operator.getitem:
        schema = _schema(node)
        if schema is None or schema.is_mutable or node.target in _UNDECLARED_WRITES or _is_random(node):
            return False
        if (node.target is WAIT_OP or node.target.namespace == "_c10d_functional") and not _activation_collective(node):
            return False
    # A storage written after the node ran (anywhere in the graph) may not hold, when the copy
    # runs, what the node read or made: keep the node rather than prove when the write happens.
    return all(last_write.get(root[n], -1) < position[node] for n in (node, *node.all_input_nodes))


def _activation_collective(node: fx.Node) -> bool:
    """A model-parallel collective of activations (tensor parallelism's all-gathers, all-reduces
    and reduce-scatters over `tp`), or the wait of one: it moves no parameter buffer, so its copy
    in the backward is one more collective of the same values on the same group, the same bits
    (every rank's graph gains it at the same place). A parameter's all-gather (FSDP) is not
    copied: the backward gathers its own (`reshard_after_forward`)."""
    issue = node.args[0] if node.target is WAIT_OP and node.args and isinstance(node.args[0], fx.Node) else node
    tag = tag_of(issue)
    return tag is not None and not tag.buffer and tag.phase != "update"


def _read_by_output(node: fx.Node) -> bool:
    """The step returns it (directly or through detach/alias): it is alive to the end anyway."""
    passthrough = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    return any(u.op == "output" or (u.target in passthrough and _read_by_output(u)) for u in node.users)


def _recomputed_nodes(
    gm: fx.GraphModule, unit_of: dict, microbatch_of: dict, chosen: set, position: dict
) -> list[fx.Node]:
    """The forward nodes of the chosen units that the backward reads through copies (graph
    order): recomputable, read by no other unit's forward (those are kept: a unit's output is
    the next one's input; with micro-batches, units are per micro-batch) and not returned by
    the step. The copies read the originals of everything else."""
    root, last_write = _storages(gm, position)
    out = []
    for node in gm.graph.nodes:
        unit = unit_of.get(node)
        if unit not in chosen or not _recomputable(node, root, last_write, position):
            continue
        if any(u in microbatch_of and unit_of.get(u) != unit for u in node.users) or _read_by_output(node):
            continue
        out.append(node)
    return out


# --- the copies -------------------------------------------------------------------------------------


def _recompute(gm: fx.GraphModule, unit: str, nodes: list[fx.Node], position: dict, end: int) -> None:
    """Redirect the backward's reads of `nodes` (forward nodes of `unit`) to copies, computed
    right before the first such read from their recomputed inputs and the originals of the rest."""
    recomputed = set(nodes)
    reads = [(user, n) for n in nodes for user in list(n.users) if position[user] > end and user.op != "output"]
    if not reads:
        return
    anchor = min((user for user, _ in reads), key=position.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}

    def copy_of(target: fx.Node) -> fx.Node:
        # Inputs before users: a depth-first post-order over the recomputed ancestors.
        stack: list[tuple[fx.Node, bool]] = [(target, False)]
        while stack:
            node, expanded = stack.pop()
            if node in copies:
                continue
            if not expanded:
                stack.append((node, True))
                stack.extend((i, False) for i in node.all_input_nodes if i in recomputed and i not in copies)
                continue
            with gm.graph.inserting_before(anchor):
                copy = gm.graph.node_copy(node, lambda i: copies.get(i, i))
            copy.meta.pop(_FORWARD_END_KEY, None)
            copy.meta[_RECOMPUTED_KEY] = unit
            copies[node] = copy
        return copies[target]

    for user, node in reads:
        user.replace_input_with(node, copy_of(node))


def recomputed_bytes(nodes: list[fx.Node]) -> int:
    """Bytes of the tensors the recomputed `nodes` allocate (views allocate none)."""
    total = 0
    for node in nodes:
        if _is_view(node):
            continue
        value = node.meta.get("val")
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total
