"""Planners: ours (``auto``, ``ilp``, ``heuristic``) and the baselines, one entry point.

Every planner returns :class:`~taichi_plan.solve.result.Decisions`; :func:`solve` turns
them into a :class:`~taichi_plan.plan.format.Plan` judged by the simulator.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from ..base.deadline import OutOfTime, check, lifted, until
from ..base.errors import InfeasibleBudgetError, UsageError
from ..base.units import format_bytes
from ..plan.format import Plan
from ..problem.core import Problem, build_problem
from ..problem.live import min_live_bytes
from ..problem.optimizer.plan import (
    OPTION_ORDER,
    WORDS,
    check_choice,
    choose_groups,
    optimizer_note,
    recorded_problem,
    refusal,
    view_problem,
)
from ..problem.partition.floor import floor_bytes
from ..problem.partition.qualify import allow_random
from ..problem.sharding.prefetch import movable
from ..problem.sharding.units import reshard_units
from ..simulate.allocator import AllocatorConfig
from ..simulate.core import simulate_plan
from ..trace.format import Trace, data_sized_note
from .config import SolverConfig
from .fsdp import solve_with_fsdp
from .heuristic import best_by_simulator, plan_heuristic
from .ilp import plan_ilp
from .messages import OURS, infeasible_error, kv_cache_note, stopped_error, timed_out_error
from .reach import lowest_reachable
from .result import Decisions, make_plan

RESHARD_CHOICES = ("auto", "as-recorded")  # FSDP units' reshard_after_forward (taichi_plan/solve/fsdp.py)
PREFETCH_CHOICES = ("auto", "as-recorded")  # FSDP2's prefetching (taichi_plan/problem/sharding/prefetch.py, solve/fsdp.py)


def baseline_table() -> dict[str, Callable]:
    from .baselines import BASELINES

    return BASELINES


def methods() -> list[str]:
    return [*OURS, *baseline_table()]


MIN_TIME_LIMIT_S = 5.0  # the time limit is honoured within 10% for limits at least this long


def run_method(problem: Problem, budget_bytes: int, method: str, *, time_limit: float = 60.0,
               seed: int = 0, progress: Callable[[float | None, float], None] | None = None,
               work_limit: float | None = None, config: SolverConfig = SolverConfig()) -> Decisions:
    """Decisions of one planner (no simulation of the result, no errors for infeasible).
    ``time_limit``: wall seconds from this call, everything included; ``work_limit``: CP-SAT's
    deterministic time (``auto`` and ``ilp`` only); ``config``: the planners' tuning."""
    t0 = time.perf_counter()
    if problem.offload is not None and method in OURS:
        return _with_offload(problem, budget_bytes, method, time_limit=time_limit, seed=seed, progress=progress,
                             work_limit=work_limit, config=config)
    if method == "heuristic":
        return plan_heuristic(problem, budget_bytes, seed=seed, time_limit=time_limit, config=config.heuristic)
    if method in ("auto", "ilp"):
        warm, warm_name = _warm_start(problem, budget_bytes, seed, t0 + time_limit, config)
        left = time_limit - (time.perf_counter() - t0)
        dec = plan_ilp(problem, budget_bytes, seed=seed, time_limit=left, hint=warm, progress=progress,
                       work_limit=work_limit, config=config.ilp, heuristic=config.heuristic)
        ilp_found = dec.status != "infeasible" and bool(dec.drops or dec.partitions)
        if ilp_found and best_by_simulator(problem, budget_bytes, [dec, warm], config.heuristic) is dec:
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
    return table[method](problem, budget_bytes, seed=seed, time_limit=time_limit, config=config.baselines)


def _with_offload(problem: Problem, budget_bytes: int, method: str, *, time_limit: float, seed: int, progress,
                  work_limit: float | None, config: SolverConfig = SolverConfig()) -> Decisions:
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
                         work_limit=work_limit, config=config)
        dec.notes.append("offload allowed, but no saved activation of this trace can be offloaded")
        return dec
    if method == "heuristic":
        drop_only = plan_heuristic(plain, budget_bytes, seed=seed, time_limit=time_limit / 2, config=config.heuristic)
    else:
        drop_only = run_method(plain, budget_bytes, method, time_limit=time_limit / 2, seed=seed, progress=progress,
                               work_limit=work_limit, config=config)
    left = max(time_limit - (time.perf_counter() - t0), 0.0)
    dec = plan_offload(problem, budget_bytes, seed=seed, time_limit=left, drop_only=drop_only, config=config.offload,
                       heuristic=config.heuristic)
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


