"""The zero-bubble split of a stage's backward (`functional_shard/_split_backward.py`, issue 27).

I (`backward_input`) computes the inputs' gradients through the input path only and keeps the
gradients reaching the nodes where a parameter's path joins it; W (`backward_weight`) computes
the parameters' gradients from there. Checked on hand-built graphs and on a GPT stage:

- I's input gradients and W's weight gradients are one full `autograd.grad`'s, bit for bit: two
  linears, a parameter used twice (and one used three times, on both sides of a transpose), a
  parameter reached only from the root side, an output of parameters alone, a frozen and an
  unused parameter; a custom Function taking a parameter on the input path (a Python node);
- W does not run the input path again: a custom Function on the input path counts one backward
  per micro-batch across I and W (the earlier W, a second `autograd.grad` from the roots,
  counted three), and on a GPT stage I and W together dispatch the matmuls of one backward;
- a stage without differentiable inputs (stage 0): I computes nothing, W all of it, same bits;
- memory: I frees the output side above the parameters' paths (the loss's log-softmax), W the rest;
- in a pipeline (`{"pp": 2}`, tied GPT): zero-bubble schedules with rematerialized stages give
  GPipe's bits, and with dropout ZB-H1 (remat or not) gives 1F1B's.
"""

from __future__ import annotations

import collections
import gc

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import functional_shard as fs
from functional_shard._split_backward import backward_input, backward_weight
from functional_shard.models import GPT, GPTConfig


class Counted(torch.autograd.Function):
    """The identity, counting its backward calls."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Counted.calls += 1
        return g


class Scale(torch.autograd.Function):
    """`x * w` as a custom Function: a Python node that joins a parameter to the input path."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(0)


def _leaves(seed: int):
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape, grad=True):
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    x = leaf(6, 8)
    params = {
        "w1": leaf(16, 8), "b1": leaf(16), "w2": leaf(8, 16), "shared": leaf(8), "root_side": leaf(8),
        "only_params": leaf(3), "thrice": leaf(8, 8), "scale": leaf(8), "frozen": leaf(8, grad=False),
        "unused": leaf(5),
    }  # fmt: skip
    return x, params


def _forward(x, p):
    """Two linears, `shared` used twice, `thrice` three times, `root_side` added at the root, a
    second output of parameters alone, a Python node on the input path; `unused` unused."""
    h = Counted.apply(x)
    h = F.linear(h, p["w1"], p["b1"]).tanh()
    h = Counted.apply(h)
    h = F.linear(h, p["w2"]) * p["shared"]
    h = Scale.apply(h, p["scale"])
    h = (h @ p["thrice"]).sin() @ p["thrice"].t() + (h @ p["thrice"]).cos()
    h = (h + p["frozen"]).relu() * p["shared"] + p["root_side"] * p["root_side"].sum()
    return [h, (p["only_params"] * 2).exp() * p["root_side"][:3]]


def _cotangents(outputs, seed):
    g = torch.Generator().manual_seed(seed + 1000)
    return [torch.randn(o.shape, generator=g) for o in outputs]


@pytest.mark.parametrize("seed", range(8))
def test_input_and_weight_halves_are_one_backward_bit_for_bit(seed):
    x, p = _leaves(seed)
    outputs = _forward(x, p)
    cotangents = _cotangents(outputs, seed)
    trainable = [v for v in p.values() if v.requires_grad]
    full = torch.autograd.grad(outputs, trainable + [x], cotangents, allow_unused=True)
    x, p = _leaves(seed)
    outputs = _forward(x, p)
    got_inputs, split = backward_input(outputs, cotangents, [x], list(p.values()))
    del outputs  # W needs nothing the caller holds
    gc.collect()
    got = dict(zip(p, backward_weight(split)))
    assert torch.equal(got_inputs[0], full[-1])
    expected = dict(zip([k for k, v in p.items() if v.requires_grad], full[:-1]))
    assert got["frozen"] is None and got["unused"] is None and expected["unused"] is None
    for name, g in expected.items():
        if g is not None:
            assert torch.equal(got[name], g), name


