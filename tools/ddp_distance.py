"""How far fs and DDP end from single-process training, over many data seeds.

    python tools/ddp_distance.py --world-size 4 --seeds 10            # both HF models
    python tools/ddp_distance.py --world-size 2 --seeds 10 --arch llama
    python tools/ddp_distance.py --world-size 4 --seeds 4 --control   # also DDP in another bucket layout

Runs `tests/test_training.py::hf_train` (Hugging Face Llama and GPT-2 from small configs,
padded batches with -100 labels, 5 AdamW steps; fs traced and eager, DDP and single-process
training on the concatenated batch) once per data seed in one `fs.testing.LocalWorld`, and
prints, per seed, the largest per-tensor relative distance (max |p - p_ref| / max |p_ref|) of
fs and of DDP, their ratio, and the ratio of the Euclidean distances over all parameters; then
how often fs is the further of the two. Both are rounding noise away from the reference (AdamW
magnifies the noise where a gradient is ~0), so which of the two is further on one run is, at
world sizes where they sum the ranks' gradients in different orders, close to a coin toss.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    import functional_shard as fs
    from test_training import hf_train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--arch", choices=("llama", "gpt2"), nargs="+", default=["llama", "gpt2"])
    parser.add_argument("--control", action="store_true",
                        help="also DDP with one bucket per parameter: how far DDP ends from default DDP's distance")
    args = parser.parse_args()
    with fs.testing.LocalWorld(args.world_size, collective_timeout=60.0, call_timeout=600.0) as world:
        for arch in args.arch:
            ratios, l2_ratios, controls = [], [], []
            for seed in range(args.seeds):
                r = world.run(hf_train, arch, seed, False, args.control)[0]
                if args.control:
                    controls.append(r["worst_ddp_buckets"] / r["worst_ddp"])
                ratios.append(r["worst_fs"] / r["worst_ddp"])
                l2_ratios.append(r["l2_fs"] / r["l2_ddp"])
                assert r["traced_equals_eager"], (arch, seed)
                print(
                    f"{arch} world {args.world_size} seed {seed}: max rel. distance fs {r['worst_fs']:.3e}, "
                    f"DDP {r['worst_ddp']:.3e}, fs/DDP {ratios[-1]:.2f}; euclidean fs/DDP {l2_ratios[-1]:.3f}"
                    + (f"; DDP one bucket per parameter / DDP {controls[-1]:.2f}" if args.control else ""),
                    flush=True,
                )
            named = [("max", "fs", ratios), ("euclidean", "fs", l2_ratios)]
            if args.control:
                named.append(("max", "DDP one bucket per parameter", controls))
            for name, arm, values in named:
                print(
                    f"{arch} world {args.world_size}, {name} distance: {arm} further than DDP on "
                    f"{sum(v > 1 for v in values)} of {len(values)} seeds, equal on {sum(v == 1 for v in values)}; "
                    f"{arm}/DDP median {statistics.median(values):.2f}, range {min(values):.2f}-{max(values):.2f}"
                )


if __name__ == "__main__":
    main()
