"""`ModuleParams` (the pytree a module becomes) and the roles of its leaves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import optree
import torch

from ._pytree import NAMESPACE, register_node, tree_flatten

__all__ = ["ModuleParams", "TRAINABLE", "FROZEN", "BUFFER", "leaf_roles"]

# The three roles a leaf can play in a sharded step.
TRAINABLE = "trainable"  # sharded, gathered, differentiated, updated by the optimizer
FROZEN = "frozen"  # sharded and gathered, but no gradient, no reduce-scatter, no optimizer state
BUFFER = "buffer"  # not sharded: each rank keeps and updates its own copy (as FSDP does)


class ModuleParams(Mapping):
    """The parameters and buffers of an `nn.Module`, as a pytree (made by `fs.functionalize`).

    Arguments:
        trainable: name -> tensor, parameters with `requires_grad=True` (tied parameters once,
            under their first name).
        frozen: name -> tensor, parameters with `requires_grad=False`: sharded and gathered like
            the others but never differentiated and given no optimizer state.
        buffers: name -> tensor, module buffers (e.g. BatchNorm running statistics). Never
            sharded: each rank keeps and updates its own, as in FSDP.
        aliases: `(alias, name)` pairs: a second name under which the module's state dict holds
            the same tensor (tied weights); used by `fs.export`.
        non_persistent: names of buffers that the module's state dict leaves out.
        batch_norm: names of parameters of BatchNorm modules, which mixed precision keeps
            in their own dtype unless told otherwise (`fs.Precision.keep_batch_norm`).
        order: the parameters' names (trainable and frozen) in the module's registration
            order, which stands for the order of use: the default unit policy and a pipeline's
            stages follow it (a frozen embedding stays before the blocks). Empty: the flatten
            order (trainable, then frozen).

    It reads like one mapping from every name (trainable, frozen and buffer) to its tensor.
    As a pytree its leaves are the trainable, then frozen, then buffer tensors, each keyed by
    its name; names, roles and aliases are static structure.
    """

    __slots__ = ("trainable", "frozen", "buffers", "aliases", "non_persistent", "batch_norm", "order")

    def __init__(
        self,
        trainable: Mapping[str, Any],
        frozen: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
        *,
        aliases: tuple[tuple[str, str], ...] = (),
        non_persistent: tuple[str, ...] = (),
        batch_norm: tuple[str, ...] = (),
        order: tuple[str, ...] = (),
    ):
        self.trainable = dict(trainable)
        self.frozen = dict(frozen or {})
        self.buffers = dict(buffers or {})
        self.aliases = tuple(aliases)
        self.non_persistent = tuple(non_persistent)
        self.batch_norm = tuple(batch_norm)
        self.order = tuple(order)
        seen: set[str] = set()
        for name in (*self.trainable, *self.frozen, *self.buffers):
            if name in seen:
                raise ValueError(f"ModuleParams: name {name!r} appears in more than one role")
            seen.add(name)
        if self.order and sorted(self.order) != sorted((*self.trainable, *self.frozen)):
            raise ValueError("ModuleParams: order must name every trainable and frozen parameter once")

    def __getitem__(self, name: str) -> Any:
        for part in (self.trainable, self.frozen, self.buffers):
            if name in part:
                return part[name]
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        yield from self.trainable
        yield from self.frozen
        yield from self.buffers

    def __len__(self) -> int:
        return len(self.trainable) + len(self.frozen) + len(self.buffers)

    def __repr__(self) -> str:
        def describe(part: dict) -> str:
            return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in part.items()) + "}"

        return (
            f"ModuleParams(trainable={describe(self.trainable)}, frozen={describe(self.frozen)}, "
            f"buffers={describe(self.buffers)})"
        )

    def _structure(self) -> tuple:
        names = (tuple(self.trainable), tuple(self.frozen), tuple(self.buffers))
        return (*names, self.aliases, self.non_persistent, self.batch_norm, self.order)

    def _children(self) -> list:
        return [*self.trainable.values(), *self.frozen.values(), *self.buffers.values()]

    @classmethod
    def _rebuild(cls, structure: tuple, children) -> "ModuleParams":
        trainable_names, frozen_names, buffer_names, aliases, non_persistent, batch_norm, order = structure
        children = list(children)
        a, b = len(trainable_names), len(trainable_names) + len(frozen_names)
        return cls(
            dict(zip(trainable_names, children[:a])),
            dict(zip(frozen_names, children[a:b])),
            dict(zip(buffer_names, children[b:])),
            aliases=aliases,
            non_persistent=non_persistent,
            batch_norm=batch_norm,
            order=order,
        )

    def roles(self) -> "ModuleParams":
        """The same structure with each leaf replaced by its role string."""
        return ModuleParams(
            {k: TRAINABLE for k in self.trainable},
            {k: FROZEN for k in self.frozen},
            {k: BUFFER for k in self.buffers},
            aliases=self.aliases,
            non_persistent=self.non_persistent,
            batch_norm=self.batch_norm,
            order=self.order,
        )

    def used_order(self) -> list[int]:
        """Per leaf (flatten order), its position in the order of use: `order`'s where it is
        given, else the flatten order; module buffers after every parameter."""
        names = [*self.trainable, *self.frozen, *self.buffers]
        if not self.order:
            return list(range(len(names)))
        position = {n: k for k, n in enumerate(self.order)}
        return [position.get(n, len(position) + k) for k, n in enumerate(names)]

    def state_dict(self) -> dict[str, Any]:
        """name -> tensor as `nn.Module.state_dict()` lays it out (aliases included,
        non-persistent buffers left out)."""
        out = {k: v for k, v in self.items() if k not in self.non_persistent}
        for alias, name in self.aliases:
            if name not in self.non_persistent:
                out[alias] = self[name]
        return out


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return repr(value)


register_node(
    ModuleParams,
    lambda p: (p._children(), p._structure()),
    ModuleParams._rebuild,
    names=lambda p: [*p.trainable, *p.frozen, *p.buffers],
)


def leaf_roles(tree: Any) -> list[str]:
    """The role of every leaf of `tree` (flatten order): leaves inside a `ModuleParams` take the
    role it gives them; every other leaf is trainable."""
    is_module_params: Callable[[Any], bool] = lambda x: isinstance(x, ModuleParams)
    role_tree = optree.tree_map(
        lambda x: x.roles() if isinstance(x, ModuleParams) else TRAINABLE,
        tree,
        is_leaf=is_module_params,
        none_is_leaf=False,
        namespace=NAMESPACE,
    )
    roles, _ = tree_flatten(role_tree)
    return roles
