"""Bad pipelines are refused with errors that name what is at fault (issue 27, "Bad input").

On real gloo processes (the session's world of 2):

- a hand-written schedule, lowered with its SEND/RECV actions, that deadlocks (rank 0 waits for
  a cotangent before it sends the activation that rank 1 waits for), and one with a missing
  receive, are refused by `fs.pipeline.check` when the step is made — before any collective:
  rank 0 alone makes the step (the other ranks make none), so a collective would hang or time
  out instead of raising `ScheduleError`. The message names the offending actions
  (`error.actions` holds them). A schedule whose sends wait for their receive ("rendezvous", as
  the eager oracle runs them) deadlocks where batched non-blocking sends (the traced step) do
  not: refused for `trace=False` only;
- a schedule built for another number of pipeline ranks or micro-batches (before any collective);
- fp16 loss scaling with donate=True, compile=True with an I/W-split schedule or with the eager oracle
  (before any collective);
- more stages than the model has blocks (`step.init`, on every rank);
- micro-batches that do not divide the batch, on every rank or on one rank only: every rank
  raises (the one at fault `StepError`, the others `PeerError` naming it), none hangs;
- a `loss_fn` with a custom `torch.autograd.Function`, refused with the Function's name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from _meshes import mesh_of
from functional_shard.models import GPT, GPTConfig
from functional_shard.pipeline import PipelineSchedule, ScheduleError

PP2 = {"pp": 2}
CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32, tie_weights=False)


def gpt(n_layer: int = 4):
    torch.manual_seed(0)
    return fs.functionalize(GPT(dataclasses.replace(CONFIG, n_layer=n_layer)))


def gpt_loss(apply_fn):
    def loss_fn(p, batch):
        ids, targets = batch
        return F.cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten())

    return loss_fn


def batch(rows: int = 8):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG.vocab_size, (rows, 12), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


class Sign(torch.autograd.Function):
    """A straight-through sign: a custom backward a stage graph of aten operations would lose."""

    @staticmethod
    def forward(ctx, x):
        return torch.sign(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


# --- hand-written schedules (lowered: UNSHARD, SEND/RECV, REDUCE_GRAD, RESHARD) ---------------

# 1F1B over 2 ranks and 2 micro-batches as `fs.pipeline.with_communication` lowers it:
#   rank 0: 0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD
#   rank 1: 1UNSHARD 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD
RANK1 = "1UNSHARD 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD"
SCHEDULES = {
    "valid": ("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD", RANK1),
    # rank 0 waits for micro-batch 0's cotangent before sending its activation: each rank waits for the other
    "deadlock": ("0UNSHARD 0F0 0RECV_B0 0SEND_F0 0F1 0SEND_F1 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD", RANK1),
    # rank 1 never receives micro-batch 1's activation
    "missing_recv": (
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD",
        "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD",
    ),
    # both ranks send before they receive: rank 0 sends F1 while rank 1 sends B0. Fine when sends
    # do not block (batched isend/irecv, the traced step); a deadlock when each send waits for its receive.
    "rendezvous_deadlock": (
        "0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD",
        "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD",
    ),
    # What `check` proves consistent but fs's runner cannot run (`pipeline._runnable`): before, a
    # second gather silently dropped the gradients summed on the first; the others failed mid-step
    # while the peer waited for a transfer (or, without 0REDUCE_GRAD, rank 1 finished the step).
    "gathered_twice": ("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RESHARD 0UNSHARD 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD "
                       "0RESHARD", RANK1),
    "reduce_after_reshard": ("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0RESHARD 0REDUCE_GRAD", RANK1),
    "optimizer_action": ("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD 0RESHARD 0OPTIMIZER",
                         RANK1),
    "never_gathered": ("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD", RANK1),
    "never_reduced": ("0UNSHARD 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1", RANK1),
    "fsdp_without_transfers": ("0UNSHARD 0F0 0F1 0B0 0B1 0REDUCE_GRAD 0RESHARD", "1UNSHARD 1F0 1B0 1F1 1B1 1REDUCE_GRAD 1RESHARD"),
}


def hand_written(name: str) -> PipelineSchedule:
    rows = SCHEDULES[name]
    return PipelineSchedule.from_text("\n".join(f"rank {r}: {row}" for r, row in enumerate(rows)), num_microbatches=2)


# --- what the ranks run -------------------------------------------------------------------------


def outcome(fn):
    """(error type name, message, offending actions as text) of `fn()`, or None if it returned."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on what it is
        return type(e).__name__, str(e), [f"{r}:{a}" for r, a in getattr(e, "actions", ())]
    return None


