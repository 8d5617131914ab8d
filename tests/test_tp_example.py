"""examples/llama_tensor_parallel.py: a Hugging Face Llama at `{"fsdp": 2, "tp": 2}` on 4 processes.

The default test runs the example's `main` on the session's world of 4 gloo processes (the rank
function `fs.launch` would run; starting 4 fresh interpreters costs ~15-20 s here). The slow ones
run the script as a user would: with `fs.launch` spawning 4 processes, and under torchrun."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from test_example import assert_no_leak_warnings, clean_environment, last_dict, run_example

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "llama_tensor_parallel.py"
Q_PROJ = {"full": [128, 128], "piece": [64, 128]}  # split over tp (2), then sharded over fsdp (2)


def example_main(mesh, steps: int) -> dict:
    """The example's rank function on this rank (module-level: it is pickled into the ranks); it
    makes its own mesh on the world's processes, as under fs.launch."""
    sys.path.insert(0, str(SCRIPT.parent))
    import llama_tensor_parallel as example

    return example.main(replace(example.TrainConfig(), steps=steps, log_every=10**6))


def test_the_example_trains_at_fsdp2_tp2_and_its_joined_weights_evaluate_alike(local_world):
    result = local_world(4).run(example_main, 6)[0]
    assert result["mesh"] == {"fsdp": 2, "tp": 2} and result["q_proj_shapes"] == Q_PROJ, result
    assert result["final_loss"] < 0.85 * result["first_loss"], result
    # The trained pieces joined over tp and fsdp, in the plain (unparallelized) model, give the
    # loss the step's own evaluation computes on its pieces with its collectives.
    assert result["plain_model_eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-5), result


@pytest.mark.slow
def test_the_example_script_with_fs_launch_loss_falls_by_30_percent():
    run = run_example(str(SCRIPT))
    assert run.returncode == 0, run.stderr[-12000:]
    result = last_dict(run.stdout)
    assert result["mesh"] == {"fsdp": 2, "tp": 2} and result["steps"] == 40, result
    assert result["final_loss"] <= 0.7 * result["first_loss"], result
    assert result["plain_model_eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-5), result
    assert len(result["peak_rss_mib_per_rank"]) == 4  # four ranks reported
    assert "step    0  loss" in run.stdout
    assert_no_leak_warnings(run.stderr)


@pytest.mark.slow
def test_the_example_script_under_torchrun_and_at_another_mesh():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT),
               "--steps", "3", "--axes", "replicate=2,tp=2", "--gathered-logits"]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=clean_environment(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-12000:]
    result = last_dict(run.stdout)
    assert result["mesh"] == {"replicate": 2, "tp": 2} and result["q_proj_shapes"] == Q_PROJ, result
    assert result["final_loss"] < result["first_loss"], result
    assert_no_leak_warnings(run.stderr)
