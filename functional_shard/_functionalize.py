"""`nn.Module` -> `(apply_fn, params)`: a pure function of a parameter pytree."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.func import functional_call

from . import _tracing
from ._tree import ModuleParams

__all__ = ["functionalize"]


def functionalize(module: nn.Module) -> tuple[Callable[..., Any], ModuleParams]:
    """Turn a module into a pure function and the pytree of its parameters and buffers.

    Arguments:
        module: any `nn.Module`. It is not changed, and its own tensors are not used by
            `apply_fn` (only its code and configuration are).

    Returns `(apply_fn, params)`:
        params: a `ModuleParams` holding copies of the module's tensors: trainable parameters
            (tied ones once, under their first name), frozen parameters (`requires_grad=False`)
            and buffers, each by its state-dict name; it also names the parameters of BatchNorm
            modules (`nn.modules.batchnorm._BatchNorm`), which `fs.Precision` keeps in their own
            dtype by default.
        apply_fn(params, *args, **kwargs): `module(*args, **kwargs)` computed with the tensors
            in `params` (`torch.func.functional_call`). Buffers that the module updates in place
            (BatchNorm running statistics) are updated in `params`' buffers: give it copies if you
            need the old ones.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize expects an nn.Module; got {type(module).__name__}")
    trainable, frozen, buffers = {}, {}, {}
    first_name: dict[int, str] = {}
    aliases, order = [], []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            aliases.append((name, first_name[id(p)]))
            continue
        first_name[id(p)] = name
        order.append(name)
        (trainable if p.requires_grad else frozen)[name] = p.detach().clone()
    non_persistent = []
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for local_name, b in sub._buffers.items():
            if b is None:
                continue
            name = f"{module_name}.{local_name}" if module_name else local_name
            if local_name in sub._non_persistent_buffers_set:
                non_persistent.append(name)
            if id(b) in first_name:
                if first_name[id(b)] != name:
                    aliases.append((name, first_name[id(b)]))
                continue
            first_name[id(b)] = name
            buffers[name] = b.detach().clone()
    # Parameters of BatchNorm modules: mixed precision keeps them in their own dtype by default.
    batch_norm = [
        first_name[id(p)]
        for sub in module.modules()
        if isinstance(sub, nn.modules.batchnorm._BatchNorm)
        for p in sub._parameters.values()
        if p is not None
    ]
    params = ModuleParams(
        trainable,
        frozen,
        buffers,
        aliases=tuple(dict.fromkeys(aliases)),
        non_persistent=tuple(dict.fromkeys(non_persistent)),
        batch_norm=tuple(dict.fromkeys(batch_norm)),
        order=tuple(order) if frozen else (),  # without frozen parameters the flatten order is the module's
    )

    def modes() -> tuple[bool, ...]:
        return tuple(m.training for m in module.modules())

    def apply_fn(params: ModuleParams, *args, **kwargs):
        # A traced step is specialised on the module's train/eval modes: model.eval() retraces.
        _tracing.guard(f"the train/eval mode of {type(module).__name__} (model.train() / model.eval())", modes)
        # tie_weights=True: a tensor given under one of several tied names is used for all.
        return functional_call(module, dict(params.items()), args, kwargs, tie_weights=True, strict=False)

    apply_fn.__name__ = f"apply_{type(module).__name__}"
    apply_fn.__doc__ = f"Pure `{type(module).__name__}.forward` over a `ModuleParams` (see fs.functionalize)."
    return apply_fn, params
