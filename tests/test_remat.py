"""Rematerialization (`fs.Schedule(remat=...)`, `fs.schedule.rematerialize`): same bits, less memory.

On real gloo worlds of 2 processes:
- MLP, GPT and GPT with dropout x prefetch {0, 1, 2} x reshard {True, False}, and bucketed
  gathers, all with every unit rematerialized: parameters and optimizer state after the steps
  `torch.equal` to the eager reference's (dropout: the kept masks replay the same draws);
- the recomputed nodes read the backward's all-gather: with resharding the forward's gathered
  buffer is freed in the forward, and `max_units_alive` stays within prefetch + 2;
- memory: the bytes the graph allocates and keeps alive at once (counted per storage while it
  runs) drop by more than 40% on a 4-block GPT;
- with micro-batches (k = 1, 2, 4, `accumulate="sharded"` and `"full"`; prefetch 0/1/2, reshard
  on/off, every unit, a set, a policy; GPT, dropout, BatchNorm, bf16, frozen parameters, a
  Hugging Face Llama with token-weighted padded batches): the eager reference's bits, each
  micro-batch's units recomputed in that micro-batch's backward, its forward gathers freed in
  its forward; one micro-batch's activations alive at a time (the analysis of the graph and
  counted while it runs), fewer bytes than without remat;
- `torch.utils.checkpoint` in `loss_fn` raises an error that points to `fs.Schedule(remat=...)`,
  traced and eager.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import functional_shard as fs
from functional_shard.models import GPT, MLP, GPTConfig
from functional_shard.schedule import (
    early_reduce_scatter,
    limit_in_flight,
    prefetch,
    rematerialize,
    reshard_after_forward,
)

from test_jit import bit_problems
from test_step import build, cross_entropy, global_batch, local_batch

STEPS = 3
SCHEDULES = [
    fs.Schedule(prefetch=p, reshard_after_forward=r, remat=True) for p, r in itertools.product([0, 1, 2], [True, False])
] + [fs.Schedule(bucket_bytes=1 << 40, remat=True)]


def model_of(name: str) -> torch.nn.Module:
    if name == "gpt_dropout":
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=2, n_head=2, d_model=24, dropout=0.2))
    if name == "gpt_frozen":  # gathered once for every micro-batch: blocks.1, and blocks.0's attention
        model = build("gpt")
        for path, parameter in model.named_parameters():
            parameter.requires_grad_(not path.startswith(("blocks.1.", "blocks.0.attn.")))
        return model
    return build(name)


def run_steps(mesh, name: str, schedule: fs.Schedule, steps: int = STEPS, *, has_aux: bool = False, **options):
    apply_fn, params = fs.functionalize(model_of(name))

    def loss_fn(p, batch):
        x, y = batch
        logits = apply_fn(p, x)
        loss = cross_entropy(logits, y)
        return (loss, logits.argmax(-1)) if has_aux else loss

    optimizer = fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, schedule=schedule, has_aux=has_aux, **options)
    state = step.init(params, seed=7)
    metrics = None
    data = "gpt" if name.startswith("gpt") else name
    for i in range(steps):
        if options.get("microbatches", 1) > 1:  # 4 rows per rank: 2 or 4 micro-batches
            batch = tuple(t[4 * mesh.rank : 4 * (mesh.rank + 1)] for t in global_batch(data, 4 * mesh.world_size, i))
        else:
            batch = local_batch(global_batch(data, mesh.world_size, i), mesh.rank)
        state, metrics = step(state, batch)
    return state, metrics, step


# --- the schedule's field and the pass value ------------------------------------------------------


def test_remat_expands_to_a_pass_that_runs_first():
    assert fs.Schedule().pass_list == fs.schedule.default_passes()  # no remat: the list is unchanged
    assert fs.Schedule(remat=True).pass_list[:2] == (rematerialize(True), reshard_after_forward())
    assert fs.Schedule(remat=["blocks.0", "blocks.1"]).remat == ("blocks.0", "blocks.1")  # a hashable value
    assert rematerialize("blocks.0").units == ("blocks.0",)
    odd = rematerialize(lambda unit: unit.endswith("1"))
    assert odd.chooses("blocks.1") and not odd.chooses("blocks.0")
    assert repr(fs.Schedule(remat=True)) == "Schedule(remat=True)"
    with pytest.raises(TypeError, match="unit"):
        fs.Schedule(remat=3)
    with pytest.raises(ValueError, match="remat"):
        fs.Schedule(remat=True, passes=(prefetch(0),))


# --- same bits --------------------------------------------------------------------------------------


def remat_equals_eager(mesh, name: str) -> list[str]:
    reference, reference_metrics, _ = run_steps(mesh, name, fs.Schedule(trace=False))
    _, plain_metrics, _ = run_steps(mesh, name, fs.Schedule())
    expected = fs.tree_leaves(reference)
    blocks = sorted({b.unit for b in reference.params.layout.buffers if b.unit.startswith("blocks.")}, reverse=True)
    # Every unit is recomputed but the one that computes the loss, which the backward reads first:
    # the MLP's `output` (its `input` holds nothing the backward reads); the GPT's `input`, whose
    # tied embedding is the head, so that its `output` (the final norm) is recomputed.
    expected_units = (["output"] if name.startswith("gpt") else []) + blocks
    problems = []
    for schedule in SCHEDULES:
        state, metrics, step = run_steps(mesh, name, schedule)
        problems += bit_problems(schedule, state, metrics, expected, reference_metrics)
        events = step.schedule_events
        if fs.schedule.rematerialized(events) != expected_units:
            problems.append(f"{schedule}: rematerialized {fs.schedule.rematerialized(events)}")
        if not schedule.bucket_bytes and schedule.reshard_after_forward and fs.schedule.max_units_alive(events) > schedule.prefetch + 2:
            problems.append(f"{schedule}: {fs.schedule.max_units_alive(events)} units alive")
        if metrics["all_gather_bytes"] != plain_metrics["all_gather_bytes"] and schedule.reshard_after_forward:
            problems.append(f"{schedule}: all-gather bytes {metrics['all_gather_bytes']} != {plain_metrics['all_gather_bytes']}")
        if f"rematerialized (forward recomputed before the backward): {', '.join(expected_units)}" not in step.explain():
            problems.append(f"{schedule}: explain() does not name the rematerialized units")
    return problems


# The GPTs with -m slow (suite time): every schedule with remat on the MLP here; the GPT's
# remat bits in test_recomputed_nodes_read_the_backward_gather (4 schedules) and
# test_batch_norm_aux_and_mixed_precision_keep_their_bits, dropout's kept masks in
# test_remat_with_microbatches_keeps_the_bits_of_every_feature[dropout].
@pytest.mark.parametrize(
    "name", ["mlp", pytest.param("gpt", marks=pytest.mark.slow), pytest.param("gpt_dropout", marks=pytest.mark.slow)]
)
def test_every_schedule_with_remat_is_bit_identical_to_eager(local_world, name):
    for rank, problems in enumerate(local_world(2).run(remat_equals_eager, name)):
        assert not problems, f"rank {rank}: " + "\n".join(problems)


def forward_gathers_freed(mesh) -> dict:
    """Where each unit's forward gather is freed, relative to the end of the forward, for the
    default order (remat, then reshard) and the other one; and the chosen units."""
    out = {}
    reference, _, _ = run_steps(mesh, "gpt", fs.Schedule(trace=False))
    after = (reshard_after_forward(), rematerialize(), prefetch(1), early_reduce_scatter(), limit_in_flight())
    for label, schedule in (
        ("remat first", fs.Schedule(remat=True)),
        ("remat after reshard", fs.Schedule(passes=after)),
        ("blocks.0 only", fs.Schedule(remat=("blocks.0",))),
        ("a function", fs.Schedule(remat=lambda unit: unit != "blocks.0")),
    ):
        state, _, step = run_steps(mesh, "gpt", schedule)
        compiled = step.cache[next(iter(step.cache))]
        end = list(compiled.graph_module.graph.nodes).index(fs.schedule.forward_end(compiled.graph_module))
        freed = {e.unit: e.position for e in step.schedule_events if e.event == "freed" and e.phase == "forward"}
        out[label] = {
            "same bits": all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), fs.tree_leaves(reference))),
            "freed in forward": sorted(u for u, p in freed.items() if p <= end),
            "rematerialized": fs.schedule.rematerialized(step.schedule_events),
        }
    with pytest.raises(ValueError, match=r"no unit named \['block.0'\]"):
        run_steps(mesh, "gpt", fs.Schedule(remat=("block.0",)), steps=1)
    return out


def test_recomputed_nodes_read_the_backward_gather(local_world):
    out = local_world(2).run(forward_gathers_freed)[0]
    assert all(r["same bits"] for r in out.values()), out
    assert out["remat first"]["freed in forward"] == ["blocks.0", "blocks.1", "input", "output"], out
    # Run after resharding, the recomputed nodes read the forward's gathered units in the backward
    # (all but `input`, which computes the loss through the tied head and is not recomputed).
    assert out["remat after reshard"]["freed in forward"] == ["input"], out
    assert out["blocks.0 only"]["rematerialized"] == ["blocks.0"], out
    assert out["a function"]["rematerialized"] == ["output", "blocks.1"], out


def other_features(mesh) -> dict:
    """BatchNorm (its running statistics are written by an op whose schema does not say so),
    an aux output, bf16 parameters: remat=True gives the eager reference's bits."""
    out = {}
    for label, name, options in (
        ("batch norm", "cnn", {}),
        ("aux", "mlp", {"has_aux": True}),
        ("bf16", "gpt", {"precision": fs.Precision(param_dtype=torch.bfloat16)}),
    ):
        reference, reference_metrics, _ = run_steps(mesh, name, fs.Schedule(trace=False), **options)
        state, metrics, step = run_steps(mesh, name, fs.Schedule(remat=True), **options)
        out[label] = (
            all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), fs.tree_leaves(reference)))
            and all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(metrics.get("aux")), fs.tree_leaves(reference_metrics.get("aux"))))
            # every unit but the loss's: the CNN's 3 blocks and `input` (stem norm), the MLP's 3
            # blocks, the GPT's 2 blocks and `output` (its final norm; the tied head is `input`'s)
            and len(fs.schedule.rematerialized(step.schedule_events)) == {"cnn": 4, "mlp": 3, "gpt": 3}[name]
        )
    return out


