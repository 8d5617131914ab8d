"""The cost of layout invariance: `sharded_step(..., canonical_chunks=G)` against the default step.

    python benchmarks/canonical.py                   # world sizes 2 and 4, GPT, ~3 min on 2 quiet cores
    python benchmarks/canonical.py --breakdown       # + an arm and the pieces that split the cost (below)
    python benchmarks/canonical.py --quick           # smoke run: a tiny GPT, world size 2, 2 steps (~10 s)

The model is the GPT of benchmarks/compare.py (`_workloads.Workload("gpt")`: 8 layers, d_model
256, 4 heads, sequence 128, untied head, the shipped corpus); AdamW (`_arms.Hyper`), `donate=True`
and the default schedule (traced, prefetch 1, reshard after forward) in every arm. The global
batch is `--global-batch` (16) sequences, the same at every world size D: each rank gets
`16 / D` of them (rank r's rows of the step's global batch, a pure function of (seed, s): the same
global batches at every world size and in every arm).
One `fs.launch` per world size, every rank pinned to one thread. Arms, all built from the same
initial weights and stepped on the same batches:

  default                 `microbatches=1` (one reduce-scatter per unit, overlapped with the backward)
  default, G/D micro      `microbatches=G/D`: the same micro-batch shapes as the canonical step
                          (accumulate "sharded": a reduce-scatter per unit and micro-batch)
  canonical G             `canonical_chunks=G` (G = `--chunks`, 8) with its default schedule
                          (`Schedule(reshard_after_forward=False, reshard_after_backward=False)`:
                          each unit gathered once per step, its chunks share it): each rank runs
                          its G/D chunks as micro-batches, full gradients summed in the canonical
                          tree, one all-to-all per buffer at the end, the norm per canonical block,
                          dropout per chunk
  canonical G, per chunk  `canonical_chunks=G` with `schedule=fs.Schedule()`: each unit gathered for
                          each chunk and again in its backward (less memory; the same bits: a
                          schedule never changes them)
  (--breakdown) full G/D micro
                          `microbatches=G/D`, `Schedule(accumulate="full")`: the canonical step's
                          computation and memory without its tree, all-to-all and per-chunk metrics
                          (full gradients summed left to right, one reduce-scatter per unit at the end)
  (--arms) canonical G, eager / default, eager
                          `Schedule(trace=False)`: the eager reference of each

Protocol (as benchmarks/compare.py): `--warmup` untimed steps (the first traces), then `--steps`
timed steps interleaved step by step across the arms, the order rotating every step; a step's
time is the slowest rank's wall time (the ranks meet in an all-reduce first). Then one untimed
step per arm under `MemTracker` (the state's tensors and the batch registered first with
`track_external`): the peak of tensor storages, the largest rank's. Printed per world size: median
and IQR of the step time, peak MiB per rank, the mean loss of the last step, bytes of full buffers
gathered / reduced per step (`metrics`), and the canonical arms' ratios to the default arms.
Issue 28's target: canonical <= 1.10 x the default step's time. `--breakdown` also times the
pieces in which the canonical step differs, each alone on every rank (`_components`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import functional_shard as fs
from functional_shard.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_line  # noqa: E402
from _arms import Hyper  # noqa: E402  (benchmarks/ is not a package)
from _gpt import cpu_total  # noqa: E402
from _workloads import Workload, _tokenizer  # noqa: E402

DEFAULT = "default"
MICRO = "default, G/D micro"
CANONICAL = "canonical G"
FULL = "full G/D micro"
CANONICAL_ONCE = "canonical G, per chunk"
CANONICAL_EAGER = "canonical G, eager"
DEFAULT_EAGER = "default, eager"
ARMS = (DEFAULT, MICRO, CANONICAL, CANONICAL_ONCE)
BREAKDOWN = (FULL,)
EVERY_ARM = ARMS + BREAKDOWN + (CANONICAL_EAGER, DEFAULT_EAGER)


@dataclass(frozen=True)
class Config:
    """One launch's run; identical on every rank."""

    world_size: int
    chunks: int = 8  # G
    global_batch: int = 16  # sequences, the same at every world size
    steps: int = 12
    warmup: int = 2
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    quick: bool = False  # a tiny GPT (2 layers, d_model 64, sequence 32)
    components: bool = False  # also time the canonical step's pieces alone (`_components`)


