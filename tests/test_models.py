"""The reference models and the shipped text corpus: shapes, naming, torch.func, learnability."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call, grad

from functional_shard.data import TEXT_FILE, CharTokenizer, batches, load_text
from functional_shard.models import GPT, MLP, GPTConfig, SmallCNN

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def one_thread():
    """Run single-threaded: these models are tiny, and on a busy machine several intra-op threads
    contend so badly that a step takes tens of times longer than on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_gpt(vocab_size: int = 20, **overrides) -> GPT:
    fields = dict(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=4, d_model=32) | overrides
    return GPT(GPTConfig(**fields))


def trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def assert_func_grad_matches_autograd(module: torch.nn.Module, loss_of_output, *inputs) -> None:
    """torch.func.grad through functional_call equals the ordinary backward pass."""
    params = trainable(module)
    # Every non-trainable tensor is passed too, as a library would: copies, so the forward's
    # in-place BatchNorm updates do not leak between the two passes.
    others = {name: p.detach().clone() for name, p in module.named_parameters() if not p.requires_grad}
    others |= {name: b.clone() for name, b in module.named_buffers()}

    # The other tensors are an argument, not captured: torch.func refuses in-place updates
    # (BatchNorm's running statistics) of tensors captured from outside the transform.
    def loss_fn(params: dict[str, torch.Tensor], others: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of_output(functional_call(module, params | others, inputs))

    functional_grads = grad(loss_fn)(params, others)
    module.zero_grad()
    loss_of_output(module(*inputs)).backward()
    assert functional_grads.keys() == params.keys()
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(functional_grads[name], parameter.grad, msg=name)


# --- MLP ------------------------------------------------------------------------------------


def test_mlp_shapes_and_names():
    torch.manual_seed(0)
    model = MLP(d_in=5, d_hidden=8, d_out=3, n_blocks=2)
    assert model(torch.randn(4, 5)).shape == (4, 3)
    assert [name for name, _ in model.named_parameters()] == [
        "input_proj.weight", "input_proj.bias",
        "blocks.0.fc1.weight", "blocks.0.fc1.bias", "blocks.0.fc2.weight", "blocks.0.fc2.bias",
        "blocks.1.fc1.weight", "blocks.1.fc1.bias", "blocks.1.fc2.weight", "blocks.1.fc2.bias",
        "output_proj.weight", "output_proj.bias",
    ]  # fmt: skip


def test_mlp_func_grad():
    torch.manual_seed(0)
    model = MLP(5, 8, 3, n_blocks=2)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    assert_func_grad_matches_autograd(model, lambda out: F.mse_loss(out, y), x)


# --- SmallCNN -------------------------------------------------------------------------------


def test_cnn_shapes_frozen_stem_and_buffers():
    torch.manual_seed(0)
    model = SmallCNN(num_classes=7, in_channels=3)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"stem.weight", "stem.bias"}
    buffers = dict(model.named_buffers())
    for norm in ["stem_norm", "blocks.0.norm", "blocks.1.norm", "blocks.2.norm"]:
        assert {f"{norm}.running_mean", f"{norm}.running_var", f"{norm}.num_batches_tracked"} <= buffers.keys()
    assert buffers["stem_norm.num_batches_tracked"].dtype == torch.long
    assert buffers["stem_norm.num_batches_tracked"].item() == 1  # the forward above, in training mode


def test_cnn_func_grad_updates_batchnorm_buffers_passed_in():
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10, in_channels=1)
    x, y = torch.randn(4, 1, 12, 12), torch.randint(0, 10, (4,))
    assert_func_grad_matches_autograd(model, lambda out: F.cross_entropy(out, y), x)

    buffers = {name: b.clone() for name, b in model.named_buffers()}
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    grad(lambda p, b: F.cross_entropy(functional_call(model, p | frozen | b, (x,)), y))(trainable(model), buffers)
    # A library holding its own buffer copies sees the training-mode statistics update in them.
    assert buffers["blocks.0.norm.num_batches_tracked"].item() == model.blocks[0].norm.num_batches_tracked.item() + 1


