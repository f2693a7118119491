"""record_step: a step function the caller writes, recorded through the same path as record()."""

from __future__ import annotations

import pytest
import torch

from taichi_plan.base.errors import UsageError, WorkloadError
from taichi_plan.record import Loop, get_workload, record, record_step

GPT2 = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=512, seq=32, batch=4)


def test_record_step_records_what_record_records():
    torch.manual_seed(0)
    model, batch, loss_fn, opt = get_workload(**GPT2).build(False)
    loop = Loop(micro_batches=2, clip_grad_norm=1.0)
    by_record = record(model, batch, loss_fn, opt, loop=loop)

    def step():  # the loop record() runs, written out by hand
        for _ in range(2):
            (loss_fn(model(**batch), batch) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    by_step = record_step(model, opt, step, inputs=batch, loop=loop, name="mine", args={"batch": 4})
    assert by_step.ops["op"].tolist() == by_record.ops["op"].tolist()
    assert by_step.tensors["kind"].tolist() == by_record.tensors["kind"].tolist()
    assert by_step.tensors["nbytes"].tolist() == by_record.tensors["nbytes"].tolist()
    assert [c["inputs"] for c in by_step.meta["model_calls"]] == [c["inputs"] for c in by_record.meta["model_calls"]]
    meta = by_step.meta
    assert meta["steps_match"] and meta["loop"] == loop.to_json()
    assert meta["workload"] == {"name": "mine", "kind": "python", "args": {"batch": 4}}
    assert "step_fn" in meta["step_definition"]


def test_record_step_refuses_a_loop_it_did_not_run():
    model, batch, loss_fn, opt = get_workload(**GPT2).build(False)

    def step():
        loss_fn(model(**batch), batch).backward()
        opt.step()

    with pytest.raises(UsageError, match=r"called the model 1 time\(s\) with grad.*2 micro-batch"):
        record_step(model, opt, step, inputs=batch, loop=Loop(micro_batches=2))
    with pytest.raises(WorkloadError, match="step_fn is a int"):
        record_step(model, opt, 3)


def test_a_gradient_penalty_step_records_and_gets_an_honest_answer():
    """``torch.autograd.grad(..., create_graph=True)`` over an input the step made require grad
    (a WGAN-GP or R1 penalty): PyTorch's ModTracker, which labels ops with modules, aborted such
    a step ("A leaf node was passed to _will_engine_execute_node ..."); the recorder closes a
    module whose inputs are all leaves at their first gradient instead."""
    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.problem.core import build_problem
    from taichi_plan.solve import solve

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 16)

    def step():
        xi = x.clone().requires_grad_(True)
        out = model(xi)
        (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
        (out.mean() + 10 * (g.norm(dim=1) - 1).pow(2).mean()).backward()
        opt.step()

    trace = record_step(model, opt, step, inputs=(x,))
    ops = trace.ops
    # the penalty's grad pass is labelled with the model's modules, as a backward
    first_pass = ops[(ops["phase"] == "backward") & (ops["module"] == "0")]
    assert len(first_pass) and int(first_pass.index[0]) < int(ops.index[ops["op"] == "aten.linalg_vector_norm.default"][0])
    problem = build_problem(trace)
    with pytest.raises(InfeasibleBudgetError, match="more than one backward pass"):
        solve(trace, int(problem.baseline_peak[0] * 0.5), "heuristic", problem=problem)
