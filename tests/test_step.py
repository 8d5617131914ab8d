"""`sharded_step` against plain single-process PyTorch on the concatenated batch, and against DDP.

For an MLP, a CNN with a frozen stem and BatchNorm, and a GPT with tied embedding and head, at
world sizes 2 and 4 (real gloo processes):
- first-step gradients: ||fs - reference|| <= 1e-5 ||whole-model gradient||, tensor by tensor;
- SGD with momentum, 5 steps: max|fs - reference| <= 1e-5 max|p|, parameter by parameter;
- AdamW, 5 steps: no further from the reference than DDP is on the same batches;
- export: `load_state_dict(fs.export(state), strict=True)` gives a module with the same outputs.

BatchNorm keeps per-rank statistics (as in FSDP and DDP without SyncBatchNorm), so for the CNN
the reference computes the loss rank-chunk by rank-chunk: the mean of the per-rank losses.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import functional_shard as fs
from functional_shard.models import GPT, MLP, GPTConfig, SmallCNN

PER_RANK_BATCH = 3  # odd on purpose
STEPS = 5


def build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "mlp":
        return MLP(13, 16, 5, n_blocks=3)
    if model_name == "cnn":
        return SmallCNN(num_classes=5, in_channels=3)
    if model_name == "gpt":
        return GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=2, n_head=2, d_model=24))
    raise ValueError(model_name)


def global_batch(model_name: str, world_size: int, step: int):
    """The concatenated batch of every rank for this step: rank r's is rows r*b .. (r+1)*b."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world_size * PER_RANK_BATCH
    if model_name == "mlp":
        return torch.randn(n, 13, generator=g), torch.randint(0, 5, (n,), generator=g)
    if model_name == "cnn":
        return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)
    tokens = torch.randint(0, 31, (n, 11), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def local_batch(batch, rank: int):
    return tuple(t[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH] for t in batch)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def reference_loss(model_name: str, model: nn.Module, batch, world_size: int) -> torch.Tensor:
    if model_name == "cnn":  # per-rank BatchNorm statistics: chunk by rank
        chunks = [local_batch(batch, r) for r in range(world_size)]
        return sum(cross_entropy(model(x), y) for x, y in chunks) / world_size
    x, y = batch
    return cross_entropy(model(x), y)


def make_optimizers(kind: str, parameters):
    if kind == "sgd":
        config = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
        return fs.optim.sgd(**config), torch.optim.SGD(parameters, **config)
    config = dict(lr=1e-2, weight_decay=0.1)
    return fs.optim.adamw(**config), torch.optim.AdamW(parameters, **config)


def train_and_compare(mesh, model_name: str, kind: str) -> dict:
    """Run fs, DDP and the single-process reference for STEPS steps; report distances."""
    world, rank = mesh.world_size, mesh.rank
    model = build(model_name)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return cross_entropy(apply_fn(p, x), y)

    fs_optimizer, _ = make_optimizers(kind, [nn.Parameter(torch.zeros(1))])
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs_optimizer)
    state = step.init(params)

    reference = build(model_name)
    _, reference_optimizer = make_optimizers(kind, reference.parameters())
    ddp = nn.parallel.DistributedDataParallel(build(model_name), broadcast_buffers=False)
    _, ddp_optimizer = make_optimizers(kind, ddp.parameters())

    report: dict = {}
    for i in range(STEPS):
        batch = global_batch(model_name, world, i)
        mine = local_batch(batch, rank)
        if i == 0:
            grads, _ = step.grad(state, mine)
            full_grads = fs.gather(grads)
            reference.zero_grad()
            reference_loss(model_name, reference, batch, world).backward()
            names = [n for n, p in reference.named_parameters() if p.requires_grad]
            total = torch.sqrt(sum(reference.get_parameter(n).grad.double().square().sum() for n in names))
            report["grad_errors"] = {
                n: float((full_grads[n].double() - reference.get_parameter(n).grad.double()).norm() / total) for n in names
            }
            report["frozen_grads_zero"] = all(not full_grads[n].any() for n in params.frozen)
        previous = state
        before = [t.clone() for t in fs.tree_leaves(previous)]
        state, metrics = step(state, mine)
        report["state_untouched"] = report.get("state_untouched", True) and all(
            torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(previous))
        )
        reference_optimizer.zero_grad()
        reference_loss(model_name, reference, batch, world).backward()
        reference_optimizer.step()
        ddp_optimizer.zero_grad()
        cross_entropy(ddp(mine[0]), mine[1]).backward()
        ddp_optimizer.step()

    exported = fs.export(state)
    report["exported_keys_match"] = set(exported) == set(reference.state_dict())
    trained = {n: exported[n] for n, p in reference.named_parameters()}
    report["param_errors"] = {}
    report["ddp_param_errors"] = {}
    for n, p in reference.named_parameters():
        scale = float(p.detach().abs().max())
        report["param_errors"][n] = float((trained[n] - p.detach()).abs().max()) / scale
        report["ddp_param_errors"][n] = float((ddp.module.get_parameter(n).detach() - p.detach()).abs().max()) / scale

    # Export: the module, loaded strictly, computes what apply_fn computes with the trained leaves.
    fresh = build(model_name)
    fresh.load_state_dict(exported, strict=True)
    fresh.eval()
    model.eval()
    x, _ = local_batch(global_batch(model_name, world, 99), rank)
    with torch.no_grad():
        report["export_outputs_equal"] = torch.equal(fresh(x), apply_fn(fs.gather(state.params), x))
    if model_name == "gpt":  # one leaf, updated once, exported under both names
        report["tied_once"] = "head.weight" not in params.trainable and "tok_emb.weight" in params.trainable
        report["tied_equal"] = torch.equal(exported["head.weight"], exported["tok_emb.weight"])
    return report


