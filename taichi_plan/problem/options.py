"""The plan space a planner picks from, on a :class:`~taichi_plan.problem.core.Problem` (no torch).

An option frees a tensor after one op and has it back before a later one: a candidate's gap
(:func:`options`, with its early-rebuild variant, or every rebuild point of the gap on
forward-only imported graphs), or, on those graphs, a revival of a tensor freed in the step
(:func:`revivable`, :func:`revival_options`). :func:`rebuild_closure` says what an option's
rebuild certainly re-runs, whatever the rest of the plan, and which candidates it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .core import FIXED_KINDS, Problem, rebuild_inputs


@dataclass
class Options:
    """Every (tensor, free_after, remat_before) a planner may pick, at most one per candidate
    gap (options of one gap share ``cand``)."""

    tensor: np.ndarray  # tensor index
    cand: np.ndarray  # index into problem.candidates
    free_after: np.ndarray
    remat_before: np.ndarray

    def __len__(self) -> int:
        return len(self.tensor)


def options(problem: Problem, early: bool = True) -> Options:
    """The plan space's options. Recorded steps and training graphs: each candidate's full
    gap, plus its early-rebuild variant where it has one. Forward-only imported graphs
    (``problem.every_gap``): each candidate gap with its rebuild before *any* op of the gap,
    ``free_after + 2 .. remat_before`` (Moccasin's intervals, which may start anywhere: a
    rebuild placed after a peak, or while its inputs are still live, frees memory where a
    rebuild right before the next use cannot)."""
    if problem.every_gap:
        a, b = problem.cand_free_after, problem.cand_remat_before
        counts = np.maximum(b - a - 1, 0)
        cand = np.repeat(np.arange(len(a)), counts)
        first = np.repeat(a + 2, counts)
        offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        return Options(tensor=problem.candidates[cand], cand=cand, free_after=a[cand],
                       remat_before=(first + offset).astype(np.int64))
    k = np.arange(len(problem.candidates))
    alt = k[problem.cand_early_remat >= 0] if early else k[:0]
    cand = np.concatenate([k, alt])
    return Options(
        tensor=problem.candidates[cand],
        cand=cand,
        free_after=problem.cand_free_after[cand],
        remat_before=np.concatenate([problem.cand_remat_before, problem.cand_early_remat[alt]]),
    )


def revivable(problem: Problem) -> np.ndarray:
    """Tensor indices that may be revived (simulate.py's module docstring), on forward-only
    imported graphs: made in the step, not model state or an input, freed before its last two
    ops, and read by the rebuild ops of a tensor that can be rebuilt (else no rebuild ever
    needs it back)."""
    if not problem.every_gap:
        return np.zeros(0, dtype=np.int64)
    read: set[int] = set()
    for x in np.nonzero(problem.rematerializable)[0].tolist():
        read.update(rebuild_inputs(problem, x))
    ok = [u for u in sorted(read) if not problem.persists[u] and problem.kind[u] not in FIXED_KINDS
          and problem.nbytes[u] > 0 and problem.end[u] + 1 < problem.num_ops - 1]
    return np.asarray(ok, dtype=np.int64)


def revival_points(problem: Problem, u: int) -> range:
    """Where tensor ``u`` may be revived: kept (``end + 1``) or, if it can be rebuilt, rebuilt
    before any later op up to its rebuild deadline (the last op is never a group's)."""
    last = min(int(problem.remat_deadline[u]), problem.num_ops - 1) if problem.rematerializable[u] else -1
    return range(int(problem.end[u]) + 1, max(last, int(problem.end[u]) + 1) + 1)


def revival_options(problem: Problem) -> Options:
    """Every revival a plan may hold (at most one per tensor); ``cand`` numbers the tensors,
    after ``problem.candidates`` (so gap options and revivals never share one)."""
    ts, pts = [], []
    for u in revivable(problem).tolist():
        pts.extend(revival_points(problem, u))
        ts.extend([u] * len(revival_points(problem, u)))
    tensor = np.asarray(ts, dtype=np.int64)
    _, cand = np.unique(tensor, return_inverse=True)
    return Options(tensor=tensor, cand=(cand.astype(np.int64) + len(problem.candidates)).reshape(-1),
                   free_after=problem.end[tensor].astype(np.int64), remat_before=np.asarray(pts, dtype=np.int64))


def rebuild_closure(problem: Problem, t: int, free_after: int, candidate_set: set[int],
                    dead_candidates: bool = True) -> tuple[list[int], list[int]]:
    """The ops a rebuild of ``t`` certainly re-runs, and the candidates it reads.

    Walks ``t``'s rebuild inputs: an input already gone when ``t`` is freed (``end <=
    free_after``) is gone at any later rebuild, whatever the plan (a rebuilt copy lives no
    longer than the original), so it must be rebuilt too and its rebuild ops join,
    recursively; any other candidate input is reported (whether it must be rebuilt depends
    on its own decision). With ``dead_candidates=False`` every candidate input is reported,
    gone or not (a weaker answer, both are true).
    """
    ops: list[int] = []
    deps: list[int] = []
    seen = {t}
    stack = [t]
    while stack:
        x = stack.pop()
        ops.extend(problem.rebuild_ops[x].tolist())
        for u in rebuild_inputs(problem, x):
            if u in seen:
                continue
            seen.add(u)
            if u in candidate_set and not dead_candidates:
                deps.append(u)
            elif problem.end[u] <= free_after and problem.rematerializable[u]:
                stack.append(u)
            elif u in candidate_set:
                deps.append(u)
    return sorted(set(ops)), deps
