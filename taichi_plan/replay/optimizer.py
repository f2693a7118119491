"""Run a plan's optimizer option (``decisions.optimizer``) in live training.

``in-backward``: a ``register_post_accumulate_grad_hook`` on every parameter the optimizer
updates steps that parameter alone as soon as its gradient is complete, then sets its
``.grad`` to None, so the full set of gradients never exists (what the simulator models,
:mod:`taichi_plan.optimizer_plan`). The update is the user's own optimizer's: its step
function runs with the optimizer's parameter groups narrowed to that one parameter (the
group's hyperparameters, its current learning rate included, and the parameter's state are
the optimizer's own), without the optimizer's step hooks. The user's ``optimizer.step()``
after backward then finds no gradient and updates nothing (PyTorch's optimizers skip a
parameter whose ``.grad`` is None), so nothing is stepped twice, and ``zero_grad()`` has
nothing left to free. Per-parameter, ``foreach`` and hook-driven AdamW updates are bitwise
equal on CPU, so parameters after N steps equal the unplanned run's.
"""

from __future__ import annotations

from ..errors import PlanError
from ..optimizer_plan import plan_mode


def install_optimizer(plan, optimizer) -> list:
    """Install what ``plan``'s optimizer option needs on ``optimizer``; returns handles
    (``.remove()`` each to undo). Nothing for a plan that keeps the recorded step."""
    mode = plan_mode(plan)
    if mode == "as-recorded":
        return []
    if optimizer is None:
        raise PlanError(
            f"This plan steps the optimizer {mode} (decisions.optimizer), so apply() needs the optimizer: call "
            "taichi_plan.apply(model, plan, optimizer=optimizer). Or solve again with --optimizer as-recorded.")
    if mode == "in-backward":
        return step_in_backward(optimizer)
    raise PlanError(f"This plan steps the optimizer {mode!r}, which this taichi-plan cannot run; solve again.")


def _raw_step(optimizer):
    """The optimizer's own step function, without the step hooks and profiling that
    ``Optimizer`` wraps around it (they belong to the user's ``optimizer.step()``)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step) if getattr(step, "hooked", False) else step


def step_in_backward(optimizer) -> list:
    """Hook every parameter of ``optimizer`` that requires grad: when its gradient is
    complete, step it alone and free the gradient."""
    raw = _raw_step(optimizer)
    handles = []
    seen: set[int] = set()

    def make_hook(group: dict):
        def hook(p) -> None:
            if p.grad is None:
                return
            groups, params = optimizer.param_groups, group["params"]
            group["params"] = [p]
            optimizer.param_groups = [group]
            try:
                raw(optimizer)
            finally:
                optimizer.param_groups = groups
                group["params"] = params
            p.grad = None

        return hook

    for group in optimizer.param_groups:
        hook = make_hook(group)
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                handles.append(p.register_post_accumulate_grad_hook(hook))
    return handles