def test_batch_norm_aux_and_mixed_precision_keep_their_bits(local_world):
    for out in local_world(2).run(other_features):
        assert all(out.values()), out


# --- with micro-batches ----------------------------------------------------------------------------


def microbatch_schedules(accumulate: str) -> list[fs.Schedule]:
    """Prefetch 0, 1, 2, resharding on and off, every unit, a set of units, a policy."""
    return [
        fs.Schedule(accumulate=accumulate, remat=True),
        fs.Schedule(prefetch=0, reshard_after_forward=False, accumulate=accumulate, remat=True),
        fs.Schedule(prefetch=2, accumulate=accumulate, remat=("blocks.0", "blocks.2")),
        fs.Schedule(prefetch=0, accumulate=accumulate, remat=lambda unit: unit != "blocks.0"),
        fs.Schedule(
            prefetch=2, reshard_after_forward=False, accumulate=accumulate, remat=lambda unit: unit != "blocks.1"
        ),
    ]


def forward_ends(step) -> list[int]:
    """Positions of the micro-batches' forward ends in the last traced graph."""
    nodes = list(step.cache[next(iter(step.cache))].graph_module.graph.nodes)
    return [i for i, n in enumerate(nodes) if n.meta.get("fs_forward_end")]


def remat_with_microbatches_equals_eager(mesh, accumulate: str, k: int) -> list[str]:
    options = {"microbatches": k, "steps": 2}
    reference, reference_metrics, _ = run_steps(mesh, "mlp", fs.Schedule(trace=False, accumulate=accumulate), **options)
    expected = fs.tree_leaves(reference)
    blocks = sorted({b.unit for b in reference.params.layout.buffers if b.unit.startswith("blocks.")}, reverse=True)
    problems = []
    for schedule in microbatch_schedules(accumulate):
        state, metrics, step = run_steps(mesh, "mlp", schedule, **options)
        problems += bit_problems(schedule, state, metrics, expected, reference_metrics)
        events = step.schedule_events
        # Every micro-batch's chosen units, recomputed in that micro-batch's backward: between
        # the end of its forward and the end of the next micro-batch's.
        chosen = [b for b in blocks if rematerialize(schedule.remat).chooses(b)]
        labels = [f"{b}@mb{i}" if k > 1 else b for i in range(k) for b in chosen]
        if fs.schedule.rematerialized(events) != labels:
            problems.append(f"{schedule}, k={k}: rematerialized {fs.schedule.rematerialized(events)}")
        ends = [*forward_ends(step), 1 << 62]
        for e in events:
            i = int(e.unit.partition("@mb")[2] or 0)
            if e.event == "recomputed" and not ends[i] < e.position < ends[i + 1]:
                problems.append(f"{schedule}, k={k}: {e.unit} recomputed at {e.position}, outside its backward {ends}")
            # With resharding the recomputed nodes read the backward's gathers: each micro-batch's
            # forward gathers die in its forward.
            if schedule.reshard_after_forward and e.event == "freed" and e.phase == "forward" and e.position > ends[i]:
                problems.append(f"{schedule}, k={k}: forward gather of {e.unit} freed at {e.position}, after {ends[i]}")
    return problems


