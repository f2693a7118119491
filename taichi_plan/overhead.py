"""What the replay runtime itself costs a plan, predicted from the trace (no torch).

The recorder measures the runtime's per-op bookkeeping on the recording machine
(``meta.runtime_overhead``, see ``taichi_plan.replay.runtime.calibrate_overhead``). A model call
that the plan changes (it drops a tensor made there, or partitions a module in it) runs under
the runtime's dispatch mode: each of its ops pays ``check_op_s``, each op whose recipe a rebuild
may need pays ``recipe_op_s`` instead, and each op re-run in a rebuild pays ``rebuild_op_s`` on
top of its own time, which is its recorded time times ``rebuild_time_ratio`` of its op name
where measured (trace v5), and each dropped tensor ``drop_s`` (trace v6: what a drop costs
beyond all that, measured on a plan of the model's own). Calls the plan leaves alone, and
everything outside the model, pay nothing.
"""

from __future__ import annotations

import numpy as np

from .problem import Problem


def runtime_overhead_s(problem: Problem, drops, partitions, rerun: set[int], reruns: list[int],
                       cal: dict | None = None) -> float | None:
    """Predicted seconds the runtime adds to a step under this plan, or None when the trace
    carries no measurement (imported graphs, older recordings). ``rerun``: the ops whose
    recipes are kept; ``reruns``: each op re-run in a rebuild, once per re-run; ``cal``: the
    rates (default: the trace's ``meta.runtime_overhead``)."""
    cal = cal if cal is not None else problem.trace.meta.get("runtime_overhead")
    if not cal or problem.trace.cost_unit != "s":
        return None
    if not drops and not partitions:
        return 0.0
    call = problem.op_call
    planned = {int(call[int(problem.producer[d.tensor])]) for d in drops}
    if partitions:
        from .partition import find_span, occurrence_spans

        spans = [find_span(problem, p) for p in partitions]
        planned.update(int(call[o.fwd[0]]) for s in spans if s is not None for o in occurrence_spans(s))
    planned.discard(-1)
    in_planned = np.isin(call, sorted(planned)) if planned else np.zeros(len(call), dtype=bool)
    checked = int(in_planned.sum())
    recipes = sum(1 for i in rerun if 0 <= i < len(call) and in_planned[i])
    # A re-run op takes another time than the trace recorded for it (trace v5: measured per op
    # name on the model's own rebuilds); the simulator charged the recorded time.
    ratio = cal.get("rebuild_time_ratio") or {}
    names, cost = problem.op_name, problem.op_cost
    retimed = sum(float(cost[i]) * (ratio[names[i]] - 1.0) for i in reruns if names[i] in ratio)
    # Trace v6: what each dropped tensor costs the step beyond all of the above, measured on a
    # plan of the model's own (taichi_plan.replay.calibrate): packing it as a handle, its
    # rebuild's group bookkeeping, its handle's unpacking, the backward around a rebuilt tensor.
    return float(checked * cal["check_op_s"] + recipes * max(cal["recipe_op_s"] - cal["check_op_s"], 0.0)
                 + len(reruns) * cal["rebuild_op_s"] + retimed + len(drops) * cal.get("drop_s", 0.0))


def span_cost(problem: Problem, kind: str, redo_s: float, n_ops: int, chunks: int) -> float | None:
    """Predicted seconds of partitioning a span of ``kind`` (its ``over``: ``"tokens"``...)
    into ``chunks``, from what the recording measured on the model's own span of that kind
    (trace v6, ``meta.runtime_overhead.span_costs[kind]``: :mod:`taichi_plan.replay.calibrate`
    ran it chunked twice): ``redo_ratio`` times ``redo_s`` (the recorded seconds of the span's
    ops its chunks run again) plus ``chunks * n_ops * chunk_op_s`` (``n_ops``: the span's
    forward and backward ops in the trace). None when the trace measured no span of ``kind``."""
    cal = (problem.trace.meta.get("runtime_overhead") or {}).get("span_costs", {}).get(kind)
    if not cal or problem.trace.cost_unit != "s":
        return None
    return float(cal["redo_ratio"] * redo_s + chunks * n_ops * cal["chunk_op_s"])
