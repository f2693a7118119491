"""On forward-only graphs, the relaxation counts what a rebuild's dead inputs cost.

A dropped tensor's rebuild reads inputs that may be dead by then: each is kept since its last
op (its bytes held up to the group that reads it) or re-made (its ops re-run). Without
``ilp_dead_inputs.DeadInputsMixin._dead_inputs`` the relaxation counted neither, and its bound
stayed at each drop's own re-run (gaps of 45-53% on the public ``random_layered`` graphs). These small random traces,
in the imported space of ``test_ilp_exhaustive.py``, are cases where the bound phase's MIP now
proves the exhaustive optimum and proved less without those constraints; the exhaustive test
checks that the bound never exceeds the optimum on hundreds of others.
"""

from __future__ import annotations

import random

import pytest
from synthetic import random_training_trace
from test_ilp_exhaustive import exhaustive, optimum

from taichi_plan.problem.core import build_problem
from taichi_plan.solve import ilp
from taichi_plan.solve.bound import solve_mip
from taichi_plan.solve.ilp import model as ilp_model
from taichi_plan.solve.ilp import structures as ilp_structure

TOL = 1e-4  # costs are sums of a few numbers like 0.5, 1, 2; the bound is rounded down to a unit


def _imported(seed: int):
    trace = random_training_trace(random.Random(seed))
    trace.meta["mode"] = "imported"
    trace.ops["phase"] = "forward"
    return build_problem(trace)


def _mip_bound(problem, budget: int) -> float:
    """The bound model's MIP bound with every op and group modelled (its strongest form)."""
    st = ilp_structure.structure(problem)
    ops_all, req = ilp_structure.binding_ops(problem, budget)
    unit = max(problem.step_cost / 1e7, 1e-12)
    model = ilp_model.RelaxationModel(problem, st, [], req, ops_all, unit)
    model.chains = False
    for i in range(problem.num_ops):
        model.add_op(i)
    res = solve_mip(model.model.Proto(), 30.0)
    assert res.optimal and res.bound is not None
    return res.bound * unit


@pytest.mark.parametrize(("seed", "budget"), [(197, 176), (259, 224), (281, 240)])
def test_bound_counts_kept_or_remade_dead_inputs(seed, budget, monkeypatch):
    problem = _imported(seed)
    assert problem.every_gap
    opt = optimum(exhaustive(problem), budget)
    assert opt is not None and opt > 0
    bound = _mip_bound(problem, budget)
    assert opt - TOL <= bound <= opt + TOL, f"bound {bound}, exhaustive optimum {opt}"

    def without(self, *args):  # the relaxation as it was: no dead input counted
        self.rem, self.held = {}, {}

    monkeypatch.setattr(ilp_model.RelaxationModel, "_dead_inputs", without)
    assert _mip_bound(problem, budget) < opt - 0.5


def test_plan_ilp_proves_the_optimum_with_them():
    """The whole ILP (bound phase and CP-SAT, with a work limit) proves the same optimum."""
    problem = _imported(259)
    dec = ilp.plan_ilp(problem, 224, time_limit=60.0, work_limit=10.0)
    opt = optimum(exhaustive(problem), 224)
    assert dec.status == "optimal"
    assert dec.objective == pytest.approx(opt, abs=TOL)
    assert dec.lower_bound == pytest.approx(opt, abs=TOL)
