#!/usr/bin/env bash
# A separate virtual environment for benchmarks/compare.py with every peer installed:
# functional_shard (editable, from this checkout), DeepSpeed ZeRO-3, torchtitan's SimpleFSDP.
# The package's own tests never need it.
#
#     bash benchmarks/setup_peers.sh [VENV]        # default: ../bench-venv beside the checkout
#     VENV/bin/python benchmarks/compare.py ...
#
# torch is pinned and installed first: DeepSpeed builds from an sdist without build isolation
# (isolation would fetch an unpinned CUDA torch), and torchtitan / spmd_types go in with
# --no-deps, so nothing ever resolves a plain `torch` requirement to another build.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$REPO/../bench-venv}"
TORCH="torch==2.13.0"

python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install "$TORCH"
"$PIP" install "$TORCH" -e "$REPO" matplotlib
# DeepSpeed 0.19.8 ZeRO-3 on CPU: no compiled ops, the CPU accelerator.
DS_ACCELERATOR=cpu DS_BUILD_OPS=0 "$PIP" install --no-build-isolation "$TORCH" deepspeed==0.19.8
# SimpleFSDP (torchtitan.experiments.graph_trainer.simple_fsdp) and what it imports.
"$PIP" install --no-deps torchtitan==0.3.0 spmd_types==0.2.3
"$PIP" install "$TORCH" tyro
"$VENV/bin/python" - <<'PY'
import torch, deepspeed, functional_shard
from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel
print(f"bench venv ok: torch {torch.__version__}, deepspeed {deepspeed.__version__}, functional_shard {functional_shard.__version__}")
PY
