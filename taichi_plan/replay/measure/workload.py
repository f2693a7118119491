"""The workload a replay runs, built as the trace recorded it: rebuilt from the trace's
workload (:func:`workload_of`), on the device the trace was recorded on where one is here
(:func:`replay_device`, :func:`move_workload`), from a seed (:func:`seed_everything`)."""

from __future__ import annotations

from ...base.errors import PlanError


def workload_of(trace):
    from ...record import get_workload

    if trace.meta.get("compiled") is not None:
        raise PlanError(
            "This plan is of a torch.compile'd step, and replay does not compile the workload it rebuilds yet: "
            "run the plan in your loop, taichi_plan.apply(torch.compile(model), plan), and measure its peak "
            "with taichi_plan.compiled.compiled_peak (README, \"Compiled training\").")
    wl = trace.meta.get("workload") or {}
    kind, name, args = wl.get("kind"), wl.get("name"), dict(wl.get("args") or {})
    if trace.meta.get("mode") == "imported" or kind not in ("builtin", "entry"):
        raise PlanError(
            f"Replay rebuilds the workload the trace was recorded from, but this trace is "
            f"{trace.meta.get('mode') or kind or 'unknown'}: only traces recorded from a built-in model or "
            "an --entry can be replayed (imported graphs and record() of live objects cannot)."
        )
    return get_workload(model=name, **args) if kind == "builtin" else get_workload(entry=name, **args)


def replay_device(trace, cuda_available: bool | None = None) -> str:
    """``cuda`` when a GPU is here and the trace was recorded on one (``meta.device``; traces
    from before it was recorded: a CUDA build of torch), else ``cpu``."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    recorded = trace.meta.get("device") or ("cuda" if trace.meta.get("torch_build") == "cuda" else "cpu")
    return "cuda" if cuda_available and recorded == "cuda" else "cpu"


def move_workload(model, batch, loss_fn, optimizer, device: str):
    """The workload's parts on ``device``: every parameter and buffer of the model (replaced by
    a copy on ``device``, tied ones staying tied), the optimizer's parameter groups pointed at
    the moved parameters, every tensor of the batch, and the tensors a loss function lists in
    ``inputs`` (the built-in workloads' targets). The optimizer must not have state yet. Parts
    already on ``device`` are left as they are. (Not ``Module.to``: it swaps tensors it cannot
    change in place, which fails for fake tensors the optimizer still refers to.)"""
    import torch
    from torch.utils._pytree import tree_map

    from ...base.errors import WorkloadError

    if any(optimizer.state.values()):
        raise WorkloadError("move_workload: the optimizer already has state; move the workload before its first step.")
    target = torch.device(device)

    def there(t) -> bool:
        return t.device.type == target.type and (target.index is None or t.device.index == target.index)

    def move(t):
        return t if there(t) else t.to(target)

    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or there(p):
                continue
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(p.detach().to(target), requires_grad=p.requires_grad)
            module._parameters[name] = moved[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = move(b)
    for group in optimizer.param_groups:
        group["params"] = [moved.get(id(p), p) for p in group["params"]]
    batch = tree_map(lambda x: move(x) if isinstance(x, torch.Tensor) else x, batch)
    inputs = getattr(loss_fn, "inputs", None)
    if isinstance(inputs, tuple):
        loss_fn.inputs = tuple(move(x) if isinstance(x, torch.Tensor) else x for x in inputs)
    stray = [p for g in optimizer.param_groups for p in g["params"] if not there(p)]
    if stray:
        raise WorkloadError(f"move_workload: {len(stray)} of the optimizer's parameters stayed on {stray[0].device} "
                            f"when the model moved to {device}; its parameters must be the model's.")
    return model, batch, loss_fn, optimizer


def seed_everything(seed: int) -> None:
    """Seed torch, Python's ``random`` and NumPy's global generator: a step that draws from
    NumPy (wav2vec2's SpecAugment masks) or ``random`` then draws the same in the planned and
    the unplanned run, which replay compares."""
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
