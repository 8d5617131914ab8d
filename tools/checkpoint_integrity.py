"""What checkpoint integrity costs: save and load times of the GPT benchmark model, and the CRC-32s alone.

    python tools/checkpoint_integrity.py --world 2 --repeats 9

Builds the `gpt` workload of `benchmarks/_workloads.py` (8 layers, d_model 256: 6.4 M parameters)
with AdamW, takes one step (so the optimizer state is full), then saves it `--repeats` times to
new directories and loads each back, on `--world` gloo processes, alternating three arms:
`crc32` (as shipped: checksums written, every chunk read checked), `verify=False` (checksums
written, `load(..., verify=False)`), and `none` (the same code with the checksum function
replaced by a constant, loaded with `verify=False`: no checksum work at all). Prints, per rank
and arm, the median and spread of save and load times, and how long `zlib.crc32` alone takes
over this rank's bytes. Alternating the arms within one run keeps a loaded machine's drift out
of the differences. With an `fs.checkpoint` that has no checksums
(`PYTHONPATH=/path/to/an/old/checkout`), only the `as is` arm runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import functional_shard as fs  # noqa: E402
from _workloads import Workload  # noqa: E402


def measure(mesh, directory: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    workload = Workload("gpt")
    apply_fn, params = fs.functionalize(workload.build(0))
    step = fs.sharded_step(
        lambda p, b: workload.loss(apply_fn(p, b[0]), b[1]), mesh, optimizer=fs.optim.adamw(1e-3), schedule=fs.Schedule(trace=False)
    )
    state, _ = step(step.init(params), workload.batch(2, seed=0, rank=mesh.rank, step=0))
    from functional_shard.checkpoint import _files

    shipped = getattr(_files, "checksum", None)
    constant = lambda tensor: "00000000"  # noqa: E731
    arms = {"crc32": (shipped, True), "verify=False": (shipped, False), "none": (constant, False)} if shipped else {"as is": (None, None)}
    times: dict[str, dict[str, list[float]]] = {arm: {"save": [], "load": []} for arm in arms}
    template = step.init(params)
    for i in range(repeats):
        for arm, (function, verify) in arms.items():
            if function is not None:
                _files.checksum = function
            path = os.path.join(directory, f"c{i}-{arm.replace(' ', '').replace('=', '')}")
            mesh.all_gather_world(torch.zeros(1))
            t = time.perf_counter()
            fs.checkpoint.save(path, state)
            times[arm]["save"].append(time.perf_counter() - t)
            mesh.all_gather_world(torch.zeros(1))
            t = time.perf_counter()
            fs.checkpoint.load(path, template) if verify is None else fs.checkpoint.load(path, template, verify=verify)
            times[arm]["load"].append(time.perf_counter() - t)
    if shipped:
        _files.checksum = shipped
    tensors = [t.detach().contiguous() for t in fs.tree_leaves(state) if t.numel()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    crcs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for tensor in tensors:
            zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy())
        crcs.append(time.perf_counter() - t)
    return {"arms": times, "crc": crcs, "bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="ckpt-integrity-")
    try:
        with fs.testing.LocalWorld(args.world, collective_timeout=300.0, call_timeout=1200.0) as world:
            results = world.run(measure, directory, args.repeats)
        first = os.path.join(directory, sorted(os.listdir(directory))[0])
        size = sum(os.path.getsize(os.path.join(first, n)) for n in os.listdir(first))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    def ms(values: list[float]) -> str:
        return f"{1e3 * statistics.median(values):7.1f} ms (min {1e3 * min(values):.1f}, max {1e3 * max(values):.1f})"

    print(f"fs {fs.__version__} at {os.path.dirname(fs.__file__)}; world {args.world}; checkpoint {size / 1e6:.1f} MB")
    for rank, r in enumerate(results):
        for arm, t in r["arms"].items():
            print(f"rank {rank} {arm:>12}: save {ms(t['save'])}  load {ms(t['load'])}")
        print(f"rank {rank}: zlib.crc32 alone over its {r['bytes'] / 1e6:.1f} MB: {ms(r['crc'])}")


if __name__ == "__main__":
    main()
