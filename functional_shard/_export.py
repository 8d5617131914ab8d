"""Export: the full, unsharded parameters of a sharded state, e.g. for `model.load_state_dict`."""

from __future__ import annotations

from typing import Any

import torch

from ._shard import Sharded, gather
from ._step import StepState
from ._pytree import tree_map
from ._tree import ModuleParams

__all__ = ["export"]


def export(state: StepState | Sharded) -> Any:
    """The full, unsharded parameters of a step state (or a `Sharded`), on every rank.

    For parameters from `fs.functionalize`, a state dict for `model.load_state_dict(...,
    strict=True)`: every parameter and persistent buffer under every name the module's state
    dict uses (tied names included); buffers are this rank's. Otherwise the full pytree.
    A collective: every rank must call it. The tensors are fresh copies.
    """
    sharded = state.params if isinstance(state, StepState) else state
    if not isinstance(sharded, Sharded):
        raise TypeError(f"export expects a StepState or a Sharded; got {type(state).__name__}")
    sharded.mesh.agree("fs.export")
    with torch.no_grad():
        tree = tree_map(lambda t: t.detach().clone(), gather(sharded))
    if isinstance(tree, ModuleParams):
        return tree.state_dict()
    return tree

