"""A live step that skips module calls its recorded step made: layerdrop (wav2vec2's default
0.1, HuBERT, WavLM), a branch on a tensor's value. The runtime skips the recorded ops of such a
call (``runtime.calls.module_calls``, ``PlanRuntime._resync``) and goes on with the plan; before, the
first skipped layer stopped the plan with "the live op sequence differs", and a plan for a
wav2vec2 trained with its default config ran no step planned."""

from __future__ import annotations

import pytest
import torch
from live_peak import end_run, step_peak

import taichi_plan
from taichi_plan.base.errors import MismatchError
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.record.api import kept_index
from taichi_plan.solve import solve

STEPS = 12


def build(layerdrop: float):
    model, x, loss_fn, opt = get_workload(entry="tiny_models:layerdrop_mlp", batch=1024).build(False)
    model.layerdrop = layerdrop
    return model, x, loss_fn, opt


@pytest.fixture(scope="module")
def planned():
    """A plan at 55% of the peak of the step that calls every block (recorded with the skipping
    off, as the fullest of several recorded steps would be)."""
    model, x, loss_fn, opt = build(0.0)
    trace = record(model, x, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.55), "heuristic", problem=problem, optimizer="as-recorded")
    assert plan.recompute
    return plan, trace


def train(plan=None, trace=None, layerdrop=0.5, on_mismatch="raise"):
    torch.manual_seed(7)
    model, x, loss_fn, opt = build(layerdrop)
    if plan is not None:
        model = taichi_plan.apply(model, plan, trace=trace, on_mismatch=on_mismatch, optimizer=opt)
    peaks, called = [], []
    for _ in range(STEPS):
        seen = []
        hooks = [b.register_forward_pre_hook(lambda m, a, i=i, seen=seen: seen.append(i)) for i, b in enumerate(model.blocks)]
        peaks.append(step_peak(model, opt, x, loss_fn))
        for h in hooks:
            h.remove()
        called.append(len(seen))
    params, rt = end_run(model, plan is not None)
    return params, peaks, called, rt


def test_steps_that_skip_layers_run_the_plan_within_its_prediction(planned):
    plan, trace = planned
    base, base_peaks, base_called, _ = train()
    got, peaks, called, rt = train(plan, trace)
    assert called == base_called and min(called) < 6, "no step skipped a block: the test proves nothing"
    assert rt.skipped_calls == sum(6 - c for c in called)
    assert rt.mismatches == 0
    predicted = plan.predicted["planned_peak_bytes"]
    # every step within the prediction and at most the unplanned step's peak (a step that
    # skipped every block has nothing to drop), below it where it called half the blocks or more
    assert all(p <= predicted for p in peaks), (peaks, predicted)
    assert all(p <= b for p, b in zip(peaks, base_peaks, strict=True)), (peaks, base_peaks, called)
    assert all(p < b for p, b, c in zip(peaks, base_peaks, called, strict=True) if c >= 3)
    # the same RNG draws (the skips, the dropout masks, rebuilt with their recorded state)
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))


def test_a_step_calling_a_block_its_recording_skipped_stops_with_the_way_out():
    """The other way round: the recorded step skipped a block, a live step calls it. Its ops
    are not in the trace: the plan stops for that call, and says what to do."""
    model, x, loss_fn, opt = build(0.5)
    torch.manual_seed(3)
    trace = record(model, x, loss_fn, opt, steps=1)
    assert len(trace.meta["module_args"]) and sum(
        len(v) for k, v in trace.meta["module_args"].items() if k.startswith("blocks.") and k.count(".") == 1) < 6
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.6), "heuristic", problem=problem, optimizer="as-recorded")
    model2, x2, loss_fn2, opt2 = build(0.0)  # calls every block
    model2 = taichi_plan.apply(model2, plan, trace=trace)
    with pytest.raises(MismatchError, match="differs") as e:
        loss_fn2(model2(x2), x2).backward()
    assert "on_mismatch='warn'" in str(e.value)
    taichi_plan.finish(model2)


class _Rec:
    def __init__(self, calls):
        self.module_args = {f"m{i}": [[0, []]] * n for i, n in enumerate(calls)}


def test_the_trace_keeps_the_step_with_the_most_module_calls():
    assert kept_index([_Rec([1, 1]), _Rec([1, 1])]) == 1  # the same: the last
    assert kept_index([_Rec([1, 1]), _Rec([1, 0]), _Rec([0, 1])]) == 0
    assert kept_index([_Rec([1, 0]), _Rec([1, 1]), _Rec([1, 1]), _Rec([0, 1])]) == 2


def test_a_skipped_layer_that_changes_the_shapes_after_it_says_so():
    """Informer's layerdrop skips a layer with the convolution that halves its sequence: what
    follows runs on a longer one, which the plan cannot predict. The plan stops for that call
    and says what happened (before: "the model or its code changed since the trace was recorded")."""
    model, x, loss_fn, opt = get_workload(entry="tiny_models:pooling_blocks").build(False)
    trace = record(model, x, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.7), "heuristic", problem=problem, optimizer="as-recorded")
    model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    model.skip = {0}
    opt.zero_grad(set_to_none=True)
    with pytest.raises(MismatchError, match="Earlier in this call the model skipped blocks.0") as e:
        loss_fn(model(x), x).backward()
    assert "layerdrop=0" in str(e.value)
    model.skip = set()  # the next call runs the plan again
    loss_fn(model(x), x).backward()
    taichi_plan.finish(model)


def test_steps_that_skip_blocks_calling_a_shared_module_run_the_plan():
    """Blocks that each call one module registered on the model (a shared GELU): a skipped block
    shifts which of the GELU's recorded calls the next block makes. The runtime runs in planned
    regions, module calls counted by name; the skip is seen at the next module call and the rest
    of that call is counted op by op, so no region is entered at the shifted count: no mismatch,
    parameters bitwise the unplanned run's, every step within the prediction."""
    def built(layerdrop: float):
        model, x, loss_fn, opt = get_workload(entry="tiny_models:shared_act_layerdrop").build(False)
        model.layerdrop = layerdrop
        return model, x, loss_fn, opt

    model, x, loss_fn, opt = built(0.0)
    trace = record(model, x, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.55), "heuristic", problem=problem, optimizer="as-recorded")
    assert plan.recompute

    def run(planned: bool):
        torch.manual_seed(7)
        model, x, loss_fn, opt = built(0.5)
        if planned:
            model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
        peaks = [step_peak(model, opt, x, loss_fn) for _ in range(STEPS)]
        params, rt = end_run(model, planned)
        return params, peaks, rt

    base, _, _ = run(False)
    got, peaks, rt = run(True)
    assert rt.mismatches == 0 and rt.skipped_calls > 0
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
    assert all(p <= plan.predicted["planned_peak_bytes"] for p in peaks), peaks
