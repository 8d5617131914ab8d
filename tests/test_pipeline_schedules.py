"""fs.pipeline: schedules as data, checked before they run (issue 27's foundation).

Every built-in passes the check, compute-only and lowered (SEND/RECV, FSDP), under both send
models; text and CSV round-trip exactly; the built-ins' compute orders are torch's
(`torch.distributed.pipelining`), action for action; the theory figures hold exactly under unit
costs; bad schedules are refused naming the right actions; random edits of valid schedules are
either proved or refused, never crash the check.
"""

from __future__ import annotations

import random
from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_shard as fs
from functional_shard.pipeline import Action, ActionKind, Costs, PipelineSchedule, ScheduleError

pp = fs.pipeline
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def interleavable(P: int, M: int) -> bool:
    return M % max(1, M // P) == 0


@st.composite
def builtins(draw):
    """(name, schedule) for a built-in at P in 1..8, M in 1..16, v in 1..3."""
    P = draw(st.integers(1, 8))
    M = draw(st.integers(1, 16))
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb_h1", "zbv"]))
    if kind == "gpipe":
        return kind, pp.gpipe(P, M)
    if kind == "zbv":
        return kind, pp.zbv(P, M)
    if kind == "1f1b":
        return kind, pp.one_f_one_b(P, M)
    v = draw(st.integers(1, 3))
    if v > 1 or kind == "interleaved":
        M = draw(st.integers(1, 16).filter(lambda m: interleavable(P, m)))
    if kind == "interleaved":
        return kind, pp.interleaved_1f1b(P, M, stages_per_rank=v)
    return kind, pp.zero_bubble_h1(P, M, stages_per_rank=v)


# ---- actions and their text ----------------------------------------------------------------------


def test_actions_print_and_parse_in_torchs_compact_form():
    cases = ["0F1", "3B0", "2I0", "2W0", "1SEND_F0", "2RECV_F0", "2SEND_B0", "1RECV_B0", "1UNSHARD",
             "1RESHARD", "1REDUCE_GRAD", "0OPTIMIZER", "12F15", "1SEND_F0{4x16:float32;:int64}"]  # fmt: skip
    for text in cases:
        assert str(Action.parse(text)) == text
    assert Action.parse("0F1") == Action("F", 0, 1) == Action(ActionKind.F, stage=0, microbatch=1)
    assert hash(Action.parse("0F1")) == hash(Action("F", 0, 1))
    assert Action.parse("1SEND_F0").matching() == Action.parse("2RECV_F0")
    assert Action.parse("2SEND_B3").matching() == Action.parse("1RECV_B3")
    meta = Action("SEND_F", 1, 0, meta=[((4, 16), "torch.float32")]).meta
    assert meta == (pp.TensorMeta((4, 16), "float32"),)
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    for text in cases[:-1]:  # torch reads ours (no metadata) and prints the same text
        if "OPTIMIZER" not in text:
            assert str(torch_schedules._Action.from_str(text)) == text


@pytest.mark.parametrize(
    "bad, words",
    [("F0", "cannot read"), ("0X1", "cannot read"), ("0F", "micro-batch"), ("0UNSHARD1", "whole stage"),
     # metadata: a size that is not a number >= 0, a dtype torch has no name for, a field too many
     ("0SEND_F0{4xa:float32}", "'0SEND_F0{4xa:float32}': tensor metadata"), ("0SEND_F0{4x-1:float32}", "sizes >= 0"),
     ("0SEND_F0{4x16:notadtype}", "torch dtype"), ("0SEND_F0{4x16:float32:junk}", "torch dtype")],
)
def test_malformed_actions_are_refused(bad, words):
    with pytest.raises(ScheduleError, match=words):
        Action.parse(bad)
    with pytest.raises(ScheduleError, match="stage must be"):
        Action("F", -1, 0)
    with pytest.raises(ScheduleError, match="only SEND/RECV"):
        Action("F", 0, 0, meta=[((1,), "float32")])


@given(builtins(), st.booleans())
@FAST
def test_text_and_csv_round_trips_are_identities(case, lowered):
    _, schedule = case
    if lowered:
        schedule = pp.with_communication(schedule, fsdp=True)
    assert PipelineSchedule.from_text(schedule.to_text()) == schedule
    assert PipelineSchedule.from_text(str(schedule)).name == schedule.name
    assert PipelineSchedule.from_csv(schedule.to_csv()) == schedule
    assert PipelineSchedule.from_csv(schedule.to_csv()).to_csv() == schedule.to_csv()


def test_the_text_header_is_read_once_and_checked():
    """Only the header line sets fields (a later '#' line is a comment), its `ranks=` must match the
    rank lines, a field that is not a number is named, and a name with spaces reads back."""
    text = pp.one_f_one_b(2, 2).replace(name="my 1f1b").to_text()
    assert PipelineSchedule.from_text(text + "# TODO: try microbatches=4\n").num_microbatches == 2
    assert PipelineSchedule.from_text(text).name == "my 1f1b"
    with pytest.raises(ScheduleError, match="ranks=3, but the text has 2 rank line"):
        PipelineSchedule.from_text(text.replace("ranks=2", "ranks=3"))
    with pytest.raises(ScheduleError, match="line 1, the schedule's header: stages_per_rank='one'"):
        PipelineSchedule.from_text(text.replace("stages_per_rank=1", "stages_per_rank=one"))
    assert Action.parse("0SEND_F0{4x16:float8_e4m3fn;:int64}").meta == (pp.TensorMeta((4, 16), "float8_e4m3fn"), pp.TensorMeta((), "int64"))


def test_csv_is_torchs_format_both_ways(tmp_path):
    """torch reads our CSV rows with `_Action.from_str`; we read rows with torch's idle (empty) cells."""
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    schedule = pp.interleaved_1f1b(2, 4, stages_per_rank=2)
    import csv
    import io

    cells = csv.reader(io.StringIO(schedule.to_csv()))
    rows = [[torch_schedules._Action.from_str(cell) for cell in row] for row in cells]
    assert [[str(a) for a in row] for row in rows] == [[str(a) for a in row] for row in schedule.actions]
    with_idle = "0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    loaded = PipelineSchedule.from_csv(with_idle)
    assert loaded.num_ranks == 2 and loaded.num_microbatches == 2 and loaded.placement == "looped"
    pp.check(loaded)


def test_placement_looped_and_v():
    assert [pp.stage_to_rank(s, 4, "looped") for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [pp.stage_to_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    v = PipelineSchedule.from_rows([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]])
    assert v.placement == "v" and v.stages_of(0) == (0, 3)
    lowered = pp.with_communication(v)
    pp.check(lowered, sends="rendezvous")
    assert "1SEND_F0" not in lowered.to_text() and "2SEND_F0" in lowered.to_text()  # 1 -> 2 is local


# ---- the built-ins ---------------------------------------------------------------------------------


@given(builtins())
@FAST
def test_every_builtin_passes_the_check_compute_only_and_lowered(case):
    name, schedule = case
    result = pp.check(schedule, num_ranks=schedule.num_ranks, num_microbatches=schedule.num_microbatches)
    assert result.backward
    # every built-in adds a stage's micro-batch gradients in micro-batch order: GPipe's bits
    assert result.accumulation == (tuple(range(schedule.num_microbatches)),) * schedule.num_stages
    assert sorted(map(str, (a for _, a in result.order))) == sorted(str(a) for row in schedule.actions for a in row)
    for fsdp in (False, True):
        lowered = pp.with_communication(schedule, fsdp=fsdp)
        pp.check(lowered)
        pp.check(lowered, sends="rendezvous")
        assert lowered.compute_only() == schedule  # lowering only adds actions
        for row in lowered.actions:
            kinds = [a.kind for a in row]
            assert kinds.count(ActionKind.UNSHARD) == kinds.count(ActionKind.REDUCE_GRAD) == (
                len({a.stage for a in row}) if fsdp else 0
            )


def _torch_compute(rows) -> list[list[str]]:
    return [[str(a) for a in row if a is not None and a.computation_type.value in "FBIW"] for row in rows]


@pytest.mark.parametrize("P", range(1, 7))
def test_compute_orders_are_torchs(P):
    """torch computes `pipeline_order` without a process group; ours equal it action for action."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    mine = lambda s: [[str(a) for a in row] for row in s.actions]  # noqa: E731
    for M in range(1, 13):
        sizes = SimpleNamespace(_num_stages=P, _n_microbatches=M)
        assert _torch_compute(ts.ScheduleGPipe._get_pipeline_order(sizes).values()) == mine(pp.gpipe(P, M))
        if M >= P:
            # torch 2.13's Schedule1F1B._get_pipeline_order (a visualization only) starts the last rank at
            # F1 and never runs F0 there: its own _validate_schedule refuses it. Ranks 0..P-2 agree.
            theirs = _torch_compute(ts.Schedule1F1B._get_pipeline_order(sizes).values())
            assert theirs[:-1] == mine(pp.one_f_one_b(P, M))[:-1]
        assert mine(pp.one_f_one_b(P, M))[-1] == [f"{P-1}{k}{m}" for m in range(M) for k in "FB"]
        sizes = SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=2 * P)
        theirs = _torch_compute(ts.ScheduleZBVZeroBubble._calculate_single_rank_operations(sizes, r) for r in range(P))
        assert theirs == mine(pp.zbv(P, M))
        if not interleavable(P, M):
            continue
        for v in (1, 2, 3):
            sizes = SimpleNamespace(n_local_stages=v, pp_group_size=P, _n_microbatches=M,
                                    microbatches_per_round=M // max(1, M // P))  # fmt: skip
            pairs = (
                (ts.ScheduleInterleaved1F1B, pp.interleaved_1f1b),
                (ts.ScheduleInterleavedZeroBubble, pp.zero_bubble_h1),
            )
            for cls, ours in pairs:
                theirs = _torch_compute(cls._calculate_single_rank_operations(sizes, r) for r in range(P))
                assert theirs == mine(ours(P, M, stages_per_rank=v)), (cls.__name__, P, M, v)


def test_lowering_matches_torchs_add_send_recv():
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    for schedule in (pp.one_f_one_b(4, 8), pp.interleaved_1f1b(2, 4, 2), pp.zero_bubble_h1(3, 6), pp.zbv(3, 6)):
        compute = {r: [ts._Action.from_str(str(a)) for a in row] for r, row in enumerate(schedule.actions)}
        theirs = ts._add_send_recv(compute, stage_to_rank=schedule.rank_of, num_stages=schedule.num_stages)
        lowered = pp.with_communication(schedule)
        assert [[str(a) for a in theirs[r]] for r in range(schedule.num_ranks)] == [
            [str(a) for a in row] for row in lowered.actions
        ]


# ---- the theory, exactly under unit costs -----------------------------------------------------------


def exact(value) -> Fraction:
    return Fraction(value).limit_denominator(10_000)


@given(st.integers(1, 8), st.integers(1, 16))
@FAST
def test_bubble_and_memory_theory(P, M):
    unit = Costs(forward=1, backward=2, input_grad=1, weight_grad=1)
    one = pp.analyze(pp.one_f_one_b(P, M), unit)
    gpipe = pp.analyze(pp.gpipe(P, M), unit)
    for a in (one, gpipe):
        assert a.makespan == 3 * (M + P - 1)
        assert all(exact(b) == Fraction(P - 1, M + P - 1) for b in a.bubble)
    assert one.peak_in_flight == tuple(min(P - s, M) for s in range(P))  # <= P
    assert gpipe.peak_in_flight == (M,) * P
    zb = pp.analyze(pp.zero_bubble_h1(P, M), unit)  # F = I = W = 1
    if M >= P:  # enough deferred W's to fill every cool-down
        assert all(exact(b) == Fraction(P - 1, 3 * M + P - 1) for b in zb.bubble)
    assert all(z <= o for z, o in zip(zb.bubble, one.bubble))
    assert max(zb.peak_in_flight) == min(P, M)  # 1F1B's memory
    zbv = pp.analyze(pp.zbv(P, M))  # 2 stages per rank in a V, each F = I = W = 1: a rank works 6M
    if M >= 2 * P - 1:  # torch's ZBV plans at least 2P-1 micro-batches
        assert all(exact(b) == Fraction(P - 1, 6 * M + P - 1) for b in zbv.bubble)
    assert zbv.peak_in_flight == tuple(min(2 * P - s, M) for s in range(2 * P))  # half stages: 1F1B's memory
    if interleavable(P, M) and M >= P:
        for v in (2, 3):  # v stages per rank, each F = 1, B = 2: a rank works 3vM
            inter = pp.analyze(pp.interleaved_1f1b(P, M, v), unit)
            assert all(exact(b) == Fraction(P - 1, v * M + P - 1) for b in inter.bubble), (P, M, v)


def test_costs_per_stage_and_latency_shape_the_timeline():
    schedule = pp.one_f_one_b(2, 2)
    slow_last = pp.analyze(schedule, {1: Costs(forward=2, backward=4)})
    assert slow_last.makespan == 1 + 2 + 4 + 2 + 4 + 2  # rank 1 is the bottleneck, rank 0 waits for its B's
    latency = pp.analyze(schedule, Costs(p2p=1))
    assert latency.makespan == pp.analyze(schedule).makespan + 2  # one hop forward, one hop back on the critical path


def test_explain_shows_the_grid():
    text = pp.explain(pp.one_f_one_b(4, 8))
    assert "bubble per rank: 0.273, 0.273, 0.273, 0.273" in text
    assert "peak in-flight micro-batches per stage: 4, 3, 2, 1" in text
    grid = [line for line in text.splitlines() if line.startswith("rank")]
    assert len(grid) == 4 and grid[3].startswith("rank 3 | ... ... ... 3F0 3B0 --- 3F1")


# ---- bad schedules are refused, naming the right actions ---------------------------------------------


def refused(schedule, **kw) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        pp.check(schedule, **kw)
    return info.value


def test_deadlock_two_ranks_each_receiving_before_sending():
    schedule = PipelineSchedule.from_rows(
        [
            ["0F0", "0RECV_B0", "0SEND_F0", "0B0"],
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
        ]
    )
    error = refused(schedule)
    assert "deadlock: rank 0 waits at 0RECV_B0 (action 1) for rank 1 (1SEND_B0), which waits at 1RECV_F0 " \
           "(action 0) for rank 0 (0SEND_F0)" in str(error)  # fmt: skip
    assert error.actions == ((0, Action.parse("0RECV_B0")), (1, Action.parse("1RECV_F0")))


def test_rendezvous_model_is_stricter():
    """Both ranks send first: fine with non-blocking sends, a deadlock if sends wait for their receive."""
    fine = PipelineSchedule.from_rows(
        [
            ["0F0", "0SEND_F0", "0RECV_B0", "0B0"],
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0"],
        ]
    )
    pp.check(fine)
    pp.check(fine, sends="rendezvous")
    crossing = PipelineSchedule.from_rows(  # both send before receiving: rank 0 F1, rank 1 B0
        [
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"],
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"],
        ]
    )
    pp.check(crossing)
    error = refused(crossing, sends="rendezvous")
    assert "rank 0 waits at 0SEND_F1 (action 3) for rank 1 (1RECV_F1), which waits at 1SEND_B0 (action 3) " \
           "for rank 0 (0RECV_B0)" in str(error)  # fmt: skip


def test_compute_only_deadlock_names_the_cycle():
    schedule = PipelineSchedule.from_rows([["0F0", "0F1", "0B1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]])
    pp.check(schedule)  # any order of a rank's backwards is fine while the data allow it
    stuck = PipelineSchedule.from_rows([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]])
    error = refused(stuck)
    assert "deadlock: rank 0 waits at 0B0 (action 1) for rank 1 (1B0), which waits at 1F1 (action 0) " \
           "for rank 0 (0F1)" in str(error)  # fmt: skip


def test_missing_receive_is_refused():
    lowered = pp.with_communication(pp.one_f_one_b(2, 2))
    rank1 = [a for a in lowered.actions[1] if str(a) != "1RECV_F1"]
    error = refused(lowered.with_rank(1, rank1))
    assert "rank 1's 1F1" in str(error) and "no 1RECV_F1 before it" in str(error)
    error = refused(lowered.with_rank(0, [a for a in lowered.actions[0] if str(a) != "0SEND_F1"]))
    assert "rank 1's 1RECV_F1 (action 2) has no matching 0SEND_F1 on rank 0" in str(error)
    twice = lowered.with_rank(1, list(lowered.actions[1]) + [Action.parse("1RECV_F0")])
    assert "rank 1's 1RECV_F0 (action 8) appears twice (first at action 0)" in str(refused(twice))


def test_send_without_receive_and_mismatched_metadata():
    rows = [["0F0", "0SEND_F0{4x8:float32}", "0RECV_B0", "0B0"], ["1RECV_F0{4x8:bfloat16}", "1F0", "1B0", "1SEND_B0"]]
    error = refused(PipelineSchedule.from_rows(rows))
    assert "0SEND_F0{4x8:float32}" in str(error) and "1RECV_F0{4x8:bfloat16}" in str(error) and "disagree" in str(error)
    rows[1][0] = "1RECV_F0{4x8:float32}"
    pp.check(PipelineSchedule.from_rows(rows))
    rows = [["0F0", "0F1", "0SEND_F0", "0SEND_F1"], ["1RECV_F1", "1RECV_F0", "1F0", "1F1"]]  # forward only
    error = refused(PipelineSchedule.from_rows(rows))
    assert "in the order they are posted" in str(error) and "0SEND_F0" in str(error) and "1RECV_F1" in str(error)


def test_backward_before_forward_is_refused():
    error = refused(PipelineSchedule.from_rows([["0B0", "0F0"]]))
    assert "rank 0's 0B0 (action 0) runs before its forward 0F0" in str(error)
    error = refused(PipelineSchedule.from_rows([["0F0", "0W0", "0I0"]]))
    assert "rank 0's 0W0 (action 1)" in str(error) and "0I0 is needed first" in str(error)


def test_weight_gradient_after_the_reduction_is_refused():
    rows = [["0F0", "0I0", "0REDUCE_GRAD", "0W0"]]
    error = refused(PipelineSchedule.from_rows(rows))
    assert "rank 0's 0W0 (action 3) adds to stage 0's gradients after 0REDUCE_GRAD (action 2)" in str(error)
    assert error.actions == ((0, Action.parse("0W0")), (0, Action.parse("0REDUCE_GRAD")))
    pp.check(PipelineSchedule.from_rows([["0F0", "0I0", "0W0", "0REDUCE_GRAD", "0OPTIMIZER"]]))
    late = PipelineSchedule.from_rows([["0F0", "0B0", "0OPTIMIZER", "0REDUCE_GRAD"]])
    assert "comes after 0OPTIMIZER" in str(refused(late))


def test_compute_on_a_resharded_stage_is_refused():
    error = refused(PipelineSchedule.from_rows([["0UNSHARD", "0F0", "0RESHARD", "0B0"]]))
    assert "rank 0's 0B0 (action 3) runs stage 0 while its parameters are not gathered" in str(error)


def test_a_schedule_for_another_stage_count_is_refused():
    schedule = pp.interleaved_1f1b(2, 4, stages_per_rank=2)
    error = refused(schedule, num_stages=2)
    assert "is for 4 stages (2 ranks x 2 stage(s) per rank, looped, M=4) but the run has 2" in str(error)
    assert "micro-batches" in str(refused(schedule, num_microbatches=8))
    wrong = pp.one_f_one_b(2, 2).with_rank(1, ["1F0", "2F0", "1B0", "1F1", "1B1"])
    assert "rank 1's 2F0 (action 1) names stage 2, but the schedule has 2 stages" in str(refused(wrong))
    misplaced = pp.gpipe(2, 1).with_rank(0, ["0F0", "1F0", "0B0"])
    assert "stage 1 is placed on rank 1" in str(refused(misplaced))
    assert "never forwards micro-batch 1" in str(refused(pp.gpipe(2, 2).with_rank(0, ["0F0", "0B0"])))


# ---- mutations: proved or refused, never a crash ---------------------------------------------------


def mutate(schedule: PipelineSchedule, rng: random.Random) -> PipelineSchedule:
    rows = [list(row) for row in schedule.actions]
    rank = rng.randrange(len(rows))
    row = rows[rank]
    if not row:
        return schedule
    op = rng.choice(["drop", "swap", "move", "duplicate"])
    i, j = rng.randrange(len(row)), rng.randrange(len(row))
    if op == "drop":
        del row[i]
    elif op == "swap":
        row[i], row[j] = row[j], row[i]
    elif op == "move":
        rows[rng.randrange(len(rows))].insert(j, row.pop(i))
    else:
        row.insert(j, row[i])
    return schedule.replace(actions=tuple(tuple(r) for r in rows))


@given(builtins(), st.booleans(), st.integers(0, 2**32 - 1))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_mutations_are_proved_or_refused(case, lowered, seed):
    _, schedule = case
    if lowered:
        schedule = pp.with_communication(schedule, fsdp=True)
    rng = random.Random(seed)
    mutated = mutate(schedule, rng)
    for sends in ("nonblocking", "rendezvous"):
        try:
            result = pp.check(mutated, sends=sends)
        except ScheduleError as error:
            assert str(error)
        else:
            assert len(result.order) == sum(len(row) for row in mutated.actions)


def test_the_package_stands_alone():
    """fs.pipeline imports only the standard library and its own modules: no step, no torch."""
    import ast
    import pathlib
    import sys

    folder = pathlib.Path(pp.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 1 or node.module.split(".")[0] in sys.stdlib_module_names, (path.name, node.module)
            elif isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names), path.name
