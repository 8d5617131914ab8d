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
import threading
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch.compiler

__all__ = [
    "Issued", "Guard", "recording", "moving", "phase", "microbatch", "record", "guard", "graph_semantics",
    "random_stream", "random_base", "adjoint_ops", "adjoint_ops_enabled", "recording_model_axes", "note_model_axis",
    "carried", "carry_into_backward",
]


class Issued(NamedTuple):
    """One collective issued while a step was traced."""

    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    buffer: Any  # the BufferSpec it moves, or None
    phase: str  # "forward" | "backward" | "update"
    microbatch: int | None  # the micro-batch it serves (None: the step has one, or it serves all)


class Guard(NamedTuple):
    """A Python value a traced graph was specialised on (e.g. a module's train/eval mode)."""

    what: str  # what it is, for messages
    read: Any  # () -> the current value (hashable)
    value: Any  # the value while tracing


_GUARDS: contextvars.ContextVar[list | None] = contextvars.ContextVar("functional_shard_guards", default=None)
_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar("functional_shard_trace_log", default=None)
_BUFFER: contextvars.ContextVar[Any] = contextvars.ContextVar("functional_shard_buffer", default=None)
_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("functional_shard_phase", default="backward")
_MICROBATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("functional_shard_microbatch", default=None)
_RANDOM_BASE: contextvars.ContextVar[int | None] = contextvars.ContextVar("functional_shard_random_base", default=None)
_ADJOINT_OPS: contextvars.ContextVar[bool] = contextvars.ContextVar("functional_shard_adjoint_ops", default=False)
_MODEL_AXES: contextvars.ContextVar[set | None] = contextvars.ContextVar("functional_shard_model_axes", default=None)
_COLLECTIVE_NOTE: contextvars.ContextVar[Any] = contextvars.ContextVar("functional_shard_collective_note", default=None)


@contextlib.contextmanager
def recording() -> Iterator[tuple[list[Issued], list[Guard]]]:
    """Collect an `Issued` record per collective issued inside the block, and the `Guard`s
    that code run inside it declared."""
    log: list[Issued] = []
    guards: list[Guard] = []
    token, guard_token = _LOG.set(log), _GUARDS.set(guards)
    try:
        yield log, guards
    finally:
        _LOG.reset(token)
        _GUARDS.reset(guard_token)


def guard(what: str, read) -> None:
    """Declare that what is being traced depends on the Python value `read()` (hashable): a
    traced graph is reused only while `read()` still returns what it returned while tracing.
    Outside tracing a no-op."""
    guards = _GUARDS.get()
    if guards is not None:
        guards.append(Guard(what, read, read()))


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


@contextlib.contextmanager
def microbatch(index: int | None) -> Iterator[None]:
    """Label the collectives issued inside the block as serving micro-batch `index`."""
    token = _MICROBATCH.set(index)
    try:
        yield
    finally:
        _MICROBATCH.reset(token)


@contextlib.contextmanager
def random_stream(base: int) -> Iterator[None]:
    """The step's random stream for the block: `functional_shard::reseed` derives each chunk's
    seed from `base` (a layout-invariant step, `_canonical`)."""
    token = _RANDOM_BASE.set(base)
    try:
        yield
    finally:
        _RANDOM_BASE.reset(token)


@contextlib.contextmanager
def adjoint_ops() -> Iterator[None]:
    """Inside the block, collectives with a custom backward are issued as operators that carry
    it (`fs.tensor_parallel`'s `tp_collective`): what a traced pipeline stage needs, since it is
    replayed under autograd and an autograd.Function leaves only its forward in a graph."""
    token = _ADJOINT_OPS.set(True)
    try:
        yield
    finally:
        _ADJOINT_OPS.reset(token)


def adjoint_ops_enabled() -> bool:
    return _ADJOINT_OPS.get()


@contextlib.contextmanager
def recording_model_axes() -> Iterator[set]:
    """Inside the block, the mesh axes `fs.tensor_parallel`'s collectives are asked to work over
    are added to the set it yields (`note_model_axis`): what a step reads to tell a model whose
    modules were never parallelized from one that was."""
    seen: set = set()
    token = _MODEL_AXES.set(seen)
    try:
        yield seen
    finally:
        _MODEL_AXES.reset(token)


