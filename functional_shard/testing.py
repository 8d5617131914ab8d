"""Worlds for tests: several ranks that run the same function and hand back every rank's result.

- `LocalWorld(n)`: n real processes, gloo between them, started once and reused (a test that
  launches processes per example would spend its time importing torch).
- `SimulatedWorld(n)`: n threads of this process on a `SimulatedMesh`; no sockets, cheap up to
  8 ranks and more. Sums run in rank order.

Both have `run(fn, *args, **kwargs) -> [result of rank 0, result of rank 1, ...]`, where `fn`
is called as `fn(mesh, *args, **kwargs)` on every rank; a rank that raises makes `run` raise
`RankError` naming it.
"""

from __future__ import annotations

import datetime
import threading
import traceback
from typing import Any, Callable

from ._failures import Failure, FailureKind, RankError, first_cause
from ._mesh import init_mesh
from ._simulated import SimulatedMesh, _Rendezvous
from ._pool import WorkerPool
from ._compare import Difference, LayoutComparison, compare_layouts

__all__ = ["LocalWorld", "SimulatedWorld", "compare_layouts", "LayoutComparison", "Difference"]


def _join_mesh(axes: dict[str, int], collective_timeout: float):
    return init_mesh(axes, timeout=datetime.timedelta(seconds=collective_timeout))


class LocalWorld:
    """`world_size` processes on this machine, each with a mesh over all of them, reused across calls.

    Arguments:
        world_size: number of processes.
        axes: the mesh axes (default `{"fsdp": world_size}`).
        collective_timeout: seconds a collective waits for the others before it raises.
        call_timeout: seconds one `run` may take; then the world is stopped (and restarted by the
            next `run`).

    Use as a context manager, or call `close()`. The processes are a `fs.WorkerPool`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        axes: dict[str, int] | None = None,
        collective_timeout: float = 60.0,
        call_timeout: float = 300.0,
    ):
        self.world_size = world_size
        self.axes = axes or {"fsdp": world_size}
        self.collective_timeout = collective_timeout
        self.call_timeout = call_timeout
        self._pool: WorkerPool | None = None

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """`fn(mesh, *args, **kwargs)` on every rank; the list of their results in rank order.

        A rank that raises makes `run` raise `RankError`. Ranks that all raised errors of their
        own leave the world usable; any other failure (a collective error, a dead or stopped
        rank) stops it, and the next `run` starts a fresh one."""
        if self._pool is None or self._pool.closed:
            self._pool = WorkerPool(
                self.world_size,
                setup=_join_mesh,
                setup_args=(self.axes, self.collective_timeout),
                start_timeout=self.call_timeout,
            )
        # Grace beyond the collective timeout: a rank waiting for a failed one raises by itself.
        return self._pool.run(fn, args, kwargs, timeout=self.call_timeout, grace=self.collective_timeout + 5.0)

    def close(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SimulatedWorld:
    """`world_size` ranks as threads of this process, on a `SimulatedMesh`.

    The threads share torch's random generators (a step seeds the process's generator for its
    rank): what a random operation draws (dropout) depends on how the threads interleave, so
    compare random steps across ranks on a `LocalWorld` (processes) instead.

    Arguments:
        world_size: number of thread-ranks.
        axes: the mesh axes (default `{"fsdp": world_size}`).
        timeout: seconds a rank waits at a collective for the others before it raises.
    """

    def __init__(self, world_size: int, *, axes: dict[str, int] | None = None, timeout: float = 60.0):
        self.world_size = world_size
        self.axes = axes or {"fsdp": world_size}
        self.timeout = timeout

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        rendezvous = _Rendezvous(self.world_size, self.timeout)
        results: list[Any] = [None] * self.world_size
        errors: dict[int, tuple[BaseException, str]] = {}

        def body(rank: int) -> None:
            try:
                results[rank] = fn(SimulatedMesh(self.axes, rank, rendezvous), *args, **kwargs)
            except BaseException as error:  # noqa: BLE001
                errors[rank] = (error, traceback.format_exc())
                rendezvous.barrier.abort()  # the others raise instead of waiting for this rank

        threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank{r}") for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # A thread that found the barrier broken failed because another one did.
            failures = {
                r: Failure(
                    FailureKind.COLLECTIVE if isinstance(e, threading.BrokenBarrierError) else FailureKind.RAISED,
                    f"{type(e).__name__}: {e}",
                    remote_traceback,
                )
                for r, (e, remote_traceback) in sorted(errors.items())
            }
            raise RankError(failures) from errors[first_cause(failures)][0]
        return results