# k = 1, 2 and both strategies by default; the other pairs with -m slow (suite time). Remat with
# 4 micro-batches stays in the default set: ..._keeps_the_bits_of_every_feature[batch norm]
# (k = 4, its recomputed units per micro-batch) and ..._keeps_one_microbatch_of_activations.
@pytest.mark.parametrize(
    "accumulate, k",
    [("sharded", 2), pytest.param("sharded", 4, marks=pytest.mark.slow), ("full", 1), pytest.param("full", 2, marks=pytest.mark.slow),
     pytest.param("full", 4, marks=pytest.mark.slow)],
)
def test_remat_with_microbatches_is_bit_identical_to_eager(local_world, accumulate, k):
    for rank, problems in enumerate(local_world(2).run(remat_with_microbatches_equals_eager, accumulate, k)):
        assert not problems, f"rank {rank}: " + "\n".join(problems)


MICROBATCH_FEATURES = {  # label -> (model, accumulate, micro-batches, precision)
    "gpt": ("gpt", "sharded", 2, None),
    "dropout": ("gpt_dropout", "full", 2, None),
    "batch norm": ("cnn", "sharded", 4, None),
    "bf16": ("gpt", "full", 2, torch.bfloat16),
    "frozen": ("gpt_frozen", "full", 2, None),
}


