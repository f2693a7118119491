"""The heuristic with offload as a third choice (``solve --offload``; no torch).

Where ``problem.offload`` allows it, a saved activation may be kept, dropped or offloaded
(:mod:`taichi_plan.problem.offload`). An offload costs nothing where its copies hide behind compute,
and its stall where they do not; a drop costs its rebuild. The planner:

1. times each candidate's copies alone on the host link (the stall-free schedule of that one
   offload): the ops during which it is off the device, and its stall alone;
2. takes offloads one by one, those freeing the most bytes x over-budget ops alone first,
   keeping one only where, timed with all those kept before it (one FIFO copy stream per
   direction: more copies, later frees and later copies-in), every copy still frees device
   memory, no copy back stalls the step and the host budget holds: the link's capacity, not
   the candidates alone, bounds what is offloaded;
3. (no step: an offload that would stall is never kept, so the plan's stalls are 0 unless the
   drops' recompute groups move the copies)
4. drops what is still over budget with the drop heuristic's sweep (:func:`~.heuristic.plan_remat`),
   the offloaded tensors kept out; a rebuild may read an offloaded tensor, which is then needed
   back before that rebuild's group (the simulator's deadline; where the sweep's plan is
   refused anyway, the largest offload goes and step 2 runs again, up to ``sweeps`` times,
   :class:`~taichi_plan.solve.config.OffloadPlanConfig`);
5. also turns the drop-only plan's drops into offloads one at a time, the costliest rebuild
   first, each swap kept where the simulator finds the plan cheaper and still within the
   budgets (:func:`_swap_drops`: from a plan that fits, it can only get cheaper);
6. where the drop-only plan does not fit, offloads tensors it keeps or drops where it peaks,
   one at a time, the one that lowers the peak most without a longer stall first
   (:func:`_offload_kept`): the checkpoints a plan keeps for its rebuilds go to host memory
   and come back before the first rebuild that reads them, and a dropped tensor copied back
   instead of rebuilt no longer re-makes its dropped inputs early (a chain); a plan that then fits has its drops
   swapped for copies as in step 5;
7. returns the best plan by the simulator among those and the drop-only heuristic's (of the
   plans with offloads, only those whose copies back replay can issue where they are timed:
   :func:`_replays`), so allowing offload never ends above not allowing it.

Steps 1-4 run on the step as recorded and, where the drop-only plan partitions modules, on the
step with those partitions applied (their drops re-planned around the copies).

Not done: the ILP (:mod:`.ilp`) does not model copies; with offload allowed ``auto`` and
``ilp`` weigh its drop-only plan against this one, and claim no lower bound (its bound holds
for plans without offload only). No new partition is chosen with offload in view.
"""

from __future__ import annotations

import time

import numpy as np

from ..base.errors import PlanError
from ..problem.core import Problem
from ..problem.offload import Offload, offload_candidates, schedule_offloads, trigger_tensor
from ..problem.partition.apply import apply_partitions
from ..simulate.core import simulate
from .config import HeuristicConfig, OffloadPlanConfig
from .heuristic import best_by_simulator, plan_heuristic, plan_remat
from .result import Decisions


def lone_timings(problem: Problem) -> list[tuple[Offload, int, int, float]]:
    """Per offload candidate that leaves the device when alone: (offload, first op it is off
    the device, first op it is back, stall alone); cached on the problem."""
    cached = problem.__dict__.get("_lone_offloads")
    if cached is not None:
        return cached
    link = problem.offload.host_link_bytes_per_s
    out = []
    for o in offload_candidates(problem):
        tm = schedule_offloads(problem, [o], {}, link).timings[0]
        if tm.leaves_device:
            out.append((o, tm.freed_after + 1, tm.prefetch_at, tm.stall_s))
    problem.__dict__["_lone_offloads"] = out
    return out


