"""Full activation checkpointing keeps each block's input only, tensor-parallel blocks included.

`fs.Schedule(remat=True)` recomputes a block's forward in its backward from what it keeps. Two
things used to stay alive anyway: (1) tensor parallelism's activation collectives (with
sequence parallelism, the all-gather of the sequence before attention and before the MLP: `tp`
times a block input each), which the pass did not copy; (2) in a Llama block, the first norm of
the next block (`x * rsqrt(mean(x²))`, parameter-free up to its weight), which belonged to the
block before and was kept as a second copy of the block input. Now a block's activation
collectives are recomputed (one more collective of the same values: the same bits on every
rank) and parameter-free tails go to the block that reads them, so what a block keeps is its
input, as torchtitan's full activation checkpointing keeps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import functional_shard as fs
import functional_shard.tensor_parallel as tp
from functional_shard.models import GPT
from test_tp_compose import CONFIG, DATA, build_gpt, global_batch, rows

BATCH, LENGTH = 8, 32


def _kept_per_layer(layers: tuple[int, int], remat, sequence_parallel: bool) -> tuple[float, int]:
    """(bytes kept from forward to backward per block, a block input's bytes) of a Llama planned on
    `AbstractMesh({"fsdp": 2, "tp": 2})`, from the peak at two depths less the resident state."""
    transformers = pytest.importorskip("transformers")
    peaks = []
    for n in layers:
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=n, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, attn_implementation="sdpa",
        )  # fmt: skip
        mesh = fs.analysis.AbstractMesh({"fsdp": 2, "tp": 2})
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        rules = tp.hf_rules(model)
        apply_fn, params = fs.functionalize(tp.parallelize(model, rules, mesh, sequence_parallel=sequence_parallel))

        def loss_fn(p, batch):
            ids, labels = batch
            return F.cross_entropy(apply_fn(p, input_ids=ids, use_cache=False).logits.flatten(0, 1), labels.flatten())

        ids = torch.empty(BATCH, LENGTH, dtype=torch.long, device="meta")
        analysis, _ = fs.analysis.plan(loss_fn, params, (ids, ids), mesh=mesh, optimizer=fs.optim.sgd(0.1),
                                       placements=rules, schedule=fs.Schedule(remat=remat, reduce_scatters_in_flight=1))  # fmt: skip
        peaks.append(analysis.memory.peak - analysis.memory.resident)
    block_input = BATCH * LENGTH * 32 * 4 // (2 if sequence_parallel else 1)
    return (peaks[1] - peaks[0]) / (layers[1] - layers[0]), block_input


@pytest.mark.parametrize("sequence_parallel", [pytest.param(False, marks=pytest.mark.slow), True])  # the tails: both; collectives: SP
def test_full_remat_keeps_one_block_input_per_layer(sequence_parallel):
    kept, block_input = _kept_per_layer((3, 6), True, sequence_parallel)
    assert kept == block_input, (kept, block_input)
    without, _ = _kept_per_layer((3, 6), False, sequence_parallel)
    assert without > 4 * block_input  # what remat saves


def sp_remat(_) -> dict:
    """GPT at {fsdp: 2, tp: 2} with sequence parallelism and AdamW: remat traced == eager bit for
    bit; the traced graph with remat issues more tp collectives (the recomputed ones)."""
    mesh = fs.init_mesh({"fsdp": 2, "tp": 2})
    rules = tp.gpt_rules(CONFIG)
    apply_fn, params = fs.functionalize(tp.parallelize(build_gpt(), rules, mesh, sequence_parallel=True))

    def loss_fn(p, batch):
        ids, targets = batch
        return tp.vocab_parallel_cross_entropy(apply_fn(p, ids).flatten(0, 1), targets.flatten(), mesh, "tp")

    states, counts = {}, {}
    for label, schedule in (("eager", fs.Schedule(trace=False)), ("remat", fs.Schedule(remat=True)), ("plain", fs.Schedule())):
        step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(1e-2), placements=rules, schedule=schedule)
        state = step.init(params)
        for i in range(2):
            state, _ = step(state, rows(global_batch(i), mesh.data_rank))
        states[label] = state
        if schedule.trace:
            events = step.lower(state, rows(global_batch(0), mesh.data_rank)).events
            counts[label] = sum(1 for e in events if e.event.endswith("_issued") and e.axis == "tp")
    same = all(torch.equal(a, b) for a, b in zip(fs.tree_leaves(states["eager"]), fs.tree_leaves(states["remat"])))
    return {"same": same, "counts": counts}


def test_sequence_parallel_remat_recomputes_tp_collectives_with_the_eager_bits(local_world):
    for out in local_world(4).run(sp_remat):
        assert out["same"], out
        assert out["counts"]["remat"] > out["counts"]["plain"] > 0, out
