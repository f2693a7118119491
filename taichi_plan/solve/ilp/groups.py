"""The recompute-group rows of the CP-SAT relaxation: at a group the simulator found over
budget, what a rebuild alone allocates there must be covered by bytes away, unless another
chosen rebuild may move it earlier (which tensors a rebuild may need, per window). A mixin of
:class:`~taichi_plan.solve.ilp.model.RelaxationModel`.
"""

from __future__ import annotations

import time

import numpy as np

from ...problem.core import rebuild_inputs
from ...problem.options import rebuild_closure
from ...simulate.core import Drop, rebuild_overhead


class GroupConstraintsMixin:
    """Constraints at recompute groups (:meth:`add_group`), valid for every plan."""

    def _gone(self, u: int, lo: int, hi: int) -> bool:
        """Can tensor ``u`` be gone at a group before an op in ``lo..hi``: dead before then,
        or inside one of its gaps?"""
        return bool(self.problem.end[u] < hi) or any(a < hi and b > lo for a, b in self._gaps.get(u, ()))

    def _may_need(self, c: int, t: int, lo: int, hi: int) -> bool:
        """Can a rebuild of option ``c`` in a group before an op in ``lo..hi`` need tensor
        ``t``? The simulator follows a rebuild's inputs only through tensors gone then
        (:meth:`_gone`). A superset of what it can need."""
        problem = self.problem
        seen = {int(self.st.tensor[c])}
        stack = list(seen)
        while stack:
            for u in rebuild_inputs(problem, stack.pop()):
                if u == t:
                    return True
                if u in seen or not problem.rematerializable[u]:
                    continue
                seen.add(u)
                if self._gone(u, lo, hi):
                    stack.append(u)
        return False

    def _may_need_tensor(self, t: int, lo: int, hi: int) -> set[int]:
        """The tensors whose rebuild in a group before an op in ``lo..hi`` may need ``t``
        (:meth:`_may_need` for all at once): one walk from ``t`` to the rebuilds that read it."""
        read_by = self._readers()
        out: set[int] = set()
        walked = {t}
        stack = [t]
        while stack:
            for x in read_by.get(stack.pop(), ()):
                out.add(x)
                if x in walked:
                    continue
                if self._gone(x, lo, hi):
                    walked.add(x)
                    stack.append(x)
        return out

    def add_group(self, r: int, budget: int, deadline: float | None = None) -> None:
        """[Constraint] the recompute group before op ``r``, for each option ``k`` rebuilt
        there (``b[k] == r``), valid for every plan: if ``k`` is dropped and no other chosen
        option can move its rebuild earlier (none whose rebuild may need it runs inside its
        gap) and no module is partitioned, the group holds what crosses from op r-1 to op r
        (less what is away then, counted as if every option covering it were away) plus at
        least what a rebuild of ``k`` alone allocates at its worst moment (its tensor and the
        transients its chain needs: those are gone whatever the plan, and more rebuilds in
        the group only add to it). So those bytes away must cover the excess; a candidate
        ``k``'s rebuild reads is never away there (it is brought back into the group)."""
        if r in self.groups:
            return
        self.groups.add(r)
        problem, st, model, x = self.problem, self.st, self.model, self.x

        def crossing(q: int) -> int:
            return int(problem.nbytes[(problem.start <= q - 1) & (problem.end >= q)].sum())

        for k in np.nonzero(st.b == r)[0].tolist():
            if deadline is not None and time.perf_counter() > deadline:
                return  # the constraints not added only weaken the relaxation
            # An option that stands for others (merged_structure) is rebuilt before one of the
            # ops lo..r: the constraint below holds for each (its condition implies each
            # point's, its cover holds each point's, its excess is the least of theirs).
            lo = r if self.first_point is None else int(self.first_point[k])
            t = int(st.tensor[k])
            a = int(st.a[k])
            excess = None
            for q in range(lo, r + 1):
                if problem.every_gap:
                    # With revivals a dead input may be kept or rebuilt ahead (no transient chain
                    # is certain), but when t's producer runs, t and every input of it are in memory.
                    p = int(problem.rebuild_ops[t][0])
                    lone = int(st.sizes[k]) + sum(int(problem.nbytes[u]) for u in problem.op_reads[p].tolist()
                                                  if u != t and not problem.held(u, q))
                else:
                    lone = rebuild_overhead(problem, Drop(t, a, q))
                e = crossing(q) - int(st.sizes[k]) + lone - budget
                excess = e if excess is None else min(excess, e)
            if excess <= 0:
                continue
            maybe = np.nonzero((st.a < r - 1) & (st.b > a) & (st.tensor != t))[0].tolist()
            if len(st.sizes) <= self.config.chain_max_options:  # each option over its own window
                movers = [c for c in maybe if self._may_need(c, t, max(a, int(st.a[c])) + 1,
                                                             min(r - 1, int(st.b[c])))]
            else:  # one walk over the widest window, a+1..r-1, for all (a superset)
                may = self._may_need_tensor(t, a + 1, r - 1)
                movers = [c for c in maybe if int(st.tensor[c]) in may]
            # A revival rebuilt inside the gap whose rebuild may need t brings t back there.
            revivers = []
            if len(self.z):
                may = self._may_need_tensor(t, a + 1, r - 1)
                revivers = [j for j in np.nonzero((self.rv_hi > a) & (self.rv_lo < r))[0].tolist()
                            if int(self.rv.tensor[j]) in may]
            cond = [x[k], *(x[c].Not() for c in movers), *(self.z[j].Not() for j in revivers),
                    *(v.Not() for v in self.y)]
            # What k's rebuild reads is brought back into this group if it is away: not away.
            if problem.every_gap:
                held = {u for u in rebuild_inputs(problem, t) if u in self.cand_set}
            else:
                held = set(rebuild_closure(problem, t, a, self.cand_set)[1])
            cover = [j for j in np.nonzero((st.a < r) & (st.b >= lo))[0].tolist()
                     if j != k and int(st.tensor[j]) not in held]
            unit = self.byte_unit
            if int(st.sizes[cover].sum()) < excess:
                model.AddBoolOr([v.Not() for v in cond])
            else:
                model.Add(sum(self.sizes[j] * x[j] for j in cover) >= -(-excess // unit)).OnlyEnforceIf(cond)
            self.terms += len(cover) + len(movers)