def _choose(problem: Problem, budget_bytes: int, lone: list, banned: set[int]) -> list[Offload]:
    """Offloads taken one by one, the most bytes x over-budget ops freed alone first, each kept
    only if it frees memory where the step, with those kept before it, is still over budget
    and, with them, every copy still frees device memory, no copy back stalls the step and the
    host budget holds (the copies share one link per direction: what
    one more copy does is timed with all of them, :func:`~taichi_plan.problem.offload.schedule_offloads`)."""
    rows = [x for x in lone if x[0].tensor not in banned]
    if not rows:
        return []
    link = problem.offload.host_link_bytes_per_s
    cap = problem.offload.host_budget_bytes
    over = np.concatenate([[0], np.cumsum(problem.baseline_live > budget_bytes)])
    score = [int(problem.nbytes[o.tensor]) * int(over[b] - over[s]) for o, s, b, _st in rows]
    order = sorted(range(len(rows)), key=lambda k: (-score[k], rows[k][0].tensor))
    chosen: list[Offload] = []
    est = problem.baseline_live.astype(np.int64)  # live bytes with the offloads kept so far (no drops)
    for k in order:
        o, s, b, stall = rows[k]
        if score[k] <= 0:
            break
        if stall > 0 or not (est[s:b] > budget_bytes).any():
            continue  # stalls alone, or frees nothing where the step is still over budget
        trial = [*chosen, o]
        sched = schedule_offloads(problem, trial, {}, link)
        if sched.stall_s > 0 or not all(t.leaves_device for t in sched.timings):
            continue
        if cap is not None and sched.host_peak_bytes > cap:
            continue
        chosen = trial
        delta = np.zeros(problem.num_ops + 1, dtype=np.int64)
        for t in sched.timings:
            delta[t.freed_after + 1] -= t.nbytes
            delta[t.prefetch_at] += t.nbytes
        est = problem.baseline_live.astype(np.int64) + np.cumsum(delta)[:-1]
    return chosen


def plan_offload(problem: Problem, budget_bytes: int, *, seed: int = 0, time_limit: float = 60.0,
                 drop_only: Decisions | None = None, config: OffloadPlanConfig = OffloadPlanConfig(),
                 heuristic: HeuristicConfig = HeuristicConfig()) -> Decisions:
    """Keep, drop or offload (module docstring); ``drop_only``: the drop heuristic's plan if
    already made. ``config``: its tuning; ``heuristic``: the drop heuristic's."""
    deadline = time.perf_counter() + time_limit
    base = drop_only or plan_heuristic(problem, budget_bytes, seed=seed, time_limit=time_limit / 2, config=heuristic)
    if problem.offload is None or not lone_timings(problem):
        return base
    tried: list[Decisions] = [base]
    starts = [[]] + ([list(base.partitions)] if base.partitions else [])
    for parts in starts:
        if time.perf_counter() > deadline and len(tried) > 1:
            break
        on = apply_partitions(problem, parts, base.drops if parts else ())[0] if parts else problem
        for dec in _rounds(on, budget_bytes, deadline, config, heuristic):
            dec.partitions = list(parts)
            tried.append(dec)
    if time.perf_counter() <= deadline and base.drops:
        on = apply_partitions(problem, base.partitions, base.drops)[0] if base.partitions else problem
        swapped = _swap_drops(on, budget_bytes, base, deadline)
        if swapped is not None:
            tried.append(swapped)
        kept = _offload_kept(on, budget_bytes, base, deadline)
        if kept is not None:
            tried.append(kept)
            if time.perf_counter() <= deadline:
                swapped = _swap_drops(on, budget_bytes, kept, deadline)
                if swapped is not None:
                    tried.append(swapped)
    return best_by_simulator(problem, budget_bytes, [dec for dec in tried if dec is base or _replays_of(problem, dec)],
                             heuristic)


