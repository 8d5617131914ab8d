"""`fs.analysis.autotune`: the invariants of the search, on a small GPT at world size 2 (gloo).

No timing thresholds: which schedule wins depends on the machine's load. What must hold
whatever the timings: the returned schedule fits the budget by its own prediction (and as
measured), every rank returns the same schedule and table, the state and the caller's RNG are
untouched, and a budget below every candidate raises before anything is measured.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

SPACE = fs.analysis.SearchSpace(prefetch=(1,), keep_gathered=(0.0, 1.0), remat=(0.0, 1.0), bucket_units=(0, 2))


def _gpt_step(mesh, *, donate: bool = False, schedule=None):
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=2, n_head=2, d_model=24)))

    def loss_fn(p, batch):
        inputs, targets = batch
        return F.cross_entropy(apply_fn(p, inputs).flatten(0, 1), targets.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), donate=donate, schedule=schedule)
    tokens = torch.randint(0, 31, (2, 17), generator=torch.Generator().manual_seed(mesh.rank))
    return step, step.init(params), (tokens[:, :-1], tokens[:, 1:])


def _tune(mesh):
    step, state, batch = _gpt_step(mesh, donate=True)
    machine = fs.analysis.h100_sxm(world_size=mesh.world_size)  # no calibration: the invariants hold for any machine
    budget = fs.analysis.simulate(step.lower(state, batch), machine).memory.peak  # the step's own schedule fits
    before = [t.clone() for t in fs.tree_leaves(state)]
    rng = torch.get_rng_state()
    result = fs.analysis.autotune(
        step, state, batch, budget_bytes=budget, machine=machine, space=SPACE, confirm=2, rounds=2, steps=1, warmup=0,
        confidence=0.0,  # the fastest median wins (the default, 0.9, keeps the step's own unless it is beaten clearly)
    )
    own = fs.analysis.simulate(fs.sharded_step(step.loss_fn, mesh, optimizer=step.optimizer, donate=True, schedule=result.schedule).lower(state, batch), machine)
    try:
        fs.analysis.autotune(step, state, batch, budget_bytes=1000, machine=machine, space=SPACE)
        error = None
    except ValueError as e:
        error = str(e)
    return {
        "schedule": repr(result.schedule),
        "table": result.table(),
        "candidates": [(c.label, c.predicted_peak, c.measured_peak, c.verdict) for c in result.candidates],
        "result": result,
        "budget": budget,
        "own_peak": own.memory.peak,
        "state_unchanged": all(torch.equal(a, b) for a, b in zip(before, fs.tree_leaves(state))),
        "rng_unchanged": torch.equal(rng, torch.get_rng_state()),
        "error": error,
    }


def test_autotune_fits_the_budget_and_ranks_agree(local_world):
    reports = local_world(2).run(_tune)
    first = reports[0]
    result = first["result"]
    budget = first["budget"]
    # Every rank: the same schedule, the same figures and verdicts.
    for report in reports[1:]:
        assert report["schedule"] == first["schedule"]
        assert report["candidates"] == first["candidates"]
        assert report["table"] == first["table"]
    for report in reports:
        assert report["state_unchanged"], "autotune must not modify the state (the step donates: measured on copies)"
        assert report["rng_unchanged"]
    chosen = result.chosen
    assert chosen.schedule == result.schedule and result.budget_bytes == budget
    # Never over the budget by its own prediction (the search's copy and its own lowering), nor as measured.
    assert chosen.predicted_peak <= budget and first["own_peak"] <= budget
    assert chosen.measured_peak is not None and chosen.measured_peak <= budget
    assert [c.verdict for c in result.candidates].count("chosen") == 1
    # The step's own schedule comes first and is always measured; at most confirm + 1 are measured.
    assert result.reference.label.endswith("(the step's own)") and result.reference.measured_s is not None
    measured = [c for c in result.candidates if c.measured_s is not None]
    assert 2 <= len(measured) <= 3 and all(len(c.times_s) == 2 for c in measured)
    for c in measured:
        if c.verdict.startswith("measured slower"):
            assert c.measured_s >= chosen.measured_s
        if c.measured_peak <= budget and c.predicted_peak <= budget:
            assert c.measured_s >= chosen.measured_s  # confidence 0: the fastest median that fits
    for c in result.candidates:
        if c.predicted_peak is not None and c.predicted_peak > budget:
            assert c.verdict != "chosen" and "over the budget" in c.verdict
        if c.measured_s is None:
            assert c.measured_peak is None and c.times_s == ()
    assert len({c.schedule for c in result.candidates}) == len(result.candidates)  # no duplicates
    assert len(result.candidates) <= SPACE.size + 1
    # The table reports every candidate, the budget and the choice.
    table = first["table"]
    assert f"chosen: {first['schedule']}" in table and table.count("\n| ") == len(result.candidates) + 2  # and the header, the rule
    # A budget below every candidate: a clear error, before any measurement, on every rank.
    smallest = min(c.predicted_peak for c in result.candidates if c.predicted_peak is not None)
    for report in reports:
        assert report["error"] is not None
        assert "budget of 1000 bytes" in report["error"]
        assert f"smallest predicted peak is {smallest} bytes" in report["error"]


def test_sign_test_counts_paired_wins():
    from functional_shard.analysis._autotune import _sign_test

    assert _sign_test((1.0, 1.0, 1.0), (2.0, 2.0, 2.0)) == (3, 3, 1 / 8)
    assert _sign_test((3.0, 1.0), (2.0, 2.0)) == (1, 2, 3 / 4)
    assert _sign_test((2.0,), (2.0,)) == (0, 1, 1.0)  # a tie is no win


def test_autotune_refuses_what_it_cannot_search():
    mesh = fs.analysis.AbstractMesh({"fsdp": 2})
    state, batch = None, None  # refused before they are read
    eager = fs.sharded_step(lambda p, b: p["w"].sum(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(trace=False))
    with pytest.raises(ValueError, match="traced fs.Schedule"):
        fs.analysis.autotune(eager, state, batch, budget_bytes=1 << 20)
    own_list = fs.sharded_step(lambda p, b: p["w"].sum(), mesh, optimizer=fs.optim.sgd(lr=0.1), schedule=fs.Schedule(passes=()))
    with pytest.raises(ValueError, match="passes="):
        fs.analysis.autotune(own_list, state, batch, budget_bytes=1 << 20)
    traced = fs.sharded_step(lambda p, b: p["w"].sum(), mesh, optimizer=fs.optim.sgd(lr=0.1))
    with pytest.raises(ValueError, match="budget_bytes"):
        fs.analysis.autotune(traced, state, batch, budget_bytes=0)
    with pytest.raises(ValueError, match="confirm"):
        fs.analysis.autotune(traced, state, batch, budget_bytes=1 << 20, confirm=0)
    with pytest.raises(ValueError, match="confidence"):
        fs.analysis.autotune(traced, state, batch, budget_bytes=1 << 20, confidence=1.0)
    with pytest.raises(ValueError, match="SearchSpace.remat"):
        fs.analysis.SearchSpace(remat=(1.5,))
    with pytest.raises(ValueError, match="SearchSpace.prefetch"):
        fs.analysis.SearchSpace(prefetch=())
    assert fs.analysis.SearchSpace().size == 54


def test_search_space_tries_gathering_once_with_microbatches():
    """With micro-batches, the combinations that keep every unit gathered are also tried
    gathered once per step; a step that already gathers once still gets resharding candidates
    (they set `reshard_after_backward` back, as `Schedule` requires)."""
    space = fs.analysis.SearchSpace(prefetch=(1,), keep_gathered=(0.0, 1.0), remat=(0.0,), bucket_units=(0,))
    args = dict(backward_order=["b", "a"], forward_end_order=["a", "b"], largest_gather_bytes=100)
    assert len(space.schedules(fs.Schedule(), **args)) == 2
    four = space.schedules(fs.Schedule(), **args, microbatches=4)
    assert len(four) == 3
    label, once = four[-1]
    assert label.endswith("gathered once per step"), label
    assert once.reshard_after_backward is False and once.reshard_after_forward is False
    base = fs.Schedule(reshard_after_forward=False, reshard_after_backward=False)
    assert {s.reshard_after_backward for _, s in space.schedules(base, **args, microbatches=4)} == {True, False}


def _tune_kept_choices(mesh):
    """A ZeRO-1 step and an offloaded one are tuned as themselves: every candidate keeps the
    step's `reshard_after_update` and `offload` (they change what is traced, not only the
    passes), and the chosen schedule trains to the step's own bits."""
    out = {}
    for name, schedule in (("zero1", fs.Schedule(reshard_after_update=False)), ("offload", fs.Schedule(offload=True))):
        step, state, batch = _gpt_step(mesh, schedule=schedule)
        machine = fs.analysis.h100_sxm(world_size=mesh.world_size)
        result = fs.analysis.autotune(step, state, batch, budget_bytes=1 << 40, machine=machine, space=SPACE,
                                      confirm=1, rounds=1, steps=1, warmup=0)  # fmt: skip
        kept = all(
            c.schedule.reshard_after_update == schedule.reshard_after_update and c.schedule.offload == schedule.offload
            for c in result.candidates
        )
        # what it predicted for the step's own schedule is the step's own graph's prediction
        own = fs.analysis.simulate(step.lower(state, batch), machine).memory.peak
        kept = kept and result.candidates[0].predicted_peak == own
        tuned, tuned_state, _ = _gpt_step(mesh, schedule=result.schedule)
        a, _ = step(state, batch)
        b, _ = tuned(tuned_state, batch)
        same = all(torch.equal(x, y) for x, y in zip(fs.tree_leaves((a.params, a.opt_state)), fs.tree_leaves((b.params, b.opt_state))))
        out[name] = (kept, same, len(result.candidates))
    return out


# With -m slow (suite time, 11-27 s): the autotuner's search, budget and agreement on the default
# step stay in test_autotune_fits_the_budget_and_ranks_agree.
@pytest.mark.slow
def test_autotune_keeps_zero1_and_offload(local_world):
    for report in local_world(2).run(_tune_kept_choices):
        for name, (kept, same, n) in report.items():
            assert kept and same and n > 1, (name, kept, same, n)
