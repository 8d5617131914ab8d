"""Train a small character-level GPT with fully sharded data parallelism on CPU.

Run on this machine (spawns ``--world-size`` processes, gloo between them)::

    python examples/train_gpt.py --world-size 2

or under torchrun, which starts the processes itself::

    torchrun --nproc-per-node 2 examples/train_gpt.py

Every rank builds the same initial model (same seed), draws its own batches
(seed + rank) from the corpus shipped in ``functional_shard.data``, and takes
sharded AdamW steps. At the end rank 0 loads the exported weights back into the
``nn.Module`` and prints a sample of generated text.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed
import torch.nn.functional as F
from tqdm import tqdm

import functional_shard as fs
from functional_shard.data import CharTokenizer, batches, load_text
from functional_shard.models import GPT, GPTConfig


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


def main(config: TrainConfig) -> dict[str, float | str]:
    """Train on this rank; returns ``first_loss``, ``final_loss`` (means over ranks) and, on rank 0, ``sample``."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size)) > 1:
        # Several ranks share this machine's cores: more threads each would only contend.
        torch.set_num_threads(1)
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
    losses: list[float] = []
    progress = tqdm(range(config.steps), desc="train", disable=mesh.rank != 0)
    for _ in progress:
        batch = batches(tokens, config.batch_size, config.block_size, generator=generator)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    progress.close()

    result: dict[str, float | str] = {"first_loss": losses[0], "final_loss": losses[-1]}
    exported = fs.export(state)  # a collective: every rank calls it
    if mesh.rank == 0:
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
    args = parser.parse_args()
    return TrainConfig(
        world_size=args.world_size, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed
    )


def report(result: dict[str, float | str]) -> None:
    first, final = result["first_loss"], result["final_loss"]
    print(f"first loss {first:.3f}, final loss {final:.3f} ({100 * (1 - final / first):.0f}% lower)")
    print("sample:")
    print(result["sample"])
    print({"first_loss": first, "final_loss": final})


if __name__ == "__main__":
    config = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun started this process as one rank: run it here, the world size is torchrun's.
        config = replace(config, world_size=int(os.environ["WORLD_SIZE"]))
        result = main(config)
        # fs.launch tears the process group down itself; under torchrun that is the script's job
        # (a barrier first, so that no rank exits while another's last collective is in flight).
        fs.shutdown()
        if int(os.environ["RANK"]) == 0:
            report(result)
    else:
        report(fs.launch(main, world_size=config.world_size, args=(config,)))
