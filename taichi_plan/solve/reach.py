"""The least peak a problem's plans reach: a bisection over budgets with the heuristic (cached on
the problem), and the same search for any planner (``least_reached``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from ..problem.core import Problem
from ..problem.partition.floor import floor_bytes
from ..simulate.core import simulate_plan
from .config import SolverConfig
from .heuristic import plan_heuristic
from .result import Decisions


def lowest_reachable_peak(problem: Problem) -> tuple[int, int]:
    """(peak bytes, op) of the lowest budget the heuristic is known to meet."""
    peak, op, _asked = lowest_reachable(problem)
    return peak, op


def lowest_reachable(problem: Problem, steps: int = 7, deadline: float | None = None,
                     config: SolverConfig = SolverConfig()) -> tuple[int, int, int]:
    """(peak, op, budget asked) of the best plan the heuristic finds when bisecting between the
    floor no plan can pass and the baseline peak; no new step starts past ``deadline``
    (perf_counter). Cached on the problem when complete (with the ``config`` of that call)."""
    cached = getattr(problem, "_lowest_reachable", None)
    if cached is None:
        found, complete = _bisect_heuristic(problem, steps, deadline, config=config)
        if not complete:
            return found
        cached = problem._lowest_reachable = found
    return cached


def _bisect_heuristic(problem: Problem, steps: int, deadline: float | None,
                      planner: Callable[[Problem, int], Decisions] | None = None,
                      config: SolverConfig = SolverConfig()) -> tuple[tuple[int, int, int], bool]:
    """Bisect ``planner``'s budget (None: the heuristic, its local search bounded per step by an
    equal share of the time left to ``deadline``, at least ``config.time.bisect_local_max_s``, at most
    ``config.heuristic.local_max_s``) between the floor and the baseline peak: ((peak, op,
    budget asked) of the lowest-peak plan that fit its budget, whether the search completed)."""
    lo = int(floor_bytes(problem).max())
    hi, hi_op = problem.baseline_peak
    best = (hi, hi_op, hi)
    for i in range(steps):
        if hi - lo <= max(1, hi // 1000):
            break
        now = time.perf_counter()
        if deadline is not None and now > deadline:
            return best, False
        mid = (lo + hi) // 2
        # each step's local search may take its share of the time left (what earlier steps did not
        # use included), at least bisect_local_max_s, at most local_max_s: a recorded step's search
        # takes seconds to reach a budget
        share = 0.0 if deadline is None else (deadline - now) / (steps - i)
        bisecting = dataclasses.replace(config.heuristic, local_max_s=min(config.heuristic.local_max_s,
                                                                      max(config.time.bisect_local_max_s, share)))
        if planner is None:
            dec = plan_heuristic(problem, mid, time_limit=60.0 if deadline is None else deadline - time.perf_counter(),
                                 config=bisecting)
        else:
            dec = planner(problem, mid)
        sim, _ = simulate_plan(problem, dec.drops, dec.partitions)
        if sim.peak_bytes <= mid:
            hi, best = sim.peak_bytes, (sim.peak_bytes, sim.peak_op, mid)
            if planner is None:  # kept: a budget above it has a plan if the time runs out (solve)
                problem.__dict__["_reached_plan"] = (sim.peak_bytes, dec)
        else:
            lo = mid + 1
    return best, True


def least_reached(problem: Problem, planner: Callable[[Problem, int], Decisions], steps: int = 7
                  ) -> tuple[int, int, int]:
    """(peak, op, budget asked) of the lowest peak ``planner`` (any ``planner(problem,
    budget_bytes) -> Decisions``) is known to meet, by the bisection :func:`lowest_reachable`
    runs for the heuristic (not cached)."""
    return _bisect_heuristic(problem, steps, None, planner)[0]
