"""CP-SAT planner: minimize extra compute so that no op exceeds the budget.

The model (one boolean per option, so O(n) decisions, plus per-op chain variables only at
the ops modelled) is a *relaxation* of the simulator: every plan the simulator accepts
satisfies it, so CP-SAT's best bound is a lower bound on the extra compute of any plan of
the space (the candidate gaps and their options). Rounds on one growing model: each
assignment CP-SAT proposes is simulated and then cut off by a no-good cut (that exact
assignment, never anything else); ops and recompute groups the simulator finds over budget
get constraints valid for every plan; a plan that fits becomes the incumbent, which later
rounds must beat. Nothing the simulator would accept is ever cut, so the search is complete
(given time) and its bound, min(incumbent, CP-SAT's bound), stays valid. Plan finders that
may cut plans (a greedy repair, one tightened model) only feed incumbents.

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
  at each modelled recompute group, see :meth:`_Model.add_group`.
* Forward-only graphs (revivals): an input a rebuild reads after its last op is re-made
  (its ops' cost) or kept, its bytes added at the ops it is held through
  (:meth:`_Model._dead_inputs`).
Byte coefficients are divided by their GCD (and, if still huge, rounded up to a unit, which
keeps the relaxation); costs are rounded down to a unit of step_cost / 1e7.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from ..base.errors import PlanError
from ..problem.core import (
    Options,
    Problem,
    coverage_delta,
    gap_bytes,
    options,
    rebuild_closure,
    rebuild_inputs,
    rebuild_set,
    revivable,
    revival_options,
)
from ..problem.partition.apply import apply_partitions
from ..problem.partition.cost import partition_cost
from ..problem.partition.find import module_spans
from ..problem.partition.floor import partition_savings
from ..problem.partition.span import Span, as_partition, span_key
from ..problem.partition.tensors import blocked_tensors, span_tensors
from ..simulate.core import Drop, SimResult, is_revival, rebuild_overhead, simulate_plan
from .bound import BoundLog, relaxation_bound
from .heuristic import plan_remat
from .result import Decisions
from .scores import sim_over

INITIAL_OPS = 24  # budget-binding ops modelled in the first round
MAX_TERMS = 400_000  # stop adding ops (still a relaxation) past this many chain terms
# Chain constraints (a dropped tensor brought back early by a rebuild that needs it) grow with
# the square of the options per gap; past this many options the model leaves them out, which
# keeps it a relaxation (a tensor counts as away over its whole gap), only a weaker one.
CHAIN_MAX_OPTIONS = 2_000
# The bound phase (bound.py) gets this share of the time limit first; with a work limit, this
# many branch-and-bound nodes per unit of work instead (a limit that does not depend on load).
BOUND_SHARE = 0.6
MERGED_BOUND_SHARE = 0.9  # the same, for a bound model of merged options (merged_structure)
BOUND_NODES_PER_WORK = 200
# Pairs of options per op that re-run it in two groups (apart_reruns): each a constraint.
APART_MAX_PAIRS = 64
# The dead-input constraints (_Model._dead_inputs) are left out of models with more options
# than CHAIN_MAX_OPTIONS, or more options and revivals than this: CP-SAT's rounds with them
# run past the time limit there (a generated 1,000-node forward-only graph, 16,783 options and
# 411,684 revivals, `solve --time-limit 20`: 43-48 s, 18-19 s without them; random_layered
# n250, 9,875 options: `--time-limit 5` 6.3 s in `make test`'s load, where the limit allows 5.7).
DEAD_INPUTS_MAX_VARS = 200_000
DEAD_INPUTS_MAX_OPTIONS = CHAIN_MAX_OPTIONS
# Past this many options and revivals, CP-SAT's presolve keeps every feasible solution (no
# dual reductions): its dominance detection ignores the time limit, and with two no-good cuts
# over 497k options (a generated 1,000-node forward-only graph at 0.9) it took 25 s of a
# round given 4.6, so `--time-limit 20` ran 40-48 s; without it, 19.1 s.
PRESOLVE_DUAL_MAX_VARS = 100_000
# Levels of inputs a re-made dead input's rule follows (_dead_inputs, there): each level needs
# its inputs kept, revived or re-made in turn.
REMADE_DEPTH = 1


@dataclass
class Structure:
    """Precomputed facts the model needs, independent of the budget."""

    sizes: np.ndarray
    a: np.ndarray
    b: np.ndarray
    own_ops: list[list[int]]  # per option: its rebuild ops (producer, in-place writers)
    temporaries: list[list[int]]  # per candidate: producer ops of temporaries its rebuild must redo
    needers: list[list[int]]  # per option t: options c whose rebuild certainly needs t
    tensor: np.ndarray  # per option: tensor index
    cand: np.ndarray  # per option: candidate index (options of one tensor share it)


def structure(problem: Problem) -> Structure:
    opts = options(problem)
    cands = opts.tensor.tolist()
    k_of: dict[int, list[int]] = {}
    for k, t in enumerate(cands):
        k_of.setdefault(t, []).append(k)
    a, b = opts.free_after, opts.remat_before
    own_ops: list[list[int]] = []
    temporaries: list[list[int]] = []
    needers: list[list[int]] = [[] for _ in cands]
    cand_set = set(k_of)
    broad: list[list[int]] = [[] for _ in cands]  # option -> options whose rebuild may need it
    chains = len(cands) <= CHAIN_MAX_OPTIONS
    closures: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
    for k, t in enumerate(cands):
        # The closure depends on the tensor and where it is freed only (not on the rebuild
        # point): the options of one gap share it.
        if (t, int(a[k])) not in closures:
            own = problem.rebuild_ops[t].tolist()
            if problem.every_gap:
                # Revivals (simulate.py) may keep or rebuild a dead input ahead of the group: no
                # transient is certainly re-made, and only the direct inputs are certainly read.
                closures[(t, int(a[k]))] = (own, [], [u for u in rebuild_inputs(problem, t) if u in cand_set])
            else:
                ops, deps = rebuild_closure(problem, t, int(a[k]), cand_set, dead_candidates=False)
                closures[(t, int(a[k]))] = (own, [q for q in ops if q not in own], deps)
        own, temps, deps = closures[(t, int(a[k]))]
        own_ops.append(own)
        temporaries.append(temps)
        if not chains:
            continue
        for u in deps:
            for j in k_of[u]:
                if j != k:
                    broad[j].append(k)
    # Earliest op each option's rebuild can happen: its own point, or earlier when a
    # rebuild that needs it comes first (fixpoint over the broad relation).
    low = b.astype(np.int64).copy()
    changed = True
    while changed:
        changed = False
        for j in np.argsort(-a, kind="stable").tolist():
            for k in broad[j]:
                if low[k] < low[j]:
                    low[j] = low[k]
                    changed = True
    # c's rebuild certainly needs t back (t already freed by then) when even its earliest
    # possible rebuild comes after t is freed.
    for j in range(len(cands)):
        needers[j] = sorted({k for k in broad[j] if low[k] > a[j]})
    return Structure(problem.nbytes[opts.tensor].astype(np.int64), a, b,
                     own_ops, temporaries, needers, opts.tensor, opts.cand)


def merged_structure(problem: Problem, st: Structure, ops_all: np.ndarray) -> tuple[Structure, np.ndarray]:
    """The options of ``st`` with one per (gap, cell), for the bound model on forward-only
    graphs with many rebuild points: cells of rebuild points end right before each
    budget-binding op (as in :meth:`_Model._dead_inputs`), and the options of one gap whose
    points share a cell cover the same binding ops, re-run the same ops and meet the same
    dead-input rules; the one kept has the latest point, which covers every op the others do
    (counted away there, the memory constraints of other ops only get easier). So any plan
    maps to an assignment of the smaller model (its option replaced by its cell's), which
    stays a relaxation; a group constraint (:meth:`_Model.add_group`) of an option that
    stands for others holds for each point it stands for (returned: the first of them, per
    option kept). n250 at 0.9: 9,875 options -> 1,665."""
    cuts = np.asarray(sorted({int(i) + 1 for i in ops_all.tolist()} | {problem.num_ops}))
    cell = np.searchsorted(cuts, st.b, side="right")
    best: dict[tuple[int, int, int], int] = {}
    first: dict[tuple[int, int, int], int] = {}
    for k, key in enumerate(zip(st.tensor.tolist(), st.a.tolist(), cell.tolist(), strict=True)):
        first[key] = min(first.get(key, int(st.b[k])), int(st.b[k]))
        if key not in best or st.b[k] > st.b[best[key]]:
            best[key] = k
    keep = np.asarray(sorted(best.values()), dtype=np.int64)
    lo = np.asarray([first[(int(st.tensor[k]), int(st.a[k]), int(cell[k]))] for k in keep.tolist()], dtype=np.int64)
    sub = Structure(st.sizes[keep], st.a[keep], st.b[keep], [st.own_ops[k] for k in keep.tolist()],
                    [st.temporaries[k] for k in keep.tolist()], [[] for _ in keep.tolist()],
                    st.tensor[keep], st.cand[keep])
    return sub, lo


def merged_revivals(problem: Problem, rv: Options, ops_all: np.ndarray) -> tuple[Options, np.ndarray, np.ndarray]:
    """The revivals ``rv`` with one rebuilt revival per (tensor, cell of rebuild points) (cells
    as in :func:`merged_structure`; keeps as they are), for the bound model: those of one cell
    re-run the same ops and are the same cause of a re-make in that cell
    (:meth:`_Model._dead_inputs`), and a group constraint counts one as a reviver when any
    point it stands for may be (returned: the first and last of them). n250 at 0.9: 20,262
    revivals -> 3,458."""
    cuts = np.asarray(sorted({int(i) + 1 for i in ops_all.tolist()} | {problem.num_ops}))
    cell = np.searchsorted(cuts, rv.remat_before, side="right")
    keep = rv.remat_before == problem.end[rv.tensor] + 1
    rep: dict[tuple[int, int], int] = {}
    lo: dict[tuple[int, int], int] = {}
    hi: dict[tuple[int, int], int] = {}
    for j in range(len(rv)):
        key = (int(rv.tensor[j]), -1 if keep[j] else int(cell[j]))
        s = int(rv.remat_before[j])
        if key not in rep:
            rep[key], lo[key], hi[key] = j, s, s
        else:
            lo[key], hi[key] = min(lo[key], s), max(hi[key], s)
            if s > rv.remat_before[rep[key]]:
                rep[key] = j
    keys = sorted(rep, key=lambda k: rep[k])
    js = np.asarray([rep[k] for k in keys], dtype=np.int64)
    out = Options(rv.tensor[js], rv.cand[js], rv.free_after[js], rv.remat_before[js])
    return (out, np.asarray([lo[k] for k in keys], dtype=np.int64), np.asarray([hi[k] for k in keys], dtype=np.int64))


def apart_reruns(problem: Problem, st: Structure, most_pairs: int = APART_MAX_PAIRS) -> dict[int, list[tuple[int, int]]]:
    """Per op ``p``: pairs of options (of two tensors) whose rebuilds both re-run ``p`` (one of
    their rebuild ops, or of the transients they certainly re-make) in groups that cannot be
    the same one. A group re-runs each of its ops once and frees what it re-made but did not
    rebuild (simulate.group_events), so such a pair re-runs ``p`` twice: the layer norm whose
    output and whose saved mean and rstd are dropped and rebuilt before different ops, or a
    transient that two rebuilds far apart each make again.

    Option ``k`` is rebuilt in the group before an op of its window: at most ``b`` (its
    rebuild point), after ``a`` (it is live until then); and exactly at ``b`` when no forward
    op reads its tensor, as then no other rebuild needs it back early. Windows that do not
    overlap are different groups. Forward-only graphs (``every_gap``) keep transients alive
    between groups (revivals): none there. At most ``most_pairs`` pairs per op."""
    if problem.every_gap or len(st.sizes) < 2:
        return {}
    read_fwd = np.zeros(len(problem.nbytes), dtype=bool)
    for q in np.nonzero(problem._phase_array == "forward")[0].tolist():
        read_fwd[problem.op_reads[q]] = True
    hi = st.b.astype(np.int64)
    lo = np.where(read_fwd[st.tensor], st.a.astype(np.int64) + 1, hi)
    users: dict[int, list[int]] = {}
    for k in range(len(st.sizes)):
        for p in {*st.own_ops[k], *st.temporaries[k]}:
            users.setdefault(p, []).append(k)
    out: dict[int, list[tuple[int, int]]] = {}
    for p, ks in users.items():
        if len(ks) < 2:
            continue
        ks = sorted(ks, key=lambda k: (hi[k], lo[k]))
        pairs = []
        for n, i in enumerate(ks):
            for j in ks[n + 1:]:
                if st.tensor[i] != st.tensor[j] and (hi[i] < lo[j] or hi[j] < lo[i]):
                    pairs.append((i, j))
                    if len(pairs) >= most_pairs:
                        break
            if len(pairs) >= most_pairs:
                break
        if pairs:
            out[p] = pairs
    return out


def binding_ops(problem: Problem, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Ops where the baseline exceeds the budget, one per stretch of equal covering set
    (the one with the largest requirement), sorted by requirement, largest first."""
    req = problem.baseline_live.astype(np.int64) - budget
    over = np.nonzero(req > 0)[0]
    if len(over) == 0:
        return over, req
    cuts = np.unique(np.concatenate([problem.cand_free_after + 1, problem.cand_remat_before]))
    seg = np.searchsorted(cuts, over, side="right")
    best: dict[int, int] = {}
    for i, s in zip(over.tolist(), seg.tolist(), strict=True):
        if s not in best or req[i] > req[best[s]]:
            best[s] = i
    ops = np.array(sorted(best.values(), key=lambda i: -req[i]), dtype=np.int64)
    return ops, req


def interruptible_solve(solver: cp_model.CpSolver, model: cp_model.CpModel, callback=None,
                        deadline: float | None = None) -> int:
    """``solver.Solve(model, callback)`` in a worker thread, so that Ctrl-C reaches Python at
    once: the search is stopped and ``KeyboardInterrupt`` raised. CP-SAT's own SIGINT handling
    (``catch_sigint_signal``, which the caller turns off) ended only the round, and the rounds
    went on to the time limit and wrote a plan. At ``deadline`` (perf_counter) the search is
    stopped too: CP-SAT's own time limit is not always honoured (a generated 1,000-node
    forward-only graph at ``--time-limit 20``: a round given 5.8 s ran 26 s)."""
    import threading

    out: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            out["code"] = solver.Solve(model, callback)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            out["error"] = e
        finally:
            done.set()

    worker = threading.Thread(target=run, name="cp-sat", daemon=True)
    worker.start()
    try:
        stopped = False
        while not done.wait(0.05):
            if deadline is not None and not stopped and time.perf_counter() > deadline:
                solver.stop_search()
                stopped = True
    except BaseException:  # Ctrl-C (or anything else raised here): stop the search, then go
        solver.stop_search()
        while not done.is_set():  # (not Thread.join: interrupted, it may return early)
            time.sleep(0.01)
        raise
    finally:
        while worker.is_alive():  # the solver's own threads are gone when its thread is
            time.sleep(0.001)
    if "error" in out:
        raise out["error"]
    return out["code"]


class _Progress(cp_model.CpSolverSolutionCallback):
    """Reports (the cheapest plan the simulator accepted so far or None, the bound) at each of
    CP-SAT's solutions. A solution is a candidate of the relaxation, not yet a plan: its cost
    is not reported as one (a search that never found a plan showed "best" costs)."""

    def __init__(self, report, unit, best: Callable[[], float | None]):
        super().__init__()
        self.report, self.unit, self.best = report, unit, best

    def on_solution_callback(self):
        if self.report:
            best = self.best()
            bound = self.BestObjectiveBound() * self.unit
            self.report(best, bound if best is None else min(bound, best))


@dataclass
class PartOption:
    """Partition ``span`` into ``chunks``: frees ``savings[i]`` bytes at op i, costs ``cost``."""

    span: Span
    chunks: int
    savings: np.ndarray
    cost: float
    internal: np.ndarray  # option indices whose tensor the partition makes internal


def partition_options(problem: Problem, st: Structure, budget: int) -> list[PartOption]:
    """Partitions worth modelling: those that free bytes at some op over the budget."""
    spans = module_spans(problem)
    if not spans:
        return []
    over = problem.baseline_live > budget
    opt_of: dict[int, list[int]] = {}
    for k, t in enumerate(st.tensor.tolist()):
        opt_of.setdefault(t, []).append(k)
    out = []
    # Each option's rebuild set, once (it does not depend on the span).
    rebuilds = [rebuild_set(problem, t, b) or () for t, b in zip(st.tensor.tolist(), st.b.tolist(), strict=True)]
    early = np.nonzero(st.b != problem.cand_remat_before[st.cand])[0].tolist()  # early-rebuild options
    for span in spans:
        by_set: dict[frozenset, np.ndarray] = {}
        for chunks in span.chunk_choices:
            # Options the partition rules out: its own tensors, and those whose rebuild would
            # re-make one of them (replay cannot re-run a partitioned module's ops one by one;
            # checkpointed whole, its outputs may still be dropped: partition.whole_outputs).
            inner = frozenset(blocked_tensors(problem, span, chunks))
            if inner not in by_set:
                blocked = {k for t in inner for k in opt_of.get(t, [])}
                blocked.update(k for k, rs in enumerate(rebuilds) if k not in blocked and not inner.isdisjoint(rs))
                # A whole module's dropped output is rebuilt at its use only (its early point
                # was found with the module's insides alive: partition._apply_partitions).
                outs = span_tensors(problem, span) - inner
                blocked.update(k for k in early if outs and int(st.tensor[k]) in outs)
                by_set[inner] = np.asarray(sorted(blocked), dtype=np.int64)
            internal = by_set[inner]
            sav = partition_savings(problem, span, chunks)
            if not np.any(sav[over] > 0):
                if chunks == 1:
                    continue  # checkpointing whole may free nothing where splitting does
                break
            out.append(PartOption(span, chunks, sav, partition_cost(problem, span, chunks), internal))
    return out


def _bound_by(lower_bound: float | None, mip_bound: float | None) -> str | None:
    """Which method proved the reported bound."""
    if lower_bound is None:
        return None
    return "mip-relaxation" if mip_bound is not None and mip_bound >= lower_bound else "cp-sat"


def plan_ilp(problem: Problem, budget_bytes: int | None, *, seed: int = 0, time_limit: float = 60.0,
             hint: Decisions | None = None, progress: Callable[[float | None, float], None] | None = None,
             workers: int = 2, partitions: bool = True, work_limit: float | None = None,
             bound_share: float = BOUND_SHARE) -> Decisions:
    """Search the plan space for the cheapest plan the simulator accepts.

    ``time_limit``: wall seconds from this call, model building included. ``work_limit``:
    CP-SAT's deterministic time summed over the rounds; with it, the same inputs and seed
    give the same plan (as long as the wall limit is not reached first).
    """
    t0 = time.perf_counter()
    if budget_bytes is None:
        return Decisions(status="optimal", lower_bound=0.0, notes=["no budget"])
    st = structure(problem)
    ops_all, req = binding_ops(problem, budget_bytes)
    if len(ops_all) == 0:
        return Decisions(status="optimal", lower_bound=0.0, objective=0.0,
                         notes=["the budget does not bind: nothing to drop"])
    parts = partition_options(problem, st, budget_bytes) if partitions else []
    most = coverage_delta(problem)
    for po in parts:
        most = most + np.maximum(po.savings, 0)
    if np.any(most[ops_all] < req[ops_all]):
        return Decisions(status="infeasible", lower_bound=None, stats={"proven": True},
                         notes=["even dropping every candidate and partitioning every module cannot meet the budget"])

    cost_unit = max(problem.step_cost / 1e7, 1e-12)
    model = _Model(problem, st, parts, req, ops_all, cost_unit)
    for i in ops_all[:INITIAL_OPS].tolist():
        model.add_op(i)
    incumbent: tuple[Decisions, SimResult] | None = None
    lower_bound: float | None = None
    notes: list[str] = []  # for people (inspect shows them)
    log: list[str] = []  # for the record: the plan's solver.stats["log"]
    status_final = None
    proven_none = False
    timed_out = False
    work_used = 0.0
    rounds = rejected = repaired = 0
    def slack(inc: tuple[Decisions, SimResult]) -> float:
        """What rounding costs down to the unit can take off a plan's cost in the model: under
        one unit per op its groups re-run, per drop and per partition. (One unit per option
        before: 9,875 units on random_layered n250, which called a plan with a 10% gap optimal.)"""
        dec, sim = inc
        return cost_unit * (sum(len(g.ops) for g in sim.groups.values()) + len(dec.drops) + len(dec.partitions) + 1)

    def proves(bound: float | None) -> bool:
        """Does ``bound`` (extra compute) prove the incumbent optimal, to the cost rounding?"""
        return incumbent is not None and bound is not None and incumbent[1].extra_cost <= bound + slack(incumbent)

    # The tightened model constrains every option's rebuild: too slow to build past
    # CHAIN_MAX_OPTIONS options (forward-only graphs, where the local search finds plans).
    tightened_tried = len(st.sizes) > CHAIN_MAX_OPTIONS

    def params(solver: cp_model.CpSolver, seconds: float, work: float | None) -> None:
        prm = solver.parameters
        prm.random_seed = seed
        prm.num_workers = workers
        prm.interleave_search = workers > 1
        prm.max_time_in_seconds = max(seconds, 0.01)
        prm.catch_sigint_signal = False  # Ctrl-C ends the command (interruptible_solve), not a round
        if len(model.x) + len(model.z) > PRESOLVE_DUAL_MAX_VARS:
            prm.keep_all_feasible_solutions_in_presolve = True  # no dominance detection (above)
        if work is not None:
            prm.max_deterministic_time = max(work, 1e-3)

    def offer(dec: Decisions, sim: SimResult) -> None:
        nonlocal incumbent
        if sim.peak_bytes <= budget_bytes and (incumbent is None or sim.extra_cost < incumbent[1].extra_cost):
            incumbent = (dec, sim)
            model.cutoff(sim.extra_cost)

    if hint is not None:
        hint_sim, _ = simulate_plan(problem, hint.drops, hint.partitions)
        offer(hint, hint_sim)
        model.forbid_plan(hint)

    def learn(sim: SimResult, parted: Problem, deadline: float | None) -> bool:
        """Constraints valid for every plan at the ops and groups ``sim`` finds over budget,
        in the main model and the bound model; whether any was new."""
        over = sim_over(parted, sim) - budget_bytes
        # A kept dead tensor (_dead_inputs) can put an op over budget that the unplanned step
        # keeps under it: where the model counts kept tensors, such ops get constraints too.
        new = [int(i) for i in np.nonzero(over > 0)[0] if req[i] > 0 or model.held]
        new_main = [i for i in new if i not in model.ops]
        if new_main and model.terms < MAX_TERMS:
            for i in sorted(new_main, key=lambda i: -over[i])[:64]:
                model.add_op(i)
        groups = sorted(g for g, grp in sim.groups.items() if grp.peak_bytes > budget_bytes)
        # (The bound model may count kept tensors where the main model does not: a merged one.)
        fresh = [int(i) for i in np.nonzero(over > 0)[0] if bmodel is not None and int(i) not in bmodel.ops
                 and (req[i] > 0 or bmodel.held)]
        fresh_groups = [g for g in groups if bmodel is not None and g not in bmodel.groups]
        for r in groups:
            model.add_group(r, budget_bytes, deadline)
        if bmodel is not None:
            for i in fresh:
                bmodel.add_op(i)
            for r in fresh_groups:
                bmodel.add_group(r, budget_bytes, deadline)
        return bool(new_main or fresh or fresh_groups)

    # The bound phase (bound.py): the relaxation at every binding op, solved by a MIP solver,
    # in a cutting-plane loop; its plans are offered, its bound kept. With a work limit, a
    # node limit (not the wall clock) bounds it, so the same inputs give the same result.
    bmodel = None
    mip_bound: float | None = None
    blog = BoundLog()
    # Past CHAIN_MAX_OPTIONS options (forward-only graphs with every rebuild point) building
    # the bound model alone took more than a 5 s limit allows: there it has one option per
    # gap and cell of rebuild points (merged_structure), or, past that, CP-SAT's bound only.
    bst, merged = st, None
    if problem.every_gap and not parts and len(st.sizes) > CHAIN_MAX_OPTIONS:
        bst, merged = merged_structure(problem, st, ops_all)
    if bound_share > 0 and len(bst.sizes) <= CHAIN_MAX_OPTIONS:
        bmodel = _Model(problem, bst, parts, req, ops_all, cost_unit, merge_revivals=merged is not None)
        bmodel.chains = False
        bmodel.first_point = merged
        # Merged (forward-only graphs past CHAIN_MAX_OPTIONS): CP-SAT's rounds find no plan
        # there (the local search does) and its bound is weaker; the MIP's root cuts need the time.
        share = bound_share if merged is None else max(bound_share, MERGED_BOUND_SHARE)
        b_deadline = t0 + time_limit * (1.0 if work_limit is not None else share)
        nodes = None if work_limit is None else max(1, int(BOUND_NODES_PER_WORK * work_limit))

        def plan_of(values: dict[int, int]) -> tuple[SimResult, Problem] | None:
            dec = bmodel.decode(lambda v: values[v.Index()])[0]
            try:
                sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
            except PlanError:
                return None
            offer(dec, sim)
            return sim, parted

        def add_cuts(got: tuple[SimResult, Problem]) -> bool:
            sim, parted = got
            return sim.peak_bytes > budget_bytes and learn(sim, parted, b_deadline)

        # Plans cheaper than the incumbent have a model cost below its cost in units (costs
        # are rounded down): HiGHS may prune the rest; the bound is capped there, as below.
        found = relaxation_bound(bmodel, ops_all, b_deadline, plan_of, add_cuts, blog, nodes,
                                 lambda: None if incumbent is None else incumbent[1].extra_cost / cost_unit,
                                 lambda b: proves(b * cost_unit))
        if found is not None:
            mip_bound = found * cost_unit
            lower_bound = mip_bound  # of every plan: no cut, and capped at the incumbent
        log += blog.lines
    while True:
        if proves(lower_bound):
            status_final = "optimal"  # the bound phase proved it
            break
        remaining = time_limit - (time.perf_counter() - t0)
        if remaining <= 0.05 or (work_limit is not None and work_used >= work_limit):
            timed_out = True
            break
        rounds += 1
        solver = cp_model.CpSolver()
        params(solver, remaining, None if work_limit is None else work_limit - work_used)
        code = interruptible_solve(solver, model.model, _Progress(
            progress, cost_unit, lambda: None if incumbent is None else incumbent[1].extra_cost),
            deadline=t0 + time_limit)
        work_used += solver.deterministic_time
        if code == cp_model.INFEASIBLE:
            # Every plan not yet simulated either breaks a constraint every accepted plan
            # meets, or costs more than the incumbent: the incumbent is optimal, or no plan exists.
            if incumbent is not None:
                lower_bound = incumbent[1].extra_cost
                status_final = "optimal"
            else:
                proven_none = True
                log.append(f"round {rounds}: no plan of this space is left to try")
            break
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            timed_out = True
            log.append(f"round {rounds}: no model solution within the limit")
            # CP-SAT's bound holds without a solution too (the incumbent covers what was cut).
            bound = solver.BestObjectiveBound() * cost_unit
            if incumbent is not None:
                bound = min(bound, incumbent[1].extra_cost)
            lower_bound = bound if lower_bound is None else max(lower_bound, bound)
            break
        # Valid for every plan not yet simulated; the incumbent covers the simulated ones.
        bound = solver.BestObjectiveBound() * cost_unit
        if incumbent is not None:
            bound = min(bound, incumbent[1].extra_cost)
        lower_bound = bound if lower_bound is None else max(lower_bound, bound)
        dec, chosen, parted_y, revived = model.decode(solver.Value)
        try:
            sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
        except PlanError:  # a rebuild chain that cannot run: rejected, and cut
            model.forbid(chosen, parted_y, revived)
            rejected += 1
            continue
        model.forbid(chosen, parted_y, revived, model.idle_keeps(sim))
        offer(dec, sim)
        if sim.peak_bytes > budget_bytes:
            rejected += 1
            over = sim_over(parted, sim) - budget_bytes
            new = [int(i) for i in np.nonzero(over > 0)[0] if int(i) not in model.ops and req[i] > 0]
            deadline = t0 + time_limit  # constraints left out past it only weaken the relaxation
            learn(sim, parted, deadline)
            # A plan for now: complete the rejected one greedily (never a bound, never a cut).
            fixed = _repair(problem, dec, budget_bytes, deadline)
            if fixed is not None:
                repaired += 1
                offer(*fixed)
            elif incumbent is None and not new and not tightened_tried:
                # The excess comes from what the relaxation leaves out (transients, groups):
                # look for a plan in a tightened model, with half of what is left.
                tightened_tried = True
                share = (time_limit - (time.perf_counter() - t0)) / 2
                found, work = _tightened_search(problem, st, parts, req, ops_all, model.ops, budget_bytes, cost_unit,
                                          dec, None, params, share,
                                          None if work_limit is None else (work_limit - work_used) / 2)
                work_used += work
                log.append(f"round {rounds}: tightened search " + ("found a plan" if found else "found none"))
                if found is not None:
                    offer(*found)
        if proves(lower_bound):
            status_final = "optimal"
            break
    if timed_out:
        notes.append("CP-SAT stopped at the " + ("work" if work_limit is not None and work_used >= work_limit
                                                   else "time") + " limit: a longer limit may find a cheaper plan")
    stats = {"rounds": rounds, "rejected": rejected, "repaired": repaired, "modelled_ops": len(model.ops),
             "binding_ops": int(len(ops_all)), "candidates": int(len(st.sizes)), "partition_options": len(parts),
             "no_good_cuts": model.cuts, "scaling": model.scale_note, "log": log,
             "bound_by": _bound_by(lower_bound, mip_bound), "bound_rounds": blog.rounds, "mip_bound": mip_bound,
             "work": round(work_used, 3), "timed_out": timed_out, "proven": proven_none}
    if incumbent is None:
        why = ("no plan of this plan space fits: CP-SAT ruled out every one the simulator did not reject"
               if proven_none else "CP-SAT found no plan the simulator accepts within the limit")
        return Decisions(status="infeasible" if proven_none else None, lower_bound=None,
                         notes=notes + [why], stats=stats, timed_out=timed_out)
    dec, sim = incumbent
    # The bound phase's MIP bounds the model's plan space; the incumbent may lie outside it (a
    # warm start from DTR, whose evictions need not be the candidates' gaps) and cost less:
    # the bound of the space and the plans found is the lower of the two.
    if lower_bound is not None:
        lower_bound = min(lower_bound, sim.extra_cost)
    return Decisions(drops=dec.drops, partitions=dec.partitions, status=status_final or "feasible",
                     objective=sim.extra_cost, lower_bound=lower_bound, notes=notes, stats=stats,
                     timed_out=timed_out)


def _tightened_search(problem: Problem, st: Structure, parts: list[PartOption], req: np.ndarray,
                      ops_all: np.ndarray, ops: set[int], budget: int, cost_unit: float, first: Decisions,
                      incumbent_cost: float | None, solver_params: Callable[[cp_model.CpSolver, float, float | None], None],
                      time_limit: float, work_limit: float | None) -> tuple[tuple[Decisions, SimResult] | None, float]:
    """Plan finding only (never a bound, never a proof): starting from a rejected solution,
    raise the requirement at each op the simulator finds over budget by that op's excess and
    constrain each rebuild's own working set, until a solution fits, the model has none, or
    the limit runs out. These tightenings can cut off plans, so the main loop never trusts
    this model's infeasibility. Returns the plan (or None) and CP-SAT's deterministic time."""
    t0 = time.perf_counter()
    work = 0.0
    extra: dict[int, int] = {}
    overheads: dict[int, int] = {}
    dec = first
    while True:
        sim, parted = simulate_plan(problem, dec.drops, dec.partitions)
        if sim.peak_bytes <= budget:
            return (dec, sim), work
        chosen = np.zeros(len(st.sizes), dtype=bool)
        key = {(int(t), int(b)): k for k, (t, b) in enumerate(zip(st.tensor.tolist(), st.b.tolist(), strict=True))}
        for d in dec.drops:
            if (d.tensor, d.remat_before) in key:  # revivals aside
                chosen[key[(d.tensor, d.remat_before)]] = True
        over = sim_over(parted, sim) - budget
        freed = gap_bytes(problem.num_ops, st.a[chosen], st.b[chosen], st.sizes[chosen]) + sum(
            (po.savings for po in parts if as_partition(po.span, po.chunks) in dec.partitions),
            np.zeros(problem.num_ops, np.int64))
        for i in np.nonzero(over > 0)[0].tolist():
            extra[i] = max(extra.get(i, 0), int(freed[i]) + int(over[i]) - int(req[i]))
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05 or (work_limit is not None and work >= work_limit):
            return None, work
        m = _Model(problem, st, parts, req, ops_all, cost_unit)
        for i in sorted(ops | set(extra)):
            m.add_op(i, extra.get(i, 0))
        m.add_rebuild_constraints(budget, overheads)
        if incumbent_cost is not None:
            m.cutoff(incumbent_cost)
        solver = cp_model.CpSolver()
        solver_params(solver, left, None if work_limit is None else work_limit - work)
        code = interruptible_solve(solver, m.model, deadline=time.perf_counter() + left)
        work += solver.deterministic_time
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None, work
        dec = m.decode(solver.Value)[0]


def _repair(problem: Problem, dec: Decisions, budget: int, deadline: float | None = None
            ) -> tuple[Decisions, SimResult] | None:
    """The greedy sweep started from ``dec``'s drops, around its partitions."""
    if deadline is not None and time.perf_counter() > deadline:
        return None
    parted, _ = apply_partitions(problem, dec.partitions)
    fixed = plan_remat(parted, budget, initial=dec.drops, deadline=deadline)
    fixed.partitions = list(dec.partitions)
    sim, _ = simulate_plan(problem, fixed.drops, fixed.partitions)
    return (fixed, sim) if sim.peak_bytes <= budget else None


class _Model:
    """The CP-SAT relaxation, built once and grown between rounds: memory constraints at
    more ops, no-good cuts on simulated plans, a cutoff at the incumbent's cost."""

    def __init__(self, problem: Problem, st: Structure, parts: list[PartOption], req: np.ndarray,
                 ops_all: np.ndarray, cost_unit: float, merge_revivals: bool = False):
        self.problem, self.st, self.parts, self.req = problem, st, parts, req
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
        apart = apart_reruns(problem, st)
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

        # One constraint per option; past CHAIN_MAX_OPTIONS, one per gap over its options (they
        # share their ops; at most one is chosen). The same plans, but the per-option form
        # solved ResNet-50 at 0.4 to optimality where the per-gap one stalled at 30 s.
        per = [[k] for k in range(C)] if C <= CHAIN_MAX_OPTIONS else list(alts.values())
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
        if C <= DEAD_INPUTS_MAX_OPTIONS and C + len(self.rv) <= DEAD_INPUTS_MAX_VARS:
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
        needed there too, one level down (:data:`REMADE_DEPTH`; below it ``rem[u]`` stands
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

        def there(u: int, q: int, need, depth: int = REMADE_DEPTH) -> None:
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

    def _readers(self) -> dict[int, list[int]]:
        """Tensor -> the rematerializable tensors whose rebuild reads it (cached)."""
        if not hasattr(self, "_read_by"):
            self._read_by: dict[int, list[int]] = {}
            for x in np.nonzero(self.problem.rematerializable)[0].tolist():
                for u in rebuild_inputs(self.problem, x):
                    self._read_by.setdefault(u, []).append(x)
        return self._read_by

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
            if len(st.sizes) <= CHAIN_MAX_OPTIONS:  # each option over its own window
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