def make_step(mesh, *, schedule="1f1b", microbatches=2, trace=True, n_layer=4, loss=gpt_loss, compile=False, **kw):
    torch.set_num_threads(1)
    apply_fn, params = gpt(n_layer)
    pipeline = fs.pipeline.Pipeline(schedule)
    step = fs.sharded_step(loss(apply_fn), mesh, optimizer=fs.optim.adamw(1e-2), microbatches=microbatches,
                           pipeline=pipeline, schedule=fs.Schedule(trace=trace, compile=compile), **kw)  # fmt: skip
    return step, params


def make_alone(mesh, axes, **kw):
    """Rank 0 alone makes the step (the others do nothing): a collective would not complete."""
    mesh = mesh_of(mesh, axes)
    if mesh.rank != 0:
        return None
    return outcome(lambda: make_step(mesh, **kw))


def train_one(mesh, rows_by_rank=(8, 8), microbatches: int = 4, n_layer: int = 4, schedule="1f1b", loss=gpt_loss):
    """Every rank makes the step, inits and trains one step on its batch; returns its outcome."""
    mesh = mesh_of(mesh, PP2)

    def run():
        step, params = make_step(mesh, schedule=schedule, microbatches=microbatches, n_layer=n_layer, loss=loss)
        state = step.init(params)
        step(state, batch(rows_by_rank[mesh.rank]))

    return outcome(run)


def sign_loss(apply_fn):
    def loss_fn(p, batch):
        ids, targets = batch
        return F.cross_entropy(Sign.apply(apply_fn(p, ids)).flatten(0, 1), targets.flatten())

    return loss_fn


# --- tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(local_world):
    return local_world(2)


def test_hand_written_schedules_are_checked():
    """The valid one passes both models of sends; the others are refused naming their actions."""
    fs.pipeline.check(hand_written("valid"), sends="rendezvous")
    with pytest.raises(ScheduleError, match="deadlock"):
        fs.pipeline.check(hand_written("deadlock"), sends="nonblocking")


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_deadlocking_schedule_is_refused_when_the_step_is_made(world, trace):
    got = world.run(make_alone, PP2, schedule=hand_written("deadlock"), trace=trace)[0]
    assert got is not None and got[0] == "ScheduleError", got
    kind, message, actions = got
    assert "deadlock" in message and "0RECV_B0" in message and "1RECV_F0" in message, message
    assert "rank 0 waits at 0RECV_B0" in message and "rank 1 (1SEND_B0)" in message, message
    assert actions == ["0:0RECV_B0", "1:1RECV_F0"], actions


def test_missing_receive_is_refused_when_the_step_is_made(world):
    kind, message, actions = world.run(make_alone, PP2, schedule=hand_written("missing_recv"))[0]
    assert kind == "ScheduleError", message
    assert "1F1" in message and "no 1RECV_F1 before it" in message, message
    assert "1:1F1" in actions, actions


@pytest.mark.parametrize("name, expected", [
    ("gathered_twice", "gathers stage 0 a second time in the step (first at action 0)"),
    ("reduce_after_reshard", "0RESHARD (action 9) frees stage 0 before its 0REDUCE_GRAD"),
    ("optimizer_action", "0OPTIMIZER (action 11): a sharded_step updates every stage once after the schedule"),
    ("never_gathered", "0F0 (action 0) runs stage 0, which this rank never gathered before it"),
    ("never_reduced", "rank 0 never reduces stage 0's gradients: add 0REDUCE_GRAD"),
    ("fsdp_without_transfers", "holds FSDP actions but no SEND/RECV"),
])  # fmt: skip
def test_schedules_the_runner_cannot_run_are_refused_when_the_step_is_made(world, name, expected):
    """Each passes `fs.pipeline.check` (consistent for a runtime of its own: torch's lowering
    gathers a stage several times a step), and is refused by the step before any collective."""
    fs.pipeline.check(hand_written(name), sends="rendezvous")
    got = world.run(make_alone, PP2, schedule=hand_written(name))[0]
    assert got is not None and got[0] == "ScheduleError" and expected in got[1], got


