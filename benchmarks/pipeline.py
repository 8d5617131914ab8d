"""fs's pipeline parallelism against `torch.distributed.pipelining`, on a GPT and a Hugging Face Llama.

    python benchmarks/pipeline.py                     # {"pp": 2} and {"pp": 4}, GPT and Llama (~15 min on 2 cores)
    python benchmarks/pipeline.py --meshes pp2 --models gpt --steps 5 --warmup 1   # a quick look
    python benchmarks/pipeline.py --quick             # smoke check: a tiny GPT, {"pp": 2}, 2 steps (~15-20 s)

One launch per mesh and model (gloo, one thread per rank). Every arm is built
from the same initial weights and stepped on the same batches, interleaved step by step (arm 1's
step k, arm 2's step k, ..., the order rotating by one every step, as benchmarks/compare.py does):

  torch GPipe / 1F1B / Interleaved1F1B / InterleavedZeroBubble / ZBVZeroBubble
                        `torch.distributed.pipelining`: the model split by hand into one
                        `nn.Module` per stage (embeddings + the first blocks, ..., the last blocks
                        + final norm + head), `PipelineStage(submodule, i, n, cpu)` for each of
                        this rank's stages, `ScheduleGPipe` / `Schedule1F1B` /
                        `ScheduleInterleavedZeroBubble` (one stage per rank: ZB-H1's order),
                        `ScheduleInterleaved1F1B` (two per rank, stage s on rank s % P) or
                        `ScheduleZBVZeroBubble` (two per rank in a V: stages r and 2P-1-r),
                        `loss_fn` = the micro-batch's mean cross-entropy (torch divides the summed
                        gradients by the micro-batch count: `scale_grads=True`), then
                        `torch.optim.AdamW(foreach=False)` over this rank's stages
  fs gpipe / 1f1b / interleaved_1f1b / zb_h1 / zbv
                        `fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(...),
                        microbatches=M, pipeline=fs.pipeline.Pipeline(name), donate=True)`: one
                        `loss_fn` of the whole model, traced and cut into the same stages (fs's
                        default cut: the blocks split evenly, embeddings on the first stage, final
                        norm and head on the last, which is how the torch stages are cut); transfers
                        overlapped (the default `fs.Schedule()`); interleaved and zbv with 2 stages
                        per rank

Every rank pins one thread; every arm sees the same global batch at step s (a pure function of
(seed, s)); every pipeline rank passes it (torch: rank 0 the inputs, the last stage's rank the
targets). Printed per arm: median step time (the slowest rank's wall time of each step) and IQR,
× the fastest torch schedule, × torch's same schedule, peak memory per rank (`MemTracker`, one
untimed step after the timed ones, the largest rank's; the same measure as
benchmarks/compare.py: the arm's long-lived state — fs: every tensor of the `StepState`; torch:
the stage modules, the optimizer and the stages' persistent receive buffers — plus the batch,
then every tensor made during the step), the loss at the first and the last step, the largest
|loss - reference| over the steps (the reference: one process training the plain model with
`torch.optim.AdamW` on the whole batch), and the trainable parameters per rank (the same stage
cut on both sides).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import functional_shard as fs
from functional_shard.data import CharTokenizer, load_text
from functional_shard.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _arms import Hyper  # noqa: E402  (benchmarks/ is not a package)
from _gpt import cpu_total  # noqa: E402
from _report import machine_line  # noqa: E402

MESHES = {"pp2": {"pp": 2}, "pp4": {"pp": 4}}
MODELS = ("gpt", "llama")
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                   "zb_h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}  # fmt: skip
TORCH_NAMES = {"gpipe": "torch GPipe", "1f1b": "torch 1F1B", "interleaved_1f1b": "torch Interleaved1F1B",
               "zb_h1": "torch InterleavedZeroBubble", "zbv": "torch ZBVZeroBubble"}  # fmt: skip
FS_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_h1": 1, "zbv": 2}
MULTI = ("interleaved_1f1b", "zb_h1", "zbv")  # torch schedules that take a list of stages
# "<schedule>+compile" arms (not run by default): torch.compile (inductor) on both sides. fs:
# fs.Schedule(compile=True), each stage program compiled whole; torch: each block of each stage
# module compiled (`block.compile()`, torchtitan's apply_compile under pipelining). Whole-backward
# schedules only: fs refuses compile with an I/W split.
COMPILE = "+compile"
COMPILABLE = ("gpipe", "1f1b", "interleaved_1f1b")
FS_CHOICES = FS_SCHEDULES + tuple(s + COMPILE for s in COMPILABLE)
TORCH_CHOICES = tuple(TORCH_SCHEDULES) + tuple(s + COMPILE for s in COMPILABLE)


def schedule_of(arm: str) -> tuple[str, bool]:
    """'1f1b+compile' -> ('1f1b', True)."""
    return arm.removesuffix(COMPILE), arm.endswith(COMPILE)


def torch_name(arm: str) -> str:
    schedule, compiled = schedule_of(arm)
    return TORCH_NAMES[schedule] + (COMPILE if compiled else "")


@dataclass(frozen=True)
class Config:
    """One launch's run; identical on every rank."""

    axes: dict
    models: tuple = MODELS
    steps: int = 10
    warmup: int = 2
    batch_size: int = 16  # sequences per step (the global batch: there is no data axis)
    microbatches: int = 8
    seq_len: int = 128
    d_model: int = 256
    n_layer: int = 8
    n_head: int = 4  # GPT; Llama: 8 heads, 4 key/value heads
    intermediate: int = 688  # Llama's MLP (11008 / 4096 of d_model)
    seed: int = 0
    reference: bool = True
    fs_schedules: tuple = FS_SCHEDULES
    torch_schedules: tuple = tuple(TORCH_SCHEDULES)


