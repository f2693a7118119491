"""A dropped tensor that the model's Python code still holds is freed only when that
reference dies (trace v4 ``meta.python_refs``, taichi_plan/record/pyrefs.py).

Hand-written models (tests/held_models.py) keep each block's ``a = tanh(fc_a(x))`` after its
last forward use: in a local until the block returns, in the tuple the model returns (as
``output_attentions`` does), or on ``self``. Plans that drop ``a`` are replayed (real CPU runs):
the measured peak (the recorder's count) equals the simulator's, gradients are bitwise equal,
and without ``python_refs`` (today's behaviour) the same drops measure above the prediction.
"""

from __future__ import annotations

import copy

import pytest
import torch
from held_models import workload

from taichi_plan.base.errors import PlanError
from taichi_plan.problem.core import build_problem
from taichi_plan.record import record_workload
from taichi_plan.record.api import step_tensors
from taichi_plan.record.pyrefs import probe_step
from taichi_plan.replay.measure.run import run_and_measure
from taichi_plan.report.trace_text import render_trace_summary, trace_summary
from taichi_plan.simulate.core import Drop, simulate
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import FORMAT_VERSION, read_trace, write_trace


@pytest.fixture(scope="module")
def traces():
    return {hold: record_workload(workload(hold)) for hold in ("local", "tuple", "self")}


def tanh_outputs(trace) -> list[int]:
    """Tensor ids of every block's ``a`` (the output of ``aten.tanh``)."""
    ops, t = trace.ops, trace.tensors
    tanh = set(ops.index[ops["op"] == "aten.tanh.default"].tolist())
    return [int(i) for i, p in zip(t["tensor_id"], t["producer_op"], strict=True) if int(p) in tanh]


def release_of(trace) -> dict[int, int]:
    return {int(t): int(op) for t, op in trace.meta["python_refs"]["release"]}


def test_probe_finds_where_python_lets_go(traces):
    for hold, trace in traces.items():
        rel = release_of(trace)
        ops = trace.ops
        call = trace.meta["model_calls"][0]
        first_bw = int(ops.index[ops["phase"] == "backward"][0])
        assert trace.meta["python_refs"]["segments_known"] == trace.meta["python_refs"]["segments"] == 1
        for tid in tanh_outputs(trace):
            assert tid in rel, (hold, tid)
            op = rel[tid]
            if hold == "self":  # on the module: still there when backward starts
                assert op == -1
            elif hold == "tuple":  # returned: dies when the step deletes the output, after the loss
                assert call["end"] < op < first_bw
            else:  # a local: dies when its block returns, after the block's second half ran
                module = ops["module"].iat[op]
                producer = int(trace.tensors.set_index("tensor_id").loc[tid, "producer_op"])
                assert module.split(".")[:2] == ops["module"].iat[producer].split(".")[:2]
                assert ops["op"].iloc[:op + 1].tolist().count("aten.relu.default") > 0


