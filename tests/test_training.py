"""Training as Trainer/Accelerate users do (issue 8), on real gloo processes.

- Hugging Face Llama and GPT-2 from small configs, sdpa attention with an `attention_mask`,
  right padding and `-100` labels, `fs.WeightedLoss` by token count: 5 AdamW steps at world sizes
  2 and 4 no further from single-process training on the concatenated batch than DDP (with the
  same token weighting), traced and eager, and traced == eager bit for bit;
- mixed precision bf16/fp32: traced == eager, no further from fp32 training than FSDP2 with
  `MixedPrecisionPolicy(bf16, fp32)`, all-gather bytes half of fp32's; fp16 loss scaling skips an
  overflowing step and leaves the state unchanged;
- accumulation: k = 1, 2, 4 micro-batches, both strategies, equal one big batch (SGD, 1e-6),
  bytes per step as documented, fewer bytes alive with k = 4;
- `metrics["grad_norm"]` equals `clip_grad_norm_`'s total norm (flat and hybrid meshes);
- evaluation: the single-process eval loss, within the unit bound; `model.eval()` retraces;
- RNG: same seed, same bits; ranks draw different dropout masks; a resumed run continues the
  stream (and the fp16 loss scale) exactly;
- bad input: clear errors, state untouched.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functional_shard as fs
from functional_shard.models import GPT, MLP, GPTConfig

from _memory import AliveBytes
from _meshes import mesh_of

STEPS = 5
VOCAB = 61


# --- Hugging Face models with padding and -100 labels -------------------------------------------


def build_hf(arch: str) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        )
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
    )
    return GPT2LMHeadModel(config)


def padded_batch(world: int, step: int, per_rank: int = 2, length: int = 12, seed: int = 0):
    """(ids, mask, labels) of every rank; rank r holds rows r*per_rank..; right padding, -100 labels."""
    g = torch.Generator().manual_seed(500 + step + 1000 * seed)
    n = world * per_rank
    ids = torch.randint(3, VOCAB, (n, length), generator=g)
    lengths = torch.randint(3, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 2)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def rows(batch, rank: int, per_rank: int = 2):
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in batch)


def token_sum(model_out_logits, labels):
    logits = model_out_logits[:, :-1].float()
    target = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum")


def hf_train(mesh, arch: str, seed: int = 0, summed: bool = False, control: bool = False):
    """5 AdamW steps of fs (traced and eager), DDP and single-process training on the data of
    `seed`; the distances of fs's and DDP's parameters from single-process training
    (`tools/ddp_distance.py` runs it over many seeds). `summed`: fs's loss is the token sum
    (`fs.WeightedLoss(sum, n, summed=True)`) instead of the token mean. `control`: also DDP
    with one bucket per parameter (`bucket_cap_mb` below the smallest tensor: the same
    gradients, other positions in the buffers gloo's all-reduce sums, so other orders of the
    ranks' values), reported as `worst_ddp_buckets` / `l2_ddp_buckets`."""
    world, rank = mesh.world_size, mesh.rank
    report = {}
    states = {}
    for trace in (True, False):
        model = build_hf(arch)
        apply_fn, params = fs.functionalize(model)

        def loss_fn(p, batch):
            ids, mask, labels = batch
            out = apply_fn(p, input_ids=ids, attention_mask=mask)
            n = (labels[:, 1:] != -100).sum()
            if summed:
                return fs.WeightedLoss(token_sum(out.logits, labels), n, summed=True)
            return fs.WeightedLoss(token_sum(out.logits, labels) / n, n)

        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), schedule=fs.Schedule(trace=trace))
        state = step.init(params)
        if not trace:  # the first step's gradient against the single-process one, tensor by tensor
            batch = padded_batch(world, 0, seed=seed)
            full = fs.gather(step.grad(state, rows(batch, rank))[0])
            reference = build_hf(arch)
            total = (batch[2][:, 1:] != -100).sum()
            (token_sum(reference(input_ids=batch[0], attention_mask=batch[1]).logits, batch[2]) / total).backward()
            report["grad_error"] = max(
                float((full[n] - p.grad).norm() / p.grad.norm()) for n, p in reference.named_parameters()
            )
        for i in range(STEPS):
            state, metrics = step(state, rows(padded_batch(world, i, seed=seed), rank))
        states[trace] = state
        report[f"loss_{trace}"] = float(metrics["loss"])
    report["traced_equals_eager"] = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(states[True]), fs.tree_leaves(states[False])))
    exported = fs.export(states[True])

    reference = build_hf(arch)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ddp_models = {"ddp": nn.parallel.DistributedDataParallel(build_hf(arch))}
    if control:
        ddp_models["ddp_buckets"] = nn.parallel.DistributedDataParallel(build_hf(arch), bucket_cap_mb=1e-6)
    ddp_opts = {key: torch.optim.AdamW(m.parameters(), lr=1e-2) for key, m in ddp_models.items()}
    for i in range(STEPS):
        batch = padded_batch(world, i, seed=seed)
        total = (batch[2][:, 1:] != -100).sum()
        ref_opt.zero_grad()
        (token_sum(reference(input_ids=batch[0], attention_mask=batch[1]).logits, batch[2]) / total).backward()
        ref_opt.step()
        ids, mask, labels = rows(batch, rank)
        for key, ddp_model in ddp_models.items():
            ddp_opts[key].zero_grad()
            # DDP averages gradients over ranks: weigh each rank's sum by world / total tokens.
            (token_sum(ddp_model(input_ids=ids, attention_mask=mask).logits, labels) * world / total).backward()
            ddp_opts[key].step()
    arms = {"fs": exported.__getitem__}
    arms.update({key: (lambda n, m=m: m.module.get_parameter(n).detach()) for key, m in ddp_models.items()})
    for arm, get in arms.items():
        # The largest per-tensor relative distance, and the Euclidean distance over every
        # parameter element (a tied weight once).
        report[f"worst_{arm}"] = max(
            float((get(n) - p.detach()).abs().max()) / (float(p.detach().abs().max()) or 1.0) for n, p in reference.named_parameters()
        )
        report[f"l2_{arm}"] = sum(float((get(n) - p.detach()).double().square().sum()) for n, p in reference.named_parameters()) ** 0.5
    report["equals_ddp"] = all(torch.equal(arms["fs"](n), arms["ddp"](n)) for n, _ in reference.named_parameters())
    return report


