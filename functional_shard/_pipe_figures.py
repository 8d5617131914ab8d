"""What `fs.analysis` reads of a pipelined step (`plan_pipeline`, `tune_pipeline`, `step.profile`'s
prediction): per stage, the bytes a micro-batch's forward saves and holds from its I to its W
(measured on fake tensors: no memory, no collective), its parameter elements, and the bytes per
element a rank holds. `PipelineStep` inherits them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._pipe_saved import saved_bytes, split_bytes
from ._pytree import tree_flatten
from ._stages import Cut
from ._state import StepState

__all__ = ["StageFigures"]


class StageFigures:
    """Mixed into `PipelineStep` (which provides `_meta`, `_stage_of_leaf`, `_micro`, `num_stages`)."""

    def saved_per_microbatch(self, cut: Cut, batch: Any) -> dict:
        """Stage -> bytes one micro-batch's forward saves for its backward, on fake tensors (every
        stage, not only this rank's: no memory, no collective)."""
        return self._fake_stages(cut, batch, lambda p, run, params, received, persistent: saved_bytes(run, None, persistent)[1])

    def split_bytes_per_microbatch(self, cut: Cut, batch: Any) -> dict:
        """Stage -> (bytes one micro-batch's forward saves, bytes it holds from its I to its W: the
        saved values its I leaves alive and the gradients it keeps for W), on fake tensors; one
        forward per stage gives both (`saved_per_microbatch`'s figure is the first)."""
        last = self.num_stages - 1
        return self._fake_stages(cut, batch, lambda p, run, params, received, persistent: split_bytes(
            run, received, params, p.index == last, p.sent, persistent=persistent))  # fmt: skip

    def _fake_stages(self, cut: Cut, batch: Any, measure: Callable) -> dict:
        from torch._subclasses.fake_tensor import FakeTensorMode

        micro = tree_flatten(self._micro(batch)[0])[0]
        out = {}
        with FakeTensorMode(allow_non_fake_inputs=True):
            for p in cut.stages:
                params = [torch.empty(self._meta[i].shape, dtype=self._meta[i].dtype).requires_grad_(self._meta[i].dtype.is_floating_point)
                          for i in p.params]  # fmt: skip
                received = [torch.empty(b.shape, dtype=b.dtype).requires_grad_(b.differentiable) for b in p.received]
                batch_leaves = [torch.empty(micro[i].shape, dtype=micro[i].dtype) for i in p.batch]
                local = [torch.empty(self._meta[i].shape, dtype=self._meta[i].dtype) for i in p.local]
                # run(): the program on these inputs; run(call): `call` (an fx.Interpreter's run, say) on them
                run = lambda call=p.module: call(params, received, batch_leaves, local)  # noqa: E731
                with torch.enable_grad():
                    out[p.index] = measure(p, run, params, received, params + batch_leaves + local)
        return out

    def stage_param_elements(self, stage_of_leaf: list | None = None) -> dict:
        """Stage -> parameter elements of its units (whole leaves, this rank's tp pieces), under the
        step's own cut or `stage_of_leaf` (per leaf its stage, None for a buffer)."""
        stage_of_leaf = self._stage_of_leaf if stage_of_leaf is None else stage_of_leaf
        out = {s: 0 for s in {s for s in stage_of_leaf if s is not None} | set(range(self.num_stages))}
        for meta, stage in zip(self._meta, stage_of_leaf):
            if stage is not None:
                out[stage] += meta.numel()
        return out

    def state_bytes_per_element(self, state: StepState | None = None) -> int:
        """Bytes a rank holds between steps per parameter element it keeps: the shard, the
        optimizer state (read from `state` when given; else AdamW's two float32 moments) and a
        gradient shard."""
        shard = max((m.dtype.itemsize for m in self._meta if m.dtype.is_floating_point), default=4)
        if state is None:
            return shard + 8 + shard
        elements = sum(s.numel() for s in state.params.shards) or 1
        optimizer = sum(t.numel() * t.element_size() for t in tree_flatten(state.opt_state)[0]
                        if isinstance(t, torch.Tensor) and t.dim() > 0)  # fmt: skip
        return round(shard + optimizer / elements + shard)

    def gather_bytes_per_element(self) -> int:
        """Bytes per parameter element of a stage while it runs: its gathered leaves and their summed gradient."""
        return 2 * max((m.dtype.itemsize for m in self._meta if m.dtype.is_floating_point), default=4)

    def batch_rows(self, batch: Any) -> int:
        """The leading dimension of the batch's tensors (what micro-batches cut)."""
        return next(t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))
