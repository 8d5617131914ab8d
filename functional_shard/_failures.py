"""How a rank failed, and which rank's failure caused the others.

Every rank of a failed run gets a `Failure` of a `FailureKind`. When one rank dies, its peers
fail too, from their collectives ("Connection closed by peer", a collective timeout): those are
consequences. `RankError` names the cause: a rank that raised an exception of its own, was
killed by a signal or exited without a report, before any rank whose error came from a
collective; among those, the first to report.
"""

from __future__ import annotations

import dataclasses
import enum
import signal

__all__ = ["Failure", "FailureKind", "MeshError", "PeerError", "RankError"]


class MeshError(RuntimeError):
    """Ranks disagree (structure, shapes, collective sequence) or the mesh does not fit the world.

    Attributes:
        differences: rank -> what it held where ranks first differ (empty when not known).
    """

    def __init__(self, message: str, differences: dict[int, str] | None = None):
        super().__init__(message)
        self.differences = dict(differences or {})

    def __reduce__(self):
        return (type(self), (str(self), self.differences))


class PeerError(MeshError):
    """This rank stops because another rank failed first (named by `rank`); the cause is there.

    Attributes:
        rank: the rank that failed.
    """

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (str(self), self.rank))


class FailureKind(enum.Enum):
    """What happened to a rank that did not return a result."""

    RAISED = "raised"  # its function raised an exception of its own
    COLLECTIVE = "collective failed"  # it raised from a collective, a peer's connection, or `PeerError`: a consequence
    EXITED = "exited without a report"  # the process ended (exit code in `Failure.exit_code`) before reporting
    KILLED = "killed by a signal"  # the process was killed by signal `Failure.signal` (SIGKILL, SIGSEGV, SIGABRT...)
    STOPPED = "stopped by the launcher"  # still running when the launcher gave up on it (grace, interrupt)
    TIMED_OUT = "timed out"  # no report within the run's timeout


# The order in which failures are believed as the cause: a rank's own error or death first,
# then errors that a collective raised because a peer was gone, then ranks the launcher stopped.
_CAUSE_TIERS = {
    FailureKind.RAISED: 0,
    FailureKind.EXITED: 0,
    FailureKind.KILLED: 0,
    FailureKind.COLLECTIVE: 1,
    FailureKind.STOPPED: 2,
    FailureKind.TIMED_OUT: 2,
}


@dataclasses.dataclass(frozen=True)
class Failure:
    """One rank's failure."""

    kind: FailureKind  # what happened
    message: str  # one line: the exception's type and message, or what the launcher saw
    traceback: str = ""  # the rank's traceback when it raised, else ""
    exit_code: int | None = None  # the process's exit code if it ended (negative: killed by signal -exit_code)
    blames: int | None = None  # the rank a `PeerError` of this rank named as the one that failed first, if any

    @property
    def signal(self) -> int | None:
        """The signal that killed the process, if one did."""
        return -self.exit_code if self.exit_code is not None and self.exit_code < 0 else None

    @classmethod
    def of_exit(cls, exit_code: int | None, when: str = "") -> "Failure":
        """The failure of a process that ended with `exit_code` without reporting."""
        if exit_code is not None and exit_code < 0:
            try:
                name = signal.Signals(-exit_code).name
            except ValueError:
                name = "an unknown signal"
            return cls(FailureKind.KILLED, f"process killed by signal {-exit_code} ({name}){when}", exit_code=exit_code)
        return cls(FailureKind.EXITED, f"process exited with code {exit_code} without a report{when}", exit_code=exit_code)


# Markers of an error that a collective raised because a peer was gone or late (gloo raises a
# plain RuntimeError naming its transport; NCCL and the stores raise torch.distributed.DistError).
_COLLECTIVE_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "NCCL error",
    "Watchdog caught collective operation timeout",
)


def is_collective_error(error: BaseException) -> bool:
    """Whether `error` (or an exception it was raised from) came from a collective or a peer
    connection, or is a `PeerError` (this rank stopped because another failed)."""
    import torch.distributed as dist

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (PeerError, getattr(dist, "DistError", PeerError))):
            return True
        if any(marker in str(current) for marker in _COLLECTIVE_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def blamed_rank(error: BaseException) -> int | None:
    """The rank a `PeerError` in `error`'s chain names as the one that failed first, if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, PeerError):
            return current.rank
        current = current.__cause__ or current.__context__
    return None


def first_cause(failures: dict[int, Failure]) -> int:
    """The rank whose failure caused the others'. `failures` is in the order they were seen.

    A rank's own error or death first; else, among consequences, a rank that another rank's
    `PeerError` names (a rank that issued a collective of its own fails only from its peers'
    exit, after they named it); else the first consequence seen."""
    if not failures:
        raise ValueError("no failures to choose a cause from")
    cause = min(failures, key=lambda rank: _CAUSE_TIERS[failures[rank].kind])  # min keeps the earliest of a tier
    if _CAUSE_TIERS[failures[cause].kind] == 0:
        return cause
    blamed = [f.blames for f in failures.values() if f.blames in failures and f.blames is not None]
    return blamed[0] if blamed else cause


class RankError(RuntimeError):
    """A rank of a local run failed.

    Attributes:
        rank: the rank whose failure caused the others' (see `first_cause`).
        remote_traceback: its traceback, as text ("" when it did not raise).
        failures: rank -> `Failure`, for every rank that failed or was stopped, in the order seen.
    """

    def __init__(self, failures: dict[int, Failure], rank: int | None = None):
        self.failures = dict(failures)
        self.rank = first_cause(self.failures) if rank is None else rank
        cause = self.failures[self.rank]
        self.remote_traceback = cause.traceback
        others = "".join(
            f"\n  rank {r}: {failure.message}" for r, failure in sorted(self.failures.items()) if r != self.rank
        )
        text = f"rank {self.rank} failed: {cause.message}{others}"
        if cause.traceback:
            text += f"\n\n--- traceback of rank {self.rank} ---\n{cause.traceback}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.failures, self.rank))