# World size 4 with -m slow (suite time): both models at 2 here; the padded, token-weighted
# Llama on 4 ranks against single-process training in test_tp_step.py ({"fsdp": 2, "tp": 2})
# and test_pipeline_step.py ({"pp": 2, "fsdp": 2}).
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_models_with_padding_train_like_single_process(local_world, arch, world_size):
    pytest.importorskip("transformers")
    report = local_world(world_size).run(hf_train, arch)[0]
    print(arch, world_size, report)
    assert report["traced_equals_eager"]
    # The gradient is the single-process one to fp32 rounding (a per-rank mean instead of the
    # token-weighted one is 1e-2..1e-1 away).
    assert report["grad_error"] <= 1e-5, report
    # After 5 AdamW steps both are rounding noise away from the reference, which AdamW magnifies
    # where a gradient is ~0 (GPT-2's key biases, whose true gradient is 0, carry the most).
    # fs rounds as DDP does: its backward is the one loss.backward() runs (not torch.func.grad's
    # create_graph backward, whose silu formula differs) and starts from 1 / (tokens over all
    # ranks), as DDP's `* world / total` and the single-process token mean do. At world size 2
    # that gives DDP's bits; at 4 the ranks' gradients are summed in another order
    # (reduce-scatter vs DDP's all-reduce): measured fs/DDP 1.07 (Llama), 1.15 (GPT-2). Before
    # both, Llama was 8.2x (2) and 3.7x (4) DDP's distance.
    assert report["worst_fs"] <= 1.5 * report["worst_ddp"] + 1e-7, report


