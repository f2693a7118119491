"""Calling a model and reading an optimizer's state the one way record, the runtime and replay all do."""

from __future__ import annotations

import torch

_Tensor = torch.Tensor


def call_model(model, batch):
    """``model(batch)``, ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch)


def optimizer_state(optimizer) -> list:
    """Every tensor in ``optimizer``'s state (what a trace counts as ``optimizer_state``)."""
    return [v for state in optimizer.state.values() for v in tensors_in(list(state.values()))]


def input_signature(args, kwargs) -> list[list]:
    """The tensor inputs of a model call: ``[name, shape, dtype]`` for each tensor of rank >= 1,
    named by position (``args[0]``) or keyword (``input_ids``), nested items by index."""
    out = []

    def walk(name, x):
        if isinstance(x, _Tensor):
            if x.dim() >= 1:
                out.append([name, list(x.shape), str(x.dtype).replace("torch.", "")])
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(f"{name}[{i}]", y)
        elif isinstance(x, dict):
            for k, y in x.items():
                walk(f"{name}[{k!r}]", y)

    for i, a in enumerate(args):
        walk(f"args[{i}]", a)
    for k, v in kwargs.items():
        walk(k, v)
    return out


def autocast_of(model) -> str | None:
    """The autocast a call of ``model`` runs under (trace v13 ``meta.model_calls[].autocast``):
    ``"bf16"``/``"fp16"`` (or the dtype's name), None without. Read on its parameters' device."""
    from .loop import AUTOCAST_DTYPES

    device = next((p.device.type for p in model.parameters()), "cpu")
    if not torch.is_autocast_enabled(device):
        return None
    name = str(torch.get_autocast_dtype(device)).split(".")[-1]
    return next((k for k, v in AUTOCAST_DTYPES.items() if v == name), name)


def tensors_in(obj) -> list:
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]