def microbatch_feature(mesh, label: str) -> dict:
    name, accumulate, k, dtype = MICROBATCH_FEATURES[label]
    options = {"microbatches": k, "precision": fs.Precision(param_dtype=dtype) if dtype else None}
    eager = fs.Schedule(trace=False, accumulate=accumulate)
    reference, reference_metrics, _ = run_steps(mesh, name, eager, 2, **options)
    state, metrics, step = run_steps(mesh, name, fs.Schedule(accumulate=accumulate, remat=True), 2, **options)
    # Every unit but the one that computes the loss, in the order the backward reaches them: the
    # tied GPT's loss is computed by `input` (the head is the token embedding), so its `output`
    # (final norm) is recomputed; the CNN's loss by `output` (the head). The frozen GPT's units
    # are the others' (frozen leaves keep their place in the order of use, `ModuleParams.order`).
    per_microbatch = {"cnn": ["blocks.2", "blocks.1", "blocks.0", "input"]}
    units = per_microbatch.get(name, ["output", "blocks.1", "blocks.0"])
    return {
        "problems": bit_problems(label, state, metrics, fs.tree_leaves(reference), reference_metrics),
        "rematerialized": fs.schedule.rematerialized(step.schedule_events),
        "expected": [f"{u}@mb{i}" for i in range(k) for u in units],
    }


# "gpt" and "bf16" with -m slow (suite time): the GPT's layer norm and attention stay in by
# "dropout" and "frozen" (the same GPT, micro-batches, remat); bf16 with remat in
# test_batch_norm_aux_and_mixed_precision_keep_their_bits.
@pytest.mark.parametrize(
    "label", [pytest.param(label, marks=pytest.mark.slow) if label in ("gpt", "bf16") else label for label in MICROBATCH_FEATURES]
)
def test_remat_with_microbatches_keeps_the_bits_of_every_feature(local_world, label):
    """Layer norm and attention (GPT), dropout (the masks are kept: the same draws), BatchNorm
    (running statistics written in every micro-batch), bf16, frozen parameters (gathered once
    for every micro-batch): every micro-batch's blocks recomputed."""
    for out in local_world(2).run(microbatch_feature, label):
        assert not out["problems"] and out["rematerialized"] == out["expected"], out


