"""The ranks' agreement on which collective operation they enter, kept on the rendezvous store.

Every collective entry point of the library (a step, `init`, `grad`, `evaluate`, `fs.export`,
the checkpoints, `fs.shutdown`) opens with `Mesh.agree`: each rank states what it enters before
it issues any collective of it. The statement goes through the store, not the process group:
ranks that call different things must never pair one's collectives with the other's, which
gloo answers with a hang until the collective timeout, an abort, or the wrong bytes.

Rank r entering its n-th agreement on this world (every mesh and `fs.shutdown` counted):

1. publishes its `Entry` (operation, value, n, how many times it entered this operation on its
   mesh, how many collectives it has issued on each of its process groups) under
   `functional_shard/agree/<n>/<r>`;
2. waits for every other rank's entry n and reads them: the same operation everywhere, or
   `MeshError` on every rank, naming what each entered ("rank 1: fs.shutdown" while
   "rank 0: a training step");
3. while it waits (one blocking wait on the store), its `Heartbeat` thread looks at the ranks
   that have not arrived. Every rank's heartbeat publishes that rank's collective counts twice
   a second, so a rank that issued a collective this one did not (a `torch.distributed` call
   of the user's on some ranks only) is named within about a second (`PeerError`), and so is
   a rank that exited. A rank not heard from for a few seconds (dead, or holding the GIL) is
   met in an all-gather instead: it fails at once if the rank is dead, and waits for it
   otherwise. The looking rank puts a mark in place of each missing entry, which ends the wait
   of every rank at this call alike.

Cost: five store round trips per agreement (a counter, the entry, the wait, the read, the
deletion of the previous entry), and the heartbeat's one store write per rank every 0.5 s
(and a few reads while its rank waits).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from ._failures import MeshError, PeerError
from ._heartbeat import PREFIX, Heartbeat, beat_key as _beat_key, collective_counts, decode_beat as _decode_beat

__all__ = ["Agreement", "Entry"]

# Seconds without a changed heartbeat (`_heartbeat`: one every 0.5 s) before a missing
# rank is met in an all-gather instead.
SILENT_AFTER = 3.0
# How a mark (`_Mark`), put by a waiting rank in place of a missing rank's entry, begins.
_MARK = "<functional_shard agreement mark: "


def digest(text: str) -> int:
    """`text` hashed to a non-negative int64."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class Entry(NamedTuple):
    """What a rank states when it enters a collective operation."""

    operation: str  # the operation's name ("a training step", "fs.export", "fs.shutdown", ...)
    value: int  # the int the caller states (a traced graph's digest, a size, a flag)
    call: int  # the rank's count of agreements on this world, this one included
    count: int  # how many times the rank has entered `operation` on its mesh, this one included (0: not counted)
    collectives: dict[str, int]  # process group name -> collectives the rank had issued on it when it entered

    def encode(self) -> str:
        return json.dumps(self._asdict())

    @classmethod
    def decode(cls, text: str | bytes) -> "Entry | None":
        try:
            fields = json.loads(text)
            operation, value, call, count = fields["operation"], fields["value"], fields["call"], fields["count"]
            return cls(str(operation), int(value), int(call), int(count), dict(fields["collectives"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        if self.operation == "fs.shutdown":
            return "is shutting down (fs.shutdown)"
        times = f", its {_ordinal(self.count)} on its mesh" if self.count else ""
        return f"is in {self.operation} (its functional_shard call #{self.call}{times})"


def _store_key(call: int, rank: int) -> str:
    return f"{PREFIX}/{call}/{rank}"


def _group_timeout(group) -> float:
    """The collective timeout of `group`, in seconds (600 when it cannot be read)."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except (RuntimeError, AttributeError, ValueError):
            continue
    return 600.0


class _Watch:
    """What a rank waiting in an agreement watches for (its heartbeat thread looks every 0.5 s)."""

    def __init__(self, mine: Entry, rank: int, others: list[int], timeout: float, where: str):
        self.mine = mine
        self.rank = rank
        self.others = others
        self.timeout = timeout
        self.where = where
        self.start = time.monotonic()
        self.heard: dict[int, tuple[str, float]] = {}  # rank -> (its last heartbeat, when it changed)

    def look(self, store) -> None:
        """`_look_at_missing` (the heartbeat thread calls it every beat while this rank waits)."""
        _look_at_missing(store, self)


class Agreement:
    """One rank's side of the ranks' agreement on a world (see the module docstring).

    Arguments:
        store: the world's rendezvous store (the default group's).
        rank / world_size: this rank in the world.
        groups: the process groups whose collectives a heartbeat counts (the world first).
        timeout: seconds to wait for the other ranks before `PeerError`.
        heartbeat: start this process's `Heartbeat` if it has none (else only use one that runs).
    """

    def __init__(
        self, store, rank: int, world_size: int, groups: Sequence[Any], timeout: float, heartbeat: bool = True
    ):
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._groups = {group.group_name: weakref.ref(group) for group in groups}
        if heartbeat:
            self._heartbeat: Heartbeat | None = Heartbeat.ensure(store, rank, groups[0], self._groups)
        else:
            self._heartbeat = Heartbeat.find(groups[0])

    @classmethod
    def of_world(
        cls, groups: Sequence[Any] = (), timeout: float | None = None, heartbeat: bool = True
    ) -> "Agreement | None":
        """The agreement of the default process group's world (None for a world of one, or a
        default group without a store). `groups`: more process groups to count collectives on."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError, AttributeError):
            return None
        world = dist.group.WORLD
        groups = [world, *(g for g in groups if g.group_name != world.group_name)]
        return cls(store, dist.get_rank(), dist.get_world_size(), groups, timeout or _group_timeout(world), heartbeat)

    def enter(
        self, operation: str, value: int, count: int, gather: Callable[[torch.Tensor], torch.Tensor], where: str
    ) -> list[int]:
        """State that this rank enters `operation` with `value`; every rank's value, in rank order.

        Arguments:
            operation: the operation's name.
            value: an int (63 bits) every rank states.
            count: how many times this rank has entered `operation` on its mesh (0: not counted).
            gather: an all-gather over the world (`Mesh.all_gather_world`), used only to meet a
                rank that has not been heard from.
            where: the mesh, in words, for messages.

        Raises `MeshError` on every rank when the ranks entered different operations, and
        `PeerError` naming a rank that issued a collective of its own, exited, or did not come.
        """
        store = self._store
        call = int(store.add(f"{PREFIX}/calls/{self.rank}", 1))
        mine = Entry(operation, int(value), call, count, collective_counts(self._groups))
        text = mine.encode()
        found = _text(store.compare_set(_store_key(call, self.rank), "", text))
        if found != text:  # a waiting rank put a mark in this rank's place
            entries: dict[int, Entry | _Mark] = {self.rank: _Mark.decode(found) or _Mark("silent", self.rank, "")}
        else:
            entries = self._wait(mine, where)
        marks = [entry for entry in entries.values() if isinstance(entry, _Mark)]
        for mark in marks:
            if mark.kind == "verdict":
                raise PeerError(mark.message, mark.rank)
        if marks:
            return self._meet(mine, entries, gather, where)
        operations = {entry.operation for entry in entries.values()}
        if len(operations) > 1:
            raise _different_operations([entries[r] for r in range(self.world_size)], where)
        self._forget(call - 1)  # every rank has read it: all are at `call`
        return [entries[r].value for r in range(self.world_size)]

    # --- waiting --------------------------------------------------------------------------

    def _wait(self, mine: Entry, where: str) -> dict[int, "Entry | _Mark"]:
        """Every rank's entry for `mine.call`, or the mark a waiting rank put in its place.

        One blocking wait on the store; meanwhile this rank's heartbeat thread looks at the
        ranks that have not come (`_look_at_missing`) and, for a rank that issued a collective
        of its own, exited or fell silent, puts a mark in place of each missing entry, which
        ends the wait of every rank at this call."""
        store = self._store
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [_store_key(mine.call, r) for r in others]
        watch = _Watch(mine, self.rank, others, self.timeout, where)
        heartbeat = self._heartbeat if self._heartbeat is not None and self._heartbeat.is_alive() else None
        if heartbeat is not None:
            heartbeat.watching = watch
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower():
                raise self._store_failed(mine, error) from error
            missing = [r for r in others if not store.check([_store_key(mine.call, r)])]
            rank = missing[0] if missing else others[0]
            message = (
                f"rank {rank} did not enter {mine.operation} within the collective timeout of {self.timeout:.0f} s: "
                f"rank {self.rank} {mine.describe()}, rank {rank}'s last functional_shard call was "
                f"{_last_call(store, rank)}. Every rank must make the same functional_shard calls in the same order "
                f"({where})"
            )
            # This rank gives up: a rank that comes later finds the verdict, not this rank's entry.
            mark = _Mark("verdict", rank, message).encode()
            for key in [_store_key(mine.call, r) for r in missing]:
                store.compare_set(key, "", mark)
            store.set(_store_key(mine.call, self.rank), mark)
            raise PeerError(message, rank) from None
        except (RuntimeError, ValueError) as error:
            raise self._store_failed(mine, error) from error
        finally:
            if heartbeat is not None:
                heartbeat.watching = None
        entries: dict[int, Entry | _Mark] = {self.rank: mine}
        for rank, text in zip(others, store.multi_get(keys)):
            entry = _Mark.decode(_text(text)) or Entry.decode(text)
            entries[rank] = entry if entry is not None else _Mark("verdict", rank, f"rank {rank}'s entry is unreadable")
        return entries

    def _meet(self, mine: Entry, entries: dict[int, "Entry | _Mark"], gather, where: str) -> list[int]:
        """Agree in an all-gather (some rank was not heard from): it fails at once if that rank
        is dead, and waits for it otherwise."""
        silent = [r for r, entry in entries.items() if isinstance(entry, _Mark) and r != self.rank]
        payload = torch.tensor([digest(mine.operation), mine.value, mine.call, mine.count], dtype=torch.int64)
        try:
            everyone = gather(payload).view(self.world_size, 4).tolist()
        except Exception as error:  # noqa: BLE001 - a dead peer's connection, named
            rank = silent[0] if silent else next(r for r in range(self.world_size) if r != self.rank)
            raise PeerError(
                f"rank {rank} was not heard from for {SILENT_AFTER:.0f} s while rank {self.rank} {mine.describe()}, "
                f"and the collective that met it failed ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]}): it died or hangs ({where})",
                rank,
            ) from error
        met = [
            mine if r == self.rank else entries[r] if isinstance(entries.get(r), Entry) else self._entry_of(r, *row)
            for r, row in enumerate(everyone)
        ]
        if len({code for code, *_ in everyone}) > 1:
            raise _different_operations(met, where)
        self._forget(mine.call - 1)
        return [entry.value for entry in met]

    def _entry_of(self, rank: int, code: int, value: int, call: int, count: int) -> Entry:
        """`rank`'s entry of its call `call`, read from the store where it is there (its
        operation's name), else from what it sent to the all-gather."""
        try:
            key = _store_key(call, rank)
            entry = Entry.decode(self._store.get(key)) if self._store.check([key]) else None
        except (RuntimeError, ValueError):
            entry = None
        if entry is not None and digest(entry.operation) == code:
            return entry
        return Entry("an operation of the library" if code else "an unknown operation", value, call, count, {})

    def leave(self) -> None:
        """Delete this rank's keys (its call count, its last entry, its heartbeat): after every
        rank passed `fs.shutdown`'s agreement, so that a world made again on the same store
        starts from call 1 on every rank."""
        try:
            call = int(self._store.add(f"{PREFIX}/calls/{self.rank}", 0))
            for key in (_store_key(call, self.rank), f"{PREFIX}/calls/{self.rank}", _beat_key(self.rank)):
                self._store.delete_key(key)
        except (RuntimeError, ValueError):
            pass

    def _forget(self, call: int) -> None:
        """Delete this rank's entry of `call` (every rank has read it once all are past it)."""
        try:
            self._store.delete_key(_store_key(call, self.rank))
        except (RuntimeError, ValueError):
            pass

    def _store_failed(self, mine: Entry, error: BaseException) -> PeerError:
        return PeerError(
            f"the rendezvous store failed while rank {self.rank} waited for the others to enter {mine.operation} "
            f"({type(error).__name__}: {str(error).splitlines()[0][:300]}): the process that serves it (rank 0, or "
            f"the launcher's agent) is gone",
            0,
        )


class _Mark(NamedTuple):
    """What a waiting rank puts in place of a missing rank's entry."""

    kind: str  # "silent": meet in an all-gather; "verdict": raise `PeerError(message, rank)`
    rank: int  # the rank the mark is about (for a verdict, the rank that failed)
    message: str  # the verdict, in words ("" for "silent")

    def encode(self) -> str:
        return f"{_MARK}{self.kind} {self.rank}>{self.message}"

    @classmethod
    def decode(cls, text: str) -> "_Mark | None":
        if not text.startswith(_MARK):
            return None
        head, _, message = text[len(_MARK) :].partition(">")
        kind, _, rank = head.partition(" ")
        return cls(kind, int(rank), message) if rank.isdigit() else None


def _look_at_missing(store, watch: _Watch) -> None:
    """For the ranks `watch`'s rank still waits for: a mark in place of each missing entry if one
    of them issued a collective of its own or exited (a verdict naming it), or was not heard
    from for `SILENT_AFTER` seconds ("silent": met in an all-gather). Runs in the heartbeat thread."""
    mine, now = watch.mine, time.monotonic()
    missing = [r for r in watch.others if not store.check([_store_key(mine.call, r)])]
    verdict: _Mark | None = None
    silent = False
    for rank in missing:
        beat_text = _text(store.get(_beat_key(rank))) if store.check([_beat_key(rank)]) else ""
        beat = _decode_beat(beat_text)
        if beat.get("exited"):
            verdict = _Mark("verdict", rank, (
                f"rank {rank} exited while rank {watch.rank} {mine.describe()}; its last functional_shard call: "
                f"{_last_call(store, rank)}. Every rank must make the same functional_shard calls, and end with "
                f"fs.shutdown() ({watch.where})"
            ))  # fmt: skip
            break
        ahead = [
            (group, issued) for group, issued in beat.get("collectives", {}).items()
            if group in mine.collectives and issued > mine.collectives[group]
        ]  # fmt: skip
        if ahead:
            group, issued = ahead[0]
            verdict = _Mark("verdict", rank, (
                f"rank {rank} issued a collective that rank {watch.rank} did not: its collective #{issued} on "
                f"process group {group!r}, after its last functional_shard call ({_last_call(store, rank)}); rank "
                f"{watch.rank} had issued {mine.collectives[group]} there when it entered {mine.operation} (its "
                f"functional_shard call #{mine.call}). Every rank must issue the same collectives in the same order: "
                f"a torch.distributed call made on some ranks only (an extra all_reduce or barrier) would pair with "
                f"the others' next collective ({watch.where})"
            ))  # fmt: skip
            break
        last, since = watch.heard.get(rank, (None, watch.start))
        if beat_text != last:
            watch.heard[rank] = (beat_text, now)
        elif now - since > SILENT_AFTER:
            silent = True
    if verdict is None and not silent:
        return
    # A mark in place of every missing entry ends the wait of every rank at this call (a rank
    # that came in the meantime keeps its own entry: compare-and-set).
    mark = (verdict or _Mark("silent", watch.rank, "")).encode()
    for rank in missing:
        store.compare_set(_store_key(mine.call, rank), "", mark)


def _last_call(store, rank: int) -> str:
    """`rank`'s last agreement, in words ("none" before its first)."""
    try:
        call = int(store.add(f"{PREFIX}/calls/{rank}", 0))
        if call == 0:
            return "none"
        key = _store_key(call, rank)
        entry = Entry.decode(store.get(key)) if store.check([key]) else None
    except (RuntimeError, ValueError):
        return "unknown"
    if entry is None:
        return f"#{call}"
    times = f", its {_ordinal(entry.count)} on its mesh" if entry.count else ""
    return f"{entry.operation} (#{call}{times})"


def _different_operations(entries: list[Entry], where: str) -> MeshError:
    doing = "; ".join(f"rank {r}: {e.operation}" for r, e in enumerate(entries))
    detail = "; ".join(f"rank {r} {e.describe()}" for r, e in enumerate(entries))
    return MeshError(
        f"ranks entered different collective operations ({doing}): {detail}. Every rank of the {where} must call "
        f"the same collective operations in the same order: call it on every rank (a rank that takes one step more "
        f"than the others, or shuts down early, is named here)",
        {r: e.operation for r, e in enumerate(entries)},
    )


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
