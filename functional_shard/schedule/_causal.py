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

import torch
from torch import fx

from torch._subclasses.fake_tensor import FakeTensor

from ._graph import _is_pure, _is_view
from ._remat import written_inputs

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
    computed the mask. Returns how many nodes were rewritten; `gm.meta["causal_masks"]` says,
    for each masked attention node, what was done and why (`step.explain()` prints it)."""
    verdicts: dict[fx.Node, tuple[str, set[fx.Node]]] = {}  # mask -> (verdict, the nodes that make it)
    report: list[str] = []
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MASKED:
            continue
        mask = _argument(node, _MASKED[node.target])
        if not isinstance(mask, fx.Node):
            continue
        if _argument(node, "is_causal") or _argument(node, "dropout_p"):
            report.append(f"{node.name}: mask kept (is_causal or dropout already set)")
            continue
        if mask not in verdicts:
            made: set[fx.Node] = set()
            verdicts[mask] = _causal_constant(gm, mask, node, _query_key_lengths(node), made), made
        if verdicts[mask][0] == "causal":
            _set_argument(node, _MASKED[node.target], None)
            _set_argument(node, "is_causal", True)
            rewritten += 1
            report.append(f"{node.name}: constant causal mask {mask.name} -> is_causal=True")
        else:
            report.append(f"{node.name}: mask {mask.name} kept ({verdicts[mask][0]})")
    if report:
        gm.meta["causal_masks"] = tuple(report)
    if rewritten:
        _erase_unused(gm, set().union(*(made for verdict, made in verdicts.values() if verdict == "causal")))
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


def _causal_constant(
    gm: fx.GraphModule, mask: fx.Node, reader: fx.Node, lengths: tuple[int, int] | None, made: set[fx.Node]
) -> str:
    """"causal" when `mask` reads no input of the step, nothing else writes what it is made of
    before `reader` reads it, and it evaluates to the causal pattern for square attention of
    `lengths`; else why not. Fills `made` with the nodes that make the mask (what it reads, and
    what writes into that), as far as it looked."""
    if lengths is None or lengths[0] != lengths[1]:
        return f"attention of {lengths}, not square with static lengths"
    stack = [mask]
    while True:
        while stack:
            node = stack.pop()
            if node in made:
                continue
            if node.op == "placeholder":
                return "it is computed from the step's inputs"
            if node.op not in ("call_function", "get_attr"):
                return f"it reads {node.op} {node.name}"
            made.add(node)
            stack.extend(node.all_input_nodes)
        aliases = set(made)  # what the mask is made of, and the views of it
        for node in gm.graph.nodes:
            if node is reader:
                break
            if node not in aliases and _is_view(node) and node.args and node.args[0] in aliases:
                aliases.add(node)
        for node in gm.graph.nodes:  # in-place writes into it (through a view too), before it is read
            if node is reader:
                break
            if node not in made and node.op == "call_function" and not _is_pure(node):
                written = [w for w in written_inputs(node) if w in aliases]
                if written:
                    stack += [node, *written]
        if not stack:
            break
    try:
        value = _evaluate(gm, mask, made)
    except Exception as error:  # noqa: BLE001 - an op that cannot run here: keep the mask as traced
        return f"it could not be computed at trace time ({type(error).__name__}: {str(error)[:120]})"
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != tuple(lengths):
        return f"its shape {tuple(getattr(value, 'shape', ()))} is not (..., {lengths[0]}, {lengths[1]})"
    n = lengths[0]
    causal = torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
    if value.dtype == torch.bool:
        return "causal" if bool((value == causal).all()) else "not the causal pattern"
    if not value.is_floating_point():
        return f"its dtype {value.dtype} is neither bool nor floating"
    lowest = torch.finfo(value.dtype).min
    allowed, blocked = value == 0, (value == float("-inf")) | (value == lowest)
    return "causal" if bool((allowed == causal).all() and (blocked == ~causal).all()) else "not the causal pattern"


def _evaluate(gm: fx.GraphModule, target: fx.Node, nodes: set[fx.Node]):
    """Run the nodes `nodes` (the constant subgraph computing `target`, with the in-place
    writes into it) in graph order with real tensors; `target`'s value after all of them."""
    env: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:  # graph order is a topological order
        if node not in nodes:
            continue
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if isinstance(value, FakeTensor):
                raise RuntimeError(f"the constant {node.target} is a fake tensor")
            env[node] = value.clone() if isinstance(value, torch.Tensor) else value  # the mask's ops may write it
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)
    return env[target]


def _erase_unused(gm: fx.GraphModule, made: set[fx.Node]) -> None:
    """Erase the nodes of `made` (rewritten masks and what made them) that nothing else needs:
    a node stays if a node outside the erased ones reads it, and an in-place write stays with
    what it writes (a buffer another node also reads keeps its writes)."""
    dead = set(made)
    while True:
        alive = {n for n in dead if any(u not in dead for u in n.users) or any(w not in dead for w in written_inputs(n))}
        if not alive:
            break
        dead -= alive
    for node in reversed(list(gm.graph.nodes)):  # every reader of a node comes after it
        if node in dead:
            gm.graph.erase_node(node)
