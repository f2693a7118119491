"""Bytes live under drops, from a :class:`~taichi_plan.problem.core.Problem` (no torch).

:func:`gap_bytes` counts the bytes away at each op while tensors are freed over their gaps,
:func:`coverage_delta` what the candidates free, and :func:`min_live_bytes` what must stay
live under any plan: the floor no budget can go below.
"""

from __future__ import annotations

import numpy as np

from .core import Problem


def gap_bytes(n: int, free_after: np.ndarray, remat_before: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Bytes away during each of ``n`` ops when each tensor is freed after ``free_after`` and
    back before ``remat_before`` (ops ``free_after+1 .. remat_before-1``)."""
    delta = np.zeros(n + 1, dtype=np.int64)
    np.add.at(delta, free_after + 1, sizes)
    np.add.at(delta, remat_before, -sizes)
    return np.cumsum(delta)[:n]


def coverage_delta(problem: Problem, chosen: np.ndarray | None = None) -> np.ndarray:
    """Bytes freed at each op by dropping the candidates (all, or those where ``chosen``).

    A candidate frees its bytes during ops ``free_after+1 .. remat_before-1``: an upper
    bound on what it saves (rebuilding early or transients only add memory back).
    """
    sel = np.ones(len(problem.candidates), dtype=bool) if chosen is None else chosen.astype(bool)
    return gap_bytes(problem.num_ops, problem.cand_free_after[sel], problem.cand_remat_before[sel],
                     problem.nbytes[problem.candidates[sel]])


def min_live_bytes(problem: Problem) -> np.ndarray:
    """Bytes that must be live during each op under any plan (everything droppable dropped,
    nothing rebuilt): no budget below ``max(min_live_bytes)`` can be met."""
    return problem.baseline_live - coverage_delta(problem)
