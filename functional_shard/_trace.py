"""The jit of `sharded_step`: trace a step once per input signature, schedule it, replay it.

Tracing runs the very function the eager reference runs (`ShardedStep._update`) under
`make_fx(tracing_mode="fake")`: no real computation and no real collective happens while
tracing. The collectives in it are tagged with the buffer they move (`TraceTag`), the end of
the forward pass is marked, the schedule's passes move the collectives, and every rank checks
that it traced the same sequence of collectives before any of them runs.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from typing import Any, Callable

import torch
import torch._subclasses.fake_tensor
import torch.fx.experimental.symbolic_shapes
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import schedule as schedule_lib
from ._tree import flatten

__all__ = ["TraceError", "CompiledStep", "trace_step", "signature_of"]


class TraceError(ValueError):
    """`loss_fn` could not be traced (it reads a tensor's value in Python)."""


@dataclasses.dataclass
class CompiledStep:
    """One traced, scheduled step, cached per input signature.

    Attributes:
        signature: what it was traced for (structure, shapes and dtypes of state and batch).
        graph_module: the scheduled `torch.fx.GraphModule` (inputs and outputs are flat lists).
        events: the applied schedule, read back from the graph (`fs.schedule.ScheduleEvent`s).
        all_gather_bytes / reduce_scatter_bytes: bytes of the full buffers moved per step.
        run: what is called each step (`graph_module`, or its `torch.compile`d form).
    """

    signature: tuple
    graph_module: fx.GraphModule
    events: list
    all_gather_bytes: int
    reduce_scatter_bytes: int
    run: Callable
    num_outputs: dict
    aux_spec: Any
    # The signature holds id(layout); holding the layout keeps that id from being reused.
    layout: Any = None

    def explain(self) -> str:
        return schedule_lib.explain(self.events, title=f"schedule of {describe_signature(self.signature)}")


def signature_of(batch_leaves: list, batch_spec, state_key: tuple) -> tuple:
    """The cache key: state structure plus the batch's structure, shapes, dtypes and static values."""
    described = []
    for leaf in batch_leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), leaf.dtype, leaf.device.type))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TraceError(
                    f"a traced step bakes non-tensor batch values into its graph, so they must be hashable; "
                    f"got a {type(leaf).__name__}: pass tensors, or use fs.Schedule(trace=False)"
                ) from None
            described.append(("static", type(leaf).__name__, leaf))
    return (*state_key, batch_spec, tuple(described))


def describe_signature(signature: tuple) -> str:
    batch = signature[-1]
    parts = [f"{str(d[2]).removeprefix('torch.')}{list(d[1])}" if d[0] == "tensor" else repr(d[2]) for d in batch]
    return "batch (" + ", ".join(parts) + ")"


_DATA_DEPENDENT = tuple(
    t
    for t in (
        getattr(torch._subclasses.fake_tensor, "DataDependentOutputException", None),
        getattr(torch._subclasses.fake_tensor, "DynamicOutputShapeException", None),
        getattr(torch.fx.experimental.symbolic_shapes, "GuardOnDataDependentSymNode", None),
    )
    if t is not None
)


def _user_frame(error: BaseException) -> str:
    """The innermost frame of the user's code in `error`'s traceback, as 'file:line: code'."""
    library = (os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__)))
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith(library) and "/lib/python" not in path:
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "(no frame of user code found)"


def trace_step(
    flat_step: Callable[..., list],
    inputs: list[torch.Tensor],
    *,
    log: list,
    forward_end_output: int,
    schedule: schedule_lib.Schedule,
    context: schedule_lib.PassContext,
) -> fx.GraphModule:
    """Trace `flat_step(*inputs)` with fake tensors, tag its collectives from `log`, mark the end
    of the forward pass (the node of output `forward_end_output`, the local loss) and apply
    `schedule`'s passes, which read what the mesh allows from `context`."""
    try:
        gm = make_fx(flat_step, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
    except _DATA_DEPENDENT as error:
        op = getattr(error, "func", None)
        if op is None:  # a guard on an unbacked value: bool()/int()/float()/.item() of a tensor
            op = "aten._local_scalar_dense (bool(), int(), float() or .item() of a tensor)"
        detail = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise TraceError(
            f"sharded_step could not trace loss_fn: the operation {op} needs the value of a tensor, at "
            f"{_user_frame(error)} ({type(error).__name__}: {detail}). A traced step replays one graph for every "
            f"batch, so it cannot branch on data (Python if/while on a tensor, .item(), .tolist(), outputs whose "
            f"shape depends on values). Run this loss eagerly with fs.Schedule(trace=False), or write the branch "
            f"with torch.where"
        ) from error
    _tag_collectives(gm, log)
    _mark_forward_end(gm, forward_end_output)
    return schedule_lib.apply_schedule(gm, schedule, context)


def _tag_collectives(gm: fx.GraphModule, log: list) -> None:
    issued = [n for n in gm.graph.nodes if n.target in schedule_lib.ISSUE_OPS]
    # The loss all-reduce is issued after every logged collective and is not logged.
    if len(issued) != len(log) + 1:
        raise RuntimeError(
            f"internal: traced {len(issued)} collectives but recorded {len(log)} tagged ones (+1 loss all-reduce)"
        )
    for node, (kind, buffer) in zip(issued, log):
        phase = "forward" if kind == "all_gather" else "backward"
        record = schedule_lib.CollectiveTag.for_node(node, buffer=buffer.name, unit=buffer.unit, phase=phase)
        if record.kind != kind:
            raise RuntimeError(f"internal: collective {node.name} is a {node.target} but the log says {kind}")
        schedule_lib.tag(node, record)
    schedule_lib.tag(issued[-1], schedule_lib.CollectiveTag.for_node(issued[-1], phase="update"))


def _mark_forward_end(gm: fx.GraphModule, output_index: int) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    node = output.args[0][output_index]
    while node.op == "call_function" and node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        node = node.args[0]
    schedule_lib.mark_forward_end(node)


def flatten_batch(batch: Any) -> tuple[list, Any, list[int]]:
    """Leaves of a batch, its structure, and the positions of its tensor leaves."""
    leaves, spec = flatten(batch)
    return leaves, spec, [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
