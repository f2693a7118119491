"""Tensors whose sizes depend on tensor values (trace v11 ``meta.data_sized``): a mixture of
experts that loops over its experts routes another number of tokens to each one every step.
Before, replay held every storage to its recorded size, so the first step with other routing
stopped the plan ("its output 0 has 1056 bytes, the plan's trace has 1104"), also inside
``taichi-plan replay``, whose optimizer steps change the routing."""

from __future__ import annotations

import pytest
import torch
from live_peak import end_run, step_peak
from torch import nn

import taichi_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.record.api import first_mismatch
from taichi_plan.report.trace_text import render_trace_summary, trace_summary
from taichi_plan.solve import solve
from taichi_plan.trace.format import data_sized_note

STEPS = 6


def build():
    return get_workload(entry="tiny_models:looped_moe").build(False)


@pytest.fixture(scope="module")
def planned():
    model, x, loss_fn, opt = build()
    trace = record(model, x, loss_fn, opt)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.6), "heuristic", problem=problem, optimizer="as-recorded")
    return plan, trace


def test_the_recorder_follows_sizes_set_by_values(planned):
    _, trace = planned
    info = trace.meta["data_sized"]
    # the routing's nonzero (torch.where), once per expert of each layer
    assert info["sources"] == [["aten.nonzero.default", "blocks.0", 4], ["aten.nonzero.default", "blocks.1", 4]]
    t = trace.tensors.set_index("tensor_id")
    ops = trace.ops
    sized = set(info["tensors"])
    made = {int(r.tensor_id): ops.at[int(r.producer_op), "op"] for r in t.reset_index().itertuples() if r.producer_op >= 0}
    # every expert's gathered tokens, its matmuls and activation are sized by the routing ...
    experts = {tid for tid in sized if ops.at[int(t.at[tid, "producer_op"]), "module"].startswith("blocks.0.experts.")}
    assert {made[tid] for tid in experts} >= {"aten.addmm.default", "aten.gelu.default"}
    # ... the layer's output, which index_add_ writes in place, and the head are not (in
    # backward, gradients computed from sized tensors are counted too: the safe side)
    for tid, op in made.items():
        o = int(t.at[tid, "producer_op"])
        if ops.at[o, "phase"] == "forward" and (op == "aten.zeros_like.default" or ops.at[o, "module"] in ("head", "inp")):
            assert tid not in sized, (tid, op)
    assert data_sized_note(trace.meta).startswith(f"{len(sized)} tensors of the step have sizes set by tensor values")
    text = " ".join(render_trace_summary(trace_summary(trace), width=100).split())  # inspect says it too
    assert f"{len(sized)} tensors of the step have sizes set by tensor values" in text


def test_gathering_by_fixed_indices_is_not_sized_by_values():
    """``x[idx]`` with integer indices is tagged ``dynamic_output_shape`` for boolean masks only;
    indices that are not themselves sized by values give a fixed size."""

    class Gather(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("perm", torch.randperm(32))

        def forward(self, x):
            return self.lin(x)[self.perm].sum(-1)

    torch.manual_seed(0)
    model = Gather()
    trace = record(model, torch.randn(32, 8), lambda out, _b: out.pow(2).mean(), torch.optim.SGD(model.parameters()))
    assert trace.meta["data_sized"] == {"tensors": [], "ops": [], "sources": []}
    assert data_sized_note(trace.meta) is None


def train(plan=None, trace=None):
    torch.manual_seed(7)
    model, x, loss_fn, opt = build()
    if plan is not None:
        model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    counts, peaks = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        xb = torch.randn(x.shape, generator=g)  # fresh data: other tokens per expert
        with torch.no_grad():  # (outside the model's call: the plan runs inside it only)
            chosen = model.blocks[0].router(model.inp(xb)).topk(2, dim=-1).indices
            counts.append(torch.bincount(chosen.flatten(), minlength=4).tolist())
        peaks.append(step_peak(model, opt, xb, loss_fn))
    params, rt = end_run(model, plan is not None)
    return params, peaks, counts, rt


def test_other_routing_every_step_runs_the_plan_bitwise(planned):
    plan, trace = planned
    sized = set(trace.meta["data_sized"]["tensors"])
    assert sum(r.tensor in sized for r in plan.recompute) >= 10, "the plan drops no expert tensor: proves nothing"
    base, base_peaks, base_counts, _ = train()
    got, peaks, counts, rt = train(plan, trace)
    assert len({tuple(c) for c in counts}) == STEPS, counts  # every step routes differently
    assert rt.mismatches == 0 and rt.dropped_storages >= STEPS * 10
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))  # rebuilt at the live sizes
    # Every step saves memory; the peak is predicted at the recorded routing, and the others
    # land within 5% of it (measured: 0.7-2.0% above, at 0.58 of the unplanned peak).
    predicted = plan.predicted["planned_peak_bytes"]
    assert all(p < b for p, b in zip(peaks[1:], base_peaks[1:], strict=True)), (peaks, base_peaks)
    assert all(abs(p - predicted) <= 0.05 * predicted for p in peaks[1:]), (peaks, predicted)