@pytest.mark.parametrize("hold", ["local", "tuple"])
def test_dropping_held_tensors_measures_as_predicted(traces, hold):
    trace = traces[hold]
    problem = build_problem(trace)
    idx = {problem.index_of(t) for t in tanh_outputs(trace)}
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in zip(problem.candidates, problem.cand_free_after,
                                                            problem.cand_remat_before, strict=True) if int(t) in idx]
    assert len(drops) == 3  # every block's ``a``, freed where Python lets go of it
    rel = release_of(trace)
    assert all(d.free_after == rel[int(problem.tensor_id[d.tensor])] for d in drops)
    plan = make_plan(problem, None, "manual", Decisions(drops=drops), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    wl = workload(hold)
    planned = run_and_measure(wl, plan, trace, 1, 0, "cpu")
    plain = run_and_measure(wl, None, trace, 1, 0, "cpu")
    assert planned["recompute_ops"] > 0
    assert planned["peak_bytes"] == plan.predicted["planned_peak_bytes"]
    assert plain["peak_bytes"] == plan.predicted["baseline_peak_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(planned["grads"], plain["grads"], strict=True))


@pytest.mark.parametrize("hold", ["tuple", "self"])
def test_without_python_refs_the_prediction_is_too_low(traces, hold):
    """Today's behaviour (a trace before v4): dropping ``a`` is taken to free it at its last
    use; the run holds it longer and measures above the prediction."""
    trace = copy.copy(traces[hold])
    trace.meta = {k: v for k, v in trace.meta.items() if k != "python_refs"}
    problem = build_problem(trace)
    idx = {problem.index_of(t) for t in tanh_outputs(trace)}
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in zip(problem.candidates, problem.cand_free_after,
                                                            problem.cand_remat_before, strict=True) if int(t) in idx]
    assert len(drops) == 3
    plan = make_plan(problem, None, "manual", Decisions(drops=drops), 0.0, 0)
    planned = run_and_measure(workload(hold), plan, trace, 1, 0, "cpu")
    assert planned["peak_bytes"] > plan.predicted["planned_peak_bytes"]
    # with the trace's python_refs the simulator refuses these drops: they free too early
    with pytest.raises(PlanError, match="Python code holds it until op"):
        simulate(build_problem(traces[hold]), drops)


def test_held_into_backward_is_no_candidate(traces):
    problem = build_problem(traces["self"])
    idx = {problem.index_of(t) for t in tanh_outputs(traces["self"])}
    assert not idx & set(problem.candidates.tolist())
    assert idx & set(build_problem(traces["local"]).candidates.tolist())


def test_round_trip_and_inspect(traces, tmp_path):
    back = read_trace(write_trace(traces["tuple"], tmp_path / "t"))
    assert back.meta["format_version"] == FORMAT_VERSION and back.meta["python_refs"] == traces["tuple"].meta["python_refs"]
    s = trace_summary(back)["python_refs"]
    rel = back.meta["python_refs"]["release"]
    into = sum(1 for _t, op in rel if op < 0)  # the loss and what it reads: the step holds them
    assert s["known"] and s["held"] == len(rel) and s["into_backward"] == into > 0
    text = render_trace_summary(trace_summary(back), width=250)
    assert f"held by Python after their last use, {into} of them into backward" in " ".join(text.split())
    old = copy.copy(back)
    old.meta = {k: v for k, v in back.meta.items() if k != "python_refs"}
    assert "not recorded (a trace before v4, or a Trainer or --fsdp recording made before they had it)" in " ".join(render_trace_summary(trace_summary(old), width=250).split())
    assert (build_problem(old).python_release == -1).all()


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.nn.functional.dropout(self.bn(self.fc(x)), 0.5, training=True)


def test_probe_leaves_rng_buffers_and_gradients_as_they_were():
    torch.manual_seed(3)
    model, x = Noisy(), torch.randn(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()

    def step():
        model(x).pow(2).sum().backward()
        opt.step()

    rec, free, n = probe_step(model, opt, step, step_tensors(model, opt, [x]))
    assert n == len(rec.ops["op"]) and "aten.bernoulli_.float" in rec.ops["op"]  # it ran the forward
    assert all(p == "forward" for p in rec.ops["phase"])  # and stopped when backward started
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert torch._C._current_graph_task_id() == -1 and torch.autograd.graph._engine_run_backward


@pytest.mark.parametrize("hold", ["tuple", "self"])
def test_every_planner_frees_where_python_lets_go(traces, hold):
    """Every planner's drops start at the release point: the simulator accepts all of them
    (it refuses a drop that frees a tensor Python still holds)."""
    from taichi_plan.solve import methods, run_method

    problem = build_problem(traces[hold])
    budget = int(problem.baseline_peak[0] * 0.8)
    for method in methods():
        dec = run_method(problem, budget, method, time_limit=5, work_limit=2)
        simulate(problem, dec.drops)  # raises PlanError on a drop that frees too early
        for d in dec.drops:
            assert d.free_after >= problem.python_release[d.tensor], (method, d)
