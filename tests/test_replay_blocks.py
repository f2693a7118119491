"""Replay of plans that partition whole residual blocks (the --entry example at batch 512)."""

from __future__ import annotations

from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.solve import solve
from taichi_plan.trace.format import write_trace


def test_partitioned_blocks_replay_within_budget(tmp_path):
    """The --entry example at batch 512: plans that partition whole residual blocks (and drop
    the block outputs' readers) used to measure 13% over their prediction (every chunk adds
    its piece of each weight gradient) or fail in backward ("no recipe": a rebuild needed a
    tensor that only a partitioned module makes)."""
    trace = record_workload(get_workload(entry="examples.my_workload:make_step", batch=512), fake=False)
    write_trace(trace, tmp_path / "mine")
    p = build_problem(trace)
    replayed = 0
    for frac in (0.75, 0.8, 0.85):
        try:
            plan = solve(trace, int(p.baseline_peak[0] * frac), "auto", time_limit=10, problem=p)
        except InfeasibleBudgetError:
            continue
        path = tmp_path / f"mine-{int(frac * 100)}.plan.json"
        save_plan(plan, path)
        r = replay(path, steps=1)
        assert r["within_budget"] and abs(r["peak_ratio"] - 1) <= 0.02 and r["grads_match"], r
        replayed += 1
    assert replayed >= 2
