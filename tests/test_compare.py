"""compare: every planner at each budget, rows equal to solving each alone; the table, the
JSON, the Pareto PNG and the CLI's errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.base.errors import BudgetError, InfeasibleBudgetError, UsageError
from taichi_plan.cli import main
from taichi_plan.explore.compare import compare, parse_sweep, render_compare
from taichi_plan.problem.core import build_problem
from taichi_plan.report.pareto import pareto_data
from taichi_plan.solve import methods, solve
from taichi_plan.solve.messages import OURS
from taichi_plan.trace.format import baseline_peak, write_trace

FRACTIONS = (0.9, 0.8, 0.68)


def tiny():
    """An 8-layer chain (34 ops, peak 1,130 B): auto and ilp reach 752 B, the heuristic 784 B."""
    return chain_trace([100, 120, 80, 100, 60, 100, 90, 110], costs=[1, 2, 1, 3, 1, 2, 1, 2], temp_bytes=50)


@pytest.fixture(scope="module")
def rows():
    trace = tiny()
    peak = baseline_peak(trace)[0]
    return compare(trace, [int(peak * f) for f in FRACTIONS], time_limit=10, seed=0)


def test_rows_equal_solving_each_planner_alone(rows):
    trace = tiny()
    assert len(rows) == len(FRACTIONS) * len(methods())
    assert {r["method"] for r in rows} == set(methods())
    for r in rows:
        try:
            plan = solve(trace, r["budget_bytes"], r["method"], time_limit=10, seed=0)
        except InfeasibleBudgetError as e:
            assert not r["feasible"] and r["status"] == "infeasible" and r["error"] == str(e)
            assert r["extra_pct"] is None and r["gap"] is None
            continue
        assert r["feasible"], r
        assert r["peak_bytes"] == plan.predicted["planned_peak_bytes"] <= r["budget_bytes"]
        assert r["extra_compute"] == plan.predicted["extra_compute"]
        assert r["extra_pct"] == plan.predicted["extra_compute_pct"]
        assert r["status"] == plan.solver["status"]
        assert r["lower_bound"] == plan.solver["lower_bound"]


def test_some_budgets_bind_and_auto_fits(rows):
    # auto plans the chain at every budget; the heuristic and some baselines miss the tightest.
    assert all(r["feasible"] for r in rows if r["method"] in ("auto", "ilp"))
    assert not next(r for r in rows if r["method"] == "heuristic" and r["budget_fraction"] < 0.7)["feasible"]
    assert any(not r["feasible"] for r in rows if not r["ours"])
    assert any(r["extra_compute"] for r in rows if r["feasible"])


def test_gap_is_to_our_best_bound(rows):
    for f in FRACTIONS:
        group = [r for r in rows if abs(r["budget_fraction"] - f) < 0.01]
        bounds = [r["lower_bound"] for r in group if r["method"] in OURS and r["lower_bound"] is not None]
        best = max(bounds)
        for r in group:
            assert r["our_bound"] == best
            if r["feasible"]:
                expect = 0.0 if r["extra_compute"] <= 1e-12 else (r["extra_compute"] - best) / r["extra_compute"]
                assert r["gap"] == pytest.approx(expect)
        auto = next(r for r in group if r["method"] == "auto")
        assert auto["gap"] == pytest.approx(0.0, abs=1e-3)  # proven optimal on this tiny trace


def test_infeasible_row_keeps_the_peak_it_reached(rows):
    for r in rows:
        if not r["feasible"]:
            assert r["peak_bytes"] is None or r["peak_bytes"] > r["budget_bytes"]
            if r["method"] not in OURS:
                assert r["peak_bytes"] is not None and r["peak_source"] == "reached"


def test_render_fits_80_columns(rows):
    trace = tiny()
    text = render_compare(rows, trace, build_problem(trace))
    assert all(len(line) <= 80 for line in text.splitlines())
    assert text.count(" no ") >= sum(not r["feasible"] for r in rows)
    assert "selective-mm" in text and "auto*" in text


def test_pareto_data_omits_infeasible_points(rows):
    data = pareto_data(rows)
    n_feasible = sum(r["feasible"] for r in rows)
    assert sum(len(s["x"]) for s in data["series"]) == n_feasible
    assert len(data["omitted"]) == len(rows) - n_feasible
    for s in data["series"]:
        assert s["x"] == sorted(s["x"])
    b = pareto_data(rows, x="bytes", units="MB")
    assert "MB" in b["x_label"]


def test_restricted_methods_and_progress():
    trace = tiny()
    calls = []
    rows = compare(trace, [int(baseline_peak(trace)[0] * 0.8)], ["sqrt-n", "heuristic"], time_limit=5,
                   progress=lambda done, total, label: calls.append((done, total)))
    assert [r["method"] for r in rows] == ["heuristic", "sqrt-n"]  # methods() order
    assert calls[0] == (0, 2) and calls[-1] == (2, 2)
    with pytest.raises(UsageError):
        compare(trace, [100], ["magic"])
    with pytest.raises(UsageError):
        compare(trace, [], None)
    no_ours = compare(trace, [int(baseline_peak(trace)[0] * 0.8)], ["dtr"], time_limit=5)
    assert no_ours[0]["our_bound"] is None and no_ours[0]["gap"] is None


@pytest.mark.parametrize("text", ["0", "1.5", "-0.2", "abc", "0.9,0.9", "0.8,,0.3"])
def test_bad_sweeps(text):
    with pytest.raises(BudgetError):
        parse_sweep(text)
    assert parse_sweep("0.9, 0.5,1") == [0.9, 0.5, 1.0]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def trace_dir(tmp_path):
    return write_trace(tiny(), tmp_path / "tiny")


def test_cli_sweep_table_json_and_png(trace_dir, tmp_path):
    png = tmp_path / "pareto.png"
    args = ["compare", str(trace_dir), "--sweep", "0.9,0.6", "--methods", "heuristic,sqrt-n,dtr",
            "--time-limit", "5"]
    r = CliRunner().invoke(main, [*args, "--png", str(png)])
    assert r.exit_code == 0, r.output
    assert "heuristic*" in r.output and f"Wrote {png}" in r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(main, [*args, "--png", str(png)])
    assert r.exit_code == 8 and "--force" in r.output
    r = CliRunner().invoke(main, [*args, "--png", str(png), "--force", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert len(data["rows"]) == 6 and data["baseline_peak_bytes"] == baseline_peak(tiny())[0]
    r = CliRunner().invoke(main, [*args, "--png", str(tmp_path / "new" / "p.png")])
    assert r.exit_code == 0, r.output  # a missing directory is created, as for every output
    assert (tmp_path / "new" / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_one_budget_in_bytes(trace_dir, tmp_path):
    png = tmp_path / "b.png"
    r = CliRunner().invoke(main, ["compare", str(trace_dir), "--budget", "1KB", "-m", "none,full",
                                  "--png", str(png)])
    assert r.exit_code == 0, r.output
    assert "none" in r.output and png.exists()


@pytest.mark.parametrize("args,code", [
    (["--sweep", "0,0.5"], 4),
    (["--sweep", "1.2"], 4),
    (["--budget", "150%"], 4),
    (["--budget", "abc"], 4),
    ([], 2),
    (["--budget", "50%", "--sweep", "0.5"], 2),
    (["--budget", "50%", "--methods", "auto,magic"], 2),
])
def test_cli_bad_input(trace_dir, args, code):
    r = CliRunner().invoke(main, ["compare", str(trace_dir), *args])
    assert r.exit_code == code, r.output
    assert r.output.startswith("Error:")


def _row(method, frac, extra, feasible=True):
    return {"method": method, "ours": method in OURS, "budget_fraction": frac, "budget_bytes": int(1000 * frac),
            "feasible": feasible, "extra_pct": extra if feasible else None}


def test_pareto_marks_where_a_baseline_equals_ours(tmp_path):
    """As on GPT-2 small: dtr finds the same plans as ours at 90/80/60%, differs at 40%; ilp
    agrees with auto everywhere; sqrt-n never matches."""
    from taichi_plan.report.pareto import write_pareto_png

    fracs = [0.9, 0.8, 0.6, 0.4]
    rows = ([_row("auto", f, e) for f, e in zip(fracs, [1.0, 2.5, 7.0, 20.0])]
            + [_row("ilp", f, e) for f, e in zip(fracs, [1.0, 2.5, 7.0, 20.0])]
            + [_row("dtr", f, e) for f, e in zip(fracs, [1.0, 2.5, 7.0, 31.0])]
            + [_row("sqrt-n", f, e) for f, e in zip(fracs, [33.0, 33.0, 33.0, 33.0])]
            + [_row("full", 0.4, None, feasible=False)])
    data = pareto_data(rows)
    shared = {(round(g["x"]), tuple(g["methods"])) for g in data["coincident"]}
    assert shared == {(90, ("auto", "ilp", "dtr")), (80, ("auto", "ilp", "dtr")), (60, ("auto", "ilp", "dtr")),
                      (40, ("auto", "ilp"))}
    assert data["notes"] == ["ours (auto, ilp) = dtr at 90%, 80%, 60%"]
    by_bytes = pareto_data(rows, x="bytes", units="KB")
    assert by_bytes["notes"] == ["ours (auto, ilp) = dtr at 0.9 KB, 0.8 KB, 0.6 KB"]
    no_dtr = pareto_data([r for r in rows if r["method"] != "dtr"])
    assert no_dtr["notes"] == [] and len(no_dtr["coincident"]) == 4
    png = write_pareto_png(rows, tmp_path / "p.png", title="gpt2")
    assert png.read_bytes().startswith(b"\x89PNG")
