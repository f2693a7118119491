"""The replay runtime's own cost in a plan's predicted extra time: counted, not timed."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from taichi_plan.overhead import runtime_overhead_s
from taichi_plan.problem import build_problem
from taichi_plan.record import get_workload, record_workload
from taichi_plan.record.recorder import op_clock
from taichi_plan.replay import call_ops, call_plans
from taichi_plan.replay.runtime import CallPlan, PlanRuntime
from taichi_plan.simulate import rerun_ops, simulate_plan
from taichi_plan.solve import solve
from taichi_plan.solve.result import drops_from_plan

GPT2 = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=256, seq=64, batch=4)


@pytest.fixture(scope="module")
def gpt2():
    return record_workload(get_workload(**GPT2), fake=False)


def test_real_recording_measures_the_runtime_on_its_model(gpt2):
    cal = gpt2.meta["runtime_overhead"]
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    # Per op of the model's call (every op of it, as overhead.py charges), not per one-element add.
    assert cal["ops"] == call["end"] - call["start"] + 1
    assert cal["repeats"] >= 1
    assert cal["check_op_s"] >= 0 and cal["recipe_op_s"] >= 0 and cal["rebuild_op_s"] >= 0


def test_fake_recording_keeps_the_microbenchmark():
    trace = record_workload(get_workload(**GPT2), fake=True)
    assert trace.meta["runtime_overhead"]["ops"] == 200  # calibrate_overhead's one-element additions


@pytest.mark.parametrize("recipes", [set(), None])
def test_probe_runs_every_op_of_the_call_under_the_runtime(gpt2, recipes):
    """What calibration times: the recorded call, every op checked (and with ``None``, every
    op's recipe kept), nothing dropped, no mismatch."""
    model, batch, _loss_fn, _opt = get_workload(**GPT2).build(False)
    ops = call_ops(gpt2)[0]
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    rt = PlanRuntime([CallPlan(0, ops, {}, recipes, {}, call["inputs"], None, True, probe=True)])
    assert rt.begin_call(model, (), batch)
    frame = rt._frame
    try:
        model(**batch)
    finally:
        rt.end_call(failed=False)
    assert rt.mismatches == 0 and frame.enabled
    assert frame.n == len(ops) > 0
    assert (len(frame.recipes) > 0) == (recipes is None)
    assert not frame.dropped


def test_overhead_is_the_calibrated_rates_times_the_ops_they_apply_to(gpt2):
    """Each calibrated term moves the prediction by exactly its rate times the ops it applies
    to, counted here independently: every op of the model calls the plan changes, the re-run
    ops among them, and the simulator's recompute ops."""
    plan = solve(gpt2, int(0.9 * build_problem(gpt2).baseline_peak[0]), "heuristic", seed=0)
    problem = build_problem(gpt2)
    drops = drops_from_plan(problem, plan)
    assert drops
    sim, parted = simulate_plan(problem, drops, plan.partitions)
    rerun = rerun_ops(parted, drops)
    calls = [c for c in gpt2.meta["model_calls"] if c["grad"]]
    planned = [k for k, cp in enumerate(call_plans(plan, gpt2)) if cp.active]
    in_calls = [o for k in planned for o in range(calls[k]["start"], calls[k]["end"] + 1)]
    n_checked, n_recipes = len(in_calls), len(set(in_calls) & rerun)

    def predicted(check, recipe, rebuild) -> float:
        gpt2.meta["runtime_overhead"] = {"check_op_s": check, "recipe_op_s": recipe, "rebuild_op_s": rebuild}
        return runtime_overhead_s(problem, drops, plan.partitions, rerun, sim.recompute_ops)

    saved = dict(gpt2.meta["runtime_overhead"])
    try:
        base = predicted(1e-6, 3e-6, 2e-6)
        assert base == pytest.approx(n_checked * 1e-6 + n_recipes * 2e-6 + sim.recompute_ops * 2e-6)
        assert predicted(2e-6, 4e-6, 2e-6) - base == pytest.approx(n_checked * 1e-6)  # recipe - check unchanged
        assert predicted(1e-6, 5e-6, 2e-6) - base == pytest.approx(n_recipes * 2e-6)
        assert predicted(1e-6, 3e-6, 7e-6) - base == pytest.approx(sim.recompute_ops * 5e-6)
    finally:
        gpt2.meta["runtime_overhead"] = saved


def test_recorded_op_time_is_the_threads_cpu_time():
    """With one torch thread an op's recorded duration is CPU time: an op that waits 50 ms
    (as a thread waits for a core on a loaded machine) records its work, not the wait."""
    @torch.library.custom_op("taichi_test::waits", mutates_args=())
    def waits(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return x * 2

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) + waits(x)  # (the input needs no gradient: no backward to register)

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert op_clock() is time.thread_time
        from taichi_plan.record import record

        model = Model()
        trace = record(model, torch.randn(2, 4), lambda out, _b: out.sum(),
                       torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
    finally:
        torch.set_num_threads(old)
    ops = trace.ops
    durations = ops.loc[ops["op"] == "taichi_test.waits.default", "duration_s"].to_numpy()
    assert len(durations) == 1 and durations[0] < 0.025
    if old > 1:
        assert op_clock() is time.perf_counter
    assert np.all(ops["duration_s"].to_numpy() >= 0)


def test_rebuild_calibration_reruns_every_recipe_once_through_the_rebuild_path(gpt2):
    """What ``rebuild_op_s`` is measured on: every storage of the call rebuilt from its recipe
    after the backward (its inputs gone), each op re-run exactly once (inputs held until their
    last reader), values as the forward's."""
    from taichi_plan.replay.calibrate import _rebuild_all

    model, batch, _loss_fn, _opt = get_workload(**GPT2).build(False)
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    ops = call_ops(gpt2)[0]
    rt = PlanRuntime([CallPlan(0, ops, {}, None, {}, call["inputs"], None, True, probe=True)])
    assert rt.begin_call(model, (), batch)
    frame = rt._frame
    try:
        out = model(**batch)
    finally:
        rt.end_call(failed=False)
    logits = out.logits.detach().clone()
    out.loss.backward()
    sid = frame.sid_of[out.logits.untyped_storage()._cdata]
    del out
    steps = sum(len(s) for s in frame.recipes.values())
    rebuilt, run_recipe = {}, rt._run_recipe

    def keep_logits(frame_, s):  # the logits as the rebuild path itself made them
        st = run_recipe(frame_, s)
        if s == sid:
            rebuilt["logits"] = st
        return st

    rt._run_recipe = keep_logits
    got = _rebuild_all(rt, frame, time.thread_time)
    assert rt.recompute_ops == steps > 0
    assert len(got) == 1
    assert not frame.cache
    # (Not re-run from nothing here: with every storage gone a lone recipe rebuilds each shared
    # input once per reader, which is what _rebuild_all's op order avoids.)
    assert torch.equal(torch.empty(0).set_(rebuilt["logits"], 0, logits.shape, logits.stride()), logits)
