"""Run a plan's optimizer option (``decisions.optimizer``) in live training.

``in-backward``: a ``register_post_accumulate_grad_hook`` on every parameter the optimizer
updates steps that parameter alone as soon as its gradient is complete, then sets its
``.grad`` to None, so the full set of gradients never exists (what the simulator models,
:mod:`taichi_plan.problem.optimizer.plan`). The update is the user's own optimizer's: its step
function runs with the optimizer's parameter groups narrowed to that one parameter (the
group's hyperparameters, its current learning rate included, and the parameter's state are
the optimizer's own), without the optimizer's step hooks. The user's ``optimizer.step()``
after backward then finds no gradient and updates nothing (PyTorch's optimizers skip a
parameter whose ``.grad`` is None), so nothing is stepped twice, and ``zero_grad()`` has
nothing left to free. A parameter whose gradient completes twice before ``optimizer.step()``
(gradient accumulation the plan was not made for) raises :class:`MismatchError` instead of
being updated twice, and so does a loop that needs every gradient before any update
(:class:`_LoopGuard`): a ``GradScaler`` (unscale, skip a step with inf/NaN gradients) or
gradient clipping the trace's loop did not record. Per-parameter, ``foreach`` and hook-driven AdamW updates are bitwise
equal on CPU, so parameters after N steps equal the unplanned run's.

``groups``: a step pre-hook runs the optimizer's step function once per group of parameters
(the plan's groups: indices into the parameters that have a gradient, in the optimizer's
order, as its ``foreach`` ops list them), each time with the parameter groups narrowed to that
group; the step the user called then runs with no parameter left, and a post-hook puts the
parameter groups back. Hooks and learning-rate schedulers see one step, as before.
"""

from __future__ import annotations

import torch

from ..base.errors import MismatchError, PlanError
from ..problem.optimizer.plan import plan_mode


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
    if mode == "groups":
        return step_in_groups(optimizer, plan.optimizer["groups"])
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
    stepped: set[int] = set()  # parameters updated since the last optimizer.step()

    def make_hook(group: dict):
        def hook(p) -> None:
            if p.grad is None:
                return
            if id(p) in stepped:
                # Stepped already, so its gradient was freed: what it holds is this refused backward's
                # alone. Left behind, the next backward would add to it and step with both.
                p.grad = None
                raise MismatchError(
                    "A second backward ran before optimizer.step() (gradient accumulation, or another loss), but "
                    "this plan steps the optimizer in backward: each parameter is updated as soon as its gradient "
                    "is complete, which is right only when one backward makes the whole gradient. Solve the trace of "
                    "this loop (record it with --micro-batches), or with --optimizer as-recorded.")
            stepped.add(id(p))
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

    handles.append(optimizer.register_step_post_hook(lambda *_: stepped.clear()))
    for group in optimizer.param_groups:
        hook = make_hook(group)
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                handles.append(p.register_post_accumulate_grad_hook(hook))
    handles.append(_LoopGuard.install(seen))
    return handles


_IN_BACKWARD = ("this plan steps the optimizer in backward (decisions.optimizer: in-backward): each parameter is "
                "updated, and its gradient freed, as soon as the gradient is complete")


