"""CP-SAT planner: minimize extra compute so that no op exceeds the budget.

The model (one boolean per candidate, so O(n) decisions, plus per-op chain variables
only at the ops the budget binds) is a *relaxation* of the simulator: every plan the
simulator accepts satisfies it, so CP-SAT's best bound is a lower bound on the extra
compute of any plan (within the candidate gaps). Its plans are then judged by the
simulator; ops it finds over budget are added to the model (lazy constraints) and, where
the excess comes from effects the model leaves out (transients of a rebuild), that op's
requirement is tightened for the following rounds (those rounds no longer give bounds).

Variables and constraints:
* ``x[t]``: candidate ``t`` is dropped over its gap (free_after, remat_before).
* ``rerun[p] >= x[t]`` for ``t`` produced by op ``p``; ``redo[u] >= x[t]`` for each forward
  temporary ``u`` that is gone before ``t`` is freed and that rebuilding ``t`` needs.
  Objective: sum of their op costs (each op counted once: a lower bound).
* Chains: rebuilding a dropped ``c`` that reads ``t`` brings ``t`` back (the simulator's
  "rebuilt early"). ``forced[t,i]`` says this happened by op ``i``; ``away[t,i]`` says ``t``
  is really absent at ``i``. Only pairs with ``free_after[c] >= free_after[t]`` are used,
  where the forcing is certain, so the model stays a relaxation.
* Memory at each modelled op ``i``: sum of ``nbytes[t] * away[t,i]`` >= baseline[i] - budget.
Byte coefficients are divided by their GCD (and, if still huge, rounded up to a unit, which
keeps the relaxation); costs are rounded down to a unit of step_cost / 1e7.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..problem import Problem, coverage_delta
from ..simulate import Drop, SimResult, simulate
from .heuristic import sim_over
from .result import Decisions

INITIAL_OPS = 24  # budget-binding ops modelled in the first round
MAX_TERMS = 400_000  # stop adding ops (still a relaxation) past this many chain terms


@dataclass
class Structure:
    """Precomputed facts the model needs, independent of the budget."""

    sizes: np.ndarray
    a: np.ndarray
    b: np.ndarray
    producer: np.ndarray
    temporaries: list[list[int]]  # per candidate: producer ops of temporaries its rebuild must redo
    needers: list[list[int]]  # per candidate t: candidates c whose rebuild certainly needs t


def structure(problem: Problem) -> Structure:
    cands = problem.candidates.tolist()
    k_of = {t: k for k, t in enumerate(cands)}
    a, b = problem.cand_free_after, problem.cand_remat_before
    temporaries: list[list[int]] = []
    needers: list[list[int]] = [[] for _ in cands]
    for k, t in enumerate(cands):
        ops_needed: list[int] = []
        seen = {int(problem.producer[t])}
        stack = [int(problem.producer[t])]
        while stack:
            p = stack.pop()
            for u in problem.op_reads[p].tolist():
                if u in k_of:
                    j = k_of[u]
                    if j != k and a[k] >= a[j] and k not in needers[j]:
                        needers[j].append(k)
                    continue
                # A non-candidate input gone before t is freed must be rebuilt too.
                if problem.end[u] <= a[k] and problem.rematerializable[u]:
                    q = int(problem.producer[u])
                    if q not in seen:
                        seen.add(q)
                        ops_needed.append(q)
                        stack.append(q)
        temporaries.append(ops_needed)
    return Structure(problem.nbytes[problem.candidates].astype(np.int64), a, b,
                     problem.producer[problem.candidates], temporaries, needers)


def binding_ops(problem: Problem, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Ops where the baseline exceeds the budget, one per stretch of equal covering set
    (the one with the largest requirement), sorted by requirement, largest first."""
    req = problem.baseline_live.astype(np.int64) - budget
    over = np.nonzero(req > 0)[0]
    if len(over) == 0:
        return over, req
    cuts = np.unique(np.concatenate([problem.cand_free_after + 1, problem.cand_remat_before]))
    seg = np.searchsorted(cuts, over, side="right")
    best: dict[int, int] = {}
    for i, s in zip(over.tolist(), seg.tolist()):
        if s not in best or req[i] > req[best[s]]:
            best[s] = i
    ops = np.array(sorted(best.values(), key=lambda i: -req[i]), dtype=np.int64)
    return ops, req


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, report, unit):
        super().__init__()
        self.report, self.unit = report, unit

    def on_solution_callback(self):
        if self.report:
            self.report(self.ObjectiveValue() * self.unit, self.BestObjectiveBound() * self.unit)