def with_metas(activation: str, cotangent: str) -> PipelineSchedule:
    rank0 = SCHEDULES["valid"][0].replace("0SEND_F0", "0SEND_F0{%s}" % activation).replace("0RECV_B1", "0RECV_B1{%s}" % cotangent)
    rank1 = RANK1.replace("1RECV_F0", "1RECV_F0{%s}" % activation).replace("1SEND_B1", "1SEND_B1{%s}" % cotangent)
    return PipelineSchedule.from_text(f"rank 0: {rank0}\nrank 1: {rank1}", num_microbatches=2)


def step_with(mesh, schedule):
    """One step of the 2-micro-batch GPT under `schedule` (both ranks); the loss, or the error."""
    mesh = mesh_of(mesh, PP2)
    step, params = make_step(mesh, schedule=schedule)
    state = step.init(params)
    try:
        return float(step(state, batch())[1]["loss"])
    except ScheduleError as error:
        return str(error)


def test_declared_tensor_metadata_is_compared_with_the_run(world):
    """A schedule's SEND/RECV metadata is checked against the tensors the cut sends (4 rows x 12
    tokens x 32 floats per micro-batch), on every rank before any transfer: a schedule declaring
    999x7:float64 on both ends passed the check and ran."""
    right = world.run(step_with, with_metas("4x12x32:float32", "4x12x32:float32"))
    assert isinstance(right[0], float) and right[0] == right[1], right
    wrong = world.run(step_with, with_metas("999x7:float64", "4x12x32:float32"))
    assert "rank 0's 0SEND_F0{999x7:float64} (action 2) declares 999x7:float64" in wrong[0], wrong
    assert "carries 4x12x32:float32 per micro-batch" in wrong[0], wrong
    assert "1RECV_F0{999x7:float64}" in wrong[1], wrong


def test_rendezvous_deadlock_is_refused_for_the_eager_oracle_only(world):
    """The eager step waits for every transfer where its action stands (a send waits for its
    receive); the traced step batches non-blocking sends, which this order does not deadlock."""
    kind, message, _ = world.run(make_alone, PP2, schedule=hand_written("rendezvous_deadlock"), trace=False)[0]
    assert kind == "ScheduleError" and "deadlock" in message and "SEND" in message, message
    assert world.run(make_alone, PP2, schedule=hand_written("rendezvous_deadlock"), trace=True)[0] is None


@pytest.mark.parametrize(
    "schedule, microbatches, expected",
    [
        (fs.pipeline.gpipe(4, 4), 4, ["'gpipe'", "4 pipeline rank(s)", "pp=2"]),
        (fs.pipeline.one_f_one_b(2, 8), 4, ["'1f1b'", "8 micro-batch(es)", "microbatches=4"]),
        (fs.pipeline.zbv(2, 4), 4, None),  # a V schedule of 4 stages is fine at pp=2: the control
    ],
    ids=["other_stage_count", "other_microbatches", "control"],
)
def test_schedule_for_other_sizes_is_refused_before_any_collective(world, schedule, microbatches, expected):
    got = world.run(make_alone, PP2, schedule=schedule, microbatches=microbatches)[0]
    if expected is None:
        assert got is None, got
        return
    kind, message, _ = got
    assert kind == "ScheduleError", message
    for part in expected:
        assert part in message, (part, message)


FP16_SCALED = fs.Precision(param_dtype=torch.float16, loss_scale=fs.LossScale())


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"precision": FP16_SCALED, "donate": True}, ["loss scaling", "donate=True"]),
        ({"compile": True, "schedule": "zb_h1"}, ["compile=True", "'zb_h1'", "I and W", "1f1b"]),
        ({"compile": True, "trace": False}, ["compile=True with trace=False", "oracle"]),
    ],
    ids=["fp16_loss_scale", "compile_split_backward", "compile_eager_oracle"],
)
def test_unsupported_options_are_refused_before_any_collective(world, kw, expected):
    kind, message, _ = world.run(make_alone, PP2, **kw)[0]
    assert kind == "StepError", message
    for part in expected:
        assert part in message, (part, message)


def test_more_stages_than_blocks_is_refused_on_every_rank(world):
    """3 blocks, interleaved 1F1B at pp2: 4 stages."""
    got = world.run(train_one, n_layer=3, schedule="interleaved_1f1b")
    for kind, message, _ in got:
        assert kind in ("StepError", "PeerError"), message
    kind, message, _ = got[0]
    assert kind == "StepError" and "4 stages" in message and "only 3 blocks" in message, message


