"""Tensor parallelism composes with the rest of the step (issue 26, item 5), on gloo processes.

`fs.models.GPT` placed by `gpt_rules` (vocabulary-parallel embedding and cross-entropy) at
`{"fsdp": 2, "tp": 2}`; each of the 2 data ranks trains on its rows of one global batch. Against
single-process training on the whole batch, and traced against eager:

- mixed precision (`fs.Precision(bf16, fp32)`): buffers gathered in bf16 (half the bytes), gradients
  reduced in fp32 (the same bytes), the first gradient no further from fp32 training than 2x
  single-process bf16 training's, traced == eager bit for bit;
- micro-batches (`microbatches=2`): the first gradient within 1e-5 relative; traced == eager;
- `fs.WeightedLoss` by token count with `-100` targets (ranks and micro-batches weigh differently):
  the loss and the first gradient of the token mean over the whole batch;
- clipping (`chain(clip_by_global_norm, ...)`): `grad_norm` is `clip_grad_norm_`'s total (1e-6),
  so replicated leaves count once, and the clipped SGD update is single-process's (1e-5);
  with AdamW traced == eager;
- remat (`fs.Schedule(remat=True)`): traced == eager bit for bit;
- `step.evaluate`: the single-process loss (1e-6), traced == eager;
- `donate=True`: the eager run's bits, and the donated state refused.

The mesh is built on the session's world of 4 processes (`fs.init_mesh` names new axes on it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
MESH = {"fsdp": 2, "tp": 2}
DATA = 2  # data ranks of MESH
PER_RANK = 2  # rows of the global batch per data rank
LENGTH = 12
LR = 1e-2
STEPS = 2
MAX_NORM = 0.05  # below the first gradient's norm: clipping acts
CLIP_LR = 1e3  # SGD's update is then larger than the parameters: `new - old` is exact to ~1e-7
BF16 = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def global_batch(step: int, ignore: bool = False):
    """(ids, targets) of the global batch; with `ignore`, each row's targets end in a run of -100
    of its own length (ranks and micro-batches then hold different token counts)."""
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (DATA * PER_RANK, LENGTH), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    if ignore:
        lengths = torch.randint(1, LENGTH + 1, (DATA * PER_RANK,), generator=g)
        targets = targets.masked_fill(torch.arange(LENGTH)[None, :] >= lengths[:, None], -100)
    return ids, targets


def rows(batch, data_rank: int):
    return tuple(t[data_rank * PER_RANK : (data_rank + 1) * PER_RANK] for t in batch)


# --- single process ------------------------------------------------------------------------------


def single(batch, dtype=torch.float32):
    """(loss, gradients by name, their total norm) of single-process training on the whole batch
    (the token mean; with `dtype` bf16 the model computes in it, the loss in fp32)."""
    model = build_gpt().to(dtype)
    ids, targets = batch
    loss = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return loss.item(), grads, norm.item()


def relative(a: dict, b: dict) -> float:
    """The largest per-tensor relative distance of `a` from `b`."""
    return max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b)


def l2(a: dict, b: dict) -> float:
    """The Euclidean distance of `a` from `b` over every element, relative to `b`'s norm."""
    return (sum(float((a[k] - b[k]).square().sum()) for k in b) / sum(float(b[k].square().sum()) for k in b)) ** 0.5


# --- on the ranks ---------------------------------------------------------------------------------


