"""Shared worlds: real gloo process groups (started once per world size and reused) and
simulated thread worlds. Functions run on a world must be module-level (they are pickled by
reference into the rank processes)."""

from __future__ import annotations

import pytest

import functional_shard as fs

_worlds: dict[int, fs.testing.LocalWorld] = {}


@pytest.fixture(scope="session")
def local_world():
    """`local_world(n)` -> a `LocalWorld` of n gloo processes, shared by the whole session."""

    def get(world_size: int) -> fs.testing.LocalWorld:
        if world_size not in _worlds:
            _worlds[world_size] = fs.testing.LocalWorld(world_size, collective_timeout=60.0, call_timeout=300.0)
        return _worlds[world_size]

    yield get
    for world in _worlds.values():
        world.close()
    _worlds.clear()
