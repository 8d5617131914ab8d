"""The arms of `compare.py`: one way each to train the same model on this rank.

Every arm offers the same four things, so the harness treats them alike:

* `step(batch)`: one full training step (forward, backward, optimizer update) on this rank's batch;
* `memory_roots()`: the long-lived objects that hold its state between steps, handed to
  `MemTracker.track_external` so that the tracker counts them (it only sees tensors created
  inside it otherwise);
* `full_params()`: the full, unsharded parameters by name (a collective: every rank calls it);
* `comm_bytes()`: bytes of full buffers all-gathered, reduce-scattered and all-reduced per step,
  and how the numbers were obtained.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import functional_shard as fs

import _peers
from _workloads import Workload

# `donate=True` lets the fs step update the state's tensors in place (as FSDP2, DDP and
# torch.optim do) instead of writing a new state next to the old one; used when the installed
# functional_shard has it.
FS_DONATE = "donate" in inspect.signature(fs.sharded_step).parameters

# Arm names, in table order.
FS_DEFAULT = "fs"
FS_PREFETCH0 = "fs prefetch 0"
FS_KEEP = "fs no reshard"
FSDP2_DEFAULT = "FSDP2"
FSDP2_TUNED = "FSDP2 prefetch+async"
DEEPSPEED = "DeepSpeed ZeRO-3"
SIMPLE_FSDP = "SimpleFSDP"
SIMPLE_FSDP_COMPILED = "SimpleFSDP compiled"
DDP = "DDP"
COMPUTE = "compute only"
# Mixed precision: bf16 parameters (gathered and computed in bf16), fp32 gradient reduction.
FS_BF16 = "fs bf16"
FSDP2_BF16 = "FSDP2 bf16"
DEEPSPEED_BF16 = "DeepSpeed bf16"
ARMS = (
    FS_DEFAULT, FS_PREFETCH0, FS_KEEP, FSDP2_DEFAULT, FSDP2_TUNED, DEEPSPEED, SIMPLE_FSDP, SIMPLE_FSDP_COMPILED,
    DDP, COMPUTE, FS_BF16, FSDP2_BF16, DEEPSPEED_BF16,
)
FS_ARMS = (FS_DEFAULT, FS_PREFETCH0, FS_KEEP, FS_BF16)
FSDP2_ARMS = (FSDP2_DEFAULT, FSDP2_TUNED)
# The sharded peers fs is measured against, fp32 and bf16.
PEER_ARMS = (FSDP2_DEFAULT, FSDP2_TUNED, DEEPSPEED, SIMPLE_FSDP, SIMPLE_FSDP_COMPILED)
BF16_PEER_ARMS = (FSDP2_BF16, DEEPSPEED_BF16)
BF16_ARMS = (FS_BF16, FSDP2_BF16, DEEPSPEED_BF16)
# Which installed library an arm needs beyond torch (see _peers.missing).
NEEDS = {DEEPSPEED: "deepspeed", DEEPSPEED_BF16: "deepspeed", SIMPLE_FSDP: "simple_fsdp", SIMPLE_FSDP_COMPILED: "simple_fsdp"}

FS_SCHEDULES = {
    FS_DEFAULT: fs.Schedule(),  # traced, prefetch 1, reshard after forward
    FS_PREFETCH0: fs.Schedule(prefetch=0),
    FS_KEEP: fs.Schedule(reshard_after_forward=False),
    FS_BF16: fs.Schedule(),
}
FS_BF16_PRECISION = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FSDP2_BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def missing(name: str) -> str | None:
    """None when arm `name` can run here, else why not (its peer library is not installed)."""
    return _peers.missing(NEEDS[name]) if name in NEEDS else None

# How many blocks ahead FSDP2's explicit prefetch reaches, forward and backward. 1 is FSDP2's
# own recommendation and, on this CPU, no slower than 2 (see docs/benchmarks.md): a deeper
# prefetch only queues more all-gathers on gloo's worker thread, which shares the cores with
# the compute anyway.
FSDP2_PREFETCH_DEPTH = 1


@dataclass(frozen=True)
class Hyper:
    """AdamW hyperparameters, the same for every arm and for the single-process reference."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def torch_adamw(self, params) -> torch.optim.AdamW:
        # foreach=False: the single-tensor kernel, which is what torch picks on CPU anyway and
        # what fs.optim.adamw transcribes op for op.
        return torch.optim.AdamW(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, foreach=False
        )

    def fs_adamw(self):
        return fs.optim.adamw(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class Arm(Protocol):
    """What the harness needs of an arm; see the module docstring."""

    name: str

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None: ...

    def memory_roots(self) -> list[Any]: ...

    def full_params(self) -> dict[str, torch.Tensor]: ...

    def comm_bytes(self) -> dict[str, Any]: ...


class FsArm:
    """`fs.sharded_step` with one of the schedules of `FS_SCHEDULES`."""

    def __init__(self, name: str, model: nn.Module, workload: Workload, mesh, hyper: Hyper):
        self.name = name
        apply_fn, params = fs.functionalize(model)

        def loss_fn(p, batch):
            inputs, targets = batch
            return workload.loss(apply_fn(p, inputs), targets)

        extra = {"donate": True} if FS_DONATE else {}
        if name == FS_BF16:
            extra["precision"] = FS_BF16_PRECISION
        self.step_fn = fs.sharded_step(
            loss_fn, mesh, optimizer=hyper.fs_adamw(), schedule=FS_SCHEDULES[name], **extra
        )
        self.state = self.step_fn.init(params)
        self.metrics: dict[str, Any] | None = None

    def step(self, batch):
        # Rebinding at once: with donation the old state's tensors now belong to the new one.
        self.state, self.metrics = self.step_fn(self.state, batch)

    def memory_roots(self):
        return list(fs.tree_leaves(self.state))

    def full_params(self):
        return fs.export(self.state)

    def comm_bytes(self):
        if self.metrics is None:
            raise RuntimeError(f"{self.name}: take a step before asking for its bytes")
        return {
            "all_gather_bytes": int(self.metrics["all_gather_bytes"]),
            "reduce_scatter_bytes": int(self.metrics["reduce_scatter_bytes"]),
            "all_reduce_bytes": 0,
            # With resharding, the backward gathers again the units it reads (not an embedding
            # or an input projection, whose gradients read the batch rather than their weights).
            "backward_all_gather_bytes": sum(
                e.nbytes for e in self.step_fn.schedule_events if e.event == "gather_issued" and e.phase == "backward"
            ),
            "bytes_source": "fs step metrics (full padded buffers of the traced step's collectives)",
        }

    def layout_figures(self) -> dict[str, int]:
        """Sizes the memory model of the targets needs: sharded trainable elements per rank,
        the largest full unit buffer, and the padding the flat buffers add."""
        buffers = self.state.params.layout.buffers
        return {
            "shard_numel": sum(b.shard_numel for b in buffers if b.trainable),
            "largest_unit_bytes": max(b.nbytes for b in buffers),
            "padded_bytes": sum(b.nbytes for b in buffers if b.trainable),
            "buffers": len(buffers),
        }


class TorchArm:
    """An `nn.Module` trained with `torch.optim.AdamW` the usual way."""

    def __init__(self, name: str, model: nn.Module, workload: Workload, hyper: Hyper):
        self.name = name
        self.model = model
        self.workload = workload
        self.optimizer = hyper.torch_adamw(model.parameters())

    def step(self, batch):
        inputs, targets = batch
        loss = self.workload.loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        # set_to_none (torch's default): no gradient survives between steps, as in fs.
        self.optimizer.zero_grad(set_to_none=True)

    def memory_roots(self):
        return [self.model, self.optimizer]

    def full_params(self):
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}