def test_summed_weighted_loss_gives_ddp_bits(local_world):
    """With the loss a token sum (`summed=True`), each rank's backward starts from exactly
    1 / (tokens over all ranks), as DDP's `sum * world / total` does: at world size 2, where a
    sum of two gradients has one order, fs ends with DDP's parameters bit for bit — on data
    seeds where the mean form (`sum / n` weighted by n: `(n * (1 / W)) / n != 1 / W` for some
    of the ranks' counts) does not.

    The seeds are ones where every rank's rows have padding: on a rank whose attention mask is
    all ones, transformers' sdpa path drops the mask (`is_causal`, another kernel) in DDP, while
    fs always passes it (`loss_fn` runs as under torch.export), as single-process training on
    the concatenated, padded batch does."""
    pytest.importorskip("transformers")
    world = local_world(2)
    for seed in (1, 8):
        summed = world.run(hf_train, "llama", seed, True)[0]
        assert summed["traced_equals_eager"] and summed["equals_ddp"], (seed, summed)
        assert summed["grad_error"] <= 1e-5, summed
    mean = world.run(hf_train, "llama", 1, False)[0]
    assert not mean["equals_ddp"], mean


def test_step_differentiates_as_backward_does():
    """The step's gradient is the one `loss.backward()` computes, bit for bit (one rank): with a
    plain mean, silu and mish included, whose backward formulas differ under `torch.func.grad`'s
    create_graph=True; with a WeightedLoss, whose backward starts from 1 / (sum of weights) as
    `(token sum / total).backward()` does."""

    def body(mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 16), nn.SiLU(), nn.Linear(16, 16), nn.Mish(), nn.Linear(16, 3))
        apply_fn, params = fs.functionalize(model)
        x, y = torch.randn(32, 7), torch.randint(0, 3, (32,))
        y[::3] = -100
        n = (y != -100).sum()
        same = {}
        for weighted in (False, True):
            def loss_fn(p, b):
                total = F.cross_entropy(apply_fn(p, b[0]), b[1], ignore_index=-100, reduction="sum")
                return fs.WeightedLoss(total / n, n) if weighted else total / n

            step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(0.1), schedule=fs.Schedule(trace=False))
            grads = fs.gather(step.grad(step.init(params), (x, y))[0])
            model.zero_grad()
            (F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n).backward()
            same[weighted] = {name: torch.equal(grads[name], p.grad) for name, p in model.named_parameters()}
        return same

    same = fs.testing.SimulatedWorld(1).run(body)[0]
    assert all(same[False].values()) and all(same[True].values()), same


# --- mixed precision ------------------------------------------------------------------------------


def small_gpt(dropout: float = 0.0, bias: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=dropout, bias=bias))


def gpt_batch(world: int, step: int, per_rank: int = 2):
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, VOCAB, (world * per_rank, 12), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def ce(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mixed_precision(mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world, rank = mesh.world_size, mesh.rank
    bf16 = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out, states = {}, {}
    for name, precision, trace in (("fp32", None, True), ("bf16", bf16, True), ("bf16_eager", bf16, False)):
        apply_fn, params = fs.functionalize(small_gpt())
        step = fs.sharded_step(
            lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.adamw(1e-2),
            precision=precision, schedule=fs.Schedule(trace=trace),
        )
        state = step.init(params)
        for i in range(STEPS):
            state, metrics = step(state, rows(gpt_batch(world, i), rank))
        states[name] = state
        out[f"{name}_gather_bytes"] = metrics["all_gather_bytes"]
        out[f"{name}_scatter_bytes"] = metrics["reduce_scatter_bytes"]
    out["traced_equals_eager"] = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(states["bf16"]), fs.tree_leaves(states["bf16_eager"])))
    exported = fs.export(states["bf16"])

    reference = small_gpt()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    fsdp = small_gpt()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in fsdp.blocks:
        fully_shard(block, mesh=mesh.device_mesh, mp_policy=policy)
    fully_shard(fsdp, mesh=mesh.device_mesh, mp_policy=policy)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    for i in range(STEPS):
        batch = gpt_batch(world, i)
        ref_opt.zero_grad()
        ce(reference(batch[0]), batch[1]).backward()
        ref_opt.step()
        x, y = rows(batch, rank)
        fsdp_opt.zero_grad()
        ce(fsdp(x), y).backward()
        fsdp_opt.step()
    fsdp_full = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    fs_err, fsdp_err = 0.0, 0.0
    for name, p in reference.named_parameters():
        scale = float(p.detach().abs().max())
        fs_err = max(fs_err, float((exported[name] - p.detach()).abs().max()) / scale)
        fsdp_err = max(fsdp_err, float((fsdp_full[name].float() - p.detach()).abs().max()) / scale)
    out["fs_err"], out["fsdp_err"] = fs_err, fsdp_err
    return out