QUICK = dict(steps=2, warmup=1, batch_size=8, microbatches=4, seq_len=32, d_model=32, n_layer=8, n_head=2,
             intermediate=64)  # fmt: skip


# --- models, stages and data ---------------------------------------------------------------------


def _corpus() -> tuple[torch.Tensor, int]:
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    return tokenizer.encode(text), tokenizer.vocab_size


def _causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA with `is_causal=True` and grouped-query heads as they are, whatever mask it is given:
    what transformers' "sdpa" runs in eager without padding. Registered as the Llama's attention
    so that both sides run the same kernel (under fs's trace transformers would otherwise build an
    explicit mask and repeat the key/value heads; benchmarks/tensor_parallel.py's `--attention`)."""
    out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def build_model(name: str, config: Config, vocab: int) -> nn.Module:
    torch.manual_seed(config.seed)
    if name == "gpt":
        return GPT(GPTConfig(vocab_size=vocab, block_size=config.seq_len, n_layer=config.n_layer, n_head=config.n_head,
                             d_model=config.d_model, tie_weights=False))  # fmt: skip
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("causal", _causal_attention)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=-(-vocab // 64) * 64, hidden_size=config.d_model, intermediate_size=config.intermediate,
        num_hidden_layers=config.n_layer, num_attention_heads=2 * config.n_head, num_key_value_heads=config.n_head,
        max_position_embeddings=config.seq_len, tie_word_embeddings=False, use_cache=False,
        attn_implementation="causal",
    ))  # fmt: skip


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.blocks if isinstance(model, GPT) else model.model.layers


def stage_blocks(n_blocks: int, num_stages: int) -> list[range]:
    """The blocks of each stage: split as evenly as possible, the first stages taking one more
    (fs's default cut, `fs.pipeline.Pipeline(stages="blocks")`)."""
    per, extra = divmod(n_blocks, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = per + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class GPTStage(nn.Module):
    """Stage s of a `fs.models.GPT`: the embeddings (first stage), its blocks, `ln_f` and the head (last)."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


class LlamaStage(nn.Module):
    """Stage s of a `LlamaForCausalLM`: `embed_tokens` (first stage), its decoder layers with the
    rotary embedding every stage recomputes (a buffer), `norm` and `lm_head` (last)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed_tokens = model.model.embed_tokens
        self.rotary_emb = model.model.rotary_emb
        self.layers = nn.ModuleList(model.model.layers[i] for i in blocks)
        if last:
            self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.first else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.lm_head(self.norm(h)) if self.last else h


def blocks_of_stage(stage: nn.Module) -> nn.ModuleList:
    return stage.blocks if isinstance(stage, GPTStage) else stage.layers


def make_stage(model: nn.Module, s: int, num_stages: int) -> nn.Module:
    """Stage `s` of `num_stages` of a copy of `model`."""
    model = copy.deepcopy(model)
    blocks = stage_blocks(len(blocks_of(model)), num_stages)[s]
    kind = GPTStage if isinstance(model, GPT) else LlamaStage
    return kind(model, blocks, s == 0, s == num_stages - 1)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x) if isinstance(model, GPT) else model(input_ids=x).logits


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch_of(tokens: torch.Tensor, config: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1009)
    starts = torch.randint(0, len(tokens) - config.seq_len - 1, (config.batch_size,), generator=generator)
    x = torch.stack([tokens[i : i + config.seq_len] for i in starts.tolist()])
    y = torch.stack([tokens[i + 1 : i + 1 + config.seq_len] for i in starts.tolist()])
    return x, y


