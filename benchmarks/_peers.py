"""The arms of `compare.py` that run another library: DeepSpeed ZeRO-3 and torchtitan's SimpleFSDP.

Neither is a dependency of functional_shard: `bash benchmarks/setup_peers.sh` installs them in a
separate virtual environment. Where one is not installed, `missing(name)` says so and the harness
skips its arms with that note (the package's own tests never need them).

Both offer the four things of every arm (see `_arms.py`): `step`, `memory_roots`, `full_params`,
`comm_bytes`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch
from torch import nn

from _workloads import Workload


@functools.lru_cache(maxsize=None)
def missing(peer: str) -> str | None:
    """None when `peer` ("deepspeed", "simple_fsdp") can run here, else why not (a note for the report)."""
    if peer == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return "DeepSpeed not installed (bash benchmarks/setup_peers.sh)"
        return None
    if peer == "simple_fsdp":
        try:
            from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel  # noqa: F401
        except Exception as error:  # ImportError, or a torchtitan that does not import on this torch
            return f"torchtitan SimpleFSDP not importable ({type(error).__name__}: {error}; bash benchmarks/setup_peers.sh)"
        return None
    raise ValueError(f"unknown peer {peer!r}")


class DeepSpeedArm:
    """DeepSpeed ZeRO-3 (`deepspeed.initialize`, stage 3, every parameter partitioned:
    `stage3_param_persistence_threshold` 0, else parameters under 100k elements stay whole;
    reduce and prefetch buckets of one block; `stage3_max_reuse_distance` 0),
    AdamW as `torch.optim.AdamW` (`torch_adam`), fp32 or bf16 (`bf16.enabled`: bf16 parameters
    and gradients, fp32 master weights in the optimizer, as FSDP2's and fs's mixed precision)."""

    def __init__(self, name: str, model: nn.Module, workload: Workload, mesh, hyper, *, batch_size: int, bf16: bool = False):
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        os.environ.setdefault("LOCAL_RANK", str(mesh.rank))
        # The default group exists (fs.init_mesh made it): DeepSpeed's comm wraps it.
        deepspeed.init_distributed(dist_backend="gloo")
        # Buckets of one block (DeepSpeed's defaults, 5e8 elements, would allocate a 2 GB fp32
        # reduce buffer: a memory figure of the configuration, not of ZeRO-3), and every
        # parameter released after its use (reshard after forward, as fs's default schedule).
        block = max(sum(p.numel() for p in b.parameters()) for b in workload.blocks(model))
        config = {
            "train_micro_batch_size_per_gpu": batch_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "reduce_bucket_size": block,
                "stage3_prefetch_bucket_size": block,
                "stage3_max_reuse_distance": 0,
            },
            "zero_allow_untested_optimizer": True,
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": hyper.lr,
                    "betas": list(hyper.betas),
                    "eps": hyper.eps,
                    "weight_decay": hyper.weight_decay,
                    "torch_adam": True,
                },
            },
            "bf16": {"enabled": bf16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.name = name
        self.workload = workload
        self.bf16 = bf16
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.world_size = mesh.world_size

    def step(self, batch):
        inputs, targets = batch
        if self.bf16 and inputs.is_floating_point():
            inputs = inputs.to(torch.bfloat16)  # a DeepSpeed bf16 module computes in bf16 throughout
        output = self.engine(inputs)
        loss = self.workload.loss(output.float(), targets)
        self.engine.backward(loss)
        self.engine.step()

    def memory_roots(self):
        # ZeRO-3 keeps each parameter's partition in `ds_tensor` (the module's parameters are
        # empty between uses) and the optimizer's fp32 partitions in the wrapped torch optimizer.
        zero = self.optimizer
        partitions = [p.ds_tensor for p in self.engine.module.parameters()]
        flat = list(getattr(zero, "fp32_partitioned_groups_flat", []))
        return [self.engine.module, zero.optimizer, *partitions, *flat]

    def full_params(self):
        import deepspeed

        out = {}
        for name, p in self.engine.module.named_parameters():
            # A collective: every rank gathers the same parameters in the same order.
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().float().clone()
        # fp32 master weights live in the optimizer; the bf16 module holds their rounding.
        return out

    def comm_bytes(self):
        size = 2 if self.bf16 else 4
        padded = sum(p.ds_tensor.numel() * self.world_size for p in self.engine.module.parameters())
        return {
            "all_gather_bytes": 2 * padded * size,
            "reduce_scatter_bytes": padded * size,
            "all_reduce_bytes": 0,
            "bytes_source": "theory from DeepSpeed's partition sizes (ds_tensor x world size): every parameter "
            "gathered in forward and again in backward (persistence threshold 0), every gradient reduce-scattered "
            "once, in the parameters' dtype",
        }


class SimpleFsdpArm:
    """torchtitan's SimpleFSDP (`data_parallel(model, mesh, mode="fully_shard")`): parameters are
    DTensors sharded on dim 0, gathered by a parametrization in forward (their gradients
    reduce-scattered by its backward); eager, or `torch.compile`d (`compiled=True`, inductor)."""

    def __init__(self, name: str, model: nn.Module, workload: Workload, mesh, hyper, *, compiled: bool):
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

        self.name = name
        self.workload = workload
        self.world_size = mesh.world_size
        self.model = data_parallel(model, mesh.device_mesh, mode="fully_shard")
        self.forward = torch.compile(self.model) if compiled else self.model
        self.optimizer = hyper.torch_adamw(self.model.parameters())

    def step(self, batch):
        inputs, targets = batch
        # SimpleFSDP sums the ranks' gradients (Partial("sum"); torchtitan scales its loss
        # itself): dividing the loss by the world size makes it the mean, as in every arm.
        loss = self.workload.loss(self.forward(inputs), targets) / self.world_size
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def memory_roots(self):
        return [self.model, self.optimizer]

    def full_params(self):
        return {name: _full(p) for name, p in self.model.named_parameters()}

    def comm_bytes(self):
        full = sum(_padded_full_numel(p, self.world_size) * p.element_size() for p in self.model.parameters())
        return {
            "all_gather_bytes": 2 * full,
            "reduce_scatter_bytes": full,
            "all_reduce_bytes": 0,
            "bytes_source": "theory: SimpleFSDP gathers every parameter in forward and (recomputing the "
            "gather) in backward, and reduce-scatters every gradient once; full sizes padded to the world size",
        }


def _full(p: torch.Tensor) -> torch.Tensor:
    local = getattr(p, "full_tensor", None)
    return (local() if local is not None else p).detach().clone()


def _padded_full_numel(p: torch.Tensor, world_size: int) -> int:
    rows = p.shape[0] if p.dim() else 1
    per_row = p.numel() // rows if rows else 0
    return -(-rows // world_size) * world_size * per_row
