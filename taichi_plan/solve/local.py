"""Simulator-in-the-loop local search over drops (a plan finder, never a bound).

The sweep of :mod:`.heuristic` scores drops by the bytes they free over their gap, an upper
bound that ignores what their rebuilds hold: on forward-only graphs with many uses, where a
gap may be rebuilt before any of its ops and rebuilds need long chains of transients, its
plans peak in recompute groups and miss the budget. This search asks the simulator instead.

* **Reach the budget**: estimate, for every option not chosen, the excess it removes (its
  bytes at each op of its gap over budget, less what its lone rebuild adds over budget at
  its group) per unit of rebuild cost; simulate the best ``trials``
  (:class:`~taichi_plan.solve.config.LocalSearchConfig`), and the moves of the drops rebuilt
  in the group most over budget (elsewhere in their gap, or undone); take the one with the
  least added cost per byte of excess removed (the excess summed over every op and group),
  until nothing is over budget or no move helps.
* **Lower the cost**: undo drops, and move rebuilds to points of their gap that cost less,
  while the plan still fits, most expensive drops first; failing that, undo a drop and reach
  the budget again without its gap (ruin and recreate).
* **Revivals** (simulate.py): a tensor a group re-makes as a transient may instead be kept
  past its last op, or rebuilt once ahead of its first group (where its inputs are still
  live, or where memory is lowest), and held for every later group that reads it. Tried
  for the transients of the group most over budget while reaching it, and for every
  transient while lowering the cost.

Every plan is simulated, so what it returns peaks and costs exactly what the simulator says.
"""

from __future__ import annotations

import time

import numpy as np

from ..base.errors import PlanError
from ..problem.core import Problem, rebuild_inputs
from ..problem.options import Options, revivable
from ..simulate.core import Drop, SimResult, rebuild_overhead, simulate
from .config import LocalSearchConfig
from .scores import rebuild_cost, sim_over


class _State:
    """A plan as one chosen option per candidate gap, with its simulation."""

    def __init__(self, problem: Problem, opts: Options, budget: int, config: LocalSearchConfig = LocalSearchConfig()):
        self.problem, self.opts, self.budget = problem, opts, budget
        self.config = config
        self.by_cand: dict[int, list[int]] = {}
        for k, c in enumerate(opts.cand.tolist()):
            self.by_cand.setdefault(c, []).append(k)
        self.sizes = problem.nbytes[opts.tensor].astype(np.int64)
        self.cost = np.maximum(rebuild_cost(problem, opts), 1e-12)
        self._overhead: dict[int, int] = {}
        self.own_cost = np.maximum(np.asarray([float(problem.rerun_cost[problem.rebuild_ops[t]].sum())
                                               for t in opts.tensor.tolist()]), 1e-12)
        self._dead: dict[int, list[int]] = {}
        self.revive = True  # may moves add revivals?
        # bytes each op allocates (its outputs), to estimate what crosses into a group
        self.made = np.bincount(problem.start, weights=problem.nbytes, minlength=problem.num_ops).astype(np.int64)
        self.revivable = np.zeros(len(problem.nbytes), dtype=bool)
        self.revivable[revivable(problem)] = True

    def overhead(self, k: int) -> int:
        """Bytes a lone rebuild of option ``k`` allocates at its worst (cached)."""
        if k not in self._overhead:
            o = self.opts
            self._overhead[k] = rebuild_overhead(self.problem, Drop(int(o.tensor[k]), int(o.free_after[k]),
                                                                    int(o.remat_before[k])))
        return self._overhead[k]

    def drops(self, chosen: dict[int, int]) -> list[Drop]:
        """Keys >= 0 are candidate gaps (value: option); a key ``-1 - u`` revives tensor
        ``u`` before the op its value names."""
        o, end = self.opts, self.problem.end
        return [Drop(int(o.tensor[k]), int(o.free_after[k]), int(o.remat_before[k])) if c >= 0
                else Drop(-1 - c, int(end[-1 - c]), k) for c, k in chosen.items()]

    def dead_inputs(self, k: int) -> list[int]:
        """The inputs of option ``k``'s rebuild ops that are dead by its rebuild point and may
        be kept instead (revivals; cached)."""
        if not self.revive:
            return []
        if k not in self._dead:
            o, problem = self.opts, self.problem
            t, b = int(o.tensor[k]), int(o.remat_before[k])
            self._dead[k] = [u for u in rebuild_inputs(problem, t) if self.revivable[u] and problem.end[u] < b]
        return self._dead[k]

    def revivals(self, chosen: dict[int, int], u: int, first: int, over: np.ndarray) -> list[dict[int, int]]:
        """Plans reviving ``u`` (re-made as a transient, first in the group before op
        ``first``) instead: kept past its last op; rebuilt before ``first``, before the last
        op its rebuild inputs are all still live, or where the plan's memory is lowest."""
        problem = self.problem
        if not self.revive or not self.revivable[u]:
            return []
        end = int(problem.end[u])
        points = [end + 1]
        hi = min(first, int(problem.remat_deadline[u]))
        if problem.rematerializable[u] and end + 2 <= hi:
            inputs = rebuild_inputs(problem, u)
            early = min([int(problem.end[v]) for v in inputs if not problem.persists[v]] + [hi])
            points += [hi, end + 2 + int(np.argmin(over[end + 2:hi + 1]))]
            if early >= end + 2:
                points.append(early)
        key = -1 - u
        return [{**chosen, key: s} for s in dict.fromkeys(points) if chosen.get(key) != s]

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


