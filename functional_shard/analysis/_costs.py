"""What each node of a traced step costs: floating-point operations and bytes of memory traffic.

Both are read from the shapes in `node.meta["val"]` (fake tensors), so a step that does not
fit on this machine — or on any — can be costed. FLOPs come from the registry of
`torch.utils.flop_counter` (what `FlopCounterMode` counts: matrix products, convolutions,
attention; elementwise ops count 0 there). Bytes are those of the node's tensor inputs and
outputs, the traffic of a kernel that reads its inputs once and writes its outputs once;
views and collectives move no bytes through the compute units (a collective's bytes are its
message, counted separately).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from ..schedule._liveness import tensors_of
from ..schedule._lower import release

__all__ = ["NodeCost", "node_cost", "op_class", "tensors_of", "is_view", "COLLECTIVE_OPS", "OP_CLASSES"]

_C10D = torch.ops._c10d_functional
# The functional collectives a traced step holds (their own names, not fs.schedule's private tables).
COLLECTIVE_OPS = frozenset(
    (
        _C10D.all_gather_into_tensor.default,
        _C10D.all_gather_into_tensor_out.default,
        _C10D.reduce_scatter_tensor.default,
        _C10D.all_to_all_single.default,
        _C10D.all_reduce.default,
        _C10D.wait_tensor.default,
    )
)


class NodeCost(NamedTuple):
    """The cost of one node."""

    flops: int  # floating-point operations (multiply-adds count 2), from torch's flop registry
    bytes: int  # bytes read and written: its tensor inputs plus its tensor outputs (0 for views)
    matmul: bool  # whether the FLOPs are a matrix product's (run at matmul throughput)
    numel: int = 0  # elements of its largest tensor input or output (what a CPU kernel loops over)
    kind: str = "elementwise"  # its class of kernel (`op_class`)
    ops: int = 0  # arithmetic the flop registry does not count (`elementwise_ops`)
    dtype: str = ""  # dtype of its first tensor output ("bfloat16", "float32", ...): which peak its FLOPs run at
    attention: bool = False  # a fused attention kernel (`_scaled_dot_product_*`, forward or backward)
    causal: bool = False  # ... called causal: the kernel skips the masked half of the FLOPs torch counts


# Classes of kernels whose time per element differs by several times on a CPU: a `Machine`
# may carry a measured time curve per class (`fs.analysis.calibrate` measures one operation
# of each). Operations not listed are "elementwise" (one arithmetic operation per element;
# `sqrt` and `rsqrt` too: one vector instruction each, measured at half an `exp`'s time per
# element in a step's optimizer).
_CLASSES = {
    "transcendental": (
        "exp", "exp2", "expm1", "log", "log1p", "log2", "pow", "tanh", "tanh_backward",
        "sigmoid", "sigmoid_backward", "silu", "silu_backward", "gelu", "gelu_backward", "erf", "erfinv",
        "sin", "cos", "reciprocal", "_softmax", "_softmax_backward_data", "_log_softmax",
        "_log_softmax_backward_data", "native_dropout", "native_dropout_backward", "softplus", "elu",
    ),
    "reduction": (
        "sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "norm", "linalg_vector_norm",
        "prod", "any", "all", "argmax", "argmin", "logsumexp", "nll_loss_forward", "nll_loss2d_forward",
    ),
    "normalization": (
        "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
        "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional", "native_group_norm", "native_group_norm_backward",
    ),
    "copy": (
        "clone", "_to_copy", "copy", "copy_", "cat", "stack", "slice_backward", "select_backward",
        "embedding", "embedding_dense_backward", "index", "index_select", "index_put", "index_put_",
        "_unsafe_index", "_unsafe_index_put", "gather", "scatter", "scatter_add", "zeros", "zeros_like",
        "ones", "ones_like", "full", "full_like", "empty", "empty_like", "new_zeros", "new_empty",
        "new_full", "fill", "fill_", "constant_pad_nd", "nll_loss_backward", "repeat", "expand_copy",
        "permute_copy", "split_with_sizes_copy", "roll", "tril", "triu", "flip",
    ),
    "select": ("where", "masked_fill", "masked_fill_", "masked_scatter"),
}
OP_CLASSES = ("matmul", "view", "elementwise", *_CLASSES, "offload")
_CLASS_OF = {name: kind for kind, names in _CLASSES.items() for name in names}
_CLASS_OF["offload_copy"] = "offload"  # CPU offload's host <-> device copies (`Machine.host_bandwidth`)
_CLASS_OF["offload_copy_into"] = "offload"  # ... into the donated state's host buffers


# Ops that return a view of their input although their schema does not say so: no kernel runs.
_UNANNOTATED_VIEWS = frozenset((torch.ops.aten._unsafe_view.default,))


def op_class(node: fx.Node) -> str:
    """The class of kernel `node` runs: "view", "matmul" (FLOPs counted by torch's registry),
    or one of `OP_CLASSES`' per-element classes, by the operation's name."""
    if is_view(node) or node.target in _UNANNOTATED_VIEWS:
        return "view"
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet in flop_registry:
        return "matmul"
    name = getattr(packet, "__name__", getattr(node.target, "__name__", ""))
    return _CLASS_OF.get(name, "elementwise")


# Arithmetic operations per element of the fused elementwise kernels (the rest count one):
# addcmul: self + value * t1 * t2; addcdiv: self + value * t1 / t2; lerp: self + w * (end - self).
_FUSED = {"addcmul": 3, "addcmul_": 3, "addcdiv": 3, "addcdiv_": 3, "lerp": 3, "lerp_": 3}
_NORMALIZATION_OPS = 5  # per element: mean, variance, subtract, scale, shift (or their backward)


def elementwise_ops(kind: str, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Arithmetic operations of a kernel that torch's flop registry counts as 0 (XLA's
    `cost_analysis` counts them): one per output element of an elementwise, transcendental or
    select kernel (three for the fused `addcmul`, `addcdiv`, `lerp`), one per input element of
    a reduction, five per input element of a normalization; none for copies and views."""
    if kind in ("elementwise", "transcendental", "select"):
        return _FUSED.get(name, 1) * sum(t.numel() for t in outputs)
    if kind == "reduction":
        return max((t.numel() for t in inputs), default=0)
    if kind == "normalization":
        return _NORMALIZATION_OPS * max((t.numel() for t in inputs), default=0)
    return 0



def is_view(node: fx.Node) -> bool:
    """Its output aliases an input without writing it (view, t, split, getitem, ...)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def node_cost(node: fx.Node) -> NodeCost:
    """FLOPs and bytes of `node` (0 and 0 for placeholders, outputs, views and collectives)."""
    if node.op != "call_function" or node.target in COLLECTIVE_OPS:
        return NodeCost(0, 0, False)
    if is_view(node) or node.target in _ALLOCATIONS or node.target is release or node.target in _UNANNOTATED_VIEWS:
        return NodeCost(0, 0, False, 0, "view")  # allocating or freeing memory moves no data either
    outputs = tensors_of(node.meta.get("val"))
    inputs = [t for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))]
    traffic = sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in outputs)
    packet = getattr(node.target, "overloadpacket", None)
    flops = 0
    if packet is not None and packet in flop_registry:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        flops = int(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
    numel = max((t.numel() for t in (*inputs, *outputs)), default=0)
    kind = op_class(node)
    name = getattr(packet, "__name__", "")
    ops = 0 if flops else elementwise_ops(kind, name, inputs, outputs)
    attention = "scaled_dot_product" in name
    causal = attention and bool(_argument(node, "is_causal"))
    dtype = str(outputs[0].dtype).removeprefix("torch.") if outputs else ""
    return NodeCost(flops, traffic, flops > 0, numel, kind, ops, dtype, attention, causal)


def _argument(node: fx.Node, name: str):
    """The value of argument `name` of a call, positional or keyword (None when absent)."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == name:
            return node.args[i] if i < len(node.args) else argument.default_value
    return None
