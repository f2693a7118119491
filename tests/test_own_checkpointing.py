"""A model that checkpoints itself (trace v8 ``meta.forward_in_backward``).

Many users arrive with a transformers model's ``gradient_checkpointing_enable()`` already on.
Recorded so, the backward re-runs each block's forward, the plan cannot change those re-runs,
and the floor sits in them. The recorder counts the forward code that
``torch.utils.checkpoint`` re-runs inside backward (both variants recompute under
``enable_grad``; a backward with ``create_graph=True`` also runs with grad and is told apart by
the Python stack), ``inspect`` shows it, and an infeasible budget's message says to turn the
model's own checkpointing off, which the last test shows reaches that budget.
"""

from __future__ import annotations

import pytest
import torch

from taichi_plan.base.errors import InfeasibleBudgetError
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.record.api import forward_in_backward
from taichi_plan.record.recorder import Recorder
from taichi_plan.report.trace_text import render_trace_summary, trace_summary
from taichi_plan.solve import solve

GPT2 = dict(model="gpt2", layers=2, hidden=64, heads=4, vocab=512, seq=64, batch=4)


def _gpt2_trace(own_checkpointing: bool):
    torch.manual_seed(0)
    model, batch, loss_fn, opt = get_workload(**GPT2).build(False)
    if own_checkpointing:
        model.gradient_checkpointing_enable()
    return record(model, batch, loss_fn, opt, steps=1, warmup=0)


@pytest.fixture(scope="module")
def traces():
    return {k: _gpt2_trace(k) for k in (False, True)}


def test_the_models_own_checkpointing_is_recorded(traces):
    fib = traces[True].meta["forward_in_backward"]
    assert fib["ops"] > 20 and fib["modules"] == ["transformer.h.1", "transformer.h.0"], fib
    assert traces[False].meta["forward_in_backward"] == {"ops": 0, "modules": []}
    text = render_trace_summary(trace_summary(traces[True]), width=200)
    assert f"own ckpt   {fib['ops']} backward ops re-run the forward of 2 module(s)" in text
    assert "own ckpt" not in render_trace_summary(trace_summary(traces[False]), width=200)


def _record_plain(fn):
    lin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    rec = Recorder(None, lin)
    rec.begin_step([])
    with rec:
        fn(lin)
    return forward_in_backward(rec.end_step([]))


def test_reentrant_checkpoint_counts_and_a_double_backward_does_not():
    def reentrant(lin):
        x = torch.randn(4, 8, requires_grad=True)
        torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True).sum().backward()

    def double_backward(lin):  # a gradient penalty: its backward runs with grad, re-runs no forward
        x = torch.randn(4, 8, requires_grad=True)
        h = x * 2  # (ModTracker cannot hook a leaf passed to a module under autograd.grad)
        (g,) = torch.autograd.grad(lin(h).sin().sum(), h, create_graph=True)
        g.pow(2).sum().backward()

    assert _record_plain(reentrant)["ops"] >= 3  # addmm, relu, addmm re-run
    assert _record_plain(double_backward) == {"ops": 0, "modules": []}


def test_an_infeasible_budget_says_to_turn_it_off_and_that_reaches_it(traces):
    own = traces[True]
    budget = int(build_problem(own).baseline_peak[0] * 0.95)  # its least reachable: 0.986
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(own, budget, "heuristic")
    msg = str(e.value)
    assert "The model checkpoints itself" in msg and "gradient_checkpointing_disable()" in msg, msg
    assert "reduce the batch size" not in msg
    # The same model with its checkpointing off: the plan reaches that budget.
    plan = solve(traces[False], budget, "heuristic")
    assert plan.predicted["planned_peak_bytes"] <= budget


def test_modules_kept_out_by_the_kv_cache_are_named_with_the_way_out(traces):
    """transformers' decoders keep a KV cache unless told otherwise: each attention appends
    its keys and values to it, so no attention or block is partitioned (partition.leaves_state).
    The plan's notes and an out-of-reach budget's message name those modules and the setting
    that frees them; recorded with ``use_cache = False`` there are none."""
    from taichi_plan.problem.partition.find import state_keepers

    p = build_problem(traces[False])
    keeps = state_keepers(p)
    assert keeps == ["transformer.h.0.attn", "transformer.h.1.attn"], keeps
    plan = solve(traces[False], int(p.baseline_peak[0] * 0.8), "heuristic")
    assert any("model.config.use_cache = False" in n and "transformer.h.0.attn" in n for n in plan.solver["notes"])
    from taichi_plan.commands.solve import render_solve_summary

    text = render_solve_summary(plan)  # what `taichi-plan solve` prints
    assert any(line.startswith("Note ") and "model.config.use_cache = False" in line for line in text.splitlines()), text
    with pytest.raises(InfeasibleBudgetError, match="holds after their forward although no later forward op reads them"):
        solve(traces[False], int(p.baseline_peak[0] * 0.1), "heuristic")
    torch.manual_seed(0)
    model, batch, loss_fn, opt = get_workload(**GPT2).build(False)
    model.config.use_cache = False
    off = record(model, batch, loss_fn, opt, steps=1, warmup=0)
    assert state_keepers(build_problem(off)) == []


def test_a_plan_of_a_step_with_its_own_checkpointing_runs_over_the_whole_call(traces):
    """Planned regions are module calls; entered inside a checkpoint the model runs itself, the
    runtime's saved-tensor hooks would be innermost there and keep what it discards. A step
    recorded with the model's own checkpointing keeps the runtime over the whole call, its hooks
    outside every checkpoint (without it, the same plan runs in regions)."""
    from taichi_plan.problem.partition.regions import planned_regions

    for own, trace in traces.items():
        p = build_problem(trace)
        needed = {int(p.producer[t]) for t in p.candidates[:4]}
        assert needed
        regions = planned_regions(trace, needed)
        assert regions and all((r is None) == own for r in regions.values()), (own, regions)