def test_weight_half_does_not_run_the_input_path_again():
    """3 micro-batches, each I before any W (as ZB-H1's steady state): `Counted` sits twice on the
    input path, so one backward per micro-batch is 2 calls; the earlier W (a second
    `autograd.grad` from the roots, the graph retained by I) ran the one above w1 again."""
    graphs = []
    for m in range(3):
        x, p = _leaves(m)
        graphs.append((x, p, _forward(x, p)))
    Counted.calls = 0
    splits = []
    for m, (x, p, outputs) in enumerate(graphs):
        splits.append(backward_input(outputs, _cotangents(outputs, m), [x], list(p.values()))[1])
    graphs = [(x, p) for x, p, _ in graphs]
    assert Counted.calls == 2 * 3
    for split in splits:
        backward_weight(split)
    assert Counted.calls == 2 * 3

    x, p = _leaves(0)
    outputs = _forward(x, p)  # the control: the earlier W ran again the `Counted` above w1
    Counted.calls = 0
    cotangents = _cotangents(outputs, 0)
    torch.autograd.grad(outputs, [x], cotangents, retain_graph=True)
    torch.autograd.grad(outputs, [v for v in p.values() if v.requires_grad], cotangents, allow_unused=True)
    assert Counted.calls == 2 + 1


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _gpt_last_stage():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=80, block_size=32, n_layer=2, n_head=2, d_model=64, tie_weights=False))
    params = [p for n, p in model.named_parameters() if not n.endswith("_emb.weight")]

    def stage(h, y):
        for b in model.blocks:
            h = b(h)
        return F.cross_entropy(model.head(model.ln_f(h)).flatten(0, 1), y.flatten())

    h = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return stage, params, h, torch.randint(0, 80, (2, 32), generator=torch.Generator().manual_seed(2))


def test_gpt_stage_input_and_weight_halves_dispatch_one_backward():
    """A GPT's last stage (2 blocks, final norm, head, cross-entropy): I and W together dispatch
    the matmuls of one backward (9 + 9 = 18 mm, 8 bmm), each layer norm's backward once per half
    (input side, then weight side), and give its bits."""
    stage, params, h, y = _gpt_last_stage()
    loss = stage(h, y)
    with _Ops() as whole:
        full = torch.autograd.grad([loss], params + [h])
    loss = stage(h, y)
    with _Ops() as i:
        got_inputs, split = backward_input([loss], [torch.ones_like(loss)], [h], params)
    del loss
    with _Ops() as w:
        got = backward_weight(split)
    assert torch.equal(got_inputs[0], full[-1])
    assert all(torch.equal(a, b) for a, b in zip(got, full[:-1]))
    for op in ("aten.mm", "aten.bmm", "aten.addmm", "aten._softmax_backward_data", "aten.gelu_backward"):
        assert i.count[op] + w.count[op] == whole.count[op], (op, i.count[op], w.count[op], whole.count[op])
    assert w.count["aten.mm"] == i.count["aten.mm"] == 9 and w.count["aten.bmm"] == 0
    norms = whole.count["aten.native_layer_norm_backward"]
    assert i.count["aten.native_layer_norm_backward"] == w.count["aten.native_layer_norm_backward"] == norms == 5


def test_stage_without_differentiable_inputs_leaves_everything_to_w():
    """Stage 0: no input needs a gradient. I dispatches nothing; W is the full backward (an
    embedding, a parameter sent on as an output as a tied weight is, a root seeded once)."""
    g = torch.Generator().manual_seed(0)
    emb, w = torch.randn(10, 4, generator=g).requires_grad_(), torch.randn(4, 4, generator=g).requires_grad_()
    ids = torch.randint(0, 10, (3, 5), generator=g)

    def forward():
        h = (F.embedding(ids, emb) @ w).tanh() @ w
        return [h, emb]  # the tied weight travels on to the last stage

    outputs = forward()
    cotangents = [torch.randn(o.shape, generator=g) for o in outputs]
    full = torch.autograd.grad(outputs, [emb, w], cotangents)
    outputs = forward()
    with _Ops() as i:
        got_inputs, split = backward_input(outputs, cotangents, [], [emb, w])
    del outputs
    assert got_inputs == [] and sum(i.count.values()) == 0, i.count
    got = backward_weight(split)
    assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])


def _saved(run):
    """`run()` and a weak reference per storage autograd saved while it ran."""
    refs = {}

    def pack(t):
        storage = t.untyped_storage()
        refs[StorageWeakRef(storage).cdata] = (StorageWeakRef(storage), storage.nbytes())
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, refs