def plan_ilp(problem: Problem, budget_bytes: int | None, *, seed: int = 0, time_limit: float = 60.0,
             hint: list[Drop] | None = None, progress: Callable[[float, float], None] | None = None,
             workers: int = 2) -> Decisions:
    t0 = time.perf_counter()
    if budget_bytes is None:
        return Decisions(status="optimal", lower_bound=0.0, notes=["no budget"])
    st = structure(problem)
    ops_all, req = binding_ops(problem, budget_bytes)
    if len(ops_all) == 0:
        return Decisions(status="optimal", lower_bound=0.0, objective=0.0,
                         notes=["the budget does not bind: nothing to drop"])
    if np.any(coverage_delta(problem)[ops_all] < req[ops_all]):
        return Decisions(status="infeasible", lower_bound=None,
                         notes=["even dropping every candidate cannot meet the budget at some op"])

    cost_unit = max(problem.step_cost / 1e7, 1e-12)
    active: list[int] = list(ops_all[:INITIAL_OPS])
    extra_req: dict[int, int] = {}
    incumbent: tuple[list[Drop], SimResult] | None = None
    lower_bound = None
    relaxed = True
    rounds = 0
    notes = []
    status_final = None
    cutoff = None
    if hint:
        hint_sim = simulate(problem, hint)
        if hint_sim.peak_bytes <= budget_bytes:
            incumbent = (list(hint), hint_sim)
            cutoff = hint_sim.extra_cost
    while True:
        rounds += 1
        remaining = time_limit - (time.perf_counter() - t0)
        if remaining <= 0.05:
            break
        model, x, model_cost, scale_note, terms = _build(problem, st, active, req, extra_req, budget_bytes, cost_unit)
        if relaxed and cutoff is not None:
            # Warm start: the heuristic's plan is the incumbent to beat. (Solution hints
            # with interleaved search abort inside CP-SAT 9.15 on some infeasible models,
            # so the heuristic enters as an objective cutoff instead.)
            model.Add(model_cost <= int(math.floor(cutoff / cost_unit)))
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.random_seed = seed
        prm.num_workers = workers
        prm.interleave_search = workers > 1
        if workers > 1:
            prm.use_lns_only = False
        prm.max_deterministic_time = remaining
        prm.max_time_in_seconds = remaining * 1.5 + 1
        cb = _Progress(progress, cost_unit)
        code = solver.Solve(model, cb)
        if code == cp_model.INFEASIBLE and relaxed and cutoff is not None:
            # Nothing beats the heuristic in the relaxation: it is optimal.
            lower_bound = cutoff
            status_final = "optimal"
            break
        if code == cp_model.INFEASIBLE:
            if relaxed:
                return Decisions(status="infeasible", notes=["the relaxation is infeasible: no plan fits"],
                                 stats={"rounds": rounds})
            break
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            notes.append(f"round {rounds}: no solution within the time limit")
            break
        if relaxed:
            lower_bound = solver.BestObjectiveBound() * cost_unit
        chosen = np.array([solver.Value(v) for v in x], dtype=bool)
        drops = [Drop(int(problem.candidates[k]), int(st.a[k]), int(st.b[k])) for k in np.nonzero(chosen)[0]]
        sim = simulate(problem, drops)
        if sim.peak_bytes <= budget_bytes:
            if incumbent is None or sim.extra_cost < incumbent[1].extra_cost:
                incumbent = (drops, sim)
            slack = cost_unit * (len(st.sizes) + 1)  # rounding of costs to the unit
            if code == cp_model.OPTIMAL and relaxed and sim.extra_cost <= lower_bound + slack:
                status_final = "optimal"
            break
        over = sim_over(problem, sim) - budget_bytes
        bad = np.nonzero(over > 0)[0]
        new = [int(i) for i in bad if i not in set(active) and req[i] > 0]
        if new and terms < MAX_TERMS:
            active.extend(sorted(new, key=lambda i: -over[i])[:64])
        else:
            relaxed = False
            for i in bad.tolist():
                extra_req[i] = extra_req.get(i, 0) + int(over[i])
                if i not in active:
                    active.append(i)
    stats = {"rounds": rounds, "modelled_ops": len(active), "binding_ops": int(len(ops_all)),
             "candidates": int(len(st.sizes)), "scaling": scale_note}
    if incumbent is None:
        return Decisions(lower_bound=lower_bound, notes=notes + ["CP-SAT found no plan the simulator accepts"],
                         stats=stats)
    drops, sim = incumbent
    notes.append(scale_note)
    return Decisions(drops=drops, status=status_final or "feasible", objective=sim.extra_cost,
                     lower_bound=lower_bound, notes=notes, stats=stats)


