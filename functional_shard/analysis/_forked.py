"""Run independent planning work in forked copies of this process: `forked_map(fn, groups, workers)`.

Planning traces and simulates on meta tensors, one (mesh, rows) at a time, each independent of
the others: a search spends nearly all its time there and uses one core. Forked children inherit
the caller's objects as they are (model builders, optimizers, closures: nothing is pickled on
the way in, as a spawned process would need), run `fn` on their share of the groups and send the
results back pickled. A child that fails on a group leaves it out (the caller computes it
itself and meets the error where it always did); a child that dies or cannot send leaves all of
its share out. Results are the same values the caller would have computed: each group's work is
deterministic and runs alone in its child.

Only on platforms with `fork` (Linux, macOS); elsewhere, or with one worker, nothing is forked.
Forking a process that has initialized CUDA is refused: the children could not use it, and the
planning work never needs it.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from typing import Any, Callable, Sequence

__all__ = ["forked_map"]


def forked_map(fn: Callable[[Any], Any], groups: Sequence[Any], workers: int) -> dict[int, Any]:
    """`{i: fn(groups[i])}` for the groups the workers computed, the caller's process computing a
    share too; groups a worker failed on are missing (the caller computes them itself)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1; got {workers}")
    if workers == 1 or len(groups) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return {}
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("plan_layouts(workers > 1) forks this process, which has initialized CUDA: use workers=1")
    shares = [list(range(len(groups)))[w::workers] for w in range(min(workers, len(groups)))]
    context = multiprocessing.get_context("fork")
    children = []
    for share in shares[1:]:
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(fn, groups, share, send), daemon=True)
        child.start()
        send.close()
        children.append((child, receive))
    results: dict[int, Any] = {}
    try:
        for i in shares[0]:
            try:
                results[i] = fn(groups[i])
            except Exception:  # noqa: BLE001 - the caller computes it again and meets the error itself
                pass
        for child, receive in children:
            try:
                results.update(receive.recv())
            except (EOFError, OSError):  # the child died before sending: its share is computed by the caller
                pass
    finally:
        for child, receive in children:
            receive.close()
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join()
    return results


def _child(fn, groups, share, send) -> None:
    out = {}
    try:
        for i in share:
            try:
                out[i] = fn(groups[i])
            except Exception:  # noqa: BLE001 - left out: the caller computes it
                pass
        send.send(out)
    except BaseException:  # noqa: BLE001 - unpicklable results: the caller computes the whole share
        traceback.print_exc()
    finally:
        send.close()
        os._exit(0)  # no interpreter shutdown in a forked copy (the parent's atexit handlers are not ours)
