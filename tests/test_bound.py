"""The bound phase (taichi_plan/solve/bound.py): the MIP form of a CP-SAT model is exact for
the constraint kinds the ILP uses, so its optimum is CP-SAT's; and its bound, in the planner,
never exceeds the plan's cost. (Against exhaustive search: tests/test_ilp_exhaustive.py.)"""

from __future__ import annotations

import math
import random

from ortools.sat.python import cp_model
from synthetic import random_training_trace

from taichi_plan.problem.core import build_problem
from taichi_plan.solve.bound import SAFETY, solve_mip
from taichi_plan.solve.ilp import plan_ilp
from taichi_plan.solve.result import make_plan


def _random_model(rng: random.Random) -> cp_model.CpModel:
    """Booleans and one small integer, with the ILP's constraint kinds: clauses, implications,
    at-most-one, linear constraints enforced by a conjunction of literals, a lower bound of a
    re-run count; a nonnegative cost."""
    m = cp_model.CpModel()
    x = [m.NewBoolVar(f"x{i}") for i in range(6)]
    r = m.NewIntVar(0, 2, "r")

    def lits(n_max: int = 3):
        return [v if rng.random() < 0.5 else v.Not() for v in rng.sample(x, rng.randint(1, n_max))]

    for _ in range(rng.randint(1, 6)):
        kind = rng.randint(0, 5)
        if kind == 0:
            m.AddBoolOr(lits())
        elif kind == 1:
            m.AddImplication(lits(1)[0], lits(1)[0])
        elif kind == 2:
            m.AddAtMostOne(lits())
        elif kind == 3:
            c = m.Add(sum(rng.randint(1, 9) * v for v in rng.sample(x, 3)) >= rng.randint(1, 15))
            if rng.random() < 0.7:
                c.OnlyEnforceIf(lits())
        elif kind == 4:
            c = m.Add(sum(rng.randint(1, 9) * v for v in rng.sample(x, 3)) <= rng.randint(0, 10))
            if rng.random() < 0.5:
                c.OnlyEnforceIf(lits(2))
        else:
            m.Add(r >= sum(rng.sample(x, 2)))
    m.Minimize(sum(rng.randint(0, 5) * v for v in x) + 3 * r)
    return m


def test_mip_form_has_the_cp_sat_optimum():
    seen = {"feasible": 0, "infeasible": 0}
    for seed in range(150):
        model = _random_model(random.Random(seed))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        code = solver.Solve(model)
        res = solve_mip(model.Proto(), 10.0)
        assert res.optimal, f"seed {seed}: the MIP did not finish"
        if code == cp_model.INFEASIBLE:
            seen["infeasible"] += 1
            assert res.bound == math.inf and res.values is None, f"seed {seed}: CP-SAT infeasible, MIP {res}"
            continue
        assert code == cp_model.OPTIMAL
        seen["feasible"] += 1
        opt = solver.ObjectiveValue()
        # The reported bound is lowered by SAFETY of itself plus one unit, never more.
        assert opt - SAFETY * abs(opt) - 1.0 - 1e-6 <= res.bound <= opt, f"seed {seed}: {res.bound} vs {opt}"
        # Its solution satisfies the CP-SAT model and costs the optimum.
        for i, v in res.values.items():
            model.Add(model.GetIntVarFromProtoIndex(i) == v)
        check = cp_model.CpSolver()
        assert check.Solve(model) == cp_model.OPTIMAL and abs(check.ObjectiveValue() - opt) < 1e-6, f"seed {seed}"
    assert seen["feasible"] >= 50 and seen["infeasible"] >= 5, seen


def test_bound_phase_bound_is_below_the_plan_and_reported():
    proved = 0
    for seed in range(12):
        trace = random_training_trace(random.Random(seed))
        p = build_problem(trace)
        budget = int(p.baseline_peak[0] * 0.8)
        dec = plan_ilp(p, budget, time_limit=60, work_limit=5)
        plan = make_plan(p, budget, "ilp", dec, 0.0, 0)
        mip = dec.stats.get("mip_bound")
        if plan.solver["status"] == "infeasible" or mip is None:
            continue
        proved += 1
        assert mip <= plan.predicted["extra_compute"] + 1e-9 * p.step_cost, f"seed {seed}"
        assert plan.solver["lower_bound"] >= mip, f"seed {seed}: the reported bound is not the best one"
        assert dec.stats["bound_by"] in ("mip-relaxation", "cp-sat")
    assert proved >= 4, proved


def test_what_highs_prints_itself_does_not_reach_standard_output(capfd):
    """HiGHS writes a line of its own to the process's standard output whatever its options
    say (ERGO-Code/HiGHS#2783); it landed in the middle of ``solve``'s report."""
    import os

    from taichi_plan.solve.bound import quiet_stdout

    print("before", flush=True)
    with quiet_stdout():
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    print("after", flush=True)
    assert capfd.readouterr().out == "before\nafter\n"