def test_bf16_mixed_precision_matches_fsdp2(local_world):
    out = local_world(2).run(mixed_precision)[0]
    assert out["traced_equals_eager"]
    assert out["bf16_gather_bytes"] * 2 == out["fp32_gather_bytes"]
    assert out["bf16_scatter_bytes"] == out["fp32_scatter_bytes"]  # reduced in fp32
    # bf16 rounding differs in detail between the two (where casts happen); within a factor.
    assert out["fs_err"] <= 1.5 * out["fsdp_err"] + 1e-3, out


def fp16_overflow(mesh):
    apply_fn, params = fs.functionalize(small_gpt())
    precision = fs.Precision(param_dtype=torch.float16, loss_scale=fs.LossScale(init_scale=2.0**40))
    step = fs.sharded_step(lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.adamw(1e-2), precision=precision)
    state = step.init(params)
    before = fs.tree_leaves((state.params, state.opt_state))
    batch = rows(gpt_batch(mesh.world_size, 0), mesh.rank)
    state1, m1 = step(state, batch)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves((state1.params, state1.opt_state))))
    scales = [float(m1["loss_scale"])]
    skipped = [bool(m1["skipped"])]
    for _ in range(30):  # the scale halves until the gradient is finite, then the step updates
        state1, m = step(state1, batch)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
        if not skipped[-1]:
            break
    updated = not all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state1.params)))
    return unchanged, skipped, scales, updated


def test_fp16_overflow_step_is_skipped_and_reported(local_world):
    unchanged, skipped, scales, updated = local_world(2).run(fp16_overflow)[0]
    assert skipped[0] and unchanged
    assert scales[1] == scales[0] / 2
    assert not skipped[-1] and updated


def fp16_master(mesh, pipelined: bool):
    """A model in fp16 (its master weights too) under the default `fs.LossScale()` (65536): the
    mean gradient and the loss-scaled step against torch's backward of loss x 65536 unscaled in
    fp32."""
    torch.set_num_threads(1)
    mesh = mesh_of(mesh, {"pp": 2}) if pipelined else mesh
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16)
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(config).half())
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = (x, torch.roll(x, -1, 1))

    def loss_fn(p, b):
        return F.cross_entropy(apply_fn(p, b[0]).flatten(0, 1).float(), b[1].flatten())

    extra = dict(microbatches=2, pipeline=fs.pipeline.Pipeline("1f1b")) if pipelined else {}
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(0.1), precision=fs.Precision(loss_scale=fs.LossScale()),
                           schedule=fs.Schedule(trace=False), **extra)  # fmt: skip
    state = step.init(params)
    _, metrics = step(state, batch)
    torch.manual_seed(0)
    model = GPT(config).half()
    (F.cross_entropy(model(x).flatten(0, 1).float(), batch[1].flatten()) * 2.0**16).backward()
    norm = sum(float((p.grad.float() / 2.0**16).double().square().sum()) for p in model.parameters()) ** 0.5
    return float(metrics["grad_norm"]), bool(metrics["skipped"]), norm


