"""The verdict in reserved bytes: every plan carries the allocator model's reserved peak, and
`solve --on reserved` meets a budget stated on it (docs/allocator.md)."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from synthetic import chain_trace, random_training_trace

from taichi_plan.base.errors import InfeasibleBudgetError, PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import FORMAT_VERSION, load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.solve import solve
from taichi_plan.trace.format import write_trace

MIB = 1 << 20


def big_chain():
    """8 layers of 31 MiB activations and 15 MiB temporaries: each its own segment, rounded up
    to 32 and 16 MiB, and cached segments outlive what they held."""
    return chain_trace([31 * MIB + 5] * 8, temp_bytes=15 * MIB, param_bytes=600_000)


def test_every_plan_predicts_reserved_at_least_allocated():
    solved = 0
    for seed in range(12):
        trace = random_training_trace(random.Random(seed))
        problem = build_problem(trace)
        try:
            plan = solve(trace, int(problem.baseline_peak[0] * 0.8), "heuristic", problem=problem)
        except InfeasibleBudgetError:
            continue
        solved += 1
        p = plan.predicted
        assert p["planned_reserved_peak_bytes"] >= p["allocator"]["planned_allocated_peak_bytes"] >= p["planned_peak_bytes"]
        assert p["baseline_reserved_peak_bytes"] >= p["baseline_peak_bytes"]
        assert p["planned_reserved_peak_bytes"] == 2 * MIB  # small tensors: one small-pool segment
    assert solved >= 4


def test_a_plan_meeting_the_allocated_budget_breaks_it_in_reserved_bytes_and_on_reserved_fixes_it():
    trace = big_chain()
    problem = build_problem(trace)
    budget = int(problem.baseline_peak[0] * 0.9)
    plan = solve(trace, budget, "heuristic", problem=problem)
    assert plan.predicted["planned_peak_bytes"] <= budget < plan.predicted["planned_reserved_peak_bytes"]
    fixed = solve(trace, budget, "heuristic", problem=problem, on="reserved")
    assert fixed.predicted["planned_reserved_peak_bytes"] <= budget
    assert fixed.budget_bytes == budget
    assert fixed.solver["budget_on"] == "reserved"
    rounds = fixed.solver["stats"]["reserved_rounds"]
    assert rounds[0]["allocated_target_bytes"] == budget and rounds[-1]["allocated_target_bytes"] < budget
    assert fixed.solver["lower_bound"] is None  # a bound for a lower allocated target is no bound here


def test_solve_on_reserved_cli(tmp_path):
    write_trace(big_chain(), tmp_path / "big")
    runner = CliRunner()
    out = tmp_path / "p.plan.json"
    r = runner.invoke(main, ["solve", str(tmp_path / "big"), "--budget", "90%", "--method", "heuristic",
                             "-o", str(out)])
    assert r.exit_code == 0, r.output
    plain = json.loads(out.read_text())
    assert plain["format_version"] == FORMAT_VERSION
    assert plain["predicted"]["planned_reserved_peak_bytes"] > plain["budget_bytes"]
    r = runner.invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "on allocated bytes" in r.output and "over the budget" in r.output
    r = runner.invoke(main, ["solve", str(tmp_path / "big"), "--budget", "90%", "--method", "heuristic",
                             "--on", "reserved", "-o", str(out), "--force"])
    assert r.exit_code == 0, r.output
    assert "budget on reserved bytes" in r.output
    plan = json.loads(out.read_text())
    assert plan["budget_bytes"] == plain["budget_bytes"]
    assert plan["predicted"]["planned_reserved_peak_bytes"] <= plan["budget_bytes"]
    r = runner.invoke(main, ["inspect", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rs = json.loads(r.output)["reserved_peak"]
    assert rs["budget_on"] == "reserved" and rs["fits_budget"] is True
    assert rs["planned_nbytes"] == plan["predicted"]["planned_reserved_peak_bytes"]
    html = tmp_path / "p.html"
    r = runner.invoke(main, ["inspect", str(out), "--html", str(html)])
    assert r.exit_code == 0, r.output
    assert "Reserved peak" in html.read_text() and "budget on reserved bytes" in html.read_text()


def test_on_reserved_says_clearly_when_nothing_fits(tmp_path):
    trace = chain_trace([6 * MIB] * 8, temp_bytes=3 * MIB, param_bytes=600_000)
    problem = build_problem(trace)
    budget = int(problem.baseline_peak[0] * 0.8)
    with pytest.raises(InfeasibleBudgetError, match="No heuristic plan keeps the predicted reserved peak within") as e:
        solve(trace, budget, "heuristic", problem=problem, on="reserved")
    assert e.value.min_budget_bytes > budget
    assert "expandable_segments" in str(e.value) and "No plan file was written" in str(e.value)
    write_trace(trace, tmp_path / "t")
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "t"), "--budget", "80%", "--method", "heuristic",
                                  "--on", "reserved", "-o", str(tmp_path / "p.plan.json")])
    assert r.exit_code == 5 and not (tmp_path / "p.plan.json").exists()


def test_older_plans_are_read_and_say_they_have_no_reserved_peak(tmp_path):
    write_trace(big_chain(), tmp_path / "big")
    out = tmp_path / "p.plan.json"
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "big"), "--budget", "90%", "--method", "heuristic",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    obj = json.loads(out.read_text())
    for key in ("planned_reserved_peak_bytes", "baseline_reserved_peak_bytes", "allocator"):
        del obj["predicted"][key]
    obj["format_version"] = 3
    out.write_text(json.dumps(obj))
    with pytest.raises(PlanError, match="reserved_peak_bytes"):
        load_plan(out)  # v3 must carry them
    obj["format_version"] = 2
    out.write_text(json.dumps(obj))
    assert load_plan(out).format_version == 2
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "not predicted (plan format v2" in r.output
    again = save_plan(load_plan(out), tmp_path / "again.plan.json")  # saved again: still v2, still readable
    assert json.loads(again.read_text())["format_version"] == 2 and load_plan(again).format_version == 2


def test_allocator_settings_parse_and_reach_the_plan(tmp_path, monkeypatch):
    from taichi_plan.simulate.allocator import AllocatorConfig, replay_schedule

    assert AllocatorConfig.parse("expandable_segments:True") == AllocatorConfig(expandable_segments=True)
    assert AllocatorConfig.parse(" max_split_size_mb:128 ").max_split_size_bytes == 128 * MIB
    assert AllocatorConfig.parse("") == AllocatorConfig()
    with pytest.raises(ValueError, match="does not follow"):
        AllocatorConfig.parse("garbage_collection_threshold:0.6")
    assert AllocatorConfig.parse("garbage_collection_threshold:0.6,expandable_segments:True",
                                 strict=False).expandable_segments
    trace = big_chain()
    problem = build_problem(trace)
    cfg = AllocatorConfig(expandable_segments=True)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.9), "heuristic", problem=problem, allocator=cfg)
    assert plan.predicted["allocator"]["expandable_segments"] is True
    assert plan.predicted["planned_reserved_peak_bytes"] == replay_schedule(plan.schedule, cfg).reserved_peak_bytes
    write_trace(trace, tmp_path / "big")
    out = tmp_path / "p.plan.json"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,garbage_collection_threshold:0.6")
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "big"), "--budget", "90%", "--method", "heuristic",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["predicted"]["allocator"]["expandable_segments"] is True
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "big"), "--budget", "90%", "--alloc-conf", "nonsense",
                                  "-o", str(out), "--force"])
    assert r.exit_code == 2 and "--alloc-conf" in r.output
