"""The CP-SAT relaxation the ILP searches (:func:`~taichi_plan.solve.ilp.plan_ilp`): its
variables, the constraints every plan meets (one gap option per tensor, one chunk count per
module, the re-runs a drop pays), the objective, and what the rounds do to it: the cutoff at the
incumbent, the no-good cuts of simulated plans (a warm start's too), decoding an assignment
into decisions. The memory rows at ops and groups and the dead-input rules are its mixins
(:mod:`.ilp_memory`, :mod:`.ilp_groups`, :mod:`.ilp_dead_inputs`).

Variables and constraints:
* ``x[k]``: option ``k`` is dropped over its gap (free_after, remat_before).
* ``rerun[p] >= x[k]`` for ``p`` one of ``k``'s rebuild ops or of the transients its
  rebuild certainly needs (gone before it is freed); a tensor dropped over several gaps
  pays its rebuild ops once per gap. Objective: sum of their op costs (a lower bound).
* Chains: rebuilding a dropped ``c`` that reads ``t`` brings ``t`` back (the simulator's
  "rebuilt early"). ``forced[t,i]`` says this happened by op ``i``; ``away[t,i]`` says ``t``
  is really absent at ``i``. Only pairs where the forcing is certain are used, so the
  model stays a relaxation.
* Memory at each modelled op ``i``: sum of ``nbytes[t] * away[t,i]`` >= baseline[i] - budget;
  at each modelled recompute group, see :meth:`RelaxationModel.add_group`.
* Forward-only graphs (revivals): an input a rebuild reads after its last op is re-made
  (its ops' cost) or kept, its bytes added at the ops it is held through
  (:meth:`RelaxationModel._dead_inputs`).
Byte coefficients are divided by their GCD (and, if still huge, rounded up to a unit, which
keeps the relaxation); costs are rounded down to a unit of step_cost / 1e7.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from ortools.sat.python import cp_model

from ...problem.core import Problem, rebuild_inputs
from ...problem.options import revival_options
from ...problem.partition.span import as_partition, span_key
from ...simulate.core import Drop, SimResult, is_revival
from ..config import IlpConfig
from ..result import Decisions
from .dead_inputs import DeadInputsMixin
from .groups import GroupConstraintsMixin
from .memory import MemoryConstraintsMixin
from .partitions import PartOption
from .structures import Structure, apart_reruns, merged_revivals


class RelaxationModel(DeadInputsMixin, GroupConstraintsMixin, MemoryConstraintsMixin):
    """The CP-SAT relaxation, built once and grown between rounds: memory constraints at
    more ops, no-good cuts on simulated plans, a cutoff at the incumbent's cost."""

    def __init__(self, problem: Problem, st: Structure, parts: list[PartOption], req: np.ndarray,
                 ops_all: np.ndarray, cost_unit: float, merge_revivals: bool = False,
                 config: IlpConfig = IlpConfig()):
        self.problem, self.st, self.parts, self.req = problem, st, parts, req
        self.config = config
        self.cost_unit = cost_unit
        self.model = model = cp_model.CpModel()
        C = len(st.sizes)
        self.x = x = [model.NewBoolVar(f"x{k}") for k in range(C)]
        self.y = y = [model.NewBoolVar(f"y{j}") for j in range(len(parts))]
        # Revivals (forward-only graphs): z[j] keeps or rebuilds a dead tensor for later groups.
        # They only add memory, which the relaxation leaves out; they enter the no-good cuts.
        self.rv = revival_options(problem)
        # Per revival, the first and last rebuild point it stands for (merged_revivals).
        self.rv_lo = self.rv_hi = self.rv.remat_before
        if merge_revivals:
            self.rv, self.rv_lo, self.rv_hi = merged_revivals(problem, self.rv, ops_all)
        self.z = z = [model.NewBoolVar(f"z{j}") for j in range(len(self.rv))]
        self.ops: set[int] = set()
        self.groups: set[int] = set()
        # Per tensor, its candidate gaps (free_after, latest rebuild point).
        widest: dict[tuple[int, int], int] = {}
        for t, a, b in zip(st.tensor.tolist(), st.a.tolist(), st.b.tolist(), strict=True):
            widest[(t, a)] = max(widest.get((t, a), b), b)
        self._gaps: dict[int, list[tuple[int, int]]] = {}
        for (t, a), b in widest.items():
            self._gaps.setdefault(t, []).append((a, b))
        self.cand_set = set(st.tensor.tolist())
        # Per option, the first rebuild point it stands for (merged_structure); None: its own.
        self.first_point: np.ndarray | None = None
        self.terms = 0
        self.cuts = 0
        # Chain constraints at each modelled op (a dropped tensor brought back early by a
        # rebuild that needs it); without them a tensor counts as away over its whole gap,
        # a weaker relaxation with one row per op (the bound model, bound.py).
        self.chains = True
        # [Constraint] partitions: one chunk count per module, never a module and one inside it,
        # and a partitioned module's insides are not dropped on their own.
        by_module: dict[str, list[int]] = {}
        for j, po in enumerate(parts):
            by_module.setdefault(po.span.module, []).append(j)
        mods = sorted(by_module)
        for i1, m1 in enumerate(mods):
            for m2 in mods[i1 + 1:]:
                if m2.startswith(m1 + "."):
                    model.AddAtMostOne([y[j] for j in by_module[m1] + by_module[m2]])
            model.AddAtMostOne([y[j] for j in by_module[m1]])
        for j, po in enumerate(parts):
            for k in po.internal.tolist():
                model.AddImplication(y[j], x[k].Not())
        # [Constraint] at most one gap option per tensor.
        alts: dict[int, list[int]] = {}
        for k, c in enumerate(st.cand.tolist()):
            alts.setdefault(c, []).append(k)
        for ks in alts.values():
            if len(ks) > 1:
                model.AddAtMostOne([x[k] for k in ks])
        self.alts = alts

        # [Constraint] an op re-runs if any output it produced is dropped; temporaries likewise.
        # A tensor dropped over several gaps is rebuilt in as many groups (its gaps are
        # disjoint), so its rebuild ops run at least that many times.
        rerun: dict[int, cp_model.IntVar] = {}
        gaps_of: dict[tuple[int, int], list[int]] = {}  # (op, tensor) -> options of distinct gaps
        for k in range(C):
            for p in st.own_ops[k]:
                gaps_of.setdefault((p, int(st.tensor[k])), []).append(k)
        most = {}  # op -> the most gaps one of its outputs has
        for (p, _t), ks in gaps_of.items():
            most[p] = max(most.get(p, 1), len({int(st.a[k]) for k in ks}))
        apart = apart_reruns(problem, st, config)
        for p in apart:
            most[p] = max(most.get(p, 1), 2)
        if problem.every_gap:  # one more re-run after its last op (a revival or a re-make): below
            for p, _t in gaps_of:
                most[p] = most.get(p, 1) + 1
        self._gaps_of = gaps_of

        def rerun_of(p: int):
            """The variable counting op ``p``'s re-runs (made on first use)."""
            if p not in rerun:
                rerun[p] = model.NewIntVar(0, most.get(p, 1), f"r{p}")
            return rerun[p]

        # One constraint per option; past config.chain_max_options, one per gap over its options (they
        # share their ops; at most one is chosen). The same plans, but the per-option form
        # solved ResNet-50 at 0.4 to optimality where the per-gap one stalled at 30 s.
        per = [[k] for k in range(C)] if C <= config.chain_max_options else list(alts.values())
        for ks in per:
            for p in [*st.own_ops[ks[0]], *st.temporaries[ks[0]]]:
                model.Add(rerun_of(p) >= sum(x[k] for k in ks))
        for (p, _t), ks in gaps_of.items():
            if most[p] > 1:
                model.Add(rerun[p] >= sum(x[k] for k in ks))
        for p, pairs in apart.items():
            # [Constraint] two options that need op p re-run, rebuilt in groups that cannot be
            # one (their rebuild windows are disjoint), re-run it twice (apart_reruns).
            for i, j in pairs:
                model.Add(rerun[p] >= x[i] + x[j])
        # [Constraint] a tensor revived at most once; one rebuilt (not kept) re-runs its ops.
        by_tensor: dict[int, list[int]] = {}
        for j, u in enumerate(self.rv.tensor.tolist()):
            by_tensor.setdefault(u, []).append(j)
        for js in by_tensor.values():
            model.AddAtMostOne([z[j] for j in js])
            rebuilt = [j for j in js if self.rv.remat_before[j] >= problem.end[self.rv.tensor[j]] + 2]
            u = int(self.rv.tensor[js[0]])
            for p in problem.rebuild_ops[u].tolist() if rebuilt else ():
                # its rebuild runs after its last op, so in a group apart from those of its
                # dropped gaps (each inside its own gap): once more (most[p] has room)
                model.Add(rerun_of(p) >= sum(z[j] for j in rebuilt) + sum(x[k] for k in gaps_of.get((p, u), ())))
        self.rem: dict[int, cp_model.IntVar] = {}
        # (tensor, free_after) of a gap -> {cut q: e}: e says a reader of the tensor was re-made
        # inside the gap before op q, which brings it back there (_dead_inputs, add_op).
        self.early: dict[tuple[int, int], dict[int, cp_model.IntVar]] = {}
        self.held: dict[int, dict[int, cp_model.IntVar]] = {}
        # u -> {e: literal}: u revived (rebuilt after its last op) by op e and in memory
        # through e (_dead_inputs; None where no revival of u can be); counted in add_op.
        self.rev_held: dict[int, dict[int, cp_model.IntVar | None]] = {}
        self.revs_of: dict[int, list[int]] = {}  # tensor -> its rebuilt revivals (z indices)
        # past these sizes CP-SAT cannot presolve them within its limit: left out (a weaker relaxation)
        if C <= config.dead_inputs_options and C + len(self.rv) <= config.dead_inputs_max_vars:
            self._dead_inputs(rerun_of, ops_all)
        # What the simulator charges: each re-run op's rerun cost, each drop's own cost (x: a
        # drop; revivals, z, exist only in forward-only graphs, which have no drop cost), each
        # partition's. Rounded down, so the objective and its bound stay below the simulator's.
        rerun_cost = problem.rerun_cost
        costs = {p: int(math.floor(rerun_cost[p] / cost_unit)) for p in rerun}
        per_drop = int(math.floor(problem.drop_cost / cost_unit))
        self.objective = sum(costs[p] * v for p, v in rerun.items() if costs[p] > 0) + sum(
            int(math.floor(po.cost / cost_unit)) * y[j] for j, po in enumerate(parts)) + (
            per_drop * sum(x) if per_drop > 0 else 0)
        model.Minimize(self.objective)

        # Byte scaling: divide by the GCD; if still large, round sizes up to a unit (relaxation).
        g = 0
        for s in st.sizes.tolist():
            g = math.gcd(g, int(s))
        g = max(g, 1)
        unit = g
        biggest = max(int(st.sizes.max()) if len(st.sizes) else 1, int(req[ops_all].max()))
        if biggest // unit > 2**40:
            unit = max(g, biggest >> 40)
        self.byte_unit = unit
        self.sizes = [-(-int(s) // unit) for s in st.sizes.tolist()]
        self.scale_note = f"bytes divided by {unit} (GCD {g}{', sizes rounded up' if unit != g else ''})"

    def cutoff(self, cost: float) -> None:
        """[Constraint] (warm start) beat the incumbent: no plan of the space costing at most
        ``cost`` is lost, as the model's cost of a plan never exceeds its simulated cost."""
        self.model.Add(self.objective <= int(math.floor(cost / self.cost_unit)))

    def forbid(self, chosen_x: list[int], chosen_y: list[int], chosen_z: list[int] = (),
               idle: set[int] = frozenset()) -> None:
        """[Constraint] no-good cut: not exactly this assignment (already simulated), whatever
        the ``idle`` keeps (z indices) are: each is a no-op in this plan (idle_keeps)."""
        on_x, on_y, on_z = set(chosen_x), set(chosen_y), set(chosen_z)
        lits = [v.Not() if k in on_x else v for k, v in enumerate(self.x)]
        lits += [v.Not() if j in on_y else v for j, v in enumerate(self.y)]
        lits += [v.Not() if j in on_z else v for j, v in enumerate(self.z) if j not in idle]
        if lits:
            self.model.AddBoolOr(lits)
            self.cuts += 1

    def idle_keeps(self, sim: SimResult) -> set[int]:
        """Keeps (z indices) that change nothing in the plan ``sim`` judged: no group of it
        needs their tensor after its last op, so keeping it or not simulates the same."""
        rv = self.rv
        needed = set(sim.revived).union(*sim.transients.values())
        return {j for j in range(len(rv)) if rv.remat_before[j] == self.problem.end[rv.tensor[j]] + 1
                and int(rv.tensor[j]) not in needed}

    def decode(self, value: Callable[[cp_model.IntVar], int]) -> tuple[Decisions, list[int], list[int], list[int]]:
        """The plan of an assignment (``value`` of each variable), and its chosen x, y and z."""
        st, rv = self.st, self.rv
        xs = [k for k, v in enumerate(self.x) if value(v)]
        ys = [j for j, v in enumerate(self.y) if value(v)]
        zs = [j for j, v in enumerate(self.z) if value(v)]
        drops = [Drop(int(st.tensor[k]), int(st.a[k]), int(st.b[k])) for k in xs]
        drops += [Drop(int(rv.tensor[j]), int(rv.free_after[j]), int(rv.remat_before[j])) for j in zs]
        parts = [as_partition(self.parts[j].span, self.parts[j].chunks) for j in ys]
        return Decisions(drops=drops, partitions=parts), xs, ys, zs

    def forbid_plan(self, dec: Decisions) -> None:
        """The no-good cut of ``dec`` if it is an assignment of this model (a warm start)."""
        st, rv = self.st, self.rv
        key = {(int(t), int(a), int(b)): k for k, (t, a, b) in
               enumerate(zip(st.tensor.tolist(), st.a.tolist(), st.b.tolist(), strict=True))}
        rkey = {(int(t), int(a), int(b)): j for j, (t, a, b) in
                enumerate(zip(rv.tensor.tolist(), rv.free_after.tolist(), rv.remat_before.tolist(), strict=True))}
        revived = [is_revival(self.problem, d) for d in dec.drops]
        xs = [key.get((d.tensor, d.free_after, d.remat_before)) for d, r in zip(dec.drops, revived, strict=True) if not r]
        zs = [rkey.get((d.tensor, d.free_after, d.remat_before)) for d, r in zip(dec.drops, revived, strict=True) if r]
        part_key = {(*span_key(po.span), po.chunks): j for j, po in enumerate(self.parts)}
        ys = [part_key.get((*span_key(p), p.chunks)) for p in dec.partitions]
        if None not in xs and None not in ys and None not in zs:
            self.forbid(xs, ys, zs)

    def _readers(self) -> dict[int, list[int]]:
        """Tensor -> the rematerializable tensors whose rebuild reads it (cached)."""
        if not hasattr(self, "_read_by"):
            self._read_by: dict[int, list[int]] = {}
            for x in np.nonzero(self.problem.rematerializable)[0].tolist():
                for u in rebuild_inputs(self.problem, x):
                    self._read_by.setdefault(u, []).append(x)
        return self._read_by
