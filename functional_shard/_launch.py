"""The local launcher: run a function in several CPU processes of this machine, gloo between them.

`launch(main, world_size=2)` is to one machine what `torchrun` is to many: it sets `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in each process, so the same
`main` runs under both. It watches every rank: when one raises, the parent raises `RankError`
with that rank's number and traceback, and the others are stopped (after `grace` seconds in
which they may report their own errors), so nothing hangs and no process is left behind.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time
import traceback
from typing import Any, Callable

import torch

from ._mesh import _free_port

__all__ = ["launch", "RankError", "keep_freed_memory"]


def keep_freed_memory() -> bool:
    """Make this process's C allocator keep freed memory for reuse instead of returning it
    to the operating system (glibc only; returns whether it could).

    A sharded step allocates and frees full-size unit buffers (gathered parameters, their
    gradients) every step. glibc serves blocks above 128 KiB with fresh `mmap`s, so each
    one is page-faulted in again: on CPU that made a step up to ~50% slower than the same
    computation on reused memory. Opt in by calling it first thing in each rank's `main`.
    Peak memory is unchanged; the process keeps its peak.

    Not on by default: with it, 3 of some 30 runs of 2-4 gloo ranks on torch 2.13 aborted
    with a glibc heap-corruption check ("unaligned tcache chunk") in one rank, never
    without it. Until that is explained, treat it as an experiment.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    # The largest values glibc accepts: allocations up to 32 MiB (64-bit max) come from the
    # heap, and the heap's top is never trimmed.
    ok = mallopt(M_MMAP_THRESHOLD, 32 * 2**20) == 1
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    return ok


class RankError(RuntimeError):
    """A rank of a local launch failed.

    Attributes:
        rank: the first rank that failed.
        remote_traceback: its traceback, as text.
        failures: rank -> one-line description, for every rank that failed or was stopped.
    """

    def __init__(self, rank: int, summary: str, remote_traceback: str, failures: dict[int, str]):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.failures = failures
        others = "".join(f"\n  rank {r}: {why}" for r, why in sorted(failures.items()) if r != rank)
        super().__init__(
            f"rank {rank} failed: {summary}{others}\n\n--- traceback of rank {rank} ---\n{remote_traceback}"
        )


def _environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _report_error(conn, error: BaseException) -> None:
    summary = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    conn.send(("error", summary, traceback.format_exc()))


def _start_rank(rank: int, world_size: int, port: int, threads: int) -> None:
    """What every rank of a local world does first."""
    os.environ.update(_environment(rank, world_size, port))
    torch.set_num_threads(threads)


def _run_rank(rank: int, world_size: int, port: int, conn, main: Callable, args: tuple, kwargs: dict, threads: int):
    _start_rank(rank, world_size, port, threads)
    try:
        result = main(*args, **kwargs)
        conn.send(("ok", result if rank == 0 else None))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        _report_error(conn, error)
        conn.close()
        os._exit(1)  # do not wait in process-group teardown for ranks that may be gone
    _destroy_process_group()
    conn.close()


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _Ranks:
    """Processes of one local world and a pipe to each; collects one report per rank."""

    def __init__(self, world_size: int, target: Callable, extra_args: tuple, *, start_method: str = "spawn"):
        self.world_size = world_size
        context = multiprocessing.get_context(start_method)
        port = _free_port()
        self.connections = []
        self.processes = []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=target,
                args=(rank, world_size, port, child_end, *extra_args),
                name=f"functional_shard-rank{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self.connections.append(parent_end)
            self.processes.append(process)

    def collect(self, *, timeout: float | None, grace: float) -> list[Any]:
        """One report from every rank: their results, in rank order, or `RankError`."""
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str]] = {}
        first_failure: float | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = set(range(self.world_size))
        while waiting:
            now = time.monotonic()
            if first_failure is not None and now - first_failure > grace:
                for rank in waiting:
                    failures[rank] = (f"stopped by the launcher {grace:.0f} s after rank {min(failures)} failed", "")
                self.stop()
                break
            if deadline is not None and now > deadline:
                for rank in waiting:
                    failures[rank] = (f"no report within the launch timeout of {timeout} s", "")
                self.stop()
                break
            watched = {self.connections[r]: r for r in waiting}
            watched.update({self.processes[r].sentinel: r for r in waiting})
            for ready in multiprocessing.connection.wait(list(watched), timeout=0.2):
                rank = watched[ready]
                if rank not in waiting:
                    continue
                connection = self.connections[rank]
                report = None
                try:
                    if connection.poll():
                        report = connection.recv()
                except (EOFError, OSError):
                    report = None
                if report is None:
                    if ready is connection or not self.processes[rank].is_alive():
                        self.processes[rank].join(timeout=1)
                        code = self.processes[rank].exitcode
                        report = ("error", f"process exited with code {code} without a report", "")
                    else:
                        continue
                waiting.discard(rank)
                if report[0] == "ok":
                    results[rank] = report[1]
                else:
                    failures[rank] = (report[1], report[2])
                    if first_failure is None:
                        first_failure = time.monotonic()
        if failures:
            # The first rank to report an error of its own is the cause; the others' errors
            # (a broken connection, a collective timeout, being stopped) are consequences.
            # Dict order is arrival order.
            # A PeerError says outright that another rank failed first.
            real = (
                [r for r, (summary, tb) in failures.items() if tb and not summary.startswith("PeerError")]
                or [r for r, (_, tb) in failures.items() if tb]
                or list(failures)
            )
            first = real[0]
            summary, remote_traceback = failures[first]
            raise RankError(first, summary, remote_traceback, {r: s for r, (s, _) in failures.items()})
        return [results[r] for r in range(self.world_size)]

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for connection in self.connections:
            connection.close()


def launch(
    main: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
    grace: float = 10.0,
    threads_per_rank: int | None = None,
) -> Any:
    """Run `main(*args, **kwargs)` in `world_size` local processes and return rank 0's result.

    Arguments:
        main: a picklable (module-level) function. Inside it, `fs.init_mesh(...)` joins the
            world (gloo on CPU). Its return value on rank 0 must be picklable.
        world_size: number of processes.
        args / kwargs: passed to `main` on every rank.
        timeout: seconds the whole launch may take before every rank is stopped (default: none).
        grace: seconds the other ranks get, once one has failed, to report before they are
            stopped (a rank blocked in a collective with the failed one would otherwise wait
            for its collective timeout).
        threads_per_rank: `torch.set_num_threads` in each rank (default: cores // world_size).

    Raises `RankError` naming the failed rank, with its traceback; no process outlives the call.
    The caller's script must guard its entry point with `if __name__ == "__main__":` (the
    processes are spawned, not forked, so they import it afresh).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    threads = threads_per_rank or _threads_per_rank(world_size)
    ranks = _Ranks(world_size, _run_rank, (main, tuple(args), dict(kwargs or {}), threads))
    try:
        return ranks.collect(timeout=timeout, grace=grace)[0]
    finally:
        ranks.stop()
