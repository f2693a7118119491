"""The solver's typed tuning (taichi_plan/solve/config.py): a value other than the default
reaches the component it tunes, through ``solve(config=...)`` and the functions below it."""

from __future__ import annotations

import dataclasses
import random

import pytest
from synthetic import random_training_trace

from taichi_plan.problem.core import build_problem
from taichi_plan.solve import solve
from taichi_plan.solve.baselines import plan_dtr
from taichi_plan.solve.config import BaselinesConfig, HeuristicConfig, IlpConfig, SolverConfig
from taichi_plan.solve.heuristic import plan_remat


def _problem(seed: int):
    trace = random_training_trace(random.Random(seed))
    return trace, build_problem(trace)


def test_solve_passes_the_ilp_config_on():
    """Without the bound phase (``bound_share=0``) the ILP proves the optimum in a CP-SAT round
    instead of by the MIP bound."""
    trace, problem = _problem(0)
    budget = int(problem.baseline_peak[0] * 0.9)
    plain = solve(trace, budget, "ilp", time_limit=10, work_limit=5, problem=problem).solver
    without = solve(trace, budget, "ilp", time_limit=10, work_limit=5, problem=problem,
                    config=SolverConfig(ilp=IlpConfig(bound_share=0.0))).solver
    assert plain["stats"]["bound_rounds"] >= 1 and plain["stats"]["bound_by"] == "mip-relaxation"
    assert without["stats"]["bound_rounds"] == 0 and without["stats"]["rounds"] >= 1
    assert plain["status"] == without["status"] == "optimal"
    assert plain["extra_compute"] == pytest.approx(without["extra_compute"])


def test_round_counts_follow_the_config():
    _, problem = _problem(5)
    budget = int(problem.baseline_peak[0] * 0.9)
    assert plan_remat(problem, budget).stats["rounds"] == 3
    assert plan_remat(problem, budget, config=HeuristicConfig(max_rounds=1)).stats["rounds"] == 1
    assert plan_dtr(problem, budget).stats["rounds"] == 6
    assert plan_dtr(problem, budget, config=BaselinesConfig(dtr_rounds=2)).stats["rounds"] == 2


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        IlpConfig().workers = 1  # type: ignore[misc]
    assert SolverConfig(ilp=IlpConfig(workers=1)).ilp.workers == 1
    assert SolverConfig().heuristic == HeuristicConfig()
