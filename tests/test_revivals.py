"""Revivals on forward-only imported graphs (simulate.py): a dead tensor kept past its last op,
or rebuilt once ahead of the groups that read it, and held for all of them.

A hand-built graph whose only plan at its budget keeps a dead tensor: the peak and the cost
are checked against numbers worked out by hand, the schedule's peak against the simulator's,
and the planners must find that plan. Recorded steps refuse revivals (replay rebuilds a
recorded tensor once, when backward unpacks it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from synthetic import TraceBuilder

from taichi_plan.base.errors import PlanError
from taichi_plan.plan.format import peak_from_schedule
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.options import options, revival_options
from taichi_plan.simulate.core import Drop, build_schedule, simulate
from taichi_plan.solve import solve

GRAPHS = Path(os.environ.get("TAICHI_GRAPHS_DIR") or Path(__file__).resolve().parents[2] / "shared" / "graphs")


def chain_graph(imported: bool = True):
    """x -> a (100 B, cost 5) -> b (10 B, cost 5) -> c (50 B, cost 1) -> d (50 B) -> e (200 B),
    then f = m(c, e): c has one gap (after op 3, back before op 5) over the peak at op 4; its
    rebuild reads b, dead since op 2, whose own rebuild reads a, dead since op 1."""
    tb = TraceBuilder()
    x = tb.tensor(8, "input")
    (a,) = tb.op("f", [x], [100], cost=5.0)
    (b,) = tb.op("g", [a], [10], cost=5.0)
    (c,) = tb.op("h", [b], [50], cost=1.0)
    (d,) = tb.op("k", [c], [50], cost=1.0)
    (e,) = tb.op("p", [d], [200], cost=1.0)
    (f,) = tb.op("m", [c, e], [10], cost=1.0)
    tb.op("q", [f], [4], cost=1.0)
    trace = tb.build()
    if imported:
        trace.meta["mode"] = "imported"
    return trace, {"a": a, "b": b, "c": c}


def test_keeping_a_dead_tensor_replaces_its_transient_chain():
    trace, t = chain_graph()
    p = build_problem(trace)
    assert p.every_gap and p.baseline_peak == (308, 4)  # x + c + d + e at op 4
    a, b, c = (p.index_of(t[k]) for k in "abc")
    drop_c = Drop(c, 3, 5)
    # c alone: the group before op 5 carries x + e (208) and re-makes a (100), b (10), c (50):
    # 318 after b, a freed after its reader; cost 5 + 5 + 1.
    alone = simulate(p, [drop_c])
    assert (alone.peak_bytes, alone.peak_in_recompute, alone.extra_cost) == (318, True, 11.0)
    # b kept past its last op (op 2) until the group that reads it: 10 bytes more from op 3 on,
    # nothing re-made but c. Peak: op 4 (308 - 50 + 10) and op 5 (x + c + e + f), cost 1.
    kept = simulate(p, [drop_c, Drop(b, 2, 3)])
    assert (kept.peak_bytes, kept.extra_cost, kept.revived) == (268, 1.0, {b: (3, 4)})
    assert list(kept.live_bytes) == [108, 118, 68, 118, 268, 268, 22]
    assert kept.groups[5].peak_bytes == 268  # x + e + b carried (218), then c made (268), b freed
    # b rebuilt before op 4 instead: a re-made as a transient there; b held into the group at op 5.
    rebuilt = simulate(p, [drop_c, Drop(b, 2, 4)])
    assert (rebuilt.extra_cost, rebuilt.revived, rebuilt.transients) == (11.0, {b: (4, 4)}, {4: {a}})
    # b rebuilt in the group that reads it: a transient, as without the revival.
    same = simulate(p, [drop_c, Drop(b, 2, 5)])
    assert (same.peak_bytes, same.extra_cost) == (alone.peak_bytes, alone.extra_cost)
    # A keep nobody reads changes nothing.
    idle = simulate(p, [Drop(b, 2, 3)])
    assert idle.peak_bytes == p.baseline_peak[0] and idle.extra_cost == 0.0
    for drops in ([drop_c], [drop_c, Drop(b, 2, 3)], [drop_c, Drop(b, 2, 4)], [Drop(b, 2, 3)]):
        assert peak_from_schedule(build_schedule(p, drops))[0] == simulate(p, drops).peak_bytes


def test_revivals_are_options_of_forward_only_graphs_only():
    trace, t = chain_graph()
    p = build_problem(trace)
    r = revival_options(p)
    b = p.index_of(t["b"])
    assert (b, 3) in set(zip(r.tensor.tolist(), r.remat_before.tolist(), strict=True))
    assert set(r.cand.tolist()).isdisjoint(options(p).cand.tolist())
    with pytest.raises(PlanError, match="twice"):
        simulate(p, [Drop(b, 2, 3), Drop(b, 2, 4)])
    recorded, t = chain_graph(imported=False)
    q = build_problem(recorded)
    assert len(revival_options(q)) == 0
    with pytest.raises(PlanError):
        simulate(q, [Drop(q.index_of(t["b"]), 2, 3)])


@pytest.mark.parametrize("method", ["auto", "ilp", "heuristic"])
def test_planners_find_the_plan_that_needs_a_keep(method):
    trace, t = chain_graph()
    plan = solve(trace, 300, method, time_limit=60.0, work_limit=10.0)
    assert plan.predicted["planned_peak_bytes"] <= 300
    assert plan.predicted["extra_compute"] == 1.0
    kept = [r for r in plan.recompute if r.tensor == t["b"]]
    assert kept and kept[0].free_after == 2 and "kept" in kept[0].why
    if method != "heuristic":
        assert plan.solver["status"] == "optimal"


@pytest.mark.skipif(not (GRAPHS / "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json").exists(),
                    reason="needs ../shared/graphs")
@pytest.mark.parametrize(("fraction", "moccasin"), [(0.9, 1.0079), (0.8, 1.0230)])
def test_local_search_meets_moccasin_on_random_layered_n100(fraction, moccasin):
    """Moccasin's optimum (ICML 2023, C=2), as measured for issue 11; no deadline, so the
    result does not depend on the machine's load."""
    from taichi_plan.solve.local import local_search
    from taichi_plan.trace.import_graph import import_graph

    p = build_problem(import_graph(GRAPHS / "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json"))
    budget = int(p.baseline_peak[0] * fraction)
    drops, sim = local_search(p, options(p), budget)
    assert sim.peak_bytes <= budget
    assert 1 + sim.extra_cost / p.step_cost <= moccasin


