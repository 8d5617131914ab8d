"""fs against PyTorch FSDP2 and DDP: step time, peak memory, bytes moved and accuracy.

    python benchmarks/compare.py                    # the full run (~30-40 min on 2 cores)
    python benchmarks/compare.py --quick            # smoke check: world size 2, smallest batches (< 2 min)
    python benchmarks/compare.py --docs-from benchmarks/results/NAME   # put a run into docs/benchmarks.md

One `fs.launch` per world size (gloo, one thread per rank). In it, for every model and per-rank
batch size, these arms start from the same weights, take the same batches and the same AdamW
steps, interleaved step by step:

  fs                    fs.sharded_step, default schedule (traced, prefetch 1, reshard after forward)
  fs prefetch 0         ... fs.Schedule(prefetch=0)
  fs no reshard         ... fs.Schedule(reshard_after_forward=False)
  FSDP2                 fully_shard per block + root, FSDP2's defaults
  FSDP2 prefetch+async  ... explicit forward/backward prefetch, asynchronous unshards
  DDP                   DistributedDataParallel, defaults
  compute only          plain torch on this rank's batch, no collectives (the floor)

(fs arms pass donate=True when the installed functional_shard has it.) Written to --out
(default benchmarks/results/<timestamp>/): results.json (raw figures, machine, configuration),
results.md (tables and targets) and results.png (step time and peak memory per arm).
See docs/benchmarks.md for what each figure means and how it is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import functional_shard as fs

from _arms import ARMS, FS_DEFAULT, FS_DONATE, FSDP2_PREFETCH_DEPTH
from _report import METHODS, machine_info, render_tables, render_targets, summarize, targets, write_docs, write_outputs
from _runner import Plan, run_world
from _workloads import DEFAULT_MODELS, MODELS

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Defaults:
    """The full run. Batch sizes sweep from communication-bound (small: the bytes moved per step
    do not depend on the batch) to compute-bound; chosen so that the whole run takes ~30-40
    minutes on a 2-core machine (GPT batch 16 at world size 4 alone is about a third of it)."""

    world_sizes: tuple[int, ...] = (2, 4)
    models: tuple[str, ...] = DEFAULT_MODELS
    mlp_batch_sizes: tuple[int, ...] = (8, 64, 512)
    gpt_batch_sizes: tuple[int, ...] = (1, 4, 16)
    gpt_large_batch_sizes: tuple[int, ...] = (1,)
    steps: int = 20
    warmup: int = 3
    correctness_steps: int = 10


@dataclass(frozen=True)
class Quick(Defaults):
    """Smoke check (< 2 min): world size 2, each model's smallest batch, few steps."""

    world_sizes: tuple[int, ...] = (2,)
    mlp_batch_sizes: tuple[int, ...] = (8,)
    gpt_batch_sizes: tuple[int, ...] = (1,)
    steps: int = 5
    warmup: int = 1
    correctness_steps: int = 3


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke check: world size 2, smallest batches, 5 steps")
    parser.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<timestamp>)")
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default 2 4 (quick: 2)")
    parser.add_argument("--models", nargs="+", choices=MODELS, help="default: mlp gpt (gpt-large: ~101M parameters, run on its own)")
    parser.add_argument("--mlp-batch-sizes", type=int, nargs="+", help="per rank; default 8 64 512 (quick: 8)")
    parser.add_argument("--gpt-batch-sizes", type=int, nargs="+", help="per rank; default 1 4 16 (quick: 1)")
    parser.add_argument("--gpt-large-batch-sizes", type=int, nargs="+", help="per rank; default 1")
    parser.add_argument("--steps", type=int, help="timed steps per arm; default 20 (quick: 5)")
    parser.add_argument("--warmup", type=int, help="untimed steps before them; default 3 (quick: 1)")
    parser.add_argument("--correctness-steps", type=int, help="steps before the parameter check; default 10 (quick: 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", choices=ARMS, metavar="ARM", help=f"default: every arm; any of {list(ARMS)} (fs is always run)")
    parser.add_argument("--write-docs", action="store_true", help="after the run, put it into docs/benchmarks.md")
    parser.add_argument("--docs-from", type=Path, metavar="DIR", help="run nothing: put the run in DIR into docs/benchmarks.md")
    parser.add_argument(
        "--merge", type=Path, nargs="+", metavar="DIR",
        help="run nothing: join the runs in these folders (e.g. one per world size) into --out",
    )
    return parser.parse_args(argv)


