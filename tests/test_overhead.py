"""The replay runtime's own cost in a plan's predicted extra time: counted, not timed."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from dispatch_count import count_dispatches

from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.overhead import runtime_overhead_s
from taichi_plan.problem.partition.regions import (
    early_triggers,
    needed_ops,
    planned_regions,
    region_ops,
)
from taichi_plan.record import get_workload, record_workload
from taichi_plan.runtime.calls import call_ops
from taichi_plan.runtime.mode import PlanRuntime
from taichi_plan.runtime.mode.call_plan import CallPlan
from taichi_plan.simulate.core import rerun_ops, simulate_plan
from taichi_plan.solve import solve
from taichi_plan.solve.result import drops_from_plan
from taichi_plan.torch_common.ops import IGNORED_OPS, op_clock

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
    # Re-timed per op name, among the names of the call's ops (a GPT-2 re-runs its matmuls).
    ops = call_ops(gpt2)[0]
    assert cal["rebuild_time_ratio"] and set(cal["rebuild_time_ratio"]) <= {o[0] for o in ops}
    assert "aten.mm.default" in cal["rebuild_time_ratio"] and all(r > 0 for r in cal["rebuild_time_ratio"].values())


def test_fake_recording_keeps_the_microbenchmark():
    trace = record_workload(get_workload(**GPT2), fake=True)
    assert trace.meta["runtime_overhead"]["ops"] == 200  # calibrate_overhead's one-element additions
    assert trace.meta["runtime_overhead"]["module_call_s"] >= 0  # v15: a planned call's module hooks


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


def _ops_the_runtime_sees(plan, trace, monkeypatch) -> int:
    """How many of the model's ops reach the runtime's dispatch mode in one planned training
    step (every op there pays the checking rate; the ``detach`` of each tensor its pack hook
    keeps is the runtime's own, in that rate)."""
    import taichi_plan

    seen = count_dispatches(monkeypatch)
    model, batch, loss_fn, opt = get_workload(**GPT2).build(False)
    model = taichi_plan.apply(model, plan, trace=trace, optimizer=opt)
    try:
        loss_fn(model(**batch), batch).backward()
        assert model._taichi_plan["runtime"].mismatches == 0
    finally:
        taichi_plan.finish(model)
    monkeypatch.undo()
    return len(seen)


def test_overhead_is_the_calibrated_rates_times_the_ops_they_apply_to(gpt2, monkeypatch):
    """Each calibrated term moves the prediction by exactly its rate times the ops it applies
    to, counted here independently: the ops that reach the runtime's dispatch mode in a planned
    step of the model (those of its planned regions, taichi_plan.problem.partition.regions), and the re-run ops
    among them (the runtime's overhead, added after the solve), and the simulator's recompute
    ops and the drops (in the simulator's extra compute, which the planners weigh)."""
    plan = solve(gpt2, int(0.9 * build_problem(gpt2).baseline_peak[0]), "heuristic", seed=0)
    problem = build_problem(gpt2)
    drops = drops_from_plan(problem, plan)
    assert drops
    sim, parted = simulate_plan(problem, drops, plan.partitions)
    rerun = rerun_ops(parted, drops)
    calls = [c for c in gpt2.meta["model_calls"] if c["grad"]]
    regions = planned_regions(gpt2, needed_ops(parted, drops, rerun, early_triggers(parted, sim)))[0]
    in_regions = [o for r in regions for o in range(r.first, r.last + 1)]
    # The runtime sees exactly the regions' ops (those it counts: not the detaches that
    # autograd's saving makes, which its pack hook replaces by its own), a part of the call.
    names = gpt2.ops["op"].tolist()
    assert _ops_the_runtime_sees(plan, gpt2, monkeypatch) == sum(names[o] not in IGNORED_OPS for o in in_regions)
    n_checked, n_recipes = len(in_regions), len(rerun)
    assert 0 < n_checked < calls[0]["end"] - calls[0]["start"] + 1
    assert set(rerun) <= set(in_regions)

    reruns = [op for g in sim.groups.values() for op in g.ops]
    assert len(reruns) == sim.recompute_ops

    def predicted(check, recipe, rebuild=0.0, ratio=None, drop=0.0, module=0.0, region=0.0) -> tuple[float, float]:
        """(runtime overhead, simulated extra compute) of the plan's drops under these rates."""
        gpt2.meta["runtime_overhead"] = {"check_op_s": check, "recipe_op_s": recipe, "rebuild_op_s": rebuild,
                                         "rebuild_time_ratio": ratio or {}, "drop_s": drop, "module_call_s": module,
                                         "region_s": region}
        fresh = build_problem(gpt2)  # Problem.rerun_cost is computed once per problem
        seen = region_ops(gpt2, needed_ops(parted, drops, rerun, early_triggers(parted, sim)))
        return (runtime_overhead_s(fresh, drops, plan.partitions, rerun, seen=seen),
                simulate_plan(fresh, drops, plan.partitions)[0].extra_cost)

    saved = dict(gpt2.meta["runtime_overhead"])
    try:
        base, extra = predicted(1e-6, 3e-6)
        assert base == pytest.approx(n_checked * 1e-6 + n_recipes * 2e-6)
        # Trace v15: the module hooks, once per module call of the planned call (its own call not one).
        module_calls = sum(1 for name, entries in gpt2.meta["module_args"].items() if name
                           for e in entries if calls[0]["start"] <= e[0] <= calls[0]["end"])
        assert module_calls > 0
        assert predicted(1e-6, 3e-6, module=5e-6)[0] - base == pytest.approx(module_calls * 5e-6)
        # Trace v18: each planned region entered, once per region.
        assert len(regions) > 0
        assert predicted(1e-6, 3e-6, region=9e-6)[0] - base == pytest.approx(len(regions) * 9e-6)
        assert predicted(2e-6, 4e-6)[0] - base == pytest.approx(n_checked * 1e-6)  # recipe - check unchanged
        assert predicted(1e-6, 5e-6)[0] - base == pytest.approx(n_recipes * 2e-6)
        # Each re-run op's bookkeeping, once per re-run, in the simulator's cost (not the overhead).
        over, cost = predicted(1e-6, 3e-6, 7e-6)
        assert over == pytest.approx(base) and cost - extra == pytest.approx(sim.recompute_ops * 7e-6)
        # A measured time ratio re-times each re-run of an op of that name (the recorded time
        # is charged without one).
        ops = gpt2.ops
        name = ops["op"][reruns[0]]
        recorded = sum(float(ops["duration_s"][i]) for i in reruns if ops["op"][i] == name)
        assert recorded > 0
        assert predicted(1e-6, 3e-6, 0.0, {name: 2.5, "aten.not_rerun.default": 9.0})[1] - extra == \
            pytest.approx(1.5 * recorded)
        # Trace v6: each dropped tensor's own cost, once per drop.
        assert predicted(1e-6, 3e-6, drop=40e-6)[1] - extra == pytest.approx(len(drops) * 40e-6)
    finally:
        gpt2.meta["runtime_overhead"] = saved


def test_the_planners_weigh_what_each_drop_costs(gpt2):
    """With a measured drop cost, a plan of many cheap drops costs what the runtime makes it
    cost: the heuristic's plan at the same budget has no more drops than without, and the ILP's
    objective and bound include the drops (bound <= the simulator's cost, which counts them;
    here the optimum trades the drops for the head's token partition)."""
    saved = dict(gpt2.meta["runtime_overhead"])
    budget = int(0.8 * build_problem(gpt2).baseline_peak[0])
    try:
        gpt2.meta["runtime_overhead"] = {**saved, "drop_s": 0.0}
        free = solve(gpt2, budget, "heuristic", seed=0)
        gpt2.meta["runtime_overhead"] = {**saved, "drop_s": 1.0}  # a second per drop
        dear = solve(gpt2, budget, "heuristic", seed=0)
        exact = solve(gpt2, budget, "ilp", seed=0, work_limit=5)
    finally:
        gpt2.meta["runtime_overhead"] = saved
    assert 0 < len(dear.recompute) <= len(free.recompute)
    assert dear.solver["extra_compute"] >= len(dear.recompute) * 1.0
    assert len(exact.recompute) <= len(dear.recompute)
    lb = exact.solver["lower_bound"]
    assert lb is not None and lb <= exact.solver["extra_compute"] + 1e-9
    # Priced at a second each, drops are the plan's cost (its re-runs and partitions take
    # milliseconds): the proven-optimal plan has the fewest drops a plan at this budget needs.
    assert exact.solver["status"] == "optimal"
    assert int(exact.solver["extra_compute"]) == len(exact.recompute)


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
    from taichi_plan.runtime.calibrate.rebuilds import rebuild_all

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
    op_seconds: dict[int, list] = {}
    got = rebuild_all(rt, frame, time.thread_time, op_seconds)
    assert rt.recompute_ops == steps > 0
    assert len(got) == 1
    # Each re-run op's seconds and runs, by its counted index in the call: every recipe's ops,
    # once per recipe step (an op of several outputs, such as native_layer_norm's output, mean
    # and rstd, once per output: rebuild_time_ratio is per run, not per op).
    runs: dict[int, int] = {}
    for s in frame.recipes.values():
        for step in s:
            runs[step.op] = runs.get(step.op, 0) + 1
    assert {i: n for i, (_sec, n) in op_seconds.items()} == runs
    assert max(runs[i] for i in runs if ops[i][0] == "aten.native_layer_norm.default") == 3
    assert all(sec >= 0 for sec, _n in op_seconds.values())
    assert not frame.cache
    # (Not re-run from nothing here: with every storage gone a lone recipe rebuilds each shared
    # input once per reader, which is what rebuild_all's op order avoids.)
    assert torch.equal(torch.empty(0).set_(rebuilt["logits"], 0, logits.shape, logits.stride()), logits)


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def test_partition_cost_is_the_calibrated_rates_times_the_ops_each_chunk_runs(gpt2):
    """A partitioned module's cost: its recorded forward once more, ``checkpoint_op_s`` per
    forward op, and ``chunk_op_s`` per op each further chunk runs again (its forward, that
    forward's re-run in backward, its backward), the ops counted here from the trace."""
    from taichi_plan.plan.format import Partition
    from taichi_plan.problem.partition.cost import launch_overhead_s, partition_cost
    from taichi_plan.problem.partition.find import find_span

    problem = build_problem(gpt2)
    module = "transformer.h.0.mlp"  # (a block appends to the KV cache: never partitioned)
    span = find_span(problem, Partition(module, 0, 2))
    ops = gpt2.ops
    mine = ops["module"].map(lambda m: _under(m, module))
    n_fwd = int((mine & (ops["phase"] == "forward")).sum())
    n_bwd = int((mine & (ops["phase"] == "backward")).sum())
    redo = float(ops.loc[mine & (ops["phase"] == "forward"), "duration_s"].sum())
    assert n_fwd > 10 and n_bwd > 10
    saved = dict(gpt2.meta["runtime_overhead"])
    try:
        gpt2.meta["runtime_overhead"].update(checkpoint_op_s=3e-6, chunk_op_s=7e-6, checkpoint_call_s=50e-6)
        for k in (1, 2, 4):  # and each chunk one checkpoint call (trace v7)
            want = redo + n_fwd * 3e-6 + (k - 1) * (2 * n_fwd + n_bwd) * 7e-6 + k * 50e-6
            assert partition_cost(problem, span, k) == pytest.approx(want)
        del gpt2.meta["runtime_overhead"]["checkpoint_call_s"]  # a v6 trace: no per-call cost
        assert partition_cost(problem, span, 2) == pytest.approx(redo + n_fwd * 3e-6 + (2 * n_fwd + n_bwd) * 7e-6)
        for key in ("checkpoint_op_s", "chunk_op_s"):  # an older trace: the launch overhead per op per chunk
            del gpt2.meta["runtime_overhead"][key]
            assert partition_cost(problem, span, 2) == pytest.approx(
                redo + 2 * (n_fwd + n_bwd) * launch_overhead_s(problem))
    finally:
        gpt2.meta["runtime_overhead"] = saved


def test_partitions_are_calibrated_on_modules_that_run_in_chunks(gpt2):
    """What the partition terms are measured on: modules of the call the planner may split
    (never a container such as a ModuleList, which is never called), disjoint; checkpointed
    whole, each runs its forward once in the forward and once more in backward; split into K,
    K times each; the call's ops still match the trace."""
    from taichi_plan.problem.partition.find import partitionable_spans
    from taichi_plan.runtime.calibrate.probes import build_partition_probes
    from taichi_plan.runtime.install import install
    from taichi_plan.runtime.partition import install_partitions

    cal = gpt2.meta["runtime_overhead"]
    assert cal["checkpoint_op_s"] >= 0 and cal["chunk_op_s"] >= 0
    model, batch, loss_fn, _opt = get_workload(**GPT2).build(False)
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    problem, spans, k_most, probes = build_partition_probes(gpt2, call, model)
    names = [s.module for s in spans]
    assert names == cal["partition_probe"]["modules"] and k_most == cal["partition_probe"]["chunks"] == 4
    assert all(type(model.get_submodule(n)).forward is not torch.nn.Module.forward for n in names)
    # the blocks append to the KV cache (partition.leaves_state): their MLPs are measured
    assert "transformer.h.0.mlp" in names and "transformer.h.0" not in names
    assert "transformer.h.0" not in {s.module for s in partitionable_spans(problem)}
    for a in spans:
        for b in spans:
            assert a is b or a.fwd[1] < b.fwd[0] or b.fwd[1] < a.fwd[0]
    for k, (cp, parts) in probes.items():
        runs = dict.fromkeys(names, 0)
        for name in names:
            sub = model.get_submodule(name)
            original = sub.forward

            def counted(*a, _name=name, _f=original, _runs=runs, **kw):
                _runs[_name] += 1
                return _f(*a, **kw)

            sub.forward = counted
        rt = PlanRuntime([cp])
        handles = install(model, rt)
        undo = install_partitions(model, parts, rt)
        try:
            out = model(**batch)
            assert runs == dict.fromkeys(names, k)
            loss_fn(out, batch).backward()
            assert runs == dict.fromkeys(names, 2 * k)
        finally:
            undo()
            for h in handles:
                h.remove()
            for name in names:
                del model.get_submodule(name).forward
        assert rt.mismatches == 0 and rt.planned_calls == 1  # (a call with other ops than the trace's raises)


def _token_span(problem):
    from taichi_plan.problem.partition.token_span import token_spans

    spans = [s for s in token_spans(problem) if s.module == "lm_head"]
    assert len(spans) == 1
    return spans[0]


def test_token_partition_cost_is_the_calibrated_rates_times_the_counted_terms(gpt2):
    """A head + loss partitioned over tokens costs ``redo_ratio`` times the recorded seconds
    of the ops whose time the split changes (the head's matmul and the log-softmax, counted
    here from the trace's own rows) plus ``chunk_op_s`` per op of the span per chunk. A trace
    that measured no such span, or measured it before the fused pass (no ``fused`` flag: its
    backward then made the logits again), costs the launch overhead per op per chunk (the
    fused pass runs the head once)."""
    from taichi_plan.problem.partition.cost import launch_overhead_s, partition_cost

    problem = build_problem(gpt2)
    span = _token_span(problem)
    ops = gpt2.ops
    fwd = ops["phase"] == "forward"
    head_mm = fwd & (ops["module"] == "lm_head") & ops["op"].isin(["aten.mm.default", "aten.addmm.default"])
    log_softmax = fwd & (ops["op"] == "aten._log_softmax.default")
    assert int(head_mm.sum()) == 1 and int(log_softmax.sum()) == 1
    redo = float(ops.loc[head_mm | log_softmax, "duration_s"].sum())
    n_ops = len(span.fwd_ops) + len(span.bwd_ops)
    assert n_ops > 5
    saved = dict(gpt2.meta["runtime_overhead"])
    try:
        assert span.fused
        fallback = 4 * n_ops * launch_overhead_s(problem)
        gpt2.meta["runtime_overhead"]["span_costs"] = {"tokens": {"redo_ratio": -0.5, "chunk_op_s": 4e-6,
                                                                  "fused": True}}
        for k in span.chunk_choices:
            assert partition_cost(problem, span, k) == pytest.approx(-0.5 * redo + k * n_ops * 4e-6)
        del gpt2.meta["runtime_overhead"]["span_costs"]["tokens"]["fused"]  # measured before v14
        assert partition_cost(problem, span, 4) == pytest.approx(fallback)
        del gpt2.meta["runtime_overhead"]["span_costs"]  # an older trace
        assert partition_cost(problem, span, 4) == pytest.approx(fallback)
    finally:
        gpt2.meta["runtime_overhead"] = saved


def test_the_probed_span_costs_what_was_measured_and_others_follow_the_fit(gpt2):
    """The probed span split into a count it was measured at costs what was measured there,
    below 0 too (the fused pass can run faster than the span unsplit): the cost is not linear
    in the chunks (smaller chunks run from the caches). Another span of the kind, or a count
    not measured, takes the least-squares line through the measured points, whose slope is
    never negative and whose intercept saves at most the ops it changes."""
    import dataclasses

    from taichi_plan.problem.partition.cost import partition_cost
    from taichi_plan.problem.partition.token_span import cost_terms
    from taichi_plan.runtime.calibrate.rates import span_rates

    problem = build_problem(gpt2)
    span = _token_span(problem)
    n_ops = len(span.fwd_ops) + len(span.bwd_ops)
    saved = dict(gpt2.meta["runtime_overhead"])
    try:
        for extras in ((0.004, 0.003, 0.007), (0.004, 0.003, 0.002), (-0.002, 0.001, 0.003)):
            rates = span_rates("tokens", (problem, span), (2, 4, 8), list(extras))
            gpt2.meta["runtime_overhead"]["span_costs"] = {"tokens": rates}
            assert rates["chunk_op_s"] >= 0 and rates["redo_ratio"] >= -1 and rates["chunks"] == [2, 4, 8]
            assert rates["fused"]
            for k, e in zip((2, 4, 8), extras, strict=True):
                assert partition_cost(problem, span, k) == pytest.approx(e)
            if extras[2] <= extras[0]:  # falling with the chunks: no negative slope
                assert rates["chunk_op_s"] == 0
            other = dataclasses.replace(span, module="another_head")
            line = [partition_cost(problem, other, k) for k in (2, 4, 8, 16)]
            assert line == sorted(line)
            assert line[0] >= -cost_terms(problem, span)[0] - 1e-12
            assert line[1] - line[0] == pytest.approx(2 * n_ops * rates["chunk_op_s"])
    finally:
        gpt2.meta["runtime_overhead"] = saved


def test_the_span_clock_times_the_head_and_loss_stretches_only():
    """A span probe's extra is the difference of the span's own seconds: from the head's call
    to the end of the loss, and from the start of the backward to the head input's gradient."""
    import torch

    from taichi_plan.runtime.calibrate.clocks import SpanClock

    ticks = iter(range(1, 100))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    sc = SpanClock(model, "1", lambda: next(ticks))
    out = model(torch.ones(3, 4))  # the head's call: tick 1
    loss = out.square().sum()
    sc.forward_done()  # tick 2
    loss.backward()  # the head input's gradient: tick 3
    sc.remove()
    assert sc.seconds() == (2 - 1) + (3 - 2)
    model(torch.ones(3, 4)).sum().backward()  # removed: no more ticks
    assert next(ticks) == 4
    absent = SpanClock(model, "no.such.head", lambda: next(ticks))
    absent.forward_done()
    assert absent.seconds() == 0.0


def test_token_span_is_calibrated_chunked_on_the_models_own_head(gpt2, monkeypatch):
    """A real recording times the model's own head + loss split into each of its chunk choices
    up to 32 over tokens: each probe runs the head's logits chunk by chunk (k chunks in forward,
    with the gradients; none again in backward), with the call's ops still matching the trace."""
    from taichi_plan.runtime import chunked_loss
    from taichi_plan.runtime.calibrate.probes import build_span_probes
    from taichi_plan.runtime.install import install
    from taichi_plan.runtime.partition import install_partitions

    cal = gpt2.meta["runtime_overhead"]["span_costs"]["tokens"]
    assert cal["module"] == "lm_head" and cal["chunks"] == [2, 4, 8, 16, 32] and len(cal["extra_s"]) == 5
    assert cal["redo_ratio"] >= -1 and cal["chunk_op_s"] >= 0 and cal["fused"]
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    probes = build_span_probes(gpt2, call)
    (_problem, span), ks, by_k = probes["tokens"]
    assert span.module == "lm_head" and ks == (2, 4, 8, 16, 32)
    model, batch, loss_fn, _opt = get_workload(**GPT2).build(False)
    logits_runs = [0]
    original = chunked_loss._logits

    def counted(*a, **kw):
        logits_runs[0] += 1
        return original(*a, **kw)

    monkeypatch.setattr(chunked_loss, "_logits", counted)
    for k, (cp, parts) in by_k.items():
        assert cp.tokens == {"lm_head": k} and cp.probe
        logits_runs[0] = 0
        rt = PlanRuntime([cp])
        handles = install(model, rt)
        undo = install_partitions(model, parts, rt)
        try:
            out = model(**batch)
            assert logits_runs[0] == k
            loss_fn(out, batch).backward()
            assert logits_runs[0] == k
        finally:
            undo()
            for h in handles:
                h.remove()
        assert rt.mismatches == 0
        model.zero_grad(set_to_none=True)


def test_per_op_terms_are_never_below_the_bookkeeping_alone():
    """Noise in a model's forward (a loaded machine, a model of large ops) may make a
    measured per-op term fall below what one-element additions time: the term is raised to
    it, and keeping a recipe never costs less than checking; the measured values are kept."""
    from taichi_plan.runtime.calibrate.rates import floored

    micro = {"check_op_s": 5e-6, "recipe_op_s": 8e-6, "rebuild_op_s": 3e-6}
    low = floored({"check_op_s": 1e-6, "recipe_op_s": -2e-6, "rebuild_op_s": -1e-6, "ops": 10}, micro)
    assert (low["check_op_s"], low["recipe_op_s"], low["rebuild_op_s"]) == (5e-6, 8e-6, 3e-6)
    assert low["unfloored"] == {"check_op_s": 1e-6, "recipe_op_s": -2e-6, "rebuild_op_s": -1e-6} and low["ops"] == 10
    high = floored({"check_op_s": 30e-6, "recipe_op_s": 20e-6, "rebuild_op_s": 9e-6}, micro)
    assert (high["check_op_s"], high["recipe_op_s"], high["rebuild_op_s"]) == (30e-6, 30e-6, 9e-6)
    same = floored({"check_op_s": 30e-6, "recipe_op_s": 40e-6, "rebuild_op_s": 9e-6}, micro)
    assert "unfloored" not in same and same["recipe_op_s"] == 40e-6


def test_every_variant_is_warmed_up_once_before_the_timed_rounds():
    """Calibration's rounds: one untimed run of every variant not already run once (a trial
    run of a probe counts: its one-time costs are paid), then ``repeats`` timed runs of each,
    each round starting one variant later; without the warm-up (the test suite), the rounds
    only; the rounds stop before one that would pass the budget."""
    from taichi_plan.runtime.calibrate.config import CalibrationConfig
    from taichi_plan.runtime.calibrate.timing import interleaved

    def rounds(repeats=3, budget=1e9, ran=None, warm_up=True):
        runs, now = [], [0.0]

        def forward(v):  # each run takes one second of this clock
            runs.append(v)
            now[0] += 1.0
            return 0.0, 0.0

        times = interleaved(forward, {"a": "A", "b": "B", "c": "C"}, repeats, budget, lambda: now[0], ran,
                            CalibrationConfig(warm_up=warm_up))
        return runs, {n: len(v) for n, v in times.items()}

    timed = ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert rounds() == (["A", "B", "C"] + timed, {"a": 3, "b": 3, "c": 3})
    assert rounds(ran={"b"}) == (["A", "C"] + timed, {"a": 3, "b": 3, "c": 3})
    assert rounds(warm_up=False) == (timed, {"a": 3, "b": 3, "c": 3})
    # a round takes 3 s: a budget of 5 s allows one, of 6 s two (the untimed runs before the
    # rounds are not counted against it)
    assert rounds(budget=5, warm_up=False) == (timed[:3], {"a": 1, "b": 1, "c": 1})
    assert rounds(budget=6, warm_up=False) == (timed[:6], {"a": 2, "b": 2, "c": 2})
    assert rounds(budget=6) == (["A", "B", "C"] + timed[:6], {"a": 2, "b": 2, "c": 2})


def test_drop_cost_is_measured_on_a_plan_of_the_models_own(gpt2):
    """``drop_s``: calibration solves a plan of drops for the model's call (no partitions),
    runs it (each drop packed as a handle in forward, rebuilt in backward, the call's ops
    matching the trace), and charges each drop what the step took beyond the simulator and
    the other terms: ``modelled + drops x drop_s == measured`` whenever that is above 0."""
    from taichi_plan.runtime.calibrate.probes import build_drop_probe
    from taichi_plan.runtime.calibrate.rates import drop_rate
    from taichi_plan.runtime.install import install

    cal = gpt2.meta["runtime_overhead"]
    assert cal["drop_s"] >= 0 and cal["drop_probe"]["drops"] > 0
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    probe = build_drop_probe(gpt2, call)
    problem, drops, cp = probe
    assert len(drops) == cal["drop_probe"]["drops"] == sum(len(v) for v in cp.drops.values())
    assert all(call["start"] <= int(problem.producer[d.tensor]) <= call["end"] for d in drops)
    model, batch, loss_fn, _opt = get_workload(**GPT2).build(False)
    rt = PlanRuntime([cp])
    handles = install(model, rt)
    try:
        out = model(**batch)
        assert rt.dropped_storages == len(drops) and rt.recompute_ops == 0
        loss_fn(out, batch).backward()
        assert rt.recompute_ops > 0
    finally:
        for h in handles:
            h.remove()
    assert rt.mismatches == 0
    rates = {k: cal[k] for k in ("check_op_s", "recipe_op_s", "rebuild_op_s")}
    modelled = drop_rate(probe, 0.0, rates)["drop_probe"]["modelled_s"]
    assert modelled > 0
    rate = drop_rate(probe, modelled + 0.01, rates)
    assert rate["drop_s"] * len(drops) == pytest.approx(0.01)
    assert drop_rate(probe, modelled - 0.01, rates)["drop_s"] == 0


def test_module_hooks_and_regions_are_measured_on_the_model(gpt2):
    """Trace v18: ``module_call_s`` and ``region_s`` come from the drop probe's call run with the
    module hooks alone and in its regions; what the own-clocked runtime counts there is every
    module call of the model call and every planned region of the probe."""
    from dataclasses import replace

    from taichi_plan.problem.partition.regions import module_calls_per_call
    from taichi_plan.runtime.calibrate.clocks import own_clocked_runtime
    from taichi_plan.runtime.calibrate.probes import build_drop_probe
    from taichi_plan.runtime.install import install

    cal = gpt2.meta["runtime_overhead"]
    assert cal["module_call_s"] > 0 and cal["region_s"] >= 0
    # v19: the regions' cost beyond the own seconds, measured on the same probe against the call plain
    regions = build_drop_probe(gpt2, [c for c in gpt2.meta["model_calls"] if c["grad"]][0])[2].regions
    assert cal.get("region_op_s", 0) >= 0 and cal["region_probe"]["ops"] == sum(
        last - first + 1 for spans in regions.values() for first, last in spans.values())
    call = [c for c in gpt2.meta["model_calls"] if c["grad"]][0]
    _problem, _drops, cp = build_drop_probe(gpt2, call)
    assert cp.regions and not cp.whole_call  # the probe runs in regions: kept measures their entries
    model, batch, _loss_fn, _opt = get_workload(**GPT2).build(False)
    counted = {}
    for name, plan in (("hooks", replace(cp, drops={}, group_of={}, triggers={}, regions={}, probe=True)),
                       ("kept", replace(cp, drops={}, group_of={}, probe=True))):
        rt = own_clocked_runtime()([plan])
        handles = install(model, rt)
        try:
            model(**batch)
        finally:
            for h in handles:
                h.remove()
        assert rt.mismatches == 0, name
        counted[name] = (rt.hook_n, rt.regions_run, rt.hook_s)
    n_modules = module_calls_per_call(gpt2)[0]
    assert counted["hooks"][:2] == (n_modules, 0)
    assert cal["module_call_probe"]["calls"] == n_modules  # v20: the hooks whole, per module call
    assert counted["kept"][:2] == (n_modules, sum(len(v) for v in cp.regions.values()))
    assert counted["kept"][2] > 0


def test_hook_rates():
    from taichi_plan.runtime.calibrate.rates import module_hook_rates

    hooks = [(0, 0, 0, 0, 50 * 10e-6, 50, 0)] * 3
    kept = [(0, 0, 0, 0, 50 * 10e-6 + 4 * 20e-6, 50, 4)] * 3
    rates = module_hook_rates({"hooks": hooks, "kept": kept})
    assert rates["module_call_s"] == pytest.approx(10e-6) and rates["region_s"] == pytest.approx(20e-6)
    assert rates["module_call_own_s"] == rates["module_call_s"]  # no unclocked run: the own seconds
    assert module_hook_rates({"hooks": hooks, "kept": [(0, 0, 0, 0, 40 * 10e-6, 50, 4)]})["region_s"] == 0  # not below 0
    assert module_hook_rates({"kept": kept}) == {}  # no hooks-alone run: the microbenchmark's term stays
    assert "region_s" not in module_hook_rates({"hooks": hooks, "kept": [(0, 0, 0, 0, 1.0, 50, 0)]})  # no region entered


def test_module_calls_cost_what_the_hooks_cost_them_whole():
    """Trace v20: ``module_call_s`` is what the module hooks alone cost the forward and backward
    per module call, unclocked, against the call plain (paired per repetition, median), not
    their own seconds; never below those; from 5 repetitions."""
    from taichi_plan.runtime.calibrate.config import default_config
    from taichi_plan.runtime.calibrate.rates import module_hook_rates

    hooks = [(0, 0, 0, 0, 50 * 10e-6, 50, 0)] * 5  # own: 10 us per call
    plain = [(0.100, 0.3), (0.101, 0.3), (0.102, 0.3), (0.100, 0.3), (0.100, 0.3)]
    # forward 1.5, 1.5, 2, 1.5, 2 ms over; forward and backward 2, 2, 2.5, 2, 2.5 ms over
    whole = [(0.1015, 0.302), (0.1025, 0.302), (0.1040, 0.3025), (0.1015, 0.302), (0.1020, 0.3025)]
    rates = module_hook_rates({"hooks": hooks, "hooks_whole": whole, "plain": plain})
    assert rates["module_call_s"] == pytest.approx(2e-3 / 50)  # 40 us a call, forward and backward
    assert rates["module_call_forward_s"] == pytest.approx(1.5e-3 / 50)  # 30 of them in the forward
    assert rates["module_call_own_s"] == pytest.approx(10e-6)
    assert rates["module_call_probe"] == {"whole_s": pytest.approx(2e-3), "forward_s": pytest.approx(1.5e-3),
                                          "own_s": pytest.approx(0.5e-3), "calls": 50, "repeats": 5}
    below = [(0.1002, 0.3002)] * 5  # noise below the own seconds: the own seconds stand
    assert module_hook_rates({"hooks": hooks, "hooks_whole": below, "plain": plain})["module_call_s"] == pytest.approx(10e-6)
    n = default_config().region_min_repeats - 1
    few = module_hook_rates({"hooks": hooks[:n], "hooks_whole": whole[:n], "plain": plain[:n]})
    assert few["module_call_s"] == pytest.approx(10e-6) and few["module_call_probe"]["repeats"] == n


def test_region_outside():
    """Trace v19: what the regions cost the forward beyond the runtime's own seconds, per op of
    the probe's regions (the unclocked run against plain, forward seconds paired per repetition,
    minus the clocked run's handler and hook seconds); not below 0; nothing without the runs."""
    from taichi_plan.runtime.calibrate.rates import region_outside

    kept = [(0, 0, 3e-3, 0, 1e-3, 50, 10)] * 5  # own: 3 ms in the handler, 1 ms in the hooks
    plain = [(0.100, 0.3), (0.101, 0.3), (0.102, 0.3), (0.100, 0.3), (0.100, 0.3)]
    whole = [(0.1045, 0.3), (0.1055, 0.3), (0.1070, 0.3), (0.1045, 0.3), (0.1050, 0.3)]  # 4.5, 4.5, 5, 4.5, 5 ms over
    out = region_outside({"kept": kept, "kept_whole": whole, "plain": plain}, 100)
    assert out["region_op_s"] == pytest.approx(5e-6)  # (4.5 - 4) ms over 100 ops
    assert out["region_probe"]["ops"] == 100 and out["region_probe"]["regions"] == 10
    under = [(0.1030, 0.3)] * 5  # the whole run below the own seconds (noise): nothing added
    assert region_outside({"kept": kept, "kept_whole": under, "plain": plain}, 100)["region_op_s"] == 0
    few = region_outside({"kept": kept[:4], "kept_whole": whole[:4], "plain": plain[:4]}, 100)
    assert "region_op_s" not in few and few["region_probe"]["repeats"] == 4  # too few repetitions: not charged
    assert region_outside({"kept": kept, "plain": plain}, 100) == {}
    assert region_outside({"kept": kept, "kept_whole": whole, "plain": plain}, 0) == {}
    # v20: the module calls' cost beyond their hooks' own seconds is charged per call, not per op
    beyond = region_outside({"kept": kept, "kept_whole": whole, "plain": plain}, 100, 4e-6)
    assert beyond["region_op_s"] == pytest.approx(3e-6)  # (4.5 - 4 - 50 x 4 us) ms over 100 ops


def test_region_ops_are_charged_per_op_in_regions(gpt2):
    """The overhead is exactly ``region_op_s`` per op of the plan's planned regions more."""
    p = build_problem(gpt2)
    plan = solve(gpt2, int(0.8 * p.baseline_peak[0]), "heuristic", seed=0)
    drops = drops_from_plan(p, plan)
    sim, parted = simulate_plan(p, drops, [])
    rerun = rerun_ops(parted, drops)

    seen = region_ops(gpt2, needed_ops(parted, drops, rerun))
    ops = sum(k.ops for k in seen.values() if k is not None)
    assert ops > 0
    cal = dict(gpt2.meta["runtime_overhead"], region_op_s=0.0)
    more = dict(cal, region_op_s=7e-6)
    assert runtime_overhead_s(p, drops, [], rerun, cal=more, seen=seen) - runtime_overhead_s(
        p, drops, [], rerun, cal=cal, seen=seen) == pytest.approx(ops * 7e-6)


def test_a_fake_recordings_runtime_costs_stay_out_of_its_compute():
    """A fake recording's op times are a device profile's, its runtime terms this CPU's
    microbenchmark: the simulator charges the recorded op times only, and the re-run and drop
    terms are the plan's predicted runtime overhead, added after the solve."""
    trace = record_workload(get_workload(**GPT2), fake=True, device_profile="a100-40gb")
    p = build_problem(trace)
    cal = trace.meta["runtime_overhead"]
    assert not p.folds_runtime and cal["rebuild_op_s"] > 0
    assert np.array_equal(p.rerun_cost, p.op_cost) and p.drop_cost == 0.0
    plan = solve(trace, int(0.8 * p.baseline_peak[0]), "heuristic", seed=0)
    drops = drops_from_plan(p, plan)
    sim, parted = simulate_plan(p, drops, [])  # the drops alone: their re-runs at recorded times
    reruns = [op for g in sim.groups.values() for op in g.ops]
    assert reruns and sim.extra_cost == pytest.approx(float(p.op_cost[reruns].sum()))
    # ...and the runtime's per-re-run and per-drop terms in its predicted overhead
    with_reruns = runtime_overhead_s(p, drops, [], rerun_ops(parted, drops), reruns)
    assert with_reruns - runtime_overhead_s(p, drops, [], rerun_ops(parted, drops)) == pytest.approx(
        len(reruns) * cal["rebuild_op_s"] + len(drops) * cal.get("drop_s", 0.0))


def test_a_calibration_config_reaches_calibration():
    """``measure_on_model(..., config=CalibrationConfig(...))`` runs what its config says: the
    repetitions (3 here, where the suite's default config runs 1) and the chunks partitions are
    probed in (2, where the default probes 4)."""
    import torch
    from torch import nn

    from taichi_plan.record import record
    from taichi_plan.runtime.calibrate import measure_on_model
    from taichi_plan.runtime.calibrate.config import CalibrationConfig

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2)])

        def forward(self, x):
            return self.blocks(x).square().mean(dim=1)

    torch.manual_seed(0)
    model, batch = Mlp(), {"x": torch.randn(16, 64)}

    def loss_fn(out, b):
        return out.mean()

    trace = record(model, batch, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, warmup=0)
    default = measure_on_model(model, batch, loss_fn, trace)
    assert default["repeats"] == 1 and default["partition_probe"]["chunks"] == 4
    tuned = measure_on_model(model, batch, loss_fn, trace,
                             config=CalibrationConfig(repeats=3, budget_s=1e9, warm_up=False, probe_chunks=2))
    assert tuned["repeats"] == 3 and tuned["partition_probe"]["chunks"] == 2


