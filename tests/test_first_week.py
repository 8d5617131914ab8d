"""A new user's first week (issue 29): mistakes that used to pass silently or fail without a location.

On real gloo processes (2 ranks), traced and eager:
- a `loss_fn` that never reads the parameters it is given (`model(x)` instead of
  `apply_fn(params, x)`) raises, naming the fix; a loss that ignores only some parameters trains;
- bf16 mixed precision on a CNN with BatchNorm and a frozen stem trains by default (BatchNorm
  parameters kept in float32, as FSDP1 does), traced with the eager reference's bits, and
  `step.evaluate` works in train and eval mode; `keep_batch_norm=False` (the opt-out) fails at
  replay, and the error names the user's lines (loss_fn, the model's forward);
- an exception raised by an operation of a replayed graph names the operation and the user's line
  (mapping checked on a graph directly, and end to end with targets out of range);
- `microbatches=3` on a batch of 8 names the batch leaf and its shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard._replay import describe_node, failing_node, make_fx_with_sources, replay
from functional_shard.models import MLP, SmallCNN
from functional_shard.schedule._lower import runnable

BF16 = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
SCHEDULES = {"traced": fs.Schedule(), "eager": fs.Schedule(trace=False)}


# --- 29.1: a loss that never reads params --------------------------------------------------------


def loss_of_the_module(mesh, mode: str):
    torch.manual_seed(0)
    model = MLP(5, 8, 3, n_blocks=1)
    apply_fn, params = fs.functionalize(model)
    step = fs.sharded_step(lambda p, x: model(x).square().mean(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=SCHEDULES[mode])
    state = step.init(params)
    before = [t.clone() for t in fs.tree_leaves(state)]
    with pytest.raises(fs.StepError) as info:
        step(state, torch.randn(4, 5))
    untouched = all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state)))
    return str(info.value), untouched


@pytest.mark.parametrize("mode", ["traced", "eager"])
def test_a_loss_that_never_reads_params_raises_naming_the_fix(local_world, mode):
    for message, untouched in local_world(2).run(loss_of_the_module, mode):
        assert "does not depend on any trainable parameter" in message
        assert "apply_fn(params, x)" in message and "not model(x)" in message
        assert untouched


def loss_ignoring_some_params(mesh, mode: str):
    params = {"used": torch.ones(3), "ignored": torch.ones(2)}
    step = fs.sharded_step(lambda p, x: (p["used"] * x).sum(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=SCHEDULES[mode])
    state, _ = step(step.init(params), torch.ones(3))
    return {name: t.tolist() for name, t in fs.gather(state.params).items()}


@pytest.mark.parametrize("mode", ["traced", "eager"])
def test_a_loss_that_ignores_some_params_still_trains(local_world, mode):
    for trained in local_world(2).run(loss_ignoring_some_params, mode):
        assert trained["used"] == pytest.approx([0.9] * 3) and trained["ignored"] == [1.0, 1.0]


# --- 29.2: bf16 with BatchNorm ------------------------------------------------------------------


def cnn_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)


def bf16_batch_norm_cnn(mesh):
    results = {}
    for mode, schedule in SCHEDULES.items():
        torch.manual_seed(0)
        model = SmallCNN(num_classes=5, in_channels=3)  # frozen stem, BatchNorm after every conv
        apply_fn, params = fs.functionalize(model)

        def loss_fn(p, batch):
            x, y = batch
            return F.cross_entropy(apply_fn(p, x).float(), y)

        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=schedule, precision=BF16)
        state = step.init(params)
        losses = []
        for i in range(3):
            state, metrics = step(state, cnn_batch(mesh.rank, i))
            losses.append(float(metrics["loss"]))
        evaluated = [float(step.evaluate(state, cnn_batch(mesh.rank, 9))["loss"])]
        model.eval()  # running statistics: a retrace of the evaluation
        evaluated.append(float(step.evaluate(state, cnn_batch(mesh.rank, 9))["loss"]))
        layout = state.params.layout
        gathered = {layout.paths[i]: spec.gather_dtype for spec in layout.buffers for i in spec.leaves}
        results[mode] = (fs.tree_leaves(state), losses, evaluated, gathered)
    same = all(torch.equal(a, b) for a, b in zip(results["traced"][0], results["eager"][0]))
    return same, results["traced"][1:], results["eager"][1:]


def test_bf16_with_batch_norm_trains_by_default_traced_and_eager(local_world):
    for same, traced, eager in local_world(2).run(bf16_batch_norm_cnn):
        assert same, "traced and eager differ"
        assert traced == eager
        losses, evaluated, gathered = traced
        assert all(map(torch.isfinite, torch.tensor(losses + evaluated)))
        assert losses[-1] < losses[0]
        # BatchNorm parameters (frozen stem's norm included) in float32, everything else in bf16.
        assert gathered["stem_norm.weight"] == gathered["blocks.0.norm.bias"] == torch.float32
        assert gathered["stem.weight"] == gathered["blocks.0.conv.weight"] == gathered["head.weight"] == torch.bfloat16


def batch_norm_in_bf16(mesh, mode: str):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(SmallCNN(num_classes=5, in_channels=3))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).float(), y)  # the user's line

    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_batch_norm=False)
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=SCHEDULES[mode], precision=precision)
    with pytest.raises(RuntimeError) as info:
        step(step.init(params), cnn_batch(mesh.rank, 0))
    return str(info.value), isinstance(info.value.__cause__, RuntimeError)


def test_batch_norm_in_bf16_on_request_fails_naming_the_users_lines(local_world):
    """The opt-out gathers BatchNorm's weights in bf16 beside its float32 statistics, which
    torch's kernel refuses when the graph replays (fake tensors trace it): the error names the
    operation, this file's loss_fn line and the model's forward line, as the eager error does."""
    for message, chained in local_world(2).run(batch_norm_in_bf16, "traced"):
        assert "expected scalar type BFloat16 but found Float" in message
        assert "aten.native_batch_norm" in message
        assert f'{__file__}", line' in message and "in loss_fn" in message and "the user's line" in message
        assert "models.py" in message and "self.stem_norm(self.stem(x))" in message
        # ... on its first line too, which is what a failing rank's report shows
        assert "aten.native_batch_norm.default at " in message.splitlines()[0] and "models.py:" in message.splitlines()[0]
        assert chained
    for message, _ in local_world(2).run(batch_norm_in_bf16, "eager"):
        assert "expected scalar type BFloat16 but found Float" in message


# --- 29.2: an error inside a replayed graph names the user's line -----------------------------


def _pick(x, index):
    return x[index] * 2  # fails at run time only: the index is a value


def test_a_failing_node_of_a_replayed_graph_is_mapped_to_the_users_line():
    x, index = torch.randn(4), torch.tensor([1])
    gm = make_fx_with_sources(_pick)(x, index)
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index.Tensor)
    assert "in _pick" in node.meta["stack_trace"] and "x[index] * 2" in node.meta["stack_trace"]
    run = runnable(gm)
    with pytest.raises(IndexError) as info:
        replay(run, [x, torch.tensor([7])])
    assert failing_node(run, info.value.__cause__).name == node.name
    message = str(info.value)
    assert "index 7 is out of bounds" in message and "aten.index.Tensor" in message
    assert "in _pick" in message and "x[index] * 2" in message
    assert describe_node(node) in message


def targets_out_of_range(mesh):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)  # y holds a class the model does not have

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1))
    with pytest.raises(IndexError) as info:
        step(step.init(params), (torch.randn(4, 5), torch.tensor([0, 1, 2, 7])))
    return str(info.value)


def test_an_error_of_a_replayed_step_names_the_users_line(local_world):
    for message in local_world(2).run(targets_out_of_range):
        assert "Target 7 is out of bounds" in message
        assert f"{__file__}:" in message.splitlines()[0] and "in loss_fn" in message.splitlines()[0]
        assert "aten.nll_loss" in message
        assert "in loss_fn" in message and "F.cross_entropy(apply_fn(p, x), y)" in message


# --- 29.8: micro-batches that do not divide the batch --------------------------------------------


def microbatches_of_eight(mesh, mode: str):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(5, 8, 3, n_blocks=1))
    step = fs.sharded_step(
        lambda p, b: F.cross_entropy(apply_fn(p, b["x"]), b["y"]),
        mesh,
        optimizer=fs.optim.sgd(lr=0.1),
        schedule=SCHEDULES[mode],
        microbatches=3,
    )
    with pytest.raises(fs.StepError) as info:
        step(step.init(params), {"x": torch.randn(8, 5), "y": torch.zeros(8, dtype=torch.int64)})
    return str(info.value)


@pytest.mark.parametrize("mode", ["traced", "eager"])
def test_microbatches_that_do_not_divide_the_batch_name_the_leaf(local_world, mode):
    for message in local_world(2).run(microbatches_of_eight, mode):
        assert "microbatches=3" in message and "batch leaf 'x' has shape [8, 5]" in message
