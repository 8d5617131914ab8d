"""The pass protocol: what a pass value is, and the context every pass is called with."""

from __future__ import annotations

import dataclasses
from typing import Callable

from torch import fx


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What passes may need to know about the mesh the step runs on.

    Attributes:
        max_collectives_in_flight: the most collectives the backend may have issued and not
            yet waited at once (None: no limit); `limit_in_flight` enforces it.
        max_in_flight_per_group: the most of them on any one process group (the group name a
            collective node names); None: no limit of its own.
        world_size: ranks in the world.
        num_shards: into how many slices each parameter buffer is cut (the shard axis' size).
    """

    max_collectives_in_flight: int | None = None
    world_size: int = 1
    num_shards: int = 1
    max_in_flight_per_group: int | None = None

    @classmethod
    def for_mesh(cls, mesh) -> "PassContext":
        """The context of a step on `mesh` (an `fs.Mesh`, or any mesh with the same attributes)."""
        return cls(
            max_collectives_in_flight=mesh.max_collectives_in_flight,
            world_size=mesh.world_size,
            num_shards=mesh.num_shards,
            max_in_flight_per_group=getattr(mesh, "max_collectives_in_flight_per_group", None),
        )


class Pass:
    """Base of pass values. A subclass is a frozen dataclass whose fields are the pass's settings
    and whose `__call__(gm, context)` moves collectives of `gm` and returns it (or None)."""

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule | None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class function_pass(Pass):
    """A plain function `GraphModule -> GraphModule` as a pass value (it ignores the context)."""

    function: Callable[[fx.GraphModule], fx.GraphModule | None]

    def __call__(self, gm: fx.GraphModule, context: PassContext) -> fx.GraphModule | None:
        return self.function(gm)

    def __repr__(self) -> str:
        return f"function_pass({getattr(self.function, '__qualname__', repr(self.function))})"


def as_pass(value) -> Pass:
    """`value` if it is a `Pass`; a plain callable `gm -> gm` wrapped in `function_pass`."""
    if isinstance(value, Pass):
        return value
    if not callable(value):
        raise TypeError(f"a schedule pass must be an fs.schedule.Pass or a callable GraphModule -> GraphModule; got {value!r}")
    return function_pass(value)
