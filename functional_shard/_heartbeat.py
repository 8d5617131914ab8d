"""Each rank's heartbeat: a thread that publishes the rank's collective counts to the rendezvous
store twice a second, so that a rank waiting in an agreement (`_agreement`) can tell a rank that
issued a collective of its own (its count went up) from one that is still computing (its count
did not), and a live rank from a silent or exited one.

While its rank waits in an agreement, the thread also runs the wait's look at the ranks that have
not come (`watching`: an object with a `look(store)` method, `_agreement._Watch`), so the main
thread needs no second thread of its own. One heartbeat per process and world (`Heartbeat.ensure`);
`stop_heartbeats` ends them with the world (`fs.shutdown`).
"""

from __future__ import annotations

import atexit
import json
import threading
import weakref
from typing import Any, Callable

import torch.distributed as dist

__all__ = ["Heartbeat", "beat_key", "collective_counts", "decode_beat", "stop_heartbeats"]

# Seconds between a rank's heartbeats (and a waiting rank's looks at the missing ranks).
HEARTBEAT_PERIOD = 0.5
# Where the agreement (`_agreement`) and the heartbeats keep their keys on the store.
PREFIX = "functional_shard/agree"


def beat_key(rank: int) -> str:
    return f"{PREFIX}/beat/{rank}"


def decode_beat(text: str) -> dict:
    try:
        beat = json.loads(text) if text else {}
    except ValueError:
        return {}
    return beat if isinstance(beat, dict) else {}


def collective_counts(groups: dict[str, Callable[[], Any]]) -> dict[str, int]:
    """Group name -> collectives this rank has issued on it (gloo and NCCL count them as they are issued)."""
    counts = {}
    for name, ref in groups.items():
        group = ref()
        if group is None:
            continue
        try:
            counts[name] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError):
            pass  # a backend that does not count
    return counts


class Heartbeat(threading.Thread):
    """A thread that publishes this rank's collective counts to the store every 0.5 s, so that
    a rank waiting in an agreement can tell a rank that issued a collective of its own (its count
    went up) from a rank that is still computing (its count did not), and a live rank from a
    silent one. One per process and world (`ensure`); it ends with the process group
    (`stop_heartbeats`, called by `fs.shutdown`), and at exit says that the rank exited.

    It uses a store connection of its own (`store.clone()`), so a main thread waiting on the
    store never delays it.
    """

    def __init__(self, store, rank: int, world, groups: dict[str, Callable[[], Any]]):
        super().__init__(name="functional_shard-heartbeat", daemon=True)
        try:
            self._store = store.clone()
        except (RuntimeError, AttributeError):
            self._store = store
        self._world = weakref.ref(world)
        self.rank = rank
        self._groups = dict(groups)
        self._stopping = threading.Event()
        self._beats = 0
        # What this rank's main thread waits for in an agreement, if it waits: an object whose
        # `look(store)` this thread calls every beat (`_agreement._Watch`).
        self.watching: Any = None

    @classmethod
    def find(cls, world) -> "Heartbeat | None":
        """This process's running heartbeat for the world of process group `world`, if any."""
        for thread in threading.enumerate():
            if isinstance(thread, cls) and thread.is_alive() and not thread._stopping.is_set():
                if thread._world() is world:
                    return thread
        return None

    @classmethod
    def ensure(cls, store, rank: int, world, groups: dict[str, Callable[[], Any]]) -> "Heartbeat":
        """This process's heartbeat for the world of process group `world`, started if there
        is none, counting `groups` too."""
        for thread in threading.enumerate():
            if isinstance(thread, cls) and thread.is_alive() and not thread._stopping.is_set():
                if thread._world() is world:
                    thread._groups.update(groups)
                    return thread
                thread.stop()  # a previous world's
        heartbeat = cls(store, rank, world, groups)
        heartbeat._publish()  # the first beat before any agreement can wait for it
        atexit.register(heartbeat._at_exit)
        heartbeat.start()
        return heartbeat

    def _publish(self, exited: bool = False) -> None:
        self._beats += 1
        beat = {"beat": self._beats, "collectives": collective_counts(self._groups), "exited": exited}
        self._store.set(beat_key(self.rank), json.dumps(beat))

    def run(self) -> None:
        while not self._stopping.wait(HEARTBEAT_PERIOD):
            if not dist.is_initialized():
                return
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone: so is the world
                return
            watch = self.watching
            if watch is not None:
                try:
                    watch.look(self._store)
                except Exception:  # noqa: BLE001 - the main thread's wait still ends at its timeout
                    pass

    def stop(self) -> None:
        """End the thread (and wait for it: it must not be inside the store at interpreter exit)."""
        self._stopping.set()
        if self is not threading.current_thread() and self.is_alive():
            self.join(timeout=2 * HEARTBEAT_PERIOD + 1.0)
        try:
            atexit.unregister(self._at_exit)
        except Exception:  # noqa: BLE001
            pass

    def _at_exit(self) -> None:
        self.stop()
        try:
            self._publish(exited=True)  # ranks waiting for this one learn it at once
        except Exception:  # noqa: BLE001 - the store may already be gone
            pass


def stop_heartbeats() -> None:
    """Stop this process's heartbeat threads (`fs.shutdown`: the world they watched ends)."""
    for thread in threading.enumerate():
        if isinstance(thread, Heartbeat):
            thread.stop()