def _pairwise(rows: torch.Tensor) -> torch.Tensor:
    """The canonical tree's sum of `rows` (a power of two of them): neighbours paired level by
    level, what `canonical_chunks` steps add their parts with (fs's `_canonical.tree_sum`)."""
    while rows.shape[0] > 1:
        rows = rows[0::2] + rows[1::2]
    return rows[0]


def _workload(config: Config):
    """(the model, a rank's batch at a step, the loss of a batch): compare.py's GPT, or a tiny one."""
    workload = Workload("gpt")
    per_rank = config.global_batch // config.world_size
    if config.quick:
        torch.manual_seed(config.seed)
        model = GPT(GPTConfig(vocab_size=_tokenizer().vocab_size, block_size=32, n_layer=2, n_head=2, d_model=64))
    else:
        model = workload.build(config.seed)

    def batch(rank: int, step: int):
        # Rows [rank * per_rank, (rank + 1) * per_rank) of the step's global batch: the same
        # global batches at every world size (so the canonical arms' losses agree across them).
        x, y = workload.batch(config.global_batch, seed=config.seed, rank=0, step=step)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        return (x[:, :32], y[:, :32]) if config.quick else (x, y)

    return model, batch, workload.loss


def _options(name: str, config: Config) -> dict:
    per_rank = config.chunks // config.world_size
    return {
        DEFAULT: {},
        MICRO: {"microbatches": per_rank},
        CANONICAL: {"canonical_chunks": config.chunks},
        FULL: {"microbatches": per_rank, "schedule": fs.Schedule(accumulate="full")},
        CANONICAL_ONCE: {"canonical_chunks": config.chunks, "schedule": fs.Schedule()},
        CANONICAL_EAGER: {"canonical_chunks": config.chunks, "schedule": fs.Schedule(trace=False)},
        DEFAULT_EAGER: {"schedule": fs.Schedule(trace=False)},
    }[name]


def run(config: Config) -> dict | None:
    torch.set_num_threads(1)  # the ranks share the cores; and a canonical step needs one count everywhere
    mesh = fs.init_mesh({"fsdp": config.world_size})
    model, batch_of, loss = _workload(config)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        x, y = batch
        return loss(apply_fn(p, x), y)

    hyper = Hyper()
    arms = {}
    for name in config.arms:
        step = fs.sharded_step(loss_fn, mesh, optimizer=hyper.fs_adamw(), donate=True, **_options(name, config))
        arms[name] = {"step": step, "state": step.init(params), "times": [], "loss": None, "metrics": None}
    total = config.warmup + config.steps
    for i in range(total):
        batch = batch_of(mesh.rank, i)
        names = list(arms)
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            arm = arms[name]
            mesh.all_reduce_flat(torch.zeros(1))  # start together
            start = time.perf_counter()
            arm["state"], metrics = arm["step"](arm["state"], batch)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            slowest = float(mesh.all_gather_world(elapsed).max())
            arm["loss"], arm["metrics"] = float(metrics["loss"]), metrics
            if i >= config.warmup:
                arm["times"].append(slowest)
        if mesh.rank == 0:
            now = time.strftime("%H:%M:%S")
            print(f"[{now} ws {config.world_size}] step {i + 1}/{total}", file=sys.stderr, flush=True)
    batch = batch_of(mesh.rank, total)
    report = {}
    for name, arm in arms.items():
        tracker = MemTracker()
        tracker.track_external(*fs.tree_leaves(arm["state"]), *batch)
        mesh.all_reduce_flat(torch.zeros(1))
        with tracker:
            arm["state"], _ = arm["step"](arm["state"], batch)
        peaks = mesh.all_gather_world(torch.tensor([cpu_total(tracker, "peak")], dtype=torch.int64)).tolist()
        report[name] = {
            "times_s": arm["times"],
            "peak_bytes_per_rank": peaks,
            "loss": arm["loss"],
            "all_gather_bytes": int(arm["metrics"]["all_gather_bytes"]),
            "reduce_scatter_bytes": int(arm["metrics"]["reduce_scatter_bytes"]),
        }
    # The canonical arms must agree bit for bit (every parameter after the same steps): a check
    # that the schedule of "per chunk" changed nothing but the time and the memory.
    canonical = [name for name in (CANONICAL, CANONICAL_ONCE, CANONICAL_EAGER) if name in arms]
    full = {name: fs.tree_leaves(fs.gather(arms[name]["state"].params, full=True)) for name in canonical}
    for name in canonical:
        report[name]["same_bits_as_first_canonical"] = all(
            torch.equal(a, b) for a, b in zip(full[canonical[0]], full[name])
        )
    components = None
    if config.components:
        components = _components(mesh, config, model, loss, batch, arms[CANONICAL]["state"])
    if mesh.rank != 0:
        return None
    return {"arms": report, "params": sum(p.numel() for p in model.parameters()), "components_ms": components}


