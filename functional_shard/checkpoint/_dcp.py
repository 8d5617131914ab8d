"""`load_dcp`: a `torch.distributed.checkpoint` (DCP) checkpoint of an FSDP2 model and its
`torch.optim.AdamW` into an fs state, at any world size; `read_dcp`: its contents in one process.

    # what an FSDP2 job saves (torch's recipe):
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    # every rank of the fs job, at any world size:
    step = fs.sharded_step(loss_fn, mesh, optimizer=fs.optim.adamw(lr, weight_decay=...))
    state = fs.checkpoint.load_dcp(path, step.init(params))

The model's tensors are matched by state-dict name (a leaf's path, or one of its aliases: a tied
weight), the optimizer's by parameter name (`optim.state.<fqn>.exp_avg`): torch's per-parameter
`exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq`) become the shards of `AdamWState`'s, its `step`
(equal for every parameter) the state's `count` and step number. Each rank reads only the
ranges its shards keep, from whichever stored chunks hold them. Nothing in the files is run:
see `_dcp_files` for the trust boundary.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import optree
import torch

from .._export_file import state_dict_names
from .._layout import BufferSpec, Layout
from .._mesh import BaseMesh
from .._placed import layout_groups
from .._pytree import NAMESPACE
from .._shard import _check_shards
from .._step import StepState
from ..optim import AdamWState
from ..tensor_parallel._placement import split_tensor
from ._dcp_files import DcpIndex, DcpReader, DcpTensor, read_metadata
from ._format import CheckpointError, _entry_name, held_elsewhere, piece_start, shard_pieces, split_order

__all__ = ["load_dcp", "read_dcp"]

OPERATION = "fs.checkpoint.load_dcp"
ADAMW_STATE = ("exp_avg", "exp_avg_sq")  # torch.optim.AdamW's per-parameter tensors (and `step`)
_SHOWN = 6  # names listed in a mismatch message before "... (n in all)"
_KNOWN_STATE = {  # per-parameter state names of other torch optimizers, for messages
    "momentum_buffer": "torch.optim.SGD's",
    "max_exp_avg_sq": "AdamW(amsgrad=True)'s",
    "sum": "Adagrad's",
    "square_avg": "RMSprop's",
}


def load_dcp(
    path: str | os.PathLike,
    template: StepState,
    *,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
    rename: Callable[[str], str] | None = None,
    strict: bool = True,
) -> StepState:
    """The state saved by `torch.distributed.checkpoint` at `path`, laid out like `template`; every rank.

    Arguments:
        path: a DCP checkpoint directory (`dcp.save(..., checkpoint_id=path)`, torch's default
            file system writer), the same on every rank.
        template: a `StepState` of the step that will continue training, e.g. `step.init(params)`
            with `fs.optim.adamw` (alone, or chained after stateless transformations such as
            `clip_by_global_norm`): it gives the mesh, the layout and the optimizer state's
            structure. Its values are ignored and never modified, except what the checkpoint
            does not hold (see `optim_key`).
        model_key: the key the model's state dict was saved under (`"model"` in torch's recipe
            `{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}`), or
            None for a state dict saved as it is (`dcp.save(model.state_dict(), ...)`).
        optim_key: the key of the optimizer's state dict (FQN-keyed, as `get_optimizer_state_dict`
            writes it), or None to load the model only: the template's optimizer state and step
            number are kept (a fresh `step.init` gives a fine-tuning run's start).
        rename: fs state-dict name -> the checkpoint's parameter name (e.g.
            `lambda n: "_orig_mod." + n` for a `torch.compile`d model); default as is.
        strict: refuse model tensors that no leaf of the template takes (as
            `load_state_dict(strict=True)` does).

    Returns a new `StepState` of the template's step whose gathered parameters, `exp_avg`,
    `exp_avg_sq` (and `max_exp_avg_sq` with `amsgrad`) equal the checkpoint's tensors bit for
    bit, whose `count` is torch's per-parameter `step` and whose step number is that count. The
    RNG seed is the template's. Each rank reads only the byte ranges its shards need (whole
    chunks of the tensors they touch), at any world size, mesh or unit policy; with
    tensor-parallel placements, a leaf split along another dimension than its first is read
    whole (one at a time) and cut to this rank's piece.

    Raises `CheckpointError` on every rank, before any tensor is read: naming the missing, extra
    or mismatched tensors with their shapes and dtypes (no casts are made), an optimizer state
    of another kind (`momentum_buffer`, a non-AdamW template), parameters whose `step` counts
    differ (fs keeps one count), or a file it refuses. Hyperparameters (the learning rate, betas,
    weight decay) are not part of an fs state: build `fs.optim.adamw` with the values of the
    FSDP2 job (`read_dcp(path)["optim.param_groups.0.lr"]`, ...).

    Trust: `.metadata` is read by a restricted unpickler that resolves only DCP's metadata
    classes, `torch.Size`, dtypes and layouts (any other global refuses the file, unexecuted),
    tensors with `torch.load(weights_only=True)`; non-tensor values are not read.
    """
    if not isinstance(template, StepState):
        raise TypeError(
            "fs.checkpoint.load_dcp expects a template StepState (from step.init(params)); "
            f"got {type(template).__name__}"
        )
    _check_shards(template.params)
    mesh = template.params.mesh
    mesh.agree(OPERATION)
    rename = rename or (lambda name: name)
    groups = layout_groups(template.params.layout, mesh)
    elsewhere = held_elsewhere(template.params.layout, groups, mesh, rename) if len(set(groups)) > 1 else None
    result, error = None, None
    try:
        result = _load_here(os.path.abspath(path), template, model_key, optim_key, rename, strict, elsewhere)
    except Exception as e:  # noqa: BLE001 (the other ranks must learn of it)
        error = e
    mesh.succeed_together(
        OPERATION,
        error,
        lambda failed: CheckpointError(f"ranks {failed} could not load {path} (see their errors); no rank loaded it"),
    )
    if elsewhere is not None:  # each pipeline coordinate read its own parameters' `step`s: one count for all
        mesh.check_same(f"the step count read from {path} (every parameter's `step`)", str(result.step))
    return result


def read_dcp(path: str | os.PathLike) -> dict[str, Any]:
    """Every value of the DCP checkpoint at `path`, whole, by flattened key
    (`model.blocks.0.attn.weight`, `optim.state.<fqn>.exp_avg`, `optim.param_groups.0.lr`), in one
    process: tensors, and plain Python values read with `torch.load(weights_only=True)`. For
    inspection and conversion; the same trust boundary as `load_dcp`."""
    index = read_metadata(os.path.abspath(path))
    with DcpReader(index) as reader:
        out: dict[str, Any] = {key: reader.read(key) for key in index.tensors}
        out.update({key: reader.read_object(key) for key in index.objects})
    return out


# --- what the checkpoint holds, by name -----------------------------------------------------------


def _path_of(index: DcpIndex, key: str) -> tuple:
    """The key's path in the nested state dict (planner data), else the flattened key split
    as well as it can be (parameter names contain dots: only prefixes are split off)."""
    return index.paths.get(key, (key,))


def _model_tensors(index: DcpIndex, model_key: str | None, optim_key: str | None) -> dict[str, DcpTensor]:
    """Parameter name -> tensor, for the model's entries."""
    out = {}
    for key, tensor in index.tensors.items():
        path = _path_of(index, key)
        if model_key is None:
            if len(path) == 1 and not (optim_key and key.startswith(optim_key + ".")):
                out[str(path[0])] = tensor
        elif len(path) == 2 and path[0] == model_key:
            out[str(path[1])] = tensor
        elif key not in index.paths and key.startswith(model_key + "."):
            out[key[len(model_key) + 1 :]] = tensor
    return out