class Fsdp2Arm(TorchArm):
    """PyTorch FSDP2: `fully_shard` on every block, then on the root.

    Default: FSDP2's defaults (blocks reshard after forward, the root does not; implicit
    prefetching, which on CPU means none: each unshard is a blocking gloo all-gather).
    Tuned (`tuned=True`): its best CPU configuration: explicit forward and backward prefetch
    of the next `FSDP2_PREFETCH_DEPTH` blocks, and every unshard (pre-forward, pre-backward
    and the prefetches) issued with `async_op=True`, so a prefetched all-gather runs on gloo's
    thread while this block computes, and is waited in the next block's pre-forward hook.
    """

    def __init__(
        self, name: str, model: nn.Module, workload: Workload, mesh, hyper: Hyper, *, tuned: bool, bf16: bool = False
    ):
        self.world_size = mesh.world_size
        blocks = workload.blocks(model)
        policy = {"mp_policy": FSDP2_BF16_POLICY} if bf16 else {}
        for block in blocks:
            fully_shard(block, mesh=mesh.device_mesh, **policy)
        fully_shard(model, mesh=mesh.device_mesh, **policy)
        self.bf16 = bf16
        self.async_unshard = False
        if tuned:
            self.async_unshard = _tune_fsdp2(model, blocks, FSDP2_PREFETCH_DEPTH)
        super().__init__(name, model, workload, hyper)
        self.counted: dict[str, int] | None = None

    def counted_step(self, batch) -> None:
        """A step that also counts the bytes of FSDP2's all-gathers and reduce-scatters (not timed)."""
        with _count_fsdp2_collectives() as counts:
            self.step(batch)
        self.counted = dict(counts)

    def full_params(self):
        # DTensor.full_tensor all-gathers every parameter: a collective, same order on every rank.
        return {name: p.full_tensor().detach().clone() for name, p in self.model.named_parameters()}

    def comm_bytes(self):
        theory = self._theoretical_bytes()
        result = {
            "all_gather_bytes": theory["all_gather"],
            "reduce_scatter_bytes": theory["reduce_scatter"],
            "all_reduce_bytes": 0,
            "bytes_source": "theory from FSDP2's padded sharded parameter sizes (every group gathered in "
            "forward, groups that reshard after forward again in backward; every group reduce-scattered)",
        }
        if self.counted is not None:
            result["counted_all_gather_bytes"] = self.counted["all_gather"]
            result["counted_reduce_scatter_bytes"] = self.counted["reduce_scatter"]
            result["bytes_source"] += (
                "; counted_*: full buffers passed to torch.distributed.all_gather_single / "
                "reduce_scatter_single during one untimed step"
            )
        return result

    def _theoretical_bytes(self) -> dict[str, int]:
        all_gather = reduce_scatter = 0
        for module in self.model.modules():
            if not isinstance(module, FSDPModule):
                continue
            for group in module._get_fsdp_state()._fsdp_param_groups:
                numel = sum(p.padded_sharded_param_size.numel() * self.world_size for p in group.fsdp_params)
                # Gathered in param_dtype (bf16 under the policy), reduced in reduce_dtype (fp32).
                gathered = numel * (2 if self.bf16 else 4)
                # post_forward_mesh_info is None exactly when the group keeps its parameters
                # after forward (FSDP2 sets it so for the root at lazy init).
                regathered = group.post_forward_mesh_info is not None
                all_gather += gathered * (2 if regathered else 1)
                reduce_scatter += numel * 4
        return {"all_gather": all_gather, "reduce_scatter": reduce_scatter}


