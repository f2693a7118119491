"""Planners: ours (``auto``, ``ilp``, ``heuristic``) and the baselines, one entry point.

Every planner returns :class:`~taichi_plan.solve.result.Decisions`; :func:`solve` turns
them into a :class:`~taichi_plan.plan.format.Plan` judged by the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np

from ..base.deadline import OutOfTime, check, lifted, until
from ..base.errors import InfeasibleBudgetError, UsageError
from ..base.units import format_bytes
from ..plan.format import Plan
from ..problem.core import Problem, build_problem, describe_op, min_live_bytes
from ..problem.optimizer.plan import (
    OPTION_ORDER,
    WORDS,
    check_choice,
    choose_groups,
    floor_parts,
    optimizer_note,
    recorded_problem,
    refusal,
    view_problem,
)
from ..problem.partition.find import state_keepers
from ..problem.partition.floor import floor_bytes
from ..problem.partition.qualify import allow_random
from ..problem.sharding.prefetch import movable
from ..problem.sharding.reshard import reshard_units
from ..simulate.allocator import AllocatorConfig
from ..simulate.core import simulate_plan
from ..trace.format import Trace, data_sized_note, own_checkpointing
from .fsdp import solve_with_fsdp
from .heuristic import best_by_simulator, plan_heuristic
from .ilp import plan_ilp
from .result import Decisions, make_plan

OURS = ("auto", "ilp", "heuristic")
RESHARD_CHOICES = ("auto", "as-recorded")  # FSDP units' reshard_after_forward (taichi_plan/solve/fsdp.py)
PREFETCH_CHOICES = ("auto", "as-recorded")  # FSDP2's prefetching (taichi_plan/problem/sharding/prefetch.py, solve/fsdp.py)


def baseline_table() -> dict[str, Callable]:
    from .baselines import BASELINES

    return BASELINES


def methods() -> list[str]:
    return [*OURS, *baseline_table()]


MIN_TIME_LIMIT_S = 5.0  # the time limit is honoured within 10% for limits at least this long
FINISH_SHARE = 0.05  # of the time limit, kept for simulating the chosen plan and writing it
# Of the time limit, kept after the optimizer options are screened (their views of the step, floors)
# for saying what the heuristic reaches when no plan was found.
REPORT_SHARE = 0.15
# Share of the warm start's time the heuristic's bisection may take when no warm start fits
# (_warm_start): the rest is the search's.
REACH_SHARE = 0.15
BISECT_LOCAL_MAX_S = 1.0  # local search per bisection step for the least reachable budget (forward-only graphs)


def run_method(problem: Problem, budget_bytes: int, method: str, *, time_limit: float = 60.0,
               seed: int = 0, progress: Callable[[float | None, float], None] | None = None,
               work_limit: float | None = None) -> Decisions:
    """Decisions of one planner (no simulation of the result, no errors for infeasible).
    ``time_limit``: wall seconds from this call, everything included; ``work_limit``: CP-SAT's
    deterministic time (``auto`` and ``ilp`` only)."""
    t0 = time.perf_counter()
    if problem.offload is not None and method in OURS:
        return _with_offload(problem, budget_bytes, method, time_limit=time_limit, seed=seed, progress=progress,
                             work_limit=work_limit)
    if method == "heuristic":
        return plan_heuristic(problem, budget_bytes, seed=seed, time_limit=time_limit)
    if method in ("auto", "ilp"):
        warm, warm_name = _warm_start(problem, budget_bytes, seed, t0 + time_limit)
        left = time_limit - (time.perf_counter() - t0)
        dec = plan_ilp(problem, budget_bytes, seed=seed, time_limit=left, hint=warm, progress=progress,
                       work_limit=work_limit)
        ilp_found = dec.status != "infeasible" and bool(dec.drops or dec.partitions)
        if ilp_found and best_by_simulator(problem, budget_bytes, [dec, warm]) is dec:
            if dec.drops == warm.drops and dec.partitions == warm.partitions:
                dec.notes = [f"the {warm_name}'s plan, which CP-SAT could not improve on", *dec.notes]
            else:
                dec.notes = [f"CP-SAT's plan, cheaper than the {warm_name}'s", *dec.notes]
            dec.stats["warm_start"] = warm_name
            return dec
        # The ILP found nothing the simulator accepts: keep the warm start (make_plan judges
        # it, and it does not fit: a warm start that fits is the ILP's incumbent).
        warm.lower_bound = None
        warm.status = None
        warm.timed_out = dec.timed_out
        warm.notes = [f"the {warm_name}'s plan: CP-SAT found nothing better", *dec.notes]
        warm.stats["ilp"] = dec.stats
        warm.stats["warm_start"] = warm_name
        return warm
    table = baseline_table()
    if method not in table:
        raise UsageError(f"Unknown method {method!r}; choose one of {', '.join(methods())}.")
    return table[method](problem, budget_bytes, seed=seed, time_limit=time_limit)


def _with_offload(problem: Problem, budget_bytes: int, method: str, *, time_limit: float, seed: int, progress,
                  work_limit: float | None) -> Decisions:
    """Our planners with offload allowed (:mod:`.offload_plan`): the heuristic keeps, drops or
    offloads; ``auto`` and ``ilp`` also run the drop-only search in half the time and keep the
    better plan by the simulator. The ILP does not model copies, so its bound holds for plans
    without offload only: none is claimed, unless no tensor can be offloaded at all."""
    from ..problem.offload import allow_offload
    from .offload_plan import lone_timings, plan_offload

    t0 = time.perf_counter()
    plain = allow_offload(problem, None)
    if not lone_timings(problem):
        dec = run_method(plain, budget_bytes, method, time_limit=time_limit, seed=seed, progress=progress,
                         work_limit=work_limit)
        dec.notes.append("offload allowed, but no saved activation of this trace can be offloaded")
        return dec
    if method == "heuristic":
        drop_only = plan_heuristic(plain, budget_bytes, seed=seed, time_limit=time_limit / 2)
    else:
        drop_only = run_method(plain, budget_bytes, method, time_limit=time_limit / 2, seed=seed, progress=progress,
                               work_limit=work_limit)
    left = max(time_limit - (time.perf_counter() - t0), 0.0)
    dec = plan_offload(problem, budget_bytes, seed=seed, time_limit=left, drop_only=drop_only)
    if dec is drop_only and drop_only.status == "optimal" and drop_only.lower_bound == 0.0:
        return dec  # free already: a bound of 0 holds for every plan
    if dec is not drop_only:
        dec.notes.append(f"the offload heuristic's plan, better by the simulator than the drop-only {method} plan")
    if drop_only.lower_bound is not None:
        dec.notes.append(f"no lower bound: the {method} search's bound ({drop_only.lower_bound:.6g}) holds for plans "
                         "without offload only (the ILP does not model copies)")
    dec.lower_bound = None
    dec.status = None
    return dec


def _warm_start(problem: Problem, budget_bytes: int, seed: int, deadline: float) -> tuple[Decisions, str]:
    """The best plan by the simulator among our heuristic and every baseline (they are fast,
    and ours must never do worse than one of them), and its name ("heuristic", "dtr
    baseline", ...). Baselines not started by a third of the time left are skipped."""
    t0 = time.perf_counter()
    tried = {"heuristic": plan_heuristic(problem, budget_bytes, seed=seed, time_limit=(deadline - t0) / 2)}
    cut = t0 + (deadline - t0) / 3
    for name, fn in baseline_table().items():
        now = time.perf_counter()
        if name != "none" and now < cut:
            tried[f"{name} baseline"] = fn(problem, budget_bytes, seed=seed, time_limit=(deadline - now) / 4)
    best = best_by_simulator(problem, budget_bytes, list(tried.values()))
    if simulate_plan(problem, best.drops, best.partitions)[0].peak_bytes > budget_bytes:
        # The greedy sweep is not monotone in the budget: the bisection that finds the lowest
        # peak it reaches (the budget a timed-out solve suggests) asks for less, and its plan
        # may fit this budget where the sweep asked for it did not.
        lowest_reachable(problem, deadline=t0 + (deadline - t0) * REACH_SHARE)
        reached = problem.__dict__.get("_reached_plan")
        if reached is not None and reached[0] <= budget_bytes:
            tried["heuristic (asked for less)"] = reached[1]
            best = best_by_simulator(problem, budget_bytes, list(tried.values()))
    return best, next(name for name, dec in tried.items() if dec is best)


def solve(trace: Trace, budget_bytes: int, method: str = "auto", *, time_limit: float = 60.0,
          seed: int = 0, progress: Callable[[float | None, float], None] | None = None,
          problem: Problem | None = None, on: str = "allocated", allocator: AllocatorConfig | None = None,
          work_limit: float | None = None, started: float | None = None, optimizer: str = "auto",
          partition_random: bool = False, reshard: str = "auto", prefetch: str = "auto",
          offload=None) -> Plan:
    """Plan ``trace`` under ``budget_bytes``; raise :class:`InfeasibleBudgetError` if no plan fits.

    ``offload`` (an :class:`~taichi_plan.problem.offload.OffloadConfig`, None by default): our planners
    may also offload saved activations to host memory (:mod:`.offload_plan`), on its host link
    and within its host budget; baselines never offload.

    ``optimizer`` (:mod:`taichi_plan.problem.optimizer.plan`): ``as-recorded`` plans activations only;
    ``in-backward`` / ``groups`` plan the step as that option runs it; ``auto`` (default) keeps
    the recorded step whenever a plan fits with it, and otherwise takes the options the trace's
    loop allows (the plan says which, ``Plan.optimizer``). ``problem`` is the recorded trace's.

    ``on``: the budget holds allocated bytes (the simulator's peak) or ``"reserved"`` bytes (the
    allocator model's reserved peak; see :mod:`taichi_plan.solve.reserved`); ``allocator``: the
    model's settings (PyTorch's defaults when None).

    ``time_limit`` is wall seconds for the whole solve, counted from ``started`` (a
    ``time.perf_counter()`` value: the CLI passes the moment it started loading) or from this
    call; limits of at least :data:`MIN_TIME_LIMIT_S` are honoured within 10% (with
    ``on="reserved"``, for all its rounds together). When it runs out, the best plan found so
    far is returned with its bound. ``work_limit`` bounds CP-SAT's deterministic time instead
    (summed over its rounds): the same trace, budget, seed and work limit give the same plan,
    provided the time limit is not reached first.

    ``reshard`` (sharded traces, :mod:`taichi_plan.solve.fsdp`): ``auto`` (default) lets our
    planners choose which FSDP units stop resharding after forward; ``as-recorded`` keeps every
    unit as recorded. Baselines keep the recorded setting. ``prefetch``, likewise, for FSDP2's
    prefetching (which all-gathers are issued early, :mod:`taichi_plan.problem.sharding.prefetch`).

    ``partition_random``: the planners may partition modules that draw random numbers
    (dropout); their chunks then draw their own, which changes training statistically, and
    the plan records it (:mod:`taichi_plan.problem.partition`). Off, nothing random is partitioned.
    """
    _check_limits(time_limit, work_limit)
    if on == "reserved":
        from .reserved import solve_on_reserved

        began = time.perf_counter() if started is None else started
        problem = allow_random(problem or build_problem(trace), partition_random)
        return solve_on_reserved(
            lambda target: solve(trace, target, method, time_limit=time_limit, seed=seed, progress=progress,
                                 problem=problem, allocator=allocator, work_limit=work_limit, started=began,
                                 optimizer=optimizer, partition_random=partition_random, reshard=reshard,
                                 prefetch=prefetch, offload=offload),
            budget_bytes, method)
    if reshard not in RESHARD_CHOICES:
        raise UsageError(f"--reshard must be one of {', '.join(RESHARD_CHOICES)}, not {reshard!r}.")
    if prefetch not in PREFETCH_CHOICES:
        raise UsageError(f"--prefetch must be one of {', '.join(PREFETCH_CHOICES)}, not {prefetch!r}.")
    t0 = time.perf_counter() if started is None else started
    end = t0 + time_limit * (1 - FINISH_SHARE)
    problem = problem or build_problem(trace)
    failed: list[InfeasibleBudgetError] = []
    try:
        # Phases without a limit of their own (an optimizer option's view of the step, its
        # problem and floor) check this deadline (taichi_plan/base/deadline.py); the search, bounded
        # by its own limit, does not (a plan it holds is never lost to a check).
        with until(t0 + time_limit * (1 - REPORT_SHARE)):
            return _solve_options(trace, problem, budget_bytes, method, time_limit, seed, progress, on, allocator,
                                  work_limit, t0, optimizer, partition_random, reshard, prefetch, failed, offload)
    except OutOfTime as e:
        err = stopped_error(problem, budget_bytes, method, e.phase, time_limit, work_limit, failed, deadline=end)
        reached = problem.__dict__.get("_reached_plan")
        if method in OURS and optimizer in ("auto", "as-recorded") and reached is not None and reached[0] <= budget_bytes:
            # Asked for less while finding what to report, the heuristic met this budget: the best
            # plan so far is that one, written with no bound rather than no plan at all.
            dec = dataclasses.replace(reached[1], status=None, lower_bound=None, timed_out=True, notes=[
                f"the time limit ran out while {e.phase}; this is the heuristic's plan for a lower budget, "
                f"found while bisecting for the least reachable one, which fits this budget (no bound)",
                *reached[1].notes])
            return make_plan(problem, budget_bytes, method, dec, time.perf_counter() - t0, seed, allocator=allocator)
        raise err from None


def _solve_options(trace, problem, budget_bytes, method, time_limit, seed, progress, on, allocator, work_limit, t0,
                   optimizer, partition_random, reshard, prefetch, failed, offload=None) -> Plan:
    """:func:`solve`'s search over the optimizer options, in order; the errors of the options
    that found no plan are added to ``failed``."""
    check_choice(trace, optimizer)
    # Whether the trace allows the other options is asked only once the recorded step fails (on
    # a large trace the answer builds the step's per-parameter view: seconds of the time limit).
    modes = [optimizer] if optimizer != "auto" else ["as-recorded", *OPTION_ORDER]
    refused: dict[str, bool] = {}

    def allowed(m: str) -> bool:
        if optimizer != "auto" or m == "as-recorded":
            return True
        if m not in refused:
            refused[m] = refusal(trace, m) is not None
        return not refused[m]

    skipped: list[Problem] = []  # options below whose floor the budget is (their error only if all fail)
    for k, mode in enumerate(modes):
        if not allowed(mode):
            continue

        def is_last(k: int = k) -> bool:
            return not any(allowed(m) for m in modes[k + 1:])

        check(f"building the step with the optimizer {WORDS.get(mode, 'as recorded')}")
        prob = allow_random(view_problem(problem, mode, choose_groups(problem, budget_bytes) if mode == "groups"
                                         else None), partition_random)
        if offload is not None:
            from ..problem.offload import allow_offload

            prob = allow_offload(prob, offload)
        if budget_bytes < int(floor_bytes(prob).max()) and budget_bytes < prob.baseline_peak[0] and not is_last():
            skipped.append(prob)
            continue  # below what this step can reach at all: the next option
        limit = time_limit
        if mode != "as-recorded":
            # The optimizer options share what is left: one that finds no plan (stepping in
            # groups, on a ViT-base at 35%) must not spend the time the next one needs (in
            # backward, where the heuristic alone fits). The recorded step keeps the whole limit.
            left = sum(1 for m in modes[k:] if allowed(m))
            now = time.perf_counter()
            limit = min(time_limit, now - t0 + (t0 + time_limit - now) / left)

        def step(p: Problem, limit: float = limit) -> Plan:
            return _solve_step(trace, budget_bytes, method, time_limit=limit, seed=seed, progress=progress,
                               problem=p, on=on, allocator=allocator, work_limit=work_limit, started=t0,
                               asked_limit=time_limit)

        try:
            with lifted():
                by_reshard = reshard == "auto" and bool(reshard_units(trace.meta))
                by_prefetch = prefetch == "auto" and any(movable(trace).values())
                if (by_reshard or by_prefetch) and method in OURS and mode == "as-recorded":
                    plan = solve_with_fsdp(prob, budget_bytes, seed, time_limit * (1 - FINISH_SHARE), t0, step,
                                           reshard=by_reshard, prefetch=by_prefetch)
                else:
                    plan = step(prob)
        except InfeasibleBudgetError as e:
            failed.append(e)
            end = t0 + time_limit * (1 - FINISH_SHARE)
            if is_last():
                # the option that is known to reach the lowest budget says what to ask for
                failed += [infeasible_error(q, budget_bytes, method, deadline=end) for q in skipped]
                raise min(failed, key=lambda x: x.min_budget_bytes or 0) from None
            if time.perf_counter() > end:  # options left untried: not a proof that none fits
                raise OutOfTime("the optimizer options after the recorded step found no plan") from None
            continue
        if mode != "as-recorded":
            plan.optimizer["chosen_by"] = "auto" if optimizer == "auto" else "asked"
            plan.solver["notes"].insert(0, optimizer_note(plan.optimizer, optimizer == "auto"))
        kv = kv_cache_note(recorded_problem(prob)) if plan.budget_bytes < int(prob.baseline_peak[0]) else None
        if kv is not None:
            plan.solver["notes"].append(kv)
        sized = data_sized_note(trace.meta)
        if sized is not None:
            plan.solver["notes"].append(sized)
        return plan
    raise AssertionError("unreachable: the last option raises or returns")


def _check_limits(time_limit, work_limit) -> None:
    if not (isinstance(time_limit, (int, float)) and math.isfinite(time_limit) and time_limit > 0):
        raise UsageError(f"--time-limit must be a positive number of seconds, not {time_limit!r}.")
    if work_limit is not None and not (isinstance(work_limit, (int, float)) and math.isfinite(work_limit)
                                       and work_limit > 0):
        raise UsageError(f"--work-limit must be a positive number, not {work_limit!r}.")


def _solve_step(trace: Trace, budget_bytes: int, method: str, *, time_limit: float, seed: int,
                progress: Callable[[float | None, float], None] | None, problem: Problem, on: str,
                allocator: AllocatorConfig | None, work_limit: float | None, started: float,
                asked_limit: float | None = None) -> Plan:
    """:func:`solve` for one optimizer option: ``problem`` is the step as it runs it, within
    ``time_limit`` (its share of ``asked_limit``, the command's, which errors name)."""
    if on != "allocated":
        raise UsageError(f"--on must be allocated or reserved, not {on!r}.")
    if method not in methods():
        raise UsageError(f"Unknown method {method!r}; choose one of {', '.join(methods())}.")
    _check_limits(time_limit, work_limit)
    t0 = started
    end = t0 + time_limit * (1 - FINISH_SHARE)
    base_peak, _ = problem.baseline_peak
    if budget_bytes >= base_peak:
        note = ("the budget does not bind: no change needed" if problem.trace.meta.get("optimizer_view") is None
                else "with the optimizer stepped so, the budget does not bind: no activation needs to be dropped")
        dec = Decisions(status="optimal", lower_bound=0.0, notes=[note])
        return make_plan(problem, budget_bytes, method, dec, time.perf_counter() - t0, seed, allocator=allocator)
    if budget_bytes < int(min_live_bytes(problem).max()) and budget_bytes < int(floor_bytes(problem).max()):
        raise infeasible_error(problem, budget_bytes, method, deadline=end)
    dec = run_method(problem, budget_bytes, method, time_limit=max(end - time.perf_counter(), 0.0), seed=seed,
                     progress=progress, work_limit=work_limit)
    plan = make_plan(problem, budget_bytes, method, dec, time.perf_counter() - t0, seed, allocator=allocator)
    reached = None
    if plan.solver["status"] == "infeasible" and method in OURS and time.perf_counter() < end:
        # The greedy sweep is not monotone in the budget: asked for less, it may find a plan
        # that fits this budget, or at least peaks lower. Of the two, the simulator's better
        # one stands (so auto never ends above its own heuristic, even when nothing fits).
        reach, reach_op, asked = lowest_reachable(problem, deadline=end)
        reached = (reach, reach_op) if reach < problem.baseline_peak[0] else None
        lower = plan_heuristic(problem, asked, seed=seed, time_limit=max(end - time.perf_counter(), 0.0))
        lower.notes.append(f"the heuristic's plan for a budget of {format_bytes(asked)}: its plan for "
                           f"{format_bytes(budget_bytes)} did not fit")
        lower.timed_out = dec.timed_out
        if best_by_simulator(problem, budget_bytes, [dec, lower]) is lower:
            dec = lower
            plan = make_plan(problem, budget_bytes, method, lower, time.perf_counter() - t0, seed,
                             allocator=allocator)
    if plan.solver["status"] == "infeasible":
        if dec.timed_out:
            peak, op = plan.predicted["planned_peak_bytes"], plan.predicted["planned_peak_op"]
            if reached is not None and reached[0] < peak:
                peak, op = reached
            raise timed_out_error(problem, budget_bytes, method, peak, op, asked_limit or time_limit, work_limit)
        raise infeasible_error(problem, budget_bytes, method, plan, deadline=end)
    return plan


def lowest_reachable_peak(problem: Problem) -> tuple[int, int]:
    """(peak bytes, op) of the lowest budget the heuristic is known to meet."""
    peak, op, _asked = lowest_reachable(problem)
    return peak, op


def lowest_reachable(problem: Problem, steps: int = 7, deadline: float | None = None) -> tuple[int, int, int]:
    """(peak, op, budget asked) of the best plan the heuristic finds when bisecting between the
    floor no plan can pass and the baseline peak; no new step starts past ``deadline``
    (perf_counter). Cached on the problem when complete."""
    cached = getattr(problem, "_lowest_reachable", None)
    if cached is None:
        found, complete = _bisect_heuristic(problem, steps, deadline)
        if not complete:
            return found
        cached = problem._lowest_reachable = found
    return cached


def _bisect_heuristic(problem: Problem, steps: int, deadline: float | None,
                      planner: Callable[[Problem, int], Decisions] | None = None
                      ) -> tuple[tuple[int, int, int], bool]:
    """Bisect ``planner``'s budget (None: the heuristic, its local search bounded) between the
    floor and the baseline peak: ((peak, op, budget asked) of the lowest-peak plan that fit its
    budget, whether the search completed)."""
    lo = int(floor_bytes(problem).max())
    hi, hi_op = problem.baseline_peak
    best = (hi, hi_op, hi)
    for _ in range(steps):
        if hi - lo <= max(1, hi // 1000):
            break
        if deadline is not None and time.perf_counter() > deadline:
            return best, False
        mid = (lo + hi) // 2
        if planner is None:
            dec = plan_heuristic(problem, mid, time_limit=60.0 if deadline is None else deadline - time.perf_counter(),
                                 local_max_s=BISECT_LOCAL_MAX_S)
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


def timed_out_error(problem: Problem, budget_bytes: int, method: str, peak: int, op: int, time_limit: float,
                    work_limit: float | None, stopped_in: str | None = None) -> InfeasibleBudgetError:
    """No plan yet when the limit ran out (not a proof that none exists): say so (and in which
    phase it stopped, ``stopped_in``), and the lowest peak a plan found reaches: ``peak``, at
    ``op`` (the best plan for this budget's, or the heuristic's when asked for less)."""
    limit = f"the time limit of {time_limit:g} s" + ("" if work_limit is None else f" or the work limit of {work_limit:g}")
    at = f", during {describe_op(problem, op)}" if op >= 0 else ""
    view = (problem.trace.meta.get("optimizer_view") or {}).get("mode")
    if view is not None:  # reached with that optimizer option: asked for it by name, it gets the whole limit
        at += f", with the optimizer {WORDS.get(view, view).split(' (')[0]}"
    where = "the search" if stopped_in is None else f"it stopped while {stopped_in}: the search"
    msg = (f"No {method} plan found for a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes) within "
           f"{limit}: {where} stopped before any plan fit, which does not prove that none exists. The lowest "
           f"peak a plan found so far reaches (the heuristic's and the baselines' included, also when asked "
           f"for less) is {format_bytes(peak)}{at}. "
           f"Give it more time (--time-limit), or ask for at least that (--budget {_suggest(peak)}"
           f"{'' if view is None else f' --optimizer {view}'}). "
           "No plan file was written.")
    err = InfeasibleBudgetError(msg, min_budget_bytes=peak, op_id=op)
    err.planned_peak_bytes = peak
    err.timed_out = True
    return err


def stopped_error(problem: Problem, budget_bytes: int, method: str, phase: str, time_limit: float,
                  work_limit: float | None, failed: list[InfeasibleBudgetError], deadline: float
                  ) -> InfeasibleBudgetError:
    """The time ran out during ``phase``, with no plan found (``failed``: the errors of the
    options tried): :func:`timed_out_error` with the lowest peak known, the options' or the
    heuristic's on the step as recorded (``problem``), bisected until ``deadline``."""
    known = [(e.min_budget_bytes, e.op_id) for e in failed if e.min_budget_bytes]
    # An option's best plan may peak above the step unplanned, which meets its own peak.
    peak, op = min([*known, tuple(problem.baseline_peak)]) if known else lowest_reachable(problem, deadline=deadline)[:2]
    return timed_out_error(problem, budget_bytes, method, peak, -1 if op is None else op, time_limit, work_limit,
                           stopped_in=phase)


def infeasible_error(problem: Problem, budget_bytes: int, method: str, plan: Plan | None = None,
                     deadline: float | None = None):
    floor = floor_bytes(problem)
    i = int(np.argmax(floor))
    reach, reach_op, _asked = lowest_reachable(problem, deadline=deadline)
    peak = plan.predicted["planned_peak_bytes"] if plan is not None else None
    if peak is not None and peak <= budget_bytes:
        reach = min(reach, peak)
    head = f"No {method} plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes)."
    if plan is not None:
        at = describe_op(problem, plan.predicted["planned_peak_op"]) if plan.predicted["planned_peak_op"] >= 0 else ""
        head += f" The best {method} plan peaks at {format_bytes(peak)}" + (f", during {at}." if at else ".")
    if reach <= budget_bytes:
        msg = (f"{head} taichi-plan's heuristic reaches {format_bytes(reach)} on this trace: "
               "use --method auto. No plan file was written.")
    else:
        if method in OURS:
            meet = (f"The lowest budget taichi-plan is known to meet is {format_bytes(reach)}" +
                    ("" if method in ("auto", "ilp") else " (--method auto may reach a little lower)"))
        else:
            meet = f"taichi-plan's own planner (--method auto) meets {format_bytes(reach)}"
        msg = (f"{head} No plan of this trace can go below {format_bytes(int(floor[i]))}: {describe_op(problem, i)} "
               "needs that much live at once even with every droppable tensor dropped and every module "
               f"partitioned. {meet}: ask for at least that (--budget {_suggest(reach)})"
               f"{_what_helps(problem, i, int(floor[i]), deadline)} No plan file was written.")
    err = InfeasibleBudgetError(msg, min_budget_bytes=reach, op_id=reach_op)
    err.planned_peak_bytes = peak
    return err


def _what_helps(problem: Problem, op: int, floor: int, deadline: float | None = None) -> str:
    """The floor's parts at ``op`` (parameters, optimizer state, gradients, activations) and
    the advice that fits them: the optimizer options with the floor each would reach (or why
    the loop rules one out; not past ``deadline``); when parameters, gradients and optimizer
    state make most of the floor, what would shrink them, not a smaller batch, which cannot help."""
    parts = floor_parts(problem, op, floor).by_kind
    state = parts["parameter"] + parts["gradient"] + parts["optimizer_state"]
    names = {"parameter": "parameters", "optimizer_state": "optimizer state", "gradient": "gradients",
             "activations": "activations and other tensors"}
    where = " (in the optimizer step)" if problem.op_phase[op] == "optimizer" else ""
    text = (f". At op {op}{where} the floor is " +
            ", ".join(f"{names[k]} {format_bytes(v)}" for k, v in parts.items()) + ".")
    used = (problem.trace.meta.get("optimizer_view") or {}).get("mode")
    if used is not None:
        text += f" That is with the optimizer {WORDS[used]}."
    try:
        with until(deadline):
            text += _options_floor(recorded_problem(problem), used, floor)
    except OutOfTime:  # the step's views under the other options can take long to build
        text += " What the other optimizer options would reach was not weighed within the time limit."
    own = own_checkpointing(problem.trace.meta)
    if own is not None:
        text += " " + own
    kv = kv_cache_note(recorded_problem(problem))
    if kv is not None:
        text += " " + kv
    if floor <= 0 or state < floor / 2:
        return text + (" Otherwise, reduce the batch size." if own is None else "")
    return (text + f" Parameters, gradients and optimizer state are {100 * state / floor:.0f}% of it: no "
            "activation plan and no smaller batch frees them; sharding them across devices (FSDP), an optimizer "
            "with less state, or lower-precision parameters and state would.")


def kv_cache_note(problem: Problem) -> str | None:
    """A sentence on the modules no plan partitions because they keep tensors in the model's
    state (a KV cache), or None."""
    keeps = state_keepers(problem)
    if not keeps:
        return None
    more = f" and {len(keeps) - 3} more" if len(keeps) > 3 else ""
    return (f"{len(keeps)} module(s) ({', '.join(keeps[:3])}{more}) make tensors that the step's code still "
            "holds after their forward although no later forward op reads them (a transformers model's KV cache, "
            "or outputs the model returns and the loss does not use), so no plan partitions or checkpoints them: "
            "re-run in backward, such a module would make them a second time while the first copies are held. "
            "Where that is a transformers model's KV cache, training needs none: recorded with "
            "model.config.use_cache = False (as gradient_checkpointing_enable() sets it), its modules are all options"
            + (" (this built-in model: record it with --no-kv-cache)." if _builtin_decoder(problem) else "."))


def _builtin_decoder(problem: Problem) -> bool:
    """Was the trace recorded from a built-in decoder, which ``--no-kv-cache`` builds without its cache?"""
    from ..trace.format import KV_CACHE_MODELS

    wl = problem.trace.meta.get("workload") or {}
    return wl.get("kind") == "builtin" and wl.get("name") in KV_CACHE_MODELS


def _options_floor(rec: Problem, used: str | None, floor: int) -> str:
    """Sentences on what each optimizer option other than ``used`` does to ``floor`` (or why
    the loop rules it out); checks the deadline in force."""
    text = ""
    for mode in OPTION_ORDER:
        if mode == used:
            continue
        why = refusal(rec.trace, mode)
        if why is not None:
            if mode == "in-backward":  # (groups are refused only where they cannot help)
                text += f" The optimizer cannot be stepped in backward here (--optimizer in-backward): {why}."
            continue
        other = int(floor_bytes(view_problem(rec, mode, choose_groups(rec, 0) if mode == "groups" else None)).max())
        if other < floor:
            text += (f" With the optimizer {WORDS[mode]} (--optimizer {mode}, or auto), no plan can go below "
                     f"{format_bytes(other)} instead: {format_bytes(floor - other)} less.")
    return text


def _suggest(nbytes: int) -> str:
    """A budget flag at or just above ``nbytes``, in a readable unit."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= 10 * scale:
            return f"{math.ceil(nbytes / scale * 100) / 100:g}{unit}"
    return str(nbytes)