def test_input_half_frees_the_output_side_and_weight_half_the_rest():
    stage, params, h, y = _gpt_last_stage()
    held = {t.untyped_storage()._cdata for t in params + [h, y]}
    loss, refs = _saved(lambda: stage(h, y))
    refs = {k: r for k, r in refs.items() if k not in held}
    log_softmax = [k for k, (_, n) in refs.items() if n == 2 * 32 * 80 * 4]  # (rows x length, vocab) fp32

    def alive():
        gc.collect()
        return {k for k, (r, _) in refs.items() if not r.expired()}

    _, split = backward_input([loss], [torch.ones_like(loss)], [h], params)
    del loss
    after_input = alive()
    assert log_softmax and not set(log_softmax) & after_input  # above the head's matmul: W needs none of it
    assert after_input  # the blocks' activations, until W
    backward_weight(split)
    assert not alive()
    assert not split.groups and not split.kept


# --- in a pipeline: remat, tied weights, dropout ---------------------------------------------------


def _config(dropout: float) -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=True, dropout=dropout)


def _grads(mesh, schedule: str, remat: bool, dropout: float):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(_config(dropout))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-3), microbatches=4, pipeline=schedule,
                           schedule=fs.Schedule(remat=remat))  # fmt: skip
    state = step.init(params)
    x = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    grads = fs.gather(step.grad(state, (x, torch.roll(x, -1, 1)))[0], full=True)
    return {k: v.clone() for k, v in grads.trainable.items()}


def _all(mesh, runs):
    return {run: _grads(mesh, *run) for run in runs}


def test_zero_bubble_with_remat_and_a_tied_weight_gives_gpipe_bits():
    """Tied GPT at `{"pp": 2}`, M = 4: ZB-H1 and ZB-V (4 stages in a V: stage 0 and the last on
    rank 0), rematerialized or not, give GPipe's gradients bit for bit; with dropout, ZB-H1 with
    remat (the I recomputes the forward with the F's RNG state, its graph serves the W) gives
    1F1B's."""
    runs = [("gpipe", False, 0.0), ("zb_h1", True, 0.0), ("zbv", False, 0.0), ("zbv", True, 0.0),
            ("1f1b", False, 0.1), ("zb_h1", False, 0.1), ("zb_h1", True, 0.1)]  # fmt: skip
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        results = world.run(_all, runs)
    got = {run: {k: v for per_rank in results for k, v in per_rank[run].items()} for run in runs}  # stages differ
    assert len(got[runs[0]]) == len(dict(GPT(_config(0.0)).named_parameters()))
    for run in runs[1:]:
        control = runs[0] if run[2] == 0.0 else runs[4]
        differ = [k for k in got[control] if not torch.equal(got[run][k], got[control][k])]
        assert got[run].keys() == got[control].keys() and not differ, (run, differ)


def test_peaks_walk_what_a_micro_batch_holds_between_its_i_and_its_w():
    """`stage_peak_bytes` / `peak_bytes(held_after_input=)`: from an I to its W a micro-batch holds
    `held_after_input` instead of its forward's bytes. ZB-H1 at P = 2, M = 4: the last stage runs
    1F0 1I0 1F1 1I1 1W0 ..., so 2 micro-batches past their I at once (2 x 13); the first stage
    0F0 0F1 0I0 0W0 ..., at most one past its I beside one forwarded (10 + 13)."""
    from functional_shard.pipeline._peaks import stage_peak_bytes

    zb = fs.pipeline.zero_bubble_h1(2, 4)
    assert stage_peak_bytes(zb, [10, 10]) == tuple(10 * n for n in fs.pipeline.peak_in_flight(zb)) == (20, 20)
    assert stage_peak_bytes(zb, [10, 10], [13, 13]) == (23, 26)
    assert fs.pipeline.peak_bytes(zb, [10, 10], [3, 3]) == (23, 23)  # an I frees nothing by default
    assert fs.pipeline.peak_bytes(zb, [10, 10], [3, 3], held_after_input=[13, 13]) == (26, 29)
    one = fs.pipeline.one_f_one_b(2, 4)  # no I: the same as without
    assert stage_peak_bytes(one, [10, 10], [13, 13]) == stage_peak_bytes(one, [10, 10]) == (20, 10)
