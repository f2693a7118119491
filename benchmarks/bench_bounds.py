"""Lower bounds on recorded transformers (issue 11): `auto` with and without the bound phase
(solve/bound.py), at 70/50/35% of the plain peak, 30 s each (fake recordings, a100-40gb)."""

from __future__ import annotations

import sys
import time

FRACTIONS = (0.7, 0.5, 0.35)
TIME_LIMIT = 30.0


def run(time_limit: float = TIME_LIMIT, fractions=FRACTIONS, workloads=None, say=None) -> list[dict]:
    """One row per (trace, budget, bound phase on/off)."""
    import taichi_plan.solve as solve_mod
    from benchmarks.common import RECORDED
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.problem.core import build_problem
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.solve.config import IlpConfig, SolverConfig

    without = SolverConfig(ilp=IlpConfig(bound_share=0.0))  # CP-SAT's bound only
    rows = []
    for label, model, flags in workloads or RECORDED:
        trace = record_workload(get_workload(model=model, **flags), fake=True, device_profile="a100-40gb")
        problem = build_problem(trace)
        base = problem.baseline_peak[0]
        for frac in fractions:
            for phase in (False, True):
                row = {"trace": label, "ops": problem.num_ops, "budget": frac, "bound_phase": phase}
                t0 = time.perf_counter()
                try:
                    plan = solve_mod.solve(trace, int(base * frac), "auto", time_limit=time_limit, problem=problem,
                                           config=SolverConfig() if phase else without)
                    s = plan.solver
                    row.update(status=s["status"], ratio=1 + plan.predicted["extra_compute"] / problem.step_cost,
                               lb=None if s["lower_bound"] is None else 1 + s["lower_bound"] / problem.step_cost,
                               gap=s["gap"], by=(s["stats"] or {}).get("bound_by"))
                except InfeasibleBudgetError as e:
                    row.update(status="no plan", ratio=None, lb=None, gap=None, by=None,
                               timed_out=bool(getattr(e, "timed_out", False)))
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                if say:
                    say(markdown([row]).splitlines()[-1])
    return rows


def markdown(rows: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.4f}"

    lines = ["| trace (ops) | budget | bound phase | status | compute ratio | lower bound | gap | bound by | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "-" if r["gap"] is None else f"{100 * r['gap']:.2f}%"
        status = r["status"] + (" (time-out)" if r.get("timed_out") else "")
        lines.append(f"| {r['trace']} ({r['ops']}) | {r['budget']} | {'on' if r['bound_phase'] else 'off'} | {status} "
                     f"| {f(r['ratio'])} | {f(r['lb'])} | {gap} | {r['by'] or '-'} | {r['seconds']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    out = run(say=lambda line: print(line, file=sys.stderr, flush=True))
    print(markdown(out))
