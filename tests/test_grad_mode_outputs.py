"""Kernels whose outputs depend on grad mode: on CPU an LSTM layer runs ``mkldnn_rnn_layer``,
which returns the workspace its backward reads only with grad enabled. The runtime rebuilt
every op under ``no_grad``, got no workspace back and crashed in backward with an
``IndexError``; a rebuild now runs with the grad mode its op ran with (its inputs are new
tensors requiring no grad, so no graph is recorded either way)."""

from __future__ import annotations

import torch
from live_peak import train_entry

from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.solve import solve


def train(plan=None, trace=None, steps: int = 3):
    return train_entry("tiny_models:lstm_lm", plan, trace, steps)


def test_a_dropped_lstm_workspace_is_rebuilt_with_grad_enabled():
    model, ids, loss_fn, opt = get_workload(entry="tiny_models:lstm_lm").build(False)
    trace = record(model, ids, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.8), "heuristic", problem=problem, optimizer="as-recorded")
    rnn = [r for r in plan.recompute if r.op_name == "aten.mkldnn_rnn_layer.default"]
    assert rnn, [r.op_name for r in plan.recompute]  # the plan drops a layer's outputs (its workspace)
    base, base_peaks, _ = train()
    got, peaks, rt = train(plan, trace)
    assert rt.mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
    # measured by an independent live-storage counter: the plan's peak, below the unplanned one
    assert peaks[1:] == [plan.predicted["planned_peak_bytes"]] * 2, (peaks, plan.predicted["planned_peak_bytes"])
    assert peaks[-1] < base_peaks[-1]