class _LoopGuard:
    """While a plan steps an optimizer in backward, what a loop does with the whole gradient
    between backward and ``optimizer.step()`` cannot happen: ``GradScaler.scale`` (its
    ``step`` must unscale every gradient and skip the update when one is inf or NaN) raises
    before the backward, and ``clip_grad_norm_`` / ``clip_grad_value_`` of a parameter already
    updated raise instead of clipping nothing. Both would otherwise train otherwise, silently
    (scaled gradients applied; no clipping). One patch of each, installed with the first
    optimizer and removed with the last (``remove()``)."""

    params: dict[int, int] = {}  # id of a parameter stepped in backward -> its installs
    saved: dict | None = None

    def __init__(self, ids: set[int]):
        self.ids = set(ids)

    @classmethod
    def install(cls, ids: set[int]) -> _LoopGuard:
        for i in ids:
            cls.params[i] = cls.params.get(i, 0) + 1
        if cls.saved is None:
            utils = torch.nn.utils
            cls.saved = {"scale": torch.amp.GradScaler.scale, "norm": utils.clip_grad.clip_grad_norm_,
                         "value": utils.clip_grad.clip_grad_value_}
            torch.amp.GradScaler.scale = cls._scale
            utils.clip_grad_norm_ = utils.clip_grad.clip_grad_norm_ = cls._clipper("norm", "clip_grad_norm_")
            utils.clip_grad_value_ = utils.clip_grad.clip_grad_value_ = cls._clipper("value", "clip_grad_value_")
        return cls(ids)

    def remove(self) -> None:
        cls = type(self)
        for i in self.ids:
            n = cls.params.get(i, 0) - 1
            if n > 0:
                cls.params[i] = n
            else:
                cls.params.pop(i, None)
        self.ids = set()
        if not cls.params and cls.saved is not None:
            utils = torch.nn.utils
            torch.amp.GradScaler.scale = cls.saved["scale"]
            utils.clip_grad_norm_ = utils.clip_grad.clip_grad_norm_ = cls.saved["norm"]
            utils.clip_grad_value_ = utils.clip_grad.clip_grad_value_ = cls.saved["value"]
            cls.saved = None

    @staticmethod
    def _scale(scaler, outputs):
        if scaler.is_enabled():
            raise MismatchError(
                f"The loop scales its loss with a GradScaler, but {_IN_BACKWARD}: the scaler could neither unscale the "
                "gradients nor skip a step with inf or NaN gradients, and the scaled gradients would be applied. "
                "Solve again with --optimizer groups or as-recorded (both step after backward), or train in bf16 "
                "without a scaler.")
        return _LoopGuard.saved["scale"](scaler, outputs)

    @staticmethod
    def _clipper(key: str, name: str):
        def clip(parameters, *args, **kwargs):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if any(id(p) in _LoopGuard.params for p in params):
                raise MismatchError(
                    f"The loop calls {name} after backward, but {_IN_BACKWARD}: those parameters were updated "
                    "unclipped and have no gradient left to clip. Record the loop with its clipping (--clip-grad-norm, "
                    "or Loop(clip_grad_norm=...)), whose plans step the optimizer after it, or solve again with "
                    "--optimizer groups or as-recorded.")
            return _LoopGuard.saved[key](params, *args, **kwargs)

        clip.__name__ = name
        return clip


def step_in_groups(optimizer, groups: list[list[int]]) -> list:
    """Make ``optimizer.step()`` update its parameters group by group (see the module doc)."""
    raw = _raw_step(optimizer)
    saved: list = []

    def pre(opt, _args, _kwargs):
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        want = sum(len(g) for g in groups)
        if len(params) != want:
            raise PlanError(
                f"The plan steps the optimizer in groups of the {want} parameters that had a gradient when the trace "
                f"was recorded, but {len(params)} have one now: the model or its frozen parameters changed. Record "
                "and solve again.")
        all_groups = opt.param_groups
        originals = [(g, g["params"]) for g in all_groups]
        try:
            for members in groups:
                chosen = {id(params[i]) for i in members}
                narrowed = []
                for g, ps in originals:
                    g["params"] = [p for p in ps if id(p) in chosen]
                    if g["params"]:
                        narrowed.append(g)
                opt.param_groups = narrowed
                raw(opt)
        except BaseException:
            _restore(opt, all_groups, originals)
            raise
        for g, _ps in originals:
            g["params"] = []  # the step the user called finds nothing left to update
        opt.param_groups = all_groups
        saved.append((all_groups, originals))

    def post(opt, _args, _kwargs):
        if saved:
            _restore(opt, *saved.pop())

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def _restore(opt, all_groups, originals) -> None:
    for g, ps in originals:
        g["params"] = ps
    opt.param_groups = all_groups