@pytest.mark.parametrize("pipelined", [False, True], ids=["plain", "pipelined"])
def test_fp16_master_weights_unscale_in_float32(local_world, pipelined):
    """The unscaled gradient is computed in float32 and cast back: with the scale cast to fp16
    (65536: inf) every gradient came out 0, a finite step applied and the scale grew on."""
    if pipelined:
        results = local_world(2).run(fp16_master, True)
    else:
        results = fs.testing.SimulatedWorld(1).run(fp16_master, False)
    for grad_norm, skipped, expected in results:
        assert not skipped and abs(grad_norm / expected - 1) < 2e-3, (grad_norm, expected)


# --- accumulation ---------------------------------------------------------------------------------


def accumulation(mesh, accumulate: str, once: bool = False):
    """k = 1, 2, 4 micro-batches, traced and eager, against single-process SGD on the whole batch.
    `once`: the traced step gathers each unit once per step (`reshard_after_backward=False`)."""
    world, rank = mesh.world_size, mesh.rank
    keep = dict(reshard_after_forward=False, reshard_after_backward=False) if once else {}
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(world * 8, 13, generator=g), torch.randint(0, 5, (world * 8,), generator=g)) for _ in range(3)]
    out = {}
    for k in (1, 2, 4):
        torch.manual_seed(0)
        apply_fn, params = fs.functionalize(MLP(13, 16, 5, n_blocks=3))
        step = fs.sharded_step(
            lambda p, b: F.cross_entropy(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.sgd(0.1),
            microbatches=k, schedule=fs.Schedule(accumulate=accumulate, **keep),
        )
        state = step.init(params)
        for batch in data:
            state, metrics = step(state, tuple(t[rank * 8 : (rank + 1) * 8] for t in batch))
        eager = fs.sharded_step(
            lambda p, b: F.cross_entropy(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.sgd(0.1),
            microbatches=k, schedule=fs.Schedule(trace=False, accumulate=accumulate),
        )
        eager_state = eager.init(params)
        for batch in data:
            eager_state, _ = eager(eager_state, tuple(t[rank * 8 : (rank + 1) * 8] for t in batch))
        out[k] = {
            "params": fs.export(state),
            "same_as_eager": all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), fs.tree_leaves(eager_state))),
            "gather": metrics["all_gather_bytes"],
            "scatter": metrics["reduce_scatter_bytes"],
            "trainable_bytes": sum(b.padded_numel * 4 for b in state.params.layout.buffers if b.trainable),
            "units_alive": fs.schedule.max_units_alive(step.schedule_events),
        }
    torch.manual_seed(0)
    reference = MLP(13, 16, 5, n_blocks=3)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    for k in out:
        out[k]["error"] = max(
            float((out[k]["params"][n] - p.detach()).abs().max() / p.detach().abs().max()) for n, p in reference.named_parameters()
        )
        del out[k]["params"]
    return out


# "sharded" with -m slow (suite time): k = 1, 2, 4 sharded equal one big batch, with its k
# reduce-scatters, in test_microbatches_gather_each_unit_once_per_step[2-sharded].
@pytest.mark.parametrize("accumulate", [pytest.param("sharded", marks=pytest.mark.slow), "full"])
def test_microbatches_equal_one_big_batch(local_world, accumulate):
    out = local_world(2).run(accumulation, accumulate)[0]
    for k, r in out.items():
        assert r["same_as_eager"], k
        assert r["error"] <= 1e-6, (k, r["error"])
        # Reduce-scatter bytes: k per step when sharded, 1 when full; gathers grow with k.
        assert r["scatter"] == r["trainable_bytes"] * (k if accumulate == "sharded" else 1), (k, r)
        # Prefetch stays within a micro-batch: no more units gathered at once than with one
        # (one more when the next micro-batch's first unit was prefetched during this one).
        assert r["units_alive"] <= out[1]["units_alive"], (k, r)
    assert out[4]["gather"] > out[1]["gather"]


