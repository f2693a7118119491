"""The time limit covers every phase of solve, not only the search (issue 11)."""

from __future__ import annotations

import time

import pytest
import torch

from taichi_plan.base import deadline
from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.optimizer.groups import balanced_groups, foreach_step, groups_view
from taichi_plan.problem.partition.floor import floor_bytes
from taichi_plan.record.api import record
from taichi_plan.solve import solve


@pytest.fixture(scope="module")
def deep_foreach():
    """A 100-layer MLP stepped by AdamW(foreach=True): 200 parameters in one foreach step,
    so weighing the optimizer options builds views of the step in 2 to 200 groups."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(100)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return record(model, torch.randn(8, 16), lambda out, _b: out.square().mean(), opt, steps=1)


@pytest.fixture(scope="module")
def deeper_foreach():
    """The same MLP with 250 layers: weighing its options takes long enough (about 1.3 s once
    the trace's caches are built, on this machine idle) to stop part-way through it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(250)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return record(model, torch.randn(8, 16), lambda out, _b: out.square().mean(), opt, steps=1)


def test_weighing_the_optimizer_options_stops_at_the_time_limit(deeper_foreach):
    """Half of what the recorded step can reach: auto skips the recorded step (below its
    floor) and weighs stepping in groups and in backward, phases with no limit of their own.
    Before they checked the deadline, a 100-layer call took 567 s at a 2 s limit (idle
    machine); since the groups view ties AdamW's step counts to their parameters, the whole call
    proves the budget infeasible in seconds. So the limit is a fifth of what the unlimited call
    takes (measured here, after a first call has built the trace's caches, so that load scales
    both): the call must stop within the limit plus half the unlimited time, and say the search
    stopped, not that no plan exists, with the least peak reached. Without the deadline's
    checks it would run the whole time and fail."""
    tr = deeper_foreach
    p = build_problem(tr)
    budget = int(floor_bytes(p).max()) // 2
    for _ in range(2):  # the first call builds the trace's caches; the second is timed
        t0 = time.perf_counter()
        with pytest.raises(InfeasibleBudgetError) as full:
            solve(tr, budget, "auto", time_limit=600, problem=p)
        whole = time.perf_counter() - t0
        assert not getattr(full.value, "timed_out", False)  # the unlimited call ends with a proof
    limit = whole / 5
    checks = deadline.checks
    t0 = time.perf_counter()
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(tr, budget, "auto", time_limit=limit, problem=p)
    wall = time.perf_counter() - t0
    assert wall <= limit + whole / 2, (wall, limit, whole)
    assert deadline.checks > checks
    msg = " ".join(str(e.value).split())
    assert getattr(e.value, "timed_out", False), msg
    assert "it stopped while" in msg and "does not prove that none exists" in msg
    assert budget < e.value.min_budget_bytes <= p.baseline_peak[0]


def test_a_check_outside_a_deadline_does_nothing_and_inside_one_raises():
    deadline.check("anything")  # no deadline in force
    with deadline.until(time.perf_counter() - 1):
        with pytest.raises(deadline.OutOfTime, match="building"):
            deadline.check("building")
        with deadline.lifted():
            deadline.check("the search")  # lifted: bounded by its own limit
        with deadline.until(time.perf_counter() + 60):  # a later deadline does not extend an earlier one
            assert deadline.past()


def test_the_groups_view_checks_the_deadline(deep_foreach):
    """The view in one group per parameter (200 groups) holds every foreach op once per
    group; past the deadline its building stops at the next group."""
    step = foreach_step(deep_foreach)
    assert len(step.params) == 200
    groups = balanced_groups(deep_foreach, step, 200)
    view = groups_view(deep_foreach, step, groups)
    foreach = deep_foreach.ops["op"].str.contains("._foreach_", regex=False)
    assert view.ops["op"].str.contains("._foreach_", regex=False).sum() == 200 * foreach.sum()
    assert view.accesses["op_id"].is_monotonic_increasing
    with deadline.until(time.perf_counter() - 1), pytest.raises(deadline.OutOfTime, match="groups"):
        groups_view(deep_foreach, step, groups)


def test_a_plan_met_while_reporting_is_written_when_time_runs_out(monkeypatch):
    """When the time runs out in a phase before any plan (on a 93k-op trace: finding the floor),
    the report bisects the heuristic's budget for the least it reaches; a plan it found there
    that fits the budget asked for is the best plan so far, so it is returned (feasible, timed
    out, no bound) instead of an error that says none was found. Forced here by making the
    options' phase run out of time at once."""
    import taichi_plan.solve as solve_mod
    from taichi_plan.base.deadline import OutOfTime

    torch.manual_seed(0)  # activations set the peak here (a batch of 512 through 8 layers)
    model = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tr = record(model, torch.randn(512, 64), lambda out, _b: out.square().mean(), opt, steps=1)
    p = build_problem(tr)
    budget = int(p.baseline_peak[0] * 0.8)

    def out_of_time(*_a, **_k):
        raise OutOfTime("finding the least memory any plan needs (the floor)")

    monkeypatch.setattr(solve_mod, "_solve_options", out_of_time)
    plan = solve(tr, budget, "auto", time_limit=30, problem=p)
    assert plan.recompute and plan.predicted["planned_peak_bytes"] <= budget  # (make_plan simulates it)
    assert plan.solver["status"] == "feasible" and plan.solver["lower_bound"] is None
    assert any("time limit ran out while finding the least memory" in n for n in plan.solver["notes"])
    # Asked for less than any plan reaches, it is still the error that says the search stopped.
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(tr, int(floor_bytes(p).max()) - 1, "auto", time_limit=30, problem=build_problem(tr))
    assert "does not prove that none exists" in " ".join(str(e.value).split())


def test_the_optimizer_options_share_the_time_left(deep_foreach, monkeypatch):
    """Below the recorded step's floor, each optimizer option is solved with its share of the
    time left (the options after it get theirs), so one that finds no plan cannot spend the
    time the next one needs: before, stepping in groups took the whole 20 s on a ViT-base at
    35% and stepping in backward, where the heuristic alone fits, never ran. The recorded
    step keeps the whole limit."""
    import taichi_plan.solve as solve_mod

    tr = deep_foreach
    p = build_problem(tr)
    budget = int(floor_bytes(p).max()) - 1  # just below the recorded step's floor: groups is tried
    calls = []
    inner = solve_mod._solve_step

    def spy(*a, **k):
        calls.append(((k["problem"].trace.meta.get("optimizer_view") or {}).get("mode"), k["time_limit"],
                      time.perf_counter() - k["started"]))
        return inner(*a, **k)

    monkeypatch.setattr(solve_mod, "_solve_step", spy)
    try:
        solve(tr, budget, "auto", time_limit=60, problem=p)
    except InfeasibleBudgetError:
        pass
    first = [c for c in calls if c[0] == "groups"]
    assert first, calls
    _, limit, began = first[0]
    assert limit <= began + (60 - began) / 2 + 1e-6, calls  # half of what was left: two options to go
    assert all(lim == 60 for m, lim, _ in calls if m == "in-backward"), calls  # the last: the whole rest


def test_a_stopped_search_never_suggests_more_than_the_unplanned_peak(deep_foreach):
    """When the time runs out with no plan, the lowest peak reported is never above the step's
    own peak: an option's best plan may hold more than the step unplanned (a forward-only
    graph's rebuilds), and the unplanned step meets its peak with no plan at all."""
    from taichi_plan.solve.messages import stopped_error

    problem = build_problem(deep_foreach)
    base, _op = problem.baseline_peak
    above = InfeasibleBudgetError("an option's plan", min_budget_bytes=int(base * 1.04), op_id=3)
    err = stopped_error(problem, base // 2, "auto", "weighing", 5.0, None, [above], time.perf_counter() + 5)
    assert err.min_budget_bytes == base and err.timed_out
    below = InfeasibleBudgetError("an option's plan", min_budget_bytes=base - 64, op_id=3)
    err = stopped_error(problem, base // 2, "auto", "weighing", 5.0, None, [above, below], time.perf_counter() + 5)
    assert err.min_budget_bytes == base - 64
