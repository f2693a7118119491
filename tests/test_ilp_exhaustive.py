"""Soundness and completeness of the planners against exhaustive search, on small traces.

The plan spaces (docs/planner.md, "What can be dropped"), no partitions (these synthetic
traces have no batch dimension, so no module can be partitioned). Two spaces, on the same
random traces:

* *recorded* (one gap per tensor, the longest: what replay executes): each candidate gap of
  ``problem.candidates`` is kept, dropped over its full gap, or dropped over its
  early-rebuild gap (``options(problem)``: at most one option per gap);
* *imported, any rebuild point* (the trace marked as an imported graph without a backward,
  every op relabelled forward): every gap between consecutive uses is a candidate, so a
  tensor may be freed and rebuilt several times, and each dropped gap is rebuilt before any
  op of the gap (``options(problem)``: one option per rebuild point, at most one per gap).

Combinations whose rebuild chains cannot run are not plans. Traces with more than
MAX_OPTIONS options or MAX_PLANS plans are skipped; the imported space takes more seeds
(IMPORTED_SEEDS), as its traces have more options each.

For every (trace, budget) pair:
* when some plan of the space fits, ``auto`` and ``ilp`` return a plan that fits, and CP-SAT
  alone (no warm start) finds one too;
* no reported lower bound is above the exhaustive optimum, nor is the bound phase's own
  (the MIP relaxation of solve/bound.py), which must prove a bound on nearly every pair;
* when no plan of the space fits, CP-SAT alone proves it (status infeasible, not a time-out),
  and ``auto`` raises InfeasibleBudgetError.

Searches are bounded by CP-SAT's work limit, not wall time, so the outcome does not depend on
the machine's load. A failure names its seed and space: reproduce with ``check_case(seed, space)``.
"""

from __future__ import annotations

import itertools
import math
import random
import time

import numpy as np
from synthetic import random_training_trace

from taichi_plan.errors import InfeasibleBudgetError, PlanError
from taichi_plan.problem import Problem, build_problem, options
from taichi_plan.simulate import Drop, simulate
from taichi_plan.solve import solve
from taichi_plan.solve.ilp import plan_ilp
from taichi_plan.solve.result import make_plan

MAX_OPTIONS = 12
MAX_PLANS = 2048  # combinations enumerated per trace
SEEDS = range(70)
IMPORTED_SEEDS = range(200)
WORK_LIMIT = 30.0  # CP-SAT deterministic time per solve: far more than these models need
TIME_LIMIT = 120.0  # wall seconds per solve, never reached here (the work limit binds first)
TOL = 1e-6  # costs here are sums of a few numbers like 0.5, 1, 2, 4
MIP_BOUNDS: list[bool] = []  # per feasible pair: did the bound phase prove a bound


def exhaustive(problem: Problem) -> list[tuple[int, float]]:
    """(peak bytes, extra cost) of every executable plan of the space."""
    o = options(problem)
    per: dict[int, list[int]] = {}
    for k in range(len(o)):
        per.setdefault(int(o.cand[k]), []).append(k)
    out = []
    for combo in itertools.product(*[[None, *ks] for ks in per.values()]):
        drops = [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k])) for k in combo if k is not None]
        try:
            sim = simulate(problem, drops)
        except PlanError:
            continue
        out.append((sim.peak_bytes, sim.extra_cost))
    return out


def optimum(plans: list[tuple[int, float]], budget: int) -> float | None:
    costs = [c for peak, c in plans if peak <= budget]
    return min(costs) if costs else None


