"""Run independent planning work in forked copies of this process: `forked_map(fn, groups, workers)`.

Planning traces and simulates on meta tensors, one (mesh, rows) at a time, each independent of
the others: a search spends nearly all its time there and uses one core. Forked children inherit
the caller's objects as they are (model builders, optimizers, closures: nothing is pickled on
the way in, as a spawned process would need). Every process, the caller's included, takes the
next group nobody has taken (the groups' costs differ) and runs `fn` on it; each child sends its
results back pickled at the end. A group `fn` fails on is left out (the caller computes it
itself and meets the error where it always did); a child that dies or cannot send leaves out
the groups it took. Results are the values the caller would have computed: each group's work
is deterministic and runs alone in one process.

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
    context = multiprocessing.get_context("fork")
    claimed = context.Value("i", 0)  # the next group to take: whoever is free takes it (the costs differ)
    children = []
    for _ in range(min(workers, len(groups)) - 1):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(fn, groups, claimed, send), daemon=True)
        child.start()
        send.close()
        children.append((child, receive))
    results: dict[int, Any] = {}
    try:
        results.update(_work(fn, groups, claimed))
        for child, receive in children:
            try:
                results.update(receive.recv())
            except (EOFError, OSError):  # the child died before sending: its groups are computed by the caller
                pass
    finally:
        for child, receive in children:
            receive.close()
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join()
    return results


def _work(fn, groups, claimed) -> dict[int, Any]:
    out = {}
    while True:
        with claimed.get_lock():
            i = claimed.value
            claimed.value += 1
        if i >= len(groups):
            return out
        try:
            out[i] = fn(groups[i])
        except Exception:  # noqa: BLE001 - left out: the caller computes it again and meets the error itself
            pass


def _child(fn, groups, claimed, send) -> None:
    try:
        send.send(_work(fn, groups, claimed))
    except BaseException:  # noqa: BLE001 - unpicklable results: the caller computes them
        traceback.print_exc()
    finally:
        send.close()
        os._exit(0)  # no interpreter shutdown in a forked copy (the parent's atexit handlers are not ours)
