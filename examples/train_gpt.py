"""Train a small character-level GPT with fully sharded data parallelism on CPU.

Run on this machine (spawns ``--world-size`` processes, gloo between them)::

    python examples/train_gpt.py --world-size 2

or under torchrun, which starts the processes itself::

    torchrun --nproc-per-node 2 examples/train_gpt.py

Every rank builds the same initial model (same seed), draws its own batches
(seed + rank) from the corpus shipped in ``functional_shard.data``, and takes
sharded AdamW steps. At the end rank 0 loads the exported weights back into the
``nn.Module`` and prints a sample of generated text, a summary (time, peak memory per
rank, bytes moved per step) and where it wrote the loss curve (``--out``, default
``results/train_gpt/loss.png``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.data import CharTokenizer, batches, load_text
from functional_shard.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # the examples' own helpers, beside this file
    History,
    Progress,
    Timer,
    gather_from_ranks,
    launched_by_torchrun,
    limit_threads,
    peak_rss_mib,
    plot_losses,
    summary,
)


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one run; identical on every rank."""

    world_size: int = 2
    steps: int = 300
    batch_size: int = 16  # per rank
    lr: float = 3e-3
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
    limit_threads()
    mesh = fs.init_mesh({"fsdp": config.world_size})

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

    # donate=True: each step updates the state's shards in place (the old state is used up).
    step = fs.sharded_step(
        loss_fn, mesh, optimizer=fs.optim.adamw(lr=config.lr, weight_decay=config.weight_decay), donate=True
    )
    state = step.init(params)

    # A different stream per rank, so the ranks together see world_size times as much data per step.
    generator = torch.Generator().manual_seed(config.seed + mesh.rank)
    history = History()
    tokens_per_step = config.batch_size * config.block_size * config.world_size
    progress = Progress(config.steps, rank=mesh.rank)
    began = time.perf_counter()
    for n in range(config.steps):
        batch = batches(tokens, config.batch_size, config.block_size, generator=generator)
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
        title = f"GPT ({config.n_layer} layers, d={config.d_model}) on {config.world_size} ranks, fs.sharded_step"
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
    if launched_by_torchrun():
        # torchrun started this process as one rank: run it here, the world size is torchrun's.
        config = replace(config, world_size=int(os.environ["WORLD_SIZE"]))
        fs.keep_freed_memory()  # what fs.launch does in the ranks it starts
        result = main(config)
        # fs.launch tears the process group down itself; under torchrun that is the script's job
        # (a barrier first, so that no rank exits while another's last collective is in flight).
        fs.shutdown()
        if int(os.environ["RANK"]) == 0:
            report(result)
    else:
        report(fs.launch(main, world_size=config.world_size, args=(config,)))
