"""Plain tensor parallelism (no sequence parallelism) sums every partial gradient once, and only
those (issues found by an adversarial pass, 2026-11-29):

- a parameter styled `replicated_with_grad_allreduce` (Qwen3's per-head `q_norm` / `k_norm`, run
  on each rank's own heads) gets its gradient all-reduced over `tp`: the single-process gradient,
  and the replicas stay equal after a step;
- a user's block that holds its column-parallel Linears directly and also reads its input
  elsewhere (a residual `x + ...`, a norm before the Linears) keeps that input's own gradient:
  only the Linears that read the block's input itself share its one `copy_to`.

Both against single-process training on the same batch: first-step gradients within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functional_shard as fs
from _meshes import mesh_of
import functional_shard.tensor_parallel as tp
from functional_shard.tensor_parallel import Replicated, Split


class Block(nn.Module):
    def __init__(self, d: int, h: int, norm: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d) if norm else nn.Identity()
        self.gate = nn.Linear(d, h)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x):
        y = self.norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Net(nn.Module):
    def __init__(self, norm: bool, d: int = 16, h: int = 32, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d, h, norm) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


RULES = [
    tp.rule("blocks.*.gate.*", Split(0, "tp"), style="colwise"),
    tp.rule("blocks.*.up.*", Split(0, "tp"), style="colwise"),
    tp.rule("blocks.*.down.weight", Split(1, "tp"), style="rowwise"),
    tp.rule("blocks.*.down.bias", Replicated(), style="rowwise"),
]


def _net(norm: bool) -> Net:
    torch.manual_seed(0)
    return Net(norm)


def _net_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 1, generator=g)


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    return Qwen3ForCausalLM(config)


def _ids():
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))


def _qwen_loss(logits, ids):
    logits = logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _first_grads(mesh) -> dict:
    torch.set_num_threads(1)
    mesh = mesh_of(mesh, {"tp": 2})
    out = {}
    for norm in (True, False):
        model = tp.parallelize(_net(norm), RULES, mesh)
        apply_fn, params = fs.functionalize(model)
        step = fs.sharded_step(lambda p, b: ((apply_fn(p, b[0]) - b[1]) ** 2).mean(), mesh, optimizer=fs.optim.sgd(0.1),
                               placements=RULES)  # fmt: skip
        grads = fs.gather(step.grad(step.init(params), _net_data())[0], full=True)
        out[f"net norm={norm}"] = {k: grads[k] for k in grads.trainable}
    model = _qwen3()
    rules = tp.hf_rules(model)
    tp.parallelize(model, rules, mesh)
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, ids: _qwen_loss(apply_fn(p, input_ids=ids).logits, ids), mesh,
                           optimizer=fs.optim.adamw(1e-2), placements=rules)  # fmt: skip
    state = step.init(params)
    grads = fs.gather(step.grad(state, _ids())[0], full=True)
    out["qwen3"] = {k: grads[k] for k in grads.trainable}
    state, _ = step(state, _ids())
    out["qwen3 k_norm after a step"] = fs.gather(state.params)["model.layers.0.self_attn.k_norm.weight"].clone()
    return out


def _reference(model: nn.Module, loss) -> dict:
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def test_partial_gradients_are_summed_once_and_only_those(local_world):
    pytest.importorskip("transformers.models.qwen3")
    got = local_world(2).run(_first_grads)
    expected = {}
    for norm in (True, False):
        net = _net(norm)
        x, y = _net_data()
        expected[f"net norm={norm}"] = _reference(net, ((net(x) - y) ** 2).mean())
    qwen = _qwen3()
    expected["qwen3"] = _reference(qwen, _qwen_loss(qwen(input_ids=_ids()).logits, _ids()))
    for rank, out in enumerate(got):
        for case, grads in expected.items():
            for name, g in grads.items():
                error = float((out[case][name] - g).norm() / g.norm().clamp_min(1e-30))
                assert error < 1e-5, (rank, case, name, error)
    assert torch.equal(got[0]["qwen3 k_norm after a step"], got[1]["qwen3 k_norm after a step"])
