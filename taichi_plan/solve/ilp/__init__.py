"""CP-SAT planner: minimize extra compute so that no op exceeds the budget.

The model (one boolean per option, so O(n) decisions, plus per-op chain variables only at
the ops modelled) is a *relaxation* of the simulator: every plan the simulator accepts
satisfies it, so CP-SAT's best bound is a lower bound on the extra compute of any plan of
the space (the candidate gaps and their options). Rounds on one growing model: each
assignment CP-SAT proposes is simulated and then cut off by a no-good cut (that exact
assignment, never anything else); ops and recompute groups the simulator finds over budget
get constraints valid for every plan; a plan that fits becomes the incumbent, which later
rounds must beat. Nothing the simulator would accept is ever cut, so the search is complete
(given time) and its bound, min(incumbent, CP-SAT's bound), stays valid. Plan finders that
may cut plans (a greedy repair, one tightened model) only feed incumbents.

The model, its variables and constraints, is :class:`~taichi_plan.solve.ilp.model.RelaxationModel`
(the facts it is built from: :mod:`.ilp_structure`; the partition options: :mod:`.ilp_partitions`);
CP-SAT runs in :mod:`.cpsat`. Here: the rounds, the bound phase (:mod:`.bound`) ahead of them,
and the plan finders that feed incumbents.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from ortools.sat.python import cp_model

from ...base.errors import PlanError
from ...problem.core import Problem
from ...problem.live import coverage_delta, gap_bytes
from ...problem.partition.apply import apply_partitions
from ...problem.partition.span import as_partition
from ...simulate.core import SimResult, simulate_plan
from ..bound import BoundLog, relaxation_bound
from ..config import HeuristicConfig, IlpConfig
from ..heuristic import plan_remat
from ..result import Decisions
from ..scores import sim_over
from .cpsat import Progress, interruptible_solve
from .model import RelaxationModel
from .partitions import PartOption, partition_options
from .structures import Structure, binding_ops, merged_structure, structure


def _bound_by(lower_bound: float | None, mip_bound: float | None) -> str | None:
    """Which method proved the reported bound."""
    if lower_bound is None:
        return None
    return "mip-relaxation" if mip_bound is not None and mip_bound >= lower_bound else "cp-sat"


def plan_ilp(problem: Problem, budget_bytes: int | None, *, seed: int = 0, time_limit: float = 60.0,
             hint: Decisions | None = None, progress: Callable[[float | None, float], None] | None = None,
             partitions: bool = True, work_limit: float | None = None, config: IlpConfig = IlpConfig(),
             heuristic: HeuristicConfig = HeuristicConfig()) -> Decisions:
    """Search the plan space for the cheapest plan the simulator accepts.

    ``time_limit``: wall seconds from this call, model building included. ``work_limit``:
    CP-SAT's deterministic time summed over the rounds; with it, the same inputs and seed
    give the same plan (as long as the wall limit is not reached first). ``config``: the
    search's tuning (CP-SAT's workers, the bound phase's share, the model's sizes);
    ``heuristic``: the greedy repair's.
    """
    t0 = time.perf_counter()
    if budget_bytes is None:
        return Decisions(status="optimal", lower_bound=0.0, notes=["no budget"])
    workers, bound_share = config.workers, config.bound_share
    st = structure(problem, config)
    ops_all, req = binding_ops(problem, budget_bytes)
    if len(ops_all) == 0:
        return Decisions(status="optimal", lower_bound=0.0, objective=0.0,
                         notes=["the budget does not bind: nothing to drop"])
    parts = partition_options(problem, st, budget_bytes) if partitions else []
    most = coverage_delta(problem)
    for po in parts:
        most = most + np.maximum(po.savings, 0)
    if np.any(most[ops_all] < req[ops_all]):
        return Decisions(status="infeasible", lower_bound=None, stats={"proven": True},
                         notes=["even dropping every candidate and partitioning every module cannot meet the budget"])

    cost_unit = max(problem.step_cost / 1e7, 1e-12)
    model = RelaxationModel(problem, st, parts, req, ops_all, cost_unit, config=config)
    for i in ops_all[:config.initial_ops].tolist():
        model.add_op(i)
    incumbent: tuple[Decisions, SimResult] | None = None
    lower_bound: float | None = None
    notes: list[str] = []  # for people (inspect shows them)
    log: list[str] = []  # for the record: the plan's solver.stats["log"]
    status_final = None
    proven_none = False
    timed_out = False
    work_used = 0.0
    rounds = rejected = repaired = 0
    def slack(inc: tuple[Decisions, SimResult]) -> float:
        """What rounding costs down to the unit can take off a plan's cost in the model: under
        one unit per op its groups re-run, per drop and per partition. (One unit per option
        before: 9,875 units on random_layered n250, which called a plan with a 10% gap optimal.)"""
        dec, sim = inc
        return cost_unit * (sum(len(g.ops) for g in sim.groups.values()) + len(dec.drops) + len(dec.partitions) + 1)

    def proves(bound: float | None) -> bool:
        """Does ``bound`` (extra compute) prove the incumbent optimal, to the cost rounding?"""
        return incumbent is not None and bound is not None and incumbent[1].extra_cost <= bound + slack(incumbent)

    # The tightened model constrains every option's rebuild: too slow to build past
    # config.chain_max_options options (forward-only graphs, where the local search finds plans).
    tightened_tried = len(st.sizes) > config.chain_max_options

    def params(solver: cp_model.CpSolver, seconds: float, work: float | None) -> None:
        prm = solver.parameters
        prm.random_seed = seed
        prm.num_workers = workers
        prm.interleave_search = workers > 1
        prm.max_time_in_seconds = max(seconds, 0.01)
        prm.catch_sigint_signal = False  # Ctrl-C ends the command (interruptible_solve), not a round
        if len(model.x) + len(model.z) > config.presolve_dual_max_vars:
            prm.keep_all_feasible_solutions_in_presolve = True  # no dominance detection (above)
        if work is not None:
            prm.max_deterministic_time = max(work, 1e-3)

    def offer(dec: Decisions, sim: SimResult) -> None:
        nonlocal incumbent
        if sim.peak_bytes <= budget_bytes and (incumbent is None or sim.extra_cost < incumbent[1].extra_cost):
            incumbent = (dec, sim)
            model.cutoff(sim.extra_cost)
            if progress is not None:  # (the warm start's too: CP-SAT may find nothing cheaper to report)
                progress(sim.extra_cost, 0.0 if lower_bound is None else min(lower_bound, sim.extra_cost))

    if hint is not None:
        hint_sim, _ = simulate_plan(problem, hint.drops, hint.partitions)
        offer(hint, hint_sim)
        model.forbid_plan(hint)

    def learn(sim: SimResult, parted: Problem, deadline: float | None) -> bool:
        """Constraints valid for every plan at the ops and groups ``sim`` finds over budget,
        in the main model and the bound model; whether any was new."""
        over = sim_over(parted, sim) - budget_bytes
        # A kept dead tensor (_dead_inputs) can put an op over budget that the unplanned step
        # keeps under it: where the model counts kept tensors, such ops get constraints too.
        new = [int(i) for i in np.nonzero(over > 0)[0] if req[i] > 0 or model.held]
        new_main = [i for i in new if i not in model.ops]
        if new_main and model.terms < config.max_terms:
            for i in sorted(new_main, key=lambda i: -over[i])[:64]:
                model.add_op(i)
        groups = sorted(g for g, grp in sim.groups.items() if grp.peak_bytes > budget_bytes)
        # (The bound model may count kept tensors where the main model does not: a merged one.)
        fresh = [int(i) for i in np.nonzero(over > 0)[0] if bmodel is not None and int(i) not in bmodel.ops
                 and (req[i] > 0 or bmodel.held)]
        fresh_groups = [g for g in groups if bmodel is not None and g not in bmodel.groups]
        for r in groups:
            model.add_group(r, budget_bytes, deadline)
        if bmodel is not None:
            for i in fresh:
                bmodel.add_op(i)
            for r in fresh_groups:
                bmodel.add_group(r, budget_bytes, deadline)
        return bool(new_main or fresh or fresh_groups)

    # The bound phase (bound.py): the relaxation at every binding op, solved by a MIP solver,
    # in a cutting-plane loop; its plans are offered, its bound kept. With a work limit, a
    # node limit (not the wall clock) bounds it, so the same inputs give the same result.
    bmodel = None
    mip_bound: float | None = None
    blog = BoundLog()
    # Past config.chain_max_options options (forward-only graphs with every rebuild point) building
    # the bound model alone took more than a 5 s limit allows: there it has one option per
    # gap and cell of rebuild points (merged_structure), or, past that, CP-SAT's bound only.
    bst, merged = st, None
    if problem.every_gap and not parts and len(st.sizes) > config.chain_max_options:
        bst, merged = merged_structure(problem, st, ops_all)
    if bound_share > 0 and len(bst.sizes) <= config.chain_max_options:
        bmodel = RelaxationModel(problem, bst, parts, req, ops_all, cost_unit, merge_revivals=merged is not None,
                                 config=config)
        bmodel.chains = False
        bmodel.first_point = merged
        # Merged (forward-only graphs past config.chain_max_options): CP-SAT's rounds find no plan
        # there (the local search does) and its bound is weaker; the MIP's root cuts need the time.
        share = bound_share if merged is None else max(bound_share, config.merged_bound_share)
        b_deadline = t0 + time_limit * (1.0 if work_limit is not None else share)
        nodes = None if work_limit is None else max(1, int(config.bound_nodes_per_work * work_limit))

        def plan_of(values: dict[int, int]) -> tuple[SimResult, Problem] | None:
            dec = bmodel.decode(lambda v: values[v.Index()])[0]
            try:
                sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
            except PlanError:
                return None
            offer(dec, sim)
            return sim, parted

        def add_cuts(got: tuple[SimResult, Problem]) -> bool:
            sim, parted = got
            return sim.peak_bytes > budget_bytes and learn(sim, parted, b_deadline)

        # Plans cheaper than the incumbent have a model cost below its cost in units (costs
        # are rounded down): HiGHS may prune the rest; the bound is capped there, as below.
        found = relaxation_bound(bmodel, ops_all, b_deadline, plan_of, add_cuts, blog, nodes,
                                 lambda: None if incumbent is None else incumbent[1].extra_cost / cost_unit,
                                 lambda b: proves(b * cost_unit))
        if found is not None:
            mip_bound = found * cost_unit
            lower_bound = mip_bound  # of every plan: no cut, and capped at the incumbent
        log += blog.lines
    while True:
        if proves(lower_bound):
            status_final = "optimal"  # the bound phase proved it
            break
        remaining = time_limit - (time.perf_counter() - t0)
        if remaining <= 0.05 or (work_limit is not None and work_used >= work_limit):
            timed_out = True
            break
        rounds += 1
        solver = cp_model.CpSolver()
        params(solver, remaining, None if work_limit is None else work_limit - work_used)
        code = interruptible_solve(solver, model.model, Progress(
            progress, cost_unit, lambda: None if incumbent is None else incumbent[1].extra_cost),
            deadline=t0 + time_limit)
        work_used += solver.deterministic_time
        if code == cp_model.INFEASIBLE:
            # Every plan not yet simulated either breaks a constraint every accepted plan
            # meets, or costs more than the incumbent: the incumbent is optimal, or no plan exists.
            if incumbent is not None:
                lower_bound = incumbent[1].extra_cost
                status_final = "optimal"
            else:
                proven_none = True
                log.append(f"round {rounds}: no plan of this space is left to try")
            break
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            timed_out = True
            log.append(f"round {rounds}: no model solution within the limit")
            # CP-SAT's bound holds without a solution too (the incumbent covers what was cut).
            bound = solver.BestObjectiveBound() * cost_unit
            if incumbent is not None:
                bound = min(bound, incumbent[1].extra_cost)
            lower_bound = bound if lower_bound is None else max(lower_bound, bound)
            break
        # Valid for every plan not yet simulated; the incumbent covers the simulated ones.
        bound = solver.BestObjectiveBound() * cost_unit
        if incumbent is not None:
            bound = min(bound, incumbent[1].extra_cost)
        lower_bound = bound if lower_bound is None else max(lower_bound, bound)
        dec, chosen, parted_y, revived = model.decode(solver.Value)
        try:
            sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
        except PlanError:  # a rebuild chain that cannot run: rejected, and cut
            model.forbid(chosen, parted_y, revived)
            rejected += 1
            continue
        model.forbid(chosen, parted_y, revived, model.idle_keeps(sim))
        offer(dec, sim)
        if sim.peak_bytes > budget_bytes:
            rejected += 1
            over = sim_over(parted, sim) - budget_bytes
            new = [int(i) for i in np.nonzero(over > 0)[0] if int(i) not in model.ops and req[i] > 0]
            deadline = t0 + time_limit  # constraints left out past it only weaken the relaxation
            learn(sim, parted, deadline)
            # A plan for now: complete the rejected one greedily (never a bound, never a cut).
            fixed = _repair(problem, dec, budget_bytes, deadline, heuristic)
            if fixed is not None:
                repaired += 1
                offer(*fixed)
            elif incumbent is None and not new and not tightened_tried:
                # The excess comes from what the relaxation leaves out (transients, groups):
                # look for a plan in a tightened model, with half of what is left.
                tightened_tried = True
                share = (time_limit - (time.perf_counter() - t0)) / 2
                found, work = _tightened_search(problem, st, parts, req, ops_all, model.ops, budget_bytes, cost_unit,
                                          dec, None, params, share,
                                          None if work_limit is None else (work_limit - work_used) / 2, config)
                work_used += work
                log.append(f"round {rounds}: tightened search " + ("found a plan" if found else "found none"))
                if found is not None:
                    offer(*found)
        if proves(lower_bound):
            status_final = "optimal"
            break
    if timed_out:
        notes.append("CP-SAT stopped at the " + ("work" if work_limit is not None and work_used >= work_limit
                                                   else "time") + " limit: a longer limit may find a cheaper plan")
    stats = {"rounds": rounds, "rejected": rejected, "repaired": repaired, "modelled_ops": len(model.ops),
             "binding_ops": int(len(ops_all)), "candidates": int(len(st.sizes)), "partition_options": len(parts),
             "no_good_cuts": model.cuts, "scaling": model.scale_note, "log": log,
             "bound_by": _bound_by(lower_bound, mip_bound), "bound_rounds": blog.rounds, "mip_bound": mip_bound,
             "work": round(work_used, 3), "timed_out": timed_out, "proven": proven_none}
    if incumbent is None:
        why = ("no plan of this plan space fits: CP-SAT ruled out every one the simulator did not reject"
               if proven_none else "CP-SAT found no plan the simulator accepts within the limit")
        return Decisions(status="infeasible" if proven_none else None, lower_bound=None,
                         notes=notes + [why], stats=stats, timed_out=timed_out)
    dec, sim = incumbent
    # The bound phase's MIP bounds the model's plan space; the incumbent may lie outside it (a
    # warm start from DTR, whose evictions need not be the candidates' gaps) and cost less:
    # the bound of the space and the plans found is the lower of the two.
    if lower_bound is not None:
        lower_bound = min(lower_bound, sim.extra_cost)
    return Decisions(drops=dec.drops, partitions=dec.partitions, status=status_final or "feasible",
                     objective=sim.extra_cost, lower_bound=lower_bound, notes=notes, stats=stats,
                     timed_out=timed_out)


def _tightened_search(problem: Problem, st: Structure, parts: list[PartOption], req: np.ndarray,
                      ops_all: np.ndarray, ops: set[int], budget: int, cost_unit: float, first: Decisions,
                      incumbent_cost: float | None, solver_params: Callable[[cp_model.CpSolver, float, float | None], None],
                      time_limit: float, work_limit: float | None, config: IlpConfig = IlpConfig()
                      ) -> tuple[tuple[Decisions, SimResult] | None, float]:
    """Plan finding only (never a bound, never a proof): starting from a rejected solution,
    raise the requirement at each op the simulator finds over budget by that op's excess and
    constrain each rebuild's own working set, until a solution fits, the model has none, or
    the limit runs out. These tightenings can cut off plans, so the main loop never trusts
    this model's infeasibility. Returns the plan (or None) and CP-SAT's deterministic time."""
    t0 = time.perf_counter()
    work = 0.0
    extra: dict[int, int] = {}
    overheads: dict[int, int] = {}
    dec = first
    while True:
        sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
        if sim.peak_bytes <= budget:
            return (dec, sim), work
        chosen = np.zeros(len(st.sizes), dtype=bool)
        key = {(int(t), int(b)): k for k, (t, b) in enumerate(zip(st.tensor.tolist(), st.b.tolist(), strict=True))}
        for d in dec.drops:
            if (d.tensor, d.remat_before) in key:  # revivals aside
                chosen[key[(d.tensor, d.remat_before)]] = True
        over = sim_over(parted, sim) - budget
        freed = gap_bytes(problem.num_ops, st.a[chosen], st.b[chosen], st.sizes[chosen]) + sum(
            (po.savings for po in parts if as_partition(po.span, po.chunks) in dec.partitions),
            np.zeros(problem.num_ops, np.int64))
        for i in np.nonzero(over > 0)[0].tolist():
            extra[i] = max(extra.get(i, 0), int(freed[i]) + int(over[i]) - int(req[i]))
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05 or (work_limit is not None and work >= work_limit):
            return None, work
        m = RelaxationModel(problem, st, parts, req, ops_all, cost_unit, config=config)
        for i in sorted(ops | set(extra)):
            m.add_op(i, extra.get(i, 0))
        m.add_rebuild_constraints(budget, overheads)
        if incumbent_cost is not None:
            m.cutoff(incumbent_cost)
        solver = cp_model.CpSolver()
        solver_params(solver, left, None if work_limit is None else work_limit - work)
        code = interruptible_solve(solver, m.model, deadline=time.perf_counter() + left)
        work += solver.deterministic_time
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, work
        dec = m.decode(solver.Value)[0]


def _repair(problem: Problem, dec: Decisions, budget: int, deadline: float | None = None,
            heuristic: HeuristicConfig = HeuristicConfig()) -> tuple[Decisions, SimResult] | None:
    """The greedy sweep started from ``dec``'s drops, around its partitions."""
    if deadline is not None and time.perf_counter() > deadline:
        return None
    parted, _ = apply_partitions(problem, dec.partitions)
    fixed = plan_remat(parted, budget, initial=dec.drops, deadline=deadline, config=heuristic)
    fixed.partitions = list(dec.partitions)
    sim, _ = simulate_plan(problem, fixed.drops, fixed.partitions)
    return (fixed, sim) if sim.peak_bytes <= budget else None


