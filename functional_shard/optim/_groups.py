"""Parameter groups: hyperparameters per leaf of the model, chosen by rules on the leaves' paths,
and carried onto the flat shards that an optimizer updates.

    opt = fs.optim.adamw(3e-4, weight_decay=0.1, groups=[
        fs.optim.group("*.bias", "*norm*", weight_decay=0.0),   # no decay on biases and norms
        fs.optim.group("backbone.*", lr=1e-5),                  # a smaller lr on the backbone
    ])

Each leaf takes the first group with a rule that matches it, and the optimizer's own arguments
when none does (torch's `param_groups`, optax's `multi_transform` / `add_decayed_weights(mask=)`).

In a sharded step the optimizer does not see leaves: it updates one flat shard per unit, in
which the leaves lie back to back (`fs.Layout`), and a shard's boundary may cut through a leaf.
The step therefore passes the optimizer a `LeafLayout` (`leaves=`): which leaf each element of
each shard belongs to. A built-in optimizer cuts each shard into runs of consecutive elements
whose hyperparameters agree and updates each run as torch updates a parameter of that group;
a shard inside one group is updated whole, exactly as without groups. Every operation is
elementwise, so the bits are torch's, whatever the cuts.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

import optree
import torch

from .._pytree import path_string
from ._blocks import apply_per_tensor

if TYPE_CHECKING:  # annotations only: the layout is the core's business
    from .._layout import Layout

__all__ = ["ParamGroup", "group", "LeafRange", "LeafLayout", "apply_per_group"]

# A rule: a glob on the leaf's path (`fnmatch`, `*` crosses dots: "*.bias" matches
# "blocks.0.attn.bias"), a compiled regular expression (`pattern.search(path)`), or a function
# `rule(path, shape) -> bool` (e.g. `lambda path, shape: len(shape) < 2`, nanoGPT's rule).
Rule = Union[str, "re.Pattern[str]", Callable[[str, tuple], bool]]


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Hyperparameters for the leaves that one of `rules` matches; make one with `group`.

    Arguments:
        rules: globs on leaf paths, compiled regular expressions, or functions `(path, shape)
            -> bool`; the group takes a leaf that any of them matches (and no earlier group did).
        options: `(name, value)` pairs, the hyperparameters this group sets (e.g.
            `(("weight_decay", 0.0),)`); the others are the optimizer's own.
    """

    rules: tuple[Rule, ...]
    options: tuple[tuple[str, Any], ...]

    def matches(self, path: str, shape: tuple[int, ...]) -> bool:
        """Whether a rule of this group matches the leaf at `path` (full shape `shape`)."""
        return any(_rule_matches(rule, path, shape) for rule in self.rules)

    def describe(self) -> str:
        rules = ", ".join(_describe_rule(r) for r in self.rules)
        options = ", ".join(f"{k}={v!r}" for k, v in self.options)
        return f"group({rules}; {options})"


def group(*rules: Rule, **options: Any) -> ParamGroup:
    """A parameter group: the leaves whose paths match `rules`, with their own hyperparameters.

    Pass a list of them as `groups=` to `fs.optim.adamw` or `fs.optim.sgd`. A leaf takes the
    first group with a rule that matches it; leaves no group matches take the optimizer's own
    arguments. The optimizer raises `ValueError` when it meets the model's leaves (at
    `step.init`) if a rule matches no leaf it updates, or a group gets no leaf because earlier
    groups took all its matches: a typo never silently trains with the wrong hyperparameters.

        fs.optim.group("*.bias", "*norm*", weight_decay=0.0)      # torch: {"params": no_decay, "weight_decay": 0.0}
        fs.optim.group(re.compile(r"^backbone\\."), lr=1e-5)
        fs.optim.group(lambda path, shape: len(shape) < 2, weight_decay=0.0)   # nanoGPT's rule

    Arguments:
        *rules: at least one: a glob matched against the whole leaf path (`fnmatch`, `*` also
            matches dots), a compiled regular expression (`pattern.search(path)`), or a function
            `(path, shape) -> bool` (`shape` is the leaf's full shape). Paths are those of
            `fs.tree_paths(params)`, e.g. `blocks.0.attn.qkv.weight`; frozen leaves
            (`requires_grad=False`) are not updated by the optimizer and match nothing here.
        **options: the hyperparameters this group sets, among those the optimizer accepts per
            group (`adamw`: `lr`, `weight_decay`, `betas`, `eps`; `sgd`: `lr`, `weight_decay`,
            `momentum`, `dampening`, `nesterov`). `lr` may be a schedule.

    Returns a `ParamGroup` (a frozen value).
    """
    if not rules:
        raise ValueError("fs.optim.group needs at least one rule, e.g. group('*.bias', weight_decay=0.0)")
    for rule in rules:
        if not (isinstance(rule, (str, re.Pattern)) or callable(rule)):
            raise TypeError(
                f"fs.optim.group: a rule must be a glob (str), a compiled regular expression or a function "
                f"(path, shape) -> bool; got {type(rule).__name__} {rule!r:.60}"
            )
    if not options:
        raise ValueError(f"fs.optim.group{rules!r} sets no hyperparameter: add e.g. weight_decay=0.0 or lr=1e-5")
    return ParamGroup(tuple(rules), tuple(sorted(options.items())))


