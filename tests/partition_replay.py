"""Shared by the partition tests: replay a plan of given partitions and check that its
measured peak is the predicted one, to the byte, with gradients allclose."""

from __future__ import annotations

from taichi_plan.plan import load_plan, save_plan
from taichi_plan.replay.measure import replay
from taichi_plan.solve.result import Decisions, make_plan


def recorded(directory, **sizes):
    """A workload recorded for real, its trace written to ``directory``: (directory, problem)."""
    from taichi_plan.problem import build_problem
    from taichi_plan.record import get_workload, record_workload
    from taichi_plan.trace import write_trace

    trace = record_workload(get_workload(**sizes), fake=False)
    write_trace(trace, directory)
    return directory, build_problem(trace)


def replay_partitions(problem, parts, tmp_path):
    """(the plan as written, the replay report) of ``parts`` on ``problem`` (its trace written)."""
    plan = make_plan(problem, None, "manual", Decisions(partitions=parts), 0.0, 0)
    path = tmp_path / "part.plan.json"
    save_plan(plan, path, force=True)
    return load_plan(path), replay(path, steps=1)


def assert_measured_as_predicted(r: dict) -> None:
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("allclose"), r