# --- arms ---------------------------------------------------------------------------------------


class FsArm:
    def __init__(self, schedule: str, base: nn.Module, mesh, hyper: Hyper, config: Config, batch):
        self.name = f"fs {schedule}"
        model = copy.deepcopy(base)
        apply_fn, params = fs.functionalize(model)

        def loss_fn(p, batch):
            x, y = batch
            logits = apply_fn(p, x) if isinstance(model, GPT) else apply_fn(p, input_ids=x).logits
            return cross_entropy(logits, y)

        schedule, compiled = schedule_of(schedule)
        pipeline = fs.pipeline.Pipeline(schedule, stages_per_rank=STAGES_PER_RANK[schedule])
        self.step_fn = fs.sharded_step(loss_fn, mesh, optimizer=hyper.fs_adamw(), microbatches=config.microbatches,
                                       pipeline=pipeline, donate=True, schedule=fs.Schedule(compile=compiled))  # fmt: skip
        self.state = self.step_fn.init(params)
        self.params = sum(spec.numel for spec in self.state.params.layout.buffers if spec.trainable)
        # Trace and cut loss_fn now, before any arm's first step: fs counts its own point-to-point
        # transfers among the collectives its ranks must agree on, which differ between the middle
        # and the end ranks at pp >= 3, so a rank that comes to a step's agreement late (tracing
        # on a loaded machine) after some transfers is taken for one that issued a collective of
        # its own (a PeerError). Every rank traces at the same point here, before any transfer.
        if hasattr(self.step_fn, "stage_cut"):
            self.step_fn.stage_cut(self.state, batch)

    def step(self, batch) -> torch.Tensor:
        self.state, metrics = self.step_fn(self.state, batch)
        return metrics["loss"]  # the mean over micro-batches, on every rank

    def memory_roots(self) -> list:
        return list(fs.tree_leaves(self.state))


class TorchArm:
    def __init__(self, schedule: str, base: nn.Module, mesh, hyper: Hyper, config: Config, group):
        self.name = torch_name(schedule)
        schedule, compiled = schedule_of(schedule)
        P, rank = mesh.shape["pp"], mesh.coordinates["pp"]
        v = STAGES_PER_RANK[schedule]
        n = P * v
        # the looped placement (torch's and fs's), or ZB-V's: rank r holds stages r and 2P-1-r
        self.indices = [rank, 2 * P - 1 - rank] if schedule == "zbv" else [rank + k * P for k in range(v)]
        self.modules = [make_stage(base, s, n) for s in self.indices]
        if compiled:
            for m in self.modules:
                for block in blocks_of_stage(m):
                    block.compile(backend="inductor")
        self.stages = [PipelineStage(m, s, n, torch.device("cpu"), group=group)
                       for m, s in zip(self.modules, self.indices)]  # fmt: skip
        kind = TORCH_SCHEDULES[schedule]
        self.schedule = kind(self.stages if schedule in MULTI else self.stages[0], config.microbatches,
                             loss_fn=cross_entropy)  # fmt: skip
        self.first, self.last = 0 in self.indices, n - 1 in self.indices
        self.optimizer = hyper.torch_adamw([p for m in self.modules for p in m.parameters()])
        self.params = sum(p.numel() for m in self.modules for p in m.parameters())

    def step(self, batch) -> torch.Tensor:
        x, y = batch
        args = (x,) if self.first else ()
        losses: list = []
        kwargs = dict(target=y, losses=losses) if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The last stage's rank holds the micro-batches' losses; the others add 0 (summed after the run).
        return torch.stack([l.detach() for l in losses]).mean() if losses else torch.zeros(())

    def memory_roots(self) -> list:
        return [*self.modules, self.optimizer, *_receive_buffers(self.stages)]


