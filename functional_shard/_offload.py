"""CPU offload as copies in the step: parameter shards and optimizer state kept in host memory.

`fs.Schedule(offload=fs.schedule.Offload(...))` (`schedule/_offload.py`: the value and the pass
that places the copies) keeps the chosen units' parameter shards and their
optimizer state on the host between steps (pinned where there is a GPU). The step copies them
to the compute device where it needs them and back, with one operator,
`functional_shard::offload_copy`, so that the copies are nodes of the traced graph that the
schedule's passes place and the analyses see:

- forward and backward: each offloaded shard is copied to the device right before its
  all-gather (`prefetch` moves the copy with the all-gather, so the copy of unit i+1 is issued
  before unit i computes); the gradient of that copy is the copy back, so each reduced
  gradient shard goes to the host as soon as its reduce-scatter is waited;
- the update, `update="device"` (default): each offloaded buffer's gradient shard, parameter
  shard and optimizer state are copied to the device, updated there, and copied back (with
  `donate=True` into the state's own host buffers, `offload_copy_into`: no second host copy of
  the state; else into new ones); the pass
  `stream_offload_copies` moves every copy to the device right before its first reader and every
  copy to the host right after its source, so one buffer's state is on the device at a time.
  The arithmetic is the default step's, on the same device: the same bits.
- `update="host"`: no copies around the update: the optimizer (and the gradient norm) run on
  the host's tensors, on the host's kernels (`fs.optim.adamw(fused=True)`: torch's fused CPU
  AdamW). Fewer transfers; on a GPU the bits are the host kernels', not the device's (on a CPU
  there is one device and they are the same).

On a machine without a GPU host and device are the same memory, and each copy is a real copy
(a new buffer): the graph, the bits and the analyses are those of the GPU step.
"""

from __future__ import annotations

from typing import Any, Optional

import optree
import torch
from torch.library import custom_op

from ._pytree import NAMESPACE

__all__ = [
    "offload_copy", "offload_copy_into", "to_device", "to_host", "to_host_into", "place_on_host", "keep_pinned",
    "OFFLOAD_COPY", "OFFLOAD_COPY_INTO", "offloaded", "streamed", "map_buffers", "map_buffer_pairs",
]

HOST = torch.device("cpu")


