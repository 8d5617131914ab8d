"""fs's tensor parallelism against torch's, on a Hugging Face Llama built from a `LlamaConfig`.

    python benchmarks/tensor_parallel.py                      # {"tp": 2} and {"fsdp": 2, "tp": 2}, ~5 min on 2 cores
    python benchmarks/tensor_parallel.py --meshes tp2 --steps 10 --warmup 2   # a quick look

Arms, one launch per mesh, built from the same initial weights, stepped on the same batches,
interleaved step by step (the order rotating every step, as benchmarks/compare.py does):

  fs                    `fs.tensor_parallel.parallelize(model, hf_rules(model), mesh)` (the model's
                        own `base_model_tp_plan`, `lm_head` column-parallel with its logits
                        gathered), `fs.sharded_step(..., placements=rules, donate=True)`, traced
                        (the default schedule: prefetch 1, reshard after forward), `fs.optim.adamw`
  torch TP (+ FSDP2)    `parallelize_module` on the "tp" dimension of a `DeviceMesh` with the same
                        plan: `ColwiseParallel()` for q/k/v/gate/up, `RowwiseParallel()` for o/down,
                        `ColwiseParallel(output_layouts=Replicate())` for lm_head; with an "fsdp"
                        axis, then `fully_shard(layer, mesh=mesh["fsdp"])` for every decoder layer
                        and `fully_shard(model, mesh=mesh["fsdp"])` (FSDP2's defaults);
                        `torch.optim.AdamW(foreach=False)`
  torch TP + FSDP2 prefetch+async
                        (fsdp meshes) the same with FSDP2's best CPU configuration of
                        docs/benchmarks.md: explicit prefetch one layer ahead, asynchronous unshards
  ... loss parallel     (`--loss-parallel`) the head's logits stay split along the vocabulary: fs
                        `parallelize(..., loss_parallel=True)` and `vocab_parallel_cross_entropy`;
                        torch `ColwiseParallel(use_local_output=False)` and `F.cross_entropy` under
                        `torch.distributed.tensor.parallel.loss_parallel()`

Every rank pins one thread. A data rank's batch at step s is a pure function of (seed, data
rank, s): the ranks of one tp group see the same batch, and every arm the same data. Printed
per arm: median step time (the slowest rank's wall time of each step) and IQR, × torch's
fastest arm, peak memory per rank (`MemTracker`, one untimed step, the largest rank's; the same
measure as benchmarks/compare.py), the loss at the first and the last step, and how far the
parameters are after the run from one process training the plain model with `torch.optim.AdamW`
on the concatenation of every data rank's batches (max |p - p_ref| / max |p_ref|).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.data import CharTokenizer, batches, load_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import machine_line  # noqa: E402
from _arms import Hyper, _tune_fsdp2  # noqa: E402  (benchmarks/ is not a package)
from _gpt import cpu_total  # noqa: E402

MESHES = {"tp2": {"tp": 2}, "fsdp2xtp2": {"fsdp": 2, "tp": 2}}


@dataclass(frozen=True)
class Config:
    """One launch's run; identical on every rank."""

    axes: dict
    steps: int = 20
    warmup: int = 3
    batch_size: int = 4  # sequences per data rank
    seq_len: int = 128
    hidden_size: int = 256
    intermediate_size: int = 688  # Llama's 11008 / 4096 ratio
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    seed: int = 0
    loss_parallel: bool = False
    fsdp2_tuned: bool = True
    reference: bool = True
    attention: str = "sdpa"  # or "causal": see build_llama


# --- model and data -----------------------------------------------------------------------------


def _tokens() -> tuple[torch.Tensor, int]:
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    return tokenizer.encode(text), tokenizer.vocab_size


