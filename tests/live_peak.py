"""An independent live-storage counter for the tests that train with a plan: it shares no
code with the recorder or the simulator, so a peak it measures within the plan's budget is
evidence, not a restatement."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LivePeak(TorchDispatchMode):
    """Peak bytes of the storages alive while it is active: those of ``tensors`` given up front
    and every storage an op creates, until it is freed."""

    def __init__(self, tensors):
        super().__init__()
        self.live: dict[int, int] = {}
        self.keep = []
        for t in tensors:
            self._add(t.untyped_storage())
        self.peak = sum(self.live.values())

    def _add(self, st):
        key = st._cdata
        if key not in self.live and st.nbytes():
            self.live[key] = st.nbytes()
            self.keep.append(weakref.ref(st, lambda _r, key=key: self.live.pop(key, None)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_leaves(out):
            if isinstance(x, torch.Tensor):
                self._add(x.untyped_storage())
        self.peak = max(self.peak, sum(self.live.values()))
        return out


def step_peak(model, optimizer, x, loss_fn) -> int:
    """One training step of ``model`` on the tensor batch ``x`` (zero_grad, ``loss_fn(model(x),
    x)``, backward, ``optimizer.step()``), measured by :class:`LivePeak` from the parameters,
    the batch and the optimizer's state; returns its peak bytes."""
    optimizer.zero_grad()
    held = [*model.parameters(), x, *(v for st in optimizer.state.values() for v in st.values())]
    with LivePeak(held) as tracker:
        loss_fn(model(x), x).backward()
        optimizer.step()
    return tracker.peak


def end_run(model, planned: bool):
    """(the parameters' values, the plan's runtime or None) at the end of a training run; a
    planned model's plan is finished (``taichi_plan.finish``)."""
    import taichi_plan

    rt = model._taichi_plan["runtime"] if planned else None
    params = [p.detach().clone() for p in model.parameters()]
    if planned:
        taichi_plan.finish(model)
    return params, rt


def train_entry(entry: str, plan=None, trace=None, steps: int = 3):
    """(parameters, each step's peak, runtime or None) of ``steps`` steps of the ``--entry``
    workload ``entry`` on its own tensor batch, planned by ``plan`` (its ``trace``) or not."""
    import taichi_plan
    from taichi_plan.record import get_workload

    model, x, loss_fn, opt = get_workload(entry=entry).build(False)
    if plan is not None:
        model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    peaks = [step_peak(model, opt, x, loss_fn) for _ in range(steps)]
    params, rt = end_run(model, plan is not None)
    return params, peaks, rt
