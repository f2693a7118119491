"""The heuristic with offload as a third choice (``solve --offload``; no torch).

Where ``problem.offload`` allows it, a saved activation may be kept, dropped or offloaded
(:mod:`taichi_plan.offload`). An offload costs nothing where its copies hide behind compute,
and its stall where they do not; a drop costs its rebuild. The planner:

1. times each candidate's copies alone on the host link (the stall-free schedule of that one
   offload): the ops during which it is off the device, and its stall alone;
2. sweeps the step left to right as the drop heuristic does (:func:`~.heuristic._sweep`),
   over those intervals, offloading where the step is over budget, ranked by stall per byte
   and op freed (a free copy before any stalling one);
3. lets the simulator time the chosen copies together (FIFO streams: more copies, later
   frees and later copies-in); offloads whose copies free nothing on the device are taken
   out, and, while the copies together stall the step or hold more host bytes than the host
   budget, the one that stalls (or holds) most goes, and the sweep runs again without it;
4. drops what is still over budget with the drop heuristic's sweep (:func:`~.heuristic.plan_remat`),
   the offloaded tensors and every tensor whose rebuild reads one kept out;
5. returns the best plan by the simulator among that one and the drop-only heuristic's, so
   allowing offload never ends above not allowing it.

Not done: the ILP (:mod:`.ilp`) does not model copies; with offload allowed ``auto`` and
``ilp`` weigh its drop-only plan against this one, and claim no lower bound (its bound holds
for plans without offload only).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PlanError
from ..offload import Offload, offload_candidates, schedule_offloads
from ..problem import Problem, rebuild_inputs
from ..simulate import simulate
from .heuristic import _sweep, best_by_simulator, plan_heuristic, plan_remat
from .result import Decisions

MAX_OFFLOAD_ROUNDS = 12  # rounds of taking out the worst offload (step 3)


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
    """The sweep over offload intervals where the unplanned step is over budget."""
    rows = [x for x in lone if x[0].tensor not in banned]
    if not rows:
        return []
    n = problem.num_ops
    sizes = np.asarray([problem.nbytes[o.tensor] for o, *_ in rows], dtype=np.int64)
    # _sweep frees option k over ops a+1 .. b-1: a = first op off - 1, b = first op back
    a = np.asarray([s - 1 for _o, s, _b, _st in rows], dtype=np.int64)
    b = np.asarray([b for _o, _s, b, _st in rows], dtype=np.int64)
    step = max(problem.step_cost, 1e-12)
    costs = np.asarray([st for *_r, st in rows], dtype=np.float64) + 1e-9 * step
    chosen = np.zeros(len(rows), dtype=bool)
    est = problem.baseline_live.astype(np.int64)
    _sweep(est, np.full(n, budget_bytes, dtype=np.int64), sizes, a, b, costs, chosen, np.arange(len(rows)))
    return [rows[k][0] for k in np.nonzero(chosen)[0]]


def _blocked(problem: Problem, offloads: list[Offload]) -> set[int]:
    """Tensors a drop may not take beside ``offloads``: those whose rebuild reads an offloaded one."""
    away = {o.tensor for o in offloads}
    return {int(t) for t in set(problem.candidates.tolist()) if away.intersection(rebuild_inputs(problem, int(t)))}


def plan_offload(problem: Problem, budget_bytes: int, *, seed: int = 0, time_limit: float = 60.0,
                 drop_only: Decisions | None = None) -> Decisions:
    """Keep, drop or offload (module docstring); ``drop_only``: the drop heuristic's plan if
    already made."""
    deadline = time.perf_counter() + time_limit
    base = drop_only or plan_heuristic(problem, budget_bytes, seed=seed, time_limit=time_limit / 2)
    if problem.offload is None or not lone_timings(problem):
        return base
    link = problem.offload.host_link_bytes_per_s
    cap = problem.offload.host_budget_bytes
    banned: set[int] = set()
    tried: list[Decisions] = [base]
    for _ in range(MAX_OFFLOAD_ROUNDS):
        if time.perf_counter() > deadline:
            break
        chosen = _choose(problem, budget_bytes, lone_timings(problem), banned)
        if not chosen:
            break
        sched = simulate(problem, [], chosen, link).offload
        idle = [t.tensor for t in sched.timings if not t.leaves_device]
        if idle:  # freed nothing together: out for good
            banned.update(idle)
            continue
        try:
            dec = plan_remat(problem, budget_bytes, deadline=deadline, offloads=chosen, blocked=_blocked(problem, chosen))
        except PlanError:  # a rebuild's transient reads an offloaded tensor: take the largest out
            banned.add(max(chosen, key=lambda o: (problem.nbytes[o.tensor], o.tensor)).tensor)
            continue
        dec.notes = [f"greedy sweep with offload: {len(chosen)} tensor(s) offloaded, then drops where still over",
                     *dec.notes]
        dec.stats["offloaded"] = len(chosen)
        tried.append(dec)
        sim = simulate(problem, dec.drops, dec.offloads, link)
        over_host = cap is not None and sim.host_peak_bytes > cap
        if sim.offload.stall_s <= 0 and not over_host:
            break
        by = (lambda t: (t.nbytes, t.tensor)) if over_host else (lambda t: (t.stall_s, t.nbytes, t.tensor))
        worst = max(sim.offload.timings, key=by)
        if not over_host and worst.stall_s <= 0:
            break  # stalls of copies queued behind others: none of them alone is to blame
        banned.add(worst.tensor)
    return best_by_simulator(problem, budget_bytes, tried)