def _optimizer_tensors(index: DcpIndex, optim_key: str) -> dict[str, dict[str, DcpTensor]]:
    """Parameter name -> state name (`exp_avg`, `step`, ...) -> tensor."""
    out: dict[str, dict[str, DcpTensor]] = {}
    prefix = f"{optim_key}.state."
    for key, tensor in index.tensors.items():
        path = _path_of(index, key)
        if len(path) == 4 and path[:2] == (optim_key, "state"):
            fqn, name = str(path[2]), str(path[3])
        elif key not in index.paths and key.startswith(prefix) and "." in key[len(prefix) :]:
            fqn, name = key[len(prefix) :].rsplit(".", 1)
        else:
            continue
        out.setdefault(fqn, {})[name] = tensor
    return out


def _top_level(index: DcpIndex) -> str:
    """What the checkpoint holds at its top level, in words (for messages)."""
    keys = [*index.tensors, *index.objects]
    nested = sorted({str(_path_of(index, key)[0]) for key in keys if len(_path_of(index, key)) > 1})
    flat = [key for key in keys if len(_path_of(index, key)) == 1]
    parts = [f"the keys {nested}"] if nested else []
    if flat:
        parts.append(f"{len(flat)} tensors at the top level ({_listing([repr(k) for k in flat][:3])}, ...)")
    return " and ".join(parts) or "nothing"


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")


