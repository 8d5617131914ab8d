"""The README's main example runs as a user would run it, and learns."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(*args: str) -> subprocess.CompletedProcess:
    """Run an example as a user would: a fresh interpreter, no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_train_gpt_example_loss_falls_by_30_percent():
    run = run_example(str(ROOT / "examples" / "train_gpt.py"))
    assert run.returncode == 0, run.stderr[-4000:]
    summary = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert summary["final_loss"] <= 0.7 * summary["first_loss"], summary


def test_schedules_example_shows_bit_identical_schedules():
    run = run_example(str(ROOT / "examples" / "schedules.py"), "--steps", "2")
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.count("bit-identical to the eager reference") == 5, run.stdout[-3000:]
    assert "gather_issued" in run.stdout and "reduce_scatter_waited" in run.stdout
