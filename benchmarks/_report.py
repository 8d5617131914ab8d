"""From the ranks' raw figures to statistics, targets, a markdown report, a chart and the docs.

Nothing here runs a model: every function takes the JSON-ready records of `_runner.py` (or a
`results.json` written earlier), so a report can be rendered again from any past run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

from _arms import ARMS, BF16_ARMS, BF16_PEER_ARMS, COMPUTE, DDP, FS_BF16, FS_DEFAULT, FS_KEEP, FSDP2_ARMS, PEER_ARMS

MIB = 2**20

# How each figure is obtained; stored in the JSON next to the figures.
METHODS = {
    "times_s": "per timed step, the slowest rank's wall time of arm.step(batch) (ranks start together "
    "after an all-reduce barrier); arms interleaved step by step, their order rotating every step",
    "median_ms / iqr_ms": "median and interquartile range (q3 - q1) of times_s",
    "ratio_fsdp2_best": "median / the smaller median of the two FSDP2 arms of the same configuration",
    "ratio_peer_best": "median / the smallest median of the sharded peers of the same configuration and precision "
    "(fp32: FSDP2, FSDP2 prefetch+async, DeepSpeed ZeRO-3, SimpleFSDP eager and compiled; bf16: FSDP2 bf16, "
    "DeepSpeed bf16), among those installed",
    "ratio_ddp": "median / DDP's median of the same configuration",
    "exposed_comm_ms": "median - the compute-only arm's median of the same configuration (exposed communication "
    "plus framework overhead)",
    "comm_alone_ms": "the arm's bytes x (time of the fs step's collectives alone, no compute, one at a time) / "
    "the fs step's bytes: the communication the arm cannot avoid on this mesh (fs: measured; others: scaled by bytes)",
    "overhead_ms": "median - compute only - comm_alone: framework overhead and contention, minus the communication "
    "hidden behind compute (negative: more hidden than the overhead costs)",
    "limit_ms": "physical limit of this machine for the fs step: compute only + comm alone when every core computes "
    "(2 ranks on 2 cores: gloo's copies time-share the cores), max(compute only, comm alone) with idle cores",
    "peak_bytes_per_rank": "torch.distributed._tools.mem_tracker.MemTracker peak ('Total') of one untimed "
    "step, the arm's long-lived state and the batch registered with track_external first",
    "all_gather_bytes / reduce_scatter_bytes / all_reduce_bytes": "bytes of the full (unsharded, padded) "
    "buffers per step; see each arm's bytes_source",
    "max_param_diff_rel": "after correctness_steps steps from the same initial weights: max |p_arm - p_ref| "
    "over every parameter element / max |p_ref| over every element; p_ref: one process (rank 0) training "
    "the same model with torch.optim.AdamW on the concatenation of every rank's batch",
    "activation_bytes": "MemTracker: tensor bytes alive after the forward pass (and loss) minus before, "
    "plain model, one rank's batch",
}


# --- statistics -------------------------------------------------------------------------------


def summarize(record: dict) -> dict:
    """Adds medians, spreads, ratios, exposed communication and peak memory to every arm of a
    configuration's record (in place) and returns it."""
    arms = record["arms"]
    for stats in arms.values():
        times = stats["times_s"]
        stats["median_ms"] = 1e3 * statistics.median(times)
        quartiles = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
        stats["q1_ms"], stats["q3_ms"] = 1e3 * quartiles[0], 1e3 * quartiles[2]
        stats["iqr_ms"] = stats["q3_ms"] - stats["q1_ms"]
        stats["peak_bytes"] = max(stats["peak_bytes_per_rank"])
    fsdp2_best = min((arms[name]["median_ms"] for name in FSDP2_ARMS if name in arms), default=None)
    peer_best = {
        precision: min((arms[name]["median_ms"] for name in names if name in arms), default=None)
        for precision, names in (("fp32", PEER_ARMS), ("bf16", BF16_PEER_ARMS))
    }
    ddp = arms[DDP]["median_ms"] if DDP in arms else None
    compute = arms[COMPUTE]["median_ms"] if COMPUTE in arms else None
    comm = record.get("comm_alone")
    for name, stats in arms.items():
        if comm is not None and compute is not None:
            moved = stats["all_gather_bytes"] + stats["reduce_scatter_bytes"] + 2 * stats["all_reduce_bytes"]
            stats["comm_alone_ms"] = comm["median_ms"] * moved / comm["bytes"]
            stats["overhead_ms"] = stats["median_ms"] - compute - stats["comm_alone_ms"]
        stats["ratio_fsdp2_best"] = stats["median_ms"] / fsdp2_best if fsdp2_best else None
        best = peer_best["bf16" if name in BF16_ARMS else "fp32"]
        stats["ratio_peer_best"] = stats["median_ms"] / best if best else None
        stats["ratio_ddp"] = stats["median_ms"] / ddp if ddp else None
        stats["exposed_comm_ms"] = stats["median_ms"] - compute if compute is not None else None
    record["memory_model_bytes"] = memory_model(record)
    if comm is not None and compute is not None:
        fs_comm = arms[FS_DEFAULT]["comm_alone_ms"]
        record["limit_ms"] = {"cores_busy": compute + fs_comm, "idle_cores": max(compute, fs_comm)}
    return record