def make_plan(args: argparse.Namespace) -> tuple[Plan, tuple[int, ...]]:
    defaults = Quick() if args.quick else Defaults()

    def pick(name: str):
        value = getattr(args, name)
        return getattr(defaults, name) if value is None else (tuple(value) if isinstance(value, list) else value)

    batch_sizes = {"mlp": pick("mlp_batch_sizes"), "gpt": pick("gpt_batch_sizes"), "gpt-large": pick("gpt_large_batch_sizes")}
    plan = Plan(
        batch_sizes=tuple((model, tuple(sorted(batch_sizes[model]))) for model in pick("models")),
        steps=pick("steps"),
        warmup=pick("warmup"),
        correctness_steps=pick("correctness_steps"),
        seed=args.seed,
        **({"arms": tuple(dict.fromkeys((FS_DEFAULT, *args.arms)))} if args.arms else {}),
    )
    return plan, pick("world_sizes")


def run(plan: Plan, world_sizes: tuple[int, ...]) -> list[dict]:
    records = []
    for world_size in world_sizes:
        # One launch per world size: every model, batch size and arm shares its processes.
        records += fs.launch(run_world, world_size=world_size, args=(plan, world_size), threads_per_rank=1)
    return records


def build_result(name: str, command: str, plan: Plan, world_sizes, records: list[dict], elapsed: float) -> dict:
    records = [summarize(r) for r in records]
    config = dataclasses.asdict(plan)
    config.update(world_sizes=list(world_sizes), fsdp2_prefetch_depth=FSDP2_PREFETCH_DEPTH)
    result = {
        "name": name,
        "command": command,
        "elapsed_s": elapsed,
        "machine": machine_info(),
        "config": config,
        "fs_donate": FS_DONATE,
        "methods": METHODS,
        "records": records,
    }
    result["targets"] = targets(records)
    return result


def merge(run_dirs: list[Path], out: Path) -> None:
    """One result from several runs of the same plan (separate launches, e.g. one per world
    size, so that a rank that dies in one does not lose the others): records joined, targets
    computed again over all of them."""
    runs = [json.loads((d / "results.json").read_text()) for d in run_dirs]
    result = dict(runs[0])
    result["name"] = "+".join(r["name"] for r in runs)
    result["command"] = " ; ".join(r["command"] for r in runs)
    result["elapsed_s"] = sum(r["elapsed_s"] for r in runs)
    result["config"] = dict(runs[0]["config"], world_sizes=[w for r in runs for w in r["config"]["world_sizes"]])
    result["records"] = [record for r in runs for record in r["records"]]
    result["runs"] = [
        {
            "command": r["command"], "world_sizes": r["config"]["world_sizes"], "steps": r["config"]["steps"],
            "warmup": r["config"]["warmup"], "correctness_steps": r["config"]["correctness_steps"],
            "commit": r["machine"]["git_commit"], "elapsed_s": r["elapsed_s"],
        }
        for r in runs
    ]
    result["targets"] = targets(result["records"])
    paths = write_outputs(result, out)
    print(render_tables(result))
    print(render_targets(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs, chart = REPO / "docs" / "benchmarks.md", REPO / "docs" / "benchmarks.png"
    if args.docs_from is not None:
        write_docs(args.docs_from, docs, chart)
        print(f"wrote {docs} and {chart} from {args.docs_from}")
        return 0
    if args.merge:
        merge(args.merge, args.out or REPO / "benchmarks" / "results" / "merged")
        return 0
    plan, world_sizes = make_plan(args)
    name = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else "")
    out = args.out or REPO / "benchmarks" / "results" / name
    command = "python benchmarks/compare.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    records = run(plan, world_sizes)
    result = build_result(name, command.strip(), plan, world_sizes, records, time.perf_counter() - start)
    paths = write_outputs(result, out)
    print(render_tables(result))
    print(render_targets(result))
    print(f"\nfs donate={FS_DONATE}; {result['elapsed_s']:.0f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    if args.write_docs:
        write_docs(out, docs, chart)
        print(f"wrote {docs} and {chart}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