def llama_with_microbatches(mesh, accumulate: str) -> dict:
    """A Hugging Face Llama (RMSNorm, rotary embeddings, grouped-query attention) with padding,
    token-weighted losses and 2 micro-batches: traced with remat against the eager reference.
    Its backward computes values from the forward's alone (RMSNorm's `pow`, SiLU's `sigmoid`)
    before it reads the next micro-batch's: those are the previous micro-batch's backward, and
    each micro-batch recomputes the same."""
    from test_training import build_hf, padded_batch, rows, token_sum

    apply_fn, params = fs.functionalize(build_hf("llama"))

    def loss_fn(p, batch):
        ids, mask, labels = batch
        n = (labels[:, 1:] != -100).sum()
        return fs.WeightedLoss(token_sum(apply_fn(p, input_ids=ids, attention_mask=mask).logits, labels) / n, n)

    runs = {}
    for label, trace in (("eager", False), ("remat", True)):
        schedule = fs.Schedule(trace=trace, accumulate=accumulate, remat=trace)
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), microbatches=2, schedule=schedule)
        state = step.init(params)
        for i in range(2):
            state, metrics = step(state, rows(padded_batch(mesh.world_size, i, per_rank=4), mesh.rank, per_rank=4))
        runs[label] = state, metrics, step
    state, metrics, step = runs["remat"]
    recomputed = {e.unit: e.nbytes for e in step.schedule_events if e.event == "recomputed"}
    return {
        "problems": bit_problems("llama", state, metrics, fs.tree_leaves(runs["eager"][0]), runs["eager"][1]),
        "recomputed": recomputed,
    }


# "sharded" with -m slow (suite time): the Llama's recomputation is the same under either
# strategy ("full" here); remat with sharded micro-batches in ..._is_bit_identical_to_eager[sharded-2].
@pytest.mark.parametrize("accumulate", [pytest.param("sharded", marks=pytest.mark.slow), "full"])
def test_remat_with_microbatches_on_a_hugging_face_llama(local_world, accumulate):
    pytest.importorskip("transformers")
    for out in local_world(2).run(llama_with_microbatches, accumulate):
        # Every block (not `output`, the final norm and head: it computes the loss). The embedding
        # (`input`) recomputes nothing: its output is layer 0's kept input, and the first norm of
        # layer 0 (parameter-free up to its weight) is recomputed by layer 0 from it.
        layers = ["model.layers.1", "model.layers.0"]
        assert not out["problems"], out
        assert list(out["recomputed"]) == [f"{u}@mb{i}" for i in range(2) for u in layers], out
        assert all(out["recomputed"][f"{u}@mb0"] == out["recomputed"][f"{u}@mb1"] > 0 for u in layers), out


# --- memory ------------------------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """The most bytes of storages that ops allocate (not the inputs'), alive at once."""

    def __init__(self, external: list[torch.Tensor]):
        super().__init__()
        self.external = {StorageWeakRef(t.untyped_storage()).cdata for t in external}
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in fs.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.external and ref.cdata not in self.alive:
                    self.alive[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out


def peak_bytes(mesh) -> dict[str, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, block_size=32, n_layer=4, n_head=4, d_model=32))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        return cross_entropy(apply_fn(p, batch[0]), batch[1])

    g = torch.Generator().manual_seed(mesh.rank)
    tokens = torch.randint(0, 17, (8, 32), generator=g)
    batch = (tokens, torch.roll(tokens, -1, dims=1))
    out = {}
    for label, schedule in (("plain", fs.Schedule()), ("remat", fs.Schedule(remat=True))):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-2), schedule=schedule)
        state, _ = step(step.init(params), batch)  # traces
        tracker = LiveBytes([*fs.tree_leaves(state), *batch])
        with tracker:
            step(state, batch)
        out[label] = tracker.peak
        out[f"{label} units alive"] = fs.schedule.max_units_alive(step.schedule_events)
    return out


def test_remat_lowers_the_bytes_alive(local_world):
    for out in local_world(2).run(peak_bytes):
        assert out["remat"] < 0.6 * out["plain"], out
        assert out["remat units alive"] <= 3 and out["plain units alive"] <= 3, out


