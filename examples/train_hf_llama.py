"""Train a small Hugging Face Llama with fully sharded data parallelism on CPU, then export it.

Run on this machine (spawns ``--world-size`` processes, gloo between them)::

    python examples/train_hf_llama.py                       # 2 processes, ~1 min on 2 cores
    python examples/train_hf_llama.py --precision bf16 --microbatches 2 --clip 1.0 --eval-every 20
    python examples/train_hf_llama.py --steps 200 --resume  # go on from the last checkpoint

or under torchrun, unchanged (one node, or several)::

    torchrun --nproc-per-node 2 examples/train_hf_llama.py

The model is ``transformers.LlamaForCausalLM`` built from a small ``LlamaConfig`` (nothing is
downloaded), trained on the corpus shipped in ``functional_shard.data`` with a byte-level
tokenizer (ids 0-255 are bytes; 256 BOS, 257 EOS, 258 padding). Each rank draws its own
paragraphs, pads them to ``--seq-len`` and marks the padding ``-100`` in the labels; the loss is
returned as ``fs.WeightedLoss(token_sum, n_tokens, summed=True)``, so the step trains on the exact mean over
every non-padding token of every rank, however the tokens fall between ranks.

Writes, under ``--out`` (default ``results/train_hf_llama``): ``checkpoint/`` (a sharded
``fs.checkpoint``, every ``--checkpoint-every`` steps and at the end; ``--resume`` loads it, at
any world size), ``history.json`` (losses so far), ``loss.png`` (the loss curve) and
``export/`` (``save_pretrained``: ``LlamaForCausalLM.from_pretrained(out / "export")`` loads it).
Needs the ``hf`` extra: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import functional_shard as fs
from functional_shard.data import load_text

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

# Everything is local: transformers must not reach for the Hub (set before it is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BOS, EOS, PAD = 256, 257, 258  # byte-level vocabulary: 256 bytes and three special ids
VOCAB_SIZE = 259
IGNORE = -100  # labels the loss skips (F.cross_entropy's and transformers' ignore_index)


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one run; identical on every rank."""

    world_size: int = 2
    steps: int = 120
    batch_size: int = 8  # sequences per rank per step
    seq_len: int = 160
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    precision: str = "fp32"  # or "bf16": gather and compute in bfloat16, reduce gradients in float32
    microbatches: int = 1
    clip: float = 1.0  # max gradient norm; 0 turns clipping off
    remat: bool = False
    eval_every: int = 20  # 0: no held-out evaluation
    checkpoint_every: int = 0  # 0: only at the end
    stop_after: int = 0  # stop (checkpointed) once the state has taken this many steps, as a preempted job; 0: run to `steps`
    resume: bool = False
    out: str = "results/train_hf_llama"
    export: bool = True
    # the model
    hidden_size: int = 128
    intermediate_size: int = 352
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    sample_bytes: int = 160