# (2, "full") and (3, "sharded") with -m slow (suite time): "full" accumulation (one reduce-scatter)
# in test_microbatches_equal_one_big_batch[full]; 3 ranks (padding) in test_early_update.py's
# test_in_place_updates_run_early_with_the_eager_bits.
@pytest.mark.parametrize(
    "world_size, accumulate",
    [
        (2, "sharded"),
        pytest.param(2, "full", marks=pytest.mark.slow),
        pytest.param(3, "sharded", marks=pytest.mark.slow),
    ],
)
def test_microbatches_gather_each_unit_once_per_step(local_world, world_size, accumulate):
    """`Schedule(reshard_after_forward=False, reshard_after_backward=False)`: each unit is
    gathered once per step however many micro-batches (FSDP2's set_reshard_after_backward(False)),
    the eager reference's bits, one big batch to fp32 rounding."""
    out = local_world(world_size).run(accumulation, accumulate, True)[0]
    for k, r in out.items():
        assert r["same_as_eager"], k
        assert r["error"] <= 1e-6, (k, r["error"])
        assert r["gather"] == r["trainable_bytes"], (k, r)  # once per step: not k times
        assert r["scatter"] == r["trainable_bytes"] * (k if accumulate == "sharded" else 1), (k, r)


def test_reshard_after_backward_needs_reshard_after_forward_false():
    with pytest.raises(ValueError, match="reshard_after_forward=False"):
        fs.Schedule(reshard_after_backward=False)
    with pytest.raises(ValueError, match="must be a bool"):
        fs.Schedule(reshard_after_forward=False, reshard_after_backward=0)
    schedule = fs.Schedule(reshard_after_forward=False, reshard_after_backward=False)
    assert schedule.pass_list[0] == fs.schedule.gather_once()
    assert fs.schedule.gather_once() not in fs.Schedule().pass_list


def accumulation_memory(mesh, accumulate: str):
    """Bytes alive (beyond the state) in one traced step, activation-heavy: k = 1 vs 4."""
    peaks = {}
    for k in (1, 4):
        torch.manual_seed(0)
        apply_fn, params = fs.functionalize(MLP(16, 64, 4, n_blocks=2))
        step = fs.sharded_step(
            lambda p, b: F.cross_entropy(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.sgd(0.1),
            microbatches=k, schedule=fs.Schedule(accumulate=accumulate),
        )
        state = step.init(params)
        batch = (torch.randn(512, 16), torch.randint(0, 4, (512,)))
        state, _ = step(state, batch)  # traces
        with AliveBytes(existing=fs.tree_leaves(state)) as counter:
            step(state, batch)
        peaks[k] = counter.peak
    return peaks


# "sharded" with -m slow (suite time): the same bound on "full" here, and with sharded micro-batches
# (and remat) in test_remat.py::test_remat_with_microbatches_keeps_one_microbatch_of_activations[sharded].
@pytest.mark.parametrize("accumulate", [pytest.param("sharded", marks=pytest.mark.slow), "full"])
def test_microbatches_keep_one_microbatch_of_activations(local_world, accumulate):
    peaks = local_world(2).run(accumulation_memory, accumulate)[0]
    assert peaks[4] < 0.6 * peaks[1], peaks


# --- grad norm ------------------------------------------------------------------------------------


def grad_norms(mesh, axes):
    rank, world = mesh.rank, mesh.world_size
    apply_fn, params = fs.functionalize(small_gpt())
    optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.adamw(1e-2))
    step = fs.sharded_step(lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=optimizer)
    state = step.init(params)
    reference = small_gpt()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ddp = nn.parallel.DistributedDataParallel(small_gpt())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    relative = []
    for i in range(3):
        batch = gpt_batch(world, i)
        state, metrics = step(state, rows(batch, rank))
        opt.zero_grad()
        ce(reference(batch[0]), batch[1]).backward()
        total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        ddp_opt.zero_grad()
        ce(ddp(rows(batch, rank)[0]), rows(batch, rank)[1]).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        ddp_opt.step()
        relative.append(abs(float(metrics["grad_norm"]) / float(total) - 1))
    exported = fs.export(state)

    def error(get):
        return max(float((get(n) - p.detach()).abs().max() / p.detach().abs().max()) for n, p in reference.named_parameters())

    return relative, error(exported.__getitem__), error(lambda n: ddp.module.get_parameter(n).detach())


