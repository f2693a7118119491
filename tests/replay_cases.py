"""The real recordings, plans and replays the replay tests share (tests/test_replay*.py).

One ``ReplayCases`` per test process (the session fixture ``replay_cases`` in conftest.py):
each model is recorded once, each plan solved once and each plan replayed once per process,
however many tests read them. Budgets below what the planner reaches fall back to the least
budget it reaches, so two asked budgets may share one plan (and one replay).
"""

from __future__ import annotations

from pathlib import Path

from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.plan.format import Plan, save_plan
from taichi_plan.problem.core import Problem, build_problem
from taichi_plan.trace.format import Trace, write_trace

MODELS = {
    "mlp": dict(model="mlp", hidden=256, layers=3, batch=32),
    "gpt2": dict(model="gpt2", layers=2, hidden=128, heads=4, vocab=1000, seq=64, batch=4),
    "bert": dict(model="bert", layers=2, hidden=128, heads=4, vocab=1000, seq=64, batch=4),
}

# CP-SAT's deterministic work limit stops the search (never wall time), so a plan does not
# depend on load; the tests check measured against predicted for whatever plan comes back.
WORK_LIMIT = 2


class ReplayCases:
    def __init__(self, root: Path):
        self.root = root
        self._traces: dict[str, tuple[Path, Trace, Problem]] = {}
        self._plans: dict[tuple[str, int], tuple[Plan, Path]] = {}
        self._replays: dict[Path, dict] = {}

    def trace(self, name: str) -> tuple[Path, Trace]:
        """The model's real recording, written under the session's directory."""
        if name not in self._traces:
            from taichi_plan.record import get_workload, record_workload

            trace = record_workload(get_workload(**MODELS[name]), fake=False)
            self._traces[name] = write_trace(trace, self.root / name), trace, build_problem(trace)
        path, trace, _ = self._traces[name]
        return path, trace

    def plan(self, name: str, frac: float) -> tuple[Plan, Path]:
        """auto's plan at ``frac`` of the baseline peak, or at the least budget the planner
        reaches, saved beside the trace (do not modify either: other tests read them)."""
        from taichi_plan.solve import solve

        self.trace(name)
        _, trace, problem = self._traces[name]
        budget = int(problem.baseline_peak[0] * frac)
        if (name, budget) not in self._plans:
            try:
                plan = solve(trace, budget, "auto", time_limit=600, work_limit=WORK_LIMIT, problem=problem)
            except InfeasibleBudgetError as e:
                least = int(e.min_budget_bytes)
                if (name, least) not in self._plans:
                    plan = solve(trace, least, "auto", time_limit=600, work_limit=WORK_LIMIT, problem=problem)
                    self._plans[(name, least)] = plan, self._save(plan, f"{name}-{least}")
                self._plans[(name, budget)] = self._plans[(name, least)]
            else:
                self._plans[(name, budget)] = plan, self._save(plan, f"{name}-{budget}")
        return self._plans[(name, budget)]

    def _save(self, plan: Plan, stem: str) -> Path:
        path = self.root / f"{stem}.plan.json"
        save_plan(plan, path, force=True)
        return path

    def replayed(self, plan_path: Path) -> dict:
        """``replay(plan_path, steps=1)``'s report, run once per plan file."""
        from taichi_plan.replay.measure import replay

        if plan_path not in self._replays:
            self._replays[plan_path] = replay(plan_path, steps=1)
        return self._replays[plan_path]