def compose(_, case: str):
    """Run `case` on `MESH` over the session's world; rank 0's report."""
    mesh = fs.init_mesh(MESH)
    d = mesh.data_rank
    rules = tp.gpt_rules(CONFIG)
    apply_fn, params = fs.functionalize(tp.parallelize(build_gpt(), rules, mesh))

    def mean_loss(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    def weighted_loss(p, batch):
        ids, targets = batch
        count = (targets != -100).sum()
        logits = apply_fn(p, ids).flatten(0, 1)
        total = tp.vocab_parallel_cross_entropy(logits, targets.flatten(), mesh, "tp", reduction="sum")
        return fs.WeightedLoss(total / count, count)

    def make(loss_fn=mean_loss, optimizer=None, schedule=None, **options):
        return fs.sharded_step(
            loss_fn, mesh, optimizer=optimizer or fs.optim.adamw(LR), placements=rules,
            schedule=schedule or fs.Schedule(), **options,
        )  # fmt: skip

    def train(step, ignore=False, state=None):
        state = state or step.init(params)
        losses = []
        for i in range(STEPS):
            state, metrics = step(state, rows(global_batch(i, ignore), d))
            losses.append(float(metrics["loss"]))
        return state, losses

    def first_grads(step, ignore=False):
        grads, metrics = step.grad(step.init(params), rows(global_batch(0, ignore), d))
        full = fs.gather(grads, full=True)
        return {k: full[k] for k in full.trainable}, metrics

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for x, y in zip(fs.tree_leaves(a), fs.tree_leaves(b)))

    eager = fs.Schedule(trace=False)
    report: dict = {}
    if case == "precision":
        report["grads"], metrics = first_grads(make(precision=BF16, schedule=eager))
        _, fp32 = first_grads(make(schedule=eager))
        report["bytes"] = {k: (metrics[k], fp32[k]) for k in ("all_gather_bytes", "reduce_scatter_bytes")}
        report["traced_equals_eager"] = same(train(make(precision=BF16))[0], train(make(precision=BF16, schedule=eager))[0])
        # the metrics count the state's buffers, traced as eager (the traced step counted the
        # vocabulary-parallel loss's all-gather of activations too: an adversarial pass)
        counted = {}
        for name, schedule in (("traced", fs.Schedule(reshard_after_update=False)), ("eager", fs.Schedule(trace=False, reshard_after_update=False))):
            step = make(precision=BF16, schedule=schedule)
            _, m = step(step.init(params), rows(global_batch(0), d))
            counted[name] = (m["all_gather_bytes"], m["reduce_scatter_bytes"])
        report["zero1 bytes"] = counted
    elif case == "microbatches":
        report["grads"], _ = first_grads(make(microbatches=2, schedule=eager))
        report["traced_equals_eager"] = same(train(make(microbatches=2))[0], train(make(microbatches=2, schedule=eager))[0])
    elif case == "weighted":
        report["grads"], metrics = first_grads(make(weighted_loss, microbatches=2, schedule=eager), ignore=True)
        report["loss"] = float(metrics["loss"])
        traced, _ = train(make(weighted_loss, microbatches=2), ignore=True)
        report["traced_equals_eager"] = same(traced, train(make(weighted_loss, microbatches=2, schedule=eager), ignore=True)[0])
    elif case == "clip":
        step = make(optimizer=fs.optim.chain(fs.optim.clip_by_global_norm(MAX_NORM), fs.optim.sgd(CLIP_LR)), schedule=eager)
        state = step.init(params)
        new, metrics = step(state, rows(global_batch(0), d))
        before, after = fs.gather(state.params, full=True), fs.gather(new.params, full=True)
        report["update"] = {k: after[k] - before[k] for k in after.trainable}
        report["grad_norm"] = float(metrics["grad_norm"])
        clipped_adamw = fs.optim.chain(fs.optim.clip_by_global_norm(MAX_NORM), fs.optim.adamw(LR))
        report["traced_equals_eager"] = same(
            train(make(optimizer=clipped_adamw))[0], train(make(optimizer=clipped_adamw, schedule=eager))[0]
        )
    elif case == "remat":
        report["traced_equals_eager"] = same(train(make(schedule=fs.Schedule(remat=True)))[0], train(make(schedule=eager))[0])
    elif case == "evaluate":
        batch = rows(global_batch(5), d)
        traced, plain = make(), make(schedule=eager)
        state = train(traced)[0]
        report["loss"] = float(plain.evaluate(plain.init(params), batch)["loss"])
        report["traced_equals_eager"] = torch.equal(
            traced.evaluate(state, batch)["loss"], plain.evaluate(train(plain)[0], batch)["loss"]
        )
    elif case == "donate":
        donating = make(donate=True)
        state = donating.init(params)
        after, _ = donating(state, rows(global_batch(0), d))
        after, _ = donating(after, rows(global_batch(1), d))
        report["traced_equals_eager"] = same(after, train(make(schedule=eager))[0])
        try:
            donating(state, rows(global_batch(0), d))
            report["refused"] = None
        except fs.StepError as error:
            report["refused"] = str(error)
    else:
        raise ValueError(case)
    return report if mesh.rank == 0 else None