class _Rec:
    def __init__(self, shapes, sized=()):
        self.ops = {"op": ["a", "b", "c"], "module": ["", "", ""]}
        self.shapes = shapes
        self.data_sized_ops = set(sized)
        self.num_ops = 3


def test_recorded_steps_compare_sized_outputs_by_name_only():
    ref = _Rec([((2,),), ((3,),), ((4,),)], sized={1})
    assert first_mismatch([ref, _Rec([((2,),), ((5,),), ((4,),)], sized={1})], [1, 2]) is None
    m = first_mismatch([ref, _Rec([((2,),), ((5,),), ((6,),)], sized={1})], [1, 2])
    assert m["step"] == 2 and m["op_index"] == 2


def test_a_step_that_routes_no_token_to_an_expert_skips_its_recorded_iteration():
    """transformers' eager experts loop over the experts that got tokens: a step that routes
    none to an expert runs one iteration less. The recorded iterations left, every op of them
    sized by values, are skipped (``PlanRuntime._past_sized``), as a skipped module call is.
    Before, that step stopped the plan ("the live op sequence differs")."""
    torch.manual_seed(0)
    model, x, loss_fn, opt = get_workload(entry="tiny_models:hit_moe", batch=512).build(False)
    trace = record(model, x, loss_fn, opt)  # at batch 512 every expert of both layers gets tokens
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.7), "heuristic", problem=problem, optimizer="as-recorded")
    sized = set(trace.meta["data_sized"]["tensors"])
    assert sum(r.tensor in sized for r in plan.recompute) >= 5

    def run(planned: bool):
        torch.manual_seed(7)
        model, x, loss_fn, opt = get_workload(entry="tiny_models:hit_moe", batch=512).build(False)
        if planned:
            model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
        g = torch.Generator().manual_seed(1)
        idle = []
        for step in range(4):
            xb = torch.randn(x.shape, generator=g)
            with torch.no_grad():  # odd steps: the first layer's router picks expert `step` for no token
                model.blocks[0].router.bias[step % 4] = -1e4 if step % 2 else 0.0
                if step % 2:
                    idle.append(int((model.blocks[0].router(model.inp(xb)).topk(2, -1).indices == step % 4).sum()))
            opt.zero_grad()
            loss_fn(model(xb), xb).backward()
            opt.step()
        rt = model._taichi_plan["runtime"] if planned else None
        skipped = rt.skipped_sized_ops if planned else 0  # (counted over the last step)
        params = [p.detach().clone() for p in model.parameters()]
        if planned:
            assert rt.mismatches == 0
            taichi_plan.finish(model)
        return params, idle, skipped

    base, idle, _ = run(False)
    got, idle_planned, skipped = run(True)
    assert idle == idle_planned == [0, 0]  # the steps that left an expert without tokens
    assert skipped > 0
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))


def test_a_step_that_routes_tokens_to_an_expert_the_recording_did_not_says_so():
    """The other way round: the recorded step left an expert without tokens, a live one does
    not. That iteration's ops are not in the trace: the plan stops for the call, and says why."""
    from taichi_plan.base.errors import MismatchError

    torch.manual_seed(0)
    model, x, loss_fn, opt = get_workload(entry="tiny_models:hit_moe", batch=512).build(False)
    with torch.no_grad():
        model.blocks[0].router.bias[2] = -1e4  # recorded: the first layer routes nothing to expert 2
    trace = record(model, x, loss_fn, opt, steps=1)
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.7), "heuristic", problem=problem, optimizer="as-recorded")
    with torch.no_grad():
        model.blocks[0].router.bias[2] = 0.0
    model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    opt.zero_grad(set_to_none=True)
    with pytest.raises(MismatchError, match="routed no token to"):
        loss_fn(model(x), x).backward()
    taichi_plan.finish(model)
