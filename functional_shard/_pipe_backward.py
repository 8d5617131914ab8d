"""A pipeline stage's working values on this rank during a step (`Stage`) and the backward
actions through it (`backward`): B, or its two halves I and W (`_split_backward`), of one
micro-batch: the parameters' gradients added to the stage's sums, the received values'
cotangents kept for `SEND_B`. Walked by `_pipe_run.run_actions`."""

from __future__ import annotations

import contextlib

import torch

from . import _split_backward
from .pipeline import Action, ActionKind

__all__ = ["Stage", "backward"]

K = ActionKind


class Stage:
    """One stage's working values on this rank during a step."""

    def __init__(self):
        self.leaves: list[torch.Tensor] | None = None  # gathered parameters, in the program's order
        self.local: list[torch.Tensor] = []
        self.sums: list[torch.Tensor | None] = []  # summed gradient per parameter leaf
        self.owned: list[bool] = []  # sums[j] is a tensor of the step's own (not autograd's): added into in place
        self.graphs: dict[int, tuple[list, list]] = {}  # micro-batch -> (inputs, outputs) of its forward
        self.received: dict[int, list] = {}  # micro-batch -> received values (tensors or pending works)
        self.cotangents: dict[int, list] = {}  # micro-batch -> received cotangents of its sent values
        self.input_cotangents: dict[int, list] = {}  # micro-batch -> cotangents of its received values
        self.outputs: dict[int, list] = {}  # micro-batch -> values to send forward
        self.kept: dict[int, _split_backward.Split] = {}  # micro-batch -> what its I kept for its W
        self.reduce_dtypes: list = []
        self.tree = None  # a layout-invariant step's _canonical.TreeSum over the micro-batches
        self.lent: dict[int, torch.Tensor] = {}  # received position -> a lent value (`Boundary.lent`), held for the step
        self.lent_cotangents: dict[int, torch.Tensor] = {}  # its cotangents' sum so far (fp32 at least)


def _recompute(run, rng, mesh) -> list:
    """A rematerialized stage's forward again, with autograd, from the RNG state its F saw (the
    same dropout masks, hence the same values), leaving the step's stream where it was."""
    device = getattr(mesh, "device", torch.device("cpu"))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1], device)
        with torch.enable_grad():
            return run()


def backward(a: Action, st: Stage, stages, program, schedule, last, ready, mesh=None, last_b=None, seed=None) -> None:
    """B, I or W of micro-batch `a.microbatch` through stage `a.stage`: gradients of the parameters
    added to the stage's sums (B, W), cotangents of the received values kept for SEND_B (B, I).
    I and W split the backward (`_split_backward`): I runs the input path only and keeps, until
    W, what the weights' gradients need; W runs the weight side only. The same bits as B.
    A lent value's cotangents are summed over the stage's backwards and kept for the last one's
    SEND_B (`last_b`: its micro-batch), None before; a sent lent value's root is seeded only by
    that sum, in the backward of the micro-batch it comes back with."""
    s, m = a.stage, a.microbatch
    if a.kind is K.W:  # the weight side of the graph its I kept, then freed
        _add_gradients(st, _split_backward.backward_weight(st.kept.pop(m)))
        return
    inputs, outputs = st.graphs.pop(m)
    if isinstance(outputs, tuple):  # rematerialized: recomputed here (an I's graph serves its W)
        outputs = _recompute(*outputs, mesh)
    if s == last:  # the loss: seeded with 1, or the loss scale (the mean over micro-batches and ranks is taken after)
        one = torch.ones_like(outputs[0])
        roots, cotangents = [outputs[0]], [one if seed is None else one * seed.to(one.dtype)]
    else:
        roots = [o for o, b in zip(outputs, program.sent) if b.differentiable]
        if schedule.rank_of(s + 1) == schedule.rank_of(s):
            cotangents = stages[s + 1].input_cotangents.pop(m)
        else:
            ready(K.RECV_B, s, m)
            cotangents = st.cotangents.pop(m)
    lent = [b.lent for b in program.received if b.differentiable]  # per differentiable input
    diff_inputs = [t for t in inputs if t.requires_grad]
    pairs = [(r, c) for r, c in zip(roots, cotangents) if r.requires_grad and c is not None]
    del inputs, outputs, roots, cotangents  # what W needs, the split keeps; the rest is freed with the graph
    if a.kind is K.I:
        roots, cotangents = [r for r, _ in pairs], [c for _, c in pairs]
        del pairs
        cots, st.kept[m] = _split_backward.backward_input(roots, cotangents, diff_inputs, st.leaves)
        del roots, cotangents
    else:
        diff_params = [p for p in st.leaves if p.requires_grad]
        targets = diff_params + diff_inputs
        with program.remat.full_backward() if program.remat is not None else contextlib.nullcontext():
            if targets and pairs and st.tree is None:
                cots = _accumulating_backward(st, pairs, targets, diff_inputs)
            else:
                cots = _grad_backward(st, pairs, diff_params, targets)
        del pairs
    cots = list(cots)
    for j, (c, t) in enumerate(zip(cots, diff_inputs)):
        if lent and lent[j]:  # summed here, sent once (a stage relaying it gets None but once: no zeros added)
            total = st.lent_cotangents.get(j)
            if c is not None:
                c = c.to(torch.promote_types(c.dtype, torch.float32))
                st.lent_cotangents[j] = c if total is None else total + c
            if m == last_b:
                total = st.lent_cotangents.pop(j, None)
                cots[j] = torch.zeros_like(t) if total is None else total.to(t.dtype)
            else:
                cots[j] = None
        elif c is None:
            cots[j] = torch.zeros_like(t)
    st.input_cotangents[m] = cots


