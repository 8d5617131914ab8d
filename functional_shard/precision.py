"""Mixed precision as a value: which dtype each buffer is gathered and computed in, which dtype its
gradient is reduced in, and dynamic loss scaling for fp16.

The semantics of FSDP2's `MixedPrecisionPolicy`: the optimizer keeps master shards (and its
state) in the parameters' own dtype, usually fp32. Each unit's shard is cast to `param_dtype`
*before* its all-gather (so the all-gather moves half the bytes for bf16), the forward and
backward compute in `param_dtype`, and the full gradient is cast to `reduce_dtype` before its
reduce-scatter; the reduced shard is cast back to the master dtype for the optimizer.

    step = fs.sharded_step(loss_fn, mesh, optimizer=...,
                           precision=fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

fp16 needs loss scaling (its range is narrow): `fs.Precision(param_dtype=torch.float16,
loss_scale=fs.LossScale())` multiplies the loss by a scale before the backward, divides the
gradient by it after the reduce-scatter, and skips the update of a step whose gradient is not
finite anywhere (parameters and optimizer state unchanged, scale halved), as
`torch.amp.GradScaler` and DeepSpeed do; `metrics["skipped"]` and `metrics["loss_scale"]` say so.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Callable, NamedTuple

import torch

__all__ = ["Precision", "LossScale", "LossScaleState"]


def _check_floating(name: str, dtype) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"Precision.{name} must be a floating torch.dtype (e.g. torch.bfloat16) or None; got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling: the defaults of `torch.amp.GradScaler`, with DeepSpeed's floor.

    A step whose gradient is not finite is skipped (parameters, module buffers and optimizer
    state unchanged; `metrics["skipped"]`) and the scale backs off, never below `min_scale`.
    Under a persistent overflow GradScaler's scale underflows to 0 (about 175 halvings from
    2**16 in float32) and every later step is skipped, silently; here the scale stops at
    `min_scale`, and `max_consecutive_skips` skipped steps in a row raise `fs.NonFiniteError`
    (a gradient that is not finite at the floor is a NaN or an Inf no scale can fix).

    Attributes:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it after `growth_interval` finite steps in a row.
        backoff_factor: the scale is multiplied by it after a step whose gradient is not finite.
        growth_interval: finite steps in a row before the scale grows.
        min_scale: the smallest scale (DeepSpeed's `min_loss_scale`, 1 by default); `init_scale`
            must be at least this.
        max_consecutive_skips: this many skipped steps in a row raise `fs.NonFiniteError` on every
            rank, the state passed to the step untouched; None never raises. The default, 50, is
            well beyond the 16 halvings that bring the default `init_scale` down to 1.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    max_consecutive_skips: int | None = 50

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"LossScale.init_scale must be > 0; got {self.init_scale!r}")
        if not self.growth_factor > 1:
            raise ValueError(f"LossScale.growth_factor must be > 1; got {self.growth_factor!r}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"LossScale.backoff_factor must be in (0, 1); got {self.backoff_factor!r}")
        if not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(f"LossScale.growth_interval must be an int >= 1; got {self.growth_interval!r}")
        if not 0 < self.min_scale <= self.init_scale:
            raise ValueError(
                f"LossScale.min_scale must be > 0 and <= init_scale ({self.init_scale!r}); got {self.min_scale!r}"
            )
        skips = self.max_consecutive_skips
        if skips is not None and (not isinstance(skips, int) or isinstance(skips, bool) or skips < 1):
            raise ValueError(f"LossScale.max_consecutive_skips must be an int >= 1 or None; got {skips!r}")

    def init(self) -> "LossScaleState":
        return LossScaleState(torch.tensor(self.init_scale, dtype=torch.float32), torch.tensor(0, dtype=torch.int64))

    def next(self, state: "LossScaleState", finite: torch.Tensor) -> "LossScaleState":
        """The state after a step whose gradient was `finite` (a 0-d bool tensor); traceable.

        `good_steps` counts the current streak: finite steps in a row (up from 0 after a
        skipped step), or minus the skipped steps in a row (down from 0 after a finite one)."""
        good = state.good_steps
        zero = torch.zeros_like(good)
        good = torch.where(finite, torch.maximum(good, zero) + 1, torch.minimum(good, zero) - 1)
        grow = good >= self.growth_interval
        scale = torch.where(
            finite,
            torch.where(grow, state.scale * self.growth_factor, state.scale),
            torch.clamp(state.scale * self.backoff_factor, min=self.min_scale),
        )
        return LossScaleState(scale, torch.where(grow, zero, good))

    def consecutive_skips(self, state: "LossScaleState") -> int:
        """How many steps in a row were skipped before `state` (reads a tensor: eager only)."""
        return max(0, -int(state.good_steps))


class LossScaleState(NamedTuple):
    """The loss scale's state, part of the step state (saved with it)."""

    scale: torch.Tensor  # 0-d float32: the loss is multiplied by it before the backward
    # 0-d int64: the current streak: finite steps in a row since the scale last changed (>= 0),
    # or minus the steps skipped in a row (< 0)
    good_steps: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Precision:
    """Mixed precision for a sharded step (FSDP2's `MixedPrecisionPolicy` semantics).

    Attributes:
        param_dtype: the dtype every floating buffer is all-gathered and computed in; None keeps
            each buffer's own dtype. Master shards and optimizer state stay in their dtype.
        reduce_dtype: the dtype gradients are reduce-scattered in; None means `param_dtype`
            (or the buffer's dtype), as in FSDP2.
        full_precision: leaves kept in their own dtype: a tuple of glob patterns matched
            against leaf paths and unit names (e.g. `("*.ln_f.*", "output")`: a pattern matches
            the whole path), or a function `path -> bool`. They form buffers of their own
            within their unit.
        loss_scale: dynamic loss scaling (`LossScale()`), needed for float16.
        cast_inputs: cast the batch's floating tensors to `param_dtype` before `loss_fn`
            sees them (FSDP2's `cast_forward_inputs`), so that the forward computes in it.
        keep_batch_norm: keep the parameters of BatchNorm modules (`nn.BatchNorm1d/2d/3d`,
            `SyncBatchNorm`: `fs.functionalize` names them) in their own dtype, as FSDP1's
            `MixedPrecision` does by default: their running statistics are module buffers,
            never cast, and torch's batch norm takes a `param_dtype` input with float32
            weights and statistics, not bfloat16 weights with float32 statistics. False
            gathers them in `param_dtype` like every other leaf.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    full_precision: tuple[str, ...] | Callable[[str], bool] = ()
    loss_scale: LossScale | None = None
    cast_inputs: bool = True
    keep_batch_norm: bool = True

    def __post_init__(self) -> None:
        _check_floating("param_dtype", self.param_dtype)
        _check_floating("reduce_dtype", self.reduce_dtype)
        if isinstance(self.full_precision, (list, tuple)):
            object.__setattr__(self, "full_precision", tuple(self.full_precision))
            if not all(isinstance(p, str) for p in self.full_precision):
                raise ValueError(f"Precision.full_precision must hold glob patterns (str); got {self.full_precision!r}")
        elif not callable(self.full_precision):
            raise ValueError(f"Precision.full_precision must be a tuple of patterns or a function; got {self.full_precision!r}")
        if not isinstance(self.keep_batch_norm, bool):
            raise ValueError(f"Precision.keep_batch_norm must be True or False; got {self.keep_batch_norm!r}")
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScale):
            raise ValueError(f"Precision.loss_scale must be an fs.LossScale or None; got {self.loss_scale!r}")
        if self.param_dtype == torch.float16 and self.loss_scale is None:
            raise ValueError(
                "Precision(param_dtype=torch.float16) needs loss scaling: float16 gradients underflow. Pass "
                "loss_scale=fs.LossScale(), or use torch.bfloat16"
            )

    def dtypes(
        self, path: str, unit: str, dtype: torch.dtype, *, batch_norm: bool = False
    ) -> tuple[torch.dtype, torch.dtype]:
        """(gather dtype, reduce dtype) of a leaf of `dtype` at `path` in `unit` (`batch_norm`:
        a parameter of a BatchNorm module)."""
        if not dtype.is_floating_point or (batch_norm and self.keep_batch_norm) or self._keeps(path, unit):
            return dtype, dtype
        gather = self.param_dtype or dtype
        return gather, self.reduce_dtype or gather

    def input_dtype(self) -> torch.dtype | None:
        """The dtype floating batch tensors are cast to, or None."""
        return self.param_dtype if self.cast_inputs else None

    def _keeps(self, path: str, unit: str) -> bool:
        if callable(self.full_precision):
            return bool(self.full_precision(path))
        return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(unit, p) for p in self.full_precision)
