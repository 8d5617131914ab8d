"""Tensor-parallel plans as placement rules: Hugging Face's `base_model_tp_plan` styles, and
the plan fs ships for `fs.models.GPT`.

A Hugging Face plan maps module paths relative to the base model (`"layers.*.self_attn.q_proj"`,
`*` a layer index) to a style name; fs places *leaves*, by their `fs.functionalize` paths
(`"model.layers.0.self_attn.q_proj.weight"`). Each style says how a module's weight and bias are
placed (`STYLES`); the style name stays on the rule (`Rule.style`) for the step that applies the
plan's activation collectives.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from ._placement import Placement, PlacementError, Replicated, Rule, Split

__all__ = ["STYLES", "rules_from_hf_plan", "hf_rules", "gpt_rules"]

_R = Replicated()

# Hugging Face style -> (weight placement, bias placement) on a tensor-parallel axis named "tp"
# (`rules_from_hf_plan` renames it). Linear weights are [out, in]: column-parallel splits the
# outputs (dim -2) and their bias; row-parallel splits the inputs (dim -1) and replicates the
# bias (added once, after the sum over ranks). Embeddings are [vocab, hidden].
STYLES: dict[str, tuple[Placement, Placement]] = {
    "colwise": (Split(-2, "tp"), Split(-1, "tp")),
    "colwise_rep": (Split(-2, "tp"), Split(-1, "tp")),
    "colwise_gather_output": (Split(-2, "tp"), Split(-1, "tp")),
    "rowwise": (Split(-1, "tp"), _R),
    "rowwise_rep": (Split(-1, "tp"), _R),
    "rowwise_split_input": (Split(-1, "tp"), _R),
    "packed_colwise": (Split(-2, "tp", chunks=2), Split(-1, "tp", chunks=2)),
    "packed_rowwise": (Split(-1, "tp", chunks=2), _R),
    "embedding_rowwise": (Split(0, "tp"), _R),
    "embedding_colwise": (Split(1, "tp"), _R),
    "sequence_parallel": (_R, _R),
    "replicate": (_R, _R),
    "replicated_with_grad_allreduce": (_R, _R),
}

# Modules whose split dimension is made of attention heads: cut only between heads (a fused
# projection holding each head's q, k and v rows together, GPT-NeoX's, between groups of three).
_HEAD_PROJECTIONS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1, "qkv_proj": 1, "query_key_value": 3, "dense": 1}


def _in_attention(key: str) -> bool:
    """A plan key of an attention module's projection (`dense` is GPT-NeoX's attention output;
    an MLP's `dense_*` or `mlp.dense` is not made of heads)."""
    parts = key.split(".")
    return parts[-1] != "dense" or any("attention" in p or "attn" in p for p in parts[:-1])


def _on_axis(placement: Placement, axis: str, granule: int) -> Placement:
    if isinstance(placement, Replicated):
        return placement
    return Split(placement.dim, axis, placement.chunks, granule)


def rules_from_hf_plan(
    plan: Mapping[str, str], *, prefix: str = "", axis: str = "tp", head_dim: int | None = None, required: bool = True
) -> list[Rule]:
    """Placement rules from a Hugging Face tensor-parallel plan (`config.base_model_tp_plan`).

    Arguments:
        plan: module path pattern -> style, e.g. `{"layers.*.self_attn.q_proj": "colwise"}`
            (`*` is a layer index, as in Hugging Face).
        prefix: prepended to every key to make fs's leaf paths: the base model's attribute and
            a dot (`"model."` for `LlamaForCausalLM`), `""` for a top-level plan.
        axis: the mesh axis to split over.
        head_dim: the attention head size: the splits of `q_proj`/`k_proj`/`v_proj`/`o_proj`
            cut only between heads (so heads, and grouped-query key/value heads, not divisible
            by the axis size are refused clearly by `placements_for`). None: no such check.
        required: whether each module's weight rule must match a leaf (bias rules never must).

    Returns two rules per module, `<module>.weight` then `<module>.bias`, each as a regular
    expression anchored at both ends, with the style name in `Rule.style`. Raises
    `PlacementError` for a style fs cannot place (expert parallelism, grouped GEMMs, MLA), naming it.
    """
    rules = []
    for key, style in plan.items():
        if style not in STYLES:
            raise PlacementError(
                f"tensor-parallel plan entry {key!r}: style {style!r} is not supported by fs.tensor_parallel; "
                f"supported styles: {sorted(STYLES)}. Override the entry with a supported style or leave the "
                f"module out of the plan (replicated)"
            )
        weight, bias = STYLES[style]
        name = key.rsplit(".", 1)[-1]
        granule = head_dim * _HEAD_PROJECTIONS[name] if head_dim and name in _HEAD_PROJECTIONS and _in_attention(key) else 1
        module = re.escape(prefix + key).replace(r"\*", r"\d+")
        for name, placement, must in (("weight", weight, required), ("bias", bias, False)):
            pattern = re.compile(rf"^{module}\.{name}$")
            rules.append(Rule(pattern, _on_axis(placement, axis, granule), must, style))
    return rules


