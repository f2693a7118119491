"""Lower bounds of the whole plan space, from a MIP solver on the ILP's own relaxation.

CP-SAT proves bounds slowly on the recorded transformers (covering constraints with byte
coefficients: at its time limit its best bound was 25-73% below the plan's cost). A MIP
solver (HiGHS, shipped with OR-Tools) proves them from the LP relaxation with cuts and
branching, which is what these models need. Its model is *the same* CP-SAT model
(:class:`~taichi_plan.solve.ilp.model.RelaxationModel`, so every kind of option the builder knows flows
through), translated constraint by constraint (:func:`mip_of`):

* a linear constraint ``lo <= expr <= hi`` enforced by literals ``e``: the big-M form
  ``expr >= lo - (lo - min(expr)) * sum(1 - e)`` (and the same for ``hi``), exact for 0/1
  literals; a constraint on several disjoint intervals keeps only its hull (a relaxation);
* ``bool_or``, ``bool_and``, ``at_most_one``, ``exactly_one``: their linear forms.

The model holds memory constraints at *every* binding op (one per stretch of ops with the
same covering set, :func:`~taichi_plan.solve.ilp.structures.binding_ops`) and at the recompute groups
the simulator found over budget, all valid for every plan the simulator accepts (the ILP's
invariant), but neither the no-good cuts nor the cutoff at the incumbent: its dual bound
(what HiGHS proves, also when stopped by its limit) is a lower bound on every plan of the
space. It is then a cutting-plane loop: the relaxation's optimum is simulated; ops and groups
the simulator finds over budget get their constraints and the relaxation is solved again; a
plan that fits is offered as a plan, and is optimal when its simulated cost meets the bound.

A MIP solver works in floating point: the bound is lowered by :data:`SAFETY` of itself plus
one cost unit before it is used, far more than HiGHS's feasibility tolerances can move it on
these models (coefficients are integers below 2^40).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SAFETY = 1e-6  # relative, plus one cost unit: see the module docstring
INT_MAX = 2**62
_KINDS = ("linear", "bool_or", "bool_and", "at_most_one", "exactly_one")


@dataclass
class MipResult:
    bound: float | None  # proven lower bound on the objective, in model units (None: nothing proven)
    values: dict[int, int] | None  # an optimal or best solution: CP-SAT variable index -> value
    optimal: bool
    seconds: float


def _hull(domain) -> tuple[int, int]:
    """(min, max) of a CP-SAT domain (a flat list of interval ends)."""
    d = list(domain)
    return int(d[0]), int(d[len(d) - 1])


def mip_of(proto, deadline: float | None = None):
    """A MIP of ``proto`` (a ``CpModelProto``): the same integer variables (variable ``i`` of
    ``proto`` is the ``mathopt`` variable of id ``i``), the linear forms of its constraints
    (see the module docstring), and its objective; None when ``deadline`` (perf_counter) passes
    while translating. The model is written as a ``ModelProto`` in
    bulk and read by the solver's C++ side: built term by term through ``mathopt``'s Python
    objects, ``random_layered`` n250's bound model (61k constraints) took 9 s to translate."""
    from ortools.math_opt import model_pb2
    from ortools.math_opt.python import mathopt  # here: the GPU check's stand-in has only cp_model

    inf = math.inf
    bounds = [_hull(v.domain) for v in proto.variables]
    rows_lo: list[float] = []
    rows_hi: list[float] = []
    row_ids: list[int] = []
    col_ids: list[int] = []
    coefs: list[float] = []

    def lit(ref: int) -> tuple[float, int, float]:
        """(coefficient, variable index, constant) of a literal: x or 1 - x."""
        return (1.0, ref, 0.0) if ref >= 0 else (-1.0, -ref - 1, 1.0)

    def row(terms: dict[int, float], lo: float, hi: float) -> None:
        r = len(rows_lo)
        rows_lo.append(lo)
        rows_hi.append(hi)
        for v in sorted(terms):
            c = terms[v]
            if c != 0.0:
                row_ids.append(r)
                col_ids.append(v)
                coefs.append(c)

    def add(terms: list[tuple[float, int]], const: float, lo: float, hi: float, enforce) -> None:
        """lo <= sum(terms) + const <= hi, when every literal of ``enforce`` is true."""
        mn = const + sum(c * bounds[v][0 if c > 0 else 1] for c, v in terms)
        mx = const + sum(c * bounds[v][1 if c > 0 else 0] for c, v in terms)
        off = [(-c, v, 1.0 - k) for c, v, k in map(lit, enforce)]  # sum of (1 - e): 0 when enforced
        off_const = sum(k for _c, _v, k in off)

        def relaxed(m: float) -> dict[int, float]:
            """The terms plus ``m`` times the sum of (1 - e), per variable."""
            acc: dict[int, float] = {}
            for c, v in terms:
                acc[v] = acc.get(v, 0.0) + c
            for c, v, _k in off:
                acc[v] = acc.get(v, 0.0) + m * c
            return acc

        if lo > mn:
            m = lo - mn
            row(relaxed(m), lo - const - m * off_const, inf)
        if hi < mx:
            m = mx - hi
            row(relaxed(-m), -inf, hi - const + m * off_const)

    def lits_sum(refs) -> tuple[list[tuple[float, int]], float]:
        got = [lit(r) for r in refs]
        return [(c, v) for c, v, _k in got], sum(k for _c, _v, k in got)

    for n, ct in enumerate(proto.constraints):
        if deadline is not None and n % 256 == 0 and time.perf_counter() > deadline:
            return None
        kind = next((k for k in _KINDS if getattr(ct, f"has_{k}")()), None)
        enforce = list(ct.enforcement_literal)
        if kind == "linear":
            lin = ct.linear
            dom = list(lin.domain)
            lo, hi = dom[0], dom[-1]
            terms = list(zip(map(float, lin.coeffs), lin.vars))
            add(terms, 0.0, lo if lo > -INT_MAX else -inf, hi if hi < INT_MAX else inf, enforce)
        elif kind == "bool_or":
            add(*lits_sum(ct.bool_or.literals), 1.0, inf, enforce)
        elif kind == "bool_and":
            for r in ct.bool_and.literals:
                add(*lits_sum([r]), 1.0, inf, enforce)
        elif kind == "at_most_one":
            add(*lits_sum(ct.at_most_one.literals), -inf, 1.0, enforce)
        elif kind == "exactly_one":
            add(*lits_sum(ct.exactly_one.literals), 1.0, 1.0, enforce)
        # any other kind is left out: that keeps a relaxation
    mp = model_pb2.ModelProto()
    n_vars = len(bounds)
    mp.variables.ids.extend(range(n_vars))
    mp.variables.lower_bounds.extend(float(lo) for lo, _hi in bounds)
    mp.variables.upper_bounds.extend(float(hi) for _lo, hi in bounds)
    mp.variables.integers.extend([True] * n_vars)
    mp.linear_constraints.ids.extend(range(len(rows_lo)))
    mp.linear_constraints.lower_bounds.extend(rows_lo)
    mp.linear_constraints.upper_bounds.extend(rows_hi)
    mp.linear_constraint_matrix.row_ids.extend(row_ids)  # row-major, columns sorted in each row
    mp.linear_constraint_matrix.column_ids.extend(col_ids)
    mp.linear_constraint_matrix.coefficients.extend(coefs)
    obj: dict[int, float] = {}
    for v, c in zip(proto.objective.vars, proto.objective.coeffs, strict=True):
        obj[int(v)] = obj.get(int(v), 0.0) + float(c)
    ids = sorted(v for v, c in obj.items() if c != 0.0)
    mp.objective.linear_coefficients.ids.extend(ids)
    mp.objective.linear_coefficients.values.extend(obj[v] for v in ids)
    mp.objective.offset = float(proto.objective.offset)
    return mathopt.Model.from_model_proto(mp)