# The hybrid mesh with -m slow (~20 s: a world of its own): grad norm and clipping on
# {"replicate": 2, "fsdp": 2} against torch in test_optim_compose.py::test_clip_adamw_sharded_step_matches_torch_hybrid.
@pytest.mark.parametrize("axes", [None, pytest.param({"replicate": 2, "fsdp": 2}, marks=pytest.mark.slow)])
def test_grad_norm_and_clipping_match_torch(local_world, axes):
    world = local_world(2) if axes is None else fs.testing.LocalWorld(4, axes=axes)
    try:
        for relative, fs_error, ddp_error in world.run(grad_norms, axes):
            assert max(relative) <= 1e-6, relative
            # Clipped AdamW steps: rounding noise, which AdamW magnifies where a gradient is ~0
            # (DDP with clip_grad_norm_ is as far); a wrong norm (say, of one rank's shard)
            # changes every clipped step by far more.
            assert fs_error <= max(10 * ddp_error, 1e-5), (fs_error, ddp_error)
    finally:
        if axes is not None:
            world.close()


# --- evaluation, modes, RNG -----------------------------------------------------------------------


def evaluation(mesh):
    world, rank = mesh.world_size, mesh.rank
    model = small_gpt(dropout=0.5)
    apply_fn, params = fs.functionalize(model)
    schedule = fs.Schedule(prefetch=1)
    step = fs.sharded_step(lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.adamw(1e-2), schedule=schedule)
    state = step.init(params, seed=7)
    batch = gpt_batch(world, 0)
    train_mode = float(step.evaluate(state, rows(batch, rank))["loss"])
    model.eval()
    evaluated = float(step.evaluate(state, rows(batch, rank))["loss"])
    reference = small_gpt(dropout=0.5).eval()
    with torch.no_grad():
        expected = float(ce(reference(batch[0]), batch[1]))
    events = step.last_traced("evaluate").events
    return train_mode, evaluated, expected, fs.schedule.max_units_alive(events), step.last_traced("evaluate").reduce_scatter_bytes


def test_evaluate_matches_the_single_process_model_and_follows_eval_mode(local_world):
    train_mode, evaluated, expected, alive, scattered = local_world(2).run(evaluation)[0]
    assert abs(evaluated - expected) <= 1e-5 * abs(expected)
    assert abs(train_mode - expected) > 1e-3  # dropout was on before model.eval(): a new trace
    assert alive <= 1 + 2 and scattered == 0


def dropout_runs(mesh, directory: str):
    world, rank = mesh.world_size, mesh.rank
    precision = fs.Precision(param_dtype=torch.float16, loss_scale=fs.LossScale(init_scale=2.0**8, growth_interval=1))

    def make(seed_model: int = 0):
        apply_fn, params = fs.functionalize(small_gpt(dropout=0.3))
        step = fs.sharded_step(
            lambda p, b: ce(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.adamw(1e-2), precision=precision
        )
        return step, params

    same_batch = gpt_batch(1, 0)  # every rank the same batch: losses differ only by their dropout masks
    runs = []
    for _ in range(2):
        step, params = make()
        state = step.init(params, seed=11)
        losses = []
        for i in range(4):
            state, metrics = step(state, same_batch)
            losses.append(float(metrics["local_loss"]))
        runs.append((fs.tree_leaves(state), losses))
    step, params = make()
    half = step.init(params, seed=11)
    for i in range(2):
        half, _ = step(half, same_batch)
    path = os.path.join(directory, "half")
    fs.checkpoint.save(path, half)
    step2, params2 = make()
    resumed = fs.checkpoint.load(path, step2.init(params2, seed=999))  # the seed comes from the checkpoint
    for i in range(2):
        resumed, _ = step2(resumed, same_batch)
    return {
        "repeatable": all(torch.equal(a, b) for a, b in zip(runs[0][0], runs[1][0])),
        "losses": runs[0][1],
        "resumed_exact": all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(resumed), runs[0][0])),
        "scale": float(resumed.loss_scale.scale),
    }


