"""Where each operation of a traced step comes from, so that a failure while it replays names the user's line.

A traced step replays a graph: an exception raised by one of its operations (a dtype mismatch,
an index out of range that only the batch's values reveal) would point into FX's generated
code, and torch's `GraphModule.__call__` prints that code and drops the traceback. The eager
reference shows the user's line instead. So the tracer records, per node, the innermost frames
of the user's code that issued it (`node.meta["stack_trace"]`, as make_fx's
`record_stack_traces`, but keeping the user's frames where make_fx keeps only `forward`
methods: a loss computed in `loss_fn` itself is named too), and `replay` runs the graph's
generated function directly; if it raises, the generated line gives the node, and the error is
raised again, of the same type, its message followed by the operation and the user's frames,
the original chained. A trace that fails names the user's frame too (`culprit_frame`).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = ["make_fx_with_sources", "replay", "failing_node", "describe_node", "culprit_frame"]

_TORCH = os.path.dirname(torch.__file__) + os.sep
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MODELS = _PACKAGE + "models.py"  # reference models: user code as far as a failure goes
_STDLIB = os.path.dirname(os.__file__) + os.sep
_FRAMES_KEPT = 4  # innermost user frames recorded per node
_FRAME = re.compile(r'File "(.*)", line (\d+), in (.*)')


def _is_user_file(filename: str) -> bool:
    if filename.startswith(("<", _TORCH, _STDLIB)):
        return False
    return not filename.startswith(_PACKAGE) or filename == _MODELS


def _user_stack(frame) -> str:
    """The innermost `_FRAMES_KEPT` frames of user code (outside torch, the standard library
    and this package, whose reference models count as user code) below `frame`, formatted
    as a traceback (outermost first); only frames the step called (`loss_fn` and what it
    calls), not the caller of the step. A walk of `f_back` links: a few microseconds where
    make_fx's own recording symbolizes the whole stack (~0.3 ms a node)."""
    files = []
    while frame is not None:
        files.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    files.reverse()
    inside = next((i for i, (filename, _, _) in enumerate(files) if filename.startswith(_PACKAGE)), 0)
    kept = [f for f in files[inside:] if _is_user_file(f[0])][-_FRAMES_KEPT:]
    lines = []
    for filename, lineno, name in kept:
        lines.append(f'File "{filename}", line {lineno}, in {name}')
        code = linecache.getline(filename, lineno).strip()
        if code:
            lines.append(f"    {code}")
    return "\n".join(lines)


def culprit_frame(error: BaseException) -> str:
    """The innermost frame outside torch and this library in `error`'s traceback, as
    'file:line in function: code' — a frame of the user's code, or of a library such as
    transformers that the user's code called."""
    library = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith(library) and not path.startswith("<"):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "(no frame outside torch found)"


def make_fx_with_sources(f: Callable[..., Any]) -> Callable[..., fx.GraphModule]:
    """`make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)` whose operation nodes
    carry the frames of user code that issued them in `node.meta["stack_trace"]` (make_fx's
    own `record_stack_traces` keeps only frames of `forward` methods, at ~0.3 ms a node).
    Falls back to plain make_fx where torch lacks the hook."""
    from torch.fx.experimental import proxy_tensor

    tracer_class = getattr(proxy_tensor, "_MakefxTracer", None)
    if tracer_class is None or not hasattr(tracer_class, "_init_modes_from_inputs"):  # another torch
        return proxy_tensor.make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)

    class _Tracer(tracer_class):  # type: ignore[misc, valid-type]
        @contextlib.contextmanager
        def _init_modes_from_inputs(self, fn, args):
            with super()._init_modes_from_inputs(fn, args):
                fx_tracer = getattr(self, "fx_tracer", None)
                if fx_tracer is not None:
                    fx_tracer.create_node = _recording_sources(fx_tracer.create_node)  # this trace's tracer only
                yield

    # make_fx's defaults: no decompositions, no pre-dispatch, no module stack, no fake
    # constants, an error on data-dependent operations.
    tracer = _Tracer(None, "fake", True, False, False, False, True)

    def traced(*args):
        return tracer.trace(f, *args)

    return traced


