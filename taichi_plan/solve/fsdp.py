"""FSDP2's ``reshard_after_forward`` per unit, decided together with the activation plan.

A unit that does not reshard after forward keeps its gathered parameters from the end of its
forward to its backward (memory), and skips its backward all-gather and copy-out (time on the
interconnect). :mod:`taichi_plan.reshard` derives that step from the recorded one. Here the
planner picks the setting: it orders the units by what keeping them gathered costs where the
budget binds (their unsharded bytes times the ops, in that interval, at which the unplanned
step is over the budget), per second of gathering saved, and screens each prefix of that order
(the recorded setting first) with the heuristic: the predicted step time, i.e. the step's
compute and communication plus the plan's extra compute, of the cheapest plan that fits the
budget picks the setting. The chosen method (CP-SAT for ``auto``) then plans that setting.

The search is over settings, outside the activation model (a setting changes the op sequence,
which the ILP indexes): the setting is chosen by the heuristic's plans, the activations of the
chosen one by the method asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..errors import InfeasibleBudgetError
from ..plan import Plan
from ..problem import Problem
from ..reshard import held_bytes, regather_cost, reshard_problem, reshard_units
from ..simulate import simulate_plan
from ..units import format_bytes, format_cost
from .heuristic import plan_heuristic

SCREEN_SHARE = 1 / 3  # of the time left, for screening the settings with the heuristic


def unit_order(problem: Problem, budget_bytes: int) -> list[int]:
    """The units a plan may stop resharding, cheapest first: bytes kept gathered times the ops
    of that interval at which the unplanned step is over ``budget_bytes`` (0 where the budget
    does not bind there), per second of backward gathering saved; ties by that time, more first."""
    over = problem.baseline_live > budget_bytes
    cum = np.concatenate([[0], np.cumsum(over)])
    keys = []
    for k in reshard_units(problem.trace.meta):
        size, lo, hi = held_bytes(problem, k)
        saved = regather_cost(problem, k)
        if size <= 0 or saved <= 0:
            continue
        binding = int(cum[hi] - cum[lo]) if hi > lo else 0
        keys.append((size * binding / saved, -saved, k))
    return [k for *_, k in sorted(keys)]


def screen(problem: Problem, budget_bytes: int, seed: int, deadline: float) -> tuple[list[int], list[dict]]:
    """The setting (units not resharding) whose heuristic plan fits ``budget_bytes`` with the
    least predicted step time, among the prefixes of :func:`unit_order`; and what each setting
    screened gave (``[{"units", "fits", "peak_bytes", "step_compute", "extra_compute"}]``)."""
    order = unit_order(problem, budget_bytes)
    tried = []
    best: tuple[float, int] | None = None
    best_units: list[int] = []
    for j in range(len(order) + 1):
        if j > 0 and time.perf_counter() > deadline:
            break
        units = sorted(order[:j])
        prob = reshard_problem(problem, units)
        if prob.baseline_peak[0] <= budget_bytes:
            peak, extra = prob.baseline_peak[0], 0.0
        else:
            dec = plan_heuristic(prob, budget_bytes, seed=seed, time_limit=max(deadline - time.perf_counter(), 0.1))
            sim, _ = simulate_plan(prob, dec.drops, dec.partitions)
            peak, extra = sim.peak_bytes, sim.extra_cost
        fits = peak <= budget_bytes
        tried.append({"units": units, "fits": fits, "peak_bytes": int(peak), "step_compute": prob.step_cost,
                      "extra_compute": extra})
        total = prob.step_cost + extra
        if fits and (best is None or total < best[0]):
            best, best_units = (total, j), units
    return best_units, tried


def solve_with_reshard(problem: Problem, budget_bytes: int, seed: int, time_limit: float, started: float,
                       solve_step: Callable[[Problem], Plan]) -> Plan:
    """Choose the units that stop resharding (:func:`screen`), then plan that setting with
    ``solve_step`` (the method asked for); the recorded setting when no other fits better."""
    end = started + time_limit
    deadline = time.perf_counter() + max(end - time.perf_counter(), 0.0) * SCREEN_SHARE
    units, tried = screen(problem, budget_bytes, seed, deadline)
    plan = None
    if units:
        try:
            plan = solve_step(reshard_problem(problem, units))
        except InfeasibleBudgetError:
            plan = None  # the method could not plan it: the recorded setting (its error if none fits)
    if plan is None:
        units = []
        plan = solve_step(problem)
    unit = problem.trace.cost_unit
    names = [u["module"] or "<root>" for u in problem.trace.meta["fsdp"]["units"]]
    if units:
        saved = plan.reshard["step_compute_saved"]
        note = (f"FSDP units {', '.join(names[k] for k in units)} do not reshard after forward: keeping "
                f"{format_bytes(sum(held_bytes(problem, k)[0] for k in units))} gathered saves "
                f"{format_cost(saved, unit)} of backward all-gathers, for {format_cost(plan.solver['extra_compute'], unit)} "
                f"of recomputation ({len(tried)} setting(s) screened)")
    else:
        note = (f"every FSDP unit reshards after forward as recorded: of {len(tried)} setting(s) screened, no "
                "other fits the budget in less predicted time")
    plan.solver["notes"].insert(0, note)
    plan.solver.setdefault("stats", {})["reshard_screen"] = tried
    if plan.reshard is not None:
        plan.reshard["chosen_by"] = "auto"
    return plan
