"""The examples run as a user would run them (fresh interpreters, no torchrun variables), learn,
and leave no warning about leaked resources; the Hugging Face one resumes from its checkpoint
and exports a model that `from_pretrained` loads; torchrun runs them unchanged, on two "nodes"
of this machine too."""

from __future__ import annotations

import ast
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
# What Python and torch print when a process leaves resources behind (semaphores, shared memory,
# processes): none of it may appear on an example's stderr.
LEAK_MARKERS = ("leaked semaphore", "leaked shared_memory", "resource_tracker", "leaked folder", "ResourceWarning")


def clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(extra)
    return env


def run_example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run an example as a user would: a fresh interpreter, no torchrun variables."""
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=timeout,
        check=False,
    )


def last_dict(stdout: str) -> dict:
    """The examples end with a dict of their results on one line."""
    return ast.literal_eval(stdout.strip().splitlines()[-1])


def assert_no_leak_warnings(stderr: str) -> None:
    found = [marker for marker in LEAK_MARKERS if marker in stderr]
    assert not found, f"leaked resources reported ({found}):\n{stderr[-3000:]}"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert path.stat().st_size > 10_000, "the loss curve is suspiciously small"


# The full-length run (300 steps) with -m slow (~40-50 s): train_gpt.py runs and learns in the
# default set under torchrun (test_torchrun_two_nodes_on_loopback_train_the_example), fs.launch
# from a user's script in test_the_getting_started_script_runs_as_written.
@pytest.mark.slow
def test_train_gpt_example_loss_falls_by_30_percent(tmp_path):
    run = run_example(str(EXAMPLES / "train_gpt.py"), "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr[-12000:]
    summary = last_dict(run.stdout)
    assert summary["final_loss"] <= 0.7 * summary["first_loss"], summary
    assert "steps: 300 in" in run.stdout and "peak memory (max RSS) per rank: rank 0" in run.stdout, run.stdout[-2000:]
    assert "moved per step (full buffers): all-gather" in run.stdout
    assert_png(tmp_path / "loss.png")
    assert "train: 100%" in run.stderr  # the progress bar, on rank 0 only
    assert_no_leak_warnings(run.stderr)


# With -m slow (~20 s): every schedule's bits against the eager reference in
# test_jit.py::test_every_schedule_is_bit_identical_to_eager, the events table (gather_issued,
# reduce_scatter_waited) in test_jit.py::test_cache_retraces_on_new_signature_and_explains.
@pytest.mark.slow
def test_schedules_example_shows_bit_identical_schedules():
    run = run_example(str(EXAMPLES / "schedules.py"), "--steps", "2")
    assert run.returncode == 0, run.stderr[-12000:]
    assert run.stdout.count("bit-identical to the eager reference") == 5, run.stdout[-3000:]
    assert "gather_issued" in run.stdout and "reduce_scatter_waited" in run.stdout


# --- the Hugging Face example -------------------------------------------------------------------------


def test_hf_llama_example_trains_resumes_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    script, out = str(EXAMPLES / "train_hf_llama.py"), str(tmp_path / "run")
    # A run of 6 steps interrupted after 4 (its learning-rate schedule spans the 6).
    first = run_example(script, "--steps", "6", "--stop-after", "4", "--eval-every", "0", "--out", out, "--no-export")
    assert first.returncode == 0, first.stderr[-12000:]
    assert last_dict(first.stdout)["steps"] == 4
    assert (tmp_path / "run" / "checkpoint").is_dir()

    # Go on from the checkpoint, with gradient accumulation now (the checkpoint does not care).
    second = run_example(script, "--steps", "6", "--eval-every", "2", "--out", out, "--resume", "--microbatches", "2")
    assert second.returncode == 0, second.stderr[-12000:]
    result = last_dict(second.stdout)
    assert result["steps"] == 6 and result["resumed_from"] == 4, result
    # The history goes on across the resume: the first loss is step 0's, of the first run.
    assert result["first_loss"] > 5.0 and result["final_loss"] < 0.8 * result["first_loss"], result
    assert result["final_eval_loss"] < result["first_eval_loss"], result
    assert result["export_matches"] is True
    assert_png(tmp_path / "run" / "loss.png")
    for run in (first, second):
        assert_no_leak_warnings(run.stderr)

    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "run" / "export")
    assert model.config.vocab_size == 259 and model.config.num_hidden_layers == 2
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([[256, 84, 104, 101]])).logits
    assert logits.shape == (1, 4, 259) and bool(torch.isfinite(logits).all())


# With -m slow (~20 s): the example runs in test_hf_llama_example_trains_resumes_and_exports; remat
# with micro-batches on a Hugging Face Llama in test_remat.py::test_remat_with_microbatches_on_a_hugging_face_llama.
@pytest.mark.slow
def test_hf_llama_example_remat_flag(tmp_path):
    pytest.importorskip("transformers")
    script = str(EXAMPLES / "train_hf_llama.py")
    run = run_example(
        script, "--remat", "--microbatches", "2", "--steps", "2", "--eval-every", "0", "--no-export", "--out", str(tmp_path)
    )
    assert run.returncode == 0, run.stderr[-12000:]


@pytest.mark.slow
def test_hf_llama_example_defaults_loss_falls_by_30_percent(tmp_path):
    pytest.importorskip("transformers")
    began = time.monotonic()
    run = run_example(str(EXAMPLES / "train_hf_llama.py"), "--out", str(tmp_path), timeout=600)
    seconds = time.monotonic() - began
    assert run.returncode == 0, run.stderr[-12000:]
    result = last_dict(run.stdout)
    assert result["final_loss"] <= 0.7 * result["first_loss"], result
    assert result["export_matches"] is True
    assert_no_leak_warnings(run.stderr)
    print(f"train_hf_llama.py with defaults: {seconds:.0f} s")


@pytest.mark.slow
def test_hf_llama_example_bf16_accumulation_clipping(tmp_path):
    pytest.importorskip("transformers")
    run = run_example(str(EXAMPLES / "train_hf_llama.py"), "--steps", "30", "--precision", "bf16", "--microbatches",
                      "2", "--clip", "0.5", "--eval-every", "10", "--out", str(tmp_path), timeout=600)
    assert run.returncode == 0, run.stderr[-12000:]
    result = last_dict(run.stdout)
    assert result["final_loss"] <= 0.7 * result["first_loss"], result


# --- torchrun, two nodes on loopback ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# With -m slow (suite time, 9-24 s): torchrun on one node runs the same launch path in
# tests/test_launch.py::test_one_call_runs_main_under_a_local_launch_and_under_torchrun.
@pytest.mark.slow
def test_torchrun_two_nodes_on_loopback_train_the_example(tmp_path):
    """Two torchrun agents on this machine, one rank each, meet at a c10d rendezvous on 127.0.0.1
    and run the example unchanged, as two machines would."""
    port = free_port()
    env = clean_environment(
        GLOO_SOCKET_IFNAME="lo" if sys.platform.startswith("linux") else "lo0",  # gloo on loopback
        OMP_NUM_THREADS="1",
    )
    logs = {node: (tmp_path / f"node{node}.out", tmp_path / f"node{node}.err") for node in (0, 1)}
    agents = []
    with contextlib.ExitStack() as files:
        for node in (0, 1):
            command = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fs-two-nodes",
                # The rendezvous store lives in node 0's agent (both agents see 127.0.0.1 as their own address).
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'},join_timeout=120",
                str(EXAMPLES / "train_gpt.py"), "--steps", "3", "--out", str(tmp_path / f"node{node}"),
            ]  # fmt: skip
            out, err = (files.enter_context(open(path, "w")) for path in logs[node])
            agents.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err))
        try:
            codes = [agent.wait(timeout=300) for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait()
    outputs = [(logs[node][0].read_text(), logs[node][1].read_text()) for node in (0, 1)]
    assert codes == [0, 0], "\n\n".join(f"node {n} stderr:\n{e[-3000:]}" for n, (_, e) in enumerate(outputs))
    # Rank 0 (on whichever node the rendezvous made it) trained 3 steps and reported.
    reports = [o for o, _ in outputs if "steps: 3 in" in o]
    assert len(reports) == 1, outputs
    assert "rank 0" in reports[0] and "rank 1" in reports[0]  # both ranks' peak memory: a world of two
    result = last_dict(reports[0])
    assert result["final_loss"] < result["first_loss"], result
    for _, err in outputs:
        assert_no_leak_warnings(err)


def test_the_getting_started_script_runs_as_written(tmp_path):
    """docs/getting-started.md's "Your own script" (one launch call, a data sampler, parameter
    groups, a schedule) runs as a user would copy it."""
    import re

    page = (ROOT / "docs" / "getting-started.md").read_text()
    code = re.search(r"## Your own script.*?```python\n(.*?)```", page, flags=re.DOTALL).group(1)
    script = tmp_path / "own_script.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_environment(), capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-12000:]
    result = last_dict(run.stdout)
    assert result["steps"] == 30 and result["loss"] < 1.386, result  # below ln 4: it learned
    assert_no_leak_warnings(run.stderr)
