"""Soundness and completeness of the planners against exhaustive search, on small traces.

The plan spaces (docs/planner.md, "What can be dropped"). Three spaces, on the same random
traces:

* *recorded* (one gap per tensor, the longest: what replay executes): each candidate gap of
  ``problem.candidates`` is kept, dropped over its full gap, or dropped over its
  early-rebuild gap (``options(problem)``: at most one option per gap);
* *imported, any rebuild point, with revivals* (the trace marked as an imported graph without
  a backward, every op relabelled forward): every gap between consecutive uses is a
  candidate, so a tensor may be freed and rebuilt several times, and each dropped gap is
  rebuilt before any op of the gap (``options(problem)``: one option per rebuild point, at
  most one per gap); and each dead tensor a rebuild may read is kept past its last op or
  rebuilt before any later op, or neither (``revival_options(problem)``: at most one each);
* *partitioned*: the recorded space, the trace given a workload (no batch size), so that each
  of its modules with a forward and a backward span may also be checkpointed whole (a
  partition of one chunk): every set of partitions (no module with one inside it) times every
  combination of drops. (Without a workload no module is partitioned, as in the other two.)

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

from taichi_plan.base.errors import InfeasibleBudgetError, PlanError
from taichi_plan.plan.format import Partition
from taichi_plan.problem.core import Problem, build_problem
from taichi_plan.problem.options import Options, options, revival_options
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.simulate.core import Drop, simulate_plan
from taichi_plan.solve import solve
from taichi_plan.solve.ilp import plan_ilp
from taichi_plan.solve.result import make_plan

MAX_OPTIONS = 12
MAX_PLANS = 2048  # combinations enumerated per trace
SEEDS = range(70)
IMPORTED_SEEDS = range(400)  # with revivals, about one trace in seven is small enough
PARTITIONED_SEEDS = range(70, 86)
WORK_LIMIT = 30.0  # CP-SAT deterministic time per solve: far more than these models need
TIME_LIMIT = 120.0  # wall seconds per solve, never reached here (the work limit binds first)
TOL = 1e-6  # costs here are sums of a few numbers like 0.5, 1, 2, 4
MIP_BOUNDS: list[bool] = []  # per feasible pair: did the bound phase prove a bound


def partition_sets(problem: Problem) -> list[list[Partition]]:
    """Every set of partitions a plan may hold: per module none or one of its chunk counts,
    never a module and one inside it."""
    spans = module_spans(problem)
    out = []
    for combo in itertools.product(*[[None, *s.chunk_choices] for s in spans]):
        chosen = [(s, k) for s, k in zip(spans, combo, strict=True) if k is not None]
        names = [s.module for s, _ in chosen]
        if any(a != b and b.startswith(a + ".") for a in names for b in names):
            continue
        out.append([as_partition(s, k) for s, k in chosen])
    return out


def plan_options(problem: Problem) -> Options:
    """Every option of the plan space: the gap options and, on forward-only graphs, the
    revivals (their ``cand`` numbers follow the candidates')."""
    o, r = options(problem), revival_options(problem)
    return Options(*(np.concatenate([getattr(o, f), getattr(r, f)]) for f in ("tensor", "cand", "free_after",
                                                                             "remat_before")))


def exhaustive(problem: Problem) -> list[tuple[int, float]]:
    """(peak bytes, extra cost) of every executable plan of the space (partitions included
    where the trace has modules to partition)."""
    o = plan_options(problem)
    per: dict[int, list[int]] = {}
    for k in range(len(o)):
        per.setdefault(int(o.cand[k]), []).append(k)
    out = []
    for parts in partition_sets(problem):
        for combo in itertools.product(*[[None, *ks] for ks in per.values()]):
            drops = [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k]))
                     for k in combo if k is not None]
            try:
                sim, _ = simulate_plan(problem, drops, parts)
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
    if space == "partitioned":  # a workload: its modules may be checkpointed whole (one chunk)
        trace.meta["workload"] = {"name": "synthetic", "args": {}}
    p = build_problem(trace)
    o = plan_options(p)
    if space != "imported" and len(o) > MAX_OPTIONS:
        return 0
    if math.prod(1 + int(x) for x in np.bincount(o.cand).tolist()) * len(partition_sets(p)) > MAX_PLANS:
        return 0
    if space == "partitioned" and len(partition_sets(p)) < 2:
        return 0  # no module to partition: the recorded space already has this trace
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
    for space, seeds in (("recorded", SEEDS), ("imported", IMPORTED_SEEDS), ("partitioned", PARTITIONED_SEEDS)):
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
        least = {"recorded": 250, "imported": 150, "partitioned": 40}[space]
        assert pairs >= least, f"only {pairs} pairs in the {space} space: the generator changed, widen the seeds"
