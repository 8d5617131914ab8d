"""The launcher: run a function as every rank of a world, whoever started the processes.

`launch(main, world_size=2)` is to one machine what `torchrun` is to many: it sets `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT` in each process, so the same
`main` runs under both. It watches every rank: when one fails, the parent raises `RankError`
naming the rank that failed first, with its traceback, and the others are stopped (after
`grace` seconds in which they may report their own errors), so nothing hangs and no process is
left behind, not even when the launcher itself is killed. The ranks are a `WorkerPool`.

Under `torchrun` (or any launcher that sets `RANK` and `WORLD_SIZE`) the process calling
`launch` is already one rank: `launch` runs `main` right there, as a local rank would run it
(`keep_freed_memory`, threads, `fs.shutdown()` at the end), so one call serves both launchers.

The two mistakes a spawned launch cannot survive are refused before any process starts: a call
that every spawned rank would make again when it imports the script (no
`if __name__ == "__main__":` guard), and a `main` or arguments that cannot be pickled.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch

from ._failures import Failure, FailureKind, RankError
from ._mesh import shutdown
from ._pool import WorkerPool, _dumps, _loads, keep_freed_memory

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


# The exit code of a spawned rank that found itself calling `launch` while importing the main
# script (the guard check below could not read the script): the parent turns it into the message.
_UNGUARDED_EXIT_CODE = 86

_GUARD_FIX = 'put the call under `if __name__ == "__main__":`'


def _launched_by_torchrun() -> bool:
    """Whether this process is already one rank of a world that another launcher started."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _guarded(tree: ast.Module, line: int) -> bool:
    """Whether source line `line` of `tree` lies inside an `if` whose test reads `__name__`."""
    nodes: list[ast.AST] = list(tree.body)
    while nodes:
        node = nodes.pop()
        start, end = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
        if start is None or end is None or not start <= line <= end:
            continue
        if isinstance(node, ast.If) and any(
            isinstance(name, ast.Name) and name.id == "__name__" for name in ast.walk(node.test)
        ):
            return True
        nodes.extend(ast.iter_child_nodes(node))
    return False


def _unguarded_call_site() -> str | None:
    """`file:line` of the main script's top-level statement that is making this call, if that
    statement is not under `if __name__ == "__main__":` (every spawned rank imports the script
    again and would run it too); None when guarded, or when it cannot be told (no script file:
    an interactive session or `python -c`, whose code the ranks do not run again)."""
    main_module = sys.modules.get("__main__")
    if main_module is None or getattr(main_module, "__file__", None) is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_globals is main_module.__dict__ and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return None  # not called while the script's top level runs (e.g. from a thread started later)
    filename, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(filename, encoding="utf-8") as source:
            tree = ast.parse(source.read(), filename)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None  # the spawned ranks' own check (`_UNGUARDED_EXIT_CODE`) still catches it
    return None if _guarded(tree, line) else f"{os.path.basename(filename)}:{line}"


