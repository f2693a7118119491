"""Planner and simulator: golden answers, properties over generated traces, the CLI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import cpu_slowdown
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import TraceBuilder, chain_trace, random_training_trace

from taichi_plan.base.errors import InfeasibleBudgetError, PlanError, UsageError
from taichi_plan.cli import main
from taichi_plan.plan.format import load_plan, peak_from_schedule
from taichi_plan.problem.core import build_problem
from taichi_plan.simulate.core import Drop, simulate, simulate_plan
from taichi_plan.solve import methods, run_method, solve
from taichi_plan.solve.config import HeuristicConfig, SolverConfig, TimeConfig
from taichi_plan.solve.heuristic import plan_heuristic
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import baseline_peak, write_trace

# ---------------------------------------------------------------------------------------------
# Golden: a 3-layer chain whose optimal plans are worked out by hand.
#   a = f(x) cost 1, b = f(a) cost 2, c = f(b) cost 4; backward reads c, b, a in turn.
#   Baseline peak 324 at op 4 (x, a, b, c, loss, grad). Dropping a frees ops 2..5 and costs 1;
#   dropping b as well frees ops 3..4 but its rebuild before op 5 needs a back there, so
#   op 5 holds x, a, b, g3, g2 = 230. The least any plan reaches is 224 (drop a alone).
# ---------------------------------------------------------------------------------------------


def golden_trace():
    b = TraceBuilder()
    x = b.tensor(10, "input")
    (a,) = b.op("aten.f.default", [x], [100], cost=1.0)
    (bb,) = b.op("aten.f.default", [a], [100], cost=2.0)
    (c,) = b.op("aten.f.default", [bb], [100], cost=4.0)
    (loss,) = b.op("aten.sum.default", [c], [4], cost=0.5, kind="temporary")
    (g3,) = b.op("aten.g.default", [loss, c], [10], phase="backward", cost=0.5, kind="temporary")
    (g2,) = b.op("aten.g.default", [g3, bb], [10], phase="backward", cost=0.5, kind="temporary")
    b.op("aten.g.default", [g2, a], [10], phase="backward", cost=0.5, kind="temporary")
    return b.build("golden"), (a, bb, c)


def test_golden_baseline():
    trace, _ = golden_trace()
    assert baseline_peak(trace) == (324, 4)


@pytest.mark.parametrize("method", ["auto", "ilp", "heuristic"])
@pytest.mark.parametrize("budget,cost,peak,dropped", [
    (324, 0.0, 324, set()),      # not binding
    (400, 0.0, 324, set()),      # not binding, above the peak
    (300, 1.0, 224, {"a"}),      # binding: drop a
    (224, 1.0, 224, {"a"}),      # exactly the least reachable
])
def test_golden_plans(method, budget, cost, peak, dropped):
    trace, (a, bb, c) = golden_trace()
    plan = solve(trace, budget, method, time_limit=10)
    names = {a: "a", bb: "b", c: "c"}
    assert plan.predicted["extra_compute"] == pytest.approx(cost)
    assert plan.predicted["planned_peak_bytes"] == peak
    assert {names[r.tensor] for r in plan.recompute} == dropped
    if method != "heuristic":
        assert plan.solver["status"] == "optimal"


@pytest.mark.parametrize("method", ["auto", "heuristic"])
def test_golden_infeasible_says_the_least_budget(method):
    trace, _ = golden_trace()
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(trace, 223, method, time_limit=10)
    assert e.value.min_budget_bytes == 224
    assert "plan fits a budget of 223 B" in str(e.value) and "No plan file was written" in str(e.value)


def test_rebuild_early_chain_is_simulated():
    trace, (a, bb, _) = golden_trace()
    p = build_problem(trace)
    ia, ib = p.index_of(a), p.index_of(bb)
    sim = simulate(p, [Drop(ia, 1, 6), Drop(ib, 2, 5)])
    assert sim.remat_at[ia] == 5  # a is needed back to rebuild b before op 5
    assert sim.peak_bytes == 230 and sim.peak_op == 5
    assert sim.extra_cost == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------
# Partition: a module whose transient no rematerialization can free.
# ---------------------------------------------------------------------------------------------


def partition_trace():
    b = TraceBuilder()
    x = b.tensor(40, "input")
    (t1,) = b.op("aten.mm.default", [x], [400], cost=1.0, module="m.a", kind="temporary")
    (y,) = b.op("aten.relu.default", [t1], [40], cost=1.0, module="m.b")
    (loss,) = b.op("aten.sum.default", [y], [4], cost=0.1, kind="temporary")
    (gy,) = b.op("aten.ones_like.default", [loss], [40], phase="backward", cost=0.1, kind="temporary")
    b.op("aten.mm_backward.default", [gy, x], [40], phase="backward", cost=1.0, module="m.b", kind="temporary")
    for t in b.tensors:
        t["shape"] = [4, max(t["nbytes"] // 16, 1)]
    trace = b.build("partition")
    trace.meta["workload"] = {"name": "synthetic", "args": {"batch": 4}}
    return trace


def test_partition_reaches_what_remat_cannot():
    trace = partition_trace()
    p = build_problem(trace)
    assert baseline_peak(trace)[0] == 480
    assert not plan_heuristic(p, 230, partitions=False).drops  # nothing to drop
    plan = solve(trace, 230, "auto", time_limit=10)
    assert [(q.module, q.chunks) for q in plan.partitions] == [("m", 4)]
    # At the last chunk's relu: x 40 + its t1 piece 100 + its y piece 10 + the 3 earlier
    # chunks' y pieces 30 (then the cat: x 40 + 4 pieces 40 + y 40 = 120).
    assert plan.predicted["planned_peak_bytes"] == 180
    # Extra: the module's forward once more (2.0) plus 4 chunks x 3 ops of launch overhead.
    assert plan.predicted["extra_compute"] == pytest.approx(2.0 + 4 * 3 * 1e-5)
    assert peak_from_schedule(plan.schedule)[0] == 180


def test_heuristic_reaches_a_budget_whatever_the_recorded_op_times():
    """A DDP rank of a 2-layer GPT-2 recorded under load (tests/data/ddp-gpt2-loaded): its op
    times differ from an idle recording's, and the cost-weighted sweep took cheap drops that
    left it at 19.84 MB for a 19.23 MB budget (50%), where every method gave up, at any time
    limit. Ranked by bytes alone, the sweep reaches 18.54 MB, the same peak as on an idle
    recording of that model: the heuristic keeps that plan when the cheaper order misses."""
    from taichi_plan.trace.format import read_trace

    trace = read_trace(Path(__file__).parent / "data" / "ddp-gpt2-loaded")
    p = build_problem(trace)
    budget = int(baseline_peak(trace)[0] * 0.5)
    dec = plan_heuristic(p, budget, time_limit=20)
    sim, _ = simulate_plan(p, dec.drops, dec.partitions)
    assert sim.peak_bytes <= budget < 19_840_000
    assert any("by bytes alone" in n for n in dec.notes)


def test_heuristic_asks_the_simulator_where_its_sweeps_miss_on_a_recorded_step():
    """A recorded (not forward-only) step where every sweep of the heuristic misses the budget
    (they score a drop by the bytes its gap frees, and the peak moves once a few are taken):
    the simulator-in-the-loop local search reaches it. A compiled Phi's least peak went from
    143.98 MB (the sweeps) to 134.55 MB so, measured equal to its prediction
    (docs/benchmarks.md). Without the search (``local_max_s=0``) the heuristic ends at 472 B."""
    p = build_problem(random_training_trace(random.Random(24), layers=8))
    assert not p.every_gap
    budget = 313
    swept = plan_heuristic(p, budget, partitions=False, config=HeuristicConfig(local_max_s=0.0))
    assert simulate_plan(p, swept.drops)[0].peak_bytes == 472
    dec = plan_heuristic(p, budget, partitions=False)
    assert simulate_plan(p, dec.drops)[0].peak_bytes <= budget
    assert dec.notes == ["simulator-driven local search"]
    # and the least budget a failed solve names comes from the same search: 312 B, not 344 B
    from taichi_plan.solve.reach import lowest_reachable

    assert lowest_reachable(p)[0] <= budget
    again = build_problem(random_training_trace(random.Random(24), layers=8))
    assert lowest_reachable(again, config=SolverConfig(time=TimeConfig(bisect_local_max_s=0.0)))[0] == 344


# ---------------------------------------------------------------------------------------------
# Properties over generated traces (the referee's contract).
# ---------------------------------------------------------------------------------------------

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FAST = ["heuristic", "none", "full", "sqrt-n", "dtr", "selective-mm"]


@SETTINGS
@given(seed=st.integers(0, 10_000), frac=st.sampled_from([0.95, 0.85, 0.7, 0.55]),
       method=st.sampled_from(FAST + ["auto"]))
def test_every_plan_is_feasible_and_schedule_agrees(seed, frac, method):
    trace = random_training_trace(random.Random(seed))
    p = build_problem(trace)
    budget = int(p.baseline_peak[0] * frac)
    try:
        plan = solve(trace, budget, method, time_limit=5, problem=p)
    except InfeasibleBudgetError as e:
        if method in ("auto", "heuristic"):
            assert e.min_budget_bytes > budget
        assert "No plan file was written" in str(e)
        return
    sim, _ = simulate_plan(p, [Drop(p.index_of(r.tensor), r.free_after, r.remat_before) for r in plan.recompute],
                           plan.partitions)
    assert sim.peak_bytes <= budget
    assert plan.predicted["planned_peak_bytes"] == sim.peak_bytes
    assert peak_from_schedule(plan.schedule)[0] == sim.peak_bytes


@SETTINGS
@given(seed=st.integers(0, 10_000))
def test_none_plan_reproduces_the_trace_peak(seed):
    trace = random_training_trace(random.Random(seed))
    p = build_problem(trace)
    sim = simulate(p, [])
    assert (sim.peak_bytes, sim.peak_op) == baseline_peak(trace)
    assert (sim.live_bytes == p.baseline_live).all()


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_optimal_cost_never_drops_with_the_budget(seed):
    trace = random_training_trace(random.Random(seed))
    p = build_problem(trace)
    costs = []
    for frac in (0.95, 0.85, 0.75, 0.65):
        try:
            plan = solve(trace, int(p.baseline_peak[0] * frac), "ilp", time_limit=5, problem=p)
        except InfeasibleBudgetError:
            break
        if plan.solver["status"] == "optimal":
            costs.append(plan.predicted["extra_compute"])
    assert costs == sorted(costs) or all(b >= a - 1e-6 for a, b in zip(costs, costs[1:], strict=False))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), method=st.sampled_from(["auto", "heuristic", "dtr"]))
def test_same_inputs_and_seed_give_the_same_plan(seed, method):
    trace = random_training_trace(random.Random(seed))
    p = build_problem(trace)
    budget = int(p.baseline_peak[0] * 0.8)

    def once():
        try:
            plan = solve(trace, budget, method, time_limit=600, work_limit=5, seed=3, problem=p).to_json()
        except InfeasibleBudgetError as e:
            return str(e)
        plan["solver"].pop("wall_s")
        return plan

    assert once() == once()


def _public(graphs_dir, prefix):
    from taichi_plan.trace.import_graph import import_graph

    (path,) = sorted(graphs_dir.glob(f"{prefix}*.json"))
    return import_graph(path)


def test_work_limit_gives_the_same_plan_where_the_search_is_cut(graphs_dir):
    """ResNet-50 at 0.4: neither the bound phase nor CP-SAT proves optimality within a work
    limit of 0.3 (MobileNet at 0.4, used before the bound phase, is now proven optimal), so it
    is the work limit (deterministic time, and HiGHS's node limit) that stops it; twice the
    same plan and bound."""
    trace = _public(graphs_dir, "ResNet50")
    p = build_problem(trace)
    budget = int(p.baseline_peak[0] * 0.4)

    def once():
        plan = solve(trace, budget, "auto", time_limit=600, work_limit=0.3, seed=1, problem=p)
        assert plan.solver["stats"]["timed_out"], plan.solver["stats"]
        out = plan.to_json()
        out["solver"].pop("wall_s")
        return out

    assert once() == once()


def test_forward_only_graph_rebuilds_anywhere_in_a_gap(graphs_dir):
    """random_layered n100 at 0.8: rebuilding only right before a use (or at the early point),
    no planner found a plan (docs/benchmarks.md before issue 11's rebuild points); with a
    rebuild before any op of a gap, the heuristic's local search finds one that the simulator
    accepts, and it rebuilds some gap before the op that next uses it."""
    trace = _public(graphs_dir, "random_layered_n100")
    p = build_problem(trace)
    assert p.every_gap
    budget = int(p.baseline_peak[0] * 0.8)
    dec = plan_heuristic(p, budget, time_limit=60)
    assert simulate(p, dec.drops).peak_bytes <= budget
    next_use = {(int(t), int(a)): int(b) for t, a, b in zip(p.candidates, p.cand_free_after, p.cand_remat_before,
                                                            strict=True)}
    assert any(d.remat_before < next_use[(d.tensor, d.free_after)] for d in dec.drops)


def test_time_limit_is_wall_clock_for_the_whole_command(graphs_dir, tmp_path):
    """--time-limit 5 counts loading, warm start and every CP-SAT round. ResNet-50 at 0.35 is
    not proven optimal in 5 s: the best plan so far is written with its bound (at 0.30 the
    sqrt-n warm start, run as checkpoint_sequential runs it, peaks at 0.302). random_layered
    n250 at 0.8 (its model has 9875 options, a rebuild point each: building it counts) has no
    plan found in 5 s: the error says the search stopped, not that none exists, and what the
    best plan found reaches.

    The command may run 0.5 s past its limit (finishing: the last simulation, writing) on an
    idle machine; when other processes share the cores, that finishing work takes longer by
    the slowdown a CPU-bound probe measures just before and after the command."""
    import time

    def run(prefix, budget):
        tdir = write_trace(_public(graphs_dir, prefix), tmp_path / prefix)
        out = tmp_path / f"{prefix}.plan.json"
        before = cpu_slowdown()
        t0 = time.perf_counter()
        r = CliRunner().invoke(main, ["solve", str(tdir), "--budget", budget, "--time-limit", "5", "-o", str(out)])
        wall = time.perf_counter() - t0
        slowdown = max(before, cpu_slowdown())
        assert wall <= 5 + 0.5 * slowdown, (prefix, wall, slowdown)
        return r, out

    r, out = run("ResNet50", "35%")
    assert r.exit_code == 0, r.output
    s = load_plan(out).solver
    assert s["status"] == "feasible" and s["stats"]["timed_out"]
    assert s["lower_bound"] is not None and 0 <= s["lower_bound"] <= s["extra_compute"]
    assert any("time limit" in n for n in s["notes"])
    r, out = run("random_layered_n250", "80%")
    assert r.exit_code == InfeasibleBudgetError.exit_code, r.output
    msg = " ".join(r.output.split())
    assert "within the time limit of 5 s" in msg and "does not prove that none exists" in msg
    assert "found so far reaches" in msg and not out.exists()


def test_no_plan_at_the_limit_says_so_and_what_was_reached():
    """A trace where the warm start misses the budget and CP-SAT needs a few rounds: cut at
    once by the work limit, the error says the search stopped (not that no plan exists) and
    names the peak reached; given the work, a plan is found (the exhaustive optimum, 17)."""
    trace = random_training_trace(random.Random(83))
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(trace, 432, "auto", time_limit=600, work_limit=1e-9)
    msg = " ".join(str(e.value).split())
    assert "within the time limit of 600 s or the work limit of 1e-09" in msg
    assert "does not prove that none exists" in msg and "No plan file was written" in msg
    assert e.value.min_budget_bytes == 448 and "is 448 B" in msg
    plan = solve(trace, 432, "auto", time_limit=600, work_limit=30)
    assert plan.predicted["planned_peak_bytes"] <= 432
    assert plan.predicted["extra_compute"] == pytest.approx(17.0)


def test_a_bound_above_the_cost_is_a_bug_not_clamped():
    trace, _ = golden_trace()
    p = build_problem(trace)
    dec = run_method(p, 300, "heuristic")
    dec.lower_bound = 2.0  # the plan costs 1.0
    with pytest.raises(AssertionError, match="lower bound"):
        make_plan(p, 300, "heuristic", dec, 0.0, 0)


def test_chain_sqrt_budget_reached_by_ours():
    trace = chain_trace([100] * 8, temp_bytes=50)
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.8), "auto", time_limit=10)
    assert plan.solver["status"] == "optimal" and plan.solver["gap"] < 1e-3


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def golden_dir(tmp_path):
    trace, _ = golden_trace()
    return write_trace(trace, tmp_path / "golden")


@pytest.mark.parametrize("budget", ["16 GB", "-3GB", "0", "1e999", "abc", "150%", "3XB"])
def test_cli_bad_budgets(golden_dir, tmp_path, budget):
    out = tmp_path / "p.plan.json"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", budget, "-o", str(out)])
    assert r.exit_code == 4, r.output
    assert "Budget" in r.output and not out.exists()


def test_cli_infeasible_writes_nothing(golden_dir, tmp_path):
    out = tmp_path / "p.plan.json"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "223", "-o", str(out)])
    assert r.exit_code == 5, r.output
    assert "224" in r.output.replace(",", "") or "0.22 KB" in r.output
    assert not out.exists() and not list(tmp_path.glob(".p.plan.json*"))


def test_cli_solve_writes_plan_and_refuses_overwrite(golden_dir, tmp_path):
    out = tmp_path / "p.plan.json"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert f"Wrote {out}" in r.output and "optimal" in r.output
    plan = load_plan(out)
    assert plan.budget_bytes == 300 and plan.predicted["planned_peak_bytes"] == 224
    assert plan.recompute[0].why.startswith("frees")
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "-o", str(out)])
    assert r.exit_code == 8 and "--force" in r.output
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "93%", "-o", str(out), "--force"])
    assert r.exit_code == 0 and load_plan(out).budget_bytes == int(324 * 0.93)


def test_cli_unknown_method_and_missing_trace(golden_dir, tmp_path):
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "-m", "magic",
                                  "-o", str(tmp_path / "x.json")])
    assert r.exit_code == UsageError.exit_code and "sqrt-n" in r.output
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "nope"), "--budget", "300"])
    assert r.exit_code == 3 and "does not exist" in " ".join(r.output.split())


@pytest.mark.parametrize("method", [m for m in methods() if m not in ("ilp",)])
def test_cli_every_method_runs(golden_dir, tmp_path, method):
    out = tmp_path / f"{method}.plan.json"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "90%", "-m", method, "-o", str(out),
                                  "--time-limit", "5"])
    # What the library says this method reaches decides the exit code: ours must fit (the
    # golden trace reaches 224 of 324 bytes), a baseline that cannot must say so with exit 5.
    trace, _ = golden_trace()
    budget = int(0.9 * 324)
    if method in ("auto", "heuristic"):
        fits = True
    else:
        problem = build_problem(trace)
        dec = run_method(problem, budget, method, time_limit=5)
        fits = make_plan(problem, budget, method, dec, 0.0, 0).solver["status"] != "infeasible"
    if fits:
        assert r.exit_code == 0, r.output
        data = json.loads(out.read_text())
        assert data["solver"]["method"] == method
        assert data["budget_bytes"] == budget
        assert data["predicted"]["planned_peak_bytes"] <= data["budget_bytes"]
    else:
        assert r.exit_code == InfeasibleBudgetError.exit_code, r.output
        assert f"No {method} plan fits" in " ".join(r.output.split()) and not out.exists()


# ---------------------------------------------------------------------------------------------
# Several gaps per tensor (imported graphs): freed and rebuilt once per gap.
# ---------------------------------------------------------------------------------------------


def many_use_trace(mode: str):
    """x -> a (cost 2), then a is read at ops 3 and 6 with fillers between: a has two gaps,
    (0, 3) and (3, 6); each filler makes 50 bytes that live one op."""
    b = TraceBuilder()
    x = b.tensor(10, "input")
    (a,) = b.op("f", [x], [100], cost=2.0)  # op 0
    prev = x
    for i in range(1, 7):
        reads = [prev] + ([a] if i in (3, 6) else [])
        (prev,) = b.op("g", reads, [50], cost=1.0, kind="temporary")  # forward ops only
    trace = b.build("many-use")
    trace.meta["mode"] = mode
    return trace, a


def test_a_tensor_rebuilt_once_per_gap_on_imported_graphs():
    trace, a = many_use_trace("imported")
    p = build_problem(trace)
    ia = p.index_of(a)
    gaps = sorted((int(f), int(r)) for t, f, r in zip(p.candidates, p.cand_free_after, p.cand_remat_before,
                                                      strict=True) if t == ia)
    assert gaps == [(0, 3), (3, 6)]
    sim = simulate(p, [Drop(ia, 0, 3), Drop(ia, 3, 6)])
    assert sim.extra_cost == pytest.approx(4.0)  # its producer, once per gap
    assert sim.remat_at_drop == {(ia, 0): 3, (ia, 3): 6}
    # Unplanned: x 10 + a 100 + one or two 50-byte fillers. a is away during ops 1-2 and 4-5.
    assert p.baseline_live.tolist() == [110, 160, 210, 210, 210, 210, 210]
    assert sim.live_bytes.tolist() == [110, 60, 110, 210, 110, 110, 210]
    plan = make_plan(p, 210, "heuristic", Decisions(drops=[Drop(ia, 0, 3), Drop(ia, 3, 6)]), 0.0, 0)
    assert peak_from_schedule(plan.schedule)[0] == plan.predicted["planned_peak_bytes"] == 210
    with pytest.raises(PlanError, match="overlapping"):
        simulate(p, [Drop(ia, 3, 6), Drop(ia, 3, 5)])


def test_a_recorded_tensor_keeps_one_gap():
    trace, a = many_use_trace("synthetic")
    p = build_problem(trace)
    ia = p.index_of(a)
    assert (p.candidates == ia).sum() <= 1
    with pytest.raises(PlanError, match="at most one gap"):
        simulate(p, [Drop(ia, 0, 3), Drop(ia, 3, 6)])


def test_cli_work_limit(golden_dir, tmp_path):
    out = tmp_path / "w.plan.json"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "--work-limit", "5", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert load_plan(out).solver["status"] == "optimal"
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "--work-limit", "0", "-o",
                                  str(tmp_path / "x.plan.json")])
    assert r.exit_code == UsageError.exit_code and "--work-limit must be a positive number" in r.output


@pytest.mark.parametrize("limit", ["0", "-1", "nan"])
def test_cli_time_limit_must_be_positive(golden_dir, tmp_path, limit):
    # Checked before anything runs: a limit already spent read as "no plan found in time".
    r = CliRunner().invoke(main, ["solve", str(golden_dir), "--budget", "300", "--time-limit", limit, "-o",
                                  str(tmp_path / "x.plan.json")])
    assert r.exit_code == UsageError.exit_code, r.output
    assert "--time-limit must be a positive number of seconds" in r.output


def test_the_heuristic_weighs_a_costlier_partition_that_frees_what_the_budget_needs():
    # GPT-2 small's width and vocabulary, 4 blocks, fake: at 20% of the peak the LM head + loss
    # over tokens is what must be partitioned; ranked by bytes per cost alone, each block's cheap
    # GELU chunks came first and left the sweep short (0.21 of the peak, over the budget).
    from taichi_plan.record import get_workload, record_workload

    trace = record_workload(get_workload(model="gpt2", layers=4, hidden=768, heads=12, seq=1024, batch=16),
                            fake=True, device_profile="v100-16gb", steps=1)
    problem = build_problem(trace)
    budget = int(0.2 * problem.baseline_peak[0])
    dec = plan_heuristic(problem, budget, time_limit=60)
    sim, _ = simulate_plan(problem, dec.drops, dec.partitions)
    assert sim.peak_bytes <= budget
    assert any(p.over == "tokens" for p in dec.partitions)
    assert sim.extra_pct < 25.0


def test_partition_savings_are_computed_once_per_problem(monkeypatch):
    """The floor and the ILP's partition options ask for the same modules' savings: each is
    computed once per problem (on a 46k-op GPT-2, computing them twice took the whole 30 s
    limit before CP-SAT could run)."""
    from taichi_plan.problem.partition import floor
    from taichi_plan.problem.partition.find import module_spans

    trace = partition_trace()
    p = build_problem(trace)
    calls = []
    real = floor.partitioned_live
    monkeypatch.setattr(floor, "partitioned_live", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    floor.floor_bytes(p)
    spans = module_spans(p)
    first = len(calls)
    assert first == sum(len(s.chunk_choices) for s in spans) > 0
    for s in spans:
        for k in s.chunk_choices:
            sav = floor.partition_savings(p, s, k)
            assert not sav.flags.writeable  # shared: no caller may change it
    assert len(calls) == first
    again = build_problem(trace)  # another problem computes its own
    floor.partition_savings(again, spans[0], spans[0].chunk_choices[0])
    assert len(calls) == first + 1


def test_a_warm_start_outside_the_plan_space_caps_the_bound():
    """DTR's evictions need not be the candidates' gaps: on this trace its plan (the ILP's warm
    start) drops a gap that is no candidate and costs 4.5 where the ILP's plan space cannot go
    below 5.5. The bound phase's MIP bound of that space was reported as the plan's bound, above
    the plan's own cost (make_plan's assertion; found by test_optimal_cost_never_drops_with_the_budget,
    seed 4917). The bound is now the lower of the space's and the plans found; the MIP itself
    is cut off at the incumbent's cost (bound.solve_mip), so its own bound is capped there too."""
    trace = random_training_trace(random.Random(4917))
    p = build_problem(trace)
    plan = solve(trace, int(p.baseline_peak[0] * 0.85), "ilp", time_limit=5, problem=p)
    stats = plan.solver["stats"]
    assert stats["warm_start"] == "dtr baseline" and stats["mip_bound"] <= plan.predicted["extra_compute"]
    cost = plan.predicted["extra_compute"]  # (the cut-off MIP's bound: the cost less its float safety margin)
    assert cost - 1e-5 * cost <= plan.solver["lower_bound"] <= cost and plan.solver["status"] == "optimal"


@pytest.mark.parametrize("seed", [4, 6, 13])
def test_progress_reports_only_plans_the_simulator_accepted(seed):
    # CP-SAT's solutions are candidates of the relaxation (their costs rounded down): the
    # progress line showed them as "best" even in a search that never found a plan.
    trace = random_training_trace(random.Random(seed), layers=8)
    p = build_problem(trace)
    seen = []
    plan = solve(trace, int(p.baseline_peak[0] * 0.6), "ilp", time_limit=5, problem=p, work_limit=5,
                 progress=lambda best, bound: seen.append((best, bound)))
    assert seen  # (the warm start's too: CP-SAT may find nothing cheaper to report)
    cost = plan.predicted["extra_compute"]
    for best, bound in seen:
        assert best is None or best >= cost, (best, cost)
        assert bound <= cost + 1e-9 and (best is None or bound <= best)


def test_the_warm_start_tries_the_plan_the_heuristic_finds_when_asked_for_less():
    # The greedy sweep is not monotone in its budget: on this trace, asked for 200 it peaks at
    # 216, asked for 204 (a step of the bisection that finds the least budget it reaches) at
    # 200. A timed-out solve suggests that least budget; asked for it, the warm start now fits.
    import time

    from taichi_plan.solve import _warm_start
    from taichi_plan.solve.reach import lowest_reachable

    # (the sweeps alone: the local search, which reaches this budget by itself, is off)
    sweeps = SolverConfig(heuristic=HeuristicConfig(local_max_s=0.0), time=TimeConfig(bisect_local_max_s=0.0))
    trace = random_training_trace(random.Random(97), layers=6)
    p = build_problem(trace)
    reach = lowest_reachable(p, config=sweeps)[0]
    dec = plan_heuristic(p, reach, config=sweeps.heuristic)
    assert simulate_plan(p, dec.drops, dec.partitions)[0].peak_bytes > reach  # (the sweep alone does not fit)
    best, name = _warm_start(build_problem(trace), reach, 0, time.perf_counter() + 30, config=sweeps)
    assert simulate_plan(p, best.drops, best.partitions)[0].peak_bytes <= reach, name
