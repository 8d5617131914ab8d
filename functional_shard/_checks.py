"""What a step checks in the parameters it is given, before sharding them.

`check_leaves` refuses leaves a step cannot train (meta without an initializer, complex),
naming them; `check_same_values` compares a hash of every buffer across ranks (ranks seeded
differently would otherwise train a silent mixture); `broadcast_from_rank0` takes rank 0's
values instead, as DDP does.
"""

from __future__ import annotations

import hashlib

import torch

from ._layout import Layout
from ._mesh import BaseMesh, MeshError
from ._reference import StepError
from ._tree import FROZEN

__all__ = ["check_leaves", "check_same_values", "broadcast_from_rank0"]


def check_leaves(layout: Layout, leaves: list, mesh: BaseMesh, meta_ok: bool = False) -> None:
    """Refuse leaves a step cannot train, naming them (before any collective)."""
    for i, leaf in enumerate(leaves):
        where = f"{layout.describe_leaf(i)} on rank {mesh.rank}"
        if leaf.is_meta and not meta_ok:
            raise StepError(
                f"{where} is on the meta device: it has no values to shard. Pass an initializer, "
                f"step.init(params, initialize=fs.initialize.from_module(model, seed=0)), which materializes "
                f"one submodule at a time and keeps this rank's slice"
            )
        if leaf.is_complex() and layout.roles[i] != FROZEN:
            raise StepError(
                f"{where} is complex: a sharded step does not train complex parameters (they would be "
                f"frozen silently). Store it as torch.view_as_real(...) and view it back in loss_fn, or "
                f"mark it frozen (requires_grad=False)"
            )


def _buffer_digests(layout: Layout, leaves: list) -> list[int]:
    digests = []
    for spec in layout.buffers:
        h = hashlib.blake2b(digest_size=8)
        for i in spec.leaves:
            h.update(leaves[i].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        digests.append(int.from_bytes(h.digest(), "little") >> 1)
    return digests


def check_same_values(layout: Layout, leaves: list, mesh: BaseMesh) -> None:
    """One all-gather of a 63-bit hash per buffer; raise on every rank if they differ."""
    if mesh.world_size == 1 or not layout.buffers:
        return
    mine = torch.tensor(_buffer_digests(layout, [t.cpu() for t in leaves]), dtype=torch.int64)
    everyone = mesh.all_gather_world(mine.to(getattr(mesh, "device", "cpu"))).view(mesh.world_size, -1).cpu()
    differ = (everyone != everyone[0]).any(dim=0)
    if bool(differ.any()):
        k = int(differ.nonzero()[0])
        spec = layout.buffers[k]
        ranks = [r for r in range(mesh.world_size) if everyone[r, k] != everyone[0, k]]
        raise MeshError(
            f"ranks {ranks} hold parameter values that differ from rank 0's, first in buffer {spec.name!r} "
            f"({layout.describe_leaf(spec.leaves[0])}, ...): every rank must start from the same parameters "
            f"(seed the model the same way everywhere), or pass step.init(params, values='broadcast') to take "
            f"rank 0's, as DDP does"
        )


def broadcast_from_rank0(layout: Layout, leaves: list, mesh: BaseMesh) -> list:
    """Every sharded leaf replaced by rank 0's values (one all-gather per buffer; rank 0's part kept)."""
    leaves = list(leaves)
    for spec in layout.buffers:
        # As raw bytes: the backend has no kernels for some dtypes, and bytes arrive unchanged.
        flat = layout.flatten_buffer(spec, leaves).contiguous()
        gathered = mesh.all_gather_world(flat.view(torch.uint8)).view(mesh.world_size, -1)[0]
        for i, piece in zip(spec.leaves, layout.unflatten_buffer(spec, gathered.clone().view(flat.dtype))):
            leaves[i] = piece
    return leaves