def _rule_matches(rule: Rule, path: str, shape: tuple[int, ...]) -> bool:
    if isinstance(rule, str):
        return fnmatch.fnmatchcase(path, rule)
    if isinstance(rule, re.Pattern):
        return rule.search(path) is not None
    return bool(rule(path, shape))


def _describe_rule(rule: Rule) -> str:
    if isinstance(rule, str):
        return repr(rule)
    if isinstance(rule, re.Pattern):
        return f"re.compile({rule.pattern!r})"
    return getattr(rule, "__qualname__", repr(rule))


# ------------------------------------------------------------------ where the leaves lie


class LeafRange(NamedTuple):
    """The part of one leaf of the model that lies in one tensor the optimizer updates."""

    path: str  # the leaf's path in the model's pytree, e.g. "blocks.0.attn.weight"
    start: int  # the first element of that part in the (flat) tensor
    stop: int  # one past its last element


@dataclasses.dataclass(frozen=True, eq=False)
class LeafLayout:
    """Which leaf of the model each element of the tensors an optimizer updates belongs to.

    A sharded step passes one to the optimizer's `init` and `apply` (`leaves=`): there the
    optimizer updates this rank's flat shard of each trainable buffer, whose elements belong
    to several leaves (or to padding, after the last leaf). Outside a step (`leaves=None`), each
    tensor of the params pytree is a leaf of its own (`LeafLayout.of_tree`).

    Arguments:
        paths: every leaf the optimizer updates, on any rank, in the model's flatten order.
        shapes: their full shapes.
        ranges: for each tensor of the params pytree, by its path (`fs.tree_paths`; in a
            step, the buffer name): the leaves' parts in it, in element order. Elements after
            the last part are padding.
    """

    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    ranges: Mapping[str, tuple[LeafRange, ...]]
    # Names of the tensors (buffers) every rank of the model-parallel axes holds whole, in a
    # tensor-parallel step (`Layout.replicated_buffers`): `global_norm` counts them once.
    replicated: frozenset = frozenset()
    # Canonical blocks of each tensor (a layout-invariant step, `Layout.blocks` over the
    # shards), or 0: `global_norm(..., blocks=)` sums their squares in the canonical tree.
    blocks: int = 0
    # Where this rank's tensors stand among the whole model's trainable buffers (a pipeline rank
    # holds some stages' buffers), and how many the model has; () and 0 otherwise: a
    # layout-invariant `global_norm` adds every buffer's squares in the whole model's order.
    positions: tuple[int, ...] = ()
    count: int = 0
    # Resolved group assignments, by (groups, who asks): a cache, not part of the value.
    _plans: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of_tree(cls, params: Any) -> "LeafLayout":
        """Each tensor of `params` (any pytree of tensors) a leaf of its own, named by its path."""
        paths, leaves, _ = optree.tree_flatten_with_path(params)
        names = [path_string(p) for p in paths]
        shapes = tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else () for leaf in leaves)
        ranges = {
            name: (LeafRange(name, 0, leaf.numel()),) if isinstance(leaf, torch.Tensor) else ()
            for name, leaf in zip(names, leaves)
        }
        return cls(tuple(names), shapes, ranges)

    @classmethod
    def of_shards(cls, layout: Layout, shard_index: int) -> "LeafLayout":
        """The trainable buffers of `layout` as shard `shard_index` holds them (what a step's
        optimizer updates: a dict buffer name -> flat shard). Cached per layout and shard."""
        return _of_shards(layout, shard_index)