def _warm_start(problem: Problem, budget_bytes: int, seed: int, deadline: float,
                config: SolverConfig = SolverConfig()) -> tuple[Decisions, str]:
    """The best plan by the simulator among our heuristic and every baseline (they are fast,
    and ours must never do worse than one of them), and its name ("heuristic", "dtr
    baseline", ...). Baselines not started by a third of the time left are skipped."""
    t0 = time.perf_counter()
    tried = {"heuristic": plan_heuristic(problem, budget_bytes, seed=seed, time_limit=(deadline - t0) / 2,
                                         config=config.heuristic)}
    cut = t0 + (deadline - t0) / 3
    for name, fn in baseline_table().items():
        now = time.perf_counter()
        if name != "none" and now < cut:
            tried[f"{name} baseline"] = fn(problem, budget_bytes, seed=seed, time_limit=(deadline - now) / 4,
                                           config=config.baselines)
    best = best_by_simulator(problem, budget_bytes, list(tried.values()), config.heuristic)
    if simulate_plan(problem, best.drops, best.partitions)[0].peak_bytes > budget_bytes:
        # The greedy sweep is not monotone in the budget: the bisection that finds the lowest
        # peak it reaches (the budget a timed-out solve suggests) asks for less, and its plan
        # may fit this budget where the sweep asked for it did not.
        lowest_reachable(problem, deadline=t0 + (deadline - t0) * config.time.reach_share, config=config)
        reached = problem.__dict__.get("_reached_plan")
        if reached is not None and reached[0] <= budget_bytes:
            tried["heuristic (asked for less)"] = reached[1]
            best = best_by_simulator(problem, budget_bytes, list(tried.values()), config.heuristic)
    return best, next(name for name, dec in tried.items() if dec is best)


