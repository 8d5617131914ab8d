"""fs.tensor_parallel: tensor and sequence parallelism as values and explicit collectives.

Placements per leaf, placement rules (yours, a Hugging Face model's `base_model_tp_plan`, fs's
plan for `fs.models.GPT`), the differentiable conjugate collectives and the vocabulary-parallel
cross-entropy, usable inside any `loss_fn` (the `shard_map` way), and `parallelize`, which gives a
module's split Linears and Embeddings their collectives. `fs.sharded_step(..., placements=rules)`
cuts each leaf by its placement and shards the pieces over `fsdp` (docs/parallelism.md).

    mesh = fs.init_mesh({"fsdp": 2, "tp": 2})
    rules = fs.tensor_parallel.hf_rules(model)                  # or gpt_rules(config), or your own
    apply_fn, params = fs.functionalize(fs.tensor_parallel.parallelize(model, rules, mesh))
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-3), placements=rules)

    h = fs.tensor_parallel.copy_to(x, mesh, "tp")              # column-parallel input (f)
    y = fs.tensor_parallel.reduce_from(h_local @ w_row.T, mesh, "tp")   # row-parallel output (g)
    loss = fs.tensor_parallel.vocab_parallel_cross_entropy(local_logits, targets, mesh, "tp")
"""

from ._collectives import copy_to as copy_to
from ._collectives import gather_along as gather_along
from ._collectives import gather_leaf as gather_leaf
from ._collectives import reduce_from as reduce_from
from ._collectives import reduce_scatter_along as reduce_scatter_along
from ._collectives import scatter_along as scatter_along
from ._loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from ._modules import TensorParallelEmbedding as TensorParallelEmbedding
from ._modules import TensorParallelLinear as TensorParallelLinear
from ._modules import parallelize as parallelize
from ._modules import parallelized_modules as parallelized_modules
from ._placement import Placement as Placement
from ._placement import PlacementError as PlacementError
from ._placement import Replicated as Replicated
from ._placement import Rule as Rule
from ._placement import Split as Split
from ._placement import join_pieces as join_pieces
from ._placement import local_shape as local_shape
from ._placement import placements_for as placements_for
from ._placement import rule as rule
from ._placement import split_tensor as split_tensor
from ._plans import STYLES as STYLES
from ._plans import gpt_rules as gpt_rules
from ._plans import hf_rules as hf_rules
from ._plans import rules_from_hf_plan as rules_from_hf_plan

__all__ = [
    "Placement",
    "PlacementError",
    "Replicated",
    "Rule",
    "STYLES",
    "Split",
    "TensorParallelEmbedding",
    "TensorParallelLinear",
    "copy_to",
    "gather_along",
    "gather_leaf",
    "gpt_rules",
    "hf_rules",
    "join_pieces",
    "local_shape",
    "parallelize",
    "parallelized_modules",
    "placements_for",
    "reduce_from",
    "reduce_scatter_along",
    "rule",
    "rules_from_hf_plan",
    "scatter_along",
    "split_tensor",
    "vocab_parallel_cross_entropy",
]