def test_the_schedule_holds_the_simulators_peak_on_every_plan_with_revivals():
    """Every executable plan (revivals included) of small random forward-only graphs: the
    schedule's own peak (what an outside checker recomputes) is the simulator's."""
    import itertools
    import math
    import random

    from synthetic import random_training_trace

    checked = 0
    for seed in range(40):
        trace = random_training_trace(random.Random(seed))
        trace.meta["mode"] = "imported"
        trace.ops["phase"] = "forward"
        p = build_problem(trace)
        o, r = options(p), revival_options(p)
        per: dict[int, list[Drop]] = {}
        for opts in (o, r):
            for k in range(len(opts)):
                per.setdefault(int(opts.cand[k]), []).append(
                    Drop(int(opts.tensor[k]), int(opts.free_after[k]), int(opts.remat_before[k])))
        if not any(c >= len(p.candidates) for c in per) or math.prod(1 + len(v) for v in per.values()) > 600:
            continue
        for combo in itertools.product(*[[None, *v] for v in per.values()]):
            drops = [d for d in combo if d is not None]
            try:
                sim = simulate(p, drops)
            except PlanError:
                continue
            assert peak_from_schedule(build_schedule(p, drops))[0] == sim.peak_bytes, (seed, drops)
            checked += 1
    assert checked >= 300, checked