def _replays(problem: Problem, sim) -> bool:
    """Whether replay can make every copy back of the simulated plan ``sim`` (on ``problem``,
    partitions applied) where its schedule issues it: at its tensor's unpack or the rebuild
    that reads it first (on demand), or at the last unpack of a saved tensor of the same model
    call in backward (a trigger, :func:`~taichi_plan.problem.offload.trigger_tensor`, as
    replay's own tables look it up). The simulator may choose a forward op too, where there is
    none."""
    if sim.offload is None or not problem.replayable_only:
        return True
    return all(tm.on_demand or trigger_tensor(problem, tm.prefetch_at,
                                              call=int(problem.op_call[problem.producer[tm.tensor]])) is not None
               for tm in sim.offload.timings)


def _replays_of(problem: Problem, dec: Decisions) -> bool:
    """:func:`_replays` of ``dec`` (its partitions applied)."""
    from .result import simulate_plan_of

    if not dec.offloads:
        return True
    try:
        sim, parted = simulate_plan_of(problem, dec)
    except PlanError:
        return False
    return _replays(parted, sim)


def _excess(sim, budget_bytes: int) -> int:
    """Bytes over the budget summed over the step's ops and its recompute groups' peaks."""
    over = int(np.maximum(sim.live_bytes.astype(np.int64) - budget_bytes, 0).sum())
    return over + sum(max(int(g.peak_bytes) - budget_bytes, 0) for g in sim.groups.values())


def _offload_kept(problem: Problem, budget_bytes: int, base: Decisions, deadline: float,
                  rounds: int = 200) -> Decisions | None:
    """``base`` (a drop-only plan over the budget) with saved activations offloaded where it
    peaks. Each round tries the tensors on the device at the plan's peak op after their last
    forward use: kept ones, and dropped ones whose rebuilt copy is live there (copied back
    instead of rebuilt: the copy lives only from its prefetch point, and its dropped inputs,
    which its rebuild re-made with it and held to their own uses, a chain, are rebuilt there
    instead). It takes the one
    that lowers the peak most (or, at the same peak, the bytes over the budget at other ops)
    with no longer stall and the host budget held; where none does, the one that lowers them
    most per second of stall it adds. It stops when the plan fits or nothing helps. A rebuild
    may read an offloaded tensor: it comes back before that rebuild. None when no offload was
    kept or ``base`` already fits."""
    link = problem.offload.host_link_bytes_per_s
    cap = problem.offload.host_budget_bytes
    drops = list(base.drops)
    rows = offload_candidates(problem)
    try:
        sim = simulate(problem, drops, [], link)
    except PlanError:
        return None
    if sim.peak_bytes <= budget_bytes or not rows:
        return None
    offs: list[Offload] = []
    excess = _excess(sim, budget_bytes)
    for _ in range(rounds):
        if sim.peak_bytes <= budget_bytes or time.perf_counter() > deadline:
            break
        j = sim.peak_op
        taken = {o.tensor for o in offs}
        dropped = {d.tensor: d for d in drops}
        best = free = None  # the best trial of all, and of those with no longer stall
        for o in rows:
            if o.tensor in taken or not o.after < j <= int(problem.end[o.tensor]):
                continue
            d = dropped.get(o.tensor)
            if d is not None and not (sim.remat_at.get(o.tensor, o.before) <= j):
                continue  # dropped and not yet rebuilt at the peak: copying it frees nothing there
            trial_drops = [x for x in drops if x is not d] if d is not None else drops
            try:
                trial = simulate(problem, trial_drops, [*offs, o], link)
            except PlanError:
                continue
            ex = _excess(trial, budget_bytes)
            if (trial.peak_bytes, ex) >= (sim.peak_bytes, excess) or trial.peak_bytes > sim.peak_bytes or (
                    cap is not None and trial.host_peak_bytes > cap):
                continue  # neither a lower peak nor, at the same peak, less over the budget elsewhere
            if not all(tm.leaves_device for tm in trial.offload.timings) or not _replays(problem, trial):
                continue  # a copy that frees nothing, or one replay could not issue where it is timed
            # Bytes off the budget per second of extra compute (a longer stall, or a rebuild saved)
            gain = (excess - ex) / max(trial.extra_cost - sim.extra_cost, 1e-9)
            if best is None or gain > best[4]:
                best = (trial, trial_drops, o, ex, gain)
            if trial.stall_cost <= sim.stall_cost + 1e-12 and (free is None or (
                    trial.peak_bytes, ex, trial.extra_cost) < (free[0].peak_bytes, free[3], free[0].extra_cost)):
                free = (trial, trial_drops, o, ex, gain)
        pick = free or best
        if pick is None:
            break
        sim, drops, offs, excess = pick[0], pick[1], [*offs, pick[2]], pick[3]
    if not offs:
        return None
    return Decisions(drops=drops, offloads=offs, partitions=list(base.partitions),
                     notes=[f"the drop-only plan with {len(offs)} tensor(s) offloaded where it peaked over the budget "
                            "(each the one that lowered it most, those with no longer stall first)", *base.notes],
                     stats={**base.stats, "offloaded": len(offs)})