def _tune_fsdp2(model: nn.Module, blocks: list[nn.Module], depth: int) -> bool:
    """Explicit prefetch `depth` blocks ahead (forward and backward) and asynchronous unshards.

    Returns whether the asynchronous unshard could be switched on (it is FSDP2's private
    `_set_unshard_async_op`; without it, explicit prefetches on CPU block like the default)."""
    for i, block in enumerate(blocks):
        ahead = blocks[i + 1 : i + 1 + depth]
        behind = blocks[max(0, i - depth) : i][::-1]
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)
    # The root computes first (embeddings / input projection): it prefetches the first blocks.
    # In backward the root's parameters are still unsharded (FSDP2 keeps the root's after
    # forward), so the root's pre-backward prefetches the last blocks.
    model.set_modules_to_forward_prefetch(blocks[:depth])
    model.set_modules_to_backward_prefetch(blocks[::-1][:depth])
    setter = getattr(model, "_set_unshard_async_op", None)
    if setter is None:
        return False
    setter(True)
    return True


@contextlib.contextmanager
def _count_fsdp2_collectives() -> Iterator[dict[str, int]]:
    """Count the full-buffer bytes FSDP2 hands to gloo, by wrapping the two functions its
    default all-gather and reduce-scatter call (looked up on `torch.distributed` at call time)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counting_all_gather(output_tensor, input_tensor, *args, **kwargs):
        counts["all_gather"] += output_tensor.numel() * output_tensor.element_size()
        return all_gather(output_tensor, input_tensor, *args, **kwargs)

    def counting_reduce_scatter(*args, **kwargs):
        full = kwargs["input"] if "input" in kwargs else args[1]
        counts["reduce_scatter"] += full.numel() * full.element_size()
        return reduce_scatter(*args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = counting_all_gather, counting_reduce_scatter
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter


class DdpArm(TorchArm):
    """`DistributedDataParallel` with its defaults (25 MB buckets, all-reduce overlapped with backward)."""

    def __init__(self, name: str, model: nn.Module, workload: Workload, hyper: Hyper):
        super().__init__(name, DistributedDataParallel(model), workload, hyper)

    def full_params(self):
        return {name: p.detach().clone() for name, p in self.model.module.named_parameters()}

    def comm_bytes(self):
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.module.parameters() if p.requires_grad)
        return {
            "all_gather_bytes": 0,
            "reduce_scatter_bytes": 0,
            "all_reduce_bytes": grad_bytes,
            "bytes_source": "theory: DDP all-reduces every gradient once (Ψ×4 bytes, in 25 MB buckets); "
            "a ring all-reduce moves as much as a reduce-scatter plus an all-gather of the same buffer",
        }


class ComputeArm(TorchArm):
    """The floor: the same model and optimizer on this rank's batch alone, no collectives.
    It runs on every rank at once so that it sees the same contention for the cores."""

    def full_params(self):
        raise RuntimeError("the compute-only arm trains on one rank's batch: it has no single-process twin")

    def comm_bytes(self):
        return {"all_gather_bytes": 0, "reduce_scatter_bytes": 0, "all_reduce_bytes": 0, "bytes_source": "no collectives"}


def make_arm(name: str, base: nn.Module, workload: Workload, mesh, hyper: Hyper, *, batch_size: int) -> Arm:
    """A fresh arm `name`, starting from a copy of `base`'s weights (`missing(name)` must be None)."""
    model = copy.deepcopy(base)
    if name in FS_ARMS:
        return FsArm(name, model, workload, mesh, hyper)
    if name in FSDP2_ARMS:
        return Fsdp2Arm(name, model, workload, mesh, hyper, tuned=name == FSDP2_TUNED)
    if name == FSDP2_BF16:
        # FSDP2's best CPU configuration (prefetch + asynchronous unshards) under the bf16 policy.
        return Fsdp2Arm(name, model, workload, mesh, hyper, tuned=True, bf16=True)
    if name in (DEEPSPEED, DEEPSPEED_BF16):
        return _peers.DeepSpeedArm(name, model, workload, mesh, hyper, batch_size=batch_size, bf16=name == DEEPSPEED_BF16)
    if name in (SIMPLE_FSDP, SIMPLE_FSDP_COMPILED):
        return _peers.SimpleFsdpArm(name, model, workload, mesh, hyper, compiled=name == SIMPLE_FSDP_COMPILED)
    if name == DDP:
        return DdpArm(name, model, workload, hyper)
    if name == COMPUTE:
        return ComputeArm(name, model, workload, hyper)
    raise ValueError(f"unknown arm {name!r}; expected one of {ARMS}")
