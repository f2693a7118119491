"""The simulator's verdict on a plan, re-computed from its trace: shared by the text report
(:mod:`~taichi_plan.report.plan_text`), the timeline (:mod:`~taichi_plan.report.timeline`)
and the HTML report, one floor below all three so none imports another for it."""

from __future__ import annotations

from ..base.errors import PlanError
from ..plan.format import Plan
from ..problem.core import Problem
from ..simulate.core import SimResult, simulate_plan
from ..solve.result import drops_from_plan, offloads_from_plan, plan_problem


def resimulate(problem: Problem, plan: Plan) -> tuple[SimResult, Problem]:
    """The simulator's verdict on ``plan``: ``(result, problem it describes)``, the second
    being ``problem`` with the plan's partitions applied. A :class:`PlanError` if the plan does not apply."""
    try:
        drops = drops_from_plan(problem, plan)
        offloads = offloads_from_plan(problem, plan)
    except KeyError as e:  # Problem.index_of: a tensor id the trace does not have
        raise PlanError(f"The plan drops tensor {e.args[0]}, which the trace does not have; "
                        "the plan was made for another trace.") from e
    problem = plan_problem(problem, plan)
    link = problem.offload.host_link_bytes_per_s if problem.offload is not None else None
    return simulate_plan(problem, drops, list(plan.partitions), offloads, link)


__all__ = ["resimulate"]