# --- GPT ------------------------------------------------------------------------------------


def test_gpt_shapes():
    torch.manual_seed(0)
    model = small_gpt(vocab_size=20)
    idx = torch.randint(0, 20, (3, 11))
    logits = model(idx)
    assert logits.shape == (3, 11, 20) and logits.dtype == torch.float32


def test_gpt_tied_head_is_one_parameter_under_two_state_dict_names():
    model = small_gpt()
    assert model.head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    assert {"tok_emb.weight", "head.weight"} <= model.state_dict().keys()
    assert model.num_params() == sum(p.numel() for _, p in model.named_parameters())
    assert "blocks.1.attn.qkv.weight" in names and "blocks.1.mlp.proj.bias" in names


def test_gpt_is_deterministic_given_the_seed():
    idx = torch.randint(0, 20, (2, 16))
    outputs = []
    for _ in range(2):
        torch.manual_seed(3)
        outputs.append(small_gpt()(idx))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = small_gpt()
    idx = torch.randint(0, 20, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 20
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(changed)[:, 10:])


def test_gpt_func_grad_with_tied_weight():
    torch.manual_seed(0)
    model = small_gpt()
    idx = torch.randint(0, 20, (2, 16))
    assert_func_grad_matches_autograd(model, lambda out: F.cross_entropy(out.flatten(0, 1), idx.flatten()), idx)


def test_gpt_generate_extends_past_block_size():
    torch.manual_seed(0)
    model = small_gpt().eval()
    out = model.generate(torch.zeros(2, 1, dtype=torch.long), 20, temperature=0)
    assert out.shape == (2, 21) and out.dtype == torch.long
    sampled = model.generate(torch.zeros(1, 1, dtype=torch.long), 5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (1, 6)


def test_gpt_adamw_steps_reduce_char_loss_on_shipped_text():
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)
    torch.manual_seed(0)
    model = small_gpt(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1, d_model=48)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(150):
        x, y = batches(tokens, 16, 32, generator=generator)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Measured: from 3.94 (about log(vocab_size), a uniform guess) to 0.58 of that.
    assert sum(losses[-5:]) / 5 < 0.65 * losses[0], losses


# --- data -----------------------------------------------------------------------------------


def test_shipped_text_size_and_alphabet():
    text = load_text()
    assert 100_000 <= len(text.encode("ascii")) <= 300_000
    assert 30 <= CharTokenizer.from_text(text).vocab_size <= 80


def test_shipped_text_is_reproduced_by_the_generator_script():
    script = REPOSITORY / "tools" / "make_text.py"
    if not script.exists():
        pytest.skip("tools/make_text.py is not part of an installed package")
    spec = importlib.util.spec_from_file_location("make_text", script)
    make_text = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_text)
    assert make_text.DEFAULT_OUTPUT.name == TEXT_FILE
    assert make_text.make_text(20240607, 200_000) == load_text()


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="abc .\nXY", max_size=40))
def test_tokenizer_round_trip(text):
    tokenizer = CharTokenizer.from_text("abc .\nXYZ")
    ids = tokenizer.encode(text)
    assert ids.dtype == torch.long and ids.shape == (len(text),)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids.tolist()) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids.tolist())


def test_tokenizer_rejects_unknown_characters():
    with pytest.raises(KeyError):
        CharTokenizer.from_text("abc").encode("abd")


def test_batches_are_shifted_windows_drawn_from_the_generator():
    tokens = torch.arange(100)
    x, y = batches(tokens, 8, 10, generator=torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (8, 10) and x.dtype == torch.long
    torch.testing.assert_close(y, x + 1)  # arange: the next token is the next integer
    torch.testing.assert_close(x[:, 1:], x[:, :-1] + 1)  # contiguous windows
    again, _ = batches(tokens, 8, 10, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(x, again)
    other, _ = batches(tokens, 8, 10, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(x, other)


def test_batches_reach_the_last_token():
    tokens = torch.arange(12)
    x, y = batches(tokens, 200, 10, generator=torch.Generator().manual_seed(0))
    assert y.max().item() == 11 and x.min().item() == 0
