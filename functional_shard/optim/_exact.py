"""Exact tensor-scalar forms of the torch kernel calls that take a varying Python scalar.

torch's non-capturable optimizer kernels pass per-step values (the learning rate, the
bias-corrected step size) as Python floats, either as an operand (`param.mul_(decay)`,
`t / bias_correction2_sqrt`) or as a `Scalar` argument (`add_(other, alpha=-lr)`,
`addcdiv_(t1, t2, value=-step_size)`). A trace bakes those in as constants. Here each
one is rewritten with the value as a 0-d float64 CPU tensor (an input of the trace),
reproducing the bits of torch's CPU kernel for float32, float64, complex and, where
noted, bfloat16/float16. The evidence is in tests/test_optim.py
(`test_exact_*`), which compares each form against the torch call it replaces.

Operand scalars. A 0-d float64 CPU tensor in a binary op with a *dimensioned* tensor
takes the same TensorIterator path as a Python float (which torch wraps into exactly
such a tensor): it loses type promotion to the dimensioned operand and is read either
cast to that dtype (float32/float64/complex) or, for bfloat16/float16 `mul`/`div`,
unrounded in float ("original scalar value"). Against a *0-d* tensor it would win
promotion (0-d float32 * 0-d float64 -> float64), so every 0-d leaf is first viewed as
shape (1,) (`as_1d`); the elementwise result is the same for one element either way.

Scalar arguments. `alpha=` / `value=` have no tensor form and are decomposed:

* `self.add(other, alpha=a)`: float32/float64/complex: the CPU kernel computes
  `fma(other, a, self)` (`vec::fmadd` in the vectorized body; the scalar tail was
  measured to fuse too), which `torch.addcmul(self, other, a)` (`self + 1 * other * a`)
  reproduces in both paths; `self + other * a` rounds the product separately and
  differs in ~2% of elements (random normal data). bfloat16/float16: `a` is first
  rounded to the tensor dtype (`Scalar.to<scalar_t>()`, via float), then the vectorized
  body computes in float with one final rounding, while the scalar tail rounds after
  each operation (`c10::BFloat16` arithmetic). torch's own result therefore depends on
  which elements land in the tail: the last `n % P` elements of each contiguous run the
  kernel processes (P = 32 measured for 16-bit types on AVX2 and AVX512; every element
  on the DEFAULT capability), where a run is the whole tensor or, above
  `_GRAIN_SIZE` elements with several threads, one OpenMP chunk. `add_scaled_` measures P
  once per process (`_add_period`, from a real kernel call, never inside a trace) and
  evaluates the two formulas on the matching slices; the thread count is read when
  `apply` runs (traces bake it in). This is exact for contiguous operands on CPU.
* `self.addcdiv(t1, t2, value=v)`: a custom op (`functional_shard::addcdiv_value_`) that
  calls that very kernel with `v.item()` when the graph runs: torch's bits on every dtype
  and device, one pass, one node in a trace.

On other devices the same forms are used but bit-identity with torch.optim is not
claimed (torch's default there is the foreach kernel, and CUDA kernels differ).
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

__all__ = ["scalar", "operand", "as_1d", "on_device", "add_scaled_", "addcdiv_scaled_", "warm_up"]

# at::internal::GRAIN_SIZE: TensorIterator splits work over threads only above it.
_GRAIN_SIZE = 32768
_REDUCED = (torch.bfloat16, torch.float16)


def scalar(value: float) -> torch.Tensor:
    """A per-step value as the 0-d float64 CPU tensor that `apply` consumes."""
    return torch.tensor(float(value), dtype=torch.float64, device="cpu")


def operand(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Scalar `s` (0-d float64) as the 0-d operand a kernel on `like` reads it as.

    The CPU kernels cast a float64 scalar to the op-math type of the tensor (float32 for
    float32, bfloat16 and float16; float64 for float64) before computing, so casting it
    first gives the same bits, and keeps the op on its vectorized path: a float64 operand
    against a float32 tensor makes TensorIterator cast element by element (4x slower)."""
    if like.is_complex():
        return on_device(s, like)
    return on_device(s.to(torch.float64 if like.dtype == torch.float64 else torch.float32), like)


def as_1d(t: torch.Tensor) -> torch.Tensor:
    """Views a 0-d tensor as shape (1,) so 0-d float64 scalars lose type promotion to it."""
    return t.reshape(1) if t.dim() == 0 else t


