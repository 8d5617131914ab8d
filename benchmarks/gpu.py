"""One GPU, world size 1 under NCCL: fs against plain PyTorch and FSDP2 on a Hugging Face Llama.

    python benchmarks/gpu.py --out gpu.json                 # the ~1.1B Llama (TinyLlama's shape)
    python benchmarks/gpu.py --size tiny --rounds 2         # a smoke run (also on a CPU)
    python benchmarks/gpu.py --arms torch,fs-fused --profile --out gpu.json   # where each arm's time goes

Arms, each on its own copy of the same weights, timed interleaved (one round = `--steps` steps
of every arm in turn, `--rounds` rounds; the median step of each arm):

- `torch`: the module with fp32 parameters under `torch.autocast(bfloat16)`, `loss.backward()`,
  `torch.optim.AdamW(fused=True)`: what a single-GPU user writes;
- `torch-compile`: the same with `torch.compile(module)`;
- `fsdp2`: `fully_shard` on every decoder layer and the root at world size 1,
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, `AdamW(fused=True)`;
- `fs`: `fs.sharded_step` (the default traced schedule, `donate=True`), `fs.Precision(bf16,
  fp32)`, `fs.optim.adamw`;
- `fs-fused`: the same with `fs.optim.adamw(fused=True)` (torch's fused AdamW kernel on each
  flat shard);
- `fs-compile`, `fs-fused-compile`: those with `fs.Schedule(compile=True)`;
- `fs-offload`, `fs-offload-remat`, `fs-remat`: `fused=True` with every unit's shards and
  optimizer state in pinned host memory (`fs.Schedule(offload=True)`), with and without
  `remat=True` (the peak is mostly activations), and remat alone for its cost;
  `fs-offload-host`: everything offloaded with the update on the host (torch's fused CPU AdamW);
- `fs-zero1`: `fused=True` with ZeRO-1 (`fs.Schedule(reshard_after_update=False)`).

Per arm: seconds per step, tokens/s, MFU (6 N + 12 L h s FLOPs per token over 989 TFLOP/s,
H100/H200 SXM dense bf16) and the allocator's peak (`torch.cuda.max_memory_allocated` during a
step, less what the other arms hold: each arm's own resident bytes are added back). For the
`--analyze` arm:
`fs.analysis`'s predicted peak and the simulator's step time on the machine `fs.analysis.calibrate`
measures on this GPU. Results go to `--out` as JSON after every section (a run cut short keeps
what it measured) and as a table on stdout.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import functional_shard as fs  # noqa: E402

PEAK_BF16 = 989e12
SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}


def log(results: dict, out: Path | None, **items) -> None:
    results.update(items)
    if out is not None:
        out.write_text(json.dumps(results, indent=1, default=str))


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def tensor_bytes(tree, device=None) -> int:
    """Bytes of the distinct storages of `tree`'s tensors (on `device` only, when given: an
    offloaded state's host tensors are not the allocator's)."""
    seen, total = set(), 0
    for t in fs.tree_leaves(tree):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or (device is not None and t.device != device):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2's DTensor parameters
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def cross_entropy(logits, labels):
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class TorchArm:
    """Plain PyTorch (optionally compiled) or FSDP2 at world size 1."""

    def __init__(self, module, batch, *, kind: str):
        self.module, self.batch, self.kind = module, batch, kind
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(batch[0].device.type, (1,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in module.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(module, mesh=mesh, mp_policy=policy)
        self.call = torch.compile(module) if kind == "torch-compile" else module
        try:
            self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        except (RuntimeError, TypeError):  # fused needs a GPU (or a torch with the CPU kernel)
            self.optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.1)

    def __call__(self) -> float:
        ids = self.batch[0]
        if self.kind == "fsdp2":
            loss = cross_entropy(self.call(input_ids=ids).logits, ids)
        else:
            with torch.autocast(ids.device.type, dtype=torch.bfloat16):
                loss = cross_entropy(self.call(input_ids=ids).logits, ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def resident(self) -> int:
        return tensor_bytes([p for p in self.module.parameters()]) + tensor_bytes(
            [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )


class FsArm:
    def __init__(self, module, batch, mesh, *, schedule, fused=False):
        apply_fn, params = fs.functionalize(module)
        self.step = fs.sharded_step(
            lambda p, b: cross_entropy(apply_fn(p, input_ids=b[0]).logits, b[0]),
            mesh,
            optimizer=fs.optim.adamw(1e-4, weight_decay=0.1, fused=fused),
            precision=fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            schedule=schedule,
            donate=True,
        )
        self.state = self.step.init(params)
        self.batch = batch
        self.device = mesh.device
        del module

    def __call__(self) -> float:
        self.state, metrics = self.step(self.state, self.batch)
        return metrics["loss"]

    def resident(self) -> int:
        return tensor_bytes(self.state, self.device)


def timed(arm, device) -> tuple[float, int]:
    """(seconds, the allocator's peak during the step counted for this arm alone)."""
    synchronize(device)
    others = allocated(device) - arm.resident()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = arm()
    synchronize(device)
    seconds = time.perf_counter() - start
    if not torch.isfinite(torch.as_tensor(float(loss))):
        raise RuntimeError(f"non-finite loss {float(loss)}")
    peak = torch.cuda.max_memory_allocated(device) - others if device.type == "cuda" else 0
    return seconds, peak


# Kernel classes by name, for the profile's account of where an arm's device time goes.
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "mm", "addmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("copy", "memcpy", "cat", "to_copy", "clone")),
    ("reduction", ("reduce", "sum", "norm", "softmax")),
)


