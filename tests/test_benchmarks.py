"""The benchmark harness (benchmarks/compare.py) end to end, on its smallest configuration.

One run of `--quick --models mlp` (world size 2, MLP, batch 8 per rank, 5 timed steps; about
20 s on 2 cores), then checks on what it wrote. Nothing here asserts on timings: the test
machine's speed is not the library's behaviour.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _arms import ARMS, BF16_ARMS, COMPUTE, DDP, FS_BF16, FS_DEFAULT, FS_KEEP, FS_PREFETCH0, FSDP2_ARMS, FSDP2_BF16, NEEDS  # noqa: E402
from _report import DOCS_BEGIN, DOCS_END, write_docs  # noqa: E402

WORLD_SIZE = 2
STEPS = 5

# The harness is a benchmark (~31 s for its one run): with -m slow, as the other benchmarks'
# runs are. The step's bytes and its equality to single-process training are the default
# suite's (tests/test_jit.py, tests/test_training.py); these check the harness that reports them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "run"
    command = [sys.executable, str(BENCHMARKS / "compare.py"), "--quick", "--models", "mlp", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"compare.py failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="module")
def result(run_dir) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def record(result) -> dict:
    (only,) = result["records"]
    return only


def test_json_has_every_arm_with_every_figure(result, record):
    assert result["machine"]["cores"] >= 1 and result["machine"]["cpu_model"]
    assert result["config"]["world_sizes"] == [WORLD_SIZE]
    assert isinstance(result["fs_donate"], bool)
    assert (record["model"], record["world_size"], record["batch_size"]) == ("mlp", WORLD_SIZE, 8)
    # Every arm ran, but those whose peer library is not installed: skipped, with the reason.
    assert set(record["arms"]) | set(record["skipped"]) == set(ARMS)
    assert not set(record["arms"]) & set(record["skipped"]) and set(record["skipped"]) <= set(NEEDS)
    assert all("not installed" in why or "not importable" in why for why in record["skipped"].values())
    for name, arm in record["arms"].items():
        assert len(arm["times_s"]) == STEPS and all(t > 0 for t in arm["times_s"]), name
        assert arm["median_ms"] > 0 and arm["iqr_ms"] >= 0, name
        assert len(arm["peak_bytes_per_rank"]) == WORLD_SIZE and min(arm["peak_bytes_per_rank"]) > 0, name
        assert arm["ratio_fsdp2_best"] > 0 and arm["ratio_ddp"] > 0, name
        assert arm["bytes_source"], name
    assert record["arms"][COMPUTE]["exposed_comm_ms"] == 0
    assert record["activation_bytes"] > 0


def test_fs_bytes_match_theory(record):
    """With resharding every unit is gathered in forward, again in backward if the backward reads
    it (all but the MLP's input projection, whose gradient reads the batch, not its weight), and
    reduce-scattered once; without, gathered once. The full buffers are Ψ×4 bytes plus the
    padding that makes each unit divisible by the world size."""
    psi_bytes = 4 * record["psi"]
    padded = record["fs_layout"]["padded_bytes"]
    # Padding: at most world_size - 1 elements per buffer.
    assert psi_bytes <= padded <= psi_bytes + 4 * (WORLD_SIZE - 1) * record["fs_layout"]["buffers"]
    for name in (FS_DEFAULT, FS_PREFETCH0):
        arm = record["arms"][name]
        backward = arm["backward_all_gather_bytes"]
        assert arm["reduce_scatter_bytes"] == padded, name
        assert arm["all_gather_bytes"] == padded + backward, name
        assert padded // 2 < backward < padded, name  # the blocks and the output projection, not the input one
    keep = record["arms"][FS_KEEP]
    assert keep["all_gather_bytes"] == keep["reduce_scatter_bytes"] == padded and keep["backward_all_gather_bytes"] == 0
    # bf16: gathered in bf16 (half the bytes), the same units; reduced in fp32.
    bf16 = record["arms"][FS_BF16]
    assert 2 * bf16["backward_all_gather_bytes"] == record["arms"][FS_DEFAULT]["backward_all_gather_bytes"]
    assert bf16["all_gather_bytes"] == padded // 2 + bf16["backward_all_gather_bytes"] and bf16["reduce_scatter_bytes"] == padded


def test_torch_arms_bytes(record):
    for name in (*FSDP2_ARMS, FSDP2_BF16):
        arm = record["arms"][name]
        # Counted on a real step, equal to the theory from the sharded parameter sizes.
        assert arm["counted_all_gather_bytes"] == arm["all_gather_bytes"], name
        assert arm["counted_reduce_scatter_bytes"] == arm["reduce_scatter_bytes"] >= 4 * record["psi"], name
    assert record["arms"][DDP]["all_reduce_bytes"] == 4 * record["psi"]


def test_every_trained_arm_matches_single_process(record):
    for name, arm in record["arms"].items():
        if name == COMPUTE:
            assert "max_param_diff_rel" not in arm
        elif name in BF16_ARMS:
            # bf16 parameters and compute: a distance to fp32 training (~6e-2 after 3 MLP steps,
            # fs's and FSDP2's alike), reported, not an error.
            assert 0 <= arm["max_param_diff_rel"] < 0.2, name
        else:
            assert 0 <= arm["max_param_diff_rel"] < 1e-3, name


def test_table_and_chart_are_written(run_dir, result):
    table = (run_dir / "results.md").read_text()
    for name in ARMS:
        if name in result["records"][0]["skipped"]:
            assert f"Skipped `{name}`" in table, name
        else:
            assert f"| 8 | {name} |" in table, name
    assert "Targets" in table
    chart = (run_dir / "results.png").read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 10_000
    assert result["targets"] and all(isinstance(t["met"], bool) for t in result["targets"])


def test_docs_are_rendered_from_a_run(run_dir, result, tmp_path):
    docs, chart = tmp_path / "benchmarks.md", tmp_path / "benchmarks.png"
    docs.write_text(f"# Benchmarks\n\nbefore\n\n{DOCS_BEGIN}\nplaceholder\n{DOCS_END}\n\nafter\n")
    write_docs(run_dir, docs, chart)
    text = docs.read_text()
    assert "placeholder" not in text and text.startswith("# Benchmarks\n\nbefore") and text.endswith("after\n")
    ran = result["records"][0]["arms"]
    assert all(f"| {name} |" in text for name in ran)
    assert chart.read_bytes() == (run_dir / "results.png").read_bytes()
    write_docs(run_dir, docs, chart)  # again: the markers stay, the content is replaced, not appended
    assert docs.read_text() == text


def test_docs_page_has_the_markers():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert text.index(DOCS_BEGIN) < text.index(DOCS_END)


@pytest.mark.slow  # ~12 s: the suite's time; the canonical step itself is tested in tests/test_canonical*.py
def test_canonical_benchmark_quick_runs_and_reports():
    """`benchmarks/canonical.py --quick` (tiny GPT, world size 2, 2 steps; ~10 s): every arm's row,
    the ratios, and the canonical arms bit-identical to each other (never a threshold on timings)."""
    command = [sys.executable, str(BENCHMARKS / "canonical.py"), "--quick"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"canonical.py failed:\n{done.stdout}\n{done.stderr[-12000:]}"
    from canonical import ARMS as CANONICAL_ARMS

    for name in CANONICAL_ARMS:
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {name} |"))
        median_ms, _, peak_mib = (float(cell) for cell in row.split("|")[2:5])
        assert median_ms > 0 and peak_mib > 0, row
    assert "bit-identical across `canonical G`, `canonical G, per chunk`: True" in done.stdout
    assert "`canonical G` / `default`: time" in done.stdout


@pytest.mark.slow  # ~15-20 s on a quiet machine; the pipeline step itself is tested in tests/test_pipeline*.py
def test_pipeline_benchmark_quick_runs_and_reports(tmp_path):
    """`benchmarks/pipeline.py --quick` (a tiny GPT at {"pp": 2}, 1 + 2 steps): every torch and fs
    schedule's row and figures, every arm training what one process trains (losses), fs's stage
    cut holding the parameters torch's does, the targets printed (never a threshold on timings)."""
    out = tmp_path / "pipeline.json"
    command = [sys.executable, str(BENCHMARKS / "pipeline.py"), "--quick", "--json", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"pipeline.py failed:\n{done.stdout}\n{done.stderr[-12000:]}"
    from pipeline import FS_SCHEDULES, TORCH_NAMES

    (entry,) = json.loads(out.read_text())
    assert (entry["mesh"], entry["model"]) == ("pp2", "gpt")
    arms = entry["result"]["arms"]
    names = [*TORCH_NAMES.values(), *(f"fs {s}" for s in FS_SCHEDULES)]
    assert list(arms) == names
    steps = entry["config"]["steps"] + entry["config"]["warmup"]
    for name, arm in arms.items():
        assert len(arm["times_s"]) == entry["config"]["steps"] and all(t > 0 for t in arm["times_s"]), name
        assert len(arm["peak_bytes_per_rank"]) == 2 and min(arm["peak_bytes_per_rank"]) > 0, name
        assert len(arm["losses"]) == steps and arm["max_loss_diff"] < 1e-4, name
        same_cut = "torch ZBVZeroBubble" if name in ("torch ZBVZeroBubble", "fs zbv") else "torch 1F1B"  # a V cut
        assert arm["params_per_rank"] == arms[same_cut]["params_per_rank"], name
        row = next(line for line in done.stdout.splitlines() if line.startswith(f"| {name} |"))
        assert float(row.split("|")[2]) > 0, row
    assert sum(arms["fs 1f1b"]["params_per_rank"]) == entry["result"]["params"]
    assert "fs's stage cuts hold the same parameters per rank as torch's: True" in done.stdout
    assert "fastest fs schedule" in done.stdout and "`fs 1f1b`: step time" in done.stdout
