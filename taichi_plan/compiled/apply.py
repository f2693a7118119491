"""Apply a plan of a compiled step to the compiled model.

The plan's drops (``decisions.recompute``: tensor ids of its trace) become, per joint graph,
the forward nodes whose outputs are those tensors (``meta.compiled.nodes``); the model is
compiled again with the trace's backend and a partitioner that saves the recorded values less
those (:func:`.graphs.planned_choice`). A graph whose signature the trace does not hold (another
model, shape, dtype or torch version) stops compile with a :class:`PlanError`: never an
unplanned compiled run. The model object is the user's own, re-pointed in place; :func:`restore`
(``taichi_plan.finish``) points it back.
"""

from __future__ import annotations

from ..base.errors import PlanError
from .graphs import (
    choice_digest,
    compiled_kind,
    eager_module,
    graph_signature,
    make_backend,
    partition,
    planned_choice,
)


def dropped_nodes(plan, trace) -> dict[int, set[str]]:
    """Per graph index, the names of the forward nodes whose outputs the plan drops."""
    compiled = trace.meta["compiled"]
    drops = {int(r.tensor) for r in plan.recompute}
    out: dict[int, set[str]] = {g: set() for g in range(len(compiled["graphs"]))}
    found = set()
    for graph, name, _start, _end, tids in compiled["nodes"]:
        hit = drops.intersection(tids)
        if hit:
            out[int(graph)].add(name)
            found |= hit
    lost = sorted(drops - found)
    if lost:
        raise PlanError(f"The plan drops tensor(s) {lost[:5]} that no compiled graph's forward made: it was not solved "
                        "for this compiled trace. Solve again for the trace recorded from the compiled model.")
    return out


def check_plan(plan, trace, where: str = "apply()") -> None:
    """Refuse a plan whose trace is not of a compiled step, or which uses a decision a compiled
    step cannot take yet (partitions, optimizer options)."""
    if trace.meta.get("compiled") is None:
        raise PlanError(f"{where} was given a torch.compile'd model and a plan of an eager step: under compile the "
                        "model runs other ops than the eager trace holds. Record the compiled model "
                        "(taichi-plan record --compile BACKEND, or taichi_plan.compiled.record_compiled) and solve "
                        "that trace, or apply this plan to the eager model.")
    if plan.partitions:
        raise PlanError(f"{where}: the plan partitions {plan.partitions[0].module}, which taichi-plan cannot run under "
                        "torch.compile yet; solve the compiled trace again (solve leaves partitions out of compiled "
                        "traces).")
    if plan.offloads:
        raise PlanError(f"{where}: the plan offloads {len(plan.offloads)} tensors to host memory, and a compiled step "
                        "runs no runtime beside it to copy them; solve the compiled trace again without --offload.")
    if plan.optimizer is not None:
        raise PlanError(f"{where}: the plan changes how the optimizer steps ({plan.optimizer.get('mode')}), which "
                        "taichi-plan does not run with a compiled model yet; solve again without optimizer options.")


def planned_backend(plan, trace):
    """The trace's backend with the plan's partitioner, and the number of graphs it knows."""
    compiled = trace.meta["compiled"]
    dropped = dropped_nodes(plan, trace)
    choices = {g["signature"]: planned_choice(g["saved"], dropped[i]) for i, g in enumerate(compiled["graphs"])}
    known = sorted(choices)

    def choose(joint_graph, node_info):
        sig = graph_signature(joint_graph)
        choice = choices.get(sig)
        if choice is None:
            raise PlanError(
                f"torch.compile made a graph (signature {sig}) that the plan's trace does not hold (it holds "
                f"{', '.join(known)}): the model, its input shapes or dtypes, its train/eval mode, or the torch "
                "version differ from the recording. Record the compiled step again as you train it, and solve again.")
        return choice(joint_graph, node_info)

    def partition_fn(joint_module, joint_inputs, **kwargs):
        return partition(joint_module, joint_inputs, choose=choose, **kwargs)

    key = f"taichi-plan {choice_digest()}:" + ",".join(f"{s}:{sorted(dropped[i])}" for i, s in enumerate(g["signature"] for g in compiled["graphs"]))
    return make_backend(compiled["backend"], partition_fn, key)


def _unwrap_plan_error(fn):
    """``fn`` raising the :class:`PlanError` of our partitioner itself, not dynamo's wrapper of it."""
    import functools

    from torch._dynamo.exc import BackendCompilerFailed

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None) or e.__cause__
            if isinstance(inner, PlanError):
                raise inner from None
            raise

    return call


def apply_compiled(model, plan, trace):
    """Point the compiled ``model`` at a compile of its module under ``plan``; returns ``model``
    and a function that undoes it. Dynamo's caches are reset (``torch._dynamo.reset()``, as on
    the way back): the module's cached graphs were partitioned without the plan, and dynamo keys
    them by code object, not by backend; other compiled functions of the process recompile on
    their next call (time, not behaviour)."""
    import torch

    check_plan(plan, trace)
    backend = planned_backend(plan, trace)
    kind = compiled_kind(model)
    torch._dynamo.reset()  # the module's cached graphs were partitioned without the plan
    if kind == "module":
        before = model.dynamo_ctx
        model.dynamo_ctx = torch.compile(eager_module(model), backend=backend).dynamo_ctx
        model._initialize()
        model.forward = _unwrap_plan_error(model.forward)

        def restore():
            model.dynamo_ctx = before
            model._initialize()
            torch._dynamo.reset()
    else:
        before_impl = model._compiled_call_impl
        model._compiled_call_impl = _unwrap_plan_error(torch.compile(model._call_impl, backend=backend))

        def restore():
            model._compiled_call_impl = before_impl
            torch._dynamo.reset()
    return model, restore