@pytest.mark.parametrize("rows", [(6, 6), (6, 8)], ids=["every_rank", "rank0_only"])
def test_microbatches_that_do_not_divide_the_batch_raise_on_every_rank(world, rows):
    got = world.run(train_one, rows_by_rank=rows, microbatches=4)
    for rank, (kind, message, _) in enumerate(got):
        if rows[rank] == 6:
            assert kind == "StepError", message
            assert "microbatches=4 must divide" in message and "[6, 12]" in message, message
        else:
            assert kind == "PeerError" and "ranks [0] refused their batch" in message, message


def test_custom_autograd_function_is_refused_with_its_name(world):
    got = world.run(train_one, loss=sign_loss)
    for kind, message, _ in got:
        assert kind == "StepError", message
        assert "autograd.Function(s) Sign" in message and "custom backward" in message, message


# --- a stage that raises at run time ------------------------------------------------------------


def _first_stage_raises(mesh) -> str:
    """Stage 0 raises in its forward (token ids out of the embedding's range) on the second step;
    returns what this rank raised and after how long."""
    import time

    torch.set_num_threads(1)
    apply_fn, params = gpt()
    step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(1e-3), microbatches=2,
                           pipeline=fs.pipeline.Pipeline("1f1b"))  # fmt: skip
    state, _ = step(step.init(params), batch())
    ids, targets = batch()
    start = time.monotonic()
    try:
        step(state, (ids + 1000, targets))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:200]} after {time.monotonic() - start:.1f} s"
    return "no error"


def test_a_stage_that_raises_fails_its_peer_within_the_collective_timeout():
    """Rank 0's stage raises in its forward: rank 1, waiting for its activation, raises once the
    collective timeout the mesh was made with (4 s here) has passed, instead of waiting forever."""
    with fs.testing.LocalWorld(2, axes={"pp": 2}, collective_timeout=4.0, call_timeout=60.0) as world:
        first, second = world.run(_first_stage_raises)
    assert first.startswith("IndexError"), first
    assert "Timed out" in second and float(second.rsplit(" after ", 1)[1].split()[0]) < 20, second


# --- evaluation of a batch the micro-batches do not divide ----------------------------------------


def _evaluate_short_batches(mesh) -> list[float]:
    torch.set_num_threads(1)
    apply_fn, params = gpt()
    step = fs.sharded_step(gpt_loss(apply_fn), mesh, optimizer=fs.optim.adamw(1e-3), microbatches=4,
                           pipeline=fs.pipeline.Pipeline("zbv", stages_per_rank=2))  # fmt: skip
    state = step.init(params)
    return [float(step.evaluate(state, batch(rows))["loss"]) for rows in (8, 6, 2, 3)]


def test_evaluate_takes_a_batch_the_micro_batches_do_not_divide():
    """`microbatches=4`, ZB-V at pp 2: `step.evaluate` on 6, 2 or 3 rows (a short last batch) cuts
    them into the most equal micro-batches up to 4 (3, 2, 3) and returns the single-process loss,
    as the plain step's evaluate does; 8 rows as before."""
    apply_fn, params = gpt()
    expected = []
    with torch.no_grad():
        for rows in (8, 6, 2, 3):
            ids, targets = batch(rows)
            expected.append(float(gpt_loss(apply_fn)(params, (ids, targets))))
    with fs.testing.LocalWorld(2, axes={"pp": 2}) as world:
        for got in world.run(_evaluate_short_batches):
            assert all(abs(g - e) <= 1e-6 * abs(e) for g, e in zip(got, expected)), (got, expected)


def evaluate_one(mesh, rows_by_rank):
    mesh = mesh_of(mesh, PP2)

    def run():
        step, params = make_step(mesh, microbatches=4)
        step.evaluate(step.init(params), batch(rows_by_rank[mesh.rank]))

    return outcome(run)


def test_evaluate_of_batches_cut_into_other_counts_is_refused_on_every_rank(world):
    """8 rows on one pipeline rank, 6 on the other: each cut them into the most equal micro-batches
    up to 4 (4 and 3), the micro-batch shape the same, and the ranks ran other schedules until the
    collective timeout (an adversarial pass). Now the count is part of what the ranks agree on."""
    for rank, (kind, message, _) in enumerate(world.run(evaluate_one, rows_by_rank=(8, 6))):
        assert kind == "MeshError" and "cuts the batch into 4 micro-batches" in message and "into 3" in message, (rank, message)
