"""Sharded checkpoints of training states: `save(path, state)`, `load(path, template)`, `read(path)`.

    fs.checkpoint.save("ckpt/step-1000", state)                 # every rank
    state = fs.checkpoint.load("ckpt/step-1000", step.init(params))   # any world size, mesh or units
    state = step.init(meta_params, initialize=fs.checkpoint.from_safetensors("model.safetensors"))

A checkpoint is a directory: `index.json` (names, shapes, dtypes, where each chunk is, the
optimizer's structure, the step, a format version), one safetensors file per writing rank, and
a `COMMIT` marker written last. Tensors are named by leaf path and stored as full logical
tensors cut into 1-D chunks (a leaf split by a tensor-parallel placement in an order that keeps
each rank's piece contiguous), so a checkpoint depends on neither the world size, nor the mesh,
nor the placements, nor the unit policy. See docs/checkpoints.md.
"""

from ._dcp import load_dcp as load_dcp
from ._dcp import read_dcp as read_dcp
from ._dcp_save import save_dcp as save_dcp
from ._format import CheckpointError as CheckpointError
from ._full import from_safetensors as from_safetensors
from ._full import load_full as load_full
from ._load import load as load
from ._load import read as read
from ._save import save as save

__all__ = ["CheckpointError", "from_safetensors", "load", "load_dcp", "load_full", "read", "read_dcp", "save", "save_dcp"]
