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

from ..partition import (
    CHUNK_CHOICES,
    Span,
    module_spans,
    partition_cost,
    partition_savings,
    span_tensors,
)
from ..plan import Partition
from ..problem import Problem, coverage_delta, gap_bytes, options, rebuild_closure, rebuild_set
from ..simulate import Drop, SimResult, rebuild_overhead, simulate_plan
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
    own_ops: list[list[int]]  # per option: its rebuild ops (producer, in-place writers)
    temporaries: list[list[int]]  # per candidate: producer ops of temporaries its rebuild must redo
    needers: list[list[int]]  # per option t: options c whose rebuild certainly needs t
    tensor: np.ndarray  # per option: tensor index
    cand: np.ndarray  # per option: candidate index (options of one tensor share it)


def structure(problem: Problem) -> Structure:
    opts = options(problem)
    cands = opts.tensor.tolist()
    k_of: dict[int, list[int]] = {}
    for k, t in enumerate(cands):
        k_of.setdefault(t, []).append(k)
    a, b = opts.free_after, opts.remat_before
    own_ops: list[list[int]] = []
    temporaries: list[list[int]] = []
    needers: list[list[int]] = [[] for _ in cands]
    cand_set = set(k_of)
    broad: list[list[int]] = [[] for _ in cands]  # option -> options whose rebuild may need it
    for k, t in enumerate(cands):
        ops, deps = rebuild_closure(problem, t, int(a[k]), cand_set)
        own = problem.rebuild_ops[t].tolist()
        own_ops.append(own)
        temporaries.append([q for q in ops if q not in own])
        for u in deps:
            for j in k_of[u]:
                if j != k:
                    broad[j].append(k)
    # Earliest op each option's rebuild can happen: its own point, or earlier when a
    # rebuild that needs it comes first (fixpoint over the broad relation).
    low = b.astype(np.int64).copy()
    changed = True
    while changed:
        changed = False
        for j in np.argsort(-a, kind="stable").tolist():
            for k in broad[j]:
                if low[k] < low[j]:
                    low[j] = low[k]
                    changed = True
    # c's rebuild certainly needs t back (t already freed by then) when even its earliest
    # possible rebuild comes after t is freed.
    for j in range(len(cands)):
        needers[j] = sorted({k for k in broad[j] if low[k] > a[j]})
    return Structure(problem.nbytes[opts.tensor].astype(np.int64), a, b,
                     own_ops, temporaries, needers, opts.tensor, opts.cand)


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
    for i, s in zip(over.tolist(), seg.tolist(), strict=True):
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


@dataclass
class PartOption:
    """Partition ``span`` into ``chunks``: frees ``savings[i]`` bytes at op i, costs ``cost``."""

    span: Span
    chunks: int
    savings: np.ndarray
    cost: float
    internal: np.ndarray  # option indices whose tensor the partition makes internal


def partition_options(problem: Problem, st: Structure, budget: int) -> list[PartOption]:
    """Partitions worth modelling: those that free bytes at some op over the budget."""
    spans = module_spans(problem)
    if not spans:
        return []
    over = problem.baseline_live > budget
    opt_of: dict[int, list[int]] = {}
    for k, t in enumerate(st.tensor.tolist()):
        opt_of.setdefault(t, []).append(k)
    out = []
    for span in spans:
        inner = span_tensors(problem, span)
        # Options the partition rules out: its own tensors, and those whose rebuild would
        # re-make one of them (replay cannot re-run a partitioned module's ops one by one).
        blocked = {k for t in inner for k in opt_of.get(t, [])}
        blocked.update(k for k, (t, b) in enumerate(zip(st.tensor.tolist(), st.b.tolist(), strict=True))
                       if k not in blocked and not inner.isdisjoint(rebuild_set(problem, t, b) or ()))
        internal = np.asarray(sorted(blocked), dtype=np.int64)
        for chunks in sorted({c for c in CHUNK_CHOICES if c <= span.batch}):
            sav = partition_savings(problem, span, chunks)
            if not np.any(sav[over] > 0):
                break
            out.append(PartOption(span, chunks, sav, partition_cost(problem, span, chunks), internal))
    return out


