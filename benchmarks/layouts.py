"""Choose the N-D layout of a Llama run on a cluster, and predict torchtitan's published multi-axis
runs (docs/planning.md, "Choosing the layout"): `fs.analysis.plan_layouts` on meta tensors.

    python benchmarks/layouts.py                      # every job below
    python benchmarks/layouts.py --jobs search-70b    # one: search-70b, 70b-2d, 405b-3d

- search-70b: Llama 3.1 70B on 256 H100s (Grand Teton), global batch 512 x 8192 tokens, 80 GiB
  per GPU: every replicate x fsdp x tp x pp layout, checkpointing policy, pipeline schedule and
  micro-batch count, ranked; torchtitan's published layout (FSDP 32 x TP 8, full AC) is among them.
- 70b-2d: torchtitan Table 4 (Dec 2024): 70B at FSDP 32 x TP 8, local batch 16, full AC (published
  with torch.compile and Float8, 829 TPS/GPU, 71.9 GiB).
- 405b-3d: torchtitan Table 5: 405B at FSDP 8 x TP 8 x PP 8, local batch 32, full AC, 1F1B (100
  TPS/GPU, 82.5 GiB) against interleaved 1F1B (128, 72.7); micro-batches = stages (torchtitan's
  default: 8 for 1F1B, 16 for interleaved with 2 stages per rank).

The model is Hugging Face's `LlamaForCausalLM` from a `LlamaConfig` with `num_hidden_layers` set
per trace, attention as the fused flash kernel (`benchmarks/planning.py`), tensor parallelism by its
own plan (`hf_rules`) plus a vocabulary-split token embedding, with sequence parallelism and
torch's vocabulary-parallel loss (`loss_parallel`, the buffers its eager code holds:
`benchmarks/loss_parallel.py`), as torchtitan runs it; `--loss fs` plans fs's own instead.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

import functional_shard as fs
from functional_shard import tensor_parallel as tp

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from planning import SHAPES, _flash_attention  # noqa: E402

SHAPES = {**SHAPES, "llama3_405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                         num_attention_heads=128, num_key_value_heads=8, vocab_size=128256)}  # fmt: skip
PRECISION = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FULL = (("full", True),)


def llama_builder(model: str, sequence: int, loss: str = "loss_parallel"):
    """`(layers, mesh) -> (loss_fn, params, placements)` for `plan_layouts`: the Llama of `SHAPES[model]`
    with `layers` blocks on the meta device, tensor-parallel (sequence-parallel, vocabulary-parallel
    loss) over the mesh's `tp` axis when it has one. The vocabulary-parallel loss is torch's
    `loss_parallel` as torchtitan runs it (`loss="loss_parallel"`, `benchmarks/loss_parallel.py`:
    the buffers its eager code holds) or fs's `tensor_parallel.vocab_parallel_cross_entropy`
    (`loss="fs"`)."""
    if loss not in ("loss_parallel", "fs"):
        raise ValueError(f"loss={loss!r}: expected 'loss_parallel' or 'fs'")
    from loss_parallel import loss_parallel_cross_entropy
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    AttentionInterface.register("fs_fused_attention", _flash_attention)
    shape = {**SHAPES[model]}

    def build(layers: int, mesh):
        config = LlamaConfig(**{**shape, "num_hidden_layers": layers}, max_position_embeddings=sequence,
                             rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="fs_fused_attention")  # fmt: skip
        with torch.device("meta"):
            llama = LlamaForCausalLM(config)
        split = "tp" in mesh.axis_names
        # Llama's own plan, and the token embedding split over the vocabulary as torchtitan splits it
        # (Hugging Face's plan keeps it whole: 2.1B parameters per rank at 405B's width).
        rules = [tp.rule("model.embed_tokens.weight", tp.Split(0, "tp"), style="embedding_rowwise")] + tp.hf_rules(llama) if split else None
        if split:
            tp.parallelize(llama, rules, mesh, loss_parallel=True, sequence_parallel=True)
        apply_fn, params = fs.functionalize(llama)

        def loss_fn(p, batch):
            ids, labels = batch
            logits = apply_fn(p, input_ids=ids, use_cache=False).logits.flatten(0, 1).float()
            if split and loss == "loss_parallel":
                return loss_parallel_cross_entropy(logits, labels.flatten(), mesh, "tp")
            if split:
                return tp.vocab_parallel_cross_entropy(logits, labels.flatten(), mesh, "tp")
            return torch.nn.functional.cross_entropy(logits, labels.flatten())

        return loss_fn, params, rules

    return build


def token_batch(sequence: int):
    def batch(rows: int):
        ids = torch.empty(rows, sequence, dtype=torch.long, device="meta")
        return ids, ids

    return batch


JOBS = {
    "search-70b": dict(model="llama3_70b", world=256, global_batch=512, space=fs.analysis.LayoutSpace()),
    "70b-2d": dict(model="llama3_70b", world=256, global_batch=512,
                   space=fs.analysis.LayoutSpace(tp=(8,), pp=(1,), remat=FULL)),  # fmt: skip
    "405b-3d": dict(model="llama3_405b", world=512, global_batch=256,
                    space=fs.analysis.LayoutSpace(tp=(8,), pp=(8,), remat=FULL, microbatches=(1, 2))),  # fmt: skip
}
PUBLISHED = {  # torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch.compile + Float8 (+ AsyncTP for 405B))
    ("70b-2d", "fsdp 32 x tp 8, full AC"): (829, 71.9),
    ("405b-3d", "pp 8 x fsdp 8 x tp 8, full AC, 1f1b M=8"): (100, 82.5),
    ("405b-3d", "pp 8 x fsdp 8 x tp 8, full AC, interleaved_1f1b M=16"): (128, 72.7),
}


def run(job: str, sequence: int = 8192, budget_gib: float = 80.0, workers: int = 1, loss: str = "loss_parallel") -> dict:
    spec = JOBS[job]
    layers = SHAPES[spec["model"]]["num_hidden_layers"]
    machine = fs.analysis.cluster_machine(fs.analysis.H100_SXM_HBM2E, world_size=spec["world"], network_gbps=400)
    start = time.perf_counter()
    result = fs.analysis.plan_layouts(
        llama_builder(spec["model"], sequence, loss), token_batch(sequence), layers=layers, world_size=spec["world"],
        global_batch=spec["global_batch"], tokens_per_row=sequence, machine=machine, budget_bytes=int(budget_gib * 2**30),
        optimizer=fs.optim.adamw(lr=3e-4, weight_decay=0.1), precision=PRECISION, space=spec["space"],
        peak_flops=fs.analysis.H100_SXM.dense_flops["bfloat16"], workers=workers,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    print(f"## {job}: {spec['model']} on {spec['world']} GPUs, global batch {spec['global_batch']} x {sequence}, {loss} loss "
          f"({seconds:.1f} s, {result.traces} traces, {workers} worker{'s' if workers > 1 else ''})\n")
    print(result.table(limit=12 if job == "search-70b" else None))
    rows = []
    for c in result.candidates:
        published = PUBLISHED.get((job, c.label))
        if published:
            print(f"\npublished {c.label}: {published[0]} TPS/GPU, {published[1]} GiB; predicted (bf16, no compile) "
                  f"{c.tokens_per_s_per_gpu:,.0f} TPS/GPU, {c.reserved_bytes / 2**30:.1f} GiB "
                  f"({c.reserved_bytes / 2**30 / published[1] - 1:+.1%} memory)")  # fmt: skip
        rows.append(dict(label=c.label, step_s=c.step_s, tps=c.tokens_per_s_per_gpu, reserved_gib=c.reserved_bytes / 2**30,
                         bubble=c.bubble, fits=c.fits, why=c.why, published=published))  # fmt: skip
    print()
    return dict(job=job, seconds=seconds, traces=result.traces, candidates=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--loss", default="loss_parallel", choices=("loss_parallel", "fs"),
                        help="the vocabulary-parallel loss: torch's loss_parallel as torchtitan runs it (default) or fs's")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes tracing at once (default: the cores)")
    args = parser.parse_args(argv)
    out = [run(job, workers=args.workers, loss=args.loss) for job in args.jobs.split(",")]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
