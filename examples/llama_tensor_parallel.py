"""Train a Hugging Face Llama with tensor parallelism and FSDP together, on 4 local processes.

Run on this machine (spawns 4 processes, gloo between them; ~1 min on 2 cores)::

    python examples/llama_tensor_parallel.py
    python examples/llama_tensor_parallel.py --steps 100 --axes replicate=2,tp=2   # another mesh of 4 ranks
    python examples/llama_tensor_parallel.py --gathered-logits                 # lm_head's logits gathered

or under torchrun, unchanged (the world size must be the product of ``--axes``)::

    torchrun --nproc-per-node 4 examples/llama_tensor_parallel.py

The mesh is ``{"fsdp": 2, "tp": 2}``: ranks 0 and 1 form one ``tp`` group, ranks 2 and 3 the
other, and the two groups shard what they hold over ``fsdp``. The model is
``transformers.LlamaForCausalLM`` built from a small ``LlamaConfig`` (nothing is downloaded),
grouped-query attention, the output head untied from the embedding. Its own tensor-parallel plan
(``config.base_model_tp_plan``: ``q/k/v/gate/up_proj`` column-parallel, ``o/down_proj``
row-parallel; ``lm_head`` column-parallel) becomes fs's placement rules
(``fs.tensor_parallel.hf_rules``); ``fs.tensor_parallel.parallelize`` gives those modules a
forward with Megatron's collectives around them, and ``fs.sharded_step(..., placements=rules)``
cuts every leaf to this rank's piece and shards the pieces over ``fsdp``. The head's logits stay
split along the vocabulary (``loss_parallel=True``) and the loss is
``vocab_parallel_cross_entropy``: no rank ever holds the full logits.

Data: the corpus shipped in ``functional_shard.data`` with a character tokenizer; every rank draws
the same global batch of random windows (a seeded generator per step), and
``fs.data.local_batch`` gives each data-parallel rank its rows (the two ranks of a ``tp`` group get
the same rows). The last line printed is a dict of the results (the tests read it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.data import CharTokenizer, batches, load_text, local_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import gather_from_ranks, peak_rss_mib  # the examples' own helpers, beside this file

# Everything is local: transformers must not reach for the Hub (set before it is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class TrainConfig:
    """One run; identical on every rank."""

    axes: tuple[tuple[str, int], ...] = (("fsdp", 2), ("tp", 2))  # the mesh, row-major
    steps: int = 40
    global_batch: int = 8  # sequences per step, over every data-parallel rank
    seq_len: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    loss_parallel: bool = True  # keep lm_head's logits split; False: gather them, plain cross-entropy
    log_every: int = 5
    # the model
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.axes:
            n *= size
        return n


def build_model(config: TrainConfig, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    model_config = LlamaConfig(
        vocab_size=-(-vocab_size // 64) * 64,  # rounded up: lm_head is split along the vocabulary
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    return LlamaForCausalLM(model_config)


def main(config: TrainConfig) -> dict:
    """Train on this rank; rank 0 returns what it measured."""
    mesh = fs.init_mesh(dict(config.axes))  # under fs.launch or torchrun: joins the world
    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)

    model = build_model(config, tokenizer.vocab_size)
    rules = tp.hf_rules(model)  # the model's own plan, as placement rules on leaf paths
    tp.parallelize(model, rules, mesh, loss_parallel=config.loss_parallel)
    apply_fn, params = fs.functionalize(model)  # the full parameters, on every rank

    def loss_fn(params, batch):
        inputs, targets = batch
        logits = apply_fn(params, input_ids=inputs).logits  # [b, s, vocab / tp] with loss_parallel
        if config.loss_parallel:
            return tp.vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), mesh, "tp")
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    step = fs.sharded_step(
        loss_fn,
        mesh,
        optimizer=fs.optim.adamw(config.lr, weight_decay=config.weight_decay),
        placements=rules,
        donate=True,
    )
    state = step.init(params)  # each rank keeps its pieces, sharded over fsdp
    pieces = fs.gather(state.params).trainable  # this rank's pieces (a collective over fsdp)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    shapes = {"full": list(params.trainable[q_proj].shape), "piece": list(pieces[q_proj].shape)}
    del pieces
    if mesh.rank == 0:
        print(f"mesh {mesh.shape}: {q_proj} {shapes['full']} -> this rank's piece {shapes['piece']}; "
              f"modules with a tensor-parallel forward: {len(tp.parallelized_modules(model))}", flush=True)

    losses, seconds = [], []
    for n in range(config.steps):
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + n)  # the same global batch everywhere
        batch = local_batch(batches(tokens, config.global_batch, config.seq_len, generator=generator), mesh)
        began = time.perf_counter()
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))  # the mean over the data-parallel ranks
        seconds.append(time.perf_counter() - began)
        if mesh.rank == 0 and (n % config.log_every == 0 or n == config.steps - 1):
            print(f"step {n:4d}  loss {losses[-1]:.4f}  grad norm {float(metrics['grad_norm']):.3f}  "
                  f"{1000 * seconds[-1]:.0f} ms", flush=True)

    # A fixed evaluation batch: the step's own evaluation (pieces, collectives) against the trained
    # weights joined whole (`full=True`: every split leaf gathered over tp) in the plain model.
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + 10**6)
    eval_batch = batches(tokens, config.global_batch, config.seq_len, generator=generator)
    eval_loss = float(step.evaluate(state, local_batch(eval_batch, mesh))["loss"])
    full = fs.gather(state.params, full=True).trainable  # the whole trained tree, on every rank
    peak = gather_from_ranks(peak_rss_mib())  # a collective
    if mesh.rank != 0:
        return {}
    plain = build_model(config, tokenizer.vocab_size)
    plain.load_state_dict(full, strict=False)  # strict=False: the rotary buffers are not parameters
    with torch.no_grad():
        inputs, targets = eval_batch
        plain_loss = float(torch.nn.functional.cross_entropy(plain(input_ids=inputs).logits.flatten(0, 1), targets.flatten()))
    print(f"evaluation batch: loss {eval_loss:.5f} by the step, {plain_loss:.5f} by the plain model with the "
          f"joined weights", flush=True)
    later = sorted(seconds[1:]) or seconds  # the first step traces
    return {
        "mesh": dict(mesh.shape),
        "steps": config.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "median_step_ms": round(1000 * later[len(later) // 2], 1),
        "q_proj_shapes": shapes,
        "eval_loss": eval_loss,
        "plain_model_eval_loss": plain_loss,
        "peak_rss_mib_per_rank": [round(m) for m in peak],
    }


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--axes", default=",".join(f"{a}={s}" for a, s in d.axes),
                        help="the mesh, row-major, e.g. fsdp=2,tp=2 or tp=4 (product = processes)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--global-batch", type=int, default=d.global_batch, help="sequences per step, all ranks")
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--gathered-logits", action="store_true",
                        help="gather lm_head's logits and use F.cross_entropy (default: vocabulary-parallel loss)")
    args = parser.parse_args(argv)
    try:
        axes = tuple((name, int(size)) for name, size in (item.split("=") for item in args.axes.split(",")))
    except ValueError:
        parser.error(f"--axes {args.axes!r}: expected name=size pairs separated by commas, e.g. fsdp=2,tp=2")
    return replace(d, axes=axes, steps=args.steps, global_batch=args.global_batch, seq_len=args.seq_len, lr=args.lr,
                   seed=args.seed, loss_parallel=not args.gathered_logits)


if __name__ == "__main__":
    config = parse_args()
    # Spawns config.world_size local ranks; under torchrun, runs main in this rank (torchrun's
    # world size must then be the product of the axes: fs.init_mesh says so otherwise).
    result = fs.launch(main, world_size=config.world_size, args=(config,))
    if result:
        print(f"loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {result['steps']} steps; "
              f"median step {result['median_step_ms']} ms; peak RSS per rank (MiB) {result['peak_rss_mib_per_rank']}")
        print(result)
