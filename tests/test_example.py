"""The README's main example runs as a user would run it, and learns."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_gpt_example_loss_falls_by_30_percent():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    summary = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert summary["final_loss"] <= 0.7 * summary["first_loss"], summary
