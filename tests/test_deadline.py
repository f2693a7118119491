"""The time limit covers every phase of solve, not only the search (issue 11)."""

from __future__ import annotations

import time

import pytest
import torch

from taichi_plan import deadline
from taichi_plan.errors import InfeasibleBudgetError
from taichi_plan.optimizer_groups import balanced_groups, foreach_step, groups_view
from taichi_plan.partition import floor_bytes
from taichi_plan.problem import build_problem
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


def test_weighing_the_optimizer_options_stops_at_the_time_limit(deep_foreach):
    """Half of what the recorded step can reach: auto skips the recorded step (below its
    floor) and weighs stepping in groups and in backward, phases with no limit of their own.
    Before they checked the deadline, this call took 567 s at a 2 s limit (idle machine);
    now it stops within the limit (a generous 2x here: the test must not depend on load)
    and says the search stopped, not that no plan exists, with the least peak reached."""
    p = build_problem(deep_foreach)
    budget = int(floor_bytes(p).max()) // 2
    checks = deadline.checks
    t0 = time.perf_counter()
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(deep_foreach, budget, "auto", time_limit=3, problem=p)
    wall = time.perf_counter() - t0
    assert wall <= 6, wall
    assert deadline.checks > checks
    msg = " ".join(str(e.value).split())
    assert getattr(e.value, "timed_out", False), msg
    assert "within the time limit of 3 s: it stopped while" in msg and "does not prove that none exists" in msg
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
