"""Attention with a causal mask made of constants runs as `is_causal=True`, as it does eagerly.

Hugging Face models decide on tensor values whether attention needs a mask: eagerly, a batch
without padding gets `scaled_dot_product_attention(..., is_causal=True)`; under any tracer
(fake tensors, as `fs.sharded_step` traces) they cannot read the values and build the causal
mask as a tensor instead (`masking_utils`: packed-sequence detection and the all-ones padding
check are skipped "when tracing"). The traced step then computes the same attention through
the masked kernel: every block computed and the mask read, instead of the causal kernel that
skips the upper half. On an H200 (1.1B Llama, 2048 tokens, cuDNN attention) that was 2.8x the
eager step's attention time, 24 ms of a 200 ms step, and the traced step's bits were not the
eager step's (another kernel).

`causal_masks(gm)` finds the fused attention nodes (CPU flash, memory-efficient, cuDNN;
forward and backward) whose mask depends on no input of the step (it is computed from
constants: positions, `arange`s), computes that mask once, and when it is exactly the causal
pattern (query i sees keys j <= i, over square attention; boolean, or additive with 0 and
-inf / the dtype's lowest value) drops it and sets `is_causal=True`: the node the eager step
runs. A mask computed from the batch (padding) is left alone: it changes with the data, and the
eager step uses it too. `fs.Schedule(causal_masks=False)` keeps every mask as traced.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ._graph import _is_pure

__all__ = ["causal_masks"]

aten = torch.ops.aten

# op -> the name of its mask argument (each also has `is_causal`)
_MASKED = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "attn_mask",
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_efficient_attention_backward.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention_backward.default: "attn_bias",
}


def causal_masks(gm: fx.GraphModule) -> int:
    """Rewrite every fused attention node of `gm` whose mask is made of constants and is the
    causal pattern to `is_causal=True` without a mask (see the module docstring); remove what
    computed the mask. Returns how many nodes were rewritten."""
    masks: dict[fx.Node, bool] = {}
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MASKED:
            continue
        mask = _argument(node, _MASKED[node.target])
        if not isinstance(mask, fx.Node) or _argument(node, "is_causal") or _argument(node, "dropout_p"):
            continue
        if mask not in masks:
            masks[mask] = _is_causal_constant(gm, mask, _query_key_lengths(node))
        if masks[mask]:
            _set_argument(node, _MASKED[node.target], None)
            _set_argument(node, "is_causal", True)
            rewritten += 1
    if rewritten:
        _erase_unused(gm, [m for m, causal in masks.items() if causal])
        gm.graph.lint()
        gm.recompile()
    return rewritten


def _schema_names(node: fx.Node) -> list[str]:
    return [a.name for a in node.target._schema.arguments]


def _argument(node: fx.Node, name: str):
    names = _schema_names(node)
    if name in node.kwargs:
        return node.kwargs[name]
    index = names.index(name)
    if index < len(node.args):
        return node.args[index]
    default = node.target._schema.arguments[index].default_value
    return default


def _set_argument(node: fx.Node, name: str, value) -> None:
    index = _schema_names(node).index(name)
    if name in node.kwargs or index >= len(node.args):
        node.update_kwarg(name, value)
    else:
        node.update_arg(index, value)


def _query_key_lengths(node: fx.Node) -> tuple[int, int] | None:
    """(query length, key length) of an attention node, from its traced query and key."""
    q, k = _argument(node, "query"), _argument(node, "key")
    shapes = [getattr(a, "meta", {}).get("val") for a in (q, k)]
    if not all(isinstance(s, torch.Tensor) and s.dim() >= 2 for s in shapes):
        return None
    try:
        return int(shapes[0].shape[-2]), int(shapes[1].shape[-2])
    except (TypeError, ValueError):  # symbolic lengths
        return None


def _is_causal_constant(gm: fx.GraphModule, mask: fx.Node, lengths: tuple[int, int] | None) -> bool:
    """Whether `mask` reads no input of the step and evaluates to the causal pattern for
    square attention of `lengths`."""
    if lengths is None or lengths[0] != lengths[1]:
        return False
    stack = [mask]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" or (node.op == "call_function" and not _is_pure(node)) or node.op not in ("call_function", "get_attr"):
            return False
        stack.extend(node.all_input_nodes)
    try:
        value = _evaluate(gm, mask, seen)
    except Exception:  # noqa: BLE001 - an op that cannot run here: keep the mask as traced
        return False
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != tuple(lengths):
        return False
    n = lengths[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return bool((value == causal).all())
    if not value.is_floating_point():
        return False
    lowest = torch.finfo(value.dtype).min
    allowed, blocked = value == 0, (value == float("-inf")) | (value == lowest)
    return bool((allowed == causal).all() and (blocked == ~causal).all())


def _evaluate(gm: fx.GraphModule, target: fx.Node, nodes: set[fx.Node]):
    """Run the nodes `nodes` (the constant subgraph computing `target`) with real tensors."""
    env: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:  # graph order is a topological order
        if node not in nodes:
            continue
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)
        if node is target:
            return env[node]
    raise RuntimeError("unreachable")


def _erase_unused(gm: fx.GraphModule, roots: list[fx.Node]) -> None:
    """Erase `roots` and what only they read, where nothing reads them any more."""
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.users or node.op not in ("call_function", "get_attr"):
            continue
        if node.op == "call_function" and not (_is_pure(node) or node.target is operator.getitem):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        stack.extend(inputs)
