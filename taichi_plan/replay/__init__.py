"""Apply a plan to live training (``apply``) and measure it (``replay``).

Imports torch lazily: ``import taichi_plan`` stays cheap.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import PlanError
from ..plan import Plan, load_plan


def replay_tables(plan: Plan, trace) -> tuple[dict[int, list[tuple[int, int]]], list[tuple[str, str, dict]]]:
    """(counted forward op -> [(flattened output index, tensor id)], counted forward ops as
    (op name, module, {output index: bytes of the storage it creates}))."""
    from .runtime import IGNORED_OPS

    ops = trace.ops
    forward = ops[ops["phase"] == "forward"]
    n_fwd = len(forward)
    if n_fwd and int(forward["op_id"].iloc[-1]) != n_fwd - 1:
        raise PlanError("The plan's trace interleaves forward and other ops; replay needs the forward first.")
    counted = forward[~forward["op"].isin(IGNORED_OPS)]
    index = {int(o): k for k, o in enumerate(counted["op_id"].tolist())}
    acc = trace.accesses
    writes = acc[acc["role"] == "write"]
    pos = {(int(o), int(t)): int(a) for o, t, a in zip(writes["op_id"], writes["tensor_id"], writes["arg_index"],
                                                          strict=True)}
    drops: dict[int, list[tuple[int, int]]] = {}
    for r in plan.recompute:
        if r.op >= n_fwd:
            raise PlanError(f"The plan drops tensor {r.tensor}, made by op {r.op} outside the forward; "
                            "replay only rebuilds forward tensors. Solve again with this version.")
        j = pos.get((r.op, r.tensor))
        if j is None:
            raise PlanError(f"The plan drops tensor {r.tensor} as an output of op {r.op}, but the trace has no "
                            "such output: the plan was made for another trace.")
        if r.op not in index:
            raise PlanError(f"The plan drops tensor {r.tensor}, made by {r.op_name}, an op replay does not count.")
        drops.setdefault(index[r.op], []).append((j, r.tensor))
    nbytes = dict(zip(trace.tensors["tensor_id"].tolist(), trace.tensors["nbytes"].tolist(), strict=True))
    producer = dict(zip(trace.tensors["tensor_id"].tolist(), trace.tensors["producer_op"].tolist(), strict=True))
    made: dict[int, dict[int, int]] = {}
    for (o, t), j in pos.items():
        if producer.get(t) == o:
            made.setdefault(o, {})[j] = int(nbytes[t])
    names = [(name, module, made.get(int(o), {})) for name, module, o in
             zip(counted["op"].tolist(), counted["module"].tolist(), counted["op_id"].tolist(), strict=True)]
    return drops, names


def recipe_ops(plan: Plan, trace) -> set[int]:
    """Counted forward ops whose recipes a rebuild may need: every op the simulator re-runs
    for this plan, and the rebuild ops of every dropped tensor."""
    from ..problem import build_problem
    from ..simulate import rerun_ops
    from ..solve.result import drops_from_plan
    from .runtime import IGNORED_OPS

    problem = build_problem(trace)
    needed = rerun_ops(problem, drops_from_plan(problem, plan))
    names = trace.ops["op"].tolist()
    counted, k = {}, 0
    for i, name in enumerate(names):
        if name not in IGNORED_OPS:
            counted[i] = k
            k += 1
    return {counted[i] for i in needed if i in counted}


def runtime_for(plan: Plan, trace, on_mismatch: str = "raise"):
    """The :class:`~taichi_plan.replay.runtime.PlanRuntime` that executes ``plan``."""
    from .runtime import PlanRuntime

    drops, names = replay_tables(plan, trace)
    return PlanRuntime(drops, names, on_mismatch, partition_spans(plan, trace), recipe_ops(plan, trace))


def partition_spans(plan: Plan, trace) -> dict[str, tuple[int, int]]:
    """Forward op span of each partitioned module in the trace."""
    if not plan.partitions:
        return {}
    from ..partition import module_spans
    from ..problem import build_problem
    from .runtime import IGNORED_OPS

    spans = {s.module: s.fwd for s in module_spans(build_problem(trace))}
    missing = [p.module for p in plan.partitions if p.module not in spans]
    if missing:
        raise PlanError(f"The plan partitions {missing[0]!r}, which its trace cannot partition: the plan "
                        "was made for another trace.")
    # In counted ops (IGNORED_OPS left out), as the runtime counts them.
    names = trace.ops["op"].tolist()
    counted_before = []
    k = 0
    for name in names:
        counted_before.append(k)
        k += name not in IGNORED_OPS
    out = {}
    for p in plan.partitions:
        f0, f1 = spans[p.module]
        out[p.module] = (counted_before[f0], counted_before[f1] + (names[f1] not in IGNORED_OPS) - 1)
    return out


def plan_and_trace(plan: Plan | str | Path):
    """Load a plan (path or Plan) and the trace it was solved for, checking they match."""
    from ..report.plan_text import locate_trace

    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = Path(plan)
        plan = load_plan(plan_path)
    trace, state = locate_trace(plan, plan_path)
    if trace is None:
        where = plan.trace.get("path")
        raise PlanError(
            f"Replay needs the trace the plan was solved for, but it is {state} (at {where!r}). Keep the "
            "trace directory beside the plan, or record and solve again."
        )
    return plan, trace


def apply(model, plan: Plan | str | Path, on_mismatch: str = "raise"):
    """Run ``model``'s training steps under ``plan``; returns the same model.

    A step starts when ``model`` is called and lasts until its next call (so the loss,
    backward and optimizer step in between belong to it). Dropped activations are not saved
    for backward and are rebuilt when backward needs them; the live op sequence is checked
    against the plan's trace, and a mismatch raises :class:`~taichi_plan.errors.MismatchError`
    naming the first differing op, or with ``on_mismatch="warn"`` warns once and runs unplanned.
    Call :func:`finish` after the last step to remove the hooks.
    """
    if on_mismatch not in ("raise", "warn"):
        raise PlanError(f"on_mismatch must be 'raise' or 'warn', not {on_mismatch!r}.")
    from .partition import install_partitions
    plan, trace = plan_and_trace(plan)
    rt = runtime_for(plan, trace, on_mismatch)
    state = {"ctx": None}

    def end_step():
        if state["ctx"] is not None:
            hooks, mode = state["ctx"]
            state["ctx"] = None
            hooks.__exit__(None, None, None)
            mode.__exit__(None, None, None)
            rt.end_step()

    def pre_hook(_module, _args):
        end_step()
        if not rt.enabled:
            return
        rt.begin_step()
        mode = rt
        mode.__enter__()
        hooks = rt.hooks()
        hooks.__enter__()
        state["ctx"] = (hooks, mode)

    handle = model.register_forward_pre_hook(pre_hook)
    undo = install_partitions(model, plan.partitions, rt)
    model._taichi_plan = {"runtime": rt, "end_step": end_step, "handle": handle, "undo": undo, "plan": plan}
    return model


def finish(model) -> None:
    """End the current planned step and remove everything :func:`apply` installed."""
    info = getattr(model, "_taichi_plan", None)
    if info is None:
        return
    info["end_step"]()
    info["handle"].remove()
    info["undo"]()
    del model._taichi_plan


__all__ = ["apply", "finish", "plan_and_trace", "recipe_ops", "replay_tables", "runtime_for"]