@functools.lru_cache(maxsize=16)
def _of_shards(layout: Layout, shard_index: int) -> LeafLayout:
    paths, shapes, ranges = [], [], {}
    for spec in layout.buffers:
        if not spec.trainable:
            continue
        start, stop = shard_index * spec.shard_numel, (shard_index + 1) * spec.shard_numel
        parts, offset = [], 0
        for leaf, size in zip(spec.leaves, spec.sizes):
            paths.append(layout.paths[leaf])
            shapes.append(tuple(layout.shapes[leaf]))
            lo, hi = max(start, offset), min(stop, offset + size)
            if lo < hi:
                parts.append(LeafRange(layout.paths[leaf], lo - start, hi - start))
            offset += size
        ranges[spec.name] = tuple(parts)
    blocks = layout.blocks // layout.num_shards if layout.blocks else 0
    return LeafLayout(tuple(paths), tuple(shapes), ranges, layout.replicated_buffers, blocks)


# ------------------------------------------------------------------ groups resolved


class Run(NamedTuple):
    """Consecutive elements of one tensor that one group's hyperparameters update."""

    start: int
    stop: int
    group: int  # 0: the optimizer's own arguments; i + 1: `groups[i]`


class GroupPlan(NamedTuple):
    """Groups resolved against the leaves an optimizer updates."""

    group_of: dict[str, int]  # leaf path -> group (0 for the optimizer's own arguments)
    runs: dict[str, tuple[Run, ...]]  # params tensor path -> its runs, merged, padding included


def resolve(groups: Sequence[ParamGroup], leaves: LeafLayout, owner: str) -> GroupPlan:
    """Every leaf's group (first match wins) and every tensor's runs; raises `ValueError` for a
    rule that matches no leaf, or a group that gets none. Cached on `leaves`."""
    key = (tuple(groups), owner)
    try:
        cached = leaves._plans.get(key)
    except TypeError:  # an unhashable rule or option: resolve every time
        return _resolve(groups, leaves, owner)
    if cached is None:
        cached = leaves._plans[key] = _resolve(groups, leaves, owner)
    return cached


def _resolve(groups: Sequence[ParamGroup], leaves: LeafLayout, owner: str) -> GroupPlan:
    group_of = {}
    for path, shape in zip(leaves.paths, leaves.shapes):
        group_of[path] = next((i + 1 for i, g in enumerate(groups) if g.matches(path, shape)), 0)
    for i, g in enumerate(groups):
        for rule in g.rules:
            if not any(_rule_matches(rule, p, s) for p, s in zip(leaves.paths, leaves.shapes)):
                raise ValueError(
                    f"{owner}: rule {_describe_rule(rule)} of groups[{i}] ({g.describe()}) matches no leaf the "
                    f"optimizer updates. Its leaves ({len(leaves.paths)}) are: {_some(leaves.paths)}. Frozen leaves "
                    f"(requires_grad=False) have no optimizer state; fix the rule or remove it"
                )
        if i + 1 not in group_of.values():
            raise ValueError(
                f"{owner}: groups[{i}] ({g.describe()}) gets no leaf: every leaf it matches was taken by an "
                f"earlier group (the first group that matches a leaf wins). Reorder the groups or remove it"
            )
    runs = {}
    for name, parts in leaves.ranges.items():
        merged: list[Run] = []
        for part in parts:
            g = group_of[part.path]
            if merged and merged[-1].group == g and merged[-1].stop == part.start:
                merged[-1] = Run(merged[-1].start, part.stop, g)
            else:
                merged.append(Run(part.start, part.stop, g))
        runs[name] = tuple(merged)
    return GroupPlan(group_of, runs)


def _some(paths: Sequence[str], n: int = 12) -> str:
    shown = ", ".join(paths[:n])
    return shown + (f", ... ({len(paths) - n} more)" if len(paths) > n else "")


def runs_of(plan: Optional[GroupPlan], name: str, numel: int) -> tuple[Run, ...]:
    """The runs of the tensor at path `name` (`numel` elements): padding joins the last run; a
    tensor without leaves (all padding) is one run of group 0; no plan: one run of group 0."""
    if plan is None:
        return (Run(0, numel, 0),)
    runs = plan.runs.get(name)
    if runs is None:
        raise ValueError(
            f"the optimizer was given a tensor at {name!r} that its leaf layout does not describe "
            f"(it describes {sorted(plan.runs)[:8]}); pass the LeafLayout of these params"
        )
    if not runs:
        return (Run(0, numel, 0),)
    if runs[0].start != 0 or runs[-1].stop > numel or any(a.stop != b.start for a, b in zip(runs, runs[1:])):
        raise ValueError(f"the leaf layout's ranges for {name!r} ({runs}) do not tile a tensor of {numel} elements")
    if runs[-1].stop < numel:
        runs = (*runs[:-1], Run(runs[-1].start, numel, runs[-1].group))
    return runs


