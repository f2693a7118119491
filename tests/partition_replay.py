"""Shared by the partition tests: replay a plan of given partitions and check that its
measured peak is the predicted one, to the byte, with gradients allclose."""

from __future__ import annotations

from taichi_plan.plan import load_plan, save_plan
from taichi_plan.replay.measure import replay
from taichi_plan.solve.result import Decisions, make_plan


def replay_partitions(problem, parts, tmp_path):
    """(the plan as written, the replay report) of ``parts`` on ``problem`` (its trace written)."""
    plan = make_plan(problem, None, "manual", Decisions(partitions=parts), 0.0, 0)
    path = tmp_path / "part.plan.json"
    save_plan(plan, path, force=True)
    return load_plan(path), replay(path, steps=1)


def assert_measured_as_predicted(r: dict) -> None:
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("allclose"), r
