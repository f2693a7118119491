"""A planned call whose model returns an output the loss never uses (a pooler beside an MLM
head). The runtime's pack hook kept saved tensors as it got them, with their grad_fn: a node
that saves its own output (tanh) then formed a cycle, output -> node -> kept output, that no
backward ever breaks for an unused branch and that PyTorch's garbage collector cannot see
into. A tiny FNet leaked 3 tensors a step, and its measured peak was 4,096 B over the
predicted one."""

from __future__ import annotations

import gc

import torch
from live_peak import step_peak

import taichi_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.solve import solve


def _tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_an_unused_output_is_freed_and_nothing_builds_up_from_step_to_step():
    build = get_workload(entry="tiny_models:pooled_mlp").build
    model, x, loss_fn, opt = build(False)
    trace = record(model, x, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.7), "heuristic", problem=problem,
                 optimizer="as-recorded")
    assert plan.recompute or plan.partitions, "the plan changes nothing: the call would run unplanned"
    model, x, loss_fn, opt = build(False)
    model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    counts, peaks = [], []
    for _ in range(4):
        peaks.append(step_peak(model, opt, x, loss_fn))
        counts.append(_tensors())
    taichi_plan.finish(model)
    # (the first step makes AdamW's state); before, each step kept its pooled branch: 42, 46, 46, 50
    assert counts[3] <= counts[1], counts
    assert max(peaks) <= plan.predicted["planned_peak_bytes"], (peaks, plan.predicted["planned_peak_bytes"])
