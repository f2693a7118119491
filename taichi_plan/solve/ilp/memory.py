"""The memory rows of the CP-SAT relaxation at ops: at each modelled op the bytes dropped and
still away (a rebuild that needs a tensor brings it back early), freed by partitions, less the
dead tensors kept there, cover the op's excess over the budget; and the plan-finding
tightening that each rebuild's own working set fits. A mixin of
:class:`~taichi_plan.solve.ilp.model.RelaxationModel`.
"""

from __future__ import annotations

import numpy as np

from ...simulate.core import Drop, rebuild_overhead


class MemoryConstraintsMixin:
    """Constraints at ops (:meth:`add_op`) and the rebuild tightening (:meth:`add_rebuild_constraints`)."""

    def add_rebuild_constraints(self, budget: int, overheads: dict[int, int]) -> None:
        """[Constraint] (a tightening, not valid for every plan: plan-finding model only) a
        rebuild's own working set must fit: the bytes dropped around its rebuild point cover
        what the rebuild adds over the budget."""
        problem, st, model, x = self.problem, self.st, self.model, self.x
        live = problem.baseline_live
        for k in range(len(st.sizes)):
            r = int(st.b[k])
            if k not in overheads:
                overheads[k] = rebuild_overhead(problem, Drop(int(st.tensor[k]), int(st.a[k]), r))
            # Carried into the group: what was live during op r-1 minus what op r-1 freed is at
            # most live[r-1]; the rebuilt tensor itself is part of the overhead.
            excess = int(live[r - 1]) + overheads[k] - int(st.sizes[k]) - budget
            if excess <= 0:
                continue
            cover = np.nonzero((st.a < r - 1) & (r - 1 < st.b))[0]
            cover = cover[cover != k]
            if int(st.sizes[cover].sum()) < excess:
                model.Add(x[k] == 0)
                continue
            model.Add(sum(int(st.sizes[j]) * x[j] for j in cover.tolist()) >= excess).OnlyEnforceIf(x[k])

    def _back(self, k: int, i: int):
        """The literal saying option ``k``'s tensor is back in memory at op ``i`` because a
        reader of it was re-made inside its gap by then (the latest ``early[q]``, q <= i + 1),
        or None."""
        es = self.early.get((int(self.st.tensor[k]), int(self.st.a[k])))
        q = None if not es else max((q for q in es if q <= i + 1), default=None)
        return None if q is None else es[q]

    def add_op(self, i: int, extra: int = 0) -> None:
        """[Constraint] memory at op ``i``: the dropped-and-still-away bytes cover the excess
        (plus ``extra`` bytes: a tightening, in the plan-finding model only)."""
        st, model, x, y = self.st, self.model, self.x, self.y
        self.ops.add(i)
        cover = np.nonzero((st.a < i) & (i < st.b))[0].tolist()
        cov_set = set(cover)
        away = {}
        forced = {}
        for k in cover:
            if not self.chains:  # away over its whole gap: the weaker relaxation
                away[k] = x[k]
                continue
            direct = [c for c in st.needers[k] if st.b[c] <= i and st.a[c] < i]
            chain = [c for c in st.needers[k] if c in cov_set]
            if not direct and not chain:
                away[k] = x[k]
                continue
            f = model.NewBoolVar(f"f{k}_{i}")
            forced[k] = f
            for c in direct:
                model.AddImplication(x[c], f)
            aw = model.NewBoolVar(f"w{k}_{i}")
            model.AddImplication(aw, x[k])
            model.AddBoolOr([aw.Not(), f.Not()])
            away[k] = aw
        by_gap: dict[tuple[int, int], list[int]] = {}  # without chains: one literal per gap
        for k in cover:
            # [Constraint] (forward-only graphs) a reader of k's tensor re-made inside its gap
            # before op i + 1 (early[q], q <= i + 1; _dead_inputs) brought it back: not away at i.
            back = self._back(k, i)
            if back is None:
                continue
            if away[k] is x[k] and not self.chains:
                by_gap.setdefault((int(st.tensor[k]), int(st.a[k])), []).append(k)
                continue
            if away[k] is x[k]:
                away[k] = model.NewBoolVar(f"wb{k}_{i}")
                model.AddImplication(away[k], x[k])
            model.AddBoolOr([away[k].Not(), back.Not()])
        gap_terms = []
        for ks in by_gap.values():  # at most one option of a gap is chosen
            w = model.NewBoolVar(f"wb{ks[0]}_{i}")
            model.Add(w <= sum(x[k] for k in ks))
            model.AddBoolOr([w.Not(), self._back(ks[0], i).Not()])
            gap_terms.append(self.sizes[ks[0]] * w)
            for k in ks:
                del away[k]
        for k in cover:
            if k in forced:
                for c in st.needers[k]:
                    if c in cov_set and c in forced:
                        # [Constraint] c dropped and brought back by op i brings k back too.
                        model.AddBoolOr([x[c].Not(), forced[c].Not(), forced[k]])
                        self.terms += 1
        unit = self.byte_unit
        need = -(-(int(self.req[i]) + extra) // unit)
        part_terms = [(-(-int(po.savings[i]) // unit)) * y[j] for j, po in enumerate(self.parts) if po.savings[i] > 0]
        # A dead tensor kept through op i (_dead_inputs) is in memory there: its bytes rounded
        # down to the unit, so the constraint stays a relaxation.
        kept = []
        for u, hs in self.held.items():
            if self.problem.end[u] < i:
                e = min((e for e in hs if e >= i), default=None)
                if e is not None and int(self.problem.nbytes[u]) >= unit:
                    kept.append((int(self.problem.nbytes[u]) // unit) * hs[e])
        # A revived tensor held through op e >= i is in memory at i unless its revival may come
        # after i (a point past i: then it counts nothing here).
        for u, hs in self.rev_held.items():
            if self.problem.end[u] >= i or int(self.problem.nbytes[u]) < unit:
                continue
            e = min((e for e, v in hs.items() if e >= i and v is not None), default=None)
            if e is None:
                continue
            late = [self.z[j] for j in self.revs_of[u] if self.rv_hi[j] > i]
            if late:
                pres = model.NewBoolVar(f"rp{u}_{i}")
                model.Add(pres >= hs[e] - sum(late))
            else:
                pres = hs[e]
            kept.append((int(self.problem.nbytes[u]) // unit) * pres)
        model.Add(sum(self.sizes[k] * away[k] for k in cover if k in away) + sum(gap_terms) + sum(part_terms)
                  - sum(kept) >= need)
        self.terms += len(cover)
