"""What tracing a step leaves behind outside the graph, released when the graph is dropped.

Two process-wide caches of torch grow with every trace and are never emptied:

- FX registers the Python source it generates at every `GraphModule.recompile()` in its
  loader (`torch.fx.graph_module._loader.eval_cache`) and in `linecache`: about 5 per trace
  (make_fx's graph, the passes' recompiles, the scheduled copy, the lowered graph, its
  runnable copy), ~11 KB each for a small MLP step, ~130 KB for a 6-layer GPT step (1,600 nodes);
- `FakeTensorMode.cache`, the fake-tensor dispatch cache every fake mode shares: an entry per
  operator and input shapes, ~50 per trace of the MLP step.

The jit's cache of graphs is bounded (`max_traces`), but with a batch dimension that changes
every step these grew by ~200 KB per retrace. A `Retained()` made before a trace notes what
it adds to both; `own(compiled, modules)` forgets at once the sources of modules that no
longer exist (the passes' intermediate recompiles) and the rest when the jit evicts the graph,
or when a graph it never cached (`step.lower`) is garbage collected; `forget()` forgets all of
it after a trace that failed. Forgetting only costs a traceback its source lines and a later trace a
cache miss; no running code reads either.
"""

from __future__ import annotations

import linecache
import re
import weakref
from collections.abc import Callable, Iterable

from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["Retained"]

_KEY = re.compile(r"<eval_with_key>\.(\d+)")


class Retained:
    """What tracing adds to torch's process-wide caches from the moment it is made (see the
    module docstring). Single-threaded tracing: what another thread adds meanwhile is noted too."""

    __slots__ = ("first_id", "fake_before", "sources", "fake_keys", "__weakref__")

    def __init__(self) -> None:
        self.first_id = fx.graph_module._loader.next_id  # FX numbers its sources in order
        # The keys there before, not their count: entries are also removed meanwhile (another
        # graph's release, run by the garbage collector in the middle of a trace), which would
        # shift a position and hide some of this trace's entries from it for good.
        self.fake_before: set | None = set(FakeTensorMode.cache)
        self.sources: list[str] = []  # FX loader / linecache keys of generated sources kept
        self.fake_keys: list = []  # keys of FakeTensorMode.cache entries added

    def own(self, owner: object, modules: Iterable[object]) -> Callable[[], None]:
        """Forget now what was added since this was made, except the sources of `modules`
        (GraphModules that live on), whose sources and the fake-cache entries are forgotten
        when `owner` is garbage collected or when the function returned is called (once)."""
        self._note()
        live = {_source_key(m) for m in modules}
        _forget_sources(k for k in self.sources if k not in live)
        self.sources = [k for k in self.sources if k in live]
        return weakref.finalize(owner, self.release)

    def forget(self) -> None:
        """Forget everything added since this was made (a trace that failed)."""
        self._note()
        self.release()

    def release(self) -> None:
        _forget_sources(self.sources)
        cache = FakeTensorMode.cache
        for key in self.fake_keys:
            cache.pop(key, None)
        self.sources, self.fake_keys = [], []

    def _note(self) -> None:
        self.sources = _sources_since(fx.graph_module._loader, self.first_id)
        if self.fake_before is not None:  # noted once: the set of earlier keys is not kept with the graph
            before, self.fake_before = self.fake_before, None
            self.fake_keys = [key for key in FakeTensorMode.cache if key not in before]


def _sources_since(loader, first_id: int) -> list[str]:
    keys = []
    for key in reversed(loader.eval_cache):
        match = _KEY.match(key)
        if match is None:
            continue  # a key named by its caller (co_filename): not numbered, not ours
        if int(match.group(1)) < first_id:
            break  # insertion order: everything before is older
        keys.append(key)
    return keys[::-1]


def _source_key(module: object) -> str | None:
    forward = getattr(type(module), "forward", None)
    return getattr(getattr(forward, "__code__", None), "co_filename", None)


def _forget_sources(keys: Iterable[str]) -> None:
    eval_cache = fx.graph_module._loader.eval_cache
    for key in list(keys):
        eval_cache.pop(key, None)
        linecache.cache.pop(key, None)