def memory_model(record: dict) -> int:
    """16Ψ/N (parameter, gradient and two AdamW moments, fp32, per rank) + (prefetch + 2) x the
    largest unit's full buffer (units alive at once) + activations."""
    layout = record["fs_layout"]
    return 16 * layout["shard_numel"] + (record["fs_prefetch"] + 2) * layout["largest_unit_bytes"] + record["activation_bytes"]


# --- targets ----------------------------------------------------------------------------------


def targets(records: list[dict]) -> list[dict]:
    """The figures the project reports against, each met or missed; computed, never assumed."""
    out: list[dict] = []
    for r in records:
        arms = r["arms"]
        fs = arms[FS_DEFAULT]
        where = f"{r['model']} ws {r['world_size']} batch {r['batch_size']}"
        if r["world_size"] == 1 and COMPUTE in arms:
            out.append(_target("ws 1: fs step time <= 1.03 x plain torch (compute only)", where,
                               fs["median_ms"] / arms[COMPUTE]["median_ms"], 1.03, "x"))
        for mine, peers, precision in ((FS_DEFAULT, PEER_ARMS, "fp32"), (FS_BF16, BF16_PEER_ARMS, "bf16")):
            present = [n for n in peers if n in arms]
            if mine not in arms or not present:
                continue
            names = ", ".join(present)
            if r["model"] == "gpt" and r["world_size"] == 2:
                out.append(_target(f"{mine} step time <= 0.75 x the fastest sharded {precision} peer", where,
                                   arms[mine]["ratio_peer_best"], 0.75, "x", detail=f"peers: {names}"))
            best_peak = min(arms[n]["peak_bytes"] for n in present)
            out.append(_target(f"{mine} peak memory per rank <= every sharded {precision} peer's", where,
                               arms[mine]["peak_bytes"] / MIB, best_peak / MIB, "MiB", detail=f"peers: {names}"))
        if r["model"] == "gpt" and r["world_size"] == 2 and DDP in arms and r["batch_size"] >= 4:
            out.append(_target("fs step time <= 1.10 x DDP", where, fs["ratio_ddp"], 1.10, "x"))
        model = r["memory_model_bytes"]
        # Read as a bound: at most 10% above the model. Below it is better, and expected: the
        # peak comes before the gradient shards (4Ψ/N of the 16Ψ/N) exist. The signed
        # deviation is reported either way.
        deviation = (fs["peak_bytes"] - model) / model
        out.append(_target(
            "fs peak memory <= 1.10 x (16Ψ/N + (prefetch+2) x largest unit + activations)", where, deviation, 0.10,
            "signed rel. deviation", detail=f"measured {fs['peak_bytes'] / MIB:.1f} MiB, model {model / MIB:.1f} MiB",
        ))
        out.extend(_bytes_targets(r, where))
        if "max_param_diff_rel" in fs and fsdp2_have_diffs(arms):
            best = min(arms[n]["max_param_diff_rel"] for n in FSDP2_ARMS if n in arms)
            out.append(_target(f"fs params after {r['correctness_steps']} steps no further from single-process than FSDP2's",
                               where, fs["max_param_diff_rel"], best, "rel. max abs diff", tolerance=0.0))
    return out