def merge(runs: Iterable[Run], key: Callable[[int], Any]) -> list[Run]:
    """Consecutive runs whose groups have the same `key(group)` joined into one (the group of
    the first kept): an operation that depends only on that key runs once over all of them."""
    out: list[Run] = []
    for run in runs:
        if out and _same(key(out[-1].group), key(run.group)):
            out[-1] = Run(out[-1].start, run.stop, out[-1].group)
        else:
            out.append(run)
    return out


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 (values that cannot be compared are different)
        return False


def cut(t: Optional[torch.Tensor], run: Run) -> Optional[torch.Tensor]:
    """The elements of `run` in `t` (a view, written through), or `t` itself for the whole tensor."""
    if t is None or (run.start == 0 and run.stop == t.numel()):
        return t
    if t.dim() != 1:
        raise ValueError(
            f"a tensor of shape {list(t.shape)} holds several parameter groups: only flat (1-D) tensors can be cut "
            f"into groups; give each leaf a tensor of its own or pass the tensors' LeafLayout"
        )
    return t[run.start : run.stop]


def check_options(groups: Sequence[ParamGroup], allowed: Sequence[str], owner: str) -> tuple[ParamGroup, ...]:
    """`groups` as a tuple, each checked to set only hyperparameters in `allowed`."""
    if isinstance(groups, ParamGroup):
        groups = (groups,)
    groups = tuple(groups)
    for i, g in enumerate(groups):
        if not isinstance(g, ParamGroup):
            raise TypeError(
                f"{owner}: groups[{i}] is a {type(g).__name__}; make each group with fs.optim.group(*rules, **options), "
                f"e.g. fs.optim.group('*.bias', weight_decay=0.0)"
            )
        unknown = [name for name, _ in g.options if name not in allowed]
        if unknown:
            raise ValueError(
                f"{owner}: groups[{i}] ({g.describe()}) sets {unknown}, which is not a per-group hyperparameter "
                f"of this optimizer; per group it accepts {list(allowed)}"
            )
    return groups


def options_per_group(groups: Sequence[ParamGroup], defaults: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The hyperparameters of group 0 (the defaults) and of each group (defaults overridden)."""
    return [dict(defaults)] + [{**defaults, **dict(g.options)} for g in groups]


# ------------------------------------------------------------------ a block for user optimizers


def apply_per_group(
    step_run: Callable[..., None],
    grads: Any,
    params: Any,
    states: Mapping[str, Optional[Any]] = {},  # noqa: B006 (never mutated)
    *,
    groups: Sequence[ParamGroup],
    leaves: Optional[LeafLayout] = None,
    inplace: bool = False,
    owner: str = "optimizer",
) -> tuple[Any, dict[str, Optional[Any]]]:
    """`apply_per_leaf` with parameter groups: runs `step_run(group, param, grad, *state_leaves)`
    on each run of consecutive elements that one group updates.

    In a sharded step a params tensor is a flat shard holding parts of several leaves; this cuts
    it into runs of one group each (views, written through) and calls `step_run` once per run,
    with `group` 0 for the optimizer's own hyperparameters and `i + 1` for `groups[i]`. A tensor
    inside one group is passed whole. Use it in an `apply` that accepts `leaves=`:

        def apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None):
            def step_run(g, param, grad, exp_avg):  # scalars[g]: group g's per-step values
                ...
            return optim.apply_per_group(step_run, grads, params, {"exp_avg": state.exp_avg},
                                         groups=groups, leaves=leaves, inplace=inplace)

    Arguments:
        step_run: `(group, param, grad, *state_leaves) -> None`, updating `param` and the state
            leaves in place (they are private copies, or the donated tensors with `inplace`).
        grads, params, states, inplace: as for `apply_per_leaf`.
        groups: the optimizer's `ParamGroup`s.
        leaves: the `LeafLayout` the step passed to `apply`; None: each params tensor is a leaf.
        owner: how to name the optimizer in errors, e.g. "lion".

    Returns `(new_params, new_states)`, as `apply_per_leaf`. Raises `ValueError` for a rule that
    matches no leaf (see `group`).
    """
    plan = resolve(groups, leaves if leaves is not None else LeafLayout.of_tree(params), owner) if groups else None

    def step_tensor(name, param, grad, *state):
        for run in runs_of(plan, name, param.numel()):
            step_run(run.group, cut(param, run), cut(grad, run), *(cut(s, run) for s in state))

    return apply_per_tensor(step_tensor, grads, params, states, inplace=inplace)
