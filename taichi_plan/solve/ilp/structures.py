"""What the CP-SAT relaxation is built from, independent of the budget where it can be: each
option's bytes, gap and rebuild ops, the transients its rebuild certainly re-makes, the options
whose rebuild certainly needs it back (:func:`structure`); the smaller option and revival sets
of the bound model on forward-only graphs (:func:`merged_structure`, :func:`merged_revivals`);
the ops two rebuilds certainly re-run twice (:func:`apart_reruns`); and the budget-binding ops
(:func:`binding_ops`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...problem.core import Problem, rebuild_inputs
from ...problem.options import Options, options, rebuild_closure
from ..config import IlpConfig


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


def structure(problem: Problem, config: IlpConfig = IlpConfig()) -> Structure:
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
    chains = len(cands) <= config.chain_max_options
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
    budget-binding op (as in :meth:`RelaxationModel._dead_inputs`), and the options of one gap whose
    points share a cell cover the same binding ops, re-run the same ops and meet the same
    dead-input rules; the one kept has the latest point, which covers every op the others do
    (counted away there, the memory constraints of other ops only get easier). So any plan
    maps to an assignment of the smaller model (its option replaced by its cell's), which
    stays a relaxation; a group constraint (:meth:`RelaxationModel.add_group`) of an option that
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
    (:meth:`RelaxationModel._dead_inputs`), and a group constraint counts one as a reviver when any
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


def apart_reruns(problem: Problem, st: Structure, config: IlpConfig = IlpConfig()) -> dict[int, list[tuple[int, int]]]:
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
    between groups (revivals): none there. At most ``config.apart_max_pairs`` pairs per op."""
    if problem.every_gap or len(st.sizes) < 2:
        return {}
    most_pairs = config.apart_max_pairs
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