def _describe(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


# --- the model ------------------------------------------------------------------------------------


def _match_model(
    layout: Layout, local: list[torch.Tensor], found: dict[str, DcpTensor], rename, strict: bool, where: str,
    elsewhere: set[str] = frozenset(),
) -> dict[int, DcpTensor]:
    """Leaf index -> its tensor in the checkpoint (non-persistent buffers left out); raises
    naming every missing, mismatched and (with `strict`) extra tensor: one no leaf of this
    state takes, nor one of another rank's (`elsewhere`: a pipelined state's other stages)."""
    matched: dict[int, DcpTensor] = {}
    missing, mismatched, used = [], [], set(elsewhere)
    local_of = dict(zip(layout.local, local))
    for i, names in enumerate(state_dict_names(layout)):
        candidates = [rename(n) for n in names]
        used.update(candidates)
        name = next((c for c in candidates if c in found), None)
        want = _describe(layout.dtypes[i], layout.full_shape(i))
        if not names:  # a non-persistent buffer: no state dict holds it; the template's value stays
            if local_of[i].is_meta:
                raise CheckpointError(
                    f"{layout.describe_leaf(i)} is a non-persistent buffer, which a state dict does not hold, and it "
                    f"is on the meta device in the template: build the template from parameters with real buffers"
                )
            continue
        if name is None:
            missing.append(f"{candidates[0]!r} ({want})")
            continue
        tensor = found[name]
        if tensor.shape != tuple(layout.full_shape(i)) or tensor.dtype != layout.dtypes[i]:
            mismatched.append(f"{name!r} is {tensor.describe()} in the checkpoint, {want} in this state")
        matched[i] = tensor
    extra = [f"{name!r} ({tensor.describe()})" for name, tensor in found.items() if name not in used] if strict else []
    if missing or mismatched or extra:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_listing(missing)}")
        if mismatched:
            parts.append(f"different: {_listing(mismatched)}")
        if extra:
            parts.append(f"in the checkpoint but not in this state: {_listing(extra)} (strict=False ignores them)")
        raise CheckpointError(
            f"{where} does not fit this state's model: " + "; ".join(parts) + ". Was it saved from another model "
            "(or another version of it)? rename= maps this state's names to the checkpoint's (no casts are made)"
        )
    return matched


# --- the optimizer --------------------------------------------------------------------------------


def _adamw_of(opt_state: Any) -> tuple[list[Any], Any, int]:
    """The optimizer state's leaves with `AdamWState` as a leaf, its structure, and where the
    one `AdamWState` is; raises if there is none, several, or other state beside it."""
    accessors, leaves, treedef = optree.tree_flatten_with_accessor(
        opt_state, is_leaf=lambda x: isinstance(x, AdamWState), none_is_leaf=False, namespace=NAMESPACE
    )
    paths = ["/".join(_entry_name(entry) for entry in accessor) for accessor in accessors]
    found = [k for k, leaf in enumerate(leaves) if isinstance(leaf, AdamWState)]
    others = [(path, leaf) for path, leaf in zip(paths, leaves) if not isinstance(leaf, AdamWState)]
    if len(found) != 1 or others:
        what = "no AdamWState" if not found else f"{len(found)} AdamWStates"
        if others:
            what += f" and other state (a {type(others[0][1]).__name__} at {others[0][0]!r})"
        raise CheckpointError(
            f"this state's optimizer state (a {type(opt_state).__name__}) is of another kind than a DCP "
            f"checkpoint's torch.optim.AdamW state: it holds {what}. load_dcp maps AdamW's exp_avg, exp_avg_sq "
            f"and step onto fs.optim.adamw's state (alone, or chained after stateless transformations such as "
            f"clip_by_global_norm); pass optim_key=None to load the model only and start the optimizer afresh"
        )
    return leaves, treedef, found[0]


