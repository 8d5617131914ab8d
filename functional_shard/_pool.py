"""A pool of rank processes on this machine: start `world_size` ranks once, run functions on all.

`WorkerPool` is what `fs.launch` and `fs.testing.LocalWorld` are made of. Its guarantees:

- **No orphans.** A rank dies with the process that started it: Linux kills it
  (`prctl(PR_SET_PDEATHSIG, SIGKILL)`), and a watchdog thread in every rank exits when its
  parent changes (other systems, or a parent that died before the rank could ask Linux).
- **Results arrive whatever they hold.** Messages in both directions are serialized with
  `torch.save` into bytes. torch's multiprocessing would pass tensors as file descriptors
  that a rank has to keep serving until the parent has read them; a rank that returned and
  exited first left the parent with "exited without a report".
- **No crash at exit.** A rank leaves with a barrier, `destroy_process_group`, then
  `os._exit`: interpreter shutdown, where a gloo worker thread could still destroy the last
  collective's work and abort the process ("terminate called without an active exception"),
  never runs.
- **Loopback only.** The rendezvous store lives in the parent, on a socket bound to
  127.0.0.1 (the ranks connect as clients, as under torchrun's agent), and gloo's own sockets
  bind the loopback interface: nothing a local run opens listens on another interface.
- **Failures are typed** (`FailureKind`), and `RankError` names the rank that failed first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch

from ._failures import Failure, FailureKind, RankError, blamed_rank, first_cause, is_collective_error
from ._loopback import loopback_interface
from ._mesh import shutdown
from ._parent import die_with_parent

__all__ = ["WorkerPool", "keep_freed_memory"]

# Seconds `stop` waits for terminated ranks before it kills them.
_TERMINATE_WAIT = 2.0


def keep_freed_memory() -> bool:
    """Make this process's C allocator keep freed memory for reuse instead of returning it
    to the operating system (glibc only; returns whether it could).

    A sharded step allocates and frees full-size unit buffers (gathered parameters, their
    gradients, the optimizer's temporaries) every step. glibc serves blocks above a
    threshold that it moves as it goes (128 KiB at first) with fresh `mmap`s and trims the
    top of its heap when more than twice that is free, so a step's buffers are often
    page-faulted in again: measured on the GPT benchmark at world size 1, some 6,000-7,000
    page faults per step and 1.2-1.4x the time of the same step with them reused, one
    process in two depending on where glibc's thresholds settle. Here blocks up to 32 MiB
    (the largest threshold glibc accepts) come from the heap, and the heap is never trimmed:
    the process keeps its peak of C memory, which it reaches every step anyway.

    `fs.launch` and `fs.testing.LocalWorld` call it in every rank they start (unless told
    not to); under torchrun, call it first thing in `main`, or start the processes with
    `MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647`.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = mallopt(M_MMAP_THRESHOLD, 32 * 2**20) == 1
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and ok
    return ok


def _dumps(message: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _loads(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for `rank`, and the two that keep the world on the loopback interface."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # env:// connects every rank as a client of the parent's store (torchrun's agent store)
        # instead of starting a server in rank 0, which would listen on every interface.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # gloo binds its pair sockets to this interface's address (else to the hostname's).
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", loopback_interface()),
    }


def _loopback_store() -> tuple[Any, int]:
    """A TCPStore server in this process, listening on 127.0.0.1 only, and its port.

    torch's TCPStore binds every interface; given a socket that is already bound and
    listening (`master_listen_fd`), it serves on that one. Binding it here also means no other
    process can take the port between choosing it and using it."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach()
    )
    return store, port


# --- inside a rank -----------------------------------------------------------------------------


def _finish(code: int) -> None:
    """Leave now: flush what the rank printed, skip interpreter shutdown (see the module docstring)."""
    # os._exit skips multiprocessing's exit finalizers too. A spawned rank's default start
    # method is "spawn", so a lock made there (tqdm makes one per process) is a named
    # semaphore registered with the resource tracker: without its finalizer, the tracker
    # reports "leaked semaphore objects" when the launcher exits. Run those finalizers
    # (priority >= 0: what multiprocessing's own exit handler runs first) before leaving.
    try:
        multiprocessing.util._run_finalizers(0)
    except Exception:  # noqa: BLE001 - never let cleanup keep a rank from exiting
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _failure_of(error: BaseException) -> Failure:
    kind = FailureKind.COLLECTIVE if is_collective_error(error) else FailureKind.RAISED
    message = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    return Failure(kind, message, traceback.format_exc(), blames=blamed_rank(error))


def _send(conn, message: Any) -> None:
    conn.send_bytes(_dumps(message))


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    conn,
    parent_pid: int,
    setup: Callable | None,
    setup_args: tuple,
    threads: int,
    exit_on_error: bool,
    keep_memory: bool,
) -> None:
    """The body of every rank: set up, then run what the parent sends until it says "close"."""
    die_with_parent(parent_pid)
    # A rank killed by a fatal signal (SIGSEGV, SIGABRT from glibc's heap checks, SIGBUS) prints
    # every thread's Python stack to its stderr first: where it died, not only that it did.
    faulthandler.enable(all_threads=True)
    if keep_memory:
        keep_freed_memory()
    os.environ.update(_environment(rank, world_size, port))
    torch.set_num_threads(threads)
    try:
        state = setup(*setup_args) if setup is not None else None
        _send(conn, ("ok", None))
    except BaseException as error:  # noqa: BLE001 - every failure must reach the parent
        _send(conn, ("failed", _failure_of(error)))
        _finish(1)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            _finish(1)  # the parent closed the pipe without "close": it is going away
        try:
            message = _loads(payload)
            if message[0] == "close":
                break
            _, fn, args, kwargs = message
            result = fn(state, *args, **kwargs) if setup is not None else fn(*args, **kwargs)
            reply = _dumps(("ok", result))
        except BaseException as error:  # noqa: BLE001
            _send(conn, ("failed", _failure_of(error)))
            if exit_on_error:
                # Now, not at close: peers blocked in a collective with this rank fail at once
                # ("Connection closed by peer") instead of at their collective timeout.
                _finish(1)
            continue
        conn.send_bytes(reply)
    try:
        shutdown()
    except BaseException as error:  # noqa: BLE001 - a peer died after the last result; say so, then go
        print(f"functional_shard: rank {rank}: leaving the process group failed: {error}", file=sys.stderr)
        _finish(1)
    _finish(0)


# --- in the parent -----------------------------------------------------------------------------


class WorkerPool:
    """`world_size` processes of this machine that run functions together, started once.

    Every rank gets torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    `MASTER_PORT`), so `fs.init_mesh(...)` or `dist.init_process_group()` joins the world
    (gloo on CPU, on the loopback interface only).

    Arguments:
        world_size: number of rank processes.
        setup: a picklable (module-level) function run once in every rank when it starts,
            e.g. one that calls `fs.init_mesh`. Its return value stays in the rank and is
            passed as the first argument of every function the pool runs; without `setup`
            functions are called with their own arguments only.
        setup_args: arguments of `setup`.
        threads_per_rank: `torch.set_num_threads` in each rank (default: cores // world_size).
        exit_on_error: a rank whose function raises exits right after reporting, so its peers'
            collectives fail at once instead of at their timeout; the pool is then closed.
            Otherwise ranks survive their own exceptions and the pool stays usable.
        start_timeout: seconds the ranks may take to start and run `setup` (default: none).
        keep_freed_memory: each rank first calls `keep_freed_memory()` (glibc keeps freed
            memory for reuse; see there).

    Raises `RankError` if a rank fails to start. A rank dies with the thread that started the
    pool (Linux's parent-death signal follows the thread): start and use it from one thread.
    The caller's script must guard its entry point with `if __name__ == "__main__":` (ranks
    are spawned, not forked, so they import it afresh).
    """

    def __init__(
        self,
        world_size: int,
        *,
        setup: Callable[..., Any] | None = None,
        setup_args: tuple = (),
        threads_per_rank: int | None = None,
        exit_on_error: bool = False,
        start_timeout: float | None = None,
        keep_freed_memory: bool = True,
    ):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int; got {world_size!r}")
        self.world_size = world_size
        self._exit_on_error = exit_on_error
        self._connections: list[Any] = []
        self._processes: list[Any] = []
        self._store = None
        self._closed = False
        threads = threads_per_rank or _threads_per_rank(world_size)
        # Anything raised from here on (a signal handler's exception included) must not leave
        # the ranks started so far behind.
        try:
            self._store, port = _loopback_store()
            context = multiprocessing.get_context("spawn")
            for rank in range(world_size):
                parent_end, child_end = context.Pipe()
                process = context.Process(
                    target=_rank_main,
                    args=(
                        rank, world_size, port, child_end, os.getpid(), setup, tuple(setup_args), threads,
                        exit_on_error, keep_freed_memory,
                    ),
                    name=f"functional_shard-rank{rank}",
                    daemon=True,
                )
                process.start()
                child_end.close()
                self._connections.append(parent_end)
                self._processes.append(process)
            self._collect(timeout=start_timeout, grace=10.0)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        """The process id of every rank, in rank order."""
        return [process.pid for process in self._processes]

    @property
    def closed(self) -> bool:
        """Whether the ranks are gone (closed, stopped, or failed in a way that broke the world)."""
        return self._closed

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        timeout: float | None = None,
        grace: float = 10.0,
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` (with `setup`'s result first, if any) on every rank; their results in rank order.

        Arguments:
            fn: a picklable (module-level) function. Arguments and results travel serialized
                by `torch.save` (tensors are copied, any picklable object goes).
            args / kwargs: passed to `fn` on every rank.
            timeout: seconds the ranks may take before they are stopped (default: none).
            grace: seconds the other ranks get, once one has failed, to report before they
                are stopped (a rank blocked in a collective with the failed one would
                otherwise wait for its collective timeout).

        Raises `RankError` naming the rank that failed first. Unless every failed rank raised
        an exception of its own (then the ranks are in step and the pool stays usable), the
        pool is stopped and `closed` is true.
        """
        if self._closed:
            raise RuntimeError("this WorkerPool is closed (or a failed run stopped it): start a new one")
        task = _dumps(("run", fn, tuple(args), dict(kwargs or {})))
        for connection in self._connections:
            try:
                connection.send_bytes(task)
            except OSError:
                pass  # that rank is gone; `_collect` reports how it ended
        return self._collect(timeout=timeout, grace=grace)

    def _collect(self, *, timeout: float | None, grace: float) -> list[Any]:
        """One report from every rank: their results in rank order, or `RankError`."""
        results: dict[int, Any] = {}
        failures: dict[int, Failure] = {}  # in the order seen
        first_failure: float | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = set(range(self.world_size))
        while waiting:
            now = time.monotonic()
            if first_failure is not None and now - first_failure > grace:
                why = f"stopped by the launcher {grace:.0f} s after rank {first_cause(failures)} failed"
                failures.update({rank: Failure(FailureKind.STOPPED, why) for rank in sorted(waiting)})
                break
            if deadline is not None and now > deadline:
                why = f"no report within the timeout of {timeout} s"
                failures.update({rank: Failure(FailureKind.TIMED_OUT, why) for rank in sorted(waiting)})
                break
            watched = {self._connections[r]: r for r in waiting}
            watched.update({self._processes[r].sentinel: r for r in waiting})
            ready_ranks = {watched[ready] for ready in multiprocessing.connection.wait(list(watched), timeout=0.2)}
            for rank in sorted(ready_ranks):
                report = self._read_report(rank)
                if report is None:
                    continue  # the sentinel of a rank whose report is still in flight
                waiting.discard(rank)
                if isinstance(report, Failure):
                    failures[rank] = report
                    first_failure = first_failure if first_failure is not None else time.monotonic()
                else:
                    results[rank] = report[0]
        if failures:
            if any(failure.kind is not FailureKind.RAISED for failure in failures.values()) or self._exit_on_error:
                self.stop()
            raise RankError(failures)
        return [results[r] for r in range(self.world_size)]

    def _read_report(self, rank: int) -> Failure | tuple[Any] | None:
        """Rank `rank`'s report: `(result,)`, a `Failure`, or None if it has none yet and is alive."""
        connection, process = self._connections[rank], self._processes[rank]
        try:
            if connection.poll():
                payload = connection.recv_bytes()
                try:
                    status, value = _loads(payload)
                except BaseException as error:  # noqa: BLE001 - e.g. a class this process cannot import
                    message = f"its report could not be read here: {type(error).__name__}: {error}".splitlines()[0]
                    return Failure(FailureKind.RAISED, message, traceback.format_exc())
                return (value,) if status == "ok" else value
        except (EOFError, OSError):
            pass
        # No report: has the process ended? (Its exit makes the pipe readable too: EOF.)
        process.join(timeout=0.5)
        if process.exitcode is None:
            return None
        return Failure.of_exit(process.exitcode)

    def close(self, timeout: float = 60.0) -> None:
        """End the ranks in order: each leaves the process group (a barrier, then
        `destroy_process_group`) and exits. Ranks still running after `timeout` seconds are
        stopped. Raises `RankError` if a rank did not exit cleanly (non-zero code, a signal).
        Closing a closed pool does nothing."""
        if self._closed:
            return
        close = _dumps(("close",))
        for connection in self._connections:
            try:
                connection.send_bytes(close)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        failures = {}
        for rank, process in enumerate(self._processes):
            if process.exitcode is None:
                failures[rank] = Failure(FailureKind.STOPPED, f"stopped by the launcher: still running {timeout} s after close")
            elif process.exitcode != 0:
                failures[rank] = Failure.of_exit(process.exitcode, " while closing the pool")
        self.stop()
        if failures:
            raise RankError(failures)

    def stop(self) -> None:
        """Stop every rank now (SIGTERM, then SIGKILL after 2 s) and release the rendezvous store."""
        self._closed = True
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()
        deadline = time.monotonic() + _TERMINATE_WAIT
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.exitcode is None:
                process.kill()
                process.join(timeout=5)
        for connection in self._connections:
            connection.close()
        self._store = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.stop()