def _timed(mesh, fn, repeats: int) -> float:
    """Median over `repeats` (after one warm-up) of the slowest rank's time of `fn()`, in ms."""
    times = []
    for _ in range(repeats + 1):
        mesh.all_reduce_flat(torch.zeros(1))  # start together
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        times.append(float(mesh.all_gather_world(elapsed).max()))
    return 1e3 * statistics.median(times[1:])


def _components(mesh, config: Config, model, loss, batch, state, repeats: int = 5) -> dict[str, float]:
    """The pieces in which a canonical step differs from the default one, each timed alone on
    every rank at once (ms, slowest rank): the plain model's forward and backward on the rank's
    rows at once and chunk by chunk, one pass of all-gathers over every trainable buffer, the
    reduction of every full gradient buffer (the default's reduce-scatter, the canonical tree's
    all-to-all and tree sum), the gradient norm (plain, per canonical block), the loss metric."""
    per_rank = config.chunks // config.world_size
    x, y = batch
    chunks = list(zip(x.chunk(per_rank), y.chunk(per_rank)))

    def whole():
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    def by_chunk():
        model.zero_grad(set_to_none=True)
        for cx, cy in chunks:
            loss(model(cx), cy).backward()

    buffers = [b for b in state.params.layout.buffers if b.trainable]
    generator = torch.Generator().manual_seed(mesh.rank)
    shards = [torch.randn(b.shard_numel, generator=generator) for b in buffers]
    fulls = [torch.randn(b.shard_numel * mesh.num_shards, generator=generator) for b in buffers]
    blocks = config.chunks // mesh.num_shards
    losses = torch.randn(per_rank, generator=generator)
    pieces = {
        "forward + backward, the rank's rows at once": whole,
        "forward + backward, chunk by chunk": by_chunk,
        "all-gather every buffer (one pass)": lambda: [mesh.all_gather_flat(s) for s in shards],
        "reduce every buffer: reduce-scatter (default)": lambda: [mesh.reduce_scatter_flat(f) for f in fulls],
        "reduce every buffer: all-to-all + tree (canonical)": lambda: [_pairwise(mesh.all_to_all_axis_flat(f, "fsdp").view(mesh.num_shards, -1)) for f in fulls],
        "gradient norm (default)": lambda: fs.optim.global_norm(shards, mesh),
        "gradient norm per canonical block": lambda: fs.optim.global_norm(shards, mesh, blocks=blocks),
        "loss: all-reduce (default)": lambda: mesh.all_reduce_flat(losses[:1].clone(), mesh.data_axes),
        "loss: chunks gathered + tree (canonical)": lambda: _pairwise(mesh.all_gather_axis_flat(losses, "fsdp").view(-1, 1)),
    }
    with torch.no_grad():
        out = {name: _timed(mesh, fn, repeats) for name, fn in pieces.items() if "forward" not in name}
    for name in ("forward + backward, the rank's rows at once", "forward + backward, chunk by chunk"):
        out[name] = _timed(mesh, pieces[name], repeats)
    return out


# --- report ---------------------------------------------------------------------------------------