def _receive_buffers(stages) -> list[torch.Tensor]:
    """The persistent buffers torch's stages receive activations and gradients into (made at the
    first step, kept): part of an arm's state, as fs's received tensors (made every step) are."""
    out = []
    for stage in stages:
        for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
            for infos in table.values():
                for info in infos if isinstance(infos, (tuple, list)) else (infos,):
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor):
                        out.append(buffer)
    return out


# --- one rank -------------------------------------------------------------------------------------


def _timed(mesh, arm, batch) -> tuple[float, torch.Tensor]:
    mesh.all_reduce_flat(torch.zeros(1))  # start together
    start = time.perf_counter()
    loss = arm.step(batch)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    return float(mesh.all_gather_world(elapsed).max()), loss


class _NoModules:
    """Stands in for MemTracker's `ModTracker`: no per-module statistics. A pipeline step calls
    each stage's module once per micro-batch (MemTracker refuses a second top-level call), and
    fs's stages differentiate with `torch.autograd.grad`, under which ModTracker's backward hooks
    fail. What is read, the total bytes and their peak, comes from the tensors' storages alone
    (every op's outputs through dispatch, `UntypedStorage.resize_`, the tracked state), the same
    for every arm."""

    is_bw = False
    parents = {"Global"}

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        pass


def _peak(mesh, arm, batch) -> list[int]:
    tracker = MemTracker()
    tracker._mod_tracker = _NoModules()
    tracker.track_external(*arm.memory_roots(), *batch)
    mesh.all_reduce_flat(torch.zeros(1))
    with tracker:
        arm.step(batch)
    return mesh.all_gather_world(torch.tensor([cpu_total(tracker, "peak")], dtype=torch.int64)).tolist()


