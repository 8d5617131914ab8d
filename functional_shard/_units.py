"""Unit policies: which leaves of a parameter pytree move together (one all-gather, one reduce-scatter).

A policy is either a plain function `path -> unit name`, called leaf by leaf, or a `UnitPolicy`
value, called once with the paths of every sharded leaf in the order of use, so that it can place
a leaf by where it sits among the others. The default, `BlockUnits()`, gives each repeated block
a unit and splits the leaves outside the blocks by their side: `input` (embeddings) and
`output` (final norm, head), so that neither stays gathered through the whole forward.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

__all__ = ["BlockUnits", "UnitPolicy", "Units", "assign_units", "units_by_block"]

_BLOCK_INDEX = re.compile(r"^(.*?(?:\[\d+\]|(?:^|\.)\d+(?=[.\[]|$)))")


def _block_of(path: str) -> str | None:
    """The path up to its first integer index (`blocks.3.attn.weight` -> `blocks.3`), or None."""
    match = _BLOCK_INDEX.match(path)
    return match.group(1) if match else None


def units_by_block(path: str) -> str:
    """One unit per element of a repeated block container, and one unit `rest` for every other
    leaf: a policy `path -> unit name`, called leaf by leaf.

    A leaf belongs to the unit named by its path up to the first integer index, whether it is a
    sequence index (`layers[3].w` -> `layers[3]`) or a numbered module name as `nn.ModuleList`
    and `nn.Sequential` make them (`blocks.3.attn.weight` -> `blocks.3`, `0.weight` -> `0`).
    Leaves with no index (embeddings, final norm, head) share the unit `rest`.

    It is the building block of per-leaf policies (see `docs/units.md`), and, passed as
    `units=fs.units_by_block`, the layout the default policy made before `BlockUnits` split
    `rest` into `input` and `output` (a `rest` unit stays gathered from the embedding to the
    head, through the whole forward).
    """
    return _block_of(path) or "rest"


class UnitPolicy:
    """Base of unit policies that see every path at once. A subclass is a frozen dataclass
    whose fields are its settings and whose `__call__(paths)` returns one unit name per path.

    `paths` are the paths of the leaves that go into flat buffers (trainable and frozen
    parameters; module buffers are in no unit), in the order of use: for the params of
    `fs.functionalize`, the order the module registers its parameters (trainable and frozen
    together: `ModuleParams.order`); for any other tree, its flatten order (a plain dict: its
    keys sorted). A plain function `path -> unit name` is a policy too (called leaf by leaf);
    subclass this one when a leaf's unit depends on the others.
    """

    def __call__(self, paths: tuple[str, ...]) -> Sequence[str]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class BlockUnits(UnitPolicy):
    """The default unit policy: one unit per repeated block, and the leaves outside the blocks
    split by where they sit, in the order of use:

    - a block: the path up to its first integer index, as `units_by_block` cuts it
      (`blocks.3.attn.weight` -> `blocks.3`, `model.layers.0.mlp.up_proj.weight` -> `model.layers.0`);
    - `input`: the leaves before the first block (`tok_emb`, `pos_emb`, `model.embed_tokens`);
    - `output`: the leaves after the last block (`ln_f`, `head`, `model.norm`, `lm_head`);
    - `after.<block>`: a run of leaves between two blocks (an encoder's final norm, a decoder's
      embeddings) is a unit of its own, named after the block before it
      (`after.encoder.block.5`): gathered where it is used, not from one end of the model to
      the other;
    - `rest`: every leaf, when the tree has no block at all (as `units_by_block` makes it).

    The order of use is the module's registration order, which is the order its forward runs
    them for models that register their modules that way; frozen parameters keep their place in
    it (`ModuleParams.order`), so a frozen embedding is `input` and a frozen block its own unit.

    A weight tied between the embedding and the head is one leaf, under its first name: it is
    in `input`, which is then read at both ends of the forward and stays gathered in between.
    """

    def __call__(self, paths: tuple[str, ...]) -> list[str]:
        blocks = [_block_of(path) for path in paths]
        indexed = [i for i, block in enumerate(blocks) if block is not None]
        if not indexed:
            return ["rest"] * len(paths)
        first, last = indexed[0], indexed[-1]
        names, previous = [], ""
        for i, block in enumerate(blocks):
            if block is not None:
                previous = block
                names.append(block)
            elif i < first:
                names.append("input")
            elif i > last:
                names.append("output")
            else:
                names.append(f"after.{previous}")
        return names


# What `units=` accepts: a `UnitPolicy`, a function `path -> unit name`, or None for `BlockUnits()`.
Units = UnitPolicy | Callable[[str], str] | None


def assign_units(policy: Units, paths: Sequence[str]) -> list[str]:
    """The unit of each of `paths` (in the order of use) under `policy` (None: `BlockUnits()`).

    Raises `ValueError` naming the leaf path when the policy returns something other than one
    `str` per path.
    """
    policy = BlockUnits() if policy is None else policy
    paths = tuple(paths)
    if isinstance(policy, UnitPolicy):
        names = list(policy(paths))
        if len(names) != len(paths):
            raise ValueError(
                f"the unit policy {policy!r} returned {len(names)} unit names for {len(paths)} leaves; "
                f"it must return one per path, in the order given"
            )
    elif callable(policy):
        names = [policy(path) for path in paths]
    else:
        raise TypeError(f"units must be an fs.UnitPolicy, a function path -> unit name, or None; got {policy!r}")
    for path, name in zip(paths, names):
        if not isinstance(name, str):
            raise ValueError(f"the unit policy returned {name!r} for leaf {path!r}; it must return a str")
    return names
