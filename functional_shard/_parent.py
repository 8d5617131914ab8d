"""Processes that die with the process that started them: no rank outlives its launcher.

`die_with_parent(pid)` is what every rank of a `WorkerPool` (`fs.launch`, `fs.testing.LocalWorld`)
runs first; `die_with_torchrun_agent()` is what `fs.init_mesh` runs in a rank started by
`torchrun` (whose agent, when SIGKILLed, would otherwise leave its ranks training, orphaned).

On Linux the kernel sends the process SIGKILL when its parent ends (`prctl(PR_SET_PDEATHSIG)`:
immediate, and it works whatever the process is doing, a collective or a loop holding the GIL).
Strictly, it fires when the *thread* that started the process ends: `torchrun`'s agent and
`WorkerPool` start their ranks from the thread that lives as long as they do. Elsewhere a
watchdog thread looks at the parent's pid every 0.5 s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent", "die_with_torchrun_agent"]

# Seconds a watchdog waits between looks at its parent's pid.
_WATCHDOG_PERIOD = 0.5


def _kill_on_parent_death() -> bool:
    """Ask Linux to SIGKILL this process when its parent ends; whether it could."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCHDOG_PERIOD)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="functional_shard-watchdog", daemon=True).start()


def die_with_parent(parent_pid: int) -> None:
    """Make this process end when `parent_pid`, the process that started it, ends (and end now
    if it already has: a rank spends seconds importing torch before it can ask)."""
    _kill_on_parent_death()
    if os.getppid() != parent_pid:
        os._exit(1)
    _watch(parent_pid)


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_agent(command_line: str) -> bool:
    marks = ("torchrun", "torch.distributed.run", "torch/distributed/run", "torch.distributed.launch")
    return any(mark in command_line for mark in marks)


def die_with_torchrun_agent() -> None:
    """In a rank started by `torchrun`: end when the agent that started it ends.

    The agent starts each rank directly (its parent), in a session of its own, so nothing else
    reaches a rank whose agent was SIGKILLed. If the agent is already gone (the rank was
    re-parented to init, pid 1, which is not itself an agent, as it is when torchrun is a
    container's first process), exit now. A rank started through a wrapper (a shell script
    given to `torchrun --no-python`) dies with the wrapper instead; if the agent is killed, the
    wrapper must end its child itself. Outside Linux, only the watchdog (within 0.5 s)."""
    parent = os.getppid()
    _kill_on_parent_death()
    if os.getppid() != parent or (parent == 1 and not _is_agent(_command_line(1))):
        print(
            f"functional_shard: rank {os.environ.get('RANK', '?')}: torchrun's agent is gone (this process was "
            f"re-parented to pid {os.getppid()}); exiting",
            file=sys.stderr,
        )
        os._exit(1)
    _watch(parent)  # also where prctl worked: a sandbox may accept it and never send the signal