def _causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with `is_causal=True` and grouped-query heads as they are, whatever mask it is given:
    what transformers' "sdpa" runs in eager when there is no padding (the batches here have
    none). Under fs's traced step transformers sees `torch.compiler.is_compiling()` and passes an
    explicit causal mask instead (and repeats the key/value heads): `--attention causal` makes
    both arms run this same attention, to compare the tensor parallelism alone."""
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def build_llama(config: Config, vocab: int) -> nn.Module:
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    if config.attention == "causal":
        AttentionInterface.register("causal", _causal_attention)

    # The vocabulary rounded up to a multiple of 64 (the head is split along it).
    model_config = LlamaConfig(
        vocab_size=-(-vocab // 64) * 64,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=config.attention,
    )
    torch.manual_seed(config.seed)
    return LlamaForCausalLM(model_config)


def batch_of(tokens: torch.Tensor, config: Config, data_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1009 + data_rank)
    return batches(tokens, config.batch_size, config.seq_len, generator=generator)


# --- arms ---------------------------------------------------------------------------------------


class FsArm:
    def __init__(self, name: str, base: nn.Module, mesh, hyper: Hyper, *, loss_parallel: bool):
        self.name = name
        model = copy.deepcopy(base)
        rules = tp.hf_rules(model)
        tp.parallelize(model, rules, mesh, loss_parallel=loss_parallel)
        apply_fn, params = fs.functionalize(model)

        def loss_fn(p, batch):
            x, y = batch
            logits = apply_fn(p, input_ids=x).logits
            if loss_parallel:
                return tp.vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), mesh, "tp")
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        self.step_fn = fs.sharded_step(loss_fn, mesh, optimizer=hyper.fs_adamw(), placements=rules, donate=True)
        self.state = self.step_fn.init(params)

    def step(self, batch) -> torch.Tensor:
        self.state, metrics = self.step_fn(self.state, batch)
        return metrics["loss"]  # the mean over data ranks

    def memory_roots(self):
        return list(fs.tree_leaves(self.state))

    def full_params(self) -> dict[str, torch.Tensor]:
        return dict(fs.gather(self.state.params, full=True).trainable)


def torch_plan(model: nn.Module, *, loss_parallel: bool) -> dict:
    """Hugging Face's `base_model_tp_plan` for Llama as DTensor styles, module by module."""
    plan = {}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    plan["lm_head"] = ColwiseParallel(use_local_output=False) if loss_parallel else ColwiseParallel(output_layouts=Replicate())
    return plan


