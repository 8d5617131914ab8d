"""What every rank runs: for each model and batch size, build every arm from the same initial
weights and put them through three phases on the same batches.

1. correctness (smallest batch size of each model only): `correctness_steps` steps, then each
   arm's full parameters against single-process training on the concatenated batch (rank 0);
2. timing: `warmup + steps` steps, interleaved step by step across the arms (the order rotates
   every step, so that no arm always follows the same one), each arm's step time the slowest
   rank's wall time;
3. memory: one more, untimed step per arm under `MemTracker`, the same tool for every arm.

The raw figures go back to the parent (rank 0's return value); `_report.py` turns them into
statistics, tables and targets.
"""

from __future__ import annotations

import copy
import gc
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs

from _arms import (
    ARMS,
    COMPUTE,
    FS_DEFAULT,
    FS_DONATE,
    FS_SCHEDULES,
    FSDP2_PREFETCH_DEPTH,
    Arm,
    FsArm,
    Fsdp2Arm,
    Hyper,
    make_arm,
    missing,
)
from _workloads import Workload, num_params


@dataclass(frozen=True)
class Plan:
    """Everything a run does; identical on every rank, and recorded in the JSON."""

    batch_sizes: tuple[tuple[str, tuple[int, ...]], ...]  # (model, per-rank batch sizes), in run order
    steps: int = 20
    warmup: int = 3
    correctness_steps: int = 10
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    hyper: Hyper = field(default_factory=Hyper)

    def __post_init__(self) -> None:
        unknown = set(self.arms) - set(ARMS)
        if unknown or FS_DEFAULT not in self.arms:
            raise ValueError(f"arms must be among {ARMS} and include {FS_DEFAULT!r}; got {self.arms}")
        # At least one warm-up: an arm's first step traces (fs) or initializes lazily (FSDP2).
        if self.steps < 1 or self.warmup < 1 or self.correctness_steps < 0:
            raise ValueError(f"need steps >= 1, warmup >= 1, correctness_steps >= 0; got {self}")


def run_world(plan: Plan, world_size: int) -> list[dict]:
    """The body of one `fs.launch`: every configuration of `plan` at this world size."""
    # Ranks share the machine's cores: one thread each, so that they do not fight over them.
    torch.set_num_threads(1)
    mesh = fs.init_mesh({"fsdp": world_size})
    records = []
    for model_name, batch_sizes in plan.batch_sizes:
        for batch_size in batch_sizes:
            correctness = batch_size == min(batch_sizes) and plan.correctness_steps > 0
            records.append(_run_config(mesh, Workload(model_name), batch_size, plan, correctness))
            gc.collect()
    return records


def _log(mesh, message: str) -> None:
    if mesh.rank == 0:
        print(f"[{time.strftime('%H:%M:%S')} ws {mesh.world_size}] {message}", file=sys.stderr, flush=True)


def _run_config(mesh, workload: Workload, batch_size: int, plan: Plan, correctness: bool) -> dict:
    base = workload.build(plan.seed)
    # An arm whose peer library is not installed is skipped, with the reason in the record.
    skipped = {name: why for name in plan.arms if (why := missing(name)) is not None}
    arms = [make_arm(name, base, workload, mesh, plan.hyper, batch_size=batch_size) for name in plan.arms if name not in skipped]
    label = f"{workload.name} batch {batch_size}"
    record: dict = {
        "model": workload.name,
        "batch_size": batch_size,
        "world_size": mesh.world_size,
        "psi": num_params(base),
        "fs_donate": FS_DONATE,
        "fsdp2_prefetch_depth": FSDP2_PREFETCH_DEPTH,
        "fs_prefetch": FS_SCHEDULES[FS_DEFAULT].prefetch,
        "correctness_steps": plan.correctness_steps if correctness else 0,
        "arms": {arm.name: {} for arm in arms},
        "skipped": skipped,
    }
    for arm in arms:
        if isinstance(arm, Fsdp2Arm):
            record["arms"][arm.name]["fsdp2_async_unshard"] = arm.async_unshard
        if isinstance(arm, FsArm):
            record["arms"][arm.name]["schedule"] = repr(arm.step_fn.schedule)
    step = 0
    if correctness:
        _log(mesh, f"{label}: correctness, {plan.correctness_steps} steps")
        for name, diff in _correctness(mesh, arms, workload, base, batch_size, plan).items():
            record["arms"][name].update(diff)
        step = plan.correctness_steps
    _log(mesh, f"{label}: timing, {plan.warmup} warm-up + {plan.steps} steps x {len(arms)} arms")
    for name, times in _time(mesh, arms, workload, batch_size, plan, first_step=step).items():
        record["arms"][name]["times_s"] = times
    step += plan.warmup + plan.steps
    _log(mesh, f"{label}: memory")
    batch = workload.batch(batch_size, seed=plan.seed, rank=mesh.rank, step=step)
    for arm in arms:
        record["arms"][arm.name].update(_memory(mesh, arm, batch))
        record["arms"][arm.name].update(arm.comm_bytes())
    fs_arm = next(a for a in arms if a.name == FS_DEFAULT)
    record["fs_layout"] = fs_arm.layout_figures()
    _log(mesh, f"{label}: communication alone")
    record["comm_alone"] = _comm_alone(mesh, fs_arm)
    record["activation_bytes"] = _activation_bytes(base, workload, batch)
    return record


# --- phase 1: correctness ---------------------------------------------------------------------