def check_case(seed: int, space: str = "recorded") -> int:
    """Check every budget of one random trace in one plan space ("recorded" or "imported");
    return the number of (trace, budget) pairs."""
    trace = random_training_trace(random.Random(seed))
    if space == "imported":
        trace.meta["mode"] = "imported"
        trace.ops["phase"] = "forward"
    p = build_problem(trace)
    o = options(p)
    if space == "recorded" and len(o) > MAX_OPTIONS:
        return 0
    if math.prod(1 + int(x) for x in np.bincount(o.cand).tolist()) > MAX_PLANS:
        return 0
    plans = exhaustive(p)
    least = min(peak for peak, _ in plans)
    base = p.baseline_peak[0]
    budgets = sorted({least - 1, least, least + 1, (least + base) // 2, int(base * 0.9)})
    n = 0
    for budget in budgets:
        if budget >= base:
            continue
        n += 1
        opt = optimum(plans, budget)
        where = f"seed {seed}, {space} space, budget {budget} (least {least}, baseline {base}), exhaustive optimum {opt}"
        # CP-SAT alone, no warm start: complete and sound on its own.
        dec = plan_ilp(p, budget, hint=None, time_limit=TIME_LIMIT, work_limit=WORK_LIMIT)
        raw = make_plan(p, budget, "ilp", dec, 0.0, 0)
        assert not dec.timed_out, f"{where}: CP-SAT alone stopped at the work limit"
        if opt is None:
            assert raw.solver["status"] == "infeasible" and dec.status == "infeasible", \
                f"{where}: no plan exists, CP-SAT alone says {raw.solver['status']}"
        else:
            assert raw.solver["status"] != "infeasible", f"{where}: CP-SAT alone found no plan"
            assert raw.solver["lower_bound"] <= opt + TOL, f"{where}: CP-SAT's bound {raw.solver['lower_bound']}"
            # The bound phase's own bound (the MIP relaxation, bound.py), whether or not it is
            # the one reported.
            mip = dec.stats.get("mip_bound")
            assert mip is None or mip <= opt + TOL, f"{where}: the MIP relaxation's bound {mip}"
            MIP_BOUNDS.append(mip is not None)
            assert raw.predicted["extra_compute"] >= opt - TOL, f"{where}: a plan cheaper than the optimum"
            if raw.solver["status"] == "optimal":
                assert raw.predicted["extra_compute"] <= opt + TOL, f"{where}: 'optimal' costs more"
        for method in ("auto", "ilp"):
            try:
                plan = solve(trace, budget, method, problem=p, time_limit=TIME_LIMIT, work_limit=WORK_LIMIT)
            except InfeasibleBudgetError as e:
                assert opt is None, f"{where}: {method} says infeasible: {e}"
                assert e.min_budget_bytes > budget, f"{where}: {method} suggests {e.min_budget_bytes}"
                continue
            assert plan.predicted["planned_peak_bytes"] <= budget, f"{where}: {method} over budget"
            lb = plan.solver["lower_bound"]
            # auto's warm start includes dtr, which may use gaps outside this space and so be
            # cheaper than its optimum; its bound is still a bound on this space's optimum.
            assert lb is None or lb <= opt + TOL, f"{where}: {method}'s bound {lb} is above the optimum"
            if plan.solver["status"] == "optimal":
                assert plan.predicted["extra_compute"] <= opt + TOL, f"{where}: {method} 'optimal' costs more"
    return n


def test_planners_match_exhaustive_search():
    t0 = time.perf_counter()
    failures = []
    per_space = {}
    for space, seeds in (("recorded", SEEDS), ("imported", IMPORTED_SEEDS)):
        pairs = 0
        for seed in seeds:
            try:
                pairs += check_case(seed, space)
            except AssertionError as e:
                failures.append(str(e))
        per_space[space] = pairs
    print(f"{per_space} (trace, budget) pairs in {time.perf_counter() - t0:.1f} s")
    assert not failures, f"{len(failures)} failing seed(s):\n" + "\n".join(failures)
    assert sum(MIP_BOUNDS) >= 0.9 * len(MIP_BOUNDS), f"the bound phase proved {sum(MIP_BOUNDS)} of {len(MIP_BOUNDS)}"
    for space, pairs in per_space.items():
        assert pairs >= 250, f"only {pairs} pairs in the {space} space: the generator changed, widen the seeds"
