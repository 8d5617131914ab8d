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
  `remat=True` (the peak is mostly activations), and remat alone for its cost.

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


def profile_step(name: str, arm, device, out: Path | None) -> dict:
    """One step of `arm` under torch.profiler: device (or CPU) time per kernel class, the ten
    costliest kernels, the step's wall time, and a Chrome trace `<out>.<arm>.trace.json`."""
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
    kernels = [(e.key, getattr(e, attr, 0.0) or 0.0) for e in events if (getattr(e, attr, 0.0) or 0.0) > 0]
    if device.type != "cuda":
        kernels = [(k, t) for k, t in kernels if k.startswith("aten::")]
    classes: dict = {}
    for key, us in kernels:
        lowered = key.lower()
        kind = next((c for c, words in KERNEL_CLASSES if any(w in lowered for w in words)), "elementwise/other")
        classes[kind] = classes.get(kind, 0.0) + us / 1e3
    if out is not None:
        prof.export_chrome_trace(str(out.with_suffix(f".{name}.trace.json")))
    top = sorted(kernels, key=lambda kv: -kv[1])[:10]
    print(f"{name}: wall {wall * 1e3:.1f} ms; ms by class " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])), flush=True)
    return {"wall_ms": wall * 1e3, "ms_by_class": classes, "top_kernels_ms": [(k[:120], t / 1e3) for k, t in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--arms", default="torch,fsdp2,fs,fs-fused,torch-compile,fs-compile")
    parser.add_argument("--analyze", default="fs-fused", help="the fs arm whose memory and time fs.analysis predicts (else the first fs arm)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--calibrate", action="store_true", help="calibrate the simulator here and predict the fs step")
    parser.add_argument("--profile", action="store_true",
                        help="one more step of each arm under torch.profiler: device time by kernel class, top kernels, "
                             "the host time, and a Chrome trace per arm next to --out")  # fmt: skip
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
            elif name == "fs-remat":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(remat=True), fused=True)
            elif name == "fs-compile":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(compile=True))
            elif name == "fs-fused-compile":
                arms[name] = FsArm(module, batch, mesh, schedule=fs.Schedule(compile=True), fused=True)
            for _ in range(args.warmup):
                timed(arms[name], device)
            log(results, args.out, **{f"setup_s/{name}": time.perf_counter() - start})
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
        log(results, args.out, profile={name: profile_step(name, arm, device, args.out) for name, arm in arms.items()})

    analyzed = args.analyze if args.analyze in arms else next((a for a in arms if a.startswith("fs")), None)
    if analyzed is not None:
        fs_arm = arms[analyzed]
        try:
            compiled = fs_arm.step.lower(fs_arm.state, batch)
            analysis_machine = fs.analysis.h100_sxm(world_size=1)
            predicted = fs.analysis.simulate(compiled, analysis_machine)
            extra = dict(predicted_peak=predicted.memory.peak, predicted_resident=predicted.memory.resident,
                         predicted_peak_node=predicted.memory.peak_node, h100_datasheet_step_s=predicted.step_s)
            if args.calibrate:
                start = time.perf_counter()
                machine = fs.analysis.calibrate(mesh)
                extra["calibrate_s"] = time.perf_counter() - start
                if args.out is not None:
                    machine.save(str(args.out.with_suffix(".machine.json")))
                calibrated = fs.analysis.simulate(compiled, machine)
                extra.update(calibrated_step_s=calibrated.step_s, calibrated_compute_s=calibrated.compute_s,
                             calibrated_phases=calibrated.phases, machine_matmul=machine.matmul_flops[-3:],
                             machine_scale=machine.matmul_dtype_scale, machine_attention=machine.attention_flops)
            log(results, args.out, fs_analysis=dict(extra, arm=analyzed))
        except Exception as error:
            log(results, args.out, **{"error/analysis": f"{type(error).__name__}: {error}"})
            print(f"analysis: FAILED {type(error).__name__}: {error}", flush=True)

    print(f"\n{'arm':<14} {'s/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'vs torch':>9}")
    base_s = rows.get("torch", {}).get("step_s")
    for name, r in rows.items():
        ratio = f"{r['step_s'] / base_s:.3f}x" if base_s else "-"
        print(f"{name:<14} {r['step_s']:8.4f} {r['tokens_per_s']:10.0f} {r['mfu'] * 100:5.1f}% {r['peak_bytes'] / 2**30:9.2f} {ratio:>9}")
    if "fs_analysis" in results:
        a = results["fs_analysis"]
        measured = rows[a["arm"]]
        print(f"fs.analysis of the {a['arm']} arm:")
        print(f"fs predicted peak {a['predicted_peak'] / 2**30:.2f} GiB vs measured {measured['peak_bytes'] / 2**30:.2f} GiB "
              f"({(a['predicted_peak'] / max(measured['peak_bytes'], 1) - 1) * 100:+.1f}%)")
        if "calibrated_step_s" in a:
            print(f"fs simulated step {a['calibrated_step_s']:.4f} s (calibrated here) vs measured {measured['step_s']:.4f} s "
                  f"({(a['calibrated_step_s'] / measured['step_s'] - 1) * 100:+.1f}%)")
    fs.shutdown()


if __name__ == "__main__":
    main()
