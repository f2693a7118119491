"""The two terms every solver scores a drop by: what its rebuild costs (:func:`rebuild_cost`) and
the peak the simulator sees at each op with the recompute group before it (:func:`sim_over`)."""

from __future__ import annotations

import numpy as np

from ..problem.core import Problem
from ..problem.options import Options, rebuild_closure
from ..simulate.core import SimResult


def rebuild_cost(problem: Problem, opts: Options) -> np.ndarray:
    """Per option: the cost of its rebuild ops plus the forward temporaries it must redo, as
    the runtime re-runs them (``Problem.rerun_cost``), plus the drop's own cost
    (``Problem.drop_cost``). The cost per (tensor, free_after) is kept on ``problem``: the
    heuristic's sweeps ask for it again from each start (on a generated 1,000-node forward-only
    graph, 2.5 s a call)."""
    cand_set = set(problem.candidates.tolist())
    out = np.zeros(len(opts))
    # the closure depends on the tensor and free_after only
    seen: dict[tuple[int, int], float] = problem.__dict__.setdefault("_rebuild_cost_of_gap", {})
    rerun = problem.rerun_cost
    for k, (t, a) in enumerate(zip(opts.tensor.tolist(), opts.free_after.tolist(), strict=True)):
        if (t, a) not in seen:
            ops, _ = rebuild_closure(problem, t, a, cand_set)
            seen[(t, a)] = float(rerun[ops].sum()) + problem.drop_cost
        out[k] = seen[(t, a)]
    return out


def sim_over(problem: Problem, sim: SimResult) -> np.ndarray:
    """Peak bytes during each op including the recompute group before it."""
    over = sim.live_bytes.astype(np.int64).copy()
    for r, g in sim.groups.items():
        over[r] = max(over[r], g.peak_bytes)
    return over