def test_rng_is_state_repeatable_per_rank_and_resumable(local_world, tmp_path):
    reports = local_world(2).run(dropout_runs, str(tmp_path))
    for r in reports:
        assert r["repeatable"] and r["resumed_exact"], r
    assert reports[0]["losses"] != reports[1]["losses"]  # ranks draw different dropout masks


# --- bad input ------------------------------------------------------------------------------------


def test_bad_training_options_are_named():
    with pytest.raises(ValueError, match="param_dtype must be a floating torch.dtype.*torch.int32"):
        fs.Precision(param_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"float16\) needs loss scaling"):
        fs.Precision(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="max_norm"):
        fs.optim.clip_by_global_norm(0.0)
    with pytest.raises(ValueError, match="accumulate must be 'sharded' or 'full'"):
        fs.Schedule(accumulate="sometimes")

    def body(mesh):
        torch.manual_seed(0)
        apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))
        with pytest.raises(ValueError, match="microbatches must be an int >= 1; got 0"):
            fs.sharded_step(lambda p, b: p, mesh, optimizer=fs.optim.sgd(0.1), microbatches=0)
        step = fs.sharded_step(
            lambda p, b: apply_fn(p, b).square().mean(), mesh, optimizer=fs.optim.sgd(0.1), microbatches=2,
            schedule=fs.Schedule(trace=False),
        )
        state = step.init(params)
        before = [t.clone() for t in fs.tree_leaves(state)]
        with pytest.raises(fs.StepError, match=r"microbatches=2 must divide .* shape \[3, 5\]"):
            step(state, torch.randn(3, 5))
        assert all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))

    fs.testing.SimulatedWorld(1).run(body)


def _first_week_mistakes(mesh):
    model = MLP(4, 8, 2, n_blocks=1)
    optimizer = fs.optim.sgd(0.1)
    step = fs.sharded_step(lambda p, b: p["input_proj.weight"].sum(), mesh, optimizer=optimizer, schedule=fs.Schedule(trace=False))
    out = []
    for mistake in (
        lambda: fs.sharded_step(model, mesh, optimizer=optimizer),  # the module where a function goes
        lambda: fs.sharded_step(lambda p, b: 0, {"fsdp": 1}, optimizer=optimizer),  # the axes, not a mesh
        lambda: step.init(model),  # the module, not its functionalized params
        lambda: step(fs.functionalize(model)[1], None),  # no step.init
        lambda: step.init(fs.functionalize(model)[1], seed=2**63),  # was "Overflow when unpacking long long"
    ):
        try:
            mistake()
            out.append(None)
        except Exception as error:  # noqa: BLE001 - the test reads what it says
            out.append(f"{type(error).__name__}: {' '.join(str(error).split())}")
    return out


def test_first_week_mistakes_say_what_to_do():
    """What a user of FSDP2 or DDP tries first: each names the fix (they were an argument-count
    TypeError at the first step, an AttributeError on a dict, a cut module repr, a bare type)."""
    module, axes, init, no_init, seed = fs.testing.SimulatedWorld(1).run(_first_week_mistakes)[0]
    assert module.startswith("TypeError: sharded_step takes loss_fn(params, batch)") and "fs.functionalize(model)" in module
    assert axes.startswith("TypeError: sharded_step's mesh must be a mesh made by fs.init_mesh") and "dict" in axes
    assert "pass the params of `apply_fn, params = fs.functionalize(model)`, not the module" in init, init
    assert "call state = step.init(params) first" in no_init, no_init
    assert seed == "ValueError: init(seed=...) must be an int in [-2**63, 2**63) (a state holds it as int64); got 9223372036854775808"