def _refuse_in_a_spawned_import() -> None:
    """In a process that multiprocessing spawned and that is still importing the main script:
    the script calls `launch` at its top level. Say so in one line and exit with the code the
    parent recognises (instead of Python's "freeze_support" page from every rank)."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"functional_shard: fs.launch is called when the script is imported: {_GUARD_FIX}", file=sys.stderr, flush=True)
        raise SystemExit(_UNGUARDED_EXIT_CODE)


def _describe(value: Any) -> str:
    code = getattr(value, "__code__", None)
    name = getattr(value, "__qualname__", None) or type(value).__name__
    if code is not None:
        return f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return f"{name}" if callable(value) else f"(a {type(value).__name__})"


def _payload(main: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """`(main, args, kwargs)` serialized for the ranks, or a one-line `TypeError` naming the part
    that cannot be (the ranks are spawned: they receive `main` by reference, its module and name)."""
    main_module = sys.modules.get("__main__")
    if getattr(main, "__module__", None) == "__main__" and getattr(main_module, "__file__", None) is None:
        raise TypeError(
            f"fs.launch cannot send main {_describe(main)} to the ranks: it is defined in an interactive session "
            f"(no script file), which the spawned ranks cannot import; define it in a .py file and import it"
        )
    try:
        return _dumps((main, args, kwargs))
    except Exception as error:  # noqa: BLE001 - find the part at fault, then say what to do
        cause = f"{type(error).__name__}: {error}".splitlines()[0]
        parts = [("main", main)] + [(f"args[{i}]", a) for i, a in enumerate(args)]
        parts += [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
        for name, value in parts:
            try:
                _dumps(value)
            except Exception:  # noqa: BLE001
                if name == "main":
                    fix = "define it with `def` at the top level of a module (not a lambda, not inside a function)"
                else:
                    fix = "pass values that pickle (tensors, numbers, strings, containers, module-level classes)"
                raise TypeError(f"fs.launch cannot send {name} {_describe(value)} to the ranks ({cause}): {fix}") from None
        raise TypeError(f"fs.launch cannot send main and its arguments to the ranks ({cause})") from None


def _main_of_rank(payload: bytes) -> Any:
    # Let `main` start processes as it would under torchrun (a DataLoader's workers): the pool
    # starts its ranks as daemons, which may not have children, and as spawned processes, whose
    # children are spawned too (each worker would import torch and the script again: seconds per
    # worker and epoch); this platform's default start method instead. DataLoader workers watch
    # their parent and end with it.
    multiprocessing.current_process().daemon = False
    multiprocessing.set_start_method(None, force=True)
    main, args, kwargs = _loads(payload)
    return _call_and_leave(main, args, kwargs)


def _call_and_leave(main: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """`main(*args, **kwargs)`, then this rank leaves the world (`shutdown`: it agrees first, so a
    rank that returned while another is still in a collective makes both raise `MeshError` at
    once, naming what each is in, instead of the other waiting out the collective timeout).
    Only rank 0's result is wanted; the others' need not even be picklable."""
    try:
        result = main(*args, **kwargs)
    except BaseException:
        try:
            shutdown(barrier=False)  # the peers may be inside a collective: no barrier; the launcher stops them
        except BaseException:  # noqa: BLE001 - the error of `main` is the one to report
            pass
        raise
    shutdown()  # a barrier, then destroy_process_group: no rank leaves while another's collective is in flight
    return result if os.environ.get("RANK") == "0" else None


def _run_here(main: Callable[..., Any], args: tuple, kwargs: dict, threads_per_rank: int | None, keep_memory: bool) -> Any:
    """`main` as this rank of a world another launcher started, set up as `launch`'s ranks are."""
    if keep_memory:
        keep_freed_memory()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size))
    return _call_and_leave(main, args, kwargs)


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
    """Run `main(*args, **kwargs)` as every rank of a world and return rank 0's result: in
    `world_size` local processes, or, under `torchrun`, in this process as the rank torchrun made it.

    One call for both launchers, in place of choosing one by hand:

        if __name__ == "__main__":
            result = fs.launch(main, world_size=2, args=(config,))
            if result is not None:  # rank 0's result: here locally, on rank 0 under torchrun
                print(result)

    Arguments:
        main: a picklable (module-level) function. Inside it, `fs.init_mesh(...)` joins the
            world (gloo on CPU); `int(os.environ["WORLD_SIZE"])` is the world's size under
            either launcher. Its return value on rank 0 may be any picklable object, tensors
            and state dicts included (it is copied with `torch.save`).
        world_size: number of local processes. Under torchrun the world is torchrun's
            (`--nproc-per-node`, `--nnodes`) and this argument is not used.
        args / kwargs: passed to `main` on every rank (copied the same way).
        timeout: seconds the whole launch may take before every rank is stopped (default:
            none; local processes only).
        grace: seconds the other ranks get, once one has failed, to report before they are
            stopped (a rank blocked in a collective with the failed one would otherwise wait
            for its collective timeout; local processes only).
        threads_per_rank: `torch.set_num_threads` in each rank (default: cores // world_size
            locally, cores // `LOCAL_WORLD_SIZE` under torchrun).
        keep_freed_memory: each rank calls `fs.keep_freed_memory()` first (glibc keeps freed
            memory for reuse instead of page-faulting every unit buffer in again each step).

    **Local processes** (no `RANK` and `WORLD_SIZE` in the environment). Raises `RankError`
    naming the rank that failed first (`.rank`), with its traceback and a typed `Failure` for
    every rank (`.failures`). No process outlives the call: ranks die with the launcher even
    when it is killed, and SIGTERM or SIGINT to the launcher (in the main thread) stops the
    ranks before taking effect. Each rank ends with `fs.shutdown()` (a barrier, then
    `destroy_process_group`) and `os._exit`, so `atexit` handlers registered in a rank do not
    run. Before any process starts, two mistakes raise a one-line error that names the fix: a
    call at the top level of the script, outside `if __name__ == "__main__":` (`RuntimeError`;
    the ranks are spawned, not forked, so each imports the script afresh and would launch
    again), and a `main` or argument that cannot be pickled, such as a lambda (`TypeError`).

    **Under torchrun** (`RANK` and `WORLD_SIZE` set: this process is one rank already), `main`
    runs here after `fs.keep_freed_memory()` and `torch.set_num_threads`, as in a local rank;
    then `fs.shutdown()` (after an exception, without its barrier, and the exception
    propagates: torchrun stops the other ranks). Returns `main`'s result on rank 0 and None on
    the other ranks.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    args, kwargs = tuple(args), dict(kwargs or {})
    if _launched_by_torchrun():
        return _run_here(main, args, kwargs, threads_per_rank, keep_freed_memory)
    _refuse_in_a_spawned_import()
    call_site = _unguarded_call_site()
    if call_site is not None:
        raise RuntimeError(
            f"fs.launch is called at the top level of {call_site}, which every spawned rank runs again when it "
            f"imports the script: {_GUARD_FIX}"
        )
    payload = _payload(main, args, kwargs)
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
                result = pool.run(_main_of_rank, (payload,), timeout=left, grace=grace)[0]
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
    except RankError as error:
        if any(failure.exit_code == _UNGUARDED_EXIT_CODE for failure in error.failures.values()):
            # The ranks, importing the script, reached this call (a guard the check above could not read).
            raise RuntimeError(
                f"fs.launch is called when the script is imported, and every spawned rank imports it again: {_GUARD_FIX}"
            ) from None
        raise
