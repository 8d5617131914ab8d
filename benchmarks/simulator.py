"""Predicted vs measured: the simulator's step time and peak memory against real steps.

    python benchmarks/simulator.py              # MLP, GPT, HF Llama x 4 schedules x world sizes 2, 4
    python benchmarks/simulator.py --quick      # MLP, one schedule, world size 2 (what the test runs)
    python benchmarks/simulator.py --plan       # Llama-7B planned on 8, 64, 1024 ranks (no run)
    python benchmarks/simulator.py --timeline   # one GPT step at world size 2: measured and predicted Gantt charts

For each world size the machine is calibrated once (`fs.analysis.calibrate`), then every
(model, schedule) is traced (`step.lower`), simulated, and measured separately: the median
wall time of `--steps` steps (each the slowest rank's, after a warm-up step; the schedules of
a model interleaved, one step each per round, so that they see the same load), and the peak
of one more step under `MemTracker` (state and batch tracked as external memory, as in
`compare.py`). Ranks are processes on this machine's cores (gloo), one thread each; the
machine may be shared, so timings carry its noise: the table reports the spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpt import cpu_total  # noqa: E402

SCHEDULES = {
    "default": fs.Schedule(),
    "prefetch 0": fs.Schedule(prefetch=0),
    "no reshard": fs.Schedule(reshard_after_forward=False),
    "prefetch 2": fs.Schedule(prefetch=2),
    "compile": fs.Schedule(compile=True),  # priced fused (analysis/_fusion.py); not in the default list
}
DEFAULT_SCHEDULES = ("default", "prefetch 0", "no reshard", "prefetch 2")
BATCH = {"mlp": 16, "gpt": 4, "llama": 4}


def _llama_config(**overrides):
    from transformers import LlamaConfig

    shape = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 vocab_size=256, max_position_embeddings=128)
    shape.update(overrides)
    return LlamaConfig(**shape, attn_implementation="eager")


def _llama_loss(apply_fn):
    def loss_fn(p, batch):
        ids, labels = batch
        # An explicit mask and no cache: transformers then reads no tensor's value while tracing.
        logits = apply_fn(p, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    return loss_fn


def build(model: str, rank: int):
    """(loss_fn, params, batch) of `model` for `rank`."""
    torch.manual_seed(0)
    if model == "llama":
        from transformers import LlamaForCausalLM

        apply_fn, params = fs.functionalize(LlamaForCausalLM(_llama_config()))
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 256, (BATCH[model], 64), generator=g)
        return _llama_loss(apply_fn), params, (ids, torch.roll(ids, -1, 1))
    from _workloads import Workload

    workload = Workload(model)
    apply_fn, params = fs.functionalize(workload.build(0))

    def loss_fn(p, batch):
        return workload.loss(apply_fn(p, batch[0]), batch[1])

    return loss_fn, params, workload.batch(BATCH[model], seed=0, rank=rank, step=0)


def run_world(mesh, models: list[str], schedules: list[str], steps: int, quick: bool) -> list[dict]:
    """Every rank: calibrate once, then predict and measure every (model, schedule)."""
    torch.set_num_threads(1)
    start = time.perf_counter()
    machine = fs.analysis.calibrate(mesh, quick=quick)
    calibration_s = time.perf_counter() - start
    rows = []
    for model in models:
        loss_fn, params, batch = build(model, mesh.rank)
        steps_of, states, simulations, times = {}, {}, {}, {}
        for name in schedules:
            step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), schedule=SCHEDULES[name])
            state = step.init(params)
            state, _ = step(state, batch)  # traces; the warm-up
            simulations[name] = fs.analysis.simulate(step.lower(state, batch), machine)
            steps_of[name], states[name], times[name] = step, state, []
        # Schedules interleaved, one step each per round: the machine's load drifts, and each
        # schedule then sees the same drift.
        for _ in range(steps):
            for name in schedules:
                mesh.all_reduce_flat(torch.zeros(1))
                t0 = time.perf_counter()
                states[name], _ = steps_of[name](states[name], batch)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                times[name].append(float(mesh.all_gather_world(elapsed).max()))
        for name in schedules:
            if SCHEDULES[name].compile:  # MemTracker's dispatch mode cannot run under torch.compile
                measured_peak = float("nan")
                rows.append(dict(model=model, schedule=name, world=mesh.world_size, predicted_s=simulations[name].step_s,
                                 measured_s=statistics.median(times[name]), measured_min_s=min(times[name]),
                                 measured_max_s=max(times[name]), exposed_s=simulations[name].exposed_s,
                                 predicted_peak=simulations[name].memory.peak, measured_peak=measured_peak,
                                 calibration_s=calibration_s))
                continue
            tracker = MemTracker()
            tracker.track_external(*fs.tree_leaves(states[name]), *batch)
            mesh.all_reduce_flat(torch.zeros(1))
            with tracker:
                states[name], _ = steps_of[name](states[name], batch)
            measured_peak = max(mesh.all_gather_world(torch.tensor([cpu_total(tracker)])).tolist())
            simulation = simulations[name]
            rows.append(
                dict(
                    model=model,
                    schedule=name,
                    world=mesh.world_size,
                    predicted_s=simulation.step_s,
                    measured_s=statistics.median(times[name]),
                    measured_min_s=min(times[name]),
                    measured_max_s=max(times[name]),
                    exposed_s=simulation.exposed_s,
                    predicted_peak=simulation.memory.peak,
                    measured_peak=measured_peak,
                    calibration_s=calibration_s,
                )
            )
    return rows if mesh.rank == 0 else []


def table(rows: list[dict]) -> str:
    head = ("model", "schedule", "ranks", "predicted ms", "measured ms (min-max)", "time err", "predicted MiB", "measured MiB", "mem err")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(
            " | ".join(
                (
                    r["model"],
                    r["schedule"],
                    str(r["world"]),
                    f"{r['predicted_s'] * 1e3:.1f}",
                    f"{r['measured_s'] * 1e3:.1f} ({r['measured_min_s'] * 1e3:.0f}-{r['measured_max_s'] * 1e3:.0f})",
                    f"{(r['predicted_s'] / r['measured_s'] - 1) * 100:+.0f}%",
                    f"{r['predicted_peak'] / 2**20:.2f}",
                    f"{r['measured_peak'] / 2**20:.2f}",
                    f"{(r['predicted_peak'] / r['measured_peak'] - 1) * 100:+.1f}%",
                )
            )
        )
    return "\n".join(lines)


def timeline(mesh, out_dir: str) -> dict:
    """Every rank: profile one traced GPT step (default schedule) and simulate it; rank 0 writes
    the measured Chrome trace and Gantt chart and the predicted Gantt chart to `out_dir`."""
    torch.set_num_threads(1)
    machine = fs.analysis.calibrate(mesh)
    loss_fn, params, batch = build("gpt", mesh.rank)
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3))
    state, _ = step(step.init(params), batch)
    measured = fs.analysis.profile(step, state, batch)
    predicted = fs.analysis.simulate(step.lower(state, batch), machine)
    if mesh.rank == 0:
        fs.analysis.save_chrome_trace(measured, os.path.join(out_dir, "gpt_step_trace.json"))
        fs.analysis.plot_gantt(measured, os.path.join(out_dir, "simulator_gantt.png"),
                               title=f"GPT step, 2 ranks, measured: {measured.plain_step_s * 1e3:.0f} ms "
                                     f"(with marks {measured.marked_step_s * 1e3:.0f} ms, overhead {measured.overhead * 100:+.1f}%)")
        fs.analysis.plot_gantt(predicted.as_profile(), os.path.join(out_dir, "simulator_predicted_gantt.png"),
                               title=f"GPT step, one rank, predicted: {predicted.step_s * 1e3:.0f} ms")
    return dict(plain_s=measured.plain_step_s, marked_s=measured.marked_step_s, overhead=measured.overhead,
                marks=measured.marks, predicted_s=predicted.step_s)


def plan_7b(world_sizes=(8, 64, 1024), *, sequence: int = 2048, device_bytes: int = 80 * 10**9) -> list[dict]:
    """Llama-7B (32 layers, d 4096, bf16, AdamW) planned on abstract meshes: no allocation."""
    from transformers import LlamaForCausalLM

    config = _llama_config(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    apply_fn, params = fs.functionalize(model)
    ids = torch.empty(1, sequence, dtype=torch.long, device="meta")
    rows = []
    for world in world_sizes:
        start = time.perf_counter()
        analysis, compiled = fs.analysis.plan(
            _llama_loss(apply_fn), params, (ids, ids), mesh=fs.analysis.AbstractMesh({"fsdp": world}), optimizer=fs.optim.adamw(lr=1e-4)
        )
        planning_s = time.perf_counter() - start
        simulation = fs.analysis.simulate(compiled, fs.analysis.h100_sxm(world_size=world))
        rows.append(dict(world=world, planning_s=planning_s, analysis=analysis, h100_step_s=simulation.step_s,
                         h100_exposed_s=simulation.exposed_s, fits=analysis.fits(device_bytes)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs"),
                        help="where --timeline writes its charts (default docs/)")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--models", default="mlp,gpt,llama")
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES), help=f"comma list of {list(SCHEDULES)}")
    args = parser.parse_args()
    if args.plan:
        for r in plan_7b():
            a = r["analysis"]
            print(f"Llama-7B on {r['world']} ranks: planned in {r['planning_s']:.1f} s; {a.summary()}")
            print(f"  fits 80 GB: {r['fits']}; H100 SXM (public specs) predicted step {r['h100_step_s']:.2f} s, "
                  f"exposed communication {r['h100_exposed_s']:.3f} s")
        return
    if args.timeline:
        with fs.testing.LocalWorld(2, call_timeout=1800.0) as local:
            r = local.run(timeline, args.out)[0]
        print(f"GPT step at 2 ranks: {r['plain_s'] * 1e3:.1f} ms plain, {r['marked_s'] * 1e3:.1f} ms with {r['marks']} marks "
              f"(overhead {r['overhead'] * 100:+.1f}%), predicted {r['predicted_s'] * 1e3:.1f} ms; charts in {args.out}")
        return
    models = ["mlp"] if args.quick else args.models.split(",")
    schedules = ["default"] if args.quick else args.schedules.split(",")
    worlds = [2] if args.quick else [int(w) for w in args.worlds.split(",")]
    rows = []
    load_before = os.getloadavg()[0]
    for world in worlds:
        with fs.testing.LocalWorld(world, call_timeout=1800.0) as local:
            rows += local.run(run_world, models, schedules, 2 if args.quick else args.steps, args.quick)[0]
    print(table(rows))
    errors_t = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rows]
    errors_m = [abs(r["predicted_peak"] / r["measured_peak"] - 1) for r in rows if r["measured_peak"] == r["measured_peak"]] or [0.0]
    print(f"\ntime: {sum(e <= 0.15 for e in errors_t)}/{len(rows)} within 15% (median error {statistics.median(errors_t) * 100:.0f}%); "
          f"memory: {sum(e <= 0.10 for e in errors_m)}/{len(rows)} within 10% (max error {max(errors_m) * 100:.1f}%); "
          f"calibration {rows[0]['calibration_s']:.1f} s per world size; load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