def _grad_backward(st: Stage, pairs: list, diff_params: list, targets: list) -> list:
    """A B's backward by `autograd.grad` (a layout-invariant step's tree takes each micro-batch's
    gradients whole): the gradients added to the sums; returns the inputs' cotangents."""
    if targets and pairs:
        got = torch.autograd.grad([r for r, _ in pairs], targets, [c for _, c in pairs], allow_unused=True)
    else:
        got = [None] * len(targets)
    it = iter(got[: len(diff_params)])
    _add_gradients(st, [next(it) if p.requires_grad else None for p in st.leaves])
    return list(got[len(diff_params):])


def _accumulating_backward(st: Stage, pairs: list, targets: list, diff_inputs: list) -> list:
    """A B's backward that adds each parameter's gradient to the stage's sum as autograd makes it
    (`AccumulateGrad` into the sum set as the leaf's `.grad`, in place: `sum += g`, the bits of
    `_add_gradients`), as torch's own pipelining accumulates into `.grad`; `autograd.grad` would
    hold every gradient of the micro-batch until the stage's whole backward returns, up to a
    second copy of the stage's gradients beside the sums. A sum autograd made (the first
    micro-batch's) is copied once before it is added into; a leaf whose sum has another dtype
    (a reduce dtype above the parameters') gets its gradient cast and added after. Returns the
    cotangents of `diff_inputs` (None where none reaches them); `targets`: the trainable leaves,
    then `diff_inputs`."""
    preset = []
    for j, p in enumerate(st.leaves):
        into = p.requires_grad and st.sums[j] is not None and st.sums[j].dtype == p.dtype
        if into and not st.owned[j]:  # autograd's tensor, which may be another leaf's gradient too
            st.sums[j], st.owned[j] = st.sums[j].clone(), True
        p.grad = st.sums[j] if into else None
        preset.append(into)
    for t in diff_inputs:
        t.grad = None
    torch.autograd.backward([r for r, _ in pairs], [c for _, c in pairs], inputs=targets)
    grads = []
    for j, p in enumerate(st.leaves):
        g, p.grad = p.grad, None
        grads.append(None if preset[j] or g is None else g)  # preset: added in place already
    _add_gradients(st, grads)
    cots = []
    for t in diff_inputs:
        cots.append(t.grad)
        t.grad = None
    return cots


def _add_gradients(st: Stage, grads: list) -> None:
    """One micro-batch's gradients (per parameter leaf, None where none) added to the stage's sums."""
    for j, g in enumerate(grads):
        if g is not None:
            g = g.to(st.reduce_dtypes[j])
            if st.tree is not None:
                st.sums[j] = g  # this micro-batch's, for the tree below
            elif st.sums[j] is None:
                st.sums[j] = g
            elif st.owned[j]:
                st.sums[j].add_(g)  # the same bits as out of place, without a new buffer per micro-batch
            else:  # the first sum is autograd's tensor, which may be another leaf's gradient too: a new one
                st.sums[j] = st.sums[j] + g
                st.owned[j] = True
    if st.tree is not None:  # every parameter's gradient of this micro-batch, one tree step
        st.tree.add([
            g if g is not None else torch.zeros(p.shape, dtype=d, device=p.device)
            for g, p, d in zip(st.sums, st.leaves, st.reduce_dtypes)
        ])  # fmt: skip
        st.sums = [None] * len(st.leaves)
