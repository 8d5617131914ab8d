"""The layout planner against this machine: every layout of 4 ranks, predicted and measured.

    python benchmarks/layouts_here.py [--models gpt,llama] [--steps 9] [--json out.json]

For `fs.models.GPT` and a Hugging Face Llama (from a `LlamaConfig`), 8 blocks, a global batch of
8 x 64 tokens, fp32, AdamW: `fs.analysis.plan_layouts` predicts every layout of world size 4
(`fsdp 4`, `replicate 2 x fsdp 2`, `fsdp 2 x tp 2`, `tp 4`, `pp 2 x fsdp 2`, `pp 2 x tp 2`,
`pp 4`; pipelines 1F1B with as many micro-batches as stages) on this machine as
`fs.analysis.calibrate` measures it; then each layout runs on 4 gloo processes (`LocalWorld`):
median step time over `--steps` timed steps (the slowest rank's, after 2 warm-up steps; the
layouts interleaved: each round runs one step of every layout, in a rotating order), and
the most bytes of tensor storages alive at once during one step on each rank (the state and the
batch included; `LiveBytes`, what MemTracker counts — shown beside it where MemTracker runs: it
refuses a pipeline stage called once per micro-batch), largest over ranks. Printed: predicted against measured per layout, whether the predicted ranking agrees with
the measured one for every pair of layouts whose measured times differ by more than 10 %, and
each layout's memory error.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import functional_shard as fs
from functional_shard import tensor_parallel as tp
from functional_shard.models import GPT, GPTConfig

LAYERS, GLOBAL, LENGTH, VOCAB = 8, 8, 64, 256
LAYOUTS = ({"fsdp": 4}, {"replicate": 2, "fsdp": 2}, {"fsdp": 2, "tp": 2}, {"tp": 4}, {"pp": 2, "fsdp": 2},
           {"pp": 2, "tp": 2}, {"pp": 4})  # fmt: skip
OPTIMIZER = fs.optim.adamw(lr=1e-3)


def build(model: str, layers: int, mesh, meta: bool = True):
    """(loss_fn, params, placements) of `model` with `layers` blocks for `mesh` (tensor-parallel
    over its `tp` axis when it has one): on the meta device, or with seeded weights."""
    torch.manual_seed(0)
    device = torch.device("meta") if meta else torch.device("cpu")
    split = "tp" in mesh.axis_names and mesh.shape["tp"] > 1
    if model == "gpt":
        config = GPTConfig(vocab_size=VOCAB, block_size=LENGTH, n_layer=layers, n_head=4, d_model=128)
        with device:
            net = GPT(config)
        rules = tp.gpt_rules(config) if split else None
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=LENGTH,
                             tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
        with device:
            net = LlamaForCausalLM(config)
        rules = tp.hf_rules(net) if split else None
    if split:
        tp.parallelize(net, rules, mesh)
    apply_fn, params = fs.functionalize(net)

    def loss_fn(p, batch):
        ids, targets = batch
        if model == "gpt":
            logits = apply_fn(p, ids).flatten(0, 1)
            if split:
                return tp.vocab_parallel_cross_entropy(logits, targets.flatten(), mesh, "tp")
        else:
            logits = apply_fn(p, input_ids=ids, use_cache=False).logits.flatten(0, 1)
        return F.cross_entropy(logits, targets.flatten())

    return loss_fn, params, rules


def meta_batch(rows: int):
    ids = torch.empty(rows, LENGTH, dtype=torch.long, device="meta")
    return ids, ids


def _max(mesh, value: float) -> float:
    out = torch.tensor([float(value)], dtype=torch.float64)
    return float(mesh.all_gather_world(out).max())


def calibrated(_) -> fs.analysis.Machine:
    return fs.analysis.calibrate(fs.init_mesh({"fsdp": 4}))


def measure(_, model: str, layouts: list, steps: int) -> list:
    """On every rank: each layout's median step time (slowest rank) and peak bytes (largest rank),
    the layouts measured interleaved: every round runs one step of each, in an order that rotates,
    so that the machine's drift (other work, clocks) falls on all of them alike."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_num_threads(1)
    runs = []
    for axes in layouts:
        mesh = fs.init_mesh(axes)
        loss_fn, params, rules = build(model, LAYERS, mesh, meta=False)
        pp = axes.get("pp", 1)
        options = dict(microbatches=pp, pipeline=fs.pipeline.Pipeline("1f1b")) if pp > 1 else {}
        step = fs.sharded_step(loss_fn, mesh, optimizer=OPTIMIZER, placements=rules, **options)
        data = axes.get("replicate", 1) * axes.get("fsdp", 1)
        per = GLOBAL // data
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, VOCAB, (GLOBAL, LENGTH), generator=g)
        batch = tuple(t[mesh.data_rank * per : (mesh.data_rank + 1) * per] for t in (ids, torch.roll(ids, -1, 1)))
        state = step.init(params)
        for _ in range(2):
            state, _m = step(state, batch)
        runs.append(dict(mesh=mesh, step=step, state=state, batch=batch, pp=pp, times=[]))
    for r in range(steps):
        for i in range(len(runs)):
            run = runs[(i + r) % len(runs)]
            run["mesh"].all_reduce_flat(torch.zeros(1))
            start = time.perf_counter()
            run["state"], _m = run["step"](run["state"], run["batch"])
            run["times"].append(_max(run["mesh"], time.perf_counter() - start))
    out = []
    for run in runs:
        mesh, step, state, batch = run["mesh"], run["step"], run["state"], run["batch"]
        external = [t for t in fs.tree_leaves(state) if isinstance(t, torch.Tensor)] + list(batch)
        mesh.all_reduce_flat(torch.zeros(1))
        with LiveBytes(external) as tracker:
            state, _m = step(state, batch)
        figures = {"step_s": statistics.median(run["times"]), "peak_bytes": _max(mesh, tracker.peak)}
        if run["pp"] == 1:  # the same step under torch's MemTracker (it cannot follow a module called per micro-batch)
            memtracker = MemTracker()
            memtracker.track_external(*external)
            mesh.all_reduce_flat(torch.zeros(1))
            with memtracker:
                state, _m = step(state, batch)
            total = sum(int(next((v for k, v in c.items() if str(getattr(k, "value", k)) == "Total"), 0))
                        for d, c in memtracker.get_tracker_snapshot("peak").items() if torch.device(d).type == "cpu")  # fmt: skip
            figures["memtracker_bytes"] = _max(mesh, total)
        out.append(figures)
    return out


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storages alive at once while the mode is on: the `external`
    tensors (the state, the batch) and every storage an op returns, until it is freed (checked
    after each op). What MemTracker counts, for code that calls one module several times (a
    pipeline stage, once per micro-batch), which MemTracker refuses."""

    def __init__(self, external):
        super().__init__()
        self.live: dict = {}
        self.now = 0
        for t in external:
            self._add(t)
        self.peak = self.now

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.now += storage.nbytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, n) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= n
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._add(t)
        self.peak = max(self.peak, self.now)
        return out


def label(axes: dict) -> str:
    return " x ".join(f"{k} {v}" for k, v in axes.items())


def plan(model: str, machine):
    return fs.analysis.plan_layouts(
        lambda layers, mesh: build(model, layers, mesh), meta_batch, layers=LAYERS, world_size=4, global_batch=GLOBAL,
        tokens_per_row=LENGTH, machine=machine, budget_bytes=1 << 40, optimizer=OPTIMIZER, schedule=fs.Schedule(),
        space=fs.analysis.LayoutSpace(tp=(1, 2, 4), pp=(1, 2, 4), replicate=(1, 2), remat=(("none", False),),
                                      schedules=("1f1b",), microbatches=(1,)),
        workers=os.cpu_count() or 1,
    )  # fmt: skip


def run(model: str, world, machine, steps: int) -> dict:
    start = time.perf_counter()
    planned = plan(model, machine)
    planned_s = time.perf_counter() - start
    # The same machine without its per-group-size collective curves (every group priced by the
    # whole world's): what the planner predicted before `calibrate` measured sub-groups.
    world_curves = plan(model, dataclasses.replace(machine, collective_groups={})) if machine.collective_groups else None
    measured = world.run(measure, model, list(LAYOUTS), steps)[0]
    out = dict(model=model)
    for name, candidates in (("", planned), (" (world curves only)", world_curves)):
        if candidates is None:
            continue
        rows = []
        print(f"{model}{name}:")
        for axes, m in zip(LAYOUTS, measured):
            order = ("pp", "replicate", "fsdp", "tp")
            want = {k: axes[k] for k in order if axes.get(k, 1) > 1}
            (c,) = [c for c in candidates.candidates if c.axes == want]
            rows.append(dict(layout=label(want), predicted_s=c.step_s, measured_s=m["step_s"], predicted_bytes=c.peak_bytes,
                             measured_bytes=m["peak_bytes"], memtracker_bytes=m.get("memtracker_bytes"), why=c.why))  # fmt: skip
            print(f"  {label(want):<24} predicted {c.step_s * 1e3:8.1f} ms {c.peak_bytes / 2**20:7.2f} MiB | measured "
                  f"{m['step_s'] * 1e3:8.1f} ms {m['peak_bytes'] / 2**20:7.2f} MiB | memory {c.peak_bytes / m['peak_bytes'] - 1:+6.1%}"
                  + (f" (MemTracker {m['memtracker_bytes'] / 2**20:.2f} MiB)" if "memtracker_bytes" in m else ""),
                  flush=True)  # fmt: skip
        pairs = disagreements = 0
        for a, b in itertools.combinations(rows, 2):
            if abs(a["measured_s"] / b["measured_s"] - 1) > 0.10:
                pairs += 1
                if (a["measured_s"] < b["measured_s"]) != (a["predicted_s"] < b["predicted_s"]):
                    disagreements += 1
                    print(f"  ranking disagrees: {a['layout']} vs {b['layout']}")
        worst = max(abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in rows)
        print(f"{model}{name}: {pairs} pairs differ by > 10 % measured, {disagreements} ranked the other way by the "
              f"planner; largest memory error {worst:.1%}; planned in {planned_s:.0f} s\n", flush=True)  # fmt: skip
        key = "world_curves" if name else "result"
        out[key] = dict(rows=rows, pairs=pairs, disagreements=disagreements, worst_memory_error=worst)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    with fs.testing.LocalWorld(4, collective_timeout=120.0, call_timeout=900.0) as world:
        machine = world.run(calibrated)[0]
        curves = {f"{k}/4": (machine.collective_latency_s[k], machine.collective_bandwidth[k]) for k in machine.collective_bandwidth}
        for key, (latency, bus) in sorted({**curves, **machine.collective_groups}.items()):
            print(f"calibrated {key:<18} latency {latency * 1e3:6.2f} ms, bus {bus / 1e6:8.1f} MB/s")
        out = []
        for model in args.models.split(","):
            print(f"{model}: world size 4, {LAYERS} blocks, {GLOBAL} x {LENGTH} tokens, fp32, AdamW")
            out.append(run(model, world, machine, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
