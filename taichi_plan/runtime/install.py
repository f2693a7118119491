"""Hooking a plan runtime onto a live model: its forward pre/post hooks and the optimizer's step
hooks, FSDP's own machinery hidden from the op count, and the refusal to run an eager plan under
``torch.compile``."""

from __future__ import annotations

import weakref

from ..base.errors import PlanError


def refuse_under_compile() -> None:
    """Refuse to run an eager plan in a model compiled after :func:`apply`
    (``torch.compile(planned)``, ``planned.compile()``): dynamo runs a module's own hooks outside
    its graph but with its frame callback set, and would trace the planned calls' forwards
    without the runtime, silently unplanned or half planned."""
    import torch
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    if torch.compiler.is_compiling() or get_eval_frame_callback() not in (None, False):
        raise PlanError(
            "This model was planned by taichi_plan.apply() for eager execution and then compiled "
            "(torch.compile or model.compile() after apply()): a plan of the eager op stream does not hold for the "
            "graphs compile runs. Compile first, record the compiled model (taichi-plan record --compile BACKEND, "
            "or taichi_plan.compiled.record_compiled), solve that trace and apply its plan to the compiled model; "
            "or train the planned model without compiling it.")


def install(model, rt, optimizer=None) -> list:
    """Hook ``rt`` (a :class:`~taichi_plan.runtime.mode.PlanRuntime`) onto ``model``'s calls
    (and ``optimizer``'s steps); returns the hook handles (``.remove()`` each to undo)."""
    import sys

    running = []
    owner = weakref.ref(model)

    def pre_hook(module, args, kwargs):
        if module is not owner():  # a copy of the model (copy.deepcopy) has these hooks too: it is not planned
            running.append((False, False))
            return
        refuse_under_compile()
        planned = rt.begin_call(module, args, kwargs)
        running.append((planned, rt.counted_now))

    def post_hook(_module, _args, _kwargs, out):
        if not running:
            return
        planned, counted = running.pop()
        failed = sys.exc_info()[0] is not None  # in an exception's handler when the forward raised
        if planned:
            rt.end_call(failed=failed)
        if counted:  # (end_call raised: it said so itself)
            rt.after_call(out, failed)

    handles = [model.register_forward_pre_hook(pre_hook, with_kwargs=True),
               model.register_forward_hook(post_hook, with_kwargs=True, always_call=True)]
    if "torch.distributed.fsdp" in sys.modules:  # FSDP's own ops are not the plan's (counted_ops)
        handles.extend(hide_fsdp_internals(model, rt))
    if optimizer is not None:
        handles.append(optimizer.register_step_post_hook(lambda *_: rt.end_step()))
        if rt.state_bytes is not None:
            handles.append(optimizer.register_step_post_hook(lambda opt, *_: rt.check_state(opt)))
    return handles


def hide_fsdp_internals(model, rt) -> list:
    """While an FSDP unit's own machinery runs (its param group's unshard, wait, reshard,
    pre/post-forward), the runtime ``rt`` counts no op: the trace leaves the same ops out
    (:func:`taichi_plan.runtime.calls.counted_ops`), so that FSDP's first-step allocations or another
    prefetch order do not shift the plan's op ordinals. Returns handles to remove."""
    from ..torch_common.fsdp import fsdp_units, patch_group_methods

    if not fsdp_units(model):
        return []

    def wrap(_unit, _group, _name, orig):
        def inner(*args, **kwargs):
            rt.hidden += 1
            try:
                return orig(*args, **kwargs)
            finally:
                rt.hidden -= 1

        return inner

    return [patch_group_methods(model, wrap)]