def plan_ilp(problem: Problem, budget_bytes: int | None, *, seed: int = 0, time_limit: float = 60.0,
             hint: Decisions | None = None, progress: Callable[[float, float], None] | None = None,
             workers: int = 2, partitions: bool = True) -> Decisions:
    t0 = time.perf_counter()
    if budget_bytes is None:
        return Decisions(status="optimal", lower_bound=0.0, notes=["no budget"])
    st = structure(problem)
    ops_all, req = binding_ops(problem, budget_bytes)
    if len(ops_all) == 0:
        return Decisions(status="optimal", lower_bound=0.0, objective=0.0,
                         notes=["the budget does not bind: nothing to drop"])
    parts = partition_options(problem, st, budget_bytes) if partitions else []
    most = coverage_delta(problem)
    for po in parts:
        most = most + np.maximum(po.savings, 0)
    if np.any(most[ops_all] < req[ops_all]):
        return Decisions(status="infeasible", lower_bound=None,
                         notes=["even dropping every candidate and partitioning every module cannot meet the budget"])

    cost_unit = max(problem.step_cost / 1e7, 1e-12)
    active: list[int] = list(ops_all[:INITIAL_OPS])
    extra_req: dict[int, int] = {}
    incumbent: tuple[Decisions, SimResult] | None = None
    lower_bound = None
    relaxed = True
    rounds = 0
    notes: list[str] = []  # for people (inspect shows them)
    log: list[str] = []  # for the record: the plan's solver.stats["log"]
    status_final = None
    overheads: dict[int, int] = {}
    cutoff = None
    scale_note = ""
    if hint is not None:
        hint_sim, _ = simulate_plan(problem, hint.drops, hint.partitions)
        if hint_sim.peak_bytes <= budget_bytes:
            incumbent = (hint, hint_sim)
            cutoff = hint_sim.extra_cost
    while True:
        rounds += 1
        remaining = time_limit - (time.perf_counter() - t0)
        if remaining <= 0.05:
            notes.append("CP-SAT stopped at the time limit: a longer --time-limit may find a cheaper plan")
            break
        model, x, y, model_cost, scale_note, terms = _build(problem, st, parts, active, req, extra_req,
                                                            budget_bytes, cost_unit)
        if not relaxed:
            _add_rebuild_constraints(problem, st, model, x, budget_bytes, overheads)
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
        prm.max_deterministic_time = remaining
        prm.max_time_in_seconds = remaining * 1.5 + 1
        code = solver.Solve(model, _Progress(progress, cost_unit))
        if code == cp_model.INFEASIBLE and relaxed and cutoff is not None:
            # Nothing beats the heuristic even in the relaxation: the heuristic is optimal.
            lower_bound = cutoff
            status_final = "optimal"
            break
        if code == cp_model.INFEASIBLE:
            if relaxed:
                return Decisions(status="infeasible", notes=["CP-SAT proved that no plan fits"],
                                 stats={"rounds": rounds, "log": ["the relaxation is infeasible"]})
            log.append(f"round {rounds}: the tightened model has no solution")
            break
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            log.append(f"round {rounds}: no solution within the time limit")
            break
        if relaxed:
            lower_bound = solver.BestObjectiveBound() * cost_unit
        chosen = np.array([solver.Value(v) for v in x], dtype=bool)
        dec = Decisions(
            drops=[Drop(int(st.tensor[k]), int(st.a[k]), int(st.b[k])) for k in np.nonzero(chosen)[0]],
            partitions=[Partition(parts[j].span.module, 0, parts[j].chunks) for j, v in enumerate(y)
                        if solver.Value(v)],
        )
        sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
        if sim.peak_bytes <= budget_bytes:
            if incumbent is None or sim.extra_cost < incumbent[1].extra_cost:
                incumbent = (dec, sim)
            slack = cost_unit * (len(st.sizes) + len(parts) + 1)  # rounding of costs to the unit
            if code == cp_model.OPTIMAL and relaxed and sim.extra_cost <= lower_bound + slack:
                status_final = "optimal"
            break
        over = sim_over(parted, sim) - budget_bytes
        bad = np.nonzero(over > 0)[0]
        new = [int(i) for i in bad if i not in set(active) and req[i] > 0]
        if new and terms < MAX_TERMS:
            active.extend(sorted(new, key=lambda i: -over[i])[:64])
        else:
            relaxed = False
            # Ask for more bytes away at each op still over: what this solution frees there
            # (at most its coverage) plus the excess.
            freed = gap_bytes(problem.num_ops, st.a[chosen], st.b[chosen], st.sizes[chosen]) + sum(
                (parts[j].savings for j, v in enumerate(y) if solver.Value(v)), np.zeros(problem.num_ops, np.int64))
            for i in bad.tolist():
                want = int(freed[i]) + int(over[i])
                extra_req[i] = max(extra_req.get(i, 0), want - int(req[i]))
                if i not in active:
                    active.append(i)
    stats = {"rounds": rounds, "modelled_ops": len(active), "binding_ops": int(len(ops_all)),
             "candidates": int(len(st.sizes)), "partition_options": len(parts), "scaling": scale_note, "log": log}
    if incumbent is None:
        return Decisions(lower_bound=lower_bound, notes=notes + ["CP-SAT found no plan the simulator accepts"],
                         stats=stats)
    dec, sim = incumbent
    return Decisions(drops=dec.drops, partitions=dec.partitions, status=status_final or "feasible",
                     objective=sim.extra_cost, lower_bound=lower_bound, notes=notes, stats=stats)