def _match_optimizer(
    layout: Layout, adam: AdamWState, found: dict[str, dict[str, DcpTensor]], rename, where: str,
    elsewhere: set[str] = frozenset(),
) -> tuple[dict[tuple[str, int], DcpTensor], list[DcpTensor]]:
    """(state name, leaf) -> tensor for every trainable leaf, and the `step` tensors; raises
    naming state of another optimizer, and every missing, mismatched or extra tensor (extra:
    of a parameter neither this state nor another rank's, `elsewhere`, trains)."""
    names = [*ADAMW_STATE, *(["max_exp_avg_sq"] if adam.max_exp_avg_sq is not None else [])]
    expected = {*names, "step"}
    other = sorted({name for state in found.values() for name in state} - expected)
    if other:
        fqn = next(f for f, state in found.items() if other[0] in state)
        whose = _KNOWN_STATE.get(other[0], "not AdamW")
        amsgrad = "(amsgrad=True)" if adam.max_exp_avg_sq is not None else ""
        raise CheckpointError(
            f"{where} holds optimizer state of another kind: {other[0]!r} for {fqn!r} ({whose} state; all names: "
            f"{other}), while this state's optimizer is fs.optim.adamw{amsgrad} ({sorted(expected)}). Build the step "
            f"with the optimizer the checkpoint was trained with, or pass optim_key=None to load the model only"
        )
    if found and all(str(f).isdigit() for f in found):
        raise CheckpointError(
            f"{where} holds an optimizer state keyed by parameter index ({sorted(found, key=int)[:3]}...: "
            f"optimizer.state_dict()), which names no parameter: save it with "
            f"torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer), which keys it by name"
        )
    matched: dict[tuple[str, int], DcpTensor] = {}
    steps: list[DcpTensor] = []
    missing, mismatched, used, stateless = [], [], set(), []
    trainable = [(spec, i) for spec in layout.buffers if spec.trainable for i in spec.leaves]
    all_names = state_dict_names(layout)
    for spec, i in trainable:
        candidates = [rename(n) for n in all_names[i]] or [rename(layout.paths[i])]
        fqn = next((c for c in candidates if c in found), None)
        if fqn is None:
            stateless.append(candidates[0])
            continue
        used.add(fqn)
        state = found[fqn]
        for name in [*names, "step"]:
            tensor = state.get(name)
            if tensor is None:
                missing.append(f"'{fqn}.{name}'")
                continue
            if name == "step":  # any real dtype: its value is a count
                shape, dtype = (), tensor.dtype
            else:
                shape, dtype = tuple(layout.full_shape(i)), getattr(adam, name)[spec.name].dtype
            if tensor.shape != shape or tensor.dtype != dtype:
                want = _describe(dtype, shape)
                mismatched.append(f"'{fqn}.{name}' is {tensor.describe()} in the checkpoint, {want} in this state")
            if name == "step":
                steps.append(tensor)
            else:
                matched[name, i] = tensor
    extra = [f"{fqn!r}" for fqn in found if fqn not in used and fqn not in elsewhere]
    if stateless and len(stateless) < len(trainable):
        why = "no state at all: it never had a gradient in the FSDP2 job? fs keeps one step count for every leaf"
        missing = [f"{n!r} ({why})" for n in stateless] + missing
    if missing or mismatched or extra:
        parts = []
        if missing:
            parts.append(f"missing: {_listing(missing)}")
        if mismatched:
            parts.append(f"different: {_listing(mismatched)}")
        if extra:
            parts.append(f"state of parameters this state does not train: {_listing(extra)} (frozen here?)")
        raise CheckpointError(
            f"{where} does not fit this state's optimizer (fs.optim.adamw over its trainable leaves): "
            + "; ".join(parts)
        )
    return matched, steps


def _count(reader: DcpReader, steps: list[DcpTensor], where: str) -> int:
    """The one step count of every parameter (torch keeps one per parameter; fs one in all)."""
    values: dict[float, str] = {}
    for tensor in steps:
        values.setdefault(float(reader.read(tensor.key)), tensor.key)
    if len(values) > 1:
        shown = ", ".join(f"{key!r} = {value:g}" for value, key in list(values.items())[:3])
        raise CheckpointError(
            f"{where}: the parameters' AdamW step counts differ ({shown}); fs.optim.adamw keeps one count for every "
            f"leaf, so this state cannot continue them exactly"
        )
    value = next(iter(values), 0.0)
    if value != int(value) or value < 0:
        raise CheckpointError(f"{where}: AdamW's step count {value!r} is not a count of steps")
    return int(value)


# --- reading this rank's part ---------------------------------------------------------------------


class _Pieces:
    """Ranges of this rank's tensor-parallel pieces of the checkpoint's full tensors (whole
    leaves where no placement cuts them): read directly where the piece is a range of the tensor
    in C order (no placement, or a split of the first dimension); otherwise the tensor is read
    whole, cut by the placement and kept until another tensor is asked for (one at a time)."""

    def __init__(self, reader: DcpReader, layout: Layout, mesh: BaseMesh):
        self.reader, self.layout, self.mesh = reader, layout, mesh
        self.coordinates = mesh.coordinates
        self._cut: tuple[str, torch.Tensor] | None = None

    def read(self, key: str, leaf: int, start: int, length: int) -> torch.Tensor:
        placement = self.layout.placement(leaf)
        if placement is None:
            return self.reader.read_range(key, start, length)
        parts = self.mesh.shape[placement.axis]
        if split_order(self.layout.full_shape(leaf), placement, parts) is None:
            return self.reader.read_range(key, piece_start(self.layout, leaf, self.coordinates) + start, length)
        if self._cut is None or self._cut[0] != key:
            self._cut = None  # drop the previous tensor first
            whole = split_tensor(self.reader.read(key), placement, self.coordinates[placement.axis], parts)
            self._cut = (key, whole.reshape(-1))
        return self._cut[1][start : start + length]


