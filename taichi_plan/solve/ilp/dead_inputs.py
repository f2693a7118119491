"""The dead-input rules of the CP-SAT relaxation (forward-only graphs, with revivals): a
rebuild that reads a tensor dead by then needs it back, kept (its bytes held in memory),
revived or made again (its ops re-run). A mixin of :class:`~taichi_plan.solve.ilp.model.RelaxationModel`.
"""

from __future__ import annotations

import numpy as np

from ...problem.core import rebuild_inputs
from ...problem.options import revivable


class DeadInputsMixin:
    """The dead-input rules (:meth:`_dead_inputs`), built once with the model."""

    def _dead_inputs(self, rerun_of, ops_all: np.ndarray) -> None:
        """[Constraint] (forward-only graphs, with revivals) a rebuild that reads a tensor
        dead by then needs it back: kept since its last op, its bytes in memory all along, or
        made again, its rebuild ops re-run. Without these the relaxation counts neither (any
        dead input may be kept, so no transient is certain) and its bound stays at each
        drop's own re-run (gaps of 45-53% on ``random_layered``).

        Variables: ``rem[u]``, ``u`` re-made after its last op; ``held[u][e]``, ``u`` kept
        and in memory through run op ``e`` (so through ``end[u]+1 .. e``; an implication chain
        over ``e``), which adds its bytes at those ops (:meth:`add_op`). Where the group
        rebuilding a dropped ``t`` runs decides how long a kept input must be held: before
        its own point ``b``, or earlier when a group inside its gap re-runs an op that reads
        ``t`` (re-makes a reader of ``t`` while ``t`` is gone). ``remake[v, c]``/``via``
        bound when that can happen, per cell of group points (cells end before each
        budget-binding op, where the held bytes are checked). A dead input needed at a group
        may also be revived by then (``rev_held[u][e]``: its bytes from the revival's point
        through ``e``), or re-made in that group (``T[u, q]``), whose own dead inputs are then
        needed there too, one level down (``config.remade_depth``; below it ``rem[u]`` stands
        for the re-make): before, a re-made input's inputs had to be kept only through its own
        last op, and a revival held nothing, so the relaxation re-made inputs for free in
        memory (``random_layered`` n250 at 0.9: bound 1.00846 against the plan's 1.00904,
        now proven optimal). Every constraint is an upper bound on such an indicator or an
        implication that a plan's true values satisfy, so the model stays a relaxation
        (``tests/test_ilp_exhaustive.py``, imported space; ``tests/test_relaxation_plans.py``,
        plan by plan, also on graphs whose tensors have many uses). The terms of each rule
        are in the comments below."""
        problem, model, st = self.problem, self.model, self.st
        if not problem.every_gap or not len(self.z):
            return
        ok = set(revivable(problem).tolist())
        end = problem.end
        keep_of = {int(u): j for j, u in enumerate(self.rv.tensor.tolist())
                   if self.rv.remat_before[j] == end[u] + 1}

        def held(u: int, e: int):
            hs = self.held.setdefault(u, {})
            if e not in hs:
                hs[e] = model.NewBoolVar(f"h{u}_{e}")
                if u in keep_of:
                    model.AddImplication(hs[e], self.z[keep_of[u]])
            return hs[e]

        def remade(u: int):
            """rem[u], with its re-run cost and the needs of its own rebuild (once per u)."""
            if u in self.rem:
                return self.rem[u]
            v = self.rem[u] = model.NewBoolVar(f"m{u}")
            if not problem.rematerializable[u]:
                model.Add(v == 0)
                return v
            for p in problem.rebuild_ops[u].tolist():
                # re-made after its last op: in a group apart from its dropped gaps' rebuilds
                model.Add(rerun_of(p) >= v + sum(self.x[k] for k in self._gaps_of.get((p, u), ())))
            for w in rebuild_inputs(problem, u):
                if w in ok and end[w] <= end[u]:
                    model.AddBoolOr([v.Not(), remade(w), held(w, int(end[u]))])
            return v

        for j, w in enumerate(self.rv.tensor.tolist()):
            if self.rv.remat_before[j] > end[w] + 1:
                self.revs_of.setdefault(int(w), []).append(j)

        def rev_held(u: int, e: int):
            """The literal: ``u`` revived by a rebuild at a point <= ``e`` and in memory through
            op ``e`` (None when no revival of ``u`` can be): at most the revivals that may be
            there by then (each pays its own re-run)."""
            hs = self.rev_held.setdefault(u, {})
            if e not in hs:
                js = [j for j in self.revs_of.get(u, ()) if self.rv_lo[j] <= e]
                if not js:
                    hs[e] = None
                else:
                    v = hs[e] = model.NewBoolVar(f"rh{u}_{e}")
                    model.Add(v <= sum(self.z[j] for j in js))
            return hs[e]

        again: dict[tuple[int, int], object] = {}
        deep: dict[tuple[int, int], int] = {}  # (u, q) -> levels of inputs its rule follows

        def remade_at(u: int, q: int, depth: int):
            """T[u, q]: ``u`` re-made (a transient, or a revival's rebuild) in a group before an
            op >= ``q`` for a rebuild there that reads it (None when ``u`` cannot be re-made).
            Its own dead inputs are needed in that group too (:func:`there`, ``depth`` levels
            down), and it is a re-make after its last op (``rem[u]``, which pays the re-run): at
            depth 0, where no rule follows its inputs, ``rem[u]`` itself stands for it."""
            if depth <= 0:
                return remade(u) if problem.rematerializable[u] else None
            key = (u, q)
            if key not in again:
                again[key] = None
                if problem.rematerializable[u]:
                    v = model.NewBoolVar(f"T{u}_{q}")
                    model.AddImplication(v, remade(u))
                    again[key] = v
            v = again[key]
            if v is not None and depth > deep.get(key, 0):
                deep[key] = depth
                for w in rebuild_inputs(problem, u):
                    if w in ok and end[w] < q - 1:
                        there(w, q, v, depth - 1)
            return v

        def there(u: int, q: int, need, depth: int = self.config.remade_depth) -> None:
            """[Constraint] ``need`` (a literal or a sum of them): a group before an op >= ``q``
            reads ``u``, dead by then (``end[u] < q - 1``). In a plan ``u`` is then kept through
            op ``q - 1`` (``held``), revived by then and in memory at ``q - 1`` (``rev_held``:
            a revival is held from its point to its last reader's group), or re-made in a group
            at ``q`` or later (``remade_at``, whose own inputs are needed there in turn). So a
            rebuild's dead inputs are paid for in memory or in re-runs all the way down: before,
            a re-made input's own inputs had to be kept only through its last op."""
            terms = [held(u, q - 1)]
            terms += [lit for lit in (rev_held(u, q - 1), remade_at(u, q, depth)) if lit is not None]
            model.Add(sum(terms) >= need)

        readers = self._readers()
        opts_of: dict[int, list[int]] = {}
        for c, w in enumerate(st.tensor.tolist()):
            opts_of.setdefault(w, []).append(c)
        # Where a kept tensor's memory is checked: at the budget-binding ops. Group points are
        # cut into cells at each binding op + 1, so that each cell ends right before one.
        cuts = sorted({int(i) + 1 for i in ops_all.tolist()} | {problem.num_ops})
        cell_of = np.searchsorted(np.asarray(cuts), np.arange(problem.num_ops + 1), side="right")
        lo_of = [1, *cuts]  # cell c: points lo_of[c] .. lo_of[c + 1] - 1 (cell of point p: cell_of[p])

        def cell(c: int) -> tuple[int, int]:
            return lo_of[c], (lo_of[c + 1] - 1 if c + 1 < len(lo_of) else problem.num_ops)

        # remake[v, c]: some group of cell c re-runs v's rebuild ops. Only when an option of v
        # rebuilt there, a revival of v rebuilt there, or a reader w of v re-made there while v
        # may be gone (via[v, c]: dead and not kept, or inside one of its dropped gaps).
        # Upper bounds only: a plan's true values satisfy them.
        remake: dict[tuple[int, int], object] = {}
        via: dict[tuple[int, int], object] = {}
        direct: dict[tuple[int, int], list] = {}
        for c, w in enumerate(st.tensor.tolist()):
            direct.setdefault((w, int(cell_of[st.b[c]])), []).append(self.x[c])
        for j, w in enumerate(self.rv.tensor.tolist()):
            if self.rv.remat_before[j] > end[w] + 1:  # a keep re-runs nothing
                direct.setdefault((w, int(cell_of[self.rv.remat_before[j]])), []).append(self.z[j])

        gone_lit: dict[tuple[int, int], object] = {}

        def gone(v: int, c: int):
            """None (never) or a literal: may v be gone at some group of cell c (one per pair:
            its constraints are upper bounds, the same for every reader)."""
            if (v, c) not in gone_lit:
                gone_lit[(v, c)] = gone_new(v, c)
            return gone_lit[(v, c)]

        def gone_new(v: int, c: int):
            first, last = cell(c)
            ways = [self.x[k] for k in opts_of.get(v, ()) if st.a[k] < last and first <= st.b[k]]
            if last > end[v]:  # dead at its last points, unless kept (through op last - 1)
                if v not in ok:
                    return True
                g = model.NewBoolVar(f"g{v}_{c}")
                model.Add(g + held(v, last - 1) <= 1 + sum(ways))
                return g
            if not ways:
                return None
            g = model.NewBoolVar(f"g{v}_{c}")
            model.Add(g <= sum(ways))
            return g

        def reached(v: int, c: int):
            """via[v, c]: some reader of v re-made in cell c while v may be gone (None when it
            cannot hold). One literal for all readers, at most their re-makes' sum and at most
            gone: in a plan, 1 exactly when some via[w, v, c] of one literal per reader would be,
            and in the LP never above gone (their sum could reach gone times the readers)."""
            key = (v, c)
            if key not in via:
                via[key] = None
                g = gone(v, c)
                if g is not None:
                    rs = [r for w in readers.get(v, ()) if (r := remade_in(w, c)) is not None]
                    if rs:
                        lit = model.NewBoolVar(f"c{v}_{c}")
                        model.Add(lit <= sum(rs))
                        if g is not True:
                            model.Add(lit <= g)
                        via[key] = lit
            return via[key]

        def remade_in(v: int, c: int):
            """remake[v, c] (None when it cannot hold)."""
            key = (v, c)
            if key in remake:
                return remake[key]
            remake[key] = None  # while its readers are followed (the graph has no cycles)
            causes = list(direct.get(key, ()))
            causes += [lit for lit in (reached(v, c),) if lit is not None]
            if not causes:
                return None
            r = model.NewBoolVar(f"rm{v}_{c}")
            model.Add(r <= sum(causes))
            first, last = cell(c)
            if last > end[v]:
                # re-made after its last op (it pays its re-run), or before it, inside a gap of
                # its own (an option of v covering that point is chosen)
                inside = [self.x[k] for k in opts_of.get(v, ()) if first <= end[v] and st.a[k] < min(last, int(end[v]))
                          and first <= st.b[k]]
                if v in ok:
                    model.Add(remade(v) + sum(inside) >= r)
                elif not problem.rematerializable[v]:
                    model.Add(sum(inside) >= r)
                else:
                    for op in problem.rebuild_ops[v].tolist():
                        model.Add(rerun_of(op) + sum(inside) >= r)
            remake[key] = r
            return r

        gaps: dict[tuple[int, int], list[int]] = {}
        for k, (t, a) in enumerate(zip(st.tensor.tolist(), st.a.tolist(), strict=True)):
            gaps.setdefault((t, a), []).append(k)
        for (t, a), ks in gaps.items():
            bmax = max(int(st.b[k]) for k in ks)
            dead = [u for u in rebuild_inputs(problem, t) if u in ok and end[u] < bmax - 1]
            if not dead:
                continue
            chosen = sum(self.x[k] for k in ks)  # at most one option per gap
            for u in dead:  # dead at any group after a: kept through op a at least
                if end[u] <= a:
                    model.Add(remade(u) + held(u, a) >= chosen)
                    if end[u] < a:
                        there(u, a + 1, chosen)
            # late[q] (q a cut): the gap's tensor is rebuilt in a group before op q or later:
            # an option with point >= q chosen, and no reader of it re-made in a cell from the
            # one of point a + 1 to the one ending at q - 1 (early[q]).
            lo = max(min(int(end[u]) for u in dead) + 2, a + 2)
            e_prev, c_next = None, int(cell_of[a + 1])
            for q in cuts:
                if q > bmax:
                    break
                if q <= a + 1:
                    continue
                new = []
                while c_next < len(lo_of) and cell(c_next)[1] <= q - 1:
                    new += [lit for lit in (reached(t, c_next),) if lit is not None]
                    c_next += 1
                if new or e_prev is not None:
                    eq = model.NewBoolVar(f"e{t}_{a}_{q}")
                    model.Add(eq <= sum(new) + (e_prev if e_prev is not None else 0))
                    e_prev = eq
                    self.early.setdefault((t, a), {})[q] = eq
                at_least = [self.x[k] for k in ks if st.b[k] >= q]
                if q < lo or not at_least:
                    continue
                lq = model.NewBoolVar(f"lt{t}_{a}_{q}")
                model.Add(lq >= sum(at_least) - (e_prev if e_prev is not None else 0))
                for u in dead:
                    if q - 1 > end[u]:  # u is dead at that group: kept through op q - 1, or re-made
                        model.Add(remade(u) + held(u, q - 1) >= lq)
                        there(u, q, lq)
        for hs in self.held.values():  # held through a later op: held through every earlier one
            es = sorted(hs)
            for e1, e2 in zip(es, es[1:]):
                model.AddImplication(hs[e2], hs[e1])
        for u, hs in self.rev_held.items():
            # revived and held through e2, by a revival whose points are all <= e1 (no later
            # one chosen): held through e1 too
            es = sorted(e for e, v in hs.items() if v is not None)
            for e1, e2 in zip(es, es[1:]):
                late = [self.z[j] for j in self.revs_of[u] if self.rv_hi[j] > e1]
                model.Add(hs[e1] >= hs[e2] - sum(late))