def microbatch_memory(mesh, accumulate: str) -> dict:
    """Bytes a step allocates beyond its inputs, at its peak: predicted from the scheduled graph
    (`fs.analysis`: in total and the activations' share) and counted while it runs, for 1 and 4
    micro-batches, without and with remat."""
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(16, 64, 4, n_blocks=4))
    batch = (torch.randn(512, 16), torch.randint(0, 4, (512,)))
    out = {}
    for k, remat in itertools.product((1, 4), (False, True)):
        step = fs.sharded_step(
            lambda p, b: cross_entropy(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.sgd(0.1), microbatches=k,
            schedule=fs.Schedule(accumulate=accumulate, remat=remat),
        )
        state, _ = step(step.init(params), batch)  # traces
        memory = fs.analysis.analyze(next(iter(step.cache.values()))).memory
        tracker = LiveBytes([*fs.tree_leaves(state), *batch])
        with tracker:
            step(state, batch)
        out[k, remat] = {
            "predicted": memory.peak - memory.resident,
            "activations": memory.breakdown.activations,
            "counted": tracker.peak,
        }
    return out


# "full" with -m slow (suite time): the same assertions on "sharded" here; one micro-batch of
# activations with "full" (no remat) in test_training.py::test_microbatches_keep_one_microbatch_of_activations[full].
@pytest.mark.parametrize("accumulate", ["sharded", pytest.param("full", marks=pytest.mark.slow)])
def test_remat_with_microbatches_keeps_one_microbatch_of_activations(local_world, accumulate):
    out = local_world(2).run(microbatch_memory, accumulate)[0]
    for measure in ("predicted", "counted"):
        # Less than without remat, and less than remat on the whole batch.
        assert out[4, True][measure] < 0.8 * out[4, False][measure], (measure, out)
        assert out[4, True][measure] < 0.6 * out[1, True][measure], (measure, out)
    # At the peak, the activations of one micro-batch: a quarter of the whole batch's (with remat).
    assert out[4, True]["activations"] <= 0.3 * out[1, True]["activations"], out


# --- torch.utils.checkpoint in loss_fn ------------------------------------------------------------


def checkpoint_in_loss(mesh) -> list[str]:
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(13, 16, 5, n_blocks=2))
    messages = []
    for trace, reentrant in itertools.product((True, False), (True, False)):

        def loss_fn(p, batch):
            out = checkpoint(apply_fn, p, batch[0], use_reentrant=reentrant)
            return cross_entropy(out, batch[1])

        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(trace=trace))
        with pytest.raises(fs.StepError) as info:
            step(step.init(params), (torch.randn(3, 13), torch.randint(0, 5, (3,))))
        messages.append(str(info.value))
    return messages


def test_torch_checkpoint_in_loss_fn_points_to_remat(local_world):
    for messages in local_world(2).run(checkpoint_in_loss):
        for message in messages:
            assert "torch.utils.checkpoint" in message and "fs.Schedule(remat=True)" in message, message


# --- selective rematerialization (fs.schedule.RematPolicy) -----------------------------------------

SELECTIVE = {
    "dots": fs.schedule.RematPolicy(),
    "every other mm": fs.schedule.RematPolicy(every_other_mm=True),
}


def test_remat_policy_values():
    policy = fs.schedule.RematPolicy()
    assert policy.save == fs.schedule.SAVE_DOTS == ("mm", "addmm", "bmm", "baddbmm", "sdpa")
    assert fs.Schedule(remat=policy).remat is policy  # kept whole, hashable
    assert fs.Schedule(remat=policy).pass_list[0] == rematerialize(True, policy)
    assert fs.schedule.RematPolicy(units=["blocks.0"]).units == ("blocks.0",)
    assert fs.schedule.RematPolicy(save="mm").save == ("mm",)
    with pytest.raises(ValueError, match="'matmul_'.*overload packet"):
        fs.schedule.RematPolicy(save=("mm", "matmul_"))
    with pytest.raises(TypeError, match="unit"):
        fs.schedule.RematPolicy(units=3)


def _selective_model(name: str):
    """(params, loss_fn, (mesh, i) -> this rank's batch i) for the GPT or a
    Hugging Face Llama from config (SDPA attention, RMSNorm, rotary, SiLU)."""
    if name == "gpt":
        apply_fn, params = fs.functionalize(build("gpt"))

        def loss_fn(p, batch):
            return cross_entropy(apply_fn(p, batch[0]), batch[1])

        return params, loss_fn, lambda mesh, i: local_batch(global_batch("gpt", mesh.world_size, i), mesh.rank)
    from test_training import build_hf, padded_batch, rows, token_sum

    apply_fn, params = fs.functionalize(build_hf("llama"))

    def llama_loss(p, batch):
        ids, mask, labels = batch
        n = (labels[:, 1:] != -100).sum()
        return fs.WeightedLoss(token_sum(apply_fn(p, input_ids=ids, attention_mask=mask).logits, labels) / n, n)

    return params, llama_loss, lambda mesh, i: rows(padded_batch(mesh.world_size, i), mesh.rank)


