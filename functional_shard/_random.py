"""The step's random numbers: one stream per step and data-parallel rank, or per canonical chunk.

A step seeds torch's generators (the CPU one and, on a CUDA mesh, its device's) from
`(seed, step, data rank)` for its duration and restores them afterwards (`stream`): ranks that
differ only on a model-parallel axis draw the same numbers (the same dropout mask on the
activations they all hold). A layout-invariant step (`sharded_step(..., canonical_chunks=G)`)
draws per chunk instead: before each chunk the `functional_shard::reseed` op seeds the
generators from `(seed, step, chunk)`; traced graphs hold it as a node and replay it, so the
masks are the same at every layout, eager or traced. A pipelined step seeds each stage's forward
of each micro-batch from `(seed, step, data rank, stage, micro-batch)` (`seed_forward`): the
masks do not depend on the schedule's order, and no two stages draw the same ones.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

from . import _tracing

__all__ = ["stream_seed", "stream", "chunk_seed", "reseed", "forward_seed", "seed_forward"]


def stream_seed(seed: int, step: int, rank: int) -> int:
    """The seed of step `step` on rank `rank`: a hash of the three, so streams do not overlap."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _seed_generators(seed: int, device: torch.device) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)


@contextlib.contextmanager
def stream(seed: int, step: int, rank: int | None, device: torch.device) -> Iterator[None]:
    """Torch's generators seeded for step `step` on data-parallel rank `rank` (None: a
    layout-invariant step, whose chunks reseed them), restored afterwards: the CPU one and,
    on a CUDA device, its own (what `torch.manual_seed` seeds there, without queueing a seed
    for every other device type: ~1 ms a step)."""
    base = stream_seed(seed, step, -1 if rank is None else rank)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _tracing.random_stream(base):
        _seed_generators(base, device)
        yield


def forward_seed(base: int, stage: int, microbatch: int) -> int:
    """The seed of a pipeline stage's forward of one micro-batch in the step whose stream is `base`."""
    digest = hashlib.blake2b(f"{base}:stage:{stage}:{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_forward(stage: int, microbatch: int, device: torch.device) -> None:
    """Seed the generators for stage `stage`'s forward of micro-batch `microbatch` (a pipelined
    step, inside its `stream`): each forward draws its own numbers, whatever the schedule runs
    before it on the rank and whichever rank holds the stage, so every schedule gives the same
    dropout masks, and two stages never the same ones."""
    base = _tracing.random_base()
    if base is None:
        raise RuntimeError("internal: a pipeline stage's forward ran outside a step's random stream")
    _seed_generators(forward_seed(base, stage, microbatch), device)


def chunk_seed(base: int, chunk: int) -> int:
    """The seed of chunk `chunk`'s random numbers in the step whose stream is `base`."""
    digest = hashlib.blake2b(f"{base}:chunk:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.library.custom_op("functional_shard::reseed", mutates_args=())
def _reseed(chunk: int, device: torch.device) -> None:
    base = _tracing.random_base()
    if base is None:
        raise RuntimeError("internal: functional_shard::reseed ran outside a step's random stream")
    _seed_generators(chunk_seed(base, chunk), device)


@_reseed.register_fake
def _(chunk: int, device: torch.device) -> None:
    return None


def reseed(chunk: int, device: torch.device) -> None:
    """Seed the step's generators for chunk `chunk` (eagerly, or as a node a traced step replays)."""
    torch.ops.functional_shard.reseed(chunk, device)
