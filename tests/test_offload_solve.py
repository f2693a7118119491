"""Our planners with offload allowed: they choose among keep, drop and offload, hold the host
budget, claim no bound they cannot prove, and leave everything as before without --offload."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_offload_sim import tiny

from taichi_plan.cli import main
from taichi_plan.plan.format import load_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.offload import Offload, OffloadConfig
from taichi_plan.solve import solve
from taichi_plan.trace.format import Trace, read_trace, write_trace


def _solve(prob, budget, method="heuristic", offload=None):
    return solve(prob.trace, budget, method, problem=prob, time_limit=10, optimizer="as-recorded", offload=offload)


@pytest.mark.parametrize("method", ["heuristic", "auto"])
def test_offload_replaces_a_costly_drop(method):
    # Unplanned peak 3204 B at op3 (A 1000 B live). At 2300 B, without offload a drop is
    # needed (its rebuild costs compute); on a 1000 B/s link A's copies hide behind compute
    # (test_offload_sim: no stall), so the plan offloads A and costs nothing.
    prob, a, _ = tiny()
    plain = _solve(prob, 2300, method)
    assert plain.recompute and plain.predicted["extra_compute"] > 0 and plain.offload is None
    plan = _solve(prob, 2300, method, OffloadConfig(1000.0))
    assert [o.tensor for o in plan.offloads] == [int(prob.tensor_id[a])] and not plan.recompute
    assert plan.predicted["planned_peak_bytes"] <= 2300 and plan.predicted["extra_compute"] == 0.0
    assert plan.predicted["host_peak_bytes"] == 1000 and plan.solver["status"] == "feasible"
    assert plan.solver["lower_bound"] is None  # the ILP does not model copies: no bound claimed


def test_a_checkpoint_on_the_host_beside_the_drop_that_reads_it():
    # A's rebuild costs 100 s; B's (relu of A) 1 s. At 2150 B the step must be rid of A and B
    # during op3 (x + C + T = 2104 B). Without offload both are dropped (101 s). With it, A is
    # offloaded and B dropped, its rebuild reading A, which comes back before B's recompute
    # group (test_offload_sim: copy-in [105, 106), no stall): 1 s. Before a rebuild could read
    # an offloaded tensor, the cheapest plan with offload was the drop-only one.
    prob, a, bb = tiny(a_s=100.0)
    plain = _solve(prob, 2150)
    assert sorted(r.tensor for r in plain.recompute) == sorted(int(prob.tensor_id[t]) for t in (a, bb))
    plan = _solve(prob, 2150, "heuristic", OffloadConfig(1000.0))
    assert [o.tensor for o in plan.offloads] == [int(prob.tensor_id[a])]
    assert [r.tensor for r in plan.recompute] == [int(prob.tensor_id[bb])]
    assert plan.predicted["planned_peak_bytes"] == 2104 and plan.predicted["extra_compute"] == 1.0
    assert "a rebuild reads it" in plan.offloads[0].why and plan.offloads[0].stall_s == 0.0


def test_stalls_count_and_a_slow_link_falls_back_to_drops():
    # 100 B/s: A's copy-out takes 10 s, longer than the 6 s from its last forward use to its
    # first backward one: it never leaves the device, so the planner drops instead.
    prob, a, _ = tiny()
    plan = _solve(prob, 2300, "heuristic", OffloadConfig(100.0))
    assert not plan.offloads and plan.recompute and plan.predicted["planned_peak_bytes"] <= 2300


def test_host_budget_binds():
    prob, _a, _ = tiny()
    plan = _solve(prob, 2300, "heuristic", OffloadConfig(1000.0, host_budget_bytes=999))
    assert not plan.offloads and plan.recompute  # A's 1000 B do not fit on the host
    assert plan.predicted["host_peak_bytes"] == 0


@pytest.fixture
def profiled(tmp_path):
    """The tiny trace on disk, as if recorded for the V100 profile (12 GB/s host link)."""
    prob, _a, _ = tiny()
    t = prob.trace
    trace = Trace(t.ops, t.tensors, t.accesses, {**t.meta, "device_profile": "v100-16gb"})
    return write_trace(trace, tmp_path / "traces" / "tiny")


def test_cli(profiled, tmp_path):
    out = tmp_path / "p.plan.json"
    r = CliRunner().invoke(main, ["solve", str(profiled), "--budget", "2300", "--offload", "--optimizer",
                                  "as-recorded", "--host-budget", "1KB", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "Offload    1 tensors offloaded" in r.output and "host link 12 GB/s" in r.output
    plan = load_plan(out)
    assert plan.offload == {"host_link_bytes_per_s": 12e9, "host_budget_bytes": 1000} and len(plan.offloads) == 1
    # Without --offload: the plan of before, no offload field at all.
    r = CliRunner().invoke(main, ["solve", str(profiled), "--budget", "2300", "--optimizer", "as-recorded",
                                  "-o", str(tmp_path / "q.plan.json")])
    assert r.exit_code == 0 and "Offload" not in r.output
    assert "offload" not in json.loads((tmp_path / "q.plan.json").read_text())["decisions"]


@pytest.mark.parametrize("args, message", [
    (["--host-budget", "1GB"], "only apply with --offload"),
    (["--offload", "--host-budget", "50%"], "not a percentage"),
    (["--offload", "--host-link", "0"], "must be above 0"),
])
def test_cli_refusals(profiled, tmp_path, args, message):
    r = CliRunner().invoke(main, ["solve", str(profiled), "--budget", "2300", *args, "-o", str(tmp_path / "x.json")])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x.json").exists()


def test_no_profile_needs_a_host_link(tmp_path):
    prob, _a, _ = tiny()
    path = write_trace(prob.trace, tmp_path / "traces" / "bare")
    r = CliRunner().invoke(main, ["solve", str(path), "--budget", "2300", "--offload", "-o", str(tmp_path / "x.json")])
    assert r.exit_code != 0 and "names no device profile" in " ".join(r.output.split())
    r = CliRunner().invoke(main, ["solve", str(path), "--budget", "2300", "--offload", "--host-link", "1e-6",
                                  "--optimizer", "as-recorded", "-o", str(tmp_path / "y.json")])
    assert r.exit_code == 0, r.output
    assert load_plan(tmp_path / "y.json").offload["host_link_bytes_per_s"] == pytest.approx(1000.0)
    assert build_problem(read_trace(path)).offload is None  # nothing of it stays on the trace


def test_copying_back_a_tensor_a_rebuild_reads_spares_re_making_its_inputs():
    """The planner's step that offloads where a drop-only plan peaks
    (offload_plan._offload_kept): a dropped tensor whose rebuild made its own dropped input
    live early is copied back instead, and that input is then rebuilt at its own use."""
    from synthetic import TraceBuilder

    from taichi_plan.problem.offload import allow_offload
    from taichi_plan.simulate.core import Drop, simulate
    from taichi_plan.solve.offload_plan import _offload_kept
    from taichi_plan.solve.result import Decisions

    # x (4 B) -> op0 A=mm(x) 1000 B -> op1 M=relu(A) 100 -> op2 B=gelu(M) 100 -> op3 T=exp(B)
    # 2000 -> op4 L | backward: op5 G=ones(L) 100 -> op6 GB=G*M 100 -> op7 P=exp(GB) 1500 ->
    # op8 Q=sum(P) 100 -> op9 GX=f(Q, A, M) 4. Every op 1 s.
    b = TraceBuilder()
    x = b.tensor(4, "input")
    (a,) = b.op("aten.mm.default", [x], [1000])
    (m,) = b.op("aten.relu.default", [a], [100])
    (bb,) = b.op("aten.gelu.default", [m], [100])
    (t,) = b.op("aten.exp.default", [bb], [2000], kind="temporary")
    (loss,) = b.op("aten.sum.default", [t], [4], kind="temporary")
    (g,) = b.op("aten.ones_like.default", [loss], [100], phase="backward", kind="temporary")
    (gb,) = b.op("aten.mul.Tensor", [g, m], [100], phase="backward", kind="temporary")
    (p,) = b.op("aten.exp.default", [gb], [1500], phase="backward", kind="temporary")
    (q,) = b.op("aten.sum.default", [p], [100], phase="backward", kind="temporary")
    b.op("aten.addmm.default", [q, a, m], [4], phase="backward", kind="temporary")
    prob = allow_offload(build_problem(b.build("chain")), OffloadConfig(1000.0))
    ai, mi = (int(prob.trace.tensors.index[prob.trace.tensors.tensor_id == k][0]) for k in (a, m))
    # Drop-only: A and M dropped; M's rebuild before op6 reads A, so A is rebuilt in that group
    # and held to op9: op7 = x + A + M + GB + P = 2704 B, the peak.
    base = Decisions(drops=[Drop(ai, 1, 9), Drop(mi, 2, 6)])
    sim = simulate(prob, base.drops)
    assert (sim.peak_bytes, sim.peak_op, sim.remat_at[ai]) == (2704, 7, 6)
    # M offloaded instead (its copy-out [3, 3.1) frees it after op3; back at op5 for op6): A is
    # rebuilt before op9 alone. op3 = x + M + B + T = 2204 B, op7 = x + M + GB + P = 1704 B.
    got = _offload_kept(prob, 2250, base, deadline=float("inf"))
    assert [o.tensor for o in got.offloads] == [mi] and [d.tensor for d in got.drops] == [ai]
    sim = simulate(prob, got.drops, got.offloads, 1000.0)
    assert (sim.peak_bytes, sim.peak_op, sim.remat_at[ai]) == (2204, 3, 9)
    assert sim.live_bytes[7] == 1704 and sim.extra_cost == 1.0  # A's rebuild only


def test_plans_whose_copies_back_replay_cannot_issue_are_left_out():
    """The simulator may time a copy back at a forward op (test_offload_sim's FIFO case: op4);
    replay issues copies back only at backward unpacks, so the planner keeps no such plan."""
    from taichi_plan.simulate.core import simulate
    from taichi_plan.solve.offload_plan import _replays

    prob, a, bb = tiny(big_b=True, backward_s=0.25)
    sim = simulate(prob, [], [Offload(a, 1, 7), Offload(bb, 2, 6)], host_link_bytes_per_s=1000.0)
    assert {tm.prefetch_at for tm in sim.offload.timings} == {4} and not _replays(prob, sim)
    prob, a, _ = tiny()
    sim = simulate(prob, [], [Offload(a, 1, 7)], host_link_bytes_per_s=1000.0)
    assert sim.offload.timings[0].prefetch_at == 6 and _replays(prob, sim)  # B's last unpack, op6
