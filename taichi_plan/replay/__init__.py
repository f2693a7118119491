"""Apply a plan to live training (``apply``) and measure it (``replay``).

Imports torch lazily: ``import taichi_plan`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path

from ..base.errors import PlanError
from ..plan.format import Plan
from ..runtime.calls import plan_and_trace, recorded_state, runtime_for
from ..runtime.install import install


def _apply_compiled(model, plan, trace):
    """A compiled model (``torch.compile(m)`` or ``m.compile()``) under a plan of its compiled step
    (:mod:`taichi_plan.compiled.apply`)."""
    from ..compiled.apply import apply_compiled

    plan, trace = plan_and_trace(plan, trace)
    model, undo = apply_compiled(model, plan, trace)
    model._taichi_plan = Applied(runtime=None, handles=[], undo=undo, plan=plan)
    return model


def _refuse_compiled_plan(trace) -> None:
    if trace.meta.get("compiled") is not None:
        raise PlanError(
            "apply() was given an eager model and a plan of a torch.compile'd step: the plan decides what compile's "
            "partitioner saves, so it applies to the compiled model only. Compile the model as it was recorded "
            "(torch.compile(model) or model.compile()) and apply the plan to that.")


def apply(model, plan: Plan | str | Path, on_mismatch: str = "raise", optimizer=None, trace=None):
    """Run ``model``'s training forwards under ``plan``; returns the same model.

    Each call of ``model`` with grad enabled, in training mode, is matched to the next model
    call of the plan's recorded step (one per step, or one per micro-batch when the trace was
    recorded with ``--micro-batches``); calls under ``no_grad``/``inference_mode`` or in eval mode
    run untouched. In a planned call, dropped activations are not saved for backward and are
    rebuilt when backward needs them; inputs, ops and sizes are checked against the trace, and a
    mismatch raises :class:`~taichi_plan.base.errors.MismatchError` naming what differs (with
    ``on_mismatch="warn"``: warns and runs that call unplanned). Nothing stays installed after
    a call, and the next call tries the plan again. Pass ``optimizer`` so that a step boundary
    is known (a step that calls the model another number of times than the recorded loop is
    reported); a plan whose optimizer option is ``in-backward`` needs it (each parameter is
    then stepped in backward, :mod:`taichi_plan.runtime.optimizer`, and ``optimizer.step()``
    finds nothing left to do). ``trace``: the plan's trace (a directory or Trace) when it is not where the plan
    says. Call :func:`finish` after training to remove the hooks.
    """
    if on_mismatch not in ("raise", "warn"):
        raise PlanError(f"on_mismatch must be 'raise' or 'warn', not {on_mismatch!r}.")
    if getattr(model, "_taichi_plan", None) is not None:
        raise PlanError("This model already has a plan applied: call taichi_plan.finish(model) first.")
    from ..compiled.graphs import compiled_kind

    if compiled_kind(model) is not None:
        return _apply_compiled(model, plan, trace)
    from ..record.ddp import unwrap
    from ..record.workloads import torch_optimizer
    from ..runtime.optimizer import install_optimizer

    if optimizer is not None:  # accelerate's AcceleratedOptimizer, Lightning's: the torch optimizer they step
        optimizer = torch_optimizer(optimizer)
    from ..runtime.partition import install_partitions

    plan, trace = plan_and_trace(plan, trace)
    _refuse_compiled_plan(trace)
    rt = runtime_for(plan, trace, on_mismatch)
    unshard = apply_sharding(model, plan, "apply()")
    try:
        step_handles = install_optimizer(plan, optimizer)  # refuses a plan that needs the optimizer
    except BaseException:
        unshard()
        raise
    inner = unwrap(model)  # under DDP, the module it runs: the one the trace's calls and FQNs are of
    if optimizer is not None and plan.trace.get("layout") is None:  # (sharded state is per rank)
        rt.state_bytes = recorded_state(trace)
        try:
            rt.check_state(optimizer, at_apply=True)  # the state a warm-up step made: said before the plan costs memory
        except BaseException:
            unshard()
            raise
    handles = install(inner, rt, optimizer) + step_handles
    undo_parts = install_partitions(inner, plan.partitions, rt)

    def undo() -> None:
        undo_parts()
        unshard()

    model._taichi_plan = Applied(runtime=rt, handles=handles, undo=undo, plan=plan)
    return model


class Applied(dict):
    """What :func:`apply` installed on a model (``model._taichi_plan``). A copy of the model
    (``copy.deepcopy``) is not planned: its attribute is None, and the hooks it shares with the
    original leave its calls alone (:func:`install`)."""

    def __deepcopy__(self, memo):
        return None


def apply_sharding(model, plan: Plan, where: str):
    """A plan of a sharded trace holds for that FSDP layout only, a plan of a DDP trace for a
    DDP wrapper with the same world size and settings only, and a plan of one process for an
    unwrapped, unsharded model only (``trace.layout``; the model's after FSDP's lazy init, i.e.
    after its first step): refuse another. Then set each FSDP unit's ``reshard_after_forward``
    as the plan decides (``decisions.reshard_after_forward``, v5; a model already set so is
    accepted too), and its prefetching (``decisions.fsdp_prefetch``, v6). Returns a function
    that restores the settings changed."""
    import sys

    from ..record import ddp
    from ..trace.layout import check_layout

    want = plan.trace.get("layout")
    if ddp.is_ddp(model):
        check_layout(want, ddp.live_layout(model), where)
        return lambda: None
    if want is None and "torch.distributed.fsdp" not in sys.modules:
        return lambda: None  # an unsharded plan, and nothing in this process can have sharded the model
    from ..torch_common.fsdp import fsdp_units, live_layout, set_prefetch, set_reshard
    from ..trace.layout import planned_layout

    live = live_layout(model)
    if live is None or not _sharded_as(live, planned_layout(want, plan.reshard), want):
        check_layout(want, live, where)
    undo = []
    if plan.reshard:
        undo.append(set_reshard(model, {u["module"]: u["reshard_after_forward"] for u in plan.reshard["units"]}))
    prefetch = getattr(plan, "prefetch", None)
    if prefetch is not None:  # v6: FSDP2's prefetching, every unit pinned (FSDP's default where not named)
        named = {u["module"]: {"forward": u["forward_prefetch"], "backward": u["backward_prefetch"]}
                 for u in prefetch["units"]}
        undo.append(set_prefetch(model, {fqn: named.get(fqn, {"forward": [], "backward": None})
                                         for fqn, _m in fsdp_units(model)}))

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return restore


def _sharded_as(live: dict, planned: dict | None, recorded: dict | None) -> bool:
    """Whether a live layout is one a plan runs on: the plan's, each unit's bool
    ``reshard_after_forward`` being the plan's or the recorded one (apply sets the plan's), an
    int the plan's (FSDP2 takes one only in ``fully_shard``). A unit at its recorded bool where
    the plan has an int passes: :func:`~taichi_plan.torch_common.fsdp.set_reshard` then names the int
    to give ``fully_shard``, a sharper message than the whole layout's."""
    if planned is None or recorded is None:
        return live == planned
    if {k: v for k, v in live.items() if k != "units"} != {k: v for k, v in planned.items() if k != "units"}:
        return False
    if [m for m, _ in live["units"]] != [m for m, _ in planned["units"]] or len(recorded["units"]) != len(live["units"]):
        return False
    for (_m, got), (_p, want), (_r, was) in zip(live["units"], planned["units"], recorded["units"]):
        same = got == want and isinstance(got, bool) == isinstance(want, bool)
        if not same and not (isinstance(got, bool) and isinstance(was, bool) and got == was):
            return False
    return True


def finish(model) -> None:
    """Remove everything :func:`apply` installed (planned calls already run keep working:
    their backward still rebuilds what they dropped)."""
    info = getattr(model, "_taichi_plan", None)
    if info is None:
        return
    for h in info["handles"]:
        h.remove()
    info["undo"]()
    del model._taichi_plan


__all__ = ["apply", "call_plans", "calls_before_step", "finish", "install", "model_calls", "plan_and_trace", "recipe_ops", "runtime_for"]