def _read_shard(
    reader: _Pieces, spec: BufferSpec, shard_index: int, tensor_of: Callable[[int], DcpTensor], dtype, device
) -> torch.Tensor:
    """Shard `shard_index` of buffer `spec` (`[spec.shard_numel]`, padding zero) from the checkpoint."""
    out = torch.zeros(spec.shard_numel, dtype=dtype)
    for piece in shard_pieces(spec, shard_index):
        part = reader.read(tensor_of(piece.leaf).key, piece.leaf, piece.leaf_offset, piece.length)
        out[piece.shard_offset : piece.shard_offset + piece.length] = part
    return out.to(device)


def _device(t: torch.Tensor) -> torch.device:
    return torch.device("cpu") if t.is_meta else t.device


def _load_here(path: str, template: StepState, model_key, optim_key, rename, strict: bool, elsewhere=None) -> StepState:
    sharded = template.params
    layout, mesh = sharded.layout, sharded.mesh
    where = f"DCP checkpoint {path}"
    index = read_metadata(path)
    found = _model_tensors(index, model_key, optim_key)
    if not found:
        top = _top_level(index)
        if model_key is not None:
            suggestion = "pass model_key=None (a state dict saved as it is)"
        else:
            suggestion = "pass model_key= the key it was saved under"
        raise CheckpointError(f"{where} holds no model tensors under {model_key!r} (it holds {top}): {suggestion}")
    model_elsewhere, trained_elsewhere = elsewhere or (frozenset(), frozenset())
    matched = _match_model(layout, sharded.local, found, rename, strict, where, model_elsewhere)
    opt_state, step = template.opt_state, template.step
    adam_parts = None
    if optim_key is not None:
        leaves, treedef, k = _adamw_of(template.opt_state)
        adam = leaves[k]
        state = _optimizer_tensors(index, optim_key)
        keys = [*index.tensors, *index.objects]
        if not state and not any(_path_of(index, k)[:1] == (optim_key,) or k.startswith(optim_key + ".") for k in keys):
            raise CheckpointError(
                f"{where} holds no optimizer state under {optim_key!r} (it holds {_top_level(index)}): pass "
                f"optim_key= the key it was saved under, or optim_key=None to load the model only"
            )
        adam_parts = (leaves, treedef, k, adam, *_match_optimizer(layout, adam, state, rename, where, trained_elsewhere))
    with DcpReader(index) as reader:
        pieces = _Pieces(reader, layout, mesh)
        shards = [
            _read_shard(pieces, spec, mesh.shard_index, matched.__getitem__, spec.dtype, _device(s))
            for spec, s in zip(layout.buffers, sharded.shards)
        ]
        local = [
            reader.read(matched[i].key).to(_device(t)) if i in matched else t
            for i, t in zip(layout.local, sharded.local)
        ]
        if adam_parts is not None:
            leaves, treedef, k, adam, tensors, steps = adam_parts
            count = _count(reader, steps, where)
            moments = {}
            for name in [n for n in (*ADAMW_STATE, "max_exp_avg_sq") if getattr(adam, n) is not None]:
                if not tensors:  # the optimizer never stepped: torch has no state yet, fs has zeros
                    moments[name] = {s: torch.zeros_like(v, device=_device(v)) for s, v in getattr(adam, name).items()}
                    continue
                moments[name] = {
                    spec.name: _read_shard(
                        pieces, spec, mesh.shard_index, lambda i, name=name: tensors[name, i],
                        getattr(adam, name)[spec.name].dtype, _device(getattr(adam, name)[spec.name]),
                    )  # fmt: skip
                    for spec in layout.buffers
                    if spec.trainable
                }
            leaves = list(leaves)
            new_count = torch.tensor(count, dtype=adam.count.dtype, device=_device(adam.count))
            leaves[k] = adam._replace(count=new_count, **moments)
            opt_state, step = optree.tree_unflatten(treedef, leaves), count
    return template.replace(params=sharded.replace(shards=shards, local=local), opt_state=opt_state, step=step)