@custom_op("functional_shard::offload_copy", mutates_args=())
def offload_copy(x: torch.Tensor, device: str, to_host: bool, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A copy of `x` on `device`, in `dtype` if given (a parameter shard copied to the device in
    its gather dtype, a gradient shard to the host in its shard's dtype: the cast and the copy
    are one node, which the passes move as they move a cast). A new buffer even where `device`
    is `x`'s own: on a machine without a GPU host and device are one memory, and the step's
    copies stay copies. `to_host`: the direction, for the passes and analyses (the device alone
    cannot say it where both are the CPU). Copies to a GPU are asynchronous from pinned memory;
    copies to the host wait for the data (the host may read them at once)."""
    target = torch.device(device)
    dtype = x.dtype if dtype is None else dtype
    if target == x.device:
        return x.to(dtype=dtype, copy=True)
    if to_host and x.device.type == "cuda":
        # Into pinned memory (torch's caching host allocator), so that the next step's copy back
        # is asynchronous; waited here, since the host may read it at once (the host update).
        out = torch.empty(x.shape, dtype=dtype, device=target, pin_memory=True)
        return out.copy_(x if x.dtype == dtype else x.to(dtype))
    return x.to(target, dtype=dtype, non_blocking=(not to_host) and x.is_pinned(), copy=True)


@offload_copy.register_fake
def _(x, device, to_host, dtype=None):
    return torch.empty_like(x, device=torch.device(device), dtype=x.dtype if dtype is None else dtype)


OFFLOAD_COPY = torch.ops.functional_shard.offload_copy.default


@custom_op("functional_shard::offload_copy_into", mutates_args=("out",))
def offload_copy_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """`x` (on the compute device) copied into `out` (host memory, same shape and dtype): the
    device update's result written back into the donated state's own host buffer
    (`sharded_step(..., donate=True)`), so no second host copy of the state is allocated. Waits
    for the data, as `offload_copy` to the host does; `out` stays pinned where it was."""
    out.copy_(x)


@offload_copy_into.register_fake
def _(out, x):
    return None


OFFLOAD_COPY_INTO = torch.ops.functional_shard.offload_copy_into.default


def to_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` (host memory) copied to the compute `device` (in `dtype`); not differentiable. A
    planned step's tensors (`init_abstract`: meta) stay meta."""
    return OFFLOAD_COPY(x, "meta" if x.device.type == "meta" else str(device), False, dtype)


def to_host(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x` copied to host memory (in `dtype`); not differentiable. Meta stays meta."""
    return OFFLOAD_COPY(x, "meta" if x.device.type == "meta" else str(HOST), True, dtype)


def to_host_into(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` copied into the host tensor `out`, which is returned (the donated state's buffer)."""
    OFFLOAD_COPY_INTO(out, x)
    return out


def place_on_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a state tensor, pinned where a GPU can copy from it asynchronously."""
    host = t.detach().to(HOST, copy=True)
    return host.pin_memory() if torch.cuda.is_available() and t.device.type == "cuda" else host


def keep_pinned(tree: Any, device: torch.device) -> Any:
    """`tree` with each host tensor that is not pinned copied into pinned memory, where the
    compute `device` is a GPU: a step that does not donate its state returns new host tensors
    (the host update's results, the device update's copies back), which torch allocates
    pageable; the next step's copies from them would be synchronous and slower. Elsewhere (one
    memory: no GPU) `tree` as it is."""
    if torch.device(device).type != "cuda":
        return tree

    def pinned(t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0 and not t.is_pinned():
            return t.pin_memory()
        return t

    return optree.tree_map(pinned, tree, none_is_leaf=False, namespace=NAMESPACE)


def offloaded(fn, spec) -> torch.device | None:
    """The compute device a CPU-offloaded buffer's shard is copied to, or None (not offloaded);
    `fn` is the step's `StepFunction` (its `offload` and `mesh`), or None."""
    if fn is None or fn.offload is None or not fn.offload.selects(spec.unit):
        return None
    return getattr(fn.mesh, "device", torch.device("cpu"))


def streamed(fn, layout) -> frozenset[str]:
    """The trainable buffers whose update runs on the device although they live on the host
    (`Offload(update="device")`)."""
    if fn.offload is None or fn.offload.update != "device":
        return frozenset()
    return frozenset(spec.name for spec in layout.buffers if spec.trainable and offloaded(fn, spec) is not None)


def map_buffers(opt_state, names: frozenset[str], fn) -> Any:
    """`opt_state` with `fn` applied to its per-buffer tensors of the buffers `names` (the
    optimizer state's parameter-like parts are dicts `buffer name -> shard`)."""
    return map_buffer_pairs(opt_state, opt_state, names, lambda _, leaf: fn(leaf))


def map_buffer_pairs(host_state, new_state, names: frozenset[str], fn) -> Any:
    """`new_state` with `fn(host, new)` in place of its per-buffer tensors of the buffers `names`,
    `host` the same leaf of `host_state` (the same structure: the optimizer state before and
    after the update)."""
    host_leaves = optree.tree_flatten(host_state, none_is_leaf=False, namespace=NAMESPACE)[0]
    paths, leaves, structure = optree.tree_flatten_with_path(new_state, none_is_leaf=False, namespace=NAMESPACE)
    if len(host_leaves) != len(leaves):
        raise RuntimeError("internal: the optimizer state changed structure in its update")
    mapped = [
        fn(host, leaf) if path and path[-1] in names and isinstance(leaf, torch.Tensor) else leaf
        for path, host, leaf in zip(paths, host_leaves, leaves)
    ]
    return optree.tree_unflatten(structure, mapped)