@contextlib.contextmanager
def quiet_stdout():
    """The process's standard output (file descriptor 1) goes nowhere while the block runs:
    HiGHS prints "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();"
    from C++ whatever its output options say (ERGO-Code/HiGHS#2783), into the middle of what
    ``solve`` prints (and of a report redirected to a file). Nothing else writes there while
    the solver runs: this thread waits in it."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no standard output to protect
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def solve_mip(proto, time_limit: float, node_limit: int | None = None, cutoff: float | None = None) -> MipResult:
    """Solve the MIP form of ``proto`` with HiGHS within ``time_limit`` wall seconds (and
    ``node_limit`` branch-and-bound nodes: a limit that does not depend on the load).

    ``cutoff``: HiGHS prunes every solution whose objective is not below it (its
    ``objective_bound``), and the bound returned is at most it: a lower bound on every
    solution below the cutoff, and so, capped there, on every solution (the caller's
    incumbent, whose cost is the cutoff, covers the rest). With the incumbent's cost as the
    cutoff, HiGHS fixes by reduced cost from the start: the first round on
    ``random_layered`` n250 at 0.9 was solved in 4.7 s instead of 20.5 s."""
    from ortools.math_opt.python import mathopt
    from ortools.math_opt.solvers import highs_pb2

    t0 = time.perf_counter()
    model = mip_of(proto, t0 + time_limit)
    if model is None:
        return MipResult(None, None, False, time.perf_counter() - t0)
    highs = highs_pb2.HighsOptionsProto(double_options={"objective_bound": float(cutoff)}) if cutoff is not None \
        else highs_pb2.HighsOptionsProto()
    params = mathopt.SolveParameters(time_limit=dt.timedelta(seconds=max(time_limit - (time.perf_counter() - t0),
                                                                         0.01)),
                                     node_limit=node_limit, random_seed=0, highs=highs)
    with quiet_stdout():
        res = mathopt.solve(model, mathopt.SolverType.HIGHS, params=params)
    seconds = time.perf_counter() - t0
    reason = res.termination.reason
    if reason == mathopt.TerminationReason.INFEASIBLE:  # (with a cutoff: nothing below it)
        return MipResult(math.inf if cutoff is None else cutoff - SAFETY * abs(cutoff) - 1.0, None, True, seconds)
    dual = res.termination.objective_bounds.dual_bound
    if cutoff is not None:
        dual = min(dual, cutoff)
    bound = None if not math.isfinite(dual) else dual - SAFETY * abs(dual) - 1.0
    values = None
    if res.has_primal_feasible_solution():
        values = {v.id: int(round(x)) for v, x in res.variable_values().items()}
    return MipResult(bound, values, reason == mathopt.TerminationReason.OPTIMAL, seconds)


@dataclass
class BoundLog:
    rounds: int = 0
    lines: list[str] = field(default_factory=list)


def relaxation_bound(model, ops_all: np.ndarray, deadline: float,
                     plan_of: Callable[[dict[int, int]], object | None],
                     add_cuts: Callable[[object], bool], log: BoundLog, node_limit: int | None = None,
                     cutoff: Callable[[], float | None] | None = None,
                     proven: Callable[[float], bool] | None = None) -> float | None:
    """The cutting-plane loop of the module docstring on ``model`` (a fresh ILP relaxation):
    returns the best proven lower bound (model units) or None. ``plan_of(values)`` simulates
    the relaxation's solution (and offers it as a plan); ``add_cuts(sim)`` adds the
    constraints its excess calls for and says whether any was new. ``cutoff()``: the
    incumbent's cost in model units, or None (see :func:`solve_mip`): the bound returned is
    then at most it. ``proven(bound)``: whether that bound proves the incumbent optimal (to
    the cost rounding); the loop stops there."""
    best = None
    for i in ops_all.tolist():
        if time.perf_counter() > deadline:
            break
        model.add_op(i)
    while True:
        left = deadline - time.perf_counter()
        if left <= 0.05:
            return best
        log.rounds += 1
        res = solve_mip(model.model.Proto(), left, node_limit, None if cutoff is None else cutoff())
        log.lines.append(f"bound round {log.rounds}: MIP {'optimal' if res.optimal else 'stopped'}, bound {res.bound}")
        if res.bound is not None:
            best = res.bound if best is None else max(best, res.bound)
        if res.values is None or (best is not None and proven is not None and proven(best)):
            return best
        sim = plan_of(res.values)  # offered as a plan, optimal or not
        if not res.optimal or sim is None or not add_cuts(sim):
            return best