def fsdp2_have_diffs(arms: dict) -> bool:
    present = [n for n in FSDP2_ARMS if n in arms]
    return bool(present) and all("max_param_diff_rel" in arms[n] for n in present)


def _bytes_targets(r: dict, where: str) -> list[dict]:
    """fs moves Ψ (all-gathers in forward) + at most Ψ (all-gathers in backward: the units the
    backward reads, which an embedding or an input projection is not) + Ψ (reduce-scatter)
    full-buffer elements per step with resharding, Ψ + Ψ without, each in its dtype: fp32
    (4 bytes) for the fp32 arms; for `fs bf16` the all-gathers move bf16 (2 bytes) and the
    reduce-scatter fp32 (the reduce dtype). Exact (without resharding) or an upper bound (with),
    up to the flat buffers' padding. At world size 1 every collective is the identity and the
    traced step runs none: the target there is 0 bytes."""
    out = []
    psi = r["psi"]
    if r["world_size"] == 1:
        for name in (FS_DEFAULT, FS_KEEP, FS_BF16):
            if name in r["arms"]:
                moved = r["arms"][name]["all_gather_bytes"] + r["arms"][name]["reduce_scatter_bytes"]
                out.append(_target(f"{name}: no all-gather or reduce-scatter at world size 1", where, moved, 0, "B", detail=f"{moved} B"))
        return out
    pad = (r["fs_layout"]["padded_bytes"] // 4) - psi  # padding elements per full copy
    for name, gathers, gather_size, formula in (
        (FS_DEFAULT, 2, 4, "3Ψ×4"), (FS_KEEP, 1, 4, "2Ψ×4"), (FS_BF16, 2, 2, "2Ψ×2 + Ψ×4"),
    ):
        if name not in r["arms"]:
            continue
        arm = r["arms"][name]
        moved = arm["all_gather_bytes"] + arm["reduce_scatter_bytes"]
        exact = gathers * psi * gather_size + psi * 4
        padding = gathers * pad * gather_size + pad * 4
        at_least = psi * gather_size + psi * 4  # one all-gather of every unit, one reduce-scatter
        met = (at_least if gathers > 1 else exact) <= moved <= exact + padding
        relation = "≤" if gathers > 1 else "="
        out.append({
            "target": f"{name}: all-gather + reduce-scatter bytes {relation} {formula} (+ padding)",
            "config": where,
            "value": moved / exact,
            "limit": 1.0,
            "unit": f"x {formula}",
            "met": bool(met),
            "detail": f"{moved} B vs {formula} = {exact} B (padding at most {padding} B)",
        })
    return out


def _target(name: str, where: str, value: float, limit: float, unit: str, *, detail: str = "", tolerance: float = 0.0) -> dict:
    return {"target": name, "config": where, "value": value, "limit": limit, "unit": unit,
            "met": bool(value <= limit + tolerance), "detail": detail}


# --- machine ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import torch

    import functional_shard

    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "functional_shard": functional_shard.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def machine_line() -> str:
    """The machine in one line, for a benchmark's printout: CPU, cores, load, torch, Python, commit."""
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    commit = _git("rev-parse", "--short=10", "HEAD")
    return (f"{_cpu_model()}, {os.cpu_count()} cores, load average {load:.2f} at the start; torch {torch.__version__}, "
            f"Python {platform.python_version()}, functional_shard commit {commit or '?'}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# --- markdown ---------------------------------------------------------------------------------


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / MIB:.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def render_tables(result: dict, heading: str = "###") -> str:
    """One table per model and world size: every batch size, every arm."""
    lines = []
    records = result["records"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["world_size"]), []).append(r)
    for (model, world_size), group in groups.items():
        r0 = group[0]
        lines.append(f"{heading} {model.upper()}, world size {world_size} (Ψ = {r0['psi']:,} parameters)")
        lines.append("")
        lines.append(
            "| batch/rank | arm | median ms | IQR ms | × best peer | × DDP | beyond compute ms | comm alone ms "
            "| overhead ms | peak MiB/rank | all-gather MiB | reduce-scatter MiB | all-reduce MiB | max param diff (rel) |"
        )
        lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(group, key=lambda r: r["batch_size"]):
            for name in [n for n in ARMS if n in r["arms"]]:
                a = r["arms"][name]
                lines.append(
                    f"| {r['batch_size']} | {name} | {a['median_ms']:.1f} | {a['iqr_ms']:.1f} "
                    f"| {_num(a.get('ratio_peer_best'), '.2f')} | {_num(a['ratio_ddp'], '.2f')} "
                    f"| {_num(a['exposed_comm_ms'], '.1f')} | {_num(a.get('comm_alone_ms'), '.1f')} "
                    f"| {_num(a.get('overhead_ms'), '.1f')} | {_mib(a['peak_bytes'])} "
                    f"| {_mib(a['all_gather_bytes'])} | {_mib(a['reduce_scatter_bytes'])} | {_mib(a['all_reduce_bytes'])} "
                    f"| {_num(a.get('max_param_diff_rel'), '.2e')} |"
                )
        for r in sorted(group, key=lambda r: r["batch_size"]):
            if "limit_ms" in r:
                lim = r["limit_ms"]
                lines.append(
                    f"Batch {r['batch_size']}: physical limit of the fs step on this machine = compute + comm alone = "
                    f"{lim['cores_busy']:.1f} ms (every core computes; with idle cores max(compute, comm alone) = "
                    f"{lim['idle_cores']:.1f} ms); fs {r['arms'][FS_DEFAULT]['median_ms']:.1f} ms."
                )
        skipped = {name: why for r in group for name, why in r.get("skipped", {}).items()}
        for name, why in skipped.items():
            lines.append(f"Skipped `{name}`: {why}.")
        lines.append("")
    return "\n".join(lines)


def render_targets(result: dict, heading: str = "###") -> str:
    lines = [f"{heading} Targets", "", "| target | configuration | value | limit | met |", "|---|---|---:|---:|---|"]
    for t in result["targets"]:
        value = f"{t['value']:.3g} {t['unit']}"
        detail = f" ({t['detail']})" if t.get("detail") else ""
        lines.append(f"| {t['target']} | {t['config']} | {value}{detail} | {t['limit']:.3g} | {'met' if t['met'] else 'MISSED'} |")
    met = sum(t["met"] for t in result["targets"])
    lines += ["", f"{met} of {len(result['targets'])} targets met."]
    return "\n".join(lines)


def render_header(result: dict) -> str:
    m, c = result["machine"], result["config"]
    return "\n".join([
        f"Run `{result['name']}`: `{result['command']}`, {result['elapsed_s'] / 60:.1f} min.",
        f"Machine: {m['cpu_model']}, {m['cores']} cores; torch {m['torch']}, functional_shard {m['functional_shard']} "
        f"(commit {m['git_commit'][:10] or 'unknown'}{', dirty' if m['git_dirty'] else ''}), Python {m['python']}.",
        f"World sizes {c['world_sizes']}, gloo, 1 thread per rank; {c['steps']} timed steps per arm after {c['warmup']} untimed; "
        f"correctness after {c['correctness_steps']} steps; AdamW lr {c['hyper']['lr']}, weight decay "
        f"{c['hyper']['weight_decay']}; fs donate={result['fs_donate']}; FSDP2 prefetch depth {c['fsdp2_prefetch_depth']}.",
        *_run_lines(result),
    ])


def _run_lines(result: dict) -> list[str]:
    """For a merged result whose runs differ in steps or commit: what each run was."""
    runs = result.get("runs", [])
    keys = ("steps", "warmup", "correctness_steps", "commit")
    if len({tuple(r[k] for k in keys) for r in runs}) <= 1:
        return []
    return ["Runs:"] + [
        f"- `{r['command']}` (world sizes {r['world_sizes']}): {r['steps']} timed steps per arm after {r['warmup']} "
        f"untimed, correctness after {r['correctness_steps']}; commit {r['commit'][:10]}; {r['elapsed_s'] / 60:.1f} min."
        for r in runs
    ]


def render_markdown(result: dict) -> str:
    return "\n\n".join([
        f"# Benchmark {result['name']}", render_header(result), render_tables(result, "##"),
        render_targets(result, "##"), "![step time and peak memory](results.png)", "",
    ])


# --- chart ------------------------------------------------------------------------------------


def render_chart(result: dict, path: Path) -> None:
    """Step time (log scale) and peak memory per rank, per arm, for every model, world size and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    records = result["records"]
    models = list(dict.fromkeys(r["model"] for r in records))
    fig, axes = plt.subplots(len(models), 2, figsize=(15, 4.2 * len(models)), squeeze=False)
    # One color per arm, the same in every panel (a model may run a subset of the arms).
    palette = plt.get_cmap("tab20").colors
    color_of = {name: palette[k % len(palette)] for k, name in enumerate(ARMS)}
    legend: dict = {}
    for row, model in enumerate(models):
        group = sorted((r for r in records if r["model"] == model), key=lambda r: (r["world_size"], r["batch_size"]))
        names = [n for n in ARMS if n in group[0]["arms"]]
        width = 0.8 / len(names)
        labels = [f"ws {r['world_size']}\nbatch {r['batch_size']}" for r in group]
        for col, (key, scale, ylabel) in enumerate(
            (("median_ms", 1.0, "median step time (ms, log)"), ("peak_bytes", 1 / MIB, "peak memory per rank (MiB)"))
        ):
            ax = axes[row][col]
            for k, name in enumerate(names):
                xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(group))]
                ys = [r["arms"][name][key] * scale for r in group]
                errors = None
                if key == "median_ms":  # whiskers: the interquartile range
                    errors = [
                        [r["arms"][name]["median_ms"] - r["arms"][name]["q1_ms"] for r in group],
                        [r["arms"][name]["q3_ms"] - r["arms"][name]["median_ms"] for r in group],
                    ]
                bars = ax.bar(xs, ys, width, label=name, color=color_of[name], yerr=errors, capsize=1.5)
                legend.setdefault(name, bars)
            ax.set_xticks(range(len(group)), labels)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model.upper()}: {ylabel.split(' (')[0]}")
            if key == "median_ms":
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(axis="y", alpha=0.3)
    names = [n for n in ARMS if n in legend]
    fig.legend([legend[n] for n in names], names, loc="upper center", ncol=min(len(names), 7), fontsize=9,
               bbox_to_anchor=(0.5, 0.965))
    fig.suptitle(f"fs and its peers on {result['machine']['cpu_model']} ({result['machine']['cores']} cores), gloo; "
                 f"whiskers: interquartile range", y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.90))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- files ------------------------------------------------------------------------------------


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "chart": out / "results.png"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["markdown"].write_text(render_markdown(result))
    render_chart(result, paths["chart"])
    return paths


DOCS_BEGIN = "<!-- BEGIN LATEST RESULTS (benchmarks/compare.py --docs-from DIR rewrites this part) -->"
DOCS_END = "<!-- END LATEST RESULTS -->"


def write_docs(result_dir: Path, docs: Path, chart: Path) -> None:
    """Put the run in `result_dir` into the docs: its tables and targets between the markers of
    `docs`, its chart as `chart`."""
    result = json.loads((result_dir / "results.json").read_text())
    text = docs.read_text()
    start, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f"{docs} lacks the markers {DOCS_BEGIN!r} ... {DOCS_END!r}")
    body = "\n\n".join([
        render_header(result), render_tables(result), render_targets(result),
        f"![step time and peak memory per arm]({chart.name})",
    ])
    docs.write_text(text[: start + len(DOCS_BEGIN)] + "\n\n" + body + "\n\n" + text[end:])
    shutil.copyfile(result_dir / "results.png", chart)