# --- data ---------------------------------------------------------------------------------------


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def paragraphs(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's paragraphs as `BOS bytes EOS`, cut or padded to `seq_len + 1` ids:
    `(train, held_out)`, int64 of shape `(n, seq_len + 1)`; the last 5% are held out."""
    docs = [p.strip() for p in load_text().split("\n\n") if p.strip()]
    rows = torch.full((len(docs), seq_len + 1), PAD, dtype=torch.long)
    for i, doc in enumerate(docs):
        ids = ([BOS] + encode(doc) + [EOS])[: seq_len + 1]
        rows[i, : len(ids)] = torch.tensor(ids)
    split = len(docs) - max(1, len(docs) // 20)
    return rows[:split], rows[split:]


def make_batch(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask, labels)`, each `(B, seq_len)`: labels are the next ids, -100 on padding."""
    inputs, labels = rows[:, :-1], rows[:, 1:].clone()
    labels[labels == PAD] = IGNORE
    return inputs.contiguous(), (inputs != PAD).long(), labels


def train_batch(train_rows: torch.Tensor, config: TrainConfig, step: int, rank: int):
    """This rank's batch for `step`: a function of (seed, step, rank) alone, so a resumed run draws what the
    uninterrupted run would have."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 1_009 + rank)
    picks = torch.randint(train_rows.shape[0], (config.batch_size,), generator=generator)
    return make_batch(train_rows[picks])


# --- the model ------------------------------------------------------------------------------------


def build_model(config: TrainConfig):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained/from_pretrained bars would interleave with ours
    model_config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.seq_len,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    return LlamaForCausalLM(model_config)


def make_schedule(config: TrainConfig) -> fs.Schedule:
    """The default schedule (traced, prefetch 1, reshard after forward), with every unit's
    forward recomputed before its backward if asked for."""
    return fs.Schedule(remat=True) if config.remat else fs.Schedule()


# --- one rank --------------------------------------------------------------------------------------


def main(config: TrainConfig) -> dict:
    """Train on this rank; rank 0 returns the losses, the summary and where it wrote its files."""
    # fs.launch sets WORLD_SIZE in the ranks it spawns; torchrun sets it in its own.
    config = replace(config, world_size=int(os.environ["WORLD_SIZE"]))
    mesh = fs.init_mesh({"fsdp": config.world_size})
    rank = mesh.rank
    out = Path(config.out)
    train_rows, held_out_rows = paragraphs(config.seq_len)
    # Every rank evaluates its own fixed slice of the held-out paragraphs.
    eval_batch = make_batch(held_out_rows[rank :: config.world_size][: config.batch_size])

    model = build_model(config)
    apply_fn, params = fs.functionalize(model)

    def loss_fn(params, batch):
        input_ids, attention_mask, labels = batch
        logits = apply_fn(params, input_ids=input_ids, attention_mask=attention_mask).logits
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        # The sum over this rank's non-padding tokens and their count: the step trains on the mean over
        # every rank's tokens (and every micro-batch's), not on the mean of the ranks' means; a rank
        # or micro-batch with no tokens adds 0 (a mean would be 0 / 0).
        return fs.WeightedLoss(total, (labels != IGNORE).sum(), summed=True)

    # Warmup then cosine decay over the run; no weight decay on the RMSNorm weights (Llama has no biases).
    optimizer = fs.optim.adamw(
        fs.optim.warmup_cosine_schedule(
            config.lr, warmup_steps=max(1, config.steps // 10), steps=config.steps, min_lr=config.lr / 10
        ),
        weight_decay=config.weight_decay,
        groups=[fs.optim.group("*norm.weight", weight_decay=0.0)],
    )
    if config.clip > 0:
        optimizer = fs.optim.chain(fs.optim.clip_by_global_norm(config.clip), optimizer)
    precision = None
    if config.precision == "bf16":  # bf16 gathers and compute; fp32 gradient reduction and master shards
        precision = fs.Precision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    step = fs.sharded_step(
        loss_fn,
        mesh,
        optimizer=optimizer,
        schedule=make_schedule(config),
        precision=precision,
        microbatches=config.microbatches,
        donate=True,
    )
    state = step.init(params)
    checkpoint = out / "checkpoint"
    history = History()
    step_seconds: list[float] = []  # this run's steps (history may hold an earlier run's too)
    if config.resume:
        # Any world size, unit policy or mesh: the checkpoint holds full logical tensors.
        state = fs.checkpoint.load(checkpoint, state)
        if (out / "history.json").exists():
            history = History.from_json((out / "history.json").read_text()).up_to(state.step)
    start = state.step
    if start >= config.steps and rank == 0:
        print(f"the checkpoint is at step {start}: nothing to do for --steps {config.steps}", flush=True)

    def save_checkpoint() -> None:
        fs.checkpoint.save(checkpoint, state, overwrite=True)  # a collective: every rank writes its part
        if rank == 0:
            (out / "history.json").write_text(history.to_json())

    def evaluate() -> None:
        loss = float(step.evaluate(state, eval_batch)["loss"])  # token-weighted mean over ranks
        history.eval_steps.append(state.step)
        history.eval_loss.append(loss)
        progress.write(f"step {state.step:4d}  held-out loss {loss:.3f}")

    tokens_per_step = config.batch_size * config.seq_len * config.world_size  # positions, padding included
    progress = Progress(config.steps, rank=rank, initial=min(start, config.steps))
    metrics = None
    began = time.perf_counter()
    stop = min(config.steps, config.stop_after) if config.stop_after else config.steps
    for n in range(start, stop):
        if config.eval_every and n % config.eval_every == 0 and n not in history.eval_steps:
            evaluate()
        batch = train_batch(train_rows, config, n, rank)
        with Timer() as timer:
            state, metrics = step(state, batch)
            loss = float(metrics["loss"])
        history.train_steps.append(n)
        history.train_loss.append(loss)
        history.step_seconds.append(timer.seconds)
        step_seconds.append(timer.seconds)
        progress.update(loss, tokens_per_step, timer.seconds)
        if config.checkpoint_every and state.step % config.checkpoint_every == 0 and state.step < config.steps:
            save_checkpoint()
    progress.close()
    seconds = time.perf_counter() - began
    if config.eval_every and state.step not in history.eval_steps:
        evaluate()
    if state.step > start:
        save_checkpoint()
    peak = gather_from_ranks(peak_rss_mib())  # a collective

    result: dict = {"steps": state.step, "resumed_from": start}
    exported = fs.export(state) if config.export else None  # a collective: every rank calls it
    if rank == 0:
        if history.train_loss:
            result["first_loss"], result["final_loss"] = history.train_loss[0], history.train_loss[-1]
        if history.eval_loss:
            result["first_eval_loss"], result["final_eval_loss"] = history.eval_loss[0], history.eval_loss[-1]
        if metrics is not None:
            result["summary"] = summary(
                steps=state.step - start,
                seconds=seconds,
                tokens=tokens_per_step * (state.step - start),
                peak_mib=peak,
                all_gather_bytes=metrics["all_gather_bytes"],
                reduce_scatter_bytes=metrics["reduce_scatter_bytes"],
                step_seconds=step_seconds,
                history=history,
            )
        if history.train_loss:
            title = f"LlamaForCausalLM on {config.world_size} ranks ({config.precision}, fs.sharded_step)"
            result["plot"] = str(plot_losses(out / "loss.png", history, title=title, resumed_at=start or None))
        if exported is not None:
            result.update(export_model(model, exported, out / "export", eval_batch, config))
    return result


def export_model(model, exported: dict, path: Path, batch, config: TrainConfig) -> dict:
    """Rank 0: load the trained weights into the module, `save_pretrained`, and check that
    `from_pretrained` gives back the same model (same logits); then sample from it."""
    from transformers import LlamaForCausalLM

    model.load_state_dict(exported)  # strict: every name of the module's state dict
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(json.dumps({"type": "bytes", "bos": BOS, "eos": EOS, "pad": PAD}))
    reloaded = LlamaForCausalLM.from_pretrained(path).eval()
    model.eval()
    input_ids, attention_mask, _ = batch
    with torch.no_grad():
        same = torch.equal(model(input_ids, attention_mask=attention_mask).logits,
                           reloaded(input_ids, attention_mask=attention_mask).logits)
        prompt = torch.tensor([[BOS] + encode("The")])
        generator_seed = torch.random.initial_seed()
        torch.manual_seed(config.seed)
        length = min(config.sample_bytes, config.seq_len - prompt.shape[1])
        ids = reloaded.generate(prompt, max_new_tokens=length, do_sample=True, temperature=0.8, top_k=0,
                                pad_token_id=PAD, eos_token_id=EOS, use_cache=True)
        torch.manual_seed(generator_seed)
    return {"export": str(path), "export_matches": same, "sample": decode(ids[0, 1:].tolist())}


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=d.world_size, help="processes (torchrun sets its own)")
    parser.add_argument("--steps", type=int, default=d.steps, help="train until the state has taken this many steps")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (paragraphs padded/cut)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision,
                        help="bf16: fs.Precision(param_dtype=bfloat16, reduce_dtype=float32)")
    parser.add_argument("--microbatches", type=int, default=d.microbatches,
                        help="gradient accumulation: split each batch into this many (divides --batch-size)")
    parser.add_argument("--clip", type=float, default=d.clip, help="clip the gradient's global norm (0: off)")
    parser.add_argument("--remat", action="store_true",
                        help="recompute activations in backward (fs.Schedule(remat=True))")
    parser.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps (0: off)")
    parser.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                        help="save a checkpoint every N steps (always at the end)")
    parser.add_argument("--stop-after", type=int, default=d.stop_after,
                        help="stop (with a checkpoint) after this many steps, as an interrupted run: the learning-rate "
                             "schedule still spans --steps, so --resume with the same --steps ends as the whole run")
    parser.add_argument("--resume", action="store_true", help="start from OUT/checkpoint")
    parser.add_argument("--out", default=d.out, help="where checkpoint/, loss.png, history.json and export/ go")
    parser.add_argument("--no-export", action="store_true", help="skip save_pretrained at the end")
    args = parser.parse_args(argv)
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size}")
    if args.resume and not (Path(args.out) / "checkpoint").exists():
        parser.error(f"--resume: no checkpoint in {Path(args.out) / 'checkpoint'} (run without --resume first)")
    return TrainConfig(
        world_size=args.world_size, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, precision=args.precision, microbatches=args.microbatches, clip=args.clip, remat=args.remat,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, stop_after=args.stop_after,
        resume=args.resume, out=args.out, export=not args.no_export,
    )


def report(result: dict) -> None:
    if "summary" in result:
        print(result["summary"])
    if "plot" in result:
        print(f"loss curve: {result['plot']}")
    if "export" in result:
        matches = "same logits" if result["export_matches"] else "DIFFERENT logits"
        print(f"exported to {result['export']}: LlamaForCausalLM.from_pretrained loads it ({matches})")
        print("sample:", result["sample"].strip().replace("\n", " / "))
    print({k: v for k, v in result.items() if k not in ("summary", "sample")})


if __name__ == "__main__":
    config = parse_args()
    # Spawns config.world_size local ranks; under torchrun, runs main in this rank. Either way
    # it returns rank 0's result (None on torchrun's other ranks) and shuts the mesh down.
    result = fs.launch(main, world_size=config.world_size, args=(config,))
    if result is not None:
        report(result)
