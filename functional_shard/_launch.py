"""The local launcher: run a function in several CPU processes of this machine, gloo between them.

`launch(main, world_size=2)` is to one machine what `torchrun` is to many: it sets `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in each process, so the same
`main` runs under both. It watches every rank: when one fails, the parent raises `RankError`
naming the rank that failed first, with its traceback, and the others are stopped (after
`grace` seconds in which they may report their own errors), so nothing hangs and no process is
left behind, not even when the launcher itself is killed. The ranks are a `WorkerPool`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

from ._failures import Failure, FailureKind, RankError
from ._pool import WorkerPool, keep_freed_memory

__all__ = ["launch", "RankError", "keep_freed_memory"]


class _Interrupted(BaseException):
    """Raised in the launcher's main thread by SIGTERM or SIGINT, so the ranks are stopped first."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopOnSignals:
    """While active, SIGTERM and SIGINT raise `_Interrupted` in the main thread (once: a second
    signal while the ranks are being stopped is ignored). On exit the previous handlers are back,
    and an interrupting signal is raised again for them: the launcher then dies of SIGTERM or
    raises KeyboardInterrupt as it would have without `launch`, only after its ranks are gone.

    Outside the main thread it does nothing (Python runs handlers in the main thread only); the
    ranks still die with their parent. A signal that was ignored (SIG_IGN) stays ignored."""

    _SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.previous: dict[int, Any] = {}
        self.received: int | None = None

    def _handle(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            raise _Interrupted(signum)

    def __enter__(self) -> "_StopOnSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                previous = signal.getsignal(signum)
                if previous is signal.SIG_IGN or previous is None:  # None: a C handler we could not restore
                    continue
                self.previous[signum] = previous
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if isinstance(exc, _Interrupted):
            signal.raise_signal(exc.signum)


def _main_of_rank(main: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    result = main(*args, **kwargs)
    # Only rank 0's result is wanted; the others' need not even be picklable.
    return result if os.environ.get("RANK") == "0" else None


def launch(
    main: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float | None = None,
    grace: float = 10.0,
    threads_per_rank: int | None = None,
    keep_freed_memory: bool = True,
) -> Any:
    """Run `main(*args, **kwargs)` in `world_size` local processes and return rank 0's result.

    Arguments:
        main: a picklable (module-level) function. Inside it, `fs.init_mesh(...)` joins the
            world (gloo on CPU). Its return value on rank 0 may be any picklable object,
            tensors and state dicts included (it is copied with `torch.save`).
        world_size: number of processes.
        args / kwargs: passed to `main` on every rank (copied the same way).
        timeout: seconds the whole launch may take before every rank is stopped (default: none).
        grace: seconds the other ranks get, once one has failed, to report before they are
            stopped (a rank blocked in a collective with the failed one would otherwise wait
            for its collective timeout).
        threads_per_rank: `torch.set_num_threads` in each rank (default: cores // world_size).
        keep_freed_memory: each rank calls `fs.keep_freed_memory()` first (glibc keeps freed
            memory for reuse instead of page-faulting every unit buffer in again each step).

    Raises `RankError` naming the rank that failed first (`.rank`), with its traceback and a
    typed `Failure` for every rank (`.failures`). No process outlives the call: ranks die with
    the launcher even when it is killed, and SIGTERM or SIGINT to the launcher (in the main
    thread) stops the ranks before taking effect. Each rank ends with `fs.shutdown()` (a
    barrier, then `destroy_process_group`) and `os._exit`, so `atexit` handlers registered in
    a rank do not run. The caller's script must guard its entry point with
    `if __name__ == "__main__":` (the processes are spawned, not forked, so they import it afresh).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with _StopOnSignals():
            pool = None
            try:
                pool = WorkerPool(
                    world_size,
                    threads_per_rank=threads_per_rank,
                    exit_on_error=True,
                    start_timeout=timeout,
                    keep_freed_memory=keep_freed_memory,
                )
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                result = pool.run(_main_of_rank, (main, tuple(args), dict(kwargs or {})), timeout=left, grace=grace)[0]
                pool.close()
                return result
            finally:
                if pool is not None:
                    pool.stop()
    except _Interrupted as interrupt:
        # The previous handler neither ended the process nor raised: report the stop.
        name = signal.Signals(interrupt.signum).name
        why = f"stopped by the launcher: it received {name}"
        raise RankError({rank: Failure(FailureKind.STOPPED, why) for rank in range(world_size)}) from None