@contextlib.contextmanager
def noting_collectives(callback: Callable[[Any, Sequence[str], str], None]) -> Iterator[None]:
    """Within the block, `note_collective` calls `callback(out, axes, kind)` (`_split_values`)."""
    token = _COLLECTIVE_NOTE.set(callback)
    try:
        yield
    finally:
        _COLLECTIVE_NOTE.reset(token)


def note_collective(out: Any, axes: Sequence[str], kind: str) -> None:
    """What a collective run in Python (a `SimulatedMesh`'s) made over `axes`: `kind` "whole" (an
    all-reduce or all-gather: the same on every rank) or "split" (a reduce-scatter)."""
    callback = _COLLECTIVE_NOTE.get()
    if callback is not None:
        callback(out, axes, kind)


def note_model_axis(axis: str) -> None:
    seen = _MODEL_AXES.get()
    if seen is not None:
        seen.add(axis)


def random_base() -> int | None:
    """The base seed of the enclosing `random_stream`, or None."""
    return _RANDOM_BASE.get()


def carry_into_backward(setup_context, backward):
    """(setup_context, backward) of an autograd function whose backward sees the context of
    its forward when the autograd engine runs it on another thread.

    The engine runs the backward of CUDA tensors on a thread of its own per device (on a CPU,
    in the thread that asked for the gradient), and a thread starts with no context variables:
    a collective the backward issues would go unrecorded while a step is traced, and a traced
    pipeline stage would lose `adjoint_ops`. `setup_context` keeps the forward's context and
    thread; a backward run on another thread runs in a copy of that context, labelled
    "backward" and moving no buffer until the function labels one itself (as in the thread
    that asked, where those are the defaults). On the asking thread nothing changes."""

    def carrying_setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.fs_context = (threading.get_ident(), contextvars.copy_context())

    def carrying_backward(ctx, *grads):
        ident, context = ctx.fs_context
        if ident == threading.get_ident():
            return backward(ctx, *grads)
        return context.copy().run(_in_backward, backward, ctx, grads)

    return carrying_setup, carrying_backward


def _in_backward(backward, ctx, grads):
    with phase("backward"), moving(None):
        return backward(ctx, *grads)


def carried(cls):
    """Class decorator for a `torch.autograd.Function` with `setup_context`:
    `carry_into_backward` on its `setup_context` and `backward`."""
    setup, backward = carry_into_backward(cls.setup_context, cls.backward)
    cls.setup_context, cls.backward = staticmethod(setup), staticmethod(backward)
    return cls


def record(kind: str) -> None:
    """Called by a mesh right before it issues a collective of `kind`."""
    log = _LOG.get()
    if log is not None:
        log.append(Issued(kind, _BUFFER.get(), _PHASE.get(), _MICROBATCH.get()))


class _CompilingFlag:
    """torch's process-wide "is compiling" flag, set while any thread is inside
    `graph_semantics` and restored when the last one leaves (the thread-ranks of a simulated
    mesh run loss functions at the same time: a plain save/restore per thread could leave the
    flag set for good, and change torch.optim's code path for the rest of the process)."""

    lock = threading.Lock()
    depth = 0
    saved = False

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            if cls.depth == 0:
                cls.saved = torch.compiler._is_compiling_flag
                torch.compiler._is_compiling_flag = True
            cls.depth += 1

    @classmethod
    def exit(cls) -> None:
        with cls.lock:
            cls.depth -= 1
            if cls.depth == 0:
                torch.compiler._is_compiling_flag = cls.saved


@contextlib.contextmanager
def graph_semantics() -> Iterator[None]:
    """Run `loss_fn` as torch.export does: `torch.compiler.is_compiling()` is True inside.

    Libraries check it to skip shortcuts that read a tensor's value — transformers' sdpa
    masks skip the explicit causal mask when a padding mask is all ones, which a traced graph
    cannot decide. The eager reference runs under it too, so that both take the same code
    path (and give the same bits). It sets torch's own flag for the duration (restored after).
    """
    _CompilingFlag.enter()
    try:
        yield
    finally:
        _CompilingFlag.exit()