def _build(problem, st: Structure, active, req, extra_req, budget, cost_unit):
    model = cp_model.CpModel()
    C = len(st.sizes)
    x = [model.NewBoolVar(f"x{k}") for k in range(C)]

    # [Constraint] an op re-runs if any output it produced is dropped; temporaries likewise.
    rerun: dict[int, cp_model.IntVar] = {}
    for k in range(C):
        for p in [int(st.producer[k]), *st.temporaries[k]]:
            if p not in rerun:
                rerun[p] = model.NewBoolVar(f"r{p}")
            model.AddImplication(x[k], rerun[p])
    costs = {p: int(math.floor(problem.op_cost[p] / cost_unit)) for p in rerun}
    objective = sum(costs[p] * v for p, v in rerun.items() if costs[p] > 0)
    model.Minimize(objective)

    # Byte scaling: divide by the GCD; if still large, round sizes up to a unit (relaxation).
    reqs = {i: int(req[i]) + extra_req.get(i, 0) for i in active}
    g = 0
    for s in st.sizes.tolist():
        g = math.gcd(g, int(s))
    g = max(g, 1)
    unit = g
    biggest = max(int(st.sizes.max()), max(reqs.values()))
    if biggest // unit > 2**40:
        unit = max(g, biggest >> 40)
    sizes = [-(-int(s) // unit) for s in st.sizes.tolist()]
    note = f"bytes divided by {unit} (GCD {g}{', sizes rounded up' if unit != g else ''})"

    # [Constraint] memory at each modelled op: the dropped-and-still-away bytes cover the excess.
    terms = 0
    for i in active:
        cover = np.nonzero((st.a < i) & (i < st.b))[0].tolist()
        cov_set = set(cover)
        away = {}
        forced = {}
        for k in cover:
            direct = [c for c in st.needers[k] if st.b[c] <= i and st.a[c] < i]
            chain = [c for c in st.needers[k] if c in cov_set]
            if not direct and not chain:
                away[k] = x[k]
                continue
            f = model.NewBoolVar(f"f{k}_{i}")
            forced[k] = f
            for c in direct:
                model.AddImplication(x[c], f)
            aw = model.NewBoolVar(f"w{k}_{i}")
            model.AddImplication(aw, x[k])
            model.AddBoolOr([aw.Not(), f.Not()])
            away[k] = aw
        for k in cover:
            if k in forced:
                for c in st.needers[k]:
                    if c in cov_set and c in forced:
                        # [Constraint] c dropped and brought back by op i brings k back too.
                        model.AddBoolOr([x[c].Not(), forced[c].Not(), forced[k]])
                        terms += 1
                    elif c in cov_set:
                        pass  # c is never brought back early, so rebuilding it happens after i
        need = -(-reqs[i] // unit)
        model.Add(sum(sizes[k] * away[k] for k in cover) >= need)
        terms += len(cover)
    return model, x, objective, note, terms