def local_search(problem: Problem, opts: Options, budget: int, deadline: float | None = None,
                 config: LocalSearchConfig = LocalSearchConfig(), lower: bool = True
                 ) -> tuple[list[Drop], SimResult] | None:
    """Reach ``budget`` from no drops, then (``lower``) lower the cost; returns the plan found
    that fits, or None. No move starts past ``deadline`` (perf_counter).

    Two searches: with revivals from the start (what reaches Moccasin's plans on n100), then,
    with the time left, one without them (revival moves lead the greedy reach astray on some
    graphs: ``random_layered`` n250 at 0.9 ends over budget with them) whose plan is then
    lowered with revivals. The cheaper plan that fits wins. Where no tensor may be revived (a
    recorded step), the one search without them gets all the time. ``config``: its tuning."""
    st = _State(problem, opts, budget, config)
    found = []
    start = time.perf_counter()
    searches = (True, False) if st.revivable.any() else (False,)  # (no revivals: one search, all the time)
    for revive in searches:
        if found and deadline is not None and time.perf_counter() > deadline:
            break
        st.revive = revive
        # the first search gets config.first_share of the time, the second what is left
        until = start + config.first_share * (deadline - start) if revive and deadline is not None else deadline
        chosen: dict[int, int] = {}
        cur = st.judge(chosen)
        chosen, cur = _reach(st, chosen, cur, until)
        if cur[0] > 0:
            continue
        if lower:
            chosen, cur = _lower_cost(st, chosen, cur, until)
        if lower and not revive and len(searches) > 1 and (deadline is None or time.perf_counter() <= deadline):
            st.revive = True
            chosen, cur = _lower_cost(st, chosen, cur, deadline)
        found.append((cur[1], len(found), st.drops(chosen), cur[2]))
    if not found:
        return None
    _cost, _i, drops, sim = min(found)
    return drops, sim


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
    est_keep = np.zeros(len(o))
    end, sizes_of = st.problem.end, st.problem.nbytes
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
        carried = int(live[b]) - int(st.made[b])  # what crosses into the group before op b
        group = carried - int(sizes[k]) + st.overhead(k) - st.budget
        est[k] = gain - max(0, group - int(ex[b]))
        dead = st.dead_inputs(k)
        if dead:  # with its dead inputs kept (revivals): no chain re-made, but they are held
            held = np.zeros(b - a - 1, dtype=np.int64)  # kept bytes at ops a+1..b-1
            worse = 0  # and their bytes at ops over budget before the gap
            for u in dead:
                e = int(end[u])
                held[max(e - a, 0):] += int(sizes_of[u])
                worse += int(sizes_of[u]) * int(np.count_nonzero(ex[e + 1:a + 1]))
            gain_keep = float(np.minimum(ex[a + 1:b], np.maximum(sizes[k] - held, 0)).sum())
            group = carried + int(held[-1]) - st.budget
            est_keep[k] = gain_keep - worse - max(0, group - int(ex[b]))
    moves = [(st.cost[k] / est[k], k, False) for k in np.nonzero(est > 0)[0].tolist()]
    moves += [(st.own_cost[k] / est_keep[k], k, True) for k in np.nonzero(est_keep > 0)[0].tolist()]
    moves.sort()
    trials = []
    for _v, k, keep in moves[:st.config.trials]:
        trial = {**chosen, int(o.cand[k]): int(k)}
        if keep:
            trial.update({-1 - u: int(end[u]) + 1 for u in st.dead_inputs(k)})
        trials.append(trial)
    # Transients of the group at w: revive them (made earlier, or kept); revivals: undo.
    for u in sorted(sim.transients.get(w, ())):
        trials += st.revivals(chosen, u, w, over)
    for c in chosen:
        if c < 0:
            trials.append({x: y for x, y in chosen.items() if x != c})
            u = -1 - c
            first, last = sim.revived.get(u, (w + 1, w))
            if first <= w <= last and st.revivable[u] and st.problem.rematerializable[u]:
                # held over w: rebuilt after it instead, or wherever memory is lowest before its reader
                trials += [t for t in st.revivals(chosen, u, last + 1, over) if t[c] > w or t[c] == first]
                if w + 1 <= min(last + 1, int(st.problem.remat_deadline[u])):
                    trials.append({**chosen, c: w + 1})
    # Drops rebuilt in the group at w: move them elsewhere in their gap, or undo them.
    for c, k in chosen.items():
        if c < 0:
            continue
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
        # A move that fits wins over one that does not (the cheapest that fits); among those
        # that do not, the least added cost per byte of excess removed.
        val = (got[0] > 0, got[1] if got[0] == 0 else (got[1] - cost) / (excess - got[0]))
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
        chosen, cur, improved = _revive(st, chosen, cur, late)
        if improved:
            continue
        for c in sorted(chosen, key=lambda c: -st.cost[chosen[c]] if c >= 0 else 0.0):
            if c not in chosen or late():
                continue
            trials = [{x: y for x, y in chosen.items() if x != c}]
            trials += [{**chosen, c: j} for j in st.by_cand.get(c, ()) if j != chosen[c]]
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


def _revive(st: _State, chosen: dict[int, int], cur, late) -> tuple[dict[int, int], tuple, bool]:
    """The first revival of a transient (those re-made in most groups first) that keeps the
    plan within budget and costs less; (plan, judgement, whether it changed)."""
    sim, over = cur[2], cur[3]
    groups: dict[int, list[int]] = {}
    for r in sorted(sim.transients):
        for u in sim.transients[r]:
            groups.setdefault(u, []).append(r)
    for u in sorted(groups, key=lambda u: (-len(groups[u]), u)):
        for trial in st.revivals(chosen, u, groups[u][0], over):
            if late():
                return chosen, cur, False
            got = st.judge(trial)
            if got is not None and got[0] == 0 and got[1] < cur[1] - 1e-12:
                return trial, got, True
    return chosen, cur, False
