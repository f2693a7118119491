"""Solving against a budget on *reserved* bytes (``solve --on reserved``).

The planners meet a budget on the bytes the simulator counts (allocated tensor bytes); a GPU
runs out of memory on the bytes the caching allocator reserves, which the allocator model
(:mod:`taichi_plan.simulate.allocator`) predicts for every plan. To meet a reserved budget ``B``: solve
for ``B`` allocated; while the plan's reserved peak ``R`` exceeds ``B``, lower the allocated
target by the excess ``R - B`` and solve again, until the reserved peak fits, the target cannot
be met at all, or the rounds run out. Every plan is still judged by the simulator and the
allocator model; nothing here estimates a peak of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..base.errors import InfeasibleBudgetError
from ..base.units import format_bytes
from ..plan.format import Plan
from .config import ReservedConfig


def solve_on_reserved(solve_allocated: Callable[[int], Plan], budget_bytes: int, method: str,
                      config: ReservedConfig = ReservedConfig()) -> Plan:
    """The plan whose predicted reserved peak fits ``budget_bytes``.

    ``solve_allocated(target)`` returns a plan for an allocated budget ``target`` (or raises
    :class:`InfeasibleBudgetError`). Raises :class:`InfeasibleBudgetError` when no round's plan
    fits, naming the lowest reserved peak reached. ``config.max_rounds``: the solves at most.
    """
    max_rounds = config.max_rounds
    t0 = time.perf_counter()
    target = budget_bytes
    met = None  # the lowest target a plan met (its reserved peak was over)
    unmet = 0  # the highest target no plan met
    rounds: list[dict] = []
    best: Plan | None = None
    why_stop = f"{max_rounds} rounds did not get there"
    for _ in range(max_rounds):
        try:
            plan = solve_allocated(target)
        except InfeasibleBudgetError as e:
            unmet = max(unmet, target)
            rounds.append({"allocated_target_bytes": int(target), "planned_peak_bytes": None,
                           "planned_reserved_peak_bytes": None})
            why_stop = (f"no {method} plan fits an allocated budget of {format_bytes(target)} "
                        f"(the lowest the planner is known to meet is {format_bytes(e.min_budget_bytes or 0)})")
            if met is None or met - unmet <= max(1, met // 1000):
                break
            target = (met + unmet) // 2
            continue
        met = target if met is None else min(met, target)
        reserved = int(plan.predicted["planned_reserved_peak_bytes"])
        rounds.append({"allocated_target_bytes": int(target), "planned_peak_bytes": int(plan.predicted["planned_peak_bytes"]),
                       "planned_reserved_peak_bytes": reserved})
        if best is None or reserved < best.predicted["planned_reserved_peak_bytes"]:
            best = plan
        if reserved <= budget_bytes:
            plan.solver["wall_s"] = time.perf_counter() - t0  # every round's solve
            return _on_reserved(plan, budget_bytes, target, rounds)
        # Lower what the plan really allocates (it may sit well under its target) by the excess.
        target = min(target, int(plan.predicted["planned_peak_bytes"])) - (reserved - budget_bytes)
        if target <= unmet:
            target = (met + unmet) // 2
        if target <= 0 or target >= met:
            why_stop = "the allocated target cannot go lower"
            break
    lowest = int(best.predicted["planned_reserved_peak_bytes"]) if best is not None else None
    reach = (f" The lowest reserved peak reached was {format_bytes(lowest)} ({lowest} bytes): ask for at least "
             "that, try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (less fragmentation), or reduce the "
             "batch size." if lowest is not None else " Ask for a larger budget or reduce the batch size.")
    tried = "; ".join(f"{format_bytes(r['allocated_target_bytes'])} allocated -> " +
                      (f"{format_bytes(r['planned_reserved_peak_bytes'])} reserved"
                       if r["planned_reserved_peak_bytes"] is not None else "no plan") for r in rounds)
    raise InfeasibleBudgetError(
        f"No {method} plan keeps the predicted reserved peak within {format_bytes(budget_bytes)} "
        f"({budget_bytes} bytes): {why_stop}." + (f" Rounds: {tried}." if tried else "") + reach +
        " No plan file was written.",
        min_budget_bytes=lowest, op_id=None,
        planned_peak_bytes=int(best.predicted["planned_peak_bytes"]) if best is not None else None)


def _on_reserved(plan: Plan, budget_bytes: int, target: int, rounds: list[dict]) -> Plan:
    """Restate ``plan`` (solved for ``target`` allocated) as the plan for ``budget_bytes`` reserved."""
    plan.budget_bytes = budget_bytes
    s = plan.solver
    s["budget_on"] = "reserved"
    s["stats"] = {**(s.get("stats") or {}), "reserved_rounds": rounds}
    if target != budget_bytes:
        # A bound proven for a lower allocated target does not bound plans for this budget
        # (their allocated peak may be anywhere up to it): drop it rather than overstate.
        s["lower_bound"] = None
        s["gap"] = None
        if s.get("status") == "optimal":
            s["status"] = "feasible"
        s["notes"] = [*(s.get("notes") or []),
                      f"solved for {format_bytes(target)} allocated, so that the predicted reserved peak "
                      f"({format_bytes(plan.predicted['planned_reserved_peak_bytes'])}) fits the budget "
                      f"(round {len(rounds)})"]
    return plan
