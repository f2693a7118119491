"""FSDP2's ``reshard_after_forward`` and prefetching per unit, decided with the activation plan.

A unit that does not reshard after forward keeps its gathered parameters from the end of its
forward to its backward (memory), and skips its backward all-gather and copy-out (time on the
interconnect); one that reshards to a smaller mesh of K ranks keeps 1/K of them and gathers
them in backward within that group (on a node's links where the job spans nodes).
:mod:`taichi_plan.problem.sharding.reshard` derives both steps from the recorded one. Here the planner picks
the setting: it orders those changes by what each costs where the budget binds (the bytes
held longer times the ops, in that interval, at which the unplanned step is over the budget),
per second of gathering saved, and screens prefixes of that order (the recorded setting first;
every prefix of a short order, else doubling lengths and a bisection) with the heuristic: the
predicted step time, i.e. the step's compute and communication plus the plan's extra
compute, of the cheapest plan that fits the budget picks the setting. The chosen method
(CP-SAT for ``auto``) then plans that setting.

Prefetching (:mod:`taichi_plan.problem.sharding.prefetch`) is screened next, on the chosen reshard setting: from
the leanest setting (every all-gather issued by its own unit, FSDP's backward default off), the
gatherings a plan may issue early are ordered by what holding their all-gather buffer early
costs where the budget binds (its bytes times the ops, over the interval it is held longer, at
which the unplanned step is over the budget) per second of all-gather it may hide; the recorded
setting (FSDP's defaults), every prefix of that order from the longest down, are screened with
the heuristic as above.

Those two screens run one after the other (the *sequential* choice). The choice is then made
joint over the pairs (:func:`screen_joint`): each other reshard setting screened, best first,
gets its own prefetch screen, every pair planned with the heuristic, while the screening time
lasts; the pair with the least predicted step time that fits wins, so the joint choice is never
worse than the sequential one and is better where a reshard setting that lost with FSDP's
default prefetching wins with another (``tests/test_reshard.py`` shows one on a recorded trace).

Predicted step time, here, is the step's time with collectives overlapping compute
(:func:`taichi_plan.problem.sharding.overlap.overlapped_step_time`) plus the plan's recomputation.

The search is over settings, outside the activation model (a setting changes the op sequence,
which the ILP indexes): the setting is chosen by the heuristic's plans, the activations of the
chosen one by the method asked for, whose lower bound holds for that setting only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..base.errors import InfeasibleBudgetError
from ..base.units import format_bytes, format_cost
from ..plan.format import Plan
from ..problem.core import Problem
from ..problem.sharding.decisions import held_bytes, regather_cost
from ..problem.sharding.overlap import is_collective, overlapped_step_time
from ..problem.sharding.prefetch import PHASES, movable, prefetch_problem, setting_of
from ..problem.sharding.reshard import reshard_problem
from ..problem.sharding.smaller_mesh import smaller_mesh_saving
from ..problem.sharding.units import reshard_units, smaller_mesh_factors
from ..simulate.core import simulate_plan
from .config import FsdpConfig, HeuristicConfig
from .heuristic import plan_heuristic


def evaluate(prob: Problem, budget_bytes: int, seed: int, deadline: float,
             heuristic: HeuristicConfig = HeuristicConfig()) -> dict:
    """The heuristic's plan of ``prob`` under ``budget_bytes`` (``heuristic``: its tuning):
    whether it fits, its peak, its recomputation and the predicted step time (overlapped step
    time + recomputation)."""
    if prob.baseline_peak[0] <= budget_bytes:
        peak, extra = prob.baseline_peak[0], 0.0
    else:
        dec = plan_heuristic(prob, budget_bytes, seed=seed, time_limit=max(deadline - time.perf_counter(), 0.1),
                             config=heuristic)
        sim, _ = simulate_plan(prob, dec.drops, dec.partitions)
        peak, extra = sim.peak_bytes, sim.extra_cost
    return {"fits": bool(peak <= budget_bytes), "peak_bytes": int(peak), "step_compute": prob.step_cost,
            "extra_compute": float(extra), "step_time": overlapped_step_time(prob).step_time + float(extra)}


def _binding(problem: Problem, budget_bytes: int):
    """Ops at which the unplanned step is over ``budget_bytes``, between two ops (a function of
    the interval, end excluded)."""
    cum = np.concatenate([[0], np.cumsum(problem.baseline_live > budget_bytes)])
    return lambda lo, hi: int(cum[hi] - cum[lo]) if hi > lo else 0


def unit_moves(problem: Problem, budget_bytes: int) -> list[tuple]:
    """The units a plan may stop resharding, as ``(key, -saved, unit, False)``: the key the
    bytes kept gathered times the ops of that interval at which the unplanned step is over
    ``budget_bytes`` (0 where the budget does not bind there), per second of backward gathering
    saved. Sorted, cheapest first (ties: more time saved first)."""
    binding = _binding(problem, budget_bytes)
    keys = []
    for k in reshard_units(problem.trace.meta):
        size, lo, hi = held_bytes(problem, k)
        saved = regather_cost(problem, k)
        if size > 0 and saved > 0:
            keys.append((size * binding(lo, hi) / saved, -saved, k, False))
    return sorted(keys)


def smaller_mesh_choice(problem: Problem) -> dict[int, int]:
    """Per unit that may reshard to a smaller mesh on this trace, the K the screen tries: the
    largest factor of the shard group (strictly between 1 and it) whose ranks share a node, so
    that the backward all-gather runs on the node's links (else the least factor). Not the root
    (backward gathers it first anyway), and none on a trace of measured op times: the steps
    :func:`taichi_plan.problem.sharding.smaller_mesh.smaller_mesh_view` does not derive."""
    from ..trace.devices import get_profile

    meta = problem.trace.meta
    factors = smaller_mesh_factors(meta)
    if meta.get("mode") != "fake" or not meta.get("device_profile") or not factors:
        return {}
    node = get_profile(meta["device_profile"]).devices_per_node
    within = [k for k in factors if k <= node]
    k = max(within) if within else min(factors)
    units = meta["fsdp"]["units"]
    return dict.fromkeys((u for u in reshard_units(meta) if units[u]["module"]), k)  # the root's not derived


def smaller_mesh_moves(problem: Problem, budget_bytes: int, choice: dict[int, int]) -> list[tuple]:
    """The units of ``choice`` resharding to its K, as ``(key, -saved, unit, K)``: the key the
    post-forward shards' bytes times the ops, from the end of their forward to their backward
    gathering, at which the unplanned step is over ``budget_bytes``, per second it saves; units
    that save nothing are left out. Sorted, cheapest first."""
    binding = _binding(problem, budget_bytes)
    keys = []
    for u, k in choice.items():
        kept, saved = smaller_mesh_saving(problem, u, k)
        _size, lo, hi = held_bytes(problem, u)
        if kept > 0 and saved > 0:
            keys.append((kept * binding(lo, hi) / saved, -saved, u, k))
    return sorted(keys)


def setting_key(changes: dict[int, bool | int]) -> tuple:
    """A reshard setting (unit -> False or K) as a key: its items, sorted."""
    return tuple(sorted((int(u), v) for u, v in changes.items()))


def _entry(changes: dict) -> dict:
    """How a screened setting is reported: the units not resharding, and those resharding to
    a smaller mesh (``[[unit, K], ...]``)."""
    return {"units": sorted(u for u, v in changes.items() if v is False),
            "to": [[u, v] for u, v in sorted(changes.items()) if v is not False]}


def changes_of_entry(entry: dict) -> dict:
    return {**dict.fromkeys(entry["units"], False), **{int(u): int(k) for u, k in entry.get("to", [])}}


def prefix_lengths(n: int, config: FsdpConfig = FsdpConfig()) -> list[int]:
    """The prefix lengths a screen tries first, shortest first: every one up to
    ``config.full_prefixes`` units, else the powers of two and ``n`` (a 70B model's 81 units: 8
    settings, where each takes a heuristic plan of a 29k-op step), refined later by bisection."""
    if n <= config.full_prefixes:
        return list(range(1, n + 1))
    return sorted({min(1 << i, n) for i in range(n.bit_length() + 1)} | {n})


def setting_moves(problem: Problem, budget_bytes: int) -> list[tuple[int, bool | int]]:
    """Every change the screen may make to the recorded setting, ``(unit, False or K)``,
    cheapest first in one order for both kinds (:func:`unit_moves`, :func:`smaller_mesh_moves`
    on :func:`smaller_mesh_choice`). A unit may come twice: where its smaller mesh comes first
    (cheaper where the budget binds), keeping it gathered later replaces it; the other way
    round, the later move is left out."""
    choice = smaller_mesh_choice(problem)
    moves = unit_moves(problem, budget_bytes) + (smaller_mesh_moves(problem, budget_bytes, choice) if choice else [])
    return [(u, v) for *_, u, v in sorted(moves, key=lambda m: m[:3])]


def screen(problem: Problem, budget_bytes: int, seed: int, deadline: float, config: FsdpConfig = FsdpConfig(),
           heuristic: HeuristicConfig = HeuristicConfig()) -> tuple[dict, list[dict]]:
    """The setting (unit -> False, or K: a smaller mesh) whose heuristic plan fits
    ``budget_bytes`` with the least predicted step time, among the recorded setting and the
    prefixes of :func:`setting_moves` at :func:`prefix_lengths`, then, by bisection, between the
    longest prefix that fits and the next one tried (more units changed shortens the step while
    it fits), while time is left. Returns it and what each setting gave (``[{"units", "to",
    "fits", "peak_bytes", "step_compute", "extra_compute", "step_time"}]``)."""
    moves = setting_moves(problem, budget_bytes)
    tried: list[dict] = []
    seen: dict[tuple, dict] = {}
    best: tuple[float, dict] | None = None

    def prefix(n: int) -> dict:
        out: dict = {}
        for u, v in moves[:n]:  # a unit's first move, or keeping it gathered after its smaller mesh
            if u not in out or (v is False and out[u] is not False):
                out[u] = v
        return out

    def run(n: int) -> dict | None:
        nonlocal best
        changes = prefix(n)
        key = setting_key(changes)
        if key in seen:
            return seen[key]
        if seen and time.perf_counter() > deadline:
            return None
        got = evaluate(reshard_problem(problem, changes), budget_bytes, seed, deadline, heuristic)
        seen[key] = got
        tried.append({**_entry(changes), **got})
        if got["fits"] and (best is None or got["step_time"] < best[0]):
            best = (got["step_time"], changes)
        return got

    lengths = [0, *prefix_lengths(len(moves), config)]
    fits = {}
    for n in lengths:
        got = run(n)
        if got is None:
            break
        fits[n] = got["fits"]
    lo = max((n for n, ok in fits.items() if ok), default=0)
    over = [n for n in lengths if n > lo and n in fits]
    hi = min(over) if over else lo
    while hi - lo > 1:  # bisect where the lengths tried jumped
        mid = (lo + hi) // 2
        got = run(mid)
        if got is None:
            break
        lo, hi = (mid, hi) if got["fits"] else (lo, mid)
    return (best[1] if best else {}), tried


def prefetch_order(problem: Problem, budget_bytes: int) -> list[tuple[str, int]]:
    """The gatherings a plan may issue early (``(pass, unit)``), cheapest first: the bytes of
    the all-gather buffer held longer, times the ops of that interval at which the unplanned
    step is over ``budget_bytes``, per second of all-gather it may hide (its collective's cost);
    ties by that time, more first."""
    over = problem.baseline_live > budget_bytes
    cum = np.concatenate([[0], np.cumsum(over)])
    trace = problem.trace
    kind = trace.tensors["kind"].to_numpy()
    alloc = trace.tensors["alloc_op"].to_numpy().astype(np.int64)
    nbytes = trace.tensors["nbytes"].to_numpy().astype(np.int64)
    keys = []
    for ph, gs in movable(trace).items():
        for g in gs:
            size = int(nbytes[(kind == "all_gather") & (alloc >= g.start) & (alloc <= g.end)].sum())
            hide = float(sum(problem.op_cost[i] for i in range(g.start, g.end + 1) if is_collective(problem.op_name[i])))
            if hide <= 0:
                continue
            lo, hi = (g.start, g.wait) if g.early else (int(g.by_hook_end), g.start)  # held longer when early
            binding = int(cum[hi] - cum[lo]) if hi > lo else 0
            keys.append((size * binding / hide, -hide, PHASES.index(ph), g.unit))
    return [(PHASES[p], u) for *_, p, u in sorted(keys)]


def screen_prefetch(problem: Problem, budget_bytes: int, seed: int, deadline: float,
                    first: dict | None = None, heuristic: HeuristicConfig = HeuristicConfig()
                    ) -> tuple[dict[str, set[int]], list[dict]]:
    """The prefetch setting (units gathered early per pass) whose heuristic plan fits
    ``budget_bytes`` with the least predicted step time: the recorded one, then each prefix of
    :func:`prefetch_order` over the leanest setting, the longest first, while time is left;
    and what each gave (``[{"forward", "backward", "fits", ...}]``). ``first``: what the
    recorded setting gives, when already known (it is not planned again)."""
    recorded = setting_of(problem.trace)
    order = prefetch_order(problem, budget_bytes)
    moved = {(ph, u) for ph, u in order}
    lean = {ph: {u for u in recorded[ph] if (ph, u) not in moved} for ph in PHASES}
    settings = [recorded] + [{ph: lean[ph] | {u for p, u in order[:j] if p == ph} for ph in PHASES}
                             for j in range(len(order), -1, -1)]
    tried: list[dict] = []
    best: tuple[float, dict] | None = None
    seen = []
    for k, early in enumerate(settings):
        if early in seen:
            continue
        if k > 0 and time.perf_counter() > deadline:
            break
        seen.append(early)
        got = first if k == 0 and first is not None else evaluate(prefetch_problem(problem, early), budget_bytes,
                                                                  seed, deadline, heuristic)
        tried.append({**{ph: sorted(early[ph]) for ph in PHASES}, **got})
        if got["fits"] and (best is None or got["step_time"] < best[0]):
            best = (got["step_time"], early)
    return (best[1] if best else recorded), tried


def _best(tried: list[dict]) -> dict | None:
    """The setting screened that fits with the least predicted step time (the first of equals)."""
    fits = [t for t in tried if t["fits"]]
    return min(fits, key=lambda t: t["step_time"]) if fits else None


def screen_joint(problem: Problem, budget_bytes: int, seed: int, deadline: float, *, reshard: bool = True,
                 prefetch: bool = True, config: FsdpConfig = FsdpConfig(), heuristic: HeuristicConfig = HeuristicConfig()
                 ) -> tuple[dict, dict[str, set[int]], dict]:
    """The reshard and prefetch settings chosen together: the sequential choice first
    (:func:`screen`, then :func:`screen_prefetch` on its setting, each a third of the time to
    ``deadline``), then, while time is left, every other reshard setting screened (best first)
    with its own prefetch screen; the pair whose heuristic plan fits ``budget_bytes`` with the
    least predicted step time. Returns (the reshard setting: unit -> False or K, early
    gatherings per pass, what was screened: ``{"reshard", "prefetch", "joint", "sequential",
    "pairs"}``, ``prefetch`` being the chosen reshard setting's screen)."""
    third = max(deadline - time.perf_counter(), 0.0) / 3
    units, tried = (screen(problem, budget_bytes, seed, time.perf_counter() + third, config, heuristic) if reshard
                    else ({}, []))
    by_units = {setting_key(changes_of_entry(t)): t for t in tried}
    screens: dict[tuple, list[dict]] = {}
    chosen: tuple[dict, dict[str, set[int]] | None] = (units, None)
    best: dict | None = None
    order = [setting_key(units)] + [setting_key(changes_of_entry(t))
                                    for t in sorted(tried, key=lambda t: (not t["fits"], t["step_time"]))
                                    if setting_key(changes_of_entry(t)) != setting_key(units)]
    for j, key in enumerate(order):
        if j > 0 and time.perf_counter() > deadline:
            break
        base = reshard_problem(problem, dict(key))
        if prefetch:
            end = time.perf_counter() + third if j == 0 else deadline
            early, got = screen_prefetch(base, budget_bytes, seed, end, first=by_units.get(key), heuristic=heuristic)
        else:
            early, got = setting_of(base.trace), [by_units.get(key) or evaluate(base, budget_bytes, seed, deadline,
                                                                                 heuristic)]
        screens[key] = got
        pick = _best(got)
        if pick is not None and (best is None or pick["step_time"] < best["step_time"]):
            best, chosen = pick, (dict(key), early)
    seq_key = setting_key(units)
    pairs = [{**_entry(dict(k)), **t} for k, got in screens.items() for t in got]
    seq = _best(screens[seq_key]) if seq_key in screens else None
    early = chosen[1] if chosen[1] is not None else setting_of(reshard_problem(problem, chosen[0]).trace)
    return chosen[0], early, {
        "reshard": tried, "prefetch": screens.get(setting_key(chosen[0]), []), "pairs": pairs,
        "sequential": None if seq is None else {**_entry(units), **seq},
        "joint": None if best is None else {**_entry(chosen[0]), **best}}


def solve_with_fsdp(problem: Problem, budget_bytes: int, seed: int, time_limit: float, started: float,
                    solve_step: Callable[[Problem], Plan], *, reshard: bool = True, prefetch: bool = True,
                    config: FsdpConfig = FsdpConfig(), heuristic: HeuristicConfig = HeuristicConfig()) -> Plan:
    """Choose the units that stop resharding (``reshard``) and the all-gathers issued early
    (``prefetch``) together (:func:`screen_joint`), then plan the chosen step with
    ``solve_step`` (the method asked for); the recorded setting where the method cannot plan
    the chosen one. ``config``: the screen's tuning; ``heuristic``: the tuning of the heuristic
    that plans each setting screened."""
    end = started + time_limit
    share = max(end - time.perf_counter(), 0.0) * config.screen_share
    units, early, screened = screen_joint(problem, budget_bytes, seed, time.perf_counter() + share,
                                          reshard=reshard, prefetch=prefetch, config=config, heuristic=heuristic)
    tried, tried_pf = screened["reshard"], screened["prefetch"]
    base = reshard_problem(problem, units)
    plan = None
    for prob in (prefetch_problem(base, early), base):
        try:
            plan = solve_step(prob)
            break
        except InfeasibleBudgetError:
            continue  # the method could not plan it: the next (its error if none fits)
    if plan is None:
        units = {}
        plan = solve_step(problem)
    unit = problem.trace.cost_unit
    names = [u["module"] or "<root>" for u in problem.trace.meta["fsdp"]["units"]]
    if reshard:
        if units:
            saved = plan.reshard["step_compute_saved"]
            off = [k for k, v in units.items() if v is False]
            to = {k: v for k, v in units.items() if v is not False}
            said = []
            if off:
                said.append(f"FSDP units {', '.join(names[k] for k in off)} do not reshard after forward (keeping "
                            f"{format_bytes(sum(held_bytes(problem, k)[0] for k in off))} gathered)")
            if to:
                said.append("FSDP units reshard after forward to a smaller mesh: "
                            f"{', '.join(f'{names[k]} to {v} ranks' for k, v in to.items())} (keeping "
                            f"{format_bytes(sum(smaller_mesh_saving(problem, k, v)[0] for k, v in to.items()))} "
                            "of post-forward shards)")
            note = (f"{'; '.join(said)}: saves {format_cost(saved, unit)} of backward all-gathers, for "
                    f"{format_cost(plan.solver['extra_compute'], unit)} of recomputation ({len(tried)} setting(s) "
                    "screened)")
        else:
            note = (f"every FSDP unit reshards after forward as recorded: of {len(tried)} setting(s) screened, no "
                    "other fits the budget in less predicted time")
        plan.solver["notes"].insert(0, note)
        plan.solver.setdefault("stats", {})["reshard_screen"] = tried
        if plan.reshard is not None:
            plan.reshard["chosen_by"] = "auto"
    if prefetch and plan.prefetch is not None:
        pf = plan.prefetch
        was, now = pf["recorded_overlap"]["step_time"], pf["overlap"]["step_time"]
        pf["why"] = (f"of {len(tried_pf)} prefetch setting(s) screened, the one with the least predicted step time "
                     f"(collectives overlapping compute, plus recomputation) that fits: early all-gathers "
                     f"forward {', '.join(m or '<root>' for m in pf['forward']) or 'none'}, backward "
                     f"{', '.join(m or '<root>' for m in pf['backward']) or 'none'}; step "
                     f"{format_cost(now, unit)} against {format_cost(was, unit)} as recorded, before recomputation")
        plan.solver["notes"].insert(0 if not reshard else 1, (
            f"FSDP prefetch: {len(pf['units'])} unit(s) set apart from FSDP's defaults; " + pf["why"]))
        plan.solver.setdefault("stats", {})["prefetch_screen"] = tried_pf
        pf["chosen_by"] = "auto"
    seq, joint = screened["sequential"], screened["joint"]
    if reshard and prefetch:
        plan.solver.setdefault("stats", {})["fsdp_joint_screen"] = {
            "pairs": len(screened["pairs"]), "sequential": seq, "joint": joint}
        if seq is not None and joint is not None and joint["step_time"] < seq["step_time"]:
            plan.solver["notes"].insert(2, (
                f"FSDP settings chosen jointly ({len(screened['pairs'])} reshard and prefetch pair(s) screened): "
                f"{format_cost(joint['step_time'], unit)} predicted step against {format_cost(seq['step_time'], unit)} "
                "for the best prefetching on the reshard setting chosen first"))
    if plan.solver.get("lower_bound") is not None:
        plan.solver["notes"].append("the lower bound and gap are the activation plan's for this FSDP setting "
                                    "(reshard and prefetch fixed as chosen), not a bound over every setting")
    return plan
