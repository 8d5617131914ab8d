"""Which stage each unit goes to: contiguous runs of units (the step's units are `input`, the
repeated blocks and `output`), split evenly by blocks or units, or given explicitly."""

from __future__ import annotations

from typing import Any, Sequence

from ._losses import StepError

__all__ = ["assign_stages"]


def assign_stages(units: Sequence[str], num_stages: int, stages: Any = None) -> dict[str, int]:
    """The stage of each unit (units in their order of use: `input`, the blocks, `output`).

    Arguments:
        units: the unit names of the layout, in flatten order.
        num_stages: how many stages (pipeline ranks x stages per rank).
        stages: None or "blocks" (default): the repeated blocks split as evenly as possible, the
            first stages taking one more when they do not divide; the units before the first
            block join stage 0 and those after the last join the last stage. "units": every unit
            counted alike. Or an explicit sequence of `num_stages` sequences of unit names
            (contiguous, in order, covering every unit).

    Raises `StepError` naming what is wrong: more stages than units (or blocks), an explicit cut
    that skips, repeats or reorders units, or has another number of stages.
    """
    units = list(units)
    if stages is None or stages == "blocks" or stages == "units":
        policy = "blocks" if stages is None else stages
        inner = [u for u in units if u not in ("input", "output")] if policy == "blocks" else units
        if len(inner) < num_stages:
            raise StepError(
                f"the pipeline has {num_stages} stages but the model has only {len(inner)} "
                f"{'blocks' if policy == 'blocks' else 'units'} to cut ({inner}): use fewer stages (pp x stages_per_rank) "
                f"or a finer unit policy"
            )
        per, extra = divmod(len(inner), num_stages)
        out: dict[str, int] = {}
        index = 0
        for s in range(num_stages):
            for u in inner[index : index + per + (1 if s < extra else 0)]:
                out[u] = s
            index += per + (1 if s < extra else 0)
        # Leaves outside the blocks: with the stage of the nearest block before them (stage 0 before the first).
        current = 0
        for u in units:
            if u in out:
                current = out[u]
            else:
                out[u] = current if u != "output" else num_stages - 1
        return out
    if isinstance(stages, str):
        raise StepError(f"stages={stages!r}: give 'blocks', 'units' or a sequence of unit-name sequences, one per stage")
    cut = [list(s) for s in stages]
    if len(cut) != num_stages:
        raise StepError(f"stages= gives {len(cut)} stages but the pipeline has {num_stages} (pp x stages_per_rank)")
    flat = [u for s in cut for u in s]
    if any(not s for s in cut):
        raise StepError(f"stages= has an empty stage ({cut}): every stage needs at least one unit")
    if flat != units:
        missing = [u for u in units if u not in flat]
        unknown = [u for u in flat if u not in units]
        raise StepError(
            f"stages= must list every unit once, in order, in contiguous runs: the units are {units}; "
            + (f"missing {missing}" if missing else f"unknown {unknown}" if unknown else f"got {flat} (order or repeats)")
        )
    return {u: s for s, us in enumerate(cut) for u in us}