def solve(trace: Trace, budget_bytes: int, method: str = "auto", *, time_limit: float = 60.0,
          seed: int = 0, progress: Callable[[float | None, float], None] | None = None,
          problem: Problem | None = None, on: str = "allocated", allocator: AllocatorConfig | None = None,
          work_limit: float | None = None, started: float | None = None, optimizer: str = "auto",
          partition_random: bool = False, reshard: str = "auto", prefetch: str = "auto",
          offload=None, config: SolverConfig = SolverConfig()) -> Plan:
    """Plan ``trace`` under ``budget_bytes``; raise :class:`InfeasibleBudgetError` if no plan fits.

    ``config`` (a :class:`~taichi_plan.solve.config.SolverConfig`): the planners' tuning
    constants, each component's (``SolverConfig(ilp=IlpConfig(workers=1))``); the defaults are
    the values they were tuned with.

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
                                 prefetch=prefetch, offload=offload, config=config),
            budget_bytes, method, config.reserved)
    if reshard not in RESHARD_CHOICES:
        raise UsageError(f"--reshard must be one of {', '.join(RESHARD_CHOICES)}, not {reshard!r}.")
    if prefetch not in PREFETCH_CHOICES:
        raise UsageError(f"--prefetch must be one of {', '.join(PREFETCH_CHOICES)}, not {prefetch!r}.")
    t0 = time.perf_counter() if started is None else started
    end = t0 + time_limit * (1 - config.time.finish_share)
    problem = problem or build_problem(trace)
    failed: list[InfeasibleBudgetError] = []
    try:
        # Phases without a limit of their own (an optimizer option's view of the step, its
        # problem and floor) check this deadline (taichi_plan/base/deadline.py); the search, bounded
        # by its own limit, does not (a plan it holds is never lost to a check).
        with until(t0 + time_limit * (1 - config.time.report_share)):
            return _solve_options(trace, problem, budget_bytes, method, time_limit, seed, progress, on, allocator,
                                  work_limit, t0, optimizer, partition_random, reshard, prefetch, failed, offload,
                                  config)
    except OutOfTime as e:
        err = stopped_error(problem, budget_bytes, method, e.phase, time_limit, work_limit, failed, deadline=end,
                            config=config)
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
                   optimizer, partition_random, reshard, prefetch, failed, offload=None,
                   config: SolverConfig = SolverConfig()) -> Plan:
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
                               asked_limit=time_limit, config=config)

        try:
            with lifted():
                by_reshard = reshard == "auto" and bool(reshard_units(trace.meta))
                by_prefetch = prefetch == "auto" and any(movable(trace).values())
                if (by_reshard or by_prefetch) and method in OURS and mode == "as-recorded":
                    plan = solve_with_fsdp(prob, budget_bytes, seed, time_limit * (1 - config.time.finish_share), t0,
                                           step, reshard=by_reshard, prefetch=by_prefetch, config=config.fsdp,
                                           heuristic=config.heuristic)
                else:
                    plan = step(prob)
        except InfeasibleBudgetError as e:
            failed.append(e)
            end = t0 + time_limit * (1 - config.time.finish_share)
            if is_last():
                # the option that is known to reach the lowest budget says what to ask for
                failed += [infeasible_error(q, budget_bytes, method, deadline=end, config=config) for q in skipped]
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
                asked_limit: float | None = None, config: SolverConfig = SolverConfig()) -> Plan:
    """:func:`solve` for one optimizer option: ``problem`` is the step as it runs it, within
    ``time_limit`` (its share of ``asked_limit``, the command's, which errors name)."""
    if on != "allocated":
        raise UsageError(f"--on must be allocated or reserved, not {on!r}.")
    if method not in methods():
        raise UsageError(f"Unknown method {method!r}; choose one of {', '.join(methods())}.")
    _check_limits(time_limit, work_limit)
    t0 = started
    end = t0 + time_limit * (1 - config.time.finish_share)
    base_peak, _ = problem.baseline_peak
    if budget_bytes >= base_peak:
        note = ("the budget does not bind: no change needed" if problem.trace.meta.get("optimizer_view") is None
                else "with the optimizer stepped so, the budget does not bind: no activation needs to be dropped")
        dec = Decisions(status="optimal", lower_bound=0.0, notes=[note])
        return make_plan(problem, budget_bytes, method, dec, time.perf_counter() - t0, seed, allocator=allocator)
    if budget_bytes < int(min_live_bytes(problem).max()) and budget_bytes < int(floor_bytes(problem).max()):
        raise infeasible_error(problem, budget_bytes, method, deadline=end, config=config)
    dec = run_method(problem, budget_bytes, method, time_limit=max(end - time.perf_counter(), 0.0), seed=seed,
                     progress=progress, work_limit=work_limit, config=config)
    plan = make_plan(problem, budget_bytes, method, dec, time.perf_counter() - t0, seed, allocator=allocator)
    reached = None
    if plan.solver["status"] == "infeasible" and method in OURS and time.perf_counter() < end:
        # The greedy sweep is not monotone in the budget: asked for less, it may find a plan
        # that fits this budget, or at least peaks lower. Of the two, the simulator's better
        # one stands (so auto never ends above its own heuristic, even when nothing fits).
        reach, reach_op, asked = lowest_reachable(problem, deadline=end, config=config)
        reached = (reach, reach_op) if reach < problem.baseline_peak[0] else None
        lower = plan_heuristic(problem, asked, seed=seed, time_limit=max(end - time.perf_counter(), 0.0),
                               config=config.heuristic)
        lower.notes.append(f"the heuristic's plan for a budget of {format_bytes(asked)}: its plan for "
                           f"{format_bytes(budget_bytes)} did not fit")
        lower.timed_out = dec.timed_out
        if best_by_simulator(problem, budget_bytes, [dec, lower], config.heuristic) is lower:
            dec = lower
            plan = make_plan(problem, budget_bytes, method, lower, time.perf_counter() - t0, seed,
                             allocator=allocator)
    if plan.solver["status"] == "infeasible":
        if dec.timed_out:
            peak, op = plan.predicted["planned_peak_bytes"], plan.predicted["planned_peak_op"]
            if reached is not None and reached[0] < peak:
                peak, op = reached
            raise timed_out_error(problem, budget_bytes, method, peak, op, asked_limit or time_limit, work_limit)
        raise infeasible_error(problem, budget_bytes, method, plan, deadline=end, config=config)
    return plan