def _swap_drops(problem: Problem, budget_bytes: int, base: Decisions, deadline: float) -> Decisions | None:
    """``base`` (a plan that fits) with drops turned into offloads one at a time, the costliest
    rebuild first, each kept where the simulator finds the plan cheaper, still within the
    budget (and the host budget) and accepted by the simulator: the plan never gets worse
    than ``base`` (None when no swap was kept)."""
    link = problem.offload.host_link_bytes_per_s
    cap = problem.offload.host_budget_bytes
    can = {o.tensor: o for o in offload_candidates(problem)}
    drops, offs = list(base.drops), list(base.offloads)
    first = simulate(problem, drops, offs, link)
    if first.peak_bytes > budget_bytes:
        return None  # only a plan that fits gets cheaper by swaps
    cost = first.extra_cost
    rebuild = problem.rebuild_cost
    for d in sorted(base.drops, key=lambda d: (-float(rebuild[d.tensor]), d.tensor)):
        if time.perf_counter() > deadline:
            break
        o = can.get(d.tensor)
        if o is None:
            continue
        trial_drops = [x for x in drops if x is not d]
        try:
            sim = simulate(problem, trial_drops, [*offs, o], link)
        except PlanError:
            continue
        if sim.peak_bytes <= budget_bytes and (cap is None or sim.host_peak_bytes <= cap) and sim.extra_cost < cost:
            drops, offs, cost = trial_drops, [*offs, o], sim.extra_cost
    if len(offs) == len(base.offloads):
        return None
    return Decisions(drops=drops, offloads=offs, partitions=list(base.partitions),
                     notes=[f"the plan with {len(offs) - len(base.offloads)} of its drops offloaded instead (each swap kept where "
                            "the simulator finds it cheaper and within the budget)", *base.notes],
                     stats={**base.stats, "offloaded": len(offs)})


def _rounds(problem: Problem, budget_bytes: int, deadline: float, config: OffloadPlanConfig,
            heuristic: HeuristicConfig) -> list[Decisions]:
    """Steps 1-4 of the module docstring on ``problem`` (partitions already applied): its plan
    (none, or several tries where a rebuild read an offloaded tensor)."""
    banned: set[int] = set()
    tried: list[Decisions] = []
    if not lone_timings(problem):
        return tried
    for _try in range(config.sweeps):
        if time.perf_counter() > deadline and tried:
            break
        chosen = _choose(problem, budget_bytes, lone_timings(problem), banned)
        if not chosen:
            break
        try:
            dec = plan_remat(problem, budget_bytes, deadline=deadline, offloads=chosen,
                             config=heuristic)
        except PlanError:  # the simulator refused the plan: take the largest offload out
            banned.add(max(chosen, key=lambda o: (problem.nbytes[o.tensor], o.tensor)).tensor)
            continue
        dec.notes = [f"greedy sweep with offload: {len(chosen)} tensor(s) offloaded, then drops where still over",
                     *dec.notes]
        dec.stats["offloaded"] = len(chosen)
        tried.append(dec)
        break
    return tried

