"""Access-pattern driven greedy planner (MegTaiChi / DTR style), fast on 100k-op traces.

Sweep the step left to right. At each op still over budget, drop the active candidate
(its gap covers this op) with the lowest ``cost / (bytes x over-budget ops it covers)``,
the offline form of DTR's cost / (bytes x staleness). The sweep uses each drop's upper
bound on savings; the simulator then judges the result, and any op it still finds over
budget (rebuilt inputs, transients) gets its target lowered by the excess and the sweep
runs again, keeping what was dropped.
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from ..base.errors import PlanError
from ..plan.format import Partition
from ..problem.core import Problem
from ..problem.live import gap_bytes, min_live_bytes
from ..problem.options import options
from ..problem.partition.apply import apply_partitions
from ..problem.partition.cost import partition_cost
from ..problem.partition.find import module_class, module_spans
from ..problem.partition.floor import partition_savings
from ..problem.partition.span import as_partition, is_under
from ..problem.partition.tensors import whole_outputs
from ..simulate.core import Drop, SimResult, simulate, simulate_plan
from .config import HeuristicConfig
from .result import Decisions, host_fits, simulate_plan_of
from .scores import rebuild_cost, sim_over


def _remember(problem: Problem, drops: list[Drop], sim: SimResult, config: HeuristicConfig) -> None:
    kept = problem.__dict__.setdefault("_judged_plans", {})
    kept[tuple(drops)] = sim
    while len(kept) > config.judged_kept:
        del kept[next(iter(kept))]


def _judge(problem: Problem, dec: Decisions, config: HeuristicConfig) -> SimResult:
    """The simulation of ``dec`` (one the heuristic already ran where it has it)."""
    if dec.offloads:
        return simulate_plan_of(problem, dec)[0]
    if not dec.partitions:
        sim = problem.__dict__.get("_judged_plans", {}).get(tuple(dec.drops))
        if sim is not None:
            return sim
    sim, _ = simulate_plan(problem, dec.drops, dec.partitions)
    if not dec.partitions:
        _remember(problem, dec.drops, sim, config)
    return sim


def best_by_simulator(problem: Problem, budget_bytes: int, candidates: list[Decisions],
                      config: HeuristicConfig = HeuristicConfig()) -> Decisions:
    """The best of ``candidates`` as the simulator judges them: the cheapest that fits the
    budget; if none fits, the one with the lowest peak. Ties go to the earlier candidate."""

    def key(dec: Decisions) -> tuple:
        sim = _judge(problem, dec, config)
        fits = sim.peak_bytes <= budget_bytes and host_fits(problem, sim)
        return (0, sim.extra_cost, sim.peak_bytes) if fits else (1, sim.peak_bytes, sim.extra_cost)

    return min(candidates, key=key)


def plan_heuristic(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
                   time_limit: float = 60.0, partitions: bool = True,
                   config: HeuristicConfig = HeuristicConfig()) -> Decisions:
    """Rematerialization alone first; if that cannot meet the budget, partition modules one
    at a time (the one freeing most at the worst op per unit of cost, at the most chunks)
    and plan rematerialization again around them. Past ``time_limit`` seconds it stops adding
    rounds and returns the best plan so far (the simulator still judges it). ``config``: its
    tuning (its local search's included)."""
    deadline = time.perf_counter() + time_limit
    dec = plan_remat(problem, budget_bytes, deadline=deadline, config=config)
    searched = None  # the local search's plan on a recorded step, where it ran and fits
    if budget_bytes is not None and problem.every_gap:
        dec = _with_local_search(problem, budget_bytes, dec, min(deadline, time.perf_counter() + config.local_max_s),
                                 config)
    if budget_bytes is not None and not _fits(problem, dec, budget_bytes, config):
        dec = best_by_simulator(problem, budget_bytes, [dec, *_on_checkpointing(problem, budget_bytes, deadline, config),
                                                        *_by_bytes(problem, budget_bytes, deadline, config)], config)
        until = min(deadline, time.perf_counter() + config.local_max_s)
        if not problem.every_gap and not _fits(problem, dec, budget_bytes, config) and \
                budget_bytes >= int(min_live_bytes(problem).max()) and \
                _search_affordable(problem, dec, until - time.perf_counter(), config):
            # A recorded step whose sweeps all missed: ask the simulator. The sweep scores a drop by
            # the bytes its gap frees; where the peak moves elsewhere once a few drops are taken (a
            # compiled Phi: the LM head's log-softmax, then a block's MLP backward), the next drop it
            # ranks first is not the one the new peak needs. (Not below the least any drops reach,
            # everything droppable dropped: partitions may, drops alone cannot.)
            # (where it fits, the partitions below still start from the sweep's plan, and the
            # cheaper plan wins: the search's first fit is not its cheapest)
            found = _with_local_search(problem, budget_bytes, dec, until, config, lower=False)
            searched = found if _fits(problem, found, budget_bytes, config) else None
    if searched is not None and not partitions:
        return searched
    if budget_bytes is None or not partitions or _fits(problem, dec, budget_bytes, config):
        return dec
    remat_only = dec
    # Each module's savings at its most chunks, once. Split modules, and checkpointed whole only
    # the innermost modules whose outputs a plan may then drop (partition.whole_outputs: a
    # norm keeps its input alone). Ranked by what they free at the worst op alone, an outer
    # module checkpointed whole would win where it merely moves the peak into its backward
    # (GPT-2's whole transformer), and rule out every module inside it. The ILP weighs every
    # option (docs/planner.md).
    spans = module_spans(problem)
    options = []
    for span in spans:
        k = max(span.chunk_choices, default=0)
        if k >= 2:
            options.append((span, k, partition_savings(problem, span, k), partition_cost(problem, span, k)))
        if (1 in span.chunk_choices and not any(o is not span and is_under(o.module, span.module) for o in spans)
                and whole_outputs(problem, span)):
            options.append((span, 1, partition_savings(problem, span, 1), partition_cost(problem, span, 1)))
    best = _add_partitions(problem, budget_bytes, dec, options, deadline, config)
    best.notes.append(f"{len(best.partitions)} module(s) partitioned")
    return best_by_simulator(problem, budget_bytes, [best, remat_only, *([searched] if searched else [])], config)


def _add_partitions(problem: Problem, budget_bytes: int, start: Decisions, options: list,
                    deadline: float, config: HeuristicConfig) -> Decisions:
    """Rounds that add partitions at the worst op, rematerialization re-planned around them,
    the simulator choosing each round's step among trials: the best-scoring options (bytes
    freed at the worst op per unit of cost), 1, 2, 4, ... of them; and, each alone, the
    ``config.tries`` best option classes by that score and by the bytes alone. A class is a
    module and its repeats in the other blocks (the same name up to block indices: repeated
    blocks tie at the worst op, so one of them alone moves the peak, not lowers it). Ranking
    by score alone would take cheap small savings first (an activation's chunks) where one
    costlier option frees what the budget needs (the LM head + loss over tokens), and the
    small ones, once chosen, leave less to drop. Stops when a plan fits or no trial improves
    on the round before."""
    best = start
    chosen: list[Partition] = []
    take = 1
    while options and time.perf_counter() <= deadline:
        sim, parted = simulate_plan(problem, best.drops, best.partitions)
        worst = int(np.argmax(sim_over(parted, sim)))
        free = [o for o in options if o[2][worst] > 0
                and not any(is_under(o[0].module, c.module) or is_under(c.module, o[0].module) for c in chosen)]
        if not free:
            break
        trials = [_compatible(chosen, sorted(free, key=lambda o: -o[2][worst] / max(o[3], 1e-12)), take)]
        classes: dict[tuple, list] = {}
        for o in free:
            classes.setdefault((module_class(o[0].module), o[1]), []).append(o)
        freed = {name: -max(o[2][worst] for o in cls) for name, cls in classes.items()}
        per_cost = {name: f / max(sum(o[3] for o in classes[name]), 1e-12) for name, f in freed.items()}
        for rank in (per_cost, freed):
            for name in sorted(classes, key=rank.__getitem__)[:config.tries]:
                cls = classes[name]
                trial = _compatible(chosen, cls, len(cls))
                if trial not in trials:
                    trials.append(trial)
        decs = []
        for trial in trials:
            if time.perf_counter() > deadline and decs:
                break
            parts, _ = apply_partitions(problem, trial)
            dec = plan_remat(parts, budget_bytes, deadline=deadline, config=config)
            dec.partitions = list(trial)
            decs.append(dec)
        pick = best_by_simulator(problem, budget_bytes, [best, *decs], config)
        if pick is best:
            break
        take = take * 2 if pick is decs[0] else 1
        best, chosen = pick, list(pick.partitions)
        options = [o for o in options if not any(o[0].module == c.module for c in chosen)]
        if _fits(problem, best, budget_bytes, config):
            break
    return best


def _compatible(chosen: list[Partition], ranked: list, take: int) -> list[Partition]:
    """``chosen`` plus up to ``take`` of ``ranked`` (in order), none nested in another."""
    out = list(chosen)
    for span, k, _sav, _cost in ranked:
        if len(out) - len(chosen) == take:
            break
        if not any(is_under(span.module, c.module) or is_under(c.module, span.module) for c in out):
            out.append(as_partition(span, k))
    return out


def _on_checkpointing(problem: Problem, budget_bytes: int, deadline: float, config: HeuristicConfig) -> list[Decisions]:
    """The sweep started from what one-line checkpointing drops (every block, sqrt(n) segments:
    each region's forward re-run once), adding drops of other tensors where still over: where
    the sweep alone cannot reach as low, these can, so the heuristic never ends above them."""
    from .baselines import plan_full, plan_sqrt_n

    out = []
    for fn, what in ((plan_full, "checkpointing every block"), (plan_sqrt_n, "sqrt(n) checkpointing")):
        if time.perf_counter() > deadline:
            break
        base = fn(problem, budget_bytes)
        if not base.drops or time.perf_counter() > deadline:
            continue
        try:
            dec = plan_remat(problem, budget_bytes, deadline=deadline, fixed=base.drops, config=config)
        except PlanError:
            # the sweep's drops and the fixed ones together cannot be rebuilt (a fixed region's
            # rebuild needs a tensor the sweep dropped): no plan from this start
            continue
        dec.notes = [f"greedy sweep on top of {what}'s drops", *dec.notes]
        out.append(dec)
    return out


def _by_bytes(problem: Problem, budget_bytes: int, deadline: float, config: HeuristicConfig) -> list[Decisions]:
    """The sweep ranking drops by the bytes and over-budget ops they cover alone, every rebuild
    costing the same. The cost-weighted sweep takes cheap drops first, and on some traces the
    cheap ones, once taken, leave too little to drop where the peak is (a 2-layer GPT-2 whose
    recording under load timed its ops differently ended 3% above a budget that this sweep
    meets): the memory-first order reaches the lowest peak the sweep can, at a higher cost."""
    if time.perf_counter() > deadline:
        return []
    dec = plan_remat(problem, budget_bytes, deadline=deadline, by_bytes=True, config=config)
    dec.notes = ["greedy sweep by bytes alone (the cost-weighted sweep did not fit)", *dec.notes]
    return [dec]


def _with_local_search(problem: Problem, budget_bytes: int, swept: Decisions, deadline: float,
                       config: HeuristicConfig, lower: bool = True) -> Decisions:
    """Also search with the simulator in the loop (:mod:`.local`) and keep the cheaper plan that
    fits (the sweep's when neither does). ``lower``: once it fits, also lower its cost (else
    the first plan that fits: on a recorded step, seconds per budget less; the ILP lowers it)."""
    from .local import local_search

    searching = config.local_search if problem.every_gap else \
        dataclasses.replace(config.local_search, trials=config.local_search.recorded_trials)
    found = local_search(problem, options(problem), budget_bytes, deadline=deadline, config=searching, lower=lower)
    if found is None:
        swept.notes.append("local search found no plan that fits")
        return swept
    drops, sim = found
    _remember(problem, drops, sim, config)
    if _fits(problem, swept, budget_bytes, config) and _judge(problem, swept, config).extra_cost <= sim.extra_cost:
        return swept
    return Decisions(drops=drops, notes=["simulator-driven local search"],
                     stats={"candidates": int(len(problem.candidates)), "dropped": len(drops)})


def _search_affordable(problem: Problem, swept: Decisions, seconds: float, config: HeuristicConfig) -> bool:
    """Could the local search reach a recorded step's budget in ``seconds``? It simulates
    ``recorded_trials`` plans per drop it adds, and it adds about as many as the sweep took: where the
    time of one simulation (measured once per problem) says that takes longer, it is not started.
    (A compiled Phi, 1,585 ops: a simulation takes about a millisecond, and the search reaches its
    budgets in under 2 s; on an eager recording of tens of thousands of ops it would spend its
    whole allowance on a few moves, at every budget a solve's bisection asks for.)"""
    sim_s = problem.__dict__.get("_simulate_s")
    if sim_s is None:
        t = time.perf_counter()
        try:
            simulate(problem, swept.drops)
        except PlanError:
            return False
        sim_s = problem.__dict__["_simulate_s"] = time.perf_counter() - t
    return sim_s * config.local_search.recorded_trials * max(len(swept.drops), 1) <= seconds


def _fits(problem: Problem, dec: Decisions, budget_bytes: int, config: HeuristicConfig) -> bool:
    return _judge(problem, dec, config).peak_bytes <= budget_bytes


def plan_remat(problem: Problem, budget_bytes: int | None, initial: list[Drop] | None = None,
               deadline: float | None = None, fixed: list[Drop] | None = None, by_bytes: bool = False,
               offloads: list | None = None, blocked: set[int] | None = None,
               config: HeuristicConfig = HeuristicConfig()) -> Decisions:
    """The greedy rematerialization sweep (no partitions), starting from the ``initial`` drops
    that are options of ``problem``; no new round starts past ``deadline`` (perf_counter).
    ``fixed`` drops (any, e.g. a baseline's region rebuilds) are kept as they are: the sweep
    starts from the memory they leave and adds drops of other tensors. ``by_bytes`` ranks the
    drops as if every rebuild cost the same (see :func:`_by_bytes`). ``offloads`` (with
    ``problem.offload``) are kept too, their tensors and the ``blocked`` ones never dropped.
    ``config.max_rounds`` rounds at most."""
    if budget_bytes is None or problem.num_ops == 0:
        return Decisions(notes=["no budget: nothing to do"])
    n = problem.num_ops
    opts = options(problem)
    sizes = problem.nbytes[opts.tensor].astype(np.int64)
    a_arr, b_arr = opts.free_after, opts.remat_before
    costs = np.ones(len(opts)) if by_bytes else rebuild_cost(problem, opts)
    group = opts.cand  # options of one tensor share their candidate index
    chosen = np.zeros(len(sizes), dtype=bool)
    key = {(int(t), int(b)): k for k, (t, b) in enumerate(zip(opts.tensor.tolist(), b_arr.tolist(), strict=True))}
    for d in initial or []:
        k = key.get((d.tensor, d.remat_before))
        if k is not None and opts.free_after[k] == d.free_after and not chosen[group == group[k]].any():
            chosen[k] = True

    fixed = list(fixed or [])
    offloads = list(offloads or [])
    link = problem.offload.host_link_bytes_per_s if offloads else None
    if fixed or offloads or blocked:
        held = np.isin(opts.tensor, [d.tensor for d in fixed] + [o.tensor for o in offloads] + sorted(blocked or ()))
        chosen[held] = False
        est = sim_over(problem, simulate(problem, fixed, offloads, link))
    else:
        held = None
        est = problem.baseline_live.astype(np.int64)
    target = np.full(n, budget_bytes, dtype=np.int64)
    best: tuple[list[Drop], SimResult] | None = None
    rounds = 0
    for rounds in range(1, config.max_rounds + 1):  # noqa: B007
        before = int(chosen.sum())
        _sweep(est, target, sizes, a_arr, b_arr, costs, chosen, group, held)
        drops = fixed + [Drop(int(opts.tensor[k]), int(a_arr[k]), int(b_arr[k])) for k in np.nonzero(chosen)[0]]
        sim = simulate(problem, drops, offloads, link)
        if best is None or sim.peak_bytes <= budget_bytes or (
                best[1].peak_bytes > budget_bytes and sim.peak_bytes < best[1].peak_bytes):
            best = (drops, sim)
        if sim.peak_bytes <= budget_bytes:
            break
        if rounds > 1 and int(chosen.sum()) == before:
            break  # nothing left to drop where it is over: the heuristic cannot reach the budget
        if deadline is not None and time.perf_counter() > deadline:
            break
        # The simulator found more than the sweep's estimate (rebuilt inputs, transients):
        # lower the target by the excess where it is over, and sweep again.
        over = sim_over(problem, sim) - budget_bytes
        target[over > 0] -= over[over > 0]
    drops, sim = best
    if not offloads:
        _remember(problem, drops, sim, config)
    return Decisions(drops=drops, offloads=offloads, notes=[f"greedy sweep, {rounds} round(s) checked by the simulator"],
                     stats={"rounds": rounds, "candidates": int(len(sizes)), "dropped": len(drops)})


def _sweep(est, target, sizes, a_arr, b_arr, costs, chosen, group, held=None) -> None:
    """Greedy left-to-right pass adding drops to ``chosen`` until ``est - saved <= target``;
    at most one option per ``group`` (tensor), none of the ``held`` options' tensors."""
    n = len(est)
    taken = np.zeros(int(group.max()) + 1 if len(group) else 0, dtype=bool)
    taken[group[chosen]] = True
    if held is not None:
        taken[group[held]] = True
    over_ops = (est - gap_bytes(n, a_arr[chosen], b_arr[chosen], sizes[chosen])) > target
    prefix = np.concatenate([[0], np.cumsum(over_ops)])
    cover = prefix[b_arr] - prefix[np.minimum(a_arr + 1, n)]
    score = costs / (np.maximum(sizes, 1) * np.maximum(cover, 1))
    order = np.argsort(a_arr, kind="stable")
    saved_delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(saved_delta, a_arr[chosen] + 1, sizes[chosen])
    np.add.at(saved_delta, b_arr[chosen], -sizes[chosen])
    heap: list[tuple[float, int]] = []
    j = 0
    saved = 0
    for i in range(n):
        saved += saved_delta[i]
        while j < len(order) and a_arr[order[j]] + 1 <= i:
            k = order[j]
            if not taken[group[k]] and cover[k] > 0:
                heapq.heappush(heap, (score[k], int(k)))
            j += 1
        need = est[i] - saved - target[i]
        while need > 0 and heap:
            _, k = heapq.heappop(heap)
            if b_arr[k] <= i or taken[group[k]]:
                continue
            chosen[k] = True
            taken[group[k]] = True
            saved += sizes[k]
            saved_delta[b_arr[k]] -= sizes[k]
            need -= sizes[k]