def trace_figures(trace: dict) -> dict:
    """From a Chrome trace of one step: the device's busy time (the union of its kernels' and
    copies' intervals), its idle time inside the step's span, the host<->device copies' time and
    how much of it ran while a kernel ran (overlap), and the host's synchronizations (calls that
    wait for the device: each one stops the host from running ahead)."""

    def merged(intervals):
        out = []
        for a, b in sorted(intervals):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def union(intervals):
        return sum(b - a for a, b in merged(intervals))

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events if e.get("cat") == "gpu_memcpy"]
    device = kernels + [(a, b) for a, b, _ in copies] + [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memset"]
    if not device:
        return {}
    span = max(b for _, b in device) - min(a for a, _ in device)
    busy_kernels = merged(kernels)

    def overlap(a, b):
        return sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy_kernels)

    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and "Synchronize" in e.get("name", "")]
    h2d = [(a, b) for a, b, n in copies if "HtoD" in n]
    d2h = [(a, b) for a, b, n in copies if "DtoH" in n]
    streams = sorted({e.get("args", {}).get("stream") for e in events if e.get("cat") in ("kernel", "gpu_memcpy")} - {None})
    return {
        "span_ms": span / 1e3, "device_busy_ms": union(device) / 1e3, "device_idle_ms": (span - union(device)) / 1e3,
        "kernel_busy_ms": sum(b - a for a, b in busy_kernels) / 1e3, "kernels": len(kernels),
        "h2d_ms": sum(b - a for a, b in h2d) / 1e3, "h2d_overlapped_ms": sum(overlap(a, b) for a, b in h2d) / 1e3,
        "d2h_ms": sum(b - a for a, b in d2h) / 1e3, "d2h_overlapped_ms": sum(overlap(a, b) for a, b in d2h) / 1e3,
        "copies": len(copies), "host_syncs": len(syncs), "host_sync_ms": sum(e["dur"] for e in syncs) / 1e3,
        "streams": streams,
    }


