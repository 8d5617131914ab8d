"""Learning-rate schedules as values, with the numbers of `torch.optim.lr_scheduler`.

A schedule maps `count`, the number of updates already applied (0 on the first update), to a
learning rate; pass it wherever a learning rate goes (`fs.optim.adamw(lr=schedule)`, a group's
`lr=`). Each one here gives, at every count, the very float that its `torch.optim.lr_scheduler`
equivalent puts in `param_group["lr"]` when it is stepped once after each `optimizer.step()`:

| fs.optim | torch.optim.lr_scheduler (optimizer built with `lr=lr`) |
|---|---|
| `constant_schedule(lr)` | none |
| `lambda_schedule(lr, factor)` | `LambdaLR(opt, factor)` |
| `linear_schedule(lr, start_factor=s, end_factor=e, steps=n)` | `LinearLR(opt, start_factor=s, end_factor=e, total_iters=n)` |
| `cosine_schedule(lr, steps=n, min_lr=m)` | `CosineAnnealingLR(opt, T_max=n, eta_min=m)` |
| `join_schedules(a, b, boundaries=[k])` | `SequentialLR(opt, [a, b], milestones=[k])` |
| `warmup_cosine_schedule(lr, warmup_steps=w, steps=n, min_lr=m)` | `SequentialLR(opt, [LinearLR(opt, start_factor=1/w, total_iters=w), CosineAnnealingLR(opt, T_max=n - w, eta_min=m)], milestones=[w])` |
| `warmup_linear_schedule(lr, warmup_steps=w, steps=n)` | `SequentialLR(opt, [LinearLR(opt, start_factor=1/w, total_iters=w), LinearLR(opt, start_factor=1.0, end_factor=0.0, total_iters=n - w)], milestones=[w])` |

torch computes `LinearLR` and `CosineAnnealingLR` recursively (each value from the previous
one), which differs from the closed formulas in the last bits; these schedules run the same
recursion. To stay cheap at any count they keep the value of every 256th count reached and the
last one computed (a cache on the schedule, not part of its value): stepping in order costs one
recursion step per call (~1.5 us); a new process resuming at count n replays the recursion once
(0.7 s for n = 1,000,000), and a later jump costs at most 255 steps.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any, Callable, Sequence

__all__ = [
    "constant_schedule",
    "lambda_schedule",
    "linear_schedule",
    "cosine_schedule",
    "join_schedules",
    "warmup_cosine_schedule",
    "warmup_linear_schedule",
]

_EVERY = 256  # a recursive schedule keeps the value of every _EVERY-th count


class _Memo:
    """The values of a recursion at every `_EVERY`-th count reached, and the last one computed
    (by `joined`). Entries are only ever added, each the one exact value of its count, so ranks
    that share a schedule on threads (`fs.testing.SimulatedWorld`) may fill it together."""

    def __init__(self) -> None:
        self.kept: dict[bool, dict[int, float]] = {}
        self.last: dict[bool, tuple[int, float]] = {}


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """A schedule value: `schedule(count) -> float`."""

    def __call__(self, count: int) -> float:
        return self.value(int(count), joined=False)

    def value(self, count: int, *, joined: bool) -> float:
        """The learning rate at `count`; `joined`: this schedule starts after a boundary of
        `join_schedules` (torch's `SequentialLR` starts it from its closed form at 0)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _Recursive(_Schedule):
    """A schedule computed as torch computes it: a first value, then each from the previous."""

    _memo: _Memo = dataclasses.field(default_factory=_Memo, init=False, repr=False, compare=False, hash=False)

    def first(self, joined: bool) -> float:
        raise NotImplementedError

    def next(self, epoch: int, previous: float) -> float:
        raise NotImplementedError

    def last_recursive(self) -> int | None:
        """Past this count the value no longer changes (None: it always may)."""
        return None

    def value(self, count: int, *, joined: bool) -> float:
        if count < 0:
            raise ValueError(f"a schedule's count must be >= 0; got {count}")
        stop = self.last_recursive()
        if stop is not None:
            count = min(count, stop)
        kept = self._memo.kept.setdefault(joined, {})
        if 0 not in kept:
            kept[0] = self.first(joined)
        index = count // _EVERY
        while index not in kept:
            index -= 1
        epoch, value = index * _EVERY, kept[index]
        last = self._memo.last.get(joined)
        if last is not None and epoch < last[0] <= count:
            epoch, value = last
        while epoch < count:
            epoch += 1
            value = self.next(epoch, value)
            if epoch % _EVERY == 0:
                kept.setdefault(epoch // _EVERY, value)
        self._memo.last[joined] = (count, value)
        return value


@dataclasses.dataclass(frozen=True)
class ConstantSchedule(_Schedule):
    """`lr` at every count; see `constant_schedule`."""

    lr: float

    def value(self, count: int, *, joined: bool) -> float:
        return self.lr


@dataclasses.dataclass(frozen=True)
class LambdaSchedule(_Schedule):
    """`lr * factor(count)`, as `LambdaLR`; see `lambda_schedule`."""

    lr: float
    factor: Callable[[int], float]

    def value(self, count: int, *, joined: bool) -> float:
        return self.lr * self.factor(count)


@dataclasses.dataclass(frozen=True)
class LinearSchedule(_Recursive):
    """`LinearLR`'s numbers; see `linear_schedule`."""

    lr: float = 0.0
    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    steps: int = 5

    def first(self, joined: bool) -> float:
        if joined:  # SequentialLR: LinearLR._get_closed_form_lr at epoch 0
            s, e, n = self.start_factor, self.end_factor, self.steps
            return self.lr * (s + (e - s) * min(n, 0) / n)
        return self.lr * self.start_factor

    def next(self, epoch: int, previous: float) -> float:
        if epoch > self.steps:
            return previous
        s, e, n = self.start_factor, self.end_factor, self.steps
        return previous * (1.0 + (e - s) / (n * s + (epoch - 1) * (e - s)))

    def last_recursive(self) -> int | None:
        return self.steps


@dataclasses.dataclass(frozen=True)
class CosineSchedule(_Recursive):
    """`CosineAnnealingLR`'s numbers; see `cosine_schedule`."""

    lr: float = 0.0
    steps: int = 1
    min_lr: float = 0.0

    def first(self, joined: bool) -> float:
        if joined:  # SequentialLR: CosineAnnealingLR._get_closed_form_lr at epoch 0
            return self.min_lr + (self.lr - self.min_lr) * (1 + math.cos(math.pi * 0 / self.steps)) / 2
        return self.lr

    def next(self, epoch: int, previous: float) -> float:
        n, m = self.steps, self.min_lr
        if (epoch - 1 - n) % (2 * n) == 0:
            return previous + (self.lr - m) * (1 - math.cos(math.pi / n)) / 2
        return (1 + math.cos(math.pi * epoch / n)) / (1 + math.cos(math.pi * (epoch - 1) / n)) * (previous - m) + m


@dataclasses.dataclass(frozen=True)
class JoinedSchedules(_Schedule):
    """One schedule after another; see `join_schedules`."""

    schedules: tuple[Any, ...]
    boundaries: tuple[int, ...]

    def value(self, count: int, *, joined: bool) -> float:
        i = bisect.bisect_right(self.boundaries, count)
        local = count - (self.boundaries[i - 1] if i else 0)
        schedule = self.schedules[i]
        if isinstance(schedule, _Schedule):
            return schedule.value(local, joined=joined or i > 0)
        return float(schedule(local))


def constant_schedule(lr: float) -> ConstantSchedule:
    """`lr` at every count (torch: no scheduler).

    Arguments:
        lr: the learning rate, a float >= 0.
    """
    return ConstantSchedule(_check_lr(lr, "constant_schedule"))


def lambda_schedule(lr: float, factor: Callable[[int], float]) -> LambdaSchedule:
    """`lr * factor(count)`: the numbers of `LambdaLR(optimizer, factor)` for an optimizer built
    with `lr=lr` (how Hugging Face's `get_cosine_schedule_with_warmup` and torchtitan build
    theirs).

    Arguments:
        lr: the base learning rate, a float >= 0.
        factor: `count -> float`, called with the number of updates already applied.
    """
    if not callable(factor):
        raise TypeError(f"lambda_schedule: factor must be a function count -> float; got {type(factor).__name__}")
    return LambdaSchedule(_check_lr(lr, "lambda_schedule"), factor)


def linear_schedule(lr: float, *, start_factor: float = 1.0 / 3, end_factor: float = 1.0, steps: int = 5) -> LinearSchedule:
    """From `lr * start_factor` to `lr * end_factor` linearly over `steps` updates, then constant:
    the numbers of `LinearLR(optimizer, start_factor, end_factor, total_iters=steps)`, bit for
    bit (its recursion: `lr_k = lr_{k-1} * (1 + (e - s) / (n s + (k - 1)(e - s)))`).

    A warmup: `linear_schedule(lr, start_factor=0.01, steps=100)`; a linear decay to 0:
    `linear_schedule(lr, start_factor=1.0, end_factor=0.0, steps=n)`.

    Arguments:
        lr: the base learning rate, a float >= 0.
        start_factor: the factor at count 0, in (0, 1] (as torch).
        end_factor: the factor from count `steps` on, in [0, 1].
        steps: updates to go from one to the other, an int >= 1.
    """
    if not 0.0 < start_factor <= 1.0:
        raise ValueError(f"linear_schedule: start_factor must be in (0, 1] (as LinearLR); got {start_factor!r}")
    if not 0.0 <= end_factor <= 1.0:
        raise ValueError(f"linear_schedule: end_factor must be in [0, 1] (as LinearLR); got {end_factor!r}")
    return LinearSchedule(_check_lr(lr, "linear_schedule"), float(start_factor), float(end_factor), _check_steps(steps, "linear_schedule: steps"))


def cosine_schedule(lr: float, *, steps: int, min_lr: float = 0.0) -> CosineSchedule:
    """From `lr` down to `min_lr` along half a cosine over `steps` updates: the numbers of
    `CosineAnnealingLR(optimizer, T_max=steps, eta_min=min_lr)`, bit for bit (torch's recursion,
    not the closed formula `min_lr + (lr - min_lr)(1 + cos(pi k / steps)) / 2`, which it equals
    up to rounding). As torch, past `steps` it rises again (a cosine of period `2 steps`): end
    the run at `steps` or join a `constant_schedule(min_lr)` after it.

    Arguments:
        lr: the learning rate at count 0, a float >= 0.
        steps: updates to reach `min_lr`, an int >= 1.
        min_lr: the learning rate at count `steps`.
    """
    return CosineSchedule(_check_lr(lr, "cosine_schedule"), _check_steps(steps, "cosine_schedule: steps"), float(min_lr))


def join_schedules(*schedules: Any, boundaries: Sequence[int]) -> JoinedSchedules:
    """`schedules[i]` from count `boundaries[i - 1]` on, counting again from 0: the numbers of
    `SequentialLR(optimizer, schedulers, milestones=boundaries)` (which starts each later
    scheduler from its closed form at 0, as here). optax's `join_schedules`.

    Arguments:
        *schedules: two or more schedules (these, or any function `count -> float`).
        boundaries: the counts at which the next schedule starts: `len(schedules) - 1`
            increasing ints >= 1.
    """
    boundaries = tuple(boundaries)
    if len(schedules) < 2 or len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules: needs two or more schedules and one boundary fewer; got {len(schedules)} schedules "
            f"and boundaries {boundaries}"
        )
    if any(not isinstance(b, int) or isinstance(b, bool) for b in boundaries) or any(
        b <= a for a, b in zip((0, *boundaries), boundaries)
    ):
        raise ValueError(f"join_schedules: boundaries must be increasing ints >= 1; got {boundaries}")
    for i, schedule in enumerate(schedules):
        if not callable(schedule):
            raise TypeError(f"join_schedules: schedules[{i}] is a {type(schedule).__name__}, not a schedule")
    return JoinedSchedules(tuple(schedules), boundaries)


def warmup_cosine_schedule(
    lr: float, *, warmup_steps: int, steps: int, min_lr: float = 0.0, start_factor: float | None = None
) -> JoinedSchedules:
    """A linear warmup to `lr` over `warmup_steps` updates, then a cosine decay to `min_lr` at
    count `steps` (the whole run, warmup included, as optax's `warmup_cosine_decay_schedule`).

    `join_schedules(linear_schedule(lr, start_factor=start_factor, steps=warmup_steps),
    cosine_schedule(lr, steps=steps - warmup_steps, min_lr=min_lr), boundaries=[warmup_steps])`:
    the numbers of `SequentialLR(opt, [LinearLR(opt, start_factor, total_iters=warmup_steps),
    CosineAnnealingLR(opt, T_max=steps - warmup_steps, eta_min=min_lr)], milestones=[warmup_steps])`.

    Arguments:
        lr: the peak learning rate.
        warmup_steps: updates of the warmup, an int >= 1.
        steps: the count at which the decay reaches `min_lr`, > `warmup_steps`.
        min_lr: the final learning rate.
        start_factor: the warmup's first factor (of `lr`); default `1 / warmup_steps`.
    """
    warmup_steps = _check_steps(warmup_steps, "warmup_cosine_schedule: warmup_steps")
    if not isinstance(steps, int) or steps <= warmup_steps:
        raise ValueError(f"warmup_cosine_schedule: steps ({steps!r}) must be an int > warmup_steps ({warmup_steps})")
    factor = 1.0 / warmup_steps if start_factor is None else start_factor
    warmup = linear_schedule(lr, start_factor=factor, end_factor=1.0, steps=warmup_steps)
    return join_schedules(warmup, cosine_schedule(lr, steps=steps - warmup_steps, min_lr=min_lr), boundaries=[warmup_steps])


def warmup_linear_schedule(
    lr: float, *, warmup_steps: int, steps: int, end_factor: float = 0.0, start_factor: float | None = None
) -> JoinedSchedules:
    """A linear warmup to `lr` over `warmup_steps` updates, then a linear decay to
    `lr * end_factor` at count `steps` (Hugging Face's default, "linear").

    `join_schedules(linear_schedule(lr, start_factor=start_factor, steps=warmup_steps),
    linear_schedule(lr, start_factor=1.0, end_factor=end_factor, steps=steps - warmup_steps),
    boundaries=[warmup_steps])`: `SequentialLR` of the two `LinearLR`s.

    Arguments:
        lr: the peak learning rate.
        warmup_steps: updates of the warmup, an int >= 1.
        steps: the count at which the decay ends, > `warmup_steps`.
        end_factor: the final factor of `lr`, in [0, 1].
        start_factor: the warmup's first factor; default `1 / warmup_steps`.
    """
    warmup_steps = _check_steps(warmup_steps, "warmup_linear_schedule: warmup_steps")
    if not isinstance(steps, int) or steps <= warmup_steps:
        raise ValueError(f"warmup_linear_schedule: steps ({steps!r}) must be an int > warmup_steps ({warmup_steps})")
    factor = 1.0 / warmup_steps if start_factor is None else start_factor
    warmup = linear_schedule(lr, start_factor=factor, end_factor=1.0, steps=warmup_steps)
    decay = linear_schedule(lr, start_factor=1.0, end_factor=end_factor, steps=steps - warmup_steps)
    return join_schedules(warmup, decay, boundaries=[warmup_steps])


def _check_lr(lr: Any, owner: str) -> float:
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: lr must be a float; got {type(lr).__name__}") from None
    if not value >= 0.0:
        raise ValueError(f"{owner}: invalid learning rate {lr!r} (must be >= 0)")
    return value


def _check_steps(steps: Any, owner: str) -> int:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"{owner} must be an int >= 1; got {steps!r}")
    return steps
