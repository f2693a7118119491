"""What the replay runtime itself costs a plan, predicted from the trace (no torch).

The recorder measures the runtime's per-op bookkeeping on the recording machine
(``meta.runtime_overhead``, see ``taichi_plan.replay.runtime.calibrate_overhead``). A model call
that the plan changes (it drops a tensor made there, or partitions a module in it) runs under
the runtime's dispatch mode: each of its ops pays ``check_op_s``, each op whose recipe a rebuild
may need pays ``recipe_op_s`` instead, and each op re-run in a rebuild pays ``rebuild_op_s`` on
top of its own time. Calls the plan leaves alone, and everything outside the model, pay nothing.
"""

from __future__ import annotations

import numpy as np

from .problem import Problem


def runtime_overhead_s(problem: Problem, drops, partitions, rerun: set[int], recompute_ops: int) -> float | None:
    """Predicted seconds the runtime adds to a step under this plan, or None when the trace
    carries no measurement (imported graphs, older recordings)."""
    cal = problem.trace.meta.get("runtime_overhead")
    if not cal or problem.trace.cost_unit != "s":
        return None
    if not drops and not partitions:
        return 0.0
    call = problem.op_call
    planned = {int(call[int(problem.producer[d.tensor])]) for d in drops}
    if partitions:
        from .partition import partitionable_spans

        spans = {s.module: s for s in partitionable_spans(problem)}
        planned.update(int(call[spans[p.module].fwd[0]]) for p in partitions if p.module in spans)
    planned.discard(-1)
    in_planned = np.isin(call, sorted(planned)) if planned else np.zeros(len(call), dtype=bool)
    checked = int(in_planned.sum())
    recipes = sum(1 for i in rerun if 0 <= i < len(call) and in_planned[i])
    return float(checked * cal["check_op_s"] + recipes * max(cal["recipe_op_s"] - cal["check_op_s"], 0.0)
                 + recompute_ops * cal["rebuild_op_s"])
