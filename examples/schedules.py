"""A researcher's workflow with schedules: one model, four schedules, and a list of passes that
reorders and replaces the built-in ones and adds a custom pass.

    python examples/schedules.py              # 2 local CPU processes

Each schedule is printed with `step.explain()` (where each unit's all-gather is issued,
waited and freed, where each reduce-scatter is issued and waited, bytes per step, units
alive at once). Every schedule trains to the same bits as the eager reference: a schedule
moves collectives, never the computation.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig


def issue_gathers_in_reverse_up_front(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A custom pass: issue every forward all-gather at the very start, last unit first.

    Written with the same public tools as the built-in passes; it moves only collective
    issues, so the numbers cannot change (the graph checks that every value still comes
    after what it reads)."""
    start = next(n for n in gm.graph.nodes if n.op != "placeholder")
    gathers = [c for c in fs.schedule.collectives(gm) if c.kind == "all_gather" and c.phase == "forward"]
    fs.schedule.move_before([c.issue for c in reversed(gathers)], start)
    return gm


SCHEDULES = {
    "eager reference": fs.Schedule(trace=False),
    "on demand, keep parameters (ZeRO-2 like)": fs.Schedule(prefetch=0, reshard_after_forward=False),
    "prefetch 1, reshard after forward (ZeRO-3)": fs.Schedule(prefetch=1, reshard_after_forward=True),
    # `input` holds the embeddings and the tied head, `output` the final norm: the backward reads
    # both right after the forward, so resharding them would free them only to gather them again.
    "prefetch 2, reshard all but 'input' and 'output'": fs.Schedule(
        prefetch=2, reshard_after_forward={"input": False, "output": False}
    ),
    # A schedule is a list of pass values: reorder, replace or drop the built-in ones, add your own.
    # (`fs.Schedule(prefetch=0, extra_passes=(issue_gathers_in_reverse_up_front,))` would just add it.)
    "explicit pass list: keep 'input', custom pass, then buckets": fs.Schedule(
        passes=(
            fs.schedule.reshard_after_forward({"input": False}),
            fs.schedule.prefetch(0),
            issue_gathers_in_reverse_up_front,
            fs.schedule.bucket_gathers(1 << 19),  # about two blocks a bucket, in the new issue order
            fs.schedule.early_reduce_scatter(),
            fs.schedule.limit_in_flight(),  # the mesh's bound on collectives in flight (1 on gloo)
        )
    ),
}


def train(mesh, schedule: fs.Schedule, steps: int):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, d_model=64))
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten())

    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr=3e-3), schedule=schedule)
    state = step.init(params)
    generator = torch.Generator().manual_seed(mesh.rank)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 32), generator=generator)
        state, metrics = step(state, (x, torch.roll(x, -1, dims=1)))
    return step, state, metrics


def main(steps: int, world_size: int) -> None:
    mesh = fs.init_mesh({"fsdp": world_size})
    results = {}
    for name, schedule in SCHEDULES.items():
        step, state, metrics = train(mesh, schedule, steps)
        results[name] = fs.tree_leaves(state)
        if mesh.rank == 0:
            print(f"\n=== {name}: {schedule}")
            if schedule.trace:
                print("passes:", ", ".join(map(repr, schedule.pass_list)))
            print(f"loss {float(metrics['loss']):.4f}, all-gather {metrics['all_gather_bytes']} B, "
                  f"reduce-scatter {metrics['reduce_scatter_bytes']} B per step")
            if schedule.trace:
                print(step.explain())
    reference = results["eager reference"]
    for name, leaves in results.items():
        identical = all(torch.equal(a, b) for a, b in zip(leaves, reference))
        if mesh.rank == 0:
            print(f"{name}: {'bit-identical to' if identical else 'DIFFERENT FROM'} the eager reference")
        assert identical, name


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    fs.launch(main, world_size=args.world_size, args=(args.steps, args.world_size))
