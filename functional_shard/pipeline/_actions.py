"""Pipeline actions and schedules as plain values: printable, parseable, editable.

An action is one thing one rank does for one stage (and one micro-batch), written in
`torch.distributed.pipelining`'s compact form `<stage><KIND><microbatch>`:

    0F1          stage 0 forward of micro-batch 1
    3B0          stage 3 full backward of micro-batch 0
    2I0 / 2W0    stage 2 input-gradient / weight-gradient backward of micro-batch 0
    1SEND_F0     stage 1 sends micro-batch 0's activation to stage 2 (matched by 2RECV_F0)
    2SEND_B0     stage 2 sends micro-batch 0's input cotangent to stage 1 (matched by 1RECV_B0)
    1UNSHARD     gather stage 1's FSDP units; 1RESHARD frees them
    1REDUCE_GRAD reduce stage 1's gradients over the data-parallel ranks; 1OPTIMIZER updates it

A `PipelineSchedule` is one tuple of actions per pipeline rank, the stage placement
(`stages_per_rank`, "looped" or "v") and the number of micro-batches. Text (`to_text`) and
CSV (`to_csv`, one row per rank as torch's `_dump_csv`) round-trip exactly. Only stdlib here.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import io
import re
from typing import Iterable, NamedTuple, Sequence

__all__ = ["ActionKind", "Action", "TensorMeta", "PipelineSchedule", "ScheduleError", "stage_to_rank"]


class ScheduleError(ValueError):
    """A pipeline schedule that is malformed or would hang, wrong or mismatch the run.

    `actions` holds the first offending `(rank, action)` pairs the message names (rank is None
    where the action belongs to no rank yet, e.g. one that is missing).
    """

    def __init__(self, message: str, actions: Sequence[tuple[int | None, "Action"]] = ()):
        super().__init__(message)
        self.actions = tuple(actions)


class ActionKind(str, enum.Enum):
    """What an action does; the value is its text in the compact form (torch's `_ComputationType`)."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward (input and weight gradients) of one micro-batch through one stage
    I = "I"  # noqa: E741  input-gradient backward only (zero-bubble schedules)
    W = "W"  # weight-gradient backward only, after the same micro-batch's I
    SEND_F = "SEND_F"  # send a stage's output activation to the next stage
    RECV_F = "RECV_F"  # receive the previous stage's activation, before this stage's F
    SEND_B = "SEND_B"  # send a stage's input cotangent to the previous stage
    RECV_B = "RECV_B"  # receive the next stage's cotangent, before this stage's B or I
    UNSHARD = "UNSHARD"  # all-gather the stage's FSDP units (no micro-batch)
    RESHARD = "RESHARD"  # free the stage's gathered parameters (no micro-batch)
    REDUCE_GRAD = "REDUCE_GRAD"  # reduce the stage's accumulated gradients (no micro-batch)
    OPTIMIZER = "OPTIMIZER"  # the optimizer update of the stage's parameters (no micro-batch)


COMPUTE = frozenset({ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W})
BACKWARD = frozenset({ActionKind.B, ActionKind.I})  # those that consume and produce cotangents
SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
P2P = SENDS | RECVS
STAGE_LEVEL = frozenset({ActionKind.UNSHARD, ActionKind.RESHARD, ActionKind.REDUCE_GRAD, ActionKind.OPTIMIZER})

_KINDS = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"^(\d+)({_KINDS})(\d*)(?:\{{([^}}]*)\}})?$")
# torch's dtype names (`str(dtype)` without "torch."): floating, complex, integer, bool, float8 and
# the bit-packed kinds (the pipeline package needs no torch to read a schedule)
_DTYPE_RE = re.compile(r"(float((4|8)_e[0-9a-z_]+|16|32|64)|bfloat16|complex(32|64|128)|u?int(1|2|3|4|5|6|7|8|16|32|64)|bool|bits[0-9x]+|qu?int[0-9x]+)")


