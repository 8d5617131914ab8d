"""Layout invariance and tensor parallelism (issue 28), on gloo processes.

- At a fixed `tp` degree, `canonical_chunks` makes training independent of the data-parallel
  layout: `fs.models.GPT` (dropout, vocabulary-parallel embedding and loss, clipping, AdamW)
  at `{"fsdp": 1, "tp": 2}` and `{"fsdp": 2, "tp": 2}` gives the same parameters and losses,
  bit for bit. The tensor-parallel collectives see the same operands at both layouts (each
  data rank's chunks are computed alone, with the same shapes), so only the data-parallel
  sums could differ, and those follow the canonical tree.

Every rank pins one thread before it builds the step (`torch.set_num_threads(1)`): the thread
count changes how kernels split their sums.
"""

from __future__ import annotations

import torch

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

GPT_CONFIG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=4, d_model=32, dropout=0.1)
ROWS, LENGTH = 8, 12  # the global batch


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, GPT_CONFIG.vocab_size, (ROWS, LENGTH), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def train_gpt(_, axes: dict[str, int], chunks: int, steps: int, trace: bool = False):
    """`steps` of GPT at `axes` with `canonical_chunks=chunks`; rank 0 returns the full
    parameters, per-step losses and grad norms."""
    torch.set_num_threads(1)
    mesh = fs.init_mesh(axes)
    torch.manual_seed(0)
    rules = tp.gpt_rules(GPT_CONFIG)
    apply_fn, params = fs.functionalize(tp.parallelize(GPT(GPT_CONFIG), rules, mesh))

    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(1e-2, weight_decay=0.1))
    step = fs.sharded_step(
        loss_fn, mesh, optimizer=optimizer, placements=rules, canonical_chunks=chunks, schedule=fs.Schedule(trace=trace)
    )
    state = step.init(params)
    per = ROWS // mesh.data_size
    first = mesh.data_rank * per
    losses, norms = [], []
    for i in range(steps):
        state, metrics = step(state, tuple(t[first : first + per] for t in global_batch(i)))
        losses.append(metrics["loss"].clone())
        norms.append(metrics["grad_norm"].clone())
    full = fs.gather(state.params, full=True)
    if mesh.rank != 0:
        return None
    return {"params": {k: full[k].clone() for k in full.trainable}, "losses": losses, "norms": norms}


def test_fixed_tp_degree_is_invariant_across_data_parallel_layouts(local_world):
    one = local_world(2).run(train_gpt, {"fsdp": 1, "tp": 2}, 4, 3)[0]
    two = local_world(4).run(train_gpt, {"fsdp": 2, "tp": 2}, 4, 3)[0]
    traced = local_world(4).run(train_gpt, {"fsdp": 2, "tp": 2}, 4, 3, True)[0]
    for other in (two, traced):
        assert one["params"].keys() == other["params"].keys()
        differ = [k for k in one["params"] if not torch.equal(one["params"][k], other["params"][k])]
        assert not differ, differ
        assert all(torch.equal(a, b) for a, b in zip(one["losses"], other["losses"])), (one["losses"], other["losses"])
        assert all(torch.equal(a, b) for a, b in zip(one["norms"], other["norms"])), (one["norms"], other["norms"])
