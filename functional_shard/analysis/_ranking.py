"""Ranking candidates by a budget and a predicted time, each with why it ranks where it does
(`tune_pipeline`'s schedules, `plan_layouts`' layouts)."""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

__all__ = ["rank_with_reasons"]


def rank_with_reasons(
    candidates: Sequence[NamedTuple],
    *,
    peak: Callable[[NamedTuple], float],
    over: Callable[[NamedTuple], str],
    best: Callable[[NamedTuple], str],
    slower: Callable[[NamedTuple, NamedTuple], str],
) -> list:
    """`candidates` (NamedTuples with `step_s`, `fits` and `why` fields) sorted: those that fit
    first, fastest first, the smaller peak first; each without a `why` of its own given one:
    `over(c)` when it does not fit, `best(c)` for the fastest that fits, `slower(c, best)` else."""
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.step_s, peak(c)))
    first = next((c for c in ranked if c.fits), None)
    out = []
    for c in ranked:
        if c.why:
            out.append(c)
        elif not c.fits:
            out.append(c._replace(why=over(c)))
        elif c is first:
            out.append(c._replace(why=best(c)))
        else:
            out.append(c._replace(why=slower(c, first)))
    return out