def test_region_variants_are_topped_up_to_the_repetitions_their_term_needs():
    """The budget's rounds run every variant; the region variants then run alone, interleaved,
    until each has ``least`` repetitions (a model whose rounds fit 4 times in the budget would
    otherwise charge no ``region_op_s``); nothing runs where they have that many."""
    from taichi_plan.runtime import calibrate
    from taichi_plan.runtime.calibrate.timing import top_up

    runs = []

    def forward(v):
        runs.append(v)
        return (0.0, 0.0)

    times = {"a": [()] * 2, "b": [()] * 2, "other": [()] * 2}
    top_up(forward, {"a": "A", "b": "B"}, times, 5)
    assert runs == ["A", "B", "B", "A", "A", "B"]  # rounds 3-5, each starting one later
    assert {n: len(v) for n, v in times.items()} == {"a": 5, "b": 5, "other": 2}
    runs.clear()
    top_up(forward, {"a": "A", "b": "B"}, times, 5)
    assert runs == []
    # drop_s pairs drops with kept; region_op_s kept_whole with plain; module_call_s hooks_whole with plain
    assert set(calibrate.REGION_VARIANTS) == {"drops", "kept", "kept_whole", "plain", "hooks_whole"}


def test_the_drop_probe_prefers_drops_made_inside_modules():
    """A drop made in the model's own top-level code runs the runtime over the whole call, where
    the probe cannot measure what regions cost: the probe then keeps the plan's drops that run
    in regions on their own (here the heuristic's plan drops a tensor the top-level ``sin``
    makes too)."""
    import torch
    from torch import nn

    from taichi_plan.base.errors import InfeasibleBudgetError
    from taichi_plan.record import record
    from taichi_plan.runtime.calibrate.config import default_config
    from taichi_plan.runtime.calibrate.probes import build_drop_probe

    class Top(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(64, 512)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(3)])
            self.out = nn.Linear(512, 1)

        def forward(self, x):
            e = torch.cos(torch.sin(x.repeat(1, 4)))  # the model's own code: module ""
            return self.out(self.blocks(self.inp(x) * e.mean(dim=1, keepdim=True)))

    torch.manual_seed(0)
    model = Top()
    batch = {"x": torch.randn(512, 64)}
    trace = record(model, batch, lambda out, b: out.square().mean(), torch.optim.SGD(model.parameters(), lr=0.1),
                   steps=1, warmup=0)
    # The plans below are solved from the op times; a first step's measured times swing by 10x
    # with the machine's load, and the heuristic's plan with them. Timed by their FLOPs instead
    # (10 GFLOP/s plus 1 us an op: the top-level elementwise ops cheap to re-run), the plans
    # are the same on every run.
    trace.ops["duration_s"] = trace.ops["flops"].astype(float) / 1e10 + 1e-6
    call = [c for c in trace.meta["model_calls"] if c["grad"]][0]
    problem, drops, cp = build_drop_probe(trace, call)
    assert drops and cp.drops and not cp.whole_call and cp.regions
    modules = trace.ops["module"].tolist()
    made = {int(problem.producer[d.tensor]) for d in drops}
    assert all(modules[o] for o in made)
    # what the heuristic alone would have run: a drop made at the top level, over the whole call
    from dataclasses import replace

    from taichi_plan.runtime.calls import call_plans
    from taichi_plan.solve import solve

    bare = replace(trace, meta={k: v for k, v in trace.meta.items() if k != "runtime_overhead"})
    plan = None
    for share in default_config().drop_probe_fractions:  # the first that fits, as the probe took it before
        try:
            plan = solve(bare, int(share * problem.baseline_peak[0]), "heuristic", time_limit=10.0, problem=problem,
                         optimizer="as-recorded")
            break
        except InfeasibleBudgetError:
            continue
    plan = replace(plan, partitions=[], recompute=[r for r in plan.recompute if call["start"] <= r.op <= call["end"]])
    assert any(not modules[r.op] for r in plan.recompute) and any(modules[r.op] for r in plan.recompute)
    assert call_plans(plan, bare, problem)[0].whole_call