def _recording_sources(create_node: Callable[..., fx.Node]) -> Callable[..., fx.Node]:
    def create(*args, **kwargs) -> fx.Node:
        node = create_node(*args, **kwargs)
        if node.op == "call_function" and not node.meta.get("stack_trace"):
            stack = _user_stack(sys._getframe(1))
            if stack:
                node.meta["stack_trace"] = stack
        return node

    return create


def replay(run: Callable[..., Any], inputs: Sequence[Any]) -> Any:
    """`run(*inputs)` for a traced step's graph (a `GraphModule`, or what `torch.compile` made
    of one). An exception raised by one of the graph's operations is raised again with the
    operation and the user's source line appended to its message (see `describe_node`), of
    the same type where it can be built from a message (else a RuntimeError), chained to the
    original; the first line ends with the operation and the innermost user line. Exceptions of collectives (a peer's failure, a timeout) pass unchanged."""
    if not isinstance(run, fx.GraphModule):
        return run(*inputs)
    try:
        # The generated function itself: GraphModule.__call__ would print FX's generated code
        # to stderr and raise the error without its traceback, which names the failing line.
        return run.forward(*inputs)
    except Exception as error:
        node = failing_node(run, error)
        if node is None or _is_collective(node):
            raise
        # The location on the first line too: a rank's failure is reported by its first line.
        first, *rest = str(error).split("\n", 1)
        message = "\n".join([f"{first} [{_innermost(node)}]", *rest, describe_node(node)])
        try:
            located = type(error)(message)
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments
            located = RuntimeError(f"{type(error).__name__}: {message}")
        raise located from error


def failing_node(gm: fx.GraphModule, error: BaseException) -> fx.Node | None:
    """The node of `gm` whose line of `gm`'s generated code raised `error` (read off its
    traceback), or None when the error did not come from that code."""
    code_file = getattr(getattr(type(gm).forward, "__code__", None), "co_filename", None)
    lineno_map = getattr(gm, "_lineno_map", None)
    if code_file is None or not lineno_map:
        return None
    line = None
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_filename == code_file:
            line = lineno  # the innermost frame of the generated code
    if line is None:
        return None
    index = lineno_map.get(line - getattr(gm, "_prologue_start", 0))
    nodes = list(gm.graph.nodes)
    return nodes[index] if index is not None and 0 <= index < len(nodes) else None


def describe_node(node: fx.Node) -> str:
    """Where a failing node of a traced step comes from: its operation and the user's frames
    recorded while tracing (innermost last), or why there are none."""
    head = f"  raised by {_operation(node)} (graph node {node.name}) while the traced step replayed"
    tail = "  (fs.Schedule(trace=False) runs the same step eagerly, with Python's own traceback)"
    stack = node.meta.get("stack_trace") or ""
    if stack:
        where = "\n".join("    " + line for line in stack.splitlines())
        return f"{head}, issued by:\n{where}\n{tail}"
    return f"{head}; no line of your code issued it (a backward pass, or the step's own update)\n{tail}"


def _innermost(node: fx.Node) -> str:
    """'op at file:line in function' for the innermost user frame that issued `node`."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return f"{_operation(node)} of the traced step"
    filename, lineno, function = frames[-1]
    return f"{_operation(node)} at {filename}:{lineno} in {function}"


def _operation(node: fx.Node) -> Any:
    """The operator a node calls (`schedule._lower.runnable` calls its C++ entry point through
    a partial that names it in `overload`)."""
    return getattr(node.target, "overload", node.target)


def _is_collective(node: fx.Node) -> bool:
    return getattr(_operation(node), "namespace", None) in ("_c10d_functional", "c10d")