def _reference(base: nn.Module, tokens, config: Config, hyper: Hyper, steps: int) -> list[float]:
    """One process, the plain model, the whole batch."""
    model = copy.deepcopy(base)
    optimizer = hyper.torch_adamw(model.parameters())
    losses = []
    for step in range(steps):
        x, y = batch_of(tokens, config, step)
        loss = cross_entropy(logits_of(model, x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def run_model(name: str, config: Config, mesh, group, tokens, vocab: int) -> dict:
    hyper = Hyper()
    base = build_model(name, config, vocab)
    arms = [TorchArm(s, base, mesh, hyper, config, group) for s in config.torch_schedules]
    arms += [FsArm(s, base, mesh, hyper, config, batch_of(tokens, config, 0)) for s in config.fs_schedules]
    times = {a.name: [] for a in arms}
    losses = {a.name: [] for a in arms}
    total = config.warmup + config.steps
    for i in range(total):
        batch = batch_of(tokens, config, i)
        shift = i % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            elapsed, loss = _timed(mesh, arm, batch)
            losses[arm.name].append(loss.detach().float().reshape(()))
            if i >= config.warmup:
                times[arm.name].append(elapsed)
        if mesh.rank == 0:
            now = time.strftime("%H:%M:%S")
            print(f"[{now} {name} {config.axes}] step {i + 1}/{total}", file=sys.stderr, flush=True)
    curves = {}
    for arm in arms:
        values = torch.stack(losses[arm.name])
        if isinstance(arm, TorchArm):  # only the last stage's rank has them
            values = mesh.all_reduce_flat(values.clone())
        curves[arm.name] = values.tolist()
    params = {a.name: mesh.all_gather_world(torch.tensor([a.params], dtype=torch.int64)).tolist() for a in arms}
    memory_batch = batch_of(tokens, config, total)
    # MemTracker is a dispatch mode, under which torch.compile runs nothing compiled: no peak for those arms
    peaks = {a.name: None if a.name.endswith(COMPILE) else _peak(mesh, a, memory_batch) for a in arms}
    result = None
    if mesh.rank == 0:
        result = {"arms": {}, "params": sum(p.numel() for p in base.parameters())}
        if config.reference:
            result["reference_losses"] = _reference(base, tokens, config, hyper, total)
        for arm in arms:
            entry = {"times_s": times[arm.name], "losses": curves[arm.name], "peak_bytes_per_rank": peaks[arm.name],
                     "params_per_rank": params[arm.name]}  # fmt: skip
            if config.reference:
                entry["max_loss_diff"] = max(abs(a - b) for a, b in zip(curves[arm.name], result["reference_losses"]))
            result["arms"][arm.name] = entry
    mesh.all_reduce_flat(torch.zeros(1))  # the others wait for the reference
    return result


def run(config: Config) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.pipelining")
    mesh = fs.init_mesh(config.axes)
    # torch's stages talk on a process group of their own: fs checks that every rank issues the
    # same collectives on the mesh's groups, which point-to-point transfers between some ranks
    # (torch's, on the default group) would break.
    group = dist.new_group(backend="gloo")
    tokens, vocab = _corpus()
    return {name: run_model(name, config, mesh, group, tokens, vocab) for name in config.models}


# --- report ---------------------------------------------------------------------------------------


def _is_fs(name: str) -> bool:
    return name.startswith("fs")


def _same_torch(name: str) -> str:
    schedule = name.removeprefix("fs ")
    return torch_name(schedule) if schedule_of(schedule)[0] in TORCH_NAMES else ""


def table(model: str, label: str, config: Config, result: dict) -> str:
    """One model at one mesh as a markdown table (the docs' format)."""
    arms = result["arms"]
    medians = {n: statistics.median(a["times_s"]) for n, a in arms.items()}
    torch_best = min(m for n, m in medians.items() if not _is_fs(n))
    P = config.axes["pp"]
    lines = [
        f"**{model.upper()}** ({result['params']:,} parameters) `{config.axes}`: {config.steps} timed steps after "
        f"{config.warmup}, batch {config.batch_size} x {config.seq_len} tokens in {config.microbatches} micro-batches",
        "",
        "| arm | median ms | IQR ms | × torch best | × torch same | peak MiB/rank | loss step 1 | loss step N "
        "| max \\|loss − ref\\| | params/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, a in arms.items():
        q = statistics.quantiles(a["times_s"], n=4) if len(a["times_s"]) > 1 else [a["times_s"][0]] * 3
        same = _same_torch(name)
        ratio_same = f"{medians[name] / medians[same]:.2f}" if same in medians else ""
        diff = f"{a['max_loss_diff']:.1e}" if "max_loss_diff" in a else ""
        per_rank = ", ".join(f"{p:,}" for p in a["params_per_rank"][:P])
        lines.append(
            f"| {name} | {1e3 * medians[name]:.1f} | {1e3 * (q[2] - q[0]):.1f} | {medians[name] / torch_best:.2f} "
            f"| {ratio_same} | {_mib(a['peak_bytes_per_rank'])} | {a['losses'][0]:.4f} "
            f"| {a['losses'][-1]:.4f} | {diff} | {per_rank} |"
        )
    if "reference_losses" in result:
        ref = result["reference_losses"]
        lines.append(f"| one process, whole batch (reference) |  |  |  |  |  | {ref[0]:.4f} | {ref[-1]:.4f} | 0 |  |")
    return "\n".join(lines)


def _mib(peaks: list[int] | None) -> str:
    return "n/a" if peaks is None else f"{max(peaks) / 2**20:.1f}"


def targets(model: str, label: str, result: dict) -> list[str]:
    """Issue 27's performance targets per fs arm: step time <= 0.9 x the fastest torch schedule,
    peak memory per rank <= that schedule's."""
    arms = result["arms"]
    peers = {n: a for n, a in arms.items() if not _is_fs(n)}
    fastest = min(peers, key=lambda n: statistics.median(peers[n]["times_s"]))
    best_time = statistics.median(peers[fastest]["times_s"])
    best_peak = peers[fastest]["peak_bytes_per_rank"]
    best_peak = None if best_peak is None else max(best_peak)
    lines = []
    best = min((n for n in arms if _is_fs(n)), key=lambda n: statistics.median(arms[n]["times_s"]))
    ratio = statistics.median(arms[best]["times_s"]) / best_time
    lines.append(f"- {model} {label}: fastest fs schedule `{best}` {ratio:.2f} x the fastest torch schedule "
                 f"`{fastest}` (target <= 0.90: {'met' if ratio <= 0.9 else 'missed'})")
    for name, a in arms.items():
        if not _is_fs(name):
            continue
        ratio = statistics.median(a["times_s"]) / best_time
        peak = a["peak_bytes_per_rank"]
        memory = ("peak not measured (compiled)" if peak is None or best_peak is None else
                  f"peak {max(peak) / 2**20:.1f} MiB vs {best_peak / 2**20:.1f} MiB "
                  f"(target <=: {'met' if max(peak) <= best_peak else 'missed'})")  # fmt: skip
        lines.append(
            f"- {model} {label}, `{name}`: step time {ratio:.2f} x `{fastest}` (target <= 0.90: "
            f"{'met' if ratio <= 0.9 else 'missed'}); {memory}"
        )
    return lines


def same_training(model: str, label: str, result: dict) -> str:
    """Do both sides train the same thing: every arm's losses against the reference, and the
    trainable parameters per rank (the stage cut) fs's against torch's."""
    arms = result["arms"]
    worst = max((a.get("max_loss_diff", 0.0), n) for n, a in arms.items())
    cuts = {n: tuple(a["params_per_rank"]) for n, a in arms.items()}
    same_cut = all(cuts[n] == cuts[_same_torch(n)] for n in arms if _is_fs(n) and _same_torch(n) in cuts)
    return (f"- {model} {label}: largest |loss - single-process reference| over every step and arm {worst[0]:.2e} "
            f"(`{worst[1]}`); fs's stage cuts hold the same parameters per rank as torch's: {same_cut}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", choices=list(MESHES), default=None)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: both (--quick: gpt)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--fs-schedules", nargs="+", choices=FS_CHOICES, default=list(FS_SCHEDULES),
                        help="NAME+compile: with fs.Schedule(compile=True) (gpipe, 1f1b, interleaved_1f1b)")
    parser.add_argument("--torch-schedules", nargs="+", choices=TORCH_CHOICES, default=list(TORCH_SCHEDULES),
                        help="zb_h1: ScheduleInterleavedZeroBubble (one stage per rank); zbv: ScheduleZBVZeroBubble; "
                             "NAME+compile: every block of the stages torch.compile'd (gpipe, 1f1b, interleaved_1f1b)")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process reference")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, {'pp': 2}, 2 timed steps: a smoke check")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    args = parser.parse_args()
    began = time.time()
    print(f"Machine: {machine_line()}")
    print(f"Command: python {' '.join(sys.argv)}")
    meshes = args.meshes or (["pp2"] if args.quick else list(MESHES))
    models = args.models or (["gpt"] if args.quick else list(MODELS))
    overrides = {k: v for k, v in dict(steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                                       microbatches=args.microbatches).items() if v is not None}  # fmt: skip
    raw, goals, checks = [], [], []
    for label in meshes:
        config = Config(axes=MESHES[label], models=tuple(models), reference=not args.no_reference,
                        fs_schedules=tuple(args.fs_schedules), torch_schedules=tuple(args.torch_schedules))  # fmt: skip
        config = replace(config, **(QUICK if args.quick else {}), **overrides)
        for model in models:  # one launch per model: every fs arm of a launch is traced before any transfers (FsArm)
            one = replace(config, models=(model,))
            result = fs.launch(run, world_size=config.axes["pp"], args=(one,), threads_per_rank=1)[model]
            raw.append({"mesh": label, "model": model, "config": asdict(one), "result": result})
            print(table(model, label, one, result), flush=True)
            print()
            goals += targets(model, label, result)
            checks.append(same_training(model, label, result))
            if args.json:  # after every launch: what ran is kept if a later launch fails
                args.json.write_text(json.dumps(raw, indent=1))
    print("Same training:")
    print("\n".join(checks))
    print("Targets:")
    print("\n".join(goals))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{(time.time() - began) / 60:.1f} min; load average at the end (1, 5, 15 min): {load}")


if __name__ == "__main__":
    main()
