"""Every plan the simulator accepts satisfies the ILP relaxation (forward-only graphs).

``test_ilp_exhaustive.py`` checks that no bound is above the exhaustive optimum; this checks
the relaxation itself, plan by plan: on small random traces in the imported space (every gap,
any rebuild point, revivals), and on small graphs whose tensors have many uses
(``synthetic.many_use_graph``, as ``random_layered``: rebuilds whose dead inputs are kept,
revived or re-made in turn), the CP-SAT model with every op and every recompute group
modelled, its decisions (``x``, ``z``) fixed to those of a plan that fits, must have a
solution whose objective is at most the plan's simulated cost; so must the bound model of
graphs with many rebuild points (one option per gap and cell), each plan's options replaced
by those of their cells. A constraint that cuts a
feasible plan (say, one that counts a tensor as back in memory too early) fails here even
where it does not move the optimum. The last test makes the model one byte too strict on
purpose and checks that this catches it.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from ortools.sat.python import cp_model
from synthetic import many_use_graph, random_training_trace
from test_ilp_exhaustive import MAX_PLANS, plan_options

from taichi_plan.base.errors import PlanError
from taichi_plan.problem.core import build_problem
from taichi_plan.simulate.core import Drop, simulate_plan
from taichi_plan.solve.ilp import model as ilp_model
from taichi_plan.solve.ilp import structures as ilp_structure

SEEDS = range(400)  # the whole check (make bench: 34 s on an idle core)
# make test's share (about 9 s): the first 150 traces, and 258, the one of the 400 whose plans
# bring a dropped tensor back early through a re-made reader (138 of them)
QUICK_SEEDS = [*range(150), 258]
# Graphs whose tensors have many uses (synthetic.many_use_graph, as random_layered): rebuilds
# read dead inputs that are kept, revived or re-made in turn
# (ilp_dead_inputs.DeadInputsMixin._dead_inputs, there).
MANY_USE_SEEDS = range(60)  # make bench
QUICK_MANY_USE_SEEDS = range(12)  # make test (about 3 s; seed 13 alone has 3,600 fitting plans)
MOST_PLANS = 400  # fitting plans checked per (trace, budget)


def _imported(seed: int, many_use: bool = False):
    if many_use:
        return build_problem(many_use_graph(random.Random(seed)))
    trace = random_training_trace(random.Random(seed))
    trace.meta["mode"] = "imported"
    trace.ops["phase"] = "forward"
    return build_problem(trace)


def _plans(problem):
    """(drops, simulated peak, cost) of every executable plan of the space."""
    o = plan_options(problem)
    per: dict[int, list[int]] = {}
    for k in range(len(o)):
        per.setdefault(int(o.cand[k]), []).append(k)
    out = []
    for combo in itertools.product(*[[None, *ks] for ks in per.values()]):
        drops = [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k])) for k in combo if k is not None]
        try:
            sim, _ = simulate_plan(problem, drops)
        except PlanError:
            continue
        out.append((drops, sim.peak_bytes, sim.extra_cost))
    return out


def _violations(seed: int, chains: bool, merged: bool = False, many_use: bool = False) -> tuple[int, int, list[str]]:
    """(plans checked, plans whose tensor a reader brings back early, failures). ``merged``:
    the bound model of many-option graphs (one option per gap and cell of rebuild points,
    ``ilp_structure.merged_structure`` and ``ilp_structure.merged_revivals``), each plan's option
    and revival replaced by the one of its cell. ``many_use``: the trace of ``seed`` is a
    :func:`synthetic.many_use_graph`."""
    problem = _imported(seed, many_use)
    o = plan_options(problem)
    if math.prod(1 + int(x) for x in np.bincount(o.cand).tolist()) > MAX_PLANS:
        return 0, 0, []
    plans = _plans(problem)
    if not plans:
        return 0, 0, []
    base = problem.baseline_peak[0]
    least = min(pk for _d, pk, _c in plans)
    checked = early = 0
    failures = []
    st = ilp_structure.structure(problem)
    for budget in sorted({least, least + 1, (least + base) // 2, int(base * 0.9)}):
        if budget >= base:
            continue
        ops_all, req = ilp_structure.binding_ops(problem, budget)
        if len(ops_all) == 0:
            continue
        unit = max(problem.step_cost / 1e7, 1e-12)
        mst, flags = ilp_structure.merged_structure(problem, st, ops_all) if merged else (st, None)
        model = ilp_model.RelaxationModel(problem, mst, [], req, ops_all, unit, merge_revivals=merged)
        model.chains = chains
        model.first_point = flags
        cuts = np.asarray(sorted({int(i) + 1 for i in ops_all.tolist()} | {problem.num_ops}))

        def cell(point: int, cuts: np.ndarray = cuts) -> int:
            return int(np.searchsorted(cuts, point, side="right")) if merged else point
        for i in range(problem.num_ops):
            model.add_op(i)
        for r in range(1, problem.num_ops):
            model.add_group(r, budget)
        key = {(int(t), int(a), cell(int(b))): k for k, (t, a, b) in
               enumerate(zip(mst.tensor.tolist(), mst.a.tolist(), mst.b.tolist(), strict=True))}
        rv = model.rv
        rkey = {(int(t), int(a), -1 if b == problem.end[t] + 1 else cell(int(b))): j for j, (t, a, b) in
                enumerate(zip(rv.tensor.tolist(), rv.free_after.tolist(), rv.remat_before.tolist(), strict=True))}
        full = {(int(t), int(a), int(b)) for t, a, b in zip(st.tensor.tolist(), st.a.tolist(), st.b.tolist(),
                                                            strict=True)}
        fitting = [(d, c) for d, pk, c in plans if pk <= budget][:MOST_PLANS]
        for drops, cost in fitting:
            sim, _ = simulate_plan(problem, drops)
            fixed = model.model.Clone()
            gap = [d for d in drops if (d.tensor, d.free_after, d.remat_before) in full]
            rev = [d for d in drops if (d.tensor, d.free_after, d.remat_before) not in full]
            on_x = {key[(d.tensor, d.free_after, cell(d.remat_before))] for d in gap}
            on_z = {rkey[(d.tensor, d.free_after, -1 if d.remat_before == problem.end[d.tensor] + 1
                          else cell(d.remat_before))] for d in rev}
            for k, v in enumerate(model.x):
                fixed.Add(v == (1 if k in on_x else 0))
            for j, v in enumerate(model.z):
                fixed.Add(v == (1 if j in on_z else 0))
            fixed.Add(model.objective <= int(math.floor(cost / unit)) + len(st.sizes) + 1)
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            solver.parameters.max_time_in_seconds = 10.0
            code = solver.Solve(fixed)
            checked += 1
            early += any(sim.remat_at_drop.get((d.tensor, d.free_after), d.remat_before) < d.remat_before
                         for d in gap)
            if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                failures.append(f"seed {seed}{' (many uses)' if many_use else ''}, budget {budget}, chains {chains}, "
                                f"merged {merged}: the plan {drops} "
                                f"(cost {cost}) "
                                f"is cut ({solver.StatusName(code)})")
    return checked, early, failures


def _check(seeds, many_use: bool = False) -> tuple[int, int]:
    checked = early = 0
    failures = []
    for seed in seeds:
        for chains, merged in ((False, False), (True, False), (False, True)):
            c, e, f = _violations(seed, chains, merged, many_use)
            checked, early, failures = checked + c, early + e, failures + f
    assert not failures, "\n".join(failures[:10])
    print(f"{checked} plans checked, {early} with a tensor brought back early")
    assert checked >= 500, checked
    return checked, early


def test_every_fitting_plan_satisfies_the_relaxation():
    _checked, early = _check(QUICK_SEEDS)
    assert early >= 20, early  # plans whose tensor a reader brings back early (the early[q] rule)


@pytest.mark.bench
def test_every_fitting_plan_of_400_traces_satisfies_the_relaxation():
    _check(SEEDS)


def test_every_fitting_plan_of_many_use_graphs_satisfies_the_relaxation():
    _check(QUICK_MANY_USE_SEEDS, many_use=True)


@pytest.mark.bench
def test_every_fitting_plan_of_60_many_use_graphs_satisfies_the_relaxation():
    _check(MANY_USE_SEEDS, many_use=True)


def test_a_constraint_one_byte_too_strong_is_caught(monkeypatch):
    """The check has teeth: with every op's requirement one byte above the true excess, some
    plan at the least reachable budget is cut."""
    add_op = ilp_model.RelaxationModel.add_op
    monkeypatch.setattr(ilp_model.RelaxationModel, "add_op", lambda self, i, extra=0: add_op(self, i, extra + 1))
    assert any(_violations(seed, False)[2] for seed in SEEDS[:60])