@pytest.fixture(scope="module")
def world(local_world):
    return local_world(4)


def run(world, case: str) -> dict:
    return world.run(compose, case)[0]


# --- the tests ------------------------------------------------------------------------------------


def test_mixed_precision_gathers_bf16_reduces_fp32(world):
    report = run(world, "precision")
    (gathered, gathered32), (reduced, reduced32) = report["bytes"]["all_gather_bytes"], report["bytes"]["reduce_scatter_bytes"]
    assert 2 * gathered == gathered32 and reduced == reduced32, report["bytes"]
    zero1 = report["zero1 bytes"]
    assert zero1["traced"] == zero1["eager"] and zero1["traced"][0] == gathered, (zero1, gathered)  # ZeRO-1: one gather of the buffers
    _, fp32, _ = single(global_batch(0))
    _, bf16, _ = single(global_batch(0), torch.bfloat16)
    # (fs.gather returns the gradient in the gather dtype, bf16, as single-process bf16 training holds it)
    grads = {k: g.float() for k, g in report["grads"].items()}
    assert l2(grads, fp32) <= 2 * l2(bf16, fp32), (l2(grads, fp32), l2(bf16, fp32))
    assert report["traced_equals_eager"]


# With -m slow (suite time): micro-batches under tp give the single-process gradient (1e-5) and
# traced == eager in test_weighted_loss_over_ranks_and_microbatches_is_the_token_mean (microbatches=2).
@pytest.mark.slow
def test_microbatches_give_the_single_process_gradient(world):
    report = run(world, "microbatches")
    _, expected, _ = single(global_batch(0))
    assert relative(report["grads"], expected) <= 1e-5
    assert report["traced_equals_eager"]


def test_weighted_loss_over_ranks_and_microbatches_is_the_token_mean(world):
    batch = global_batch(0, ignore=True)
    counts = (batch[1] != -100).sum(dim=1)
    assert len(set(counts.tolist())) > 1  # the rows weigh differently
    report = run(world, "weighted")
    loss, expected, _ = single(batch)
    assert abs(report["loss"] - loss) <= 1e-6 * abs(loss)
    assert relative(report["grads"], expected) <= 1e-5
    assert report["traced_equals_eager"]


def test_clipping_counts_replicated_leaves_once(world):
    report = run(world, "clip")
    _, grads, norm = single(global_batch(0))
    assert norm > 2 * MAX_NORM  # clipping acts
    assert abs(report["grad_norm"] - norm) <= 1e-6 * norm
    scale = min(MAX_NORM / (norm + 1e-6), 1.0)
    assert relative(report["update"], {k: -CLIP_LR * scale * g for k, g in grads.items()}) <= 1e-5
    assert report["traced_equals_eager"]


def test_remat_traced_equals_eager(world):
    assert run(world, "remat")["traced_equals_eager"]


def test_evaluate_is_the_single_process_loss(world):
    report = run(world, "evaluate")
    loss, _, _ = single(global_batch(5))
    assert abs(report["loss"] - loss) <= 1e-6 * abs(loss)
    assert report["traced_equals_eager"]


def test_donated_steps_keep_the_eager_bits_and_refuse_the_old_state(world):
    report = run(world, "donate")
    assert report["traced_equals_eager"]
    assert report["refused"] is not None and "donate" in report["refused"], report["refused"]