class TorchTpArm:
    def __init__(self, name: str, base: nn.Module, device_mesh, hyper: Hyper, *, loss_parallel: bool, fsdp: str | None):
        self.name = name
        self.loss_parallel = loss_parallel
        model = copy.deepcopy(base)
        tp_mesh = device_mesh["tp"] if device_mesh.ndim > 1 else device_mesh
        parallelize_module(model, tp_mesh, torch_plan(model, loss_parallel=loss_parallel))
        self.fsdp_size = 1
        if fsdp is not None:
            layers = list(model.model.layers)
            for layer in layers:
                fully_shard(layer, mesh=device_mesh["fsdp"])
            fully_shard(model, mesh=device_mesh["fsdp"])
            self.fsdp_size = device_mesh["fsdp"].size()
            if fsdp == "tuned":
                _tune_fsdp2(model, layers, 1)
        self.group = device_mesh["fsdp"].get_group() if fsdp is not None else None
        self.model = model
        self.optimizer = hyper.torch_adamw(model.parameters())

    def step(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        if self.loss_parallel:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        else:
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # this data rank's: averaged over them after the run

    def memory_roots(self):
        return [self.model, self.optimizer]

    def full_params(self) -> dict[str, torch.Tensor]:
        return {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in self.model.named_parameters()
        }


# --- one rank -------------------------------------------------------------------------------------


def _timed(mesh, arm, batch) -> tuple[float, torch.Tensor]:
    mesh.all_reduce_flat(torch.zeros(1))  # start together
    start = time.perf_counter()
    loss = arm.step(batch)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    return float(mesh.all_gather_world(elapsed).max()), loss


def _peak(mesh, arm, batch) -> list[int]:
    tracker = MemTracker()
    tracker.track_external(*arm.memory_roots(), *batch)
    mesh.all_reduce_flat(torch.zeros(1))
    with tracker:
        arm.step(batch)
    return mesh.all_gather_world(torch.tensor([cpu_total(tracker, "peak")], dtype=torch.int64)).tolist()


def _reference(base: nn.Module, tokens, config: Config, data_size: int, hyper: Hyper, steps: int):
    """One process, the plain model, the concatenation of every data rank's batch."""
    model = copy.deepcopy(base)
    optimizer = hyper.torch_adamw(model.parameters())
    losses = []
    for step in range(steps):
        parts = [batch_of(tokens, config, r, step) for r in range(data_size)]
        x, y = (torch.cat(t) for t in zip(*parts))
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def run(config: Config) -> dict:
    torch.set_num_threads(1)
    # FSDP2 warns on every forward that the root returns a view (the logits); nothing here writes to it.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    # DTensor.full_tensor of a TP + FSDP2 parameter (_StridedShard) warns that it gathers twice (once, after the run).
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = fs.init_mesh(config.axes)
    names = tuple(config.axes)
    device_mesh = init_device_mesh("cpu", tuple(config.axes.values()), mesh_dim_names=names)
    hyper = Hyper()
    tokens, vocab = _tokens()
    base = build_llama(config, vocab)
    fsdp = "fsdp" in config.axes
    heads = [("", False)] + ([(" loss parallel", True)] if config.loss_parallel else [])
    arms = []
    for suffix, lp in heads:
        arms.append(FsArm("fs" + suffix, base, mesh, hyper, loss_parallel=lp))
        if fsdp:
            arms.append(TorchTpArm("torch TP + FSDP2" + suffix, base, device_mesh, hyper, loss_parallel=lp, fsdp="default"))
            if config.fsdp2_tuned:
                arms.append(TorchTpArm("torch TP + FSDP2 prefetch+async" + suffix, base, device_mesh, hyper,
                                       loss_parallel=lp, fsdp="tuned"))
        else:
            arms.append(TorchTpArm("torch TP" + suffix, base, device_mesh, hyper, loss_parallel=lp, fsdp=None))
    times = {a.name: [] for a in arms}
    losses = {a.name: [] for a in arms}
    total = config.warmup + config.steps
    for i in range(total):
        batch = batch_of(tokens, config, mesh.data_rank, i)
        shift = i % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            elapsed, loss = _timed(mesh, arm, batch)
            losses[arm.name].append(loss)
            if i >= config.warmup:
                times[arm.name].append(elapsed)
        if mesh.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')} {config.axes}] step {i + 1}/{total}", file=sys.stderr, flush=True)
    # Losses: fs's is the mean over data ranks already; torch's per data rank, averaged here.
    curves = {}
    for arm in arms:
        values = torch.stack([l.float().reshape(()) for l in losses[arm.name]])
        if not arm.name.startswith("fs"):
            values = mesh.all_reduce_flat(values.clone(), mesh.data_axes) / mesh.data_size if mesh.data_axes else values
        curves[arm.name] = values.tolist()
    full = {arm.name: arm.full_params() for arm in arms}  # collectives: every rank, same order
    memory_batch = batch_of(tokens, config, mesh.data_rank, total)
    peaks = {arm.name: _peak(mesh, arm, memory_batch) for arm in arms}
    result = None
    if mesh.rank == 0:
        result = {"arms": {}, "params": sum(p.numel() for p in base.parameters()), "vocab": base.config.vocab_size}
        ref_losses, ref = (None, None)
        if config.reference:
            ref_losses, ref = _reference(base, tokens, config, mesh.data_size, hyper, total)
            scale = max(float(p.abs().max()) for p in ref.values())
            result["reference_losses"] = ref_losses
        for arm in arms:
            entry = {"times_s": times[arm.name], "losses": curves[arm.name], "peak_bytes_per_rank": peaks[arm.name]}
            if ref is not None:
                worst = max(float((full[arm.name][k] - p).abs().max()) for k, p in ref.items())
                entry["max_param_diff_rel"] = worst / scale
            result["arms"][arm.name] = entry
    mesh.all_reduce_flat(torch.zeros(1))  # the others wait for the reference
    return result


# --- report ---------------------------------------------------------------------------------------


def _is_fs(name: str) -> bool:
    return name.startswith("fs")


def table(label: str, config: Config, result: dict) -> str:
    """The results of one launch as a markdown table (the docs' format)."""
    arms = result["arms"]
    medians = {n: statistics.median(a["times_s"]) for n, a in arms.items()}
    torch_best = min(m for n, m in medians.items() if not _is_fs(n))
    lines = [
        f"**{label}** `{config.axes}`, attention `{config.attention}`: {config.steps} timed steps after "
        f"{config.warmup}, batch {config.batch_size} x {config.seq_len} tokens per data rank",
        "",
        "| arm | median ms | IQR ms | × torch best | peak MiB/rank | loss step 1 | loss step N | max param diff (rel) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, a in arms.items():
        q = statistics.quantiles(a["times_s"], n=4)
        diff = f"{a['max_param_diff_rel']:.2e}" if "max_param_diff_rel" in a else ""
        lines.append(
            f"| {name} | {1e3 * medians[name]:.1f} | {1e3 * (q[2] - q[0]):.1f} | {medians[name] / torch_best:.2f} | "
            f"{max(a['peak_bytes_per_rank']) / 2**20:.1f} | {a['losses'][0]:.4f} | {a['losses'][-1]:.4f} | {diff} |"
        )
    if "reference_losses" in result:
        ref = result["reference_losses"]
        lines.append(f"| one process, plain model (reference) |  |  |  |  | {ref[0]:.4f} | {ref[-1]:.4f} | 0 |")
    return "\n".join(lines)


def targets(label: str, config: Config, result: dict) -> list[str]:
    """Issue 26's performance targets for each fs arm: step time <= 0.9 x torch's fastest arm of the
    same loss (gathered logits or loss parallel), peak memory <= every such torch arm's."""
    arms = result["arms"]
    lines = []
    for name, a in arms.items():
        if not _is_fs(name):
            continue
        peers = {n: p for n, p in arms.items() if not _is_fs(n) and n.endswith("loss parallel") == name.endswith("loss parallel")}
        mine = statistics.median(a["times_s"])
        fastest = min(peers, key=lambda n: statistics.median(peers[n]["times_s"]))
        ratio = mine / statistics.median(peers[fastest]["times_s"])
        peak = max(a["peak_bytes_per_rank"])
        smallest = min(peers, key=lambda n: max(peers[n]["peak_bytes_per_rank"]))
        theirs = max(peers[smallest]["peak_bytes_per_rank"])
        lines.append(
            f"- {label}, {config.attention}, `{name}`: step time {ratio:.2f} x `{fastest}` (target <= 0.90: "
            f"{'met' if ratio <= 0.9 else 'missed'}); peak {peak / 2**20:.1f} MiB vs `{smallest}` "
            f"{theirs / 2**20:.1f} MiB (target <=: {'met' if peak <= theirs else 'missed'})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", choices=list(MESHES), default=list(MESHES))
    parser.add_argument("--attention", nargs="+", choices=["sdpa", "causal"], default=["sdpa", "causal"],
                        help="transformers' sdpa, and/or causal SDPA in both arms (see _causal_attention); "
                        "one launch per mesh and attention")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per data rank")
    parser.add_argument("--loss-parallel", action="store_true", help="also the loss-parallel arms")
    parser.add_argument("--no-fsdp2-tuned", action="store_true", help="leave out FSDP2 prefetch+async")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process reference")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args()
    began = time.time()
    print(f"Machine: {machine_line()}")
    print(f"Command: python {' '.join(sys.argv)}")
    raw, goals = [], []
    for label in args.meshes:
        for attention in args.attention:
            axes = MESHES[label]
            config = Config(axes=axes, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                            loss_parallel=args.loss_parallel, fsdp2_tuned=not args.no_fsdp2_tuned,
                            reference=not args.no_reference, attention=attention)
            world = 1
            for size in axes.values():
                world *= size
            result = fs.launch(run, world_size=world, args=(config,), threads_per_rank=1)
            if not raw:
                print(f"Llama: {result['params']:,} parameters (hidden {config.hidden_size}, intermediate "
                      f"{config.intermediate_size}, {config.num_layers} layers, {config.num_heads} heads, "
                      f"{config.num_kv_heads} key/value heads, vocabulary {result['vocab']}, untied head)\n")
            raw.append({"mesh": label, "config": asdict(config), "result": result})
            print(table(label, config, result), flush=True)
            print()
            goals += targets(label, config, result)
    print("Targets:")
    print("\n".join(goals))
    print(f"\n{(time.time() - began) / 60:.1f} min")
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
