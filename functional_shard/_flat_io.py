"""The flat form of a traced step's inputs and outputs (`FlatIO`), and what a batch's leaves say
about the graph they are traced into (`describe_batch`: its cache key's batch part)."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from ._layout import Layout
from ._pytree import tree_flatten

__all__ = ["FlatIO", "TraceError", "describe_batch"]


class TraceError(ValueError):
    """`loss_fn` could not be traced (it reads a tensor's value in Python)."""


def describe_batch(leaves: list) -> tuple:
    """Each batch leaf as the cache key sees it: a tensor by shape, dtype and device kind; any
    other value by itself (baked into the graph: it must be hashable, else `TraceError`)."""
    described = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TraceError(
                    f"a traced step bakes non-tensor batch values into its graph, so they must be hashable; "
                    f"got a {type(leaf).__name__}: pass tensors, or use fs.Schedule(trace=False)"
                ) from None
            described.append(("static", type(leaf).__name__, leaf))
    return tuple(described)


class FlatIO:
    """Packs a program's inputs into the flat tensor list a traced graph takes, and its outputs back.

    Inputs: `[*shards, *leaves of the rest of the state, *batch tensors]` (the batch's other
    leaves are static: part of the cache key, baked into the graph). Outputs: the leaves of the
    NamedTuple the program returns; which leaf is the local loss marks the end of the forward.
    """

    def __init__(self, layout: Layout, state_structure, batch_structure, batch_leaves: list):
        self.layout = layout
        self.state_structure = state_structure
        self.batch_structure = batch_structure
        self.batch_tensors = tuple(i for i, leaf in enumerate(batch_leaves) if isinstance(leaf, torch.Tensor))
        self.batch_static = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in batch_leaves]
        self.counts = (len(layout.buffers), state_structure.num_leaves, len(self.batch_tensors))
        self.output_structure: optree.PyTreeSpec | None = None
        self.forward_ends: list[int] = []  # outputs that end a forward pass, known once traced

    def inputs(self, shards, state_leaves, batch_leaves) -> list[torch.Tensor]:
        return [*shards, *state_leaves, *(batch_leaves[i] for i in self.batch_tensors)]

    def split_inputs(self, flat) -> tuple[list, Any, Any]:
        n_shards, n_state, _ = self.counts
        shards, state_leaves, batch_tensors = flat[:n_shards], flat[n_shards : n_shards + n_state], flat[n_shards + n_state :]
        batch_leaves = list(self.batch_static)
        for i, t in zip(self.batch_tensors, batch_tensors):
            batch_leaves[i] = t
        return (
            list(shards),
            optree.tree_unflatten(self.state_structure, list(state_leaves)),
            optree.tree_unflatten(self.batch_structure, batch_leaves),
        )

    def outputs(self, out: NamedTuple) -> list[torch.Tensor]:
        leaves, self.output_structure = tree_flatten(out)
        # Where each forward ends: each micro-batch's loss (a step with several), else the loss.
        ends = getattr(out, "microbatch_losses", None) or (out.loss,)
        self.forward_ends = [i for end in ends for i, leaf in enumerate(leaves) if leaf is end][: len(ends)]
        return leaves

    def split_outputs(self, flat: list) -> Any:
        return optree.tree_unflatten(self.output_structure, list(flat))

    def input_kinds(self) -> list[str]:
        """What each graph input holds: "parameters" (shards and local leaves, the state's first
        part; with ZeRO-1 the kept full buffers, its fifth), "optimizer_state" (the rest of the
        state: optimizer state, loss scale, scalars) or "batch"."""
        n_shards, n_state, n_batch = self.counts
        kinds: list[str] = ["parameters"] * n_shards + [""] * n_state + ["batch"] * n_batch
        state = optree.tree_unflatten(self.state_structure, list(range(n_state)))
        for part, child in enumerate(state):
            for index in tree_flatten(child)[0]:
                kinds[n_shards + index] = "parameters" if part in (0, 4) else "optimizer_state"
        return kinds

    def output_kinds(self) -> list[str | None]:
        """What each graph output holds: "parameters", "optimizer_state", or None (losses, norms,
        aux), read off the program's NamedTuple fields (shards, local, opt_state, loss_scale)."""
        assert self.output_structure is not None, "known once traced"
        n = self.output_structure.num_leaves
        out = optree.tree_unflatten(self.output_structure, list(range(n)))
        kinds: list[str | None] = [None] * n
        fields = {"shards": "parameters", "local": "parameters", "opt_state": "optimizer_state", "loss_scale": "optimizer_state", "kept": "parameters"}
        for field, kind in fields.items():
            for index in tree_flatten(getattr(out, field, None))[0]:
                kinds[index] = kind
        return kinds
