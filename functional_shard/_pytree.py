"""Pytrees: one registration helper for optree and torch, pytree dataclasses, and public tree functions.

The library's pytree node types (`ModuleParams`, `Sharded`, `StepState`, ...) are registered
once, here, with both registries a user meets: optree (under the namespace `NAMESPACE`, as
optree asks of libraries) and `torch.utils._pytree` (global), so that `torch.func` transforms
and `make_fx` accept them. `fs.tree_leaves`, `fs.tree_map`, ... are optree's functions with
that namespace filled in; with plain optree, pass `namespace=fs.PYTREE_NAMESPACE`.

`pytree_dataclass` makes a frozen dataclass a pytree node, equinox-style: fields are children
unless declared with `static_field()`, which makes them part of the structure (hashable
metadata such as a layout or a mesh).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, TypeVar

import optree
import torch.utils._pytree as torch_pytree

__all__ = [
    "NAMESPACE",
    "register_node",
    "pytree_dataclass",
    "static_field",
    "tree_flatten",
    "tree_unflatten",
    "tree_leaves",
    "tree_structure",
    "tree_map",
    "tree_paths",
    "path_string",
]

# The optree namespace of every registration of this library.
NAMESPACE = "functional_shard"

T = TypeVar("T")


def register_node(
    cls: type,
    flatten: Callable[[Any], tuple[Iterable[Any], Any]],
    unflatten: Callable[[Any, Iterable[Any]], Any],
    *,
    names: Callable[[Any], Iterable[Any]] | None = None,
) -> None:
    """Register `cls` as a pytree node with optree (namespace `NAMESPACE`) and with torch.

    Arguments:
        cls: the node type.
        flatten: `node -> (children, aux)`; `aux` is hashable and compares by value.
        unflatten: `(aux, children) -> node`.
        names: `node -> path entry per child` (keys in leaf paths); default: child indices.
    """
    if names is None:
        optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    else:
        optree.register_pytree_node(
            cls, lambda node: (*flatten(node), list(names(node))), unflatten, namespace=NAMESPACE
        )
    flatten_with_keys = None
    if names is not None:

        def flatten_with_keys(node):
            children, aux = flatten(node)
            return [(torch_pytree.MappingKey(k), c) for k, c in zip(names(node), children)], aux

    torch_pytree.register_pytree_node(
        cls,
        lambda node: (list(flatten(node)[0]), flatten(node)[1]),
        lambda children, aux: unflatten(aux, children),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


def static_field(**kwargs: Any) -> Any:
    """A `pytree_dataclass` field that is structure, not a child (hashable, compared by value)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls: type[T]) -> type[T]:
    """Make `cls` a frozen dataclass and a pytree node (optree and torch).

    Fields declared with `static_field()` go into the structure; the others are children,
    flattened in field order and named by their field names in leaf paths. Equality and
    hashing are by identity (children are tensors). `replace(**changes)` returns a copy.
    """
    cls = dataclasses.dataclass(frozen=True, eq=False)(cls)
    fields = dataclasses.fields(cls)
    children_names = tuple(f.name for f in fields if not f.metadata.get("static"))
    static_names = tuple(f.name for f in fields if f.metadata.get("static"))

    def flatten(node):
        return [getattr(node, n) for n in children_names], tuple(getattr(node, n) for n in static_names)

    def unflatten(aux, children):
        node = object.__new__(cls)
        for name, value in zip(children_names, children):
            object.__setattr__(node, name, value)
        for name, value in zip(static_names, aux):
            object.__setattr__(node, name, value)
        return node

    register_node(cls, flatten, unflatten, names=lambda node: children_names)
    if "replace" not in cls.__dict__:
        cls.replace = lambda self, **changes: dataclasses.replace(self, **changes)  # type: ignore[attr-defined]
    return cls


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Leaves and structure of `tree` (library nodes included); `None` is an empty subtree, as in JAX."""
    return optree.tree_flatten(tree, none_is_leaf=False, namespace=NAMESPACE)


def tree_unflatten(structure: optree.PyTreeSpec, leaves: Iterable[Any]) -> Any:
    """The inverse of `tree_flatten`."""
    return optree.tree_unflatten(structure, leaves)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of `tree` in flatten order, e.g. every tensor of a `StepState`."""
    return tree_flatten(tree)[0]


def tree_structure(tree: Any) -> optree.PyTreeSpec:
    """The structure of `tree` (compare two with `==`)."""
    return tree_flatten(tree)[1]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """`fn` applied leaf by leaf to `tree` (and to the matching leaves of `rest`)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False, namespace=NAMESPACE)


def tree_paths(tree: Any) -> list[str]:
    """A readable path per leaf, in flatten order: `blocks.0.attn.weight`, `a[0].b`, ..."""
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False, namespace=NAMESPACE)
    return [path_string(p) for p in paths]


def path_string(path: tuple) -> str:
    """`('blocks', 0, 'w')`-style path entries as text: `blocks[0].w`."""
    out = ""
    for entry in path:
        if isinstance(entry, int):
            out += f"[{entry}]"
        else:
            out += f".{entry}" if out else str(entry)
    return out or "<root>"
