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

import torch

from ._launch import RankError, _Ranks, _report_error, _start_rank, _threads_per_rank
from ._mesh import SimulatedMesh, _Rendezvous, init_mesh

__all__ = ["LocalWorld", "SimulatedWorld"]


def _serve(rank: int, world_size: int, port: int, conn, axes: dict[str, int], collective_timeout: float, threads: int):
    _start_rank(rank, world_size, port, threads)
    try:
        mesh = init_mesh(axes, timeout=datetime.timedelta(seconds=collective_timeout))
        conn.send(("ok", None))
    except BaseException as error:  # noqa: BLE001
        _report_error(conn, error)
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, args, kwargs = task
        try:
            conn.send(("ok", fn(mesh, *args, **kwargs)))
        except BaseException as error:  # noqa: BLE001
            _report_error(conn, error)


class LocalWorld:
    """`world_size` processes on this machine, each with a mesh over all of them, reused across calls.

    Arguments:
        world_size: number of processes.
        axes: the mesh axes (default `{"fsdp": world_size}`).
        collective_timeout: seconds a collective waits for the others before it raises.
        call_timeout: seconds one `run` may take; then the world is stopped (and restarted by the
            next `run`).

    Use as a context manager, or call `close()`.
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
        self._ranks: _Ranks | None = None

    def _start(self) -> _Ranks:
        threads = _threads_per_rank(self.world_size)
        ranks = _Ranks(self.world_size, _serve, (self.axes, self.collective_timeout, threads))
        try:
            ranks.collect(timeout=self.call_timeout, grace=5.0)
        except BaseException:
            ranks.stop()
            raise
        return ranks

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """`fn(mesh, *args, **kwargs)` on every rank; the list of their results in rank order."""
        if self._ranks is None:
            self._ranks = self._start()
        for connection in self._ranks.connections:
            connection.send((fn, args, kwargs))
        try:
            return self._ranks.collect(timeout=self.call_timeout, grace=self.collective_timeout + 5.0)
        except RankError as error:
            # Ranks that raised together (the same error everywhere) leave a usable world;
            # ranks that were stopped do not.
            if any("stopped by the launcher" in why or "without a report" in why or "timeout" in why for why in error.failures.values()):
                self.close()
            raise

    def close(self) -> None:
        if self._ranks is not None:
            for connection in self._ranks.connections:
                try:
                    connection.send(None)
                except (OSError, BrokenPipeError):
                    pass
            self._ranks.stop()
            self._ranks = None

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SimulatedWorld:
    """`world_size` ranks as threads of this process, on a `SimulatedMesh`.

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
            real = {r: e for r, e in errors.items() if not isinstance(e[0], threading.BrokenBarrierError)}
            first = min(real or errors)
            error, remote_traceback = errors[first]
            failures = {r: f"{type(e).__name__}: {e}" for r, (e, _) in errors.items()}
            raise RankError(first, f"{type(error).__name__}: {error}", remote_traceback, failures) from error
        return results
