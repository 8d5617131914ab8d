"""Train a small character-level GPT with fully sharded data parallelism on CPU.

Run on this machine (spawns ``--world-size`` processes, gloo between them)::

    python examples/train_gpt.py --world-size 2

or under torchrun, which starts the processes itself::

    torchrun --nproc-per-node 2 examples/train_gpt.py

Every rank builds the same initial model (same seed) and takes sharded AdamW steps
on its part of each global batch of windows of the corpus shipped in
``functional_shard.data`` (``fs.data.DataParallelSampler``: every window once per
epoch across the ranks, the same samples per step at any world size). AdamW leaves
biases and LayerNorm weights out of weight decay (``fs.optim.group``) and follows a
warmup + cosine learning-rate schedule (``fs.optim.warmup_cosine_schedule``).
``fs.launch`` runs the script under ``python`` (spawning the ranks) and under torchrun
(one rank per process) alike. At the end rank 0 loads the exported weights back into the
``nn.Module`` and prints a sample of generated text, a summary (time, peak memory per
rank, bytes moved per step) and where it wrote the loss curve (``--out``, default
``results/train_gpt/loss.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.data import CharTokenizer, load_text
from functional_shard.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # the examples' own helpers, beside this file
    History,
    Progress,
    Timer,
    gather_from_ranks,
    peak_rss_mib,
    plot_losses,
    summary,
)


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one run; identical on every rank."""

    world_size: int = 2  # under torchrun, torchrun's
    steps: int = 300
    batch_size: int = 16  # per rank
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    sample_chars: int = 200
    out: str = "results/train_gpt"


def main(config: TrainConfig) -> dict[str, float | str]:
    """Train on this rank; returns ``first_loss``, ``final_loss`` (means over ranks) and, on rank 0,
    ``sample``, ``summary`` and ``plot``."""
    # fs.launch sets WORLD_SIZE in the ranks it spawns; torchrun sets it in its own.
    mesh = fs.init_mesh({"fsdp": int(os.environ["WORLD_SIZE"])})

    text = load_text()
    tokenizer = CharTokenizer.from_text(text)
    tokens = tokenizer.encode(text)

    # The same seed on every rank gives every rank the same initial weights.
    torch.manual_seed(config.seed)
    model_config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        block_size=config.block_size,
        n_layer=config.n_layer,
        n_head=config.n_head,
        d_model=config.d_model,
    )
    model = GPT(model_config)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(params, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = apply_fn(params, inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # Warmup then cosine decay; no weight decay on biases and LayerNorm weights (as nanoGPT and
    # Hugging Face's Trainer do).
    optimizer = fs.optim.adamw(
        fs.optim.warmup_cosine_schedule(
            config.lr, warmup_steps=min(config.warmup_steps, config.steps // 10 + 1), steps=config.steps + 1
        ),
        weight_decay=config.weight_decay,
        groups=[fs.optim.group("*.bias", "*ln*.weight", weight_decay=0.0)],
    )
    # donate=True: each step updates the state's shards in place (the old state is used up).
    step = fs.sharded_step(loss_fn, mesh, optimizer=optimizer, donate=True)
    state = step.init(params)

    # Each step's global batch of windows (batch_size per rank) is cut among the data-parallel
    # ranks; start_step=state.step would resume mid-epoch after fs.checkpoint.load.
    windows = tokens.numel() - config.block_size  # window i: tokens[i : i + block_size + 1]
    sampler = fs.data.DataParallelSampler(
        windows, mesh, batch_size=config.batch_size * mesh.world_size, seed=config.seed, start_step=state.step
    )
    offsets = torch.arange(config.block_size)
    history = History()
    tokens_per_step = config.batch_size * config.block_size * mesh.world_size
    progress = Progress(config.steps, rank=mesh.rank)
    began = time.perf_counter()
    for n in range(config.steps):
        starts = torch.tensor(sampler.indices(n))[:, None] + offsets
        batch = (tokens[starts], tokens[starts + 1])
        with Timer() as timer:
            state, metrics = step(state, batch)
            loss = float(metrics["loss"])  # the mean over ranks
        history.train_steps.append(n)
        history.train_loss.append(loss)
        history.step_seconds.append(timer.seconds)
        progress.update(loss, tokens_per_step, timer.seconds)
    progress.close()
    seconds = time.perf_counter() - began
    peak = gather_from_ranks(peak_rss_mib())  # a collective

    result: dict[str, float | str] = {"first_loss": history.train_loss[0], "final_loss": history.train_loss[-1]}
    exported = fs.export(state)  # a collective: every rank calls it
    if mesh.rank == 0:
        result["summary"] = summary(
            steps=config.steps,
            seconds=seconds,
            tokens=tokens_per_step * config.steps,
            peak_mib=peak,
            all_gather_bytes=metrics["all_gather_bytes"],
            reduce_scatter_bytes=metrics["reduce_scatter_bytes"],
            step_seconds=history.step_seconds,
            history=history,
        )
        title = f"GPT ({config.n_layer} layers, d={config.d_model}) on {mesh.world_size} ranks, fs.sharded_step"
        result["plot"] = str(plot_losses(Path(config.out) / "loss.png", history, title=title))
        model.load_state_dict(exported)
        model.eval()
        prompt = tokenizer.encode("\n").reshape(1, -1)
        sample_generator = torch.Generator().manual_seed(config.seed)
        ids = model.generate(prompt, config.sample_chars, temperature=0.8, generator=sample_generator)
        result["sample"] = tokenizer.decode(ids[0, 1:])
    return result


def parse_args() -> TrainConfig:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=defaults.world_size, help="processes (torchrun sets its own)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default=defaults.out, help="where loss.png goes")
    args = parser.parse_args()
    return TrainConfig(
        world_size=args.world_size, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        out=args.out,
    )


def report(result: dict[str, float | str]) -> None:
    print("sample:")
    print(result["sample"])
    print()
    print(result["summary"])
    print(f"loss curve: {result['plot']}")
    print({"first_loss": result["first_loss"], "final_loss": result["final_loss"]})


if __name__ == "__main__":
    config = parse_args()
    # Spawns config.world_size local ranks; under torchrun, runs main in this rank. Either way
    # it returns rank 0's result (None on torchrun's other ranks) and shuts the mesh down.
    result = fs.launch(main, world_size=config.world_size, args=(config,))
    if result is not None:
        report(result)
