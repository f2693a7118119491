"""Plans of torch.compile'd steps (aot_eager here; inductor runs in make bench)."""

import copy

import pytest
import torch

import taichi_plan
from taichi_plan.compiled import compiled_peak, record_compiled
from taichi_plan.record import get_workload
from taichi_plan.record.api import make_step_fn
from taichi_plan.solve import solve
from taichi_plan.trace import baseline_peak, write_trace


def _build(state=None):
    torch.manual_seed(0)
    wl = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=64, batch=8)
    model, batch, loss_fn, opt = wl.build(False)
    if state is not None:
        model.load_state_dict(state)
    return model, batch, loss_fn, opt


def _measure(model, batch, loss_fn, opt):
    step = make_step_fn(model, batch, loss_fn, opt)
    opt.zero_grad(set_to_none=True)
    step()  # compiles
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    peak = compiled_peak(step, model, opt, list(batch.values()))["peak_bytes"]
    return peak, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_plan_measures_as_predicted(tmp_path):
    model, batch, loss_fn, opt = _build()
    state = copy.deepcopy(model.state_dict())
    trace = record_compiled(torch.compile(model, backend="aot_eager"), batch, loss_fn, opt)
    assert trace.meta["compiled"]["backend"] == "aot_eager"
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.7), time_limit=10)
    assert plan.recompute and not plan.partitions and plan.optimizer is None
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")

    m, b, lf, o = _build(state)
    base_peak, base_grads = _measure(torch.compile(m, backend="aot_eager"), b, lf, o)
    m, b, lf, o = _build(state)
    planned = taichi_plan.apply(torch.compile(m, backend="aot_eager"), plan)
    peak, grads = _measure(planned, b, lf, o)
    predicted = plan.predicted["planned_peak_bytes"]
    assert abs(peak / predicted - 1) <= 0.03, (peak, predicted)
    assert abs(base_peak / plan.predicted["baseline_peak_bytes"] - 1) <= 0.03
    assert peak < 0.8 * base_peak
    for k in base_grads:  # same ops, same order of their results: bitwise on CPU
        assert torch.equal(base_grads[k], grads[k]), k
    taichi_plan.finish(planned)


def test_compiled_plan_refused_on_eager_model(tmp_path):
    model, batch, loss_fn, opt = _build()
    trace = record_compiled(torch.compile(model, backend="aot_eager"), batch, loss_fn, opt, steps=1)
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.9), time_limit=5)
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")
    with pytest.raises(taichi_plan.TaichiError, match="compiled model only"):
        taichi_plan.apply(_build()[0], plan)