def on_device(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Moves scalar `s` next to `like` for ops that accept no CPU scalar (addcmul, where)."""
    return s if s.device == like.device else s.to(like.device)


def _tail_mask(dtype: torch.dtype, n: int) -> torch.Tensor:
    # Which results of `a.add(b, alpha=...)` came from the kernel's scalar tail, found
    # with operands for which the two paths disagree on every element:
    # a = eps/2, b = alpha = 1 + eps: exactly, a + alpha * b = 1 + 2 eps + eps/2 + eps^2,
    # just above a tie, which the one-rounding body rounds up to 1 + 3 eps; the tail
    # first rounds alpha * b to 1 + 2 eps, then meets the exact tie and rounds to even.
    eps = torch.finfo(dtype).eps
    a = torch.full((n,), eps / 2, dtype=dtype)
    b = torch.full((n,), 1 + eps, dtype=dtype)
    r = a.add(b, alpha=1 + eps)
    tail, body = r == 1 + 2 * eps, r == 1 + 3 * eps
    if not bool((tail | body).all()):
        raise RuntimeError("unexpected add(alpha) result")
    return tail


def _runs(n: int, threads: int) -> list[tuple[int, int]]:
    # at::parallel_for (OpenMP backend), as TensorIterator::for_each calls it.
    if n <= _GRAIN_SIZE or threads <= 1:
        return [(0, n)] if n else []
    tasks = min(threads, -(-n // _GRAIN_SIZE))
    chunk = -(-n // tasks)
    return [(b, min(n, b + chunk)) for b in range(0, n, chunk)]


def _model_mask(n: int, period: int, threads: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    for b, e in _runs(n, threads):
        mask[e - ((e - b) % period if period else e - b):e] = True
    return mask


@functools.lru_cache(maxsize=None)
def _add_period(dtype: torch.dtype) -> Optional[int]:
    """P such that the CPU `add(alpha=)` kernel for `dtype` sends the last `n % P`
    elements of each run through its scalar path; 0 when it sends all of them; None
    when the kernel does not fit that model (then `add_scaled_` is not exact)."""
    n = 4095
    tail = int(_tail_mask(dtype, n).sum())
    period = 0 if tail == n else tail + 1
    threads = torch.get_num_threads()
    sizes = [1, 2, 31, 32, 33, 64, 95, 257, 1000] + ([_GRAIN_SIZE + 33] if threads > 1 else [])
    for size in sizes:
        if not torch.equal(_tail_mask(dtype, size), _model_mask(size, period, threads)):
            warnings.warn(
                f"functional_shard.optim: torch's CPU add(alpha=) kernel for {dtype} does not "
                "split work as expected; SGD updates of such params may differ from "
                "torch.optim in the last bit.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
    return period


def warm_up() -> None:
    """Runs the one-time kernel probes now, outside any trace (called by the factories)."""
    for dtype in _REDUCED:
        _add_period(dtype)


def add_scaled_(self: torch.Tensor, other: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """In place, `self.add_(other, alpha=alpha)` with `alpha` a 0-d float64 CPU tensor.

    `self` and `other` must have the same shape and dtype and at least one dimension.
    Returns `self`.
    """
    if self.dtype not in _REDUCED:
        return self.addcmul_(other, operand(alpha, self))
    dtype = self.dtype
    alpha_dt = on_device(alpha.to(torch.float32).to(dtype), self)  # Scalar.to<scalar_t>()
    tails = []
    if self.device.type == "cpu" and self.is_contiguous() and other.is_contiguous():
        period = _add_period(dtype)
        if period is not None:
            flat_self, flat_other = self.view(-1), other.reshape(-1)
            for b, e in _runs(flat_self.numel(), torch.get_num_threads()):
                start = e - ((e - b) % period if period else e - b)
                if start < e:
                    # Scalar tail: c10::BFloat16 / c10::Half arithmetic rounds after each op.
                    tails.append((start, e, flat_self[start:e] + flat_other[start:e] * alpha_dt))
    if sum(e - start for start, e, _ in tails) < self.numel():
        # Vectorized body: upcast, fma in float, one rounding (copy_ rounds like .to(dtype)).
        self.copy_(torch.addcmul(self.float(), other.float(), alpha_dt.float()))
    for start, e, value in tails:
        self.view(-1)[start:e].copy_(value)
    return self


def addcdiv_scaled_(
    self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """In place, `self.addcdiv_(t1, t2, value=value)` with `value` a 0-d float64 CPU tensor.

    All tensors must have the same shape and dtype and at least one dimension.
    Returns `self`.

    It is torch's own kernel, called with `value` read as a double when it runs (a custom op,
    `functional_shard::addcdiv_value_`): what a Python float `value` does, for every dtype,
    in one pass over the operands (the former tensor form, `self.addcdiv_(t1 * v, t2)`,
    took two).
    """
    _addcdiv_value_(self, t1, t2, value)
    return self


@torch.library.custom_op("functional_shard::addcdiv_value_", mutates_args=("self",))
def _addcdiv_value_(self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: torch.Tensor) -> None:
    """`self.addcdiv_(t1, t2, value=float(value))`: torch's kernel, one pass, on every dtype
    and device; one node in a trace, whose input `value` (0-d float64, CPU) is read when the
    graph runs, not baked in when it is traced."""
    self.addcdiv_(t1, t2, value=value.item())


@_addcdiv_value_.register_fake
def _(self: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor, value: torch.Tensor) -> None:
    return None