MODELS = ["mlp", "cnn", "gpt"]


# World size 4 with -m slow (suite time), here and below: every model at 2 ranks; 4 ranks give the
# bits of one process in test_canonical.py::test_gpt_dropout_same_bits_at_1_2_4_ranks_traced_and_eager
# and the eager reference's in test_jit.py::test_bucketed_gathers_are_bit_identical_and_fewer[4].
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_name", MODELS)
def test_sgd_momentum_matches_single_process(local_world, world_size, model_name):
    reports = local_world(world_size).run(train_and_compare, model_name, "sgd")
    for rank, report in enumerate(reports):
        bad = {n: e for n, e in report["grad_errors"].items() if e > 1e-5}
        assert not bad, f"rank {rank}: first-step gradient errors above 1e-5 x |grad|: {bad}"
        bad = {n: e for n, e in report["param_errors"].items() if e > 1e-5}
        assert not bad, f"rank {rank}: parameters after {STEPS} SGD steps off by more than 1e-5 x max|p|: {bad}"
        assert report["frozen_grads_zero"] and report["state_untouched"]
        assert report["exported_keys_match"] and report["export_outputs_equal"]
        assert report.get("tied_once", True) and report.get("tied_equal", True)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_name", MODELS)
def test_adamw_no_further_from_single_process_than_ddp(local_world, world_size, model_name):
    reports = local_world(world_size).run(train_and_compare, model_name, "adamw")
    report = reports[0]
    worst_fs = max(report["param_errors"].values())
    worst_ddp = max(report["ddp_param_errors"].values())
    # Both are rounding noise that AdamW magnifies where the true gradient is ~0; fs may not
    # be noisier than DDP beyond a factor that separates a bug (orders of magnitude) from noise.
    # The floor is the suite's tolerance for first-step gradients (1e-5 relative): on some
    # machines the CNN's BatchNorm at 4 ranks puts DDP at 1.4e-6 and fs at 5.1e-6 (2026-11-27,
    # also at commit 80469ff), both far below what a wrong mean or a lost gradient gives (>= 1e-3).
    assert worst_fs <= max(2.0 * worst_ddp, 1e-5), (worst_fs, worst_ddp, report["param_errors"])
    assert report["export_outputs_equal"] and report["exported_keys_match"]