class TensorMeta(NamedTuple):
    """Shape and dtype of one tensor a SEND/RECV carries (checked to agree between the two ends)."""

    shape: tuple[int, ...]  # the tensor's shape on the wire
    dtype: str  # torch dtype name without "torch.", e.g. "float32"

    def __str__(self) -> str:
        return "x".join(str(d) for d in self.shape) + ":" + self.dtype

    @staticmethod
    def parse(text: str) -> "TensorMeta":
        shape, _, dtype = text.strip().partition(":")
        dims = shape.split("x") if shape else []
        if not _DTYPE_RE.fullmatch(dtype) or not all(d.isdigit() for d in dims):
            raise ScheduleError(
                f"tensor metadata {text!r} is not '<d0>x<d1>...:<dtype>' with sizes >= 0 and a torch dtype's name "
                "(e.g. '4x16:float32', ':int64' for a scalar)"
            )
        return TensorMeta(tuple(int(d) for d in dims), dtype)


def _meta(value) -> tuple[TensorMeta, ...] | None:
    if value is None:
        return None
    out = []
    for item in value:
        shape, dtype = item
        out.append(TensorMeta(tuple(int(d) for d in shape), str(dtype).removeprefix("torch.")))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Action:
    """One action of one rank: `Action("F", stage=0, microbatch=1)` prints as `0F1`.

    Arguments:
        kind: an `ActionKind` or its text ("F", "SEND_B", ...).
        stage: the global stage index, 0 for the stage holding the input.
        microbatch: the micro-batch index for compute and SEND/RECV actions; None for
            UNSHARD, RESHARD, REDUCE_GRAD and OPTIMIZER, which act on the whole stage.
        meta: SEND/RECV only, optional: `(shape, dtype)` per tensor carried, e.g.
            `(((4, 16), "float32"),)`; the check refuses a SEND and RECV whose metas differ.
    """

    kind: ActionKind
    stage: int
    microbatch: int | None = None
    meta: tuple[TensorMeta, ...] | None = None

    def __post_init__(self):
        try:
            kind = ActionKind(self.kind)
        except ValueError:
            raise ScheduleError(f"unknown action kind {self.kind!r}; kinds: {[k.value for k in ActionKind]}") from None
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "meta", _meta(self.meta))
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ScheduleError(f"action {kind.value}: stage must be an int >= 0, got {self.stage!r}")
        if kind in STAGE_LEVEL:
            if self.microbatch is not None:
                raise ScheduleError(f"{kind.value} acts on a whole stage: give no micro-batch (got {self.microbatch})")
        elif not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ScheduleError(
                f"action {self.stage}{kind.value}: needs a micro-batch index >= 0, got {self.microbatch!r}"
            )
        if self.meta is not None and kind not in P2P:
            raise ScheduleError(f"only SEND/RECV actions carry tensor metadata, not {self.stage}{kind.value}")

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{'' if self.microbatch is None else self.microbatch}"
        if self.meta is not None:
            text += "{" + ";".join(str(m) for m in self.meta) + "}"
        return text

    def __repr__(self) -> str:
        return f"Action({str(self)!r})"

    @staticmethod
    def parse(text: str) -> "Action":
        """The action whose compact text is `text` ("0F1", "1SEND_F0{4x16:float32}", "2UNSHARD")."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ScheduleError(
                f"cannot read action {text!r}: write <stage><KIND><microbatch>, e.g. '0F1', '2SEND_B3', '1UNSHARD'"
            )
        stage, kind, microbatch, meta = match.groups()
        try:
            metas = None if meta is None else tuple(TensorMeta.parse(m) for m in meta.split(";") if m.strip())
        except ScheduleError as error:
            raise ScheduleError(f"action {text.strip()!r}: {error}") from None
        return Action(ActionKind(kind), int(stage), int(microbatch) if microbatch else None, metas)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P

    def peer_stage(self) -> int | None:
        """The stage at the other end of a SEND/RECV (None for other kinds)."""
        if self.kind in (ActionKind.SEND_F, ActionKind.RECV_B):
            return self.stage + 1
        if self.kind in (ActionKind.RECV_F, ActionKind.SEND_B):
            return self.stage - 1
        return None

    def matching(self) -> "Action":
        """The action at the other end of this SEND/RECV: 1SEND_F0 <-> 2RECV_F0, 2SEND_B0 <-> 1RECV_B0."""
        pair = {
            ActionKind.SEND_F: ActionKind.RECV_F,
            ActionKind.RECV_F: ActionKind.SEND_F,
            ActionKind.SEND_B: ActionKind.RECV_B,
            ActionKind.RECV_B: ActionKind.SEND_B,
        }
        if self.kind not in pair:
            raise ScheduleError(f"{self} is not a SEND/RECV and has no matching action")
        return Action(pair[self.kind], self.peer_stage(), self.microbatch)


def stage_to_rank(stage: int, num_ranks: int, placement: str = "looped") -> int:
    """The pipeline rank that holds `stage`.

    "looped" (interleaved 1F1B, Megatron): rank r holds stages r, r+P, r+2P, ...
    "v" (ZBV, DualPipeV): rank r holds r, 2P-1-r, 2P+r, ... so the first and last stage share rank 0.
    """
    lap, offset = divmod(stage, num_ranks)
    if placement == "looped":
        return offset
    if placement == "v":
        return offset if lap % 2 == 0 else num_ranks - 1 - offset
    raise ScheduleError(f"placement must be 'looped' or 'v', got {placement!r}")


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule as data: per pipeline rank, the ordered actions it runs in one step.

    Arguments:
        actions: one tuple of `Action`s per pipeline rank, rank 0 first (strings such as "0F1"
            are parsed).
        num_microbatches: M, the micro-batches of one step; every stage runs each once.
        stages_per_rank: virtual stages per rank (1, or 2+ for interleaved / ZBV); the
            pipeline has `num_ranks * stages_per_rank` stages.
        placement: "looped" or "v" (see `stage_to_rank`); "looped" whenever the two coincide
            (one rank, or one stage per rank).
        name: a label only (not compared, not in CSV).
    """

    actions: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    stages_per_rank: int = 1
    placement: str = "looped"
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        rows = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in self.actions)
        object.__setattr__(self, "actions", rows)
        if not rows:
            raise ScheduleError("a pipeline schedule needs at least one rank's actions")
        if self.num_microbatches < 1 or self.stages_per_rank < 1:
            raise ScheduleError(
                "num_microbatches and stages_per_rank must be >= 1 "
                f"(got {self.num_microbatches}, {self.stages_per_rank})"
            )
        stage_to_rank(0, 1, self.placement)  # validates the placement's name
        if len(rows) == 1 or self.stages_per_rank == 1:  # both placements are the same mapping then
            object.__setattr__(self, "placement", "looped")

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        """The rank that holds `stage` under this schedule's placement."""
        return stage_to_rank(stage, self.num_ranks, self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank `rank` holds, in increasing order."""
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def replace(self, **changes) -> "PipelineSchedule":
        """A copy with fields changed, e.g. `schedule.replace(actions=edited)`."""
        return dataclasses.replace(self, **changes)

    def with_rank(self, rank: int, actions: Iterable[Action | str]) -> "PipelineSchedule":
        """A copy whose rank `rank` runs `actions` instead (the edit users make by hand), named
        `<name> (edited)` so that its printout and `step.explain()` do not call it the built-in."""
        rows = list(self.actions)
        rows[rank] = tuple(actions)
        name = self.name if self.name.endswith(" (edited)") else f"{self.name} (edited)"
        return self.replace(actions=tuple(rows), name=name)

    def compute_only(self) -> "PipelineSchedule":
        """The same schedule with only F/B/I/W actions (what `with_communication` lowers)."""
        return self.replace(actions=tuple(tuple(a for a in row if a.is_compute) for row in self.actions))

    def has_communication(self) -> bool:
        return any(a.is_p2p for row in self.actions for a in row)

    # ---- text and CSV ------------------------------------------------------------------------

    def to_text(self) -> str:
        """A header line with the placement, then `rank r: <actions...>` per rank (`from_text` reads it back)."""
        head = (
            f"# pipeline {self.name}: ranks={self.num_ranks} stages_per_rank={self.stages_per_rank} "
            f"placement={self.placement} microbatches={self.num_microbatches}"
        )
        rows = [f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions)]
        return "\n".join([head] + rows) + "\n"

    __str__ = to_text

    @staticmethod
    def from_text(text: str, **overrides) -> "PipelineSchedule":
        """Read `to_text`'s form; without its header line, the placement is inferred (see `from_rows`)."""
        header: dict = {}
        ranks: int | None = None
        rows: list[list[str]] = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            named = re.match(r"#\s*pipeline\s+(.*?):((?:\s+\w+=\S*)*)\s*$", line)
            if named and not header:  # the header (to_text's first line); other '#' lines are comments
                header["name"] = named.group(1)
                for key, value in re.findall(r"(\w+)=(\S*)", named.group(2)):
                    if key == "placement":
                        header["placement"] = value
                        continue
                    if key not in ("ranks", "stages_per_rank", "microbatches") or not value.isdigit():
                        raise ScheduleError(f"line {number}, the schedule's header: {key}={value!r} is not one of ranks=, "
                                            "stages_per_rank=, microbatches= with a number, or placement=")  # fmt: skip
                    if key == "ranks":
                        ranks = int(value)
                    else:
                        header["num_microbatches" if key == "microbatches" else key] = int(value)
                continue
            if line.startswith("#"):
                continue
            if not line:
                continue
            match = re.match(r"rank\s+(\d+)\s*:(.*)$", line)
            if match is None:
                raise ScheduleError(f"line {number} of the schedule text is not 'rank <r>: <actions>': {line!r}")
            if int(match.group(1)) != len(rows):
                raise ScheduleError(
                    f"line {number}: expected rank {len(rows)}'s actions, found rank {match.group(1)}'s"
                )
            rows.append(match.group(2).split())
        if ranks is not None and ranks != len(rows):
            raise ScheduleError(f"the schedule's header says ranks={ranks}, but the text has {len(rows)} rank line(s)")
        return PipelineSchedule.from_rows(rows, **(header | overrides))

    def to_csv(self) -> str:
        """One row per rank, one action per cell: the form torch's `_dump_csv` writes and `_load_csv` reads."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for row in self.actions:
            writer.writerow([str(a) for a in row])
        return out.getvalue()

    @staticmethod
    def from_csv(text: str, **overrides) -> "PipelineSchedule":
        """Read one row per rank (empty cells skipped, as torch's idle steps); placement inferred."""
        rows = [[cell for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]
        return PipelineSchedule.from_rows(rows, **overrides)

    @staticmethod
    def from_rows(rows: Sequence[Sequence[Action | str]], **fields) -> "PipelineSchedule":
        """A schedule from per-rank action lists; fields not given are inferred from the actions.

        `num_microbatches` is one more than the largest micro-batch index, `stages_per_rank`
        the stage count over the rank count, `placement` the one ("looped" or "v") the actions'
        stages agree with.
        """
        parsed = [[a if isinstance(a, Action) else Action.parse(a) for a in row] for row in rows]
        actions = [a for row in parsed for a in row]
        if not parsed:
            raise ScheduleError("the schedule has no rows: give one row of actions per pipeline rank")
        num_ranks = len(parsed)
        if "num_microbatches" not in fields:
            microbatches = [a.microbatch for a in actions if a.microbatch is not None]
            fields["num_microbatches"] = max(microbatches, default=0) + 1
        if "stages_per_rank" not in fields:
            num_stages = max((a.stage for a in actions), default=0) + 1
            fields["stages_per_rank"] = max(1, -(-num_stages // num_ranks))
        if "placement" not in fields:
            fits = [
                p
                for p in ("looped", "v")
                if all(stage_to_rank(a.stage, num_ranks, p) == r for r, row in enumerate(parsed) for a in row)
            ]
            fields["placement"] = fits[0] if fits else "looped"  # the check names the misplaced action
        return PipelineSchedule(tuple(tuple(row) for row in parsed), **fields)