def _add_rebuild_constraints(problem, st: Structure, model, x, budget: int, overheads: dict[int, int]) -> None:
    """[Constraint] (tightening, not a relaxation) a rebuild's own working set must fit:
    the bytes dropped around its rebuild point cover what the rebuild adds over the budget."""
    live = problem.baseline_live
    for k in range(len(st.sizes)):
        r = int(st.b[k])
        if k not in overheads:
            overheads[k] = rebuild_overhead(problem, Drop(int(st.tensor[k]), int(st.a[k]), r))
        # Carried into the group: what was live during op r-1 minus what op r-1 freed is at
        # most live[r-1]; the rebuilt tensor itself is part of the overhead.
        excess = int(live[r - 1]) + overheads[k] - int(st.sizes[k]) - budget
        if excess <= 0:
            continue
        cover = np.nonzero((st.a < r - 1) & (r - 1 < st.b))[0]
        cover = cover[cover != k]
        if int(st.sizes[cover].sum()) < excess:
            model.Add(x[k] == 0)
            continue
        model.Add(sum(int(st.sizes[j]) * x[j] for j in cover.tolist()) >= excess).OnlyEnforceIf(x[k])


def _build(problem, st: Structure, parts: list[PartOption], active, req, extra_req, budget, cost_unit):
    model = cp_model.CpModel()
    C = len(st.sizes)
    x = [model.NewBoolVar(f"x{k}") for k in range(C)]
    y = [model.NewBoolVar(f"y{j}") for j in range(len(parts))]
    # [Constraint] partitions: one chunk count per module, never a module and one inside it,
    # and a partitioned module's insides are not dropped on their own.
    by_module: dict[str, list[int]] = {}
    for j, po in enumerate(parts):
        by_module.setdefault(po.span.module, []).append(j)
    mods = sorted(by_module)
    for i1, m1 in enumerate(mods):
        for m2 in mods[i1 + 1:]:
            if m2.startswith(m1 + "."):
                model.AddAtMostOne([y[j] for j in by_module[m1] + by_module[m2]])
        model.AddAtMostOne([y[j] for j in by_module[m1]])
    for j, po in enumerate(parts):
        for k in po.internal.tolist():
            model.AddImplication(y[j], x[k].Not())
    # [Constraint] at most one gap option per tensor.
    alts: dict[int, list[int]] = {}
    for k, c in enumerate(st.cand.tolist()):
        alts.setdefault(c, []).append(k)
    for ks in alts.values():
        if len(ks) > 1:
            model.AddAtMostOne([x[k] for k in ks])

    # [Constraint] an op re-runs if any output it produced is dropped; temporaries likewise.
    rerun: dict[int, cp_model.IntVar] = {}
    for k in range(C):
        for p in [*st.own_ops[k], *st.temporaries[k]]:
            if p not in rerun:
                rerun[p] = model.NewBoolVar(f"r{p}")
            model.AddImplication(x[k], rerun[p])
    costs = {p: int(math.floor(problem.op_cost[p] / cost_unit)) for p in rerun}
    objective = sum(costs[p] * v for p, v in rerun.items() if costs[p] > 0) + sum(
        int(math.floor(po.cost / cost_unit)) * y[j] for j, po in enumerate(parts))
    model.Minimize(objective)

    # Byte scaling: divide by the GCD; if still large, round sizes up to a unit (relaxation).
    reqs = {i: int(req[i]) + extra_req.get(i, 0) for i in active}
    g = 0
    for s in st.sizes.tolist():
        g = math.gcd(g, int(s))
    g = max(g, 1)
    unit = g
    biggest = max(int(st.sizes.max()) if len(st.sizes) else 1, max(reqs.values()))
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
        part_terms = [(-(-int(po.savings[i]) // unit)) * y[j] for j, po in enumerate(parts) if po.savings[i] > 0]
        model.Add(sum(sizes[k] * away[k] for k in cover) + sum(part_terms) >= need)
        terms += len(cover)
    return model, x, y, objective, note, terms