def hf_rules(model: Any, *, axis: str = "tp", prefix: str | None = None, include_top_level: bool = True) -> list[Rule]:
    """Placement rules for a Hugging Face model from its own plan, over `fs.functionalize` paths.

        apply_fn, params = fs.functionalize(model)
        placements = fs.tensor_parallel.placements_for(params, fs.tensor_parallel.hf_rules(model), mesh)

    Arguments:
        model: a `PreTrainedModel` (e.g. `LlamaForCausalLM`), or its config (then pass `prefix`).
        axis: the mesh axis to split over.
        prefix: the base model's path and a dot; default: read from the model
            (`model.base_model_prefix`, `"model."` for `LlamaForCausalLM`, `""` for a bare
            `LlamaModel`), `"model."` for a config.
        include_top_level: add the model class's own plan (`_tp_plan`, e.g. `{"lm_head":
            "colwise_gather_output"}`) as optional rules: a head tied to the embedding is one
            leaf, the embedding's, and keeps the embedding's placement.

    Returns the base plan's rules, then the top level's. Raises `PlacementError` if the model
    has no plan or uses a style fs cannot place.
    """
    config = getattr(model, "config", model)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise PlacementError(
            f"{type(model).__name__} has no base_model_tp_plan: give placement rules yourself "
            f"(fs.tensor_parallel.rule(pattern, Split(dim, axis)))"
        )
    if prefix is None:
        if config is model:
            prefix = "model."
        else:
            base = getattr(model, "base_model_prefix", "")
            prefix = f"{base}." if base and getattr(model, base, model) is not model else ""
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    rules = rules_from_hf_plan(plan, prefix=prefix, axis=axis, head_dim=head_dim)
    top = getattr(type(model), "_tp_plan", None) if config is not model else None
    if include_top_level and top:
        rules += rules_from_hf_plan(top, prefix="", axis=axis, required=False)
    return rules


def gpt_rules(config: Any = None, *, axis: str = "tp", vocab_parallel: bool = True) -> list[Rule]:
    """The tensor-parallel plan fs ships for `fs.models.GPT`, as placement rules.

    Megatron's layout: `attn.qkv` column-parallel with q, k and v split alike (`chunks=3`, whole
    heads per rank), `attn.proj` row-parallel, `mlp.fc` column-parallel, `mlp.proj`
    row-parallel (row-parallel biases replicated); with `vocab_parallel`, the token embedding
    (and the head, tied to it or not) split along the vocabulary, for
    `vocab_parallel_cross_entropy`. Position embedding and LayerNorms replicated.

    Arguments:
        config: the model's `GPTConfig` (its head size makes splits cut between heads), or None.
        axis: the mesh axis to split over.
        vocab_parallel: split the token embedding and head along the vocabulary (default).

    Returns the rules (bias rules optional, for `bias=False` configs).
    """
    head = config.d_model // config.n_head if config is not None else 1
    rules = [
        Rule("blocks.*.attn.qkv.weight", Split(0, axis, chunks=3, granule=head), True, "colwise"),
        Rule("blocks.*.attn.qkv.bias", Split(0, axis, chunks=3, granule=head), False, "colwise"),
        Rule("blocks.*.attn.proj.weight", Split(1, axis, granule=head), True, "rowwise"),
        Rule("blocks.*.attn.proj.bias", Replicated(), False, "rowwise"),
        Rule("blocks.*.mlp.fc.weight", Split(0, axis), True, "colwise"),
        Rule("blocks.*.mlp.fc.bias", Split(0, axis), False, "colwise"),
        Rule("blocks.*.mlp.proj.weight", Split(1, axis), True, "rowwise"),
        Rule("blocks.*.mlp.proj.bias", Replicated(), False, "rowwise"),
    ]
    if vocab_parallel:
        rules += [
            Rule("tok_emb.weight", Split(0, axis), True, "embedding_rowwise"),
            Rule("head.weight", Split(0, axis), False, "colwise"),
        ]
    return rules