def table(config: Config, result: dict) -> str:
    """One world size's figures as a markdown table (the docs' format), then the ratios."""
    arms = result["arms"]
    median = {n: statistics.median(a["times_s"]) for n, a in arms.items()}
    peak = {n: max(a["peak_bytes_per_rank"]) for n, a in arms.items()}
    per_rank = config.chunks // config.world_size
    lines = [
        f"**World size {config.world_size}**: global batch {config.global_batch} sequences "
        f"({config.global_batch // config.world_size} per rank), G = {config.chunks} ({per_rank} chunks of "
        f"{config.global_batch // config.chunks} per rank); "
        f"{config.steps} timed steps after {config.warmup}",
        "",
        "| arm | median ms | IQR ms | peak MiB/rank | loss (last step) | all-gather MiB/step | reduce MiB/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in arms.items():
        q = statistics.quantiles(a["times_s"], n=4) if len(a["times_s"]) > 1 else [a["times_s"][0]] * 3
        lines.append(
            f"| {name} | {1e3 * median[name]:.1f} | {1e3 * (q[2] - q[0]):.1f} | {peak[name] / 2**20:.1f} | "
            f"{a['loss']:.5f} | {a['all_gather_bytes'] / 2**20:.1f} | {a['reduce_scatter_bytes'] / 2**20:.1f} |"
        )
    lines.append("")
    canonical = [n for n in arms if "same_bits_as_first_canonical" in arms[n]]
    if len(canonical) > 1:
        same = all(arms[n]["same_bits_as_first_canonical"] for n in canonical)
        names = ", ".join(f"`{n}`" for n in canonical)
        lines.append(f"- parameters after the run bit-identical across {names}: {same}")
    pairs = [(CANONICAL, DEFAULT), (CANONICAL, MICRO), (CANONICAL, FULL), (CANONICAL_ONCE, DEFAULT)]
    for mine, other in pairs:
        if mine in arms and other in arms:
            ratio = median[mine] / median[other]
            verdict = f" (target <= 1.10: {'met' if ratio <= 1.10 else 'missed'})" if other == DEFAULT else ""
            lines.append(
                f"- `{mine}` / `{other}`: time {ratio:.3f}x{verdict}, peak {peak[mine] / peak[other]:.3f}x "
                f"({(peak[mine] - peak[other]) / 2**20:+.1f} MiB)"
            )
    components = result.get("components_ms")
    if components:
        lines += ["", "Pieces timed alone (ms, slowest rank, median of 5):", "", "| piece | ms |", "|---|---:|"]
        lines += [f"| {name} | {ms:.2f} |" for name, ms in components.items()]
    if CANONICAL_EAGER in arms and DEFAULT_EAGER in arms:
        ratio = median[CANONICAL_EAGER] / median[DEFAULT_EAGER]
        lines.append(f"- `{CANONICAL_EAGER}` / `{DEFAULT_EAGER}`: time {ratio:.3f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default 2 4 (quick: 2)")
    parser.add_argument("--chunks", type=int, default=8, help="G, canonical_chunks (default 8)")
    parser.add_argument("--global-batch", type=int, default=16,
                        help="sequences per step, all ranks together (default 16)")
    parser.add_argument("--steps", type=int, help="timed steps per arm (default 12; quick: 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, the first traces (default 2; quick: 1)")
    parser.add_argument("--breakdown", action="store_true",
                        help=f"also the arms {list(BREAKDOWN)}, and the canonical step's pieces timed alone")
    parser.add_argument("--arms", nargs="+", choices=EVERY_ARM, metavar="ARM",
                        help=f"run these arms instead; any of {list(EVERY_ARM)}")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny GPT, world size 2, 2 steps")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    began = time.time()
    print(f"Machine: {machine_line()}")
    print(f"Command: python benchmarks/canonical.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    world_sizes = args.world_sizes or ([2] if args.quick else [2, 4])
    arms = tuple(args.arms) if args.arms else ARMS + (BREAKDOWN if args.breakdown else ())
    if args.breakdown and CANONICAL not in arms:
        arms += (CANONICAL,)
    raw = []
    for world_size in world_sizes:
        config = Config(
            world_size=world_size, chunks=args.chunks, global_batch=args.global_batch,
            steps=args.steps or (2 if args.quick else 12), warmup=args.warmup or (1 if args.quick else 2),
            arms=arms, quick=args.quick, components=args.breakdown,
        )
        if args.chunks % world_size or args.global_batch % args.chunks:
            raise SystemExit(
                f"world size {world_size}: need world size | chunks ({args.chunks}) | "
                f"global batch ({args.global_batch})"
            )
        result = fs.launch(run, world_size=world_size, args=(config,), threads_per_rank=1)
        if not raw:
            model = (
                "tiny GPT (2 layers, d_model 64, sequence 32)" if args.quick
                else "GPT of benchmarks/compare.py (8 layers, d_model 256, sequence 128)"
            )
            print(f"{model}: {result['params']:,} parameters\n")
        raw.append({"config": asdict(config), "result": result})
        print(table(config, result), flush=True)
        print()
    print(f"{(time.time() - began) / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
