"""What `fs.analysis` reads of a pipelined step (`plan_pipeline`, `tune_pipeline`, `step.profile`'s
prediction): per stage, the bytes a micro-batch's forward saves and holds from its I to its W
(measured on fake tensors: no memory, no collective), its parameter elements, and the bytes per
element a rank holds. `PipelineStep` inherits them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ._pipe_saved import saved_bytes, split_bytes
from ._pytree import tree_flatten, tree_unflatten
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
                run = lambda call=p.module if p.call is None or self.compile else p.call: call(params, received, batch_leaves, local)  # noqa: E731
                lent = [r for r, b in zip(received, p.received) if b.lent]  # held for the step, not per micro-batch
                with torch.enable_grad():
                    out[p.index] = measure(p, run, params, received, params + batch_leaves + local + lent)
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

    def update_bytes(self, state: StepState) -> tuple[float, float]:
        """What the optimizer's update makes and holds at once beside its inputs (new moments and
        parameters, temporaries), as `(bytes per element of all the rank's buffers, bytes per
        element of its largest buffer)`: an elementwise optimizer copies every buffer's state
        (out of place) and works one buffer at a time (AdamW: 3 copies plus 2 temporaries of the
        largest, in float32 units; in place, when donated, the temporaries only). Fitted on two
        runs of `optimizer.apply` on meta tensors (no memory; the 0-dim leaves, a step count, real,
        at 1): one buffer, and the same elements as two. Local: no collective (run without the
        mesh: a clipping norm is a rank's alone, the same bytes). An optimizer that cannot run on
        synthetic buffers (parameter groups by name) is measured on this rank's own shards, every
        byte counted per element."""
        dtype = next((m.dtype for m in self._meta if m.dtype.is_floating_point), torch.float32)
        n = 1 << 12
        try:
            one = self._made_by_update({"a": torch.empty(2 * n, dtype=dtype, device="meta")}, None)
            two = self._made_by_update({"a": torch.empty(n, dtype=dtype, device="meta"),
                                        "b": torch.empty(n, dtype=dtype, device="meta")}, None)  # fmt: skip
            largest = (one - two) / n  # the largest buffer: 2n elements, then n
            return max(0.0, one / (2 * n) - largest), max(0.0, largest)
        except Exception:  # noqa: BLE001 - e.g. parameter groups naming leaves: this rank's own buffers
            layout = state.params.layout
            params = {spec.name: torch.empty(s.shape, dtype=s.dtype, device="meta")
                      for spec, s in zip(layout.buffers, state.params.shards) if spec.trainable}  # fmt: skip
            elements = sum(t.numel() for t in params.values())
            try:
                made = self._made_by_update(params, state.opt_state, self._leaf_layout(layout))
            except Exception as error:  # noqa: BLE001 - named, not swallowed
                raise ValueError(
                    f"the optimizer's update could not run on meta tensors to size its memory ({type(error).__name__}: "
                    f"{str(error)[:300]}); an fs.optim optimizer runs there"
                ) from error
            return (made / elements if elements else 0.0), 0.0

    def _made_by_update(self, params: dict, opt_state: Any, leaves=None) -> int:
        """The most bytes `optimizer.apply` makes and holds at once beside its inputs, on meta
        tensors (`opt_state`: this rank's, made meta; None: `optimizer.init(params)`)."""
        if opt_state is None:
            opt_state = self.optimizer.init(params)
        flat, spec = tree_flatten(opt_state)
        opt_state = tree_unflatten(spec, [
            (torch.ones((), dtype=t.dtype) if t.dim() == 0 else torch.empty(t.shape, dtype=t.dtype, device="meta"))
            if isinstance(t, torch.Tensor) else t for t in flat
        ])  # fmt: skip
        grads = {k: torch.empty_like(t) for k, t in params.items()}
        inputs = [*params.values(), *grads.values(), *(t for t in tree_flatten(opt_state)[0] if isinstance(t, torch.Tensor))]
        with _MadeBytes(inputs) as made:
            self.optimizer.apply(grads, opt_state, params, self.optimizer.scalars(opt_state), inplace=self.donate,
                                 mesh=None, **({} if leaves is None else {"leaves": leaves}))  # fmt: skip
        return made.peak

    def gather_bytes_per_element(self) -> int:
        """Bytes per parameter element of a stage while it runs: its gathered leaves and their summed gradient."""
        return 2 * max((m.dtype.itemsize for m in self._meta if m.dtype.is_floating_point), default=4)

    def batch_rows(self, batch: Any) -> int:
        """The leading dimension of the batch's tensors (what micro-batches cut)."""
        return next(t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor))


class _MadeBytes(TorchDispatchMode):
    """The most bytes of storages made by ops under this mode alive at once (each storage once,
    however many views; the `inputs`' storages never counted, even when an op returns them)."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in inputs}
        self.alive: dict = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.inputs:
                    self.alive.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.alive.values()))
        return out