def profile_step(name: str, arm, device, out: Path | None) -> dict:
    """One step of `arm` under torch.profiler: device (or CPU) time per kernel class, every
    kernel's count and time, the device's busy and idle time and the copies' overlap
    (`trace_figures`), the step's wall time, and a gzipped Chrome trace `<out>.<arm>.trace.json.gz`."""
    import gzip
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        arm()
        synchronize(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    attr = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    kernels = [(e.key, getattr(e, attr, 0.0) or 0.0, e.count) for e in events if (getattr(e, attr, 0.0) or 0.0) > 0]
    if device.type != "cuda":
        kernels = [k for k in kernels if k[0].startswith("aten::")]
    classes: dict = {}
    for key, us, _ in kernels:
        lowered = key.lower()
        kind = next((c for c, words in KERNEL_CLASSES if any(w in lowered for w in words)), "elementwise/other")
        classes[kind] = classes.get(kind, 0.0) + us / 1e3
    fd, raw = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        figures = trace_figures(json.load(f))
    if out is not None:
        with open(raw, "rb") as f, gzip.open(str(out.with_suffix(f".{name}.trace.json.gz")), "wb", compresslevel=6) as g:
            g.write(f.read())
    os.unlink(raw)
    top = sorted(kernels, key=lambda k: -k[1])
    print(f"{name}: wall {wall * 1e3:.1f} ms; ms by class " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])), flush=True)
    if figures:
        print(f"{name}: device busy {figures['device_busy_ms']:.1f} ms, idle {figures['device_idle_ms']:.1f} ms of a {figures['span_ms']:.1f} ms span; "
              f"{figures['kernels']} kernels; H2D {figures['h2d_ms']:.1f} ms ({figures['h2d_overlapped_ms']:.1f} under kernels), "
              f"D2H {figures['d2h_ms']:.1f} ms ({figures['d2h_overlapped_ms']:.1f} under kernels); "
              f"{figures['host_syncs']} host syncs ({figures['host_sync_ms']:.1f} ms); streams {figures['streams']}", flush=True)
    return {"wall_ms": wall * 1e3, "ms_by_class": classes, "trace": figures,
            "kernels_ms_count": [(k[:160], t / 1e3, c) for k, t, c in top[:400]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--arms", default="torch,fsdp2,fs,fs-fused,torch-compile,fs-compile")
    parser.add_argument("--analyze", default="fs-fused,fs-offload,fs-offload-remat",
                        help="the fs arms whose memory fs.analysis predicts (comma list; the first present one's time is simulated too)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--calibrate", action="store_true", help="calibrate the simulator here and predict the fs step")
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each arm under torch.profiler: device time by kernel class, top kernels, "
                             "the host time, and a Chrome trace per arm next to --out")  # fmt: skip
    parser.add_argument("--profile-arms", default=None, help="profile these arms only (comma list; default every arm)")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    results: dict = {"argv": sys.argv[1:], "torch": torch.__version__}
    mesh = fs.init_mesh({"fsdp": 1})
    device = mesh.device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        results["gpu"] = torch.cuda.get_device_name(device)
    config = LlamaConfig(**SIZES[args.size], max_position_embeddings=args.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config)
    n = sum(p.numel() for p in base.parameters())
    tokens = args.batch * args.seq
    flops_per_token = 6 * n + 12 * config.num_hidden_layers * config.hidden_size * args.seq
    batch = (torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device),)
    log(results, args.out, parameters=n, tokens_per_step=tokens, flops_per_token=flops_per_token)
    print(f"{n / 1e9:.3f}B parameters, {tokens} tokens per step, device {results.get('gpu', device)}", flush=True)

    arms = {}
    for name in args.arms.split(","):
        start = time.perf_counter()
        try:
            module = copy.deepcopy(base)
            if name in ("torch", "torch-compile", "fsdp2"):
                arms[name] = TorchArm(module, batch, kind=name)
            elif name == "fs":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule())
            elif name == "fs-fused":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(), fused=True)
            elif name == "fs-offload":  # everything offloaded, the update streamed on the device
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(offload=True), fused=True)
            elif name == "fs-offload-remat":  # ... and every unit rematerialized (activations are most of the peak)
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(offload=True, remat=True), fused=True)
            elif name == "fs-zero1":  # ZeRO-1: parameters kept whole between steps, one all-gather after the update
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(reshard_after_update=False), fused=True)
            elif name == "fs-offload-host":  # everything offloaded, the update on the host (torch's fused CPU AdamW)
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(offload=fs.schedule.Offload(update="host")), fused=True)
            elif name == "fs-remat":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(remat=True), fused=True)
            elif name == "fs-compile":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(compile=True))
            elif name == "fs-fused-compile":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(compile=True), fused=True)
            for _ in range(args.warmup):
                timed(arms[name], device)
            log(results, args.out, **{f"setup_s/{name}": time.perf_counter() - start})
            if isinstance(arms[name], FsArm):  # what fs.schedule.causal_masks did with each attention mask
                log(results, args.out, **{f"attention_masks/{name}": [
                    line for line in arms[name].step.explain().splitlines() if line.startswith("attention mask")]})
            print(f"{name}: set up and warmed in {time.perf_counter() - start:.1f} s", flush=True)
        except Exception as error:  # one arm's failure is a result, not the end of the run
            arms.pop(name, None)
            log(results, args.out, **{f"error/{name}": f"{type(error).__name__}: {error}"})
            print(f"{name}: FAILED {type(error).__name__}: {error}", flush=True)
        del module
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del base

    times: dict = {name: [] for name in arms}
    peaks: dict = {name: 0 for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            for _ in range(args.steps):
                seconds, peak = timed(arm, device)
                times[name].append(seconds)
                peaks[name] = max(peaks[name], peak)
    rows = {}
    for name in arms:
        median = statistics.median(times[name])
        rows[name] = dict(
            step_s=median, spread=(min(times[name]), max(times[name])), tokens_per_s=tokens / median,
            mfu=flops_per_token * tokens / median / PEAK_BF16, peak_bytes=peaks[name], resident_bytes=arms[name].resident(),
        )
    log(results, args.out, arms=rows)
    if args.profile:
        chosen = args.profile_arms.split(",") if args.profile_arms else list(arms)
        log(results, args.out, profile={name: profile_step(name, arm, device, args.out) for name, arm in arms.items() if name in chosen})

    analyzed = [a for a in args.analyze.split(",") if a in arms] or [a for a in arms if a.startswith("fs")][:1]
    arm = None  # the timing loop's last arm
    for name in [a for a in arms if a not in analyzed]:  # the analysis traces on the device: room for it
        del arms[name]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    machine = None
    for i, name in enumerate(analyzed):
        fs_arm = arms[name]
        try:
            compiled = fs_arm.step.lower(fs_arm.state, batch)
            predicted = fs.analysis.simulate(compiled, fs.analysis.h100_sxm(world_size=1))
            extra = dict(predicted_peak=predicted.memory.peak, predicted_resident=predicted.memory.resident,
                         predicted_host_resident=getattr(predicted.memory, "host_resident", 0),
                         predicted_peak_node=predicted.memory.peak_node, h100_datasheet_step_s=predicted.step_s)
            if args.calibrate:
                if machine is None:
                    start = time.perf_counter()
                    machine = fs.analysis.calibrate(mesh)
                    extra["calibrate_s"] = time.perf_counter() - start
                    if args.out is not None:
                        machine.save(str(args.out.with_suffix(".machine.json")))
                calibrated = fs.analysis.simulate(compiled, machine)
                extra.update(calibrated_step_s=calibrated.step_s, calibrated_compute_s=calibrated.compute_s,
                             calibrated_phases=calibrated.phases, machine_matmul=machine.matmul_flops[-3:],
                             machine_scale=machine.matmul_dtype_scale, machine_attention=machine.attention_flops)
            log(results, args.out, fs_analysis={**results.get("fs_analysis", {}), name: extra})
        except Exception as error:
            log(results, args.out, **{f"error/analysis/{name}": f"{type(error).__name__}: {error}"})
            print(f"analysis of {name}: FAILED {type(error).__name__}: {error}", flush=True)

    print(f"\n{'arm':<14} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs torch':>9}")
    base_s = rows.get("torch", {}).get("step_s")
    for name, r in rows.items():
        ratio = f"{r['step_s'] / base_s:.3f}x" if base_s else "-"
        print(f"{name:<14} {r['step_s']:8.4f} {r['tokens_per_s']:10.0f} {r['mfu'] * 100:5.1f}% {r['peak_bytes'] / 2**30:9.2f} {ratio:>9}")
    for name, a in results.get("fs_analysis", {}).items():
        measured = rows[name]
        print(f"fs.analysis of {name}: predicted peak {a['predicted_peak'] / 2**30:.2f} GiB vs measured {measured['peak_bytes'] / 2**30:.2f} GiB "
              f"({(a['predicted_peak'] / max(measured['peak_bytes'], 1) - 1) * 100:+.1f}%); host {a['predicted_host_resident'] / 2**30:.2f} GiB")
        if "calibrated_step_s" in a:
            print(f"  simulated step {a['calibrated_step_s']:.4f} s (calibrated here) vs measured {measured['step_s']:.4f} s "
                  f"({(a['calibrated_step_s'] / measured['step_s'] - 1) * 100:+.1f}%)")
    fs.shutdown()


if __name__ == "__main__":
    main()
