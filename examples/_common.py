"""What the examples share: a progress bar, per-rank peak memory, a loss-curve PNG, a summary.

Only public APIs (`torch.distributed`, tqdm, matplotlib); nothing here is part of
functional_shard. Every function is safe on every rank: those that are collectives say so.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist


class Progress:
    """A tqdm bar on rank 0 (nothing on the others): loss, tokens/s and step time per step.

    `update(loss, tokens, seconds)` after each step: `tokens` is what the whole world
    trained on in that step, `seconds` the step's wall time. The bar is redrawn at most
    every `interval` seconds (twice a second on a terminal, every 10 s into a file or pipe).
    """

    def __init__(self, total: int, *, rank: int, initial: int = 0, desc: str = "train"):
        self.enabled = rank == 0
        self.bar = None
        if self.enabled:
            from tqdm import tqdm

            interval = 0.5 if sys.stderr.isatty() else 10.0
            self.bar = tqdm(total=total, initial=initial, desc=desc, mininterval=interval, maxinterval=interval,
                            dynamic_ncols=True, unit="step")

    def update(self, loss: float, tokens: int, seconds: float) -> None:
        if self.bar is None:
            return
        rate = tokens / seconds if seconds > 0 else float("nan")
        # refresh=False: let tqdm's interval decide when to redraw (else one line per step into a log).
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", step_ms=f"{1000 * seconds:.0f}", refresh=False)
        self.bar.update(1)

    def write(self, message: str) -> None:
        """Print a line above the bar (rank 0 only)."""
        if self.bar is not None:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (`getrusage` maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def gather_from_ranks(value) -> list:
    """`value` from every rank, in rank order (a collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


@dataclass
class History:
    """Losses by step, kept on every rank (the loss in the metrics is already the mean over ranks)."""

    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> History:
        return cls(**json.loads(text))

    def up_to(self, step: int) -> History:
        """The entries of steps before `step` (what a resumed run keeps of a longer run's history)."""
        train = [(s, v, t) for s, v, t in zip(self.train_steps, self.train_loss, self.step_seconds) if s < step]
        evals = [(s, v) for s, v in zip(self.eval_steps, self.eval_loss) if s <= step]
        return History([s for s, _, _ in train], [v for _, v, _ in train], [s for s, _ in evals],
                       [v for _, v in evals], [t for _, _, t in train])


def _smooth(values: list[float], window: int) -> list[float]:
    """Centered moving average, so the curve does not lag the steps; near the ends the window
    shrinks symmetrically (down to the point itself), so the steep start is not flattened."""
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    out = []
    for i in range(len(values)):
        half = min(window // 2, i, len(values) - 1 - i)
        out.append((prefix[i + half + 1] - prefix[i - half]) / (2 * half + 1))
    return out


def plot_losses(path: str | Path, history: History, *, title: str, resumed_at: int | None = None) -> Path:
    """Write the loss curve to `path` (PNG): every step's training loss, its moving average,
    the held-out loss if any, and where a resumed run picked up. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=120)
    steps, losses = history.train_steps, history.train_loss
    ax.plot(steps, losses, color="#9ecae1", linewidth=0.9, label="train loss (each step)")
    window = 2 * max(1, len(losses) // 40) + 1  # odd, about 5% of the run
    smooth = _smooth(losses, window) if len(losses) > window else list(losses)
    if len(losses) > window:
        ax.plot(steps, smooth, color="#08519c", linewidth=2.0, label=f"train loss (mean of {window} steps)")
    if history.eval_steps:
        ax.plot(history.eval_steps, history.eval_loss, "o-", color="#e6550d", markersize=4, linewidth=1.5,
                label="held-out loss")
    if resumed_at is not None and resumed_at > 0:
        ax.axvline(resumed_at, color="0.5", linestyle="--", linewidth=1)
        ax.annotate("resumed", (resumed_at, 1), xycoords=("data", "axes fraction"), xytext=(4, -14),
                    textcoords="offset points", color="0.35", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title, fontsize=11)
    ax.grid(True, color="0.9", linewidth=0.8)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if losses:
        first, last = losses[0], smooth[-1]  # the first step as it was; the end smoothed
        ax.set_ylim(bottom=max(0.0, 0.9 * min(min(losses), *(history.eval_loss or [math.inf]))))
        ax.text(0.99, 0.97, f"train loss {first:.2f} → {last:.2f} ({100 * (1 - last / first):.0f}% lower)",
                transform=ax.transAxes, ha="right", va="top", fontsize=9, color="0.25")
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.9), frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def summary(
    *,
    steps: int,
    seconds: float,
    tokens: int,
    peak_mib: list[float],
    all_gather_bytes: int,
    reduce_scatter_bytes: int,
    step_seconds: list[float],
    history: History,
) -> str:
    """The closing lines of an example: what ran, how long, how much memory and traffic."""
    later = sorted(step_seconds[1:]) or [float("nan")]  # the first step includes the trace
    median = later[len(later) // 2]
    lines = [f"steps: {steps} in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s over all ranks)"]
    if step_seconds:
        lines[0] = lines[0][:-1] + (
            f"; median step {1000 * median:.0f} ms, first step {1000 * step_seconds[0]:.0f} ms with tracing)"
        )
    per_rank = ", ".join(f"rank {r} {m:,.0f} MiB" for r, m in enumerate(peak_mib))
    lines.append(f"peak memory (max RSS) per rank: {per_rank}")
    lines.append(
        f"moved per step (full buffers): all-gather {format_bytes(all_gather_bytes)}, "
        f"reduce-scatter {format_bytes(reduce_scatter_bytes)}"
    )
    if history.train_loss:
        first, last = history.train_loss[0], history.train_loss[-1]
        lines.append(f"loss: first {first:.3f}, final {last:.3f} ({100 * (1 - last / first):.0f}% lower)")
    if history.eval_loss:
        lines.append(f"held-out loss: {history.eval_loss[0]:.3f} at step {history.eval_steps[0]}, "
                     f"{history.eval_loss[-1]:.3f} at step {history.eval_steps[-1]}")
    return "\n".join(lines)


class Timer:
    """`with Timer() as t: ...` then `t.seconds`."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
