"""The baseline planners the benchmarks compare against, each returning :class:`Decisions`.

Every baseline is deterministic and is judged by the simulator like any other planner
(:func:`taichi_plan.solve.result.make_plan`). Only ``dtr`` looks at the budget; it alone may
free a tensor in a gap other than its candidate gap (any two consecutive uses). Drops the
simulator could not execute (a rebuild that needs a tensor which is gone and cannot be
rebuilt) are removed before returning, and counted in the notes.

Blocks (for ``full`` and ``sqrt-n``) are the repeated layer modules: FQNs ``<prefix>.<int>``
at the depth, among those where some prefix has at least two of them, whose blocks cover the
most ops (ties: more blocks, then shallower); an op belongs to a block when its module
equals the block FQN or starts with the FQN plus ``"."``. ``full`` and ``sqrt-n`` rebuild a
region's drops together, once, as non-reentrant checkpoint re-runs a region's forward.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from ..base.units import format_bytes
from ..problem.core import Problem
from ..simulate.core import Drop, simulate, unexecutable
from .config import BaselinesConfig
from .result import Decisions

DESCRIPTIONS = {
    "none": "no rematerialization: every activation is kept (the trace's own peak)",
    "full": "checkpoint every repeated block: keep block inputs/outputs, recompute the rest",
    "sqrt-n": "Chen et al. 2016: ceil(sqrt(n)) segments, keep only segment-boundary activations",
    "dtr": "DTR's greedy eviction run offline: evict min cost/(bytes x staleness) when over budget",
    "selective-mm": "save outputs of matmul/conv/attention ops, recompute every other candidate",
}

_IMPORTED_MM = re.compile(r"conv|matmul|dense|fc|linear|gemm", re.IGNORECASE)
_MM_WORDS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "conv"}
_CONV_WORD = re.compile(r"conv(\d+d|transpose\d*d?)?")
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
_NAMESPACES = {"aten", "prims", "prim"}


# ---------------------------------------------------------------------------------------------
# Budget-independent baselines
# ---------------------------------------------------------------------------------------------
# Every baseline takes (problem, budget_bytes, *, seed, time_limit, config): config, the
# baselines' tuning (BaselinesConfig), is used by those that have any (DTR's rounds).


def plan_none(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
              time_limit: float = 60.0, config: BaselinesConfig = BaselinesConfig()) -> Decisions:
    return Decisions(notes=[DESCRIPTIONS["none"]])


def plan_full(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
              time_limit: float = 60.0, config: BaselinesConfig = BaselinesConfig()) -> Decisions:
    cands, frees = problem.candidates, problem.cand_free_after
    blocks = find_blocks(problem.op_module)
    fwd = np.asarray([p == "forward" for p in problem.op_phase], dtype=bool)
    if not any(problem.op_module):
        chosen = list(range(len(cands)))
        note = "no module names in the trace: every candidate is recomputed"
    elif not blocks:
        chosen = [k for k in range(len(cands)) if fwd[frees[k]]]
        note = "no repeated blocks found: every candidate freed in forward is recomputed"
    else:
        op_block = op_blocks(problem.op_module, blocks)
        chosen = []
        for k, t in enumerate(cands.tolist()):
            b = op_block[problem.producer[t]]
            if b < 0 or not fwd[frees[k]]:
                continue
            u = problem.uses[t]
            u = u[fwd[u]]
            if np.any(op_block[u] != b):
                continue  # a block output (or read across blocks): torch keeps it
            chosen.append(k)
        note = f"{len(blocks)} blocks ({blocks[0]} ... {blocks[-1]}), each re-run once in backward"
        return _decisions(problem, chosen, "full", note, {"blocks": len(blocks)},
                          region=op_block[problem.producer[cands]])
    return _decisions(problem, chosen, "full", note, {"blocks": len(blocks)})


def plan_sqrt_n(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
                time_limit: float = 60.0, config: BaselinesConfig = BaselinesConfig()) -> Decisions:
    """``torch.utils.checkpoint.checkpoint_sequential`` over the blocks (:func:`_segments`):
    a segment's activations are dropped but for what crosses its end, and the segment's
    forward re-runs once, when backward first needs one of them."""
    fwd = np.asarray([p == "forward" for p in problem.op_phase], dtype=bool)
    seg, nseg, unit = _segments(problem, fwd)
    chosen = []
    for k, t in enumerate(problem.candidates.tolist()):
        p = problem.producer[t]
        if not fwd[p] or seg[p] < 0:
            continue  # outside every checkpointed segment: kept
        u = problem.uses[t]
        u = u[fwd[u] & (u != p)]
        if np.any(seg[u] != seg[p]):
            continue  # a segment-boundary activation: kept
        chosen.append(k)
    note = (f"{nseg} segments of consecutive forward {unit}, the last one run without checkpointing "
            "(as checkpoint_sequential); each other segment re-run once in backward")
    return _decisions(problem, chosen, "sqrt-n", note, {"segments": nseg},
                      region=seg[problem.producer[problem.candidates]])


def plan_selective_mm(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
                      time_limit: float = 60.0, config: BaselinesConfig = BaselinesConfig()) -> Decisions:
    imported = problem.trace.meta.get("mode") == "imported"
    chosen = [k for k, t in enumerate(problem.candidates.tolist())
              if not is_matmul_like(problem.op_name[problem.producer[t]], imported)]
    kept = len(problem.candidates) - len(chosen)
    return _decisions(problem, chosen, "selective-mm", f"{kept} matmul-like outputs saved", {})


def is_matmul_like(op_name: str, imported: bool = False) -> bool:
    """Matmul, conv or attention: by the aten op token (``aten.addmm.default`` -> ``addmm``),
    or for imported graphs by the node name (conv|matmul|dense|fc|linear|gemm, any case)."""
    if imported:
        return _IMPORTED_MM.search(op_name) is not None
    parts = op_name.replace("::", ".").split(".")
    token = parts[1] if len(parts) > 1 and parts[0] in _NAMESPACES else parts[0]
    token = token.lstrip("_")
    if any(a in token for a in _ATTENTION):
        return True
    return any(w in _MM_WORDS or _CONV_WORD.fullmatch(w) for w in token.split("_"))


# ---------------------------------------------------------------------------------------------
# Blocks and segments
# ---------------------------------------------------------------------------------------------


def find_blocks(op_module: list[str]) -> list[str]:
    """The repeated layer modules, in order of first appearance (see the module docstring).

    Of the depths where some prefix has at least two ``<prefix>.<int>`` children, the one whose
    blocks cover the most ops; ties go to the one with more blocks, then to the shallower. (The
    shallowest repeated level can be a two-layer classifier head, as in HF's ResNet, whose
    bottleneck layers sit deeper, under ``stages.<i>.layers.<j>``.)"""
    first: dict[str, int] = {}
    count: dict[str, int] = defaultdict(int)
    for i, m in enumerate(op_module):
        count[m] += 1
        if m and m not in first:
            first[m] = i
    by_depth: dict[int, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    for m, i in first.items():
        parts = m.split(".")
        for k in range(2, len(parts) + 1):
            if parts[k - 1].isdigit():
                fqn = ".".join(parts[:k])
                group = by_depth[k][".".join(parts[:k - 1])]
                group[fqn] = min(group.get(fqn, i), i)
    best, best_key = [], None
    for depth in sorted(by_depth):
        found = {f: i for g in by_depth[depth].values() if len(g) >= 2 for f, i in g.items()}
        if not found:
            continue
        covered = sum(n for m, n in count.items() if any(m == f or m.startswith(f + ".") for f in found))
        key = (covered, len(found), -depth)
        if best_key is None or key > best_key:
            best, best_key = sorted(found, key=lambda f: (found[f], f)), key
    return best


def op_blocks(op_module: list[str], blocks: list[str]) -> np.ndarray:
    """Block index of each op (-1 outside every block): exact FQN or FQN + "." prefix."""
    index = {b: j for j, b in enumerate(blocks)}
    memo: dict[str, int] = {}

    def block_of(m: str) -> int:
        if m not in memo:
            parts = m.split(".") if m else []
            memo[m] = next((index[".".join(parts[:k])] for k in range(len(parts), 0, -1)
                            if ".".join(parts[:k]) in index), -1)
        return memo[m]

    return np.fromiter((block_of(m) for m in op_module), dtype=np.int64, count=len(op_module))


def _segments(problem: Problem, fwd: np.ndarray) -> tuple[np.ndarray, int, str]:
    """Checkpointed segment of each forward op, -1 for ops no checkpoint covers.

    As ``torch.utils.checkpoint.checkpoint_sequential(blocks, s, x)`` cuts them: the n blocks
    (else the n forward ops) in s = ceil(sqrt(n)) segments of n // s; the last segment,
    which also takes the remainder, runs without checkpointing, and so do the ops before the
    first block and after the last one (embeddings, head, loss).
    """
    n_ops = problem.num_ops
    seg = np.full(n_ops, -1, dtype=np.int64)
    blocks = find_blocks(problem.op_module)
    if blocks:
        unit_of = op_blocks(problem.op_module, blocks)
        unit_of[~fwd] = -1
        n, unit = len(blocks), "blocks"
    else:
        unit_of = np.full(n_ops, -1, dtype=np.int64)
        f = np.nonzero(fwd)[0]
        unit_of[f] = np.arange(len(f))
        n, unit = len(f), "ops"
    if n == 0:
        return seg, 0, unit
    nseg = math.ceil(math.sqrt(n))
    size = n // nseg
    inside = (unit_of >= 0) & (unit_of < size * (nseg - 1))
    seg[inside] = unit_of[inside] // size
    return seg, nseg, unit


def _decisions(problem: Problem, chosen: list[int], name: str, note: str, stats: dict,
               region: np.ndarray | None = None) -> Decisions:
    """Drop the ``chosen`` candidates. With ``region`` (per candidate: the checkpointed region
    it is made in, -1 for none), the drops of one region are rebuilt together, as a
    checkpointed region runs: all in the group before the region's first backward op that
    needs one of them (:func:`_rebuild_together`)."""
    drops = [Drop(int(problem.candidates[k]), int(problem.cand_free_after[k]),
                  int(problem.cand_remat_before[k])) for k in chosen]
    if region is not None:
        drops = _rebuild_together(problem, drops, [int(region[k]) for k in chosen])
    drops, removed = executable(problem, drops)
    notes = [DESCRIPTIONS[name], note]
    if removed:
        notes.append(f"{len(removed)} drops left out: their rebuild needs a tensor that is gone")
    return Decisions(drops=drops, notes=notes, stats={**stats, "drops": len(drops)})


def _rebuild_together(problem: Problem, drops: list[Drop], region: list[int]) -> list[Drop]:
    """Move each drop's rebuild to the first backward rebuild of its region.

    Non-reentrant ``torch.utils.checkpoint`` re-runs a region's forward once, when backward
    first unpacks a tensor the region saved, and holds what it re-made until its use; the
    simulator does the same for drops rebuilt before one op (one group: each op re-run once).
    Rebuilding a tensor per use instead would re-run shared inputs in several groups and
    charge more than the forward. Drops outside regions, or rebuilt in forward (graphs
    without a backward), keep their own gap.
    """
    bwd = np.asarray([p == "backward" for p in problem.op_phase], dtype=bool)
    first: dict[int, int] = {}
    for d, g in zip(drops, region):
        if g >= 0 and bwd[d.remat_before]:
            first[g] = min(first.get(g, d.remat_before), d.remat_before)
    out = []
    for d, g in zip(drops, region):
        r = first.get(g, d.remat_before) if bwd[d.remat_before] else d.remat_before
        out.append(Drop(d.tensor, d.free_after, r if r >= d.free_after + 2 else d.remat_before))
    return out


# ---------------------------------------------------------------------------------------------
# Executability: the simulator's rebuild closure, attributing each failure to a drop
# ---------------------------------------------------------------------------------------------


def executable(problem: Problem, drops: list[Drop]) -> tuple[list[Drop], set[int]]:
    """Remove the drops whose rebuild would need a gone, non-rebuildable tensor.

    Mirrors :func:`taichi_plan.simulate.core._closure`; removing a drop only makes tensors more
    available, so repeating until no failure is left converges.
    """
    removed: set[int] = set()
    while True:
        bad = unexecutable(problem, drops)
        if not bad:
            return drops, removed
        removed |= bad
        drops = [d for d in drops if d.tensor not in bad]


# ---------------------------------------------------------------------------------------------
# DTR, offline
# ---------------------------------------------------------------------------------------------


def plan_dtr(problem: Problem, budget_bytes: int | None, *, seed: int = 0,
             time_limit: float = 60.0, config: BaselinesConfig = BaselinesConfig()) -> Decisions:
    """DTR's greedy eviction replayed on the trace; lowers its internal limit by the
    simulated excess (recompute transients) for up to ``config.dtr_rounds`` rounds (eight).
    Returns the first round that fits the budget, else the round with the lowest simulated peak."""
    if budget_bytes is None:
        return Decisions(notes=[DESCRIPTIONS["dtr"], "no budget: nothing evicted"])
    t0 = time.perf_counter()
    dtr = _DTRState(problem)
    banned = np.zeros(len(problem.nbytes), dtype=bool)
    limit = int(budget_bytes)
    best, lowest, rounds, prev = None, None, 0, None
    for r in range(1, config.dtr_rounds + 1):
        rounds = r
        drops = dtr.evict(limit, banned)
        drops, removed = executable(problem, drops)
        banned[list(removed)] = True
        sim = simulate(problem, drops)
        rank = (sim.peak_bytes, sim.extra_cost)
        if lowest is None or rank < (lowest[1].peak_bytes, lowest[1].extra_cost):
            lowest = (drops, sim, limit)
        if sim.peak_bytes <= budget_bytes:
            best = (drops, sim, limit)
            break
        key = sorted((d.tensor, d.free_after) for d in drops)
        if key == prev and not removed:
            break  # nothing more to evict
        prev = key
        limit -= sim.peak_bytes - budget_bytes
        if time.perf_counter() - t0 > time_limit:
            break
    drops, sim, used = best or lowest
    notes = [DESCRIPTIONS["dtr"]]
    if best is None:
        notes.append(f"no eviction limit fit the budget; kept the plan with the lowest simulated peak "
                     f"({format_bytes(sim.peak_bytes)})")
    stats = {"rounds": rounds, "internal_limit_bytes": used, "drops": len(drops),
             "banned": int(banned.sum())}
    return Decisions(drops=drops, notes=notes, stats=stats)


class _DTRState:
    """Per-op access events and the static eligibility of each gap, shared by all rounds."""

    def __init__(self, problem: Problem):
        p = problem
        self.problem = p
        lengths = np.fromiter((len(u) for u in p.uses), dtype=np.int64, count=len(p.uses))
        ops = np.concatenate(p.uses).astype(np.int64) if len(p.uses) else np.zeros(0, np.int64)
        tens = np.repeat(np.arange(len(p.uses), dtype=np.int64), lengths)
        nxt = np.full(len(ops), -1, dtype=np.int64)
        if len(ops):
            nxt[:-1] = ops[1:]
            nxt[np.cumsum(lengths)[lengths > 0] - 1] = -1  # a tensor's last use has no next
        write_limit = p.remat_deadline
        ok = (nxt >= 0) & (nxt - ops >= 2) & (nxt <= p.end[tens]) & (ops >= p.last_write[tens])
        ok &= p.rematerializable[tens] & (p.nbytes[tens] > 0) & (nxt <= write_limit[tens])
        ok &= p.gap_allowed(p.producer[tens], ops, np.maximum(nxt, 0))
        order = np.argsort(ops, kind="stable")
        self.acc_t, self.acc_next, self.acc_ok = tens[order], nxt[order], ok[order]
        self.bounds = np.searchsorted(ops[order], np.arange(p.num_ops + 1))
        cost = p.rebuild_cost.astype(np.float64)
        eps = 1e-9 * max(float(p.op_cost.max()) if p.num_ops else 1.0, 1e-30)
        self.slope = p.nbytes / np.maximum(cost, eps)  # 1/h = slope * staleness

    def evict(self, limit: int, banned: np.ndarray) -> list[Drop]:
        p = self.problem
        n = p.num_ops
        pool = _Pool(len(self.acc_t), len(p.nbytes))
        gap_end = np.zeros(len(p.nbytes), dtype=np.int64)
        evicted = banned.copy()
        restore = np.zeros(n + 1, dtype=np.int64)
        saved = 0
        drops: list[Drop] = []
        base = p.baseline_live
        for i in range(n):
            saved -= restore[i]
            lo, hi = self.bounds[i], self.bounds[i + 1]
            ts = self.acc_t[lo:hi]
            for t in ts.tolist():
                pool.remove(t)
            live = int(base[i]) - saved
            score = pool.scores(i) if live > limit else None
            while live > limit:
                k = int(np.argmax(score)) if len(score) else -1
                if k < 0 or score[k] <= 0:
                    break  # nothing evictable during this op
                score[k] = -1.0
                t = int(pool.t[k])
                if p.python_release[t] >= i:
                    continue  # the step's Python code still holds it: evicting it frees nothing yet
                a = pool.remove(t)
                b = int(gap_end[t])
                evicted[t] = True
                drops.append(Drop(t, p.release_after(t, a), b))
                nb = int(p.nbytes[t])
                live -= nb
                saved += nb
                restore[b] += nb
            for t, b, ok in zip(ts.tolist(), self.acc_next[lo:hi].tolist(), self.acc_ok[lo:hi].tolist()):
                if ok and not evicted[t]:
                    gap_end[t] = b
                    pool.add(t, i, self.slope[t])
        return drops


class _Pool:
    """Evictable tensors in order of last access, in flat arrays scanned with numpy.

    Removal only marks a slot invalid; the arrays are compacted (order kept) once half
    the slots are invalid, so a scan costs O(evictable tensors), not O(all accesses).
    """

    def __init__(self, capacity: int, num_tensors: int):
        self.t = np.zeros(capacity + 1, dtype=np.int64)
        self.a = np.zeros(capacity + 1, dtype=np.int64)
        self.s = np.zeros(capacity + 1, dtype=np.float64)
        self.valid = np.zeros(capacity + 1, dtype=bool)
        self.slot = np.full(num_tensors, -1, dtype=np.int64)
        self.size = 0
        self.dead = 0

    def add(self, t: int, a: int, s: float) -> None:
        k = self.size
        self.size += 1
        self.t[k], self.a[k], self.s[k], self.valid[k] = t, a, s, True
        self.slot[t] = k

    def remove(self, t: int) -> int:
        """Take ``t`` out if present; returns its last access op (or -1)."""
        k = int(self.slot[t])
        if k < 0:
            return -1
        self.slot[t] = -1
        self.valid[k] = False
        self.dead += 1
        return int(self.a[k])

    def scores(self, now: int) -> np.ndarray:
        """``slope * (now - last_access)`` per slot (-1 for empty slots): DTR's 1/h."""
        if self.dead > max(1024, self.size // 2):
            self._compact()
        n = self.size
        return np.where(self.valid[:n], self.s[:n] * (now - self.a[:n]), -1.0)

    def _compact(self) -> None:
        keep = np.nonzero(self.valid[:self.size])[0]
        k = len(keep)
        for arr in (self.t, self.a, self.s):
            arr[:k] = arr[keep]
        self.valid[:k] = True
        self.valid[k:self.size] = False
        self.slot[self.t[:k]] = np.arange(k)
        self.size, self.dead = k, 0


BASELINES: dict[str, Callable[..., Decisions]] = {
    "none": plan_none,
    "full": plan_full,
    "sqrt-n": plan_sqrt_n,
    "dtr": plan_dtr,
    "selective-mm": plan_selective_mm,
}
