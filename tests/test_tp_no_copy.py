"""On a mesh with no shard axis (`{"tp": 2}`: tensor parallelism alone), the step's all-gather of a
parameter buffer is the identity: the traced step reads the parameter shards in place instead
of copying them (a copy alive from the forward to the backward: one more set of parameters per
rank; 5.8 of the 52.9 MiB peak of benchmarks/tensor_parallel.py's Llama at {"tp": 2}).

Planned on the meta device (`fs.analysis.plan` on an `AbstractMesh`, one process). That the
step keeps its bits is checked on gloo processes by tests/test_tp_step.py (traced == eager)."""

from __future__ import annotations

import torch

import functional_shard as fs
from functional_shard import tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)


def planned_graph(axes: dict):
    mesh = fs.analysis.AbstractMesh(axes, rank=0)
    with torch.device("meta"):
        model = GPT(CONFIG)
    rules = tp.gpt_rules(CONFIG)
    tp.parallelize(model, rules, mesh)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    ids = torch.empty(2, 16, dtype=torch.long, device="meta")
    analysis, compiled = fs.analysis.plan(loss_fn, params, (ids, ids), mesh=mesh, optimizer=fs.optim.adamw(lr=1e-3),
                                          placements=rules)  # fmt: skip
    return compiled.graph_module.graph


def copied_inputs(graph) -> list[tuple[str, tuple]]:
    """(input, shape) of every graph input the step copies with `aten.clone`."""
    return [
        (n.args[0].name, tuple(n.meta["val"].shape))
        for n in graph.nodes
        if n.target is torch.ops.aten.clone.default and n.args[0].op == "placeholder"
    ]


def test_tensor_parallelism_alone_reads_the_parameter_shards_in_place():
    assert copied_inputs(planned_graph({"tp": 2})) == []


def test_a_shard_axis_still_gathers_into_a_buffer_of_its_own():
    graph = planned_graph({"fsdp": 2, "tp": 2})
    gathers = [n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert gathers and copied_inputs(graph) == []