def selective_equals_eager(mesh, name: str, dtype) -> dict:
    """Eager reference, full remat and each selective policy: same bits; what each recomputes."""
    precision = fs.Precision(param_dtype=dtype) if dtype is not torch.float32 else None
    params, loss_fn, batch_of = _selective_model(name)
    runs = {}
    for label, schedule in (("eager", fs.Schedule(trace=False)), ("full", fs.Schedule(remat=True)), *(
        (k, fs.Schedule(remat=v)) for k, v in SELECTIVE.items()
    )):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2, weight_decay=0.1), schedule=schedule, precision=precision)
        state = step.init(params, seed=7)
        for i in range(2):
            state, metrics = step(state, batch_of(mesh, i))
        runs[label] = state, metrics, step
    reference, reference_metrics, _ = runs.pop("eager")
    out = {"problems": [], "recomputed": {}}
    for label, (state, metrics, step) in runs.items():
        out["problems"] += bit_problems(label, state, metrics, fs.tree_leaves(reference), reference_metrics)
        gm = next(iter(step.cache.values())).graph_module
        ops = [getattr(getattr(n.target, "overloadpacket", None), "__name__", "") for nodes in
               fs.schedule._remat.recomputed_units(gm).values() for n in nodes]
        out["recomputed"][label] = {
            "mm": sum(o in ("mm", "addmm", "bmm") for o in ops),
            "sdpa": sum("scaled_dot_product" in o for o in ops),
            "nodes": len(ops),
            "units": fs.schedule.rematerialized(step.schedule_events),
        }
    return out


# bf16 with -m slow (suite time): fp32 here, GPT and Llama at 1 and 2 ranks; bf16 with remat keeps
# its bits in test_batch_norm_aux_and_mixed_precision_keep_their_bits, and the policies run in bf16
# in test_selective_remat_peak_is_predicted.
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"])
def test_selective_remat_keeps_the_bits(local_world, world, name, dtype):
    if name == "llama":
        pytest.importorskip("transformers")
    for out in local_world(world).run(selective_equals_eager, name, dtype):
        assert not out["problems"], out
        full, dots, other = (out["recomputed"][k] for k in ("full", "dots", "every other mm"))
        # The same units; full remat recomputes the matrix products, the dots policy none of them,
        # torchtitan's every second mm of each unit.
        assert full["units"] == dots["units"] == other["units"] and full["units"], out
        assert full["mm"] > other["mm"] > dots["mm"] == 0, out
        assert dots["sdpa"] == 0 and dots["nodes"] < full["nodes"], out
        # (The Llama's SDPA attention traces on CPU into bmm, softmax, bmm: its products are kept.)


def selective_memory(mesh) -> dict:
    """The analysis' peak against MemTracker's, for no remat, full remat and the dots policy
    (GPT benchmark model, bf16 mixed precision, as test_analysis measures it)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from test_analysis import GPT_SHAPE, gpt_loss

    torch.manual_seed(0)
    shape = dict(GPT_SHAPE, n_layer=4, block_size=128, d_model=128, n_head=4)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(**shape)))
    precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    g = torch.Generator().manual_seed(mesh.rank)
    tokens = torch.randint(0, shape["vocab_size"], (4, 128), generator=g)
    batch = (tokens, tokens)
    out = {}
    for label, remat in (("none", False), ("full", True), ("dots", fs.schedule.RematPolicy())):
        step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(lr=1e-3), precision=precision,
                               schedule=fs.Schedule(remat=remat))
        state, _ = step(step.init(params), batch)
        predicted = fs.analysis.analyze(step.lower(state, batch)).memory.peak
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(state), *batch)
        with tracker:
            state, _ = step(state, batch)
        snapshot = tracker.get_tracker_snapshot("peak")
        measured = next(int(v) for k, v in next(iter(snapshot.values())).items() if str(getattr(k, "value", k)) == "Total")
        out[label] = (predicted, measured)
    return out


def test_selective_remat_peak_is_predicted(local_world):
    for out in local_world(2).run(selective_memory):
        for label, (predicted, measured) in out.items():
            assert abs(measured - predicted) <= 1e-3 * predicted, (label, out)
        # Between full remat and none.
        assert out["full"][1] < out["dots"][1] < out["none"][1], out