def _correctness(mesh, arms: list[Arm], workload: Workload, base, batch_size: int, plan: Plan) -> dict[str, dict]:
    """Each arm (but compute only) after `correctness_steps` steps from the initial weights,
    against single-process training on the concatenation of every rank's batch."""
    trained = [arm for arm in arms if arm.name != COMPUTE]
    for step in range(plan.correctness_steps):
        batch = workload.batch(batch_size, seed=plan.seed, rank=mesh.rank, step=step)
        for arm in trained:
            arm.step(batch)
    full = {arm.name: arm.full_params() for arm in trained}  # collectives: every rank, same order
    diffs: dict[str, dict] = {}
    if mesh.rank == 0:
        reference = _single_process(workload, base, batch_size, plan, mesh.world_size)
        scale = max(float(p.abs().max()) for p in reference.values())
        for name, params in full.items():
            worst = max(float((params[key] - p).abs().max()) for key, p in reference.items())
            diffs[name] = {"max_param_diff_abs": worst, "max_param_diff_rel": worst / scale}
    # The other ranks wait here while rank 0 trains the reference.
    mesh.all_reduce_flat(torch.zeros(1))
    return diffs


def _single_process(workload: Workload, base, batch_size: int, plan: Plan, world_size: int) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(base)
    optimizer = plan.hyper.torch_adamw(model.parameters())
    for step in range(plan.correctness_steps):
        parts = [workload.batch(batch_size, seed=plan.seed, rank=r, step=step) for r in range(world_size)]
        inputs, targets = (torch.cat(tensors) for tensors in zip(*parts))
        workload.loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach() for name, p in model.named_parameters()}


# --- phase 2: timing --------------------------------------------------------------------------


def _time(mesh, arms: list[Arm], workload: Workload, batch_size: int, plan: Plan, first_step: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {arm.name: [] for arm in arms}
    for i in range(plan.warmup + plan.steps):
        batch = workload.batch(batch_size, seed=plan.seed, rank=mesh.rank, step=first_step + i)
        shift = i % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            elapsed = _timed_step(mesh, arm, batch)
            if i >= plan.warmup:
                times[arm.name].append(elapsed)
        if mesh.rank == 0 and (i + 1) % 5 == 0:
            _log(mesh, f"  step {i + 1}/{plan.warmup + plan.steps}")
    return times


def _timed_step(mesh, arm: Arm, batch) -> float:
    """One step of `arm`; its time is the slowest rank's (a step ends when every rank is done)."""
    mesh.all_reduce_flat(torch.zeros(1))  # start together
    start = time.perf_counter()
    arm.step(batch)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    return float(mesh.all_gather_world(elapsed).max())


def _comm_alone(mesh, arm: FsArm, repeats: int = 5) -> dict:
    """The fs default step's collectives with no computation around them: for every trainable
    unit buffer, in unit order, an all-gather (forward), an all-gather (backward) and a
    reduce-scatter of its full size, each waited before the next; the median over `repeats`
    of the slowest rank's time. The communication a step cannot avoid on this mesh."""
    buffers = [b for b in arm.state.params.layout.buffers if b.trainable]
    shards = [torch.zeros(b.shard_numel, dtype=b.dtype) for b in buffers]
    fulls = [torch.zeros(b.shard_numel * mesh.num_shards, dtype=b.dtype) for b in buffers]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        mesh.all_reduce_flat(torch.zeros(1))
        start = time.perf_counter()
        for shard in shards:
            mesh.all_gather_flat(shard)
        for shard, full in zip(reversed(shards), reversed(fulls)):
            mesh.all_gather_flat(shard)
            mesh.reduce_scatter_flat(full)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        times.append(float(mesh.all_gather_world(elapsed).max()))
    moved = sum(f.numel() * f.element_size() for f in fulls)
    return {"median_ms": 1e3 * sorted(times[1:])[len(times[1:]) // 2], "bytes": 3 * moved}


# --- phase 3: memory --------------------------------------------------------------------------


def _memory(mesh, arm: Arm, batch) -> dict:
    """Peak tensor memory of one untimed step of `arm`, per rank, by `MemTracker`.

    The tracker is told about the arm's long-lived state (parameters, optimizer state) and the
    batch before the step; everything the step allocates it sees through dispatch. The FSDP2
    arms also count their collectives' bytes on this step."""
    tracker = MemTracker()
    tracker.track_external(*arm.memory_roots(), *batch)
    mesh.all_reduce_flat(torch.zeros(1))
    with tracker:
        if isinstance(arm, Fsdp2Arm):
            arm.counted_step(batch)
        else:
            arm.step(batch)
    snapshot = _cpu_snapshot(tracker.get_tracker_snapshot("peak"))
    peaks = mesh.all_gather_world(torch.tensor([snapshot.get("Total", 0)], dtype=torch.int64)).tolist()
    return {"peak_bytes_per_rank": peaks, "peak_breakdown_rank0": snapshot}


def _cpu_snapshot(snapshot: dict) -> dict[str, int]:
    for device, categories in snapshot.items():
        if torch.device(device).type == "cpu":
            return {str(getattr(k, "value", k)): int(v) for k, v in categories.items()}
    return {}


def _activation_bytes(model, workload: Workload, batch) -> int:
    """Bytes the forward pass keeps for the backward (and its output), measured by `MemTracker`
    on the plain model: the `activations` term of the memory model in the targets."""
    inputs, targets = batch
    tracker = MemTracker()
    tracker.track_external(model, inputs, targets)
    with tracker:
        before = _cpu_snapshot(tracker.get_tracker_snapshot("current")).get("Total", 0)
        loss = workload.loss(model(inputs), targets)
        after = _cpu_snapshot(tracker.get_tracker_snapshot("current")).get("Total", 0)
    del loss
    return after - before
