"""What the jit learns about each collective while it traces a step, kept out of the math.

While `_jit` traces a step, it opens a `recording()`; every collective the meshes issue then
appends one `Issued` record (in issue order) naming its kind, the buffer it moves (the
innermost `moving(...)` label, or None for collectives that move no parameter buffer, e.g. a
user's `fs.all_reduce`) and the phase of the step it belongs to (the innermost `phase(...)`;
"backward" where none is set, since the autograd engine runs the backward outside any code
of ours). The tracer matches the records with the collective nodes of the graph, in order.

Context variables, not arguments: the computation is the same function eagerly and traced,
and outside a recording every call here is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, NamedTuple

__all__ = ["Issued", "recording", "moving", "phase", "record"]


class Issued(NamedTuple):
    """One collective issued while a step was traced."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    buffer: Any  # the BufferSpec it moves, or None
    phase: str  # "forward" | "backward" | "update"


_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("functional_shard_trace_log", default=None)
_BUFFER: contextvars.ContextVar[Any] = contextvars.ContextVar("functional_shard_buffer", default=None)
_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("functional_shard_phase", default="backward")


@contextlib.contextmanager
def recording() -> Iterator[list[Issued]]:
    """Collect an `Issued` record per collective issued inside the block."""
    log: list[Issued] = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextlib.contextmanager
def moving(buffer: Any) -> Iterator[None]:
    """Label the collectives issued inside the block as moving `buffer` (a BufferSpec)."""
    token = _BUFFER.set(buffer)
    try:
        yield
    finally:
        _BUFFER.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label the collectives issued inside the block as part of `name` ("forward", "update")."""
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


def record(kind: str) -> None:
    """Called by a mesh right before it issues a collective of `kind`."""
    log = _LOG.get()
    if log is not None:
        log.append(Issued(kind, _BUFFER.get(), _PHASE.get()))
