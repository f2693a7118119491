"""Views of a ``foreach`` optimizer step in groups: each op of one parameter runs once, in its
parameter's group (optimizer_groups.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from taichi_plan.problem.optimizer.groups import balanced_groups, foreach_step, groups_view
from taichi_plan.record.api import record

LAYERS = 5  # 10 parameters


@pytest.fixture(scope="module")
def adamw_foreach():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(LAYERS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return record(model, torch.randn(8, 16), lambda out, _b: out.square().mean(), opt, steps=1)


def optimizer_ops(trace) -> Counter:
    return Counter(trace.ops["op"][trace.ops["phase"] == "optimizer"].tolist())


def test_step_counts_belong_to_their_parameter(adamw_foreach):
    """AdamW's per-parameter ``step`` tensors appear in no foreach op beside a parameter's
    tensors (``_foreach_add_(state_steps, 1)`` alone, then ``step.item()`` per parameter):
    they are tied to their parameter by position in the step's lists."""
    step = foreach_step(adamw_foreach)
    assert len(step.params) == 2 * LAYERS
    acc = adamw_foreach.accesses
    names = adamw_foreach.ops["op"]
    for o in step.ops:
        if names[o] == "aten._local_scalar_dense.default":  # step.item(): one count, one parameter
            (t,) = acc["tensor_id"][acc["op_id"] == o].tolist()
            assert t in step.unit_of
    steps_op = next(o for o in step.ops if names[o] == "aten._foreach_add_.Tensor")
    written = acc[(acc["op_id"] == steps_op) & (acc["role"] == "write")].sort_values("arg_index")["tensor_id"].tolist()
    assert [step.unit_of[t] for t in written] == list(range(2 * LAYERS))


@pytest.mark.parametrize("k", [1, 2, 10])
def test_a_view_in_k_groups_runs_each_parameters_ops_once(adamw_foreach, k):
    """In k groups: every foreach op once per group (each on its group's elements), the
    per-parameter ``_local_scalar_dense`` ops once in all (in their parameter's group), and
    the one op that touches no parameter (``lift_fresh`` of the 1 added to every count) once
    per group, on its group's copy. Before the counts were tied, the view in 10 groups had
    300 optimizer ops (every count's ops in every group); now 120."""
    plain = optimizer_ops(adamw_foreach)
    step = foreach_step(adamw_foreach)
    view = groups_view(adamw_foreach, step, balanced_groups(adamw_foreach, step, k))
    got = optimizer_ops(view)
    for name, n in plain.items():
        per_group = "._foreach_" in name or name == "aten.lift_fresh.default"
        assert got[name] == (k * n if per_group else n), name
    assert sum(got.values()) == {1: 30, 2: 40, 10: 120}[k]
