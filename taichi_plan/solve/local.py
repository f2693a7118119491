"""Simulator-in-the-loop local search over drops (a plan finder, never a bound).

The sweep of :mod:`.heuristic` scores drops by the bytes they free over their gap, an upper
bound that ignores what their rebuilds hold: on forward-only graphs with many uses, where a
gap may be rebuilt before any of its ops and rebuilds need long chains of transients, its
plans peak in recompute groups and miss the budget. This search asks the simulator instead.

* **Reach the budget**: estimate, for every option not chosen, the excess it removes (its
  bytes at each op of its gap over budget, less what its lone rebuild adds over budget at
  its group) per unit of rebuild cost; simulate the ``TRIALS`` best, and the moves of the
  drops rebuilt in the group most over budget (elsewhere in their gap, or undone); take the
  one with the least added cost per byte of excess removed (the excess summed over every op
  and group), until nothing is over budget or no move helps.
* **Lower the cost**: undo drops, and move rebuilds to points of their gap that cost less,
  while the plan still fits, most expensive drops first; failing that, undo a drop and reach
  the budget again without its gap (ruin and recreate).

Every plan is simulated, so what it returns peaks and costs exactly what the simulator says.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import PlanError
from ..problem import Options, Problem
from ..simulate import Drop, SimResult, rebuild_overhead, simulate
from .heuristic import rebuild_cost, sim_over

TRIALS = 48  # best-estimated moves simulated per step


class _State:
    """A plan as one chosen option per candidate gap, with its simulation."""

    def __init__(self, problem: Problem, opts: Options, budget: int):
        self.problem, self.opts, self.budget = problem, opts, budget
        self.by_cand: dict[int, list[int]] = {}
        for k, c in enumerate(opts.cand.tolist()):
            self.by_cand.setdefault(c, []).append(k)
        self.sizes = problem.nbytes[opts.tensor].astype(np.int64)
        self.cost = np.maximum(rebuild_cost(problem, opts), 1e-12)
        self._overhead: dict[int, int] = {}

    def overhead(self, k: int) -> int:
        """Bytes a lone rebuild of option ``k`` allocates at its worst (cached)."""
        if k not in self._overhead:
            o = self.opts
            self._overhead[k] = rebuild_overhead(self.problem, Drop(int(o.tensor[k]), int(o.free_after[k]),
                                                                    int(o.remat_before[k])))
        return self._overhead[k]

    def drops(self, chosen: dict[int, int]) -> list[Drop]:
        o = self.opts
        return [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k])) for k in chosen.values()]

    def judge(self, chosen: dict[int, int]) -> tuple[int, float, SimResult, np.ndarray] | None:
        """(bytes over budget summed over ops, extra cost, result, per-op peak) or None when
        the plan cannot run."""
        try:
            sim = simulate(self.problem, self.drops(chosen))
        except PlanError:
            return None
        over = sim_over(self.problem, sim)
        excess = np.maximum(over - self.budget, 0)
        return int(excess.sum()), sim.extra_cost, sim, over


def local_search(problem: Problem, opts: Options, budget: int, deadline: float | None = None
                 ) -> tuple[list[Drop], SimResult] | None:
    """Reach ``budget`` from no drops, then lower the cost; returns the plan found that fits,
    or None. No move starts past ``deadline`` (perf_counter)."""
    st = _State(problem, opts, budget)
    chosen: dict[int, int] = {}
    cur = st.judge(chosen)
    chosen, cur = _reach(st, chosen, cur, deadline)
    if cur[0] > 0:
        return None
    chosen, cur = _lower_cost(st, chosen, cur, deadline)
    return st.drops(chosen), cur[2]


def _reach(st: _State, chosen: dict[int, int], cur, deadline: float | None, banned: frozenset[int] = frozenset()):
    """Best moves (never an option of a ``banned`` gap) until nothing is over budget, no move
    helps or the deadline passes; returns the last plan and its judgement."""
    while cur[0] > 0:
        if deadline is not None and time.perf_counter() > deadline:
            break
        step = _best_move(st, chosen, cur, deadline, banned)
        if step is None:
            break
        chosen, cur = step
    return chosen, cur


def _best_move(st: _State, chosen: dict[int, int], cur, deadline: float | None, banned: frozenset[int] = frozenset()
               ) -> tuple[dict[int, int], tuple] | None:
    o = st.opts
    excess, cost, sim, over = cur
    w = int(np.argmax(over))
    # Rank the options not chosen by an estimate (bytes of excess their gap removes, less what
    # their lone rebuild adds over budget at its group, per unit of rebuild cost); simulate the best.
    ex = np.maximum(over - st.budget, 0)
    prefix = np.concatenate([[0], np.cumsum(ex)])
    sizes = st.sizes
    est = np.zeros(len(o))
    live = sim.live_bytes
    for k in range(len(o)):
        if k % 256 == 0 and deadline is not None and time.perf_counter() > deadline:
            return None
        c = int(o.cand[k])
        if chosen.get(c) == k or c in banned:
            continue
        a, b = int(o.free_after[k]), int(o.remat_before[k])
        if prefix[b] - prefix[a + 1] == 0:
            continue
        gain = float(np.minimum(ex[a + 1:b], sizes[k]).sum())
        group = int(live[b - 1]) - int(sizes[k]) + st.overhead(k) - st.budget
        est[k] = gain - max(0, group - int(ex[b]))
    ok = np.nonzero(est > 0)[0]
    ranked = ok[np.argsort(st.cost[ok] / est[ok], kind="stable")][:TRIALS]
    trials = [{**chosen, int(o.cand[k]): int(k)} for k in ranked.tolist()]
    # Drops rebuilt in the group at w: move them elsewhere in their gap, or undo them.
    for c, k in chosen.items():
        t, a = int(o.tensor[k]), int(o.free_after[k])
        if sim.remat_at_drop.get((t, a)) != w:
            continue
        trials.append({x: y for x, y in chosen.items() if x != c})
        for j in st.by_cand[c]:
            b = int(o.remat_before[j])
            if j != k and (b == w - 1 or b == w + 1 or over[b] <= st.budget):
                trials.append({**chosen, c: j})
    best = None
    for trial in trials:
        if deadline is not None and time.perf_counter() > deadline:
            break
        got = st.judge(trial)
        if got is None or got[0] >= excess:
            continue
        val = (got[1] - cost) / (excess - got[0])
        if best is None or val < best[0]:
            best = (val, trial, got)
    return None if best is None else (best[1], best[2])


def _lower_cost(st: _State, chosen: dict[int, int], cur, deadline: float | None):
    """While the plan fits, most expensive drops first: undo a drop or move its rebuild to a
    cheaper point of its gap; failing that, undo it and reach the budget again without that
    gap (ruin and recreate). Repeated while it helps."""

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    improved = True
    while improved and not late():
        improved = False
        for c in sorted(chosen, key=lambda c: -st.cost[chosen[c]]):
            if c not in chosen or late():
                continue
            trials = [{x: y for x, y in chosen.items() if x != c}]
            trials += [{**chosen, c: j} for j in st.by_cand[c] if j != chosen[c]]
            for trial in trials:
                if late():
                    return chosen, cur
                got = st.judge(trial)
                if got is not None and got[0] == 0 and got[1] < cur[1] - 1e-12:
                    chosen, cur = trial, got
                    improved = True
                    break
            if improved:
                break
            trial = {x: y for x, y in chosen.items() if x != c}
            got = st.judge(trial)
            if got is None:
                continue
            trial, got = _reach(st, trial, got, deadline, banned=frozenset([c]))
            if got[0] == 0 and got[1] < cur[1] - 1e-12:
                chosen, cur = trial, got
                improved = True
                break
    return chosen, cur
