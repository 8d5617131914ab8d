"""Soak two collectives in flight: many traced two-rank steps, with a watchdog for hangs.

    python tools/soak_collectives.py --steps 20000            # the proof before a default changes
    python tools/soak_collectives.py --steps 2000 --in-flight 1

One `fs.launch` of `--world-size` ranks (gloo). Each rank traces one `fs.sharded_step` of a
small MLP with `--units` blocks under a mesh that allows `--in-flight` collectives at once, one
per process group (`Mesh` puts all-gathers and reduce-scatters on groups of their own), checks
that the schedule really has that many in flight (a unit's reduce-scatter overlapping the next
unit's all-gather), that its first steps are bit-identical to the eager reference, and then
runs `--steps` steps.

Watchdog: a thread per rank that, when no step has finished for `--hang-after` seconds, prints
every thread's stack (faulthandler) and the step it hung at, and ends the rank with exit code 3,
so a hang is reported, not waited for. Exits 0 when every rank finished every step.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time


def rank_main(steps: int, units: int, in_flight: int, hang_after: float, check_steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    import functional_shard as fs
    from functional_shard.models import MLP

    torch.set_num_threads(1)
    mesh = fs.init_mesh({"fsdp": int(os.environ["WORLD_SIZE"])}, timeout=max(60.0, 2 * hang_after), split_groups=True)
    mesh.max_collectives_in_flight = in_flight
    torch.manual_seed(0)
    apply_fn, params = fs.functionalize(MLP(32, 64, 8, n_blocks=units))

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x), y)

    def make(trace: bool):
        return fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=1e-3), schedule=fs.Schedule(trace=trace))

    generator = torch.Generator().manual_seed(mesh.rank)
    batches = [(torch.randn(8, 32, generator=generator), torch.randint(0, 8, (8,), generator=generator)) for _ in range(4)]

    # The schedule really overlaps, and stays bit-identical to the eager reference.
    traced, eager = make(True), make(False)
    state, reference = traced.init(params), eager.init(params)
    for i in range(check_steps):
        state, _ = traced(state, batches[i % len(batches)])
        reference, _ = eager(reference, batches[i % len(batches)])
    identical = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(state), fs.tree_leaves(reference)))
    events = traced.schedule_events
    overlap = fs.schedule.max_in_flight(events)

    progress = {"step": 0, "done": False}

    def watchdog() -> None:
        last, since = -1, time.monotonic()
        while not progress["done"]:
            time.sleep(1.0)
            if progress["step"] != last:
                last, since = progress["step"], time.monotonic()
            elif time.monotonic() - since > hang_after:
                print(f"[soak] rank {mesh.rank}: HANG: no step finished for {hang_after:.0f} s, at step "
                      f"{progress['step']} of {steps}; every thread's stack:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="soak-watchdog").start()
    start = time.perf_counter()
    for i in range(steps):
        state, metrics = traced(state, batches[i % len(batches)])
        progress["step"] = i + 1
        if mesh.rank == 0 and (i + 1) % max(1, steps // 10) == 0:
            print(f"[soak] {i + 1}/{steps} steps, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    progress["done"] = True
    return {
        "rank": mesh.rank,
        "steps": steps,
        "seconds": time.perf_counter() - start,
        "max_in_flight": overlap,
        "max_reduce_scatters_in_flight": fs.schedule.max_in_flight(events, "reduce_scatter"),
        "bit_identical_to_eager": identical,
        "loss": float(metrics["loss"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--units", type=int, default=4, help="MLP blocks (units), default 4")
    parser.add_argument("--in-flight", type=int, default=2, help="collectives in flight at once, one per group (default 2)")
    parser.add_argument("--hang-after", type=float, default=60.0, help="seconds without a finished step that count as a hang")
    parser.add_argument("--check-steps", type=int, default=5, help="steps compared bit for bit with the eager reference")
    args = parser.parse_args(argv)

    import functional_shard as fs

    started = time.perf_counter()
    try:
        result = fs.launch(
            rank_main, world_size=args.world_size,
            args=(args.steps, args.units, args.in_flight, args.hang_after, args.check_steps),
        )
    except Exception as error:  # a rank hung (watchdog exit 3) or failed
        print(f"[soak] FAILED after {time.perf_counter() - started:.0f} s: {error}", flush=True)
        return 1
    print(f"[soak] {args.steps} steps x {args.world_size} ranks, {args.in_flight} in flight (one per group): no hang; "
          f"{time.perf_counter() - started:.0f} s; rank 0: {result}", flush=True)
    ok = result["bit_identical_to_eager"] and result["max_in_flight"] == args.in_flight
    if not ok:
        print("[soak] FAILED: the schedule is not bit-identical to eager or does not overlap as asked", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
