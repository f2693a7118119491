"""What the replay runtime itself costs a plan, predicted from the trace (no torch).

The recorder measures the runtime's per-op bookkeeping on the recording machine
(``meta.runtime_overhead``, see ``taichi_plan.runtime.mode.calibrate_overhead``). In a model
call where the plan drops a tensor, the runtime's dispatch mode runs in the call's planned
regions (:mod:`taichi_plan.problem.partition.regions`: the module calls holding the ops that make, read or
rebuild what it drops; the whole call where one of those is the model's own top-level code):
each op there pays ``check_op_s``, and each op whose recipe a rebuild may need pays
``recipe_op_s`` instead; each module call of such a model call pays ``module_call_s`` (the
runtime's module hooks), and each region entered ``region_s`` (its mode and hooks on and off,
the region's checks): :func:`runtime_overhead_s`, added to the plan's extra compute in its
predicted extra time. Every other op, calls that only partition (their modules' wrappers and
lazy logits do that), and everything outside the model pay nothing.

The terms that grow with each rebuild are in the simulator's extra compute instead, so the
planners weigh them and the proven bound covers them: an op re-run in a rebuild costs its
recorded time times ``rebuild_time_ratio`` of its op name (trace v5), plus ``rebuild_op_s``
(``Problem.rerun_cost``), and each dropped tensor ``drop_s`` (trace v6: what a drop costs
beyond that, measured on a plan of the model's own; ``Problem.drop_cost``).
"""

from __future__ import annotations

import numpy as np

from ..core import Problem
from .find import find_span
from .span import occurrence_spans


def runtime_overhead_s(problem: Problem, drops, partitions, rerun: set[int], reruns: list[int] = (),
                       cal: dict | None = None, seen: dict | None = None) -> float | None:
    """Predicted seconds the runtime's checking and recipes add to a step under this plan, or
    None when the trace carries no measurement (imported graphs, older recordings). ``rerun``:
    the ops whose recipes are kept; ``reruns``: each op re-run in a rebuild, once per re-run;
    ``cal``: the rates (default: the trace's ``meta.runtime_overhead``); ``seen``: per model
    call, the ops of its planned regions and how many there are, or None for the whole call
    (:func:`taichi_plan.problem.partition.regions.region_ops`; by default from the drops and ``rerun``, without
    the triggers of groups rebuilt early). The runtime runs its mode in a call's planned
    regions only: a call that drops nothing (its partitions run through their modules'
    wrappers, a head over tokens through its lazy logits) pays no per-op checking. A call
    that drops or partitions along the batch or the sequence pays ``module_call_s`` (trace
    v15) per module call it makes, its module hooks (a head over tokens alone has none), and
    ``region_s`` (trace v18) per planned region it enters, and ``region_op_s`` (trace v19) per
    op of its planned regions (what they cost beyond the runtime's own seconds). Where the
    simulator charges what each re-run and each drop cost (``Problem.folds_runtime``: real
    recordings) they are not here; elsewhere (fake recordings) they are added here, after the
    solve."""
    cal = cal if cal is not None else problem.trace.meta.get("runtime_overhead")
    if not cal or problem.trace.cost_unit != "s":
        return None
    from .regions import checkpointed_modules, module_calls_per_call, needed_ops, region_ops

    call = problem.op_call
    planned = set()
    if partitions:  # a call that partitions along the batch or the sequence has the module hooks
        spans = [find_span(problem, p) for p in partitions if p.over != "tokens"]
        planned.update(int(call[o.fwd[0]]) for s in spans if s is not None for o in occurrence_spans(s))
    if not drops:
        seen = {}
    elif seen is None:
        seen = region_ops(problem.trace, needed_ops(problem, drops, rerun), checkpointed_modules(partitions or ()))
    planned.update(seen)
    planned.discard(-1)
    if not planned:
        return 0.0
    calls = np.asarray(call)
    checked = sum(int((calls == c).sum()) if k is None else int(k.ops) for c, k in seen.items())
    entered = sum(int(k.regions) for k in seen.values() if k is not None)
    in_regions = sum(int(k.ops) for k in seen.values() if k is not None)
    recipes = sum(1 for i in rerun if 0 <= i < len(call) and int(call[i]) in seen)
    per_call = module_calls_per_call(problem.trace)
    hooked = sum(per_call.get(c, 0) for c in planned)
    out = (checked * cal["check_op_s"] + recipes * max(cal["recipe_op_s"] - cal["check_op_s"], 0.0)
           + hooked * float(cal.get("module_call_s", 0.0) or 0.0) + entered * float(cal.get("region_s", 0.0) or 0.0)
           + in_regions * float(cal.get("region_op_s", 0.0) or 0.0))
    if not problem.folds_runtime:  # the re-runs at the runtime's rates, beyond their recorded time
        reruns = list(reruns)
        out += (rebuild_seconds(problem, reruns, cal) - float(problem.op_cost[reruns].sum())
                + len(drops) * float(cal.get("drop_s", 0.0) or 0.0))
    return float(out)


def rebuild_seconds(problem: Problem, reruns: list[int], cal: dict) -> float:
    """Seconds the runtime takes to re-run ``reruns`` (each op once per re-run) at the rates of
    ``cal``: each op's recorded seconds times ``rebuild_time_ratio`` of its name (1 where none),
    plus ``rebuild_op_s`` each; what ``Problem.rerun_cost`` charges when ``cal`` is the trace's."""
    ratio = cal.get("rebuild_time_ratio") or {}
    names, cost = problem.op_name, problem.op_cost
    return float(sum(float(cost[i]) * float(ratio.get(names[i], 1.0)) for i in reruns)
                 + len(reruns) * float(cal.get("rebuild_op_s", 0.0) or 0.0))


def span_cost(problem: Problem, kind: str, redo_s: float, n_ops: int, chunks: int,
              module: str | None = None) -> float | None:
    """Predicted seconds of partitioning a span of ``kind`` (its ``over``: ``"tokens"``...)
    into ``chunks``, from what the recording measured on the model's own span of that kind
    (trace v6, ``meta.runtime_overhead.span_costs[kind]``: :mod:`taichi_plan.runtime.calibrate`
    ran it chunked). The probed span itself (``module``), split into a count it was measured
    at (trace v13: every choice up to 32; before, the fewest and the most), costs what was
    measured there; otherwise ``redo_ratio`` times ``redo_s`` (the recorded seconds of the
    span's ops its chunks run again) plus ``chunks * n_ops * chunk_op_s`` (``n_ops``: the
    span's forward and backward ops in the trace). May be below 0: a head over tokens split
    runs one fused pass, which can be faster than the span unsplit. None when the trace
    measured no span of ``kind``, or measured it before trace v14 (no ``fused`` flag: a
    head over tokens then ran another function, whose backward made each chunk's logits
    again)."""
    cal = (problem.trace.meta.get("runtime_overhead") or {}).get("span_costs", {}).get(kind)
    if not cal or problem.trace.cost_unit != "s":
        return None
    if kind == "tokens" and not cal.get("fused"):
        return None
    measured = dict(zip(cal.get("chunks") or (), cal.get("extra_s") or (), strict=False))
    if module is not None and module == cal.get("module") and int(chunks) in measured:
        return float(measured[int(chunks)])
    return float(cal["redo_ratio"] * redo_s + chunks * n_ops * cal["chunk_op_s"])
