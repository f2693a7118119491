"""The HTML report: its embedded JSON agrees with the plan and the simulator, it loads
nothing from the network, long traces are downsampled without losing a peak, and the CLI
refuses to overwrite a report without --force."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.base.errors import InfeasibleBudgetError, OutputExistsError, UsageError
from taichi_plan.cli import main
from taichi_plan.plan.format import load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.report.html import TIMELINE_POINTS, read_plan_data, write_plan_html
from taichi_plan.report.plan_text import inspect_plan
from taichi_plan.simulate.core import simulate
from taichi_plan.solve import solve
from taichi_plan.solve.result import drops_from_plan
from taichi_plan.trace.format import baseline_live_bytes, read_trace, write_trace


def _solved(tmp_path, trace, frac: float = 0.7, name: str = "t"):
    """Write ``trace`` under tmp_path, solve it with the heuristic at ``frac`` of its baseline
    peak (a little higher if that cannot be reached: the report is under test) and save the
    plan. Returns (trace as read back, problem, plan, plan path)."""
    (tmp_path / "traces").mkdir(exist_ok=True)
    trace = read_trace(write_trace(trace, tmp_path / "traces" / name))
    problem = build_problem(trace)
    for f in (frac, frac + 0.1, frac + 0.2):
        try:
            plan = solve(trace, int(problem.baseline_peak[0] * f), "heuristic", problem=problem)
            break
        except InfeasibleBudgetError:
            continue
    else:
        pytest.fail(f"no plan for {name} at {frac:.0%}..{frac + 0.2:.0%} of its baseline peak")
    return trace, problem, plan, save_plan(plan, tmp_path / f"{name}.plan.json")


@pytest.fixture
def chain(tmp_path):
    trace = chain_trace([1000, 1200, 800, 1000, 1500, 900, 1000, 1100], temp_bytes=200)
    return _solved(tmp_path, trace, name="chain")


def _page(ppath, out, **kw) -> tuple[str, dict]:
    write_plan_html(ppath, out, **kw)
    page = out.read_text(encoding="utf-8")
    return page, read_plan_data(page)


def test_blob_matches_plan(chain, tmp_path):
    trace, problem, plan, ppath = chain
    assert plan.recompute, "the 70% budget should need some recomputation"
    page, data = _page(ppath, tmp_path / "r.html")
    s = data["summary"]
    assert s == json.loads(inspect_plan(ppath, as_json=True))  # the same facts as inspect --json
    assert s["budget_bytes"] == plan.budget_bytes
    assert s["baseline_peak"]["nbytes"] == plan.predicted["baseline_peak_bytes"]
    assert s["planned_peak"]["nbytes"] == plan.predicted["planned_peak_bytes"]
    assert s["planned_peak"]["op_id"] == plan.predicted["planned_peak_op"]
    assert s["extra_compute"]["cost"] == plan.predicted["extra_compute"]
    assert s["extra_compute"]["pct_of_step"] == plan.predicted["extra_compute_pct"]
    assert s["solver"]["status"] == plan.solver["status"]
    assert s["partitions"] == [{"module": p.module, "dim": p.dim, "chunks": p.chunks, "over": p.over, "why": p.why}
                               for p in plan.partitions]
    assert data["solver_stats"] == (plan.solver.get("stats") or {})

    cols = data["decisions"]["columns"]
    rows = [dict(zip(cols, r)) for r in data["decisions"]["rows"]]
    assert len(rows) == len(plan.recompute)
    sim = simulate(problem, drops_from_plan(problem, plan))
    for row, r in zip(rows, plan.recompute):
        assert (row["tensor"], row["op"], row["op_name"], row["module"], row["nbytes"], row["free_after"],
                row["remat_before"], row["why"]) == (r.tensor, r.op, r.op_name, r.module, r.nbytes,
                                                     r.free_after, r.remat_before, r.why)
        assert row["why"]
        assert row["rebuilt_before"] == sim.remat_at[problem.index_of(r.tensor)]
        assert r.free_after < row["rebuilt_before"] <= r.remat_before

    # The static header shows the key numbers without the script.
    header = page.split("<noscript>")[0]
    for text in ("Budget", "Baseline peak", "Planned peak", "Extra compute", plan.solver["method"],
                 f"{plan.budget_bytes:,} bytes", f"{plan.predicted['extra_compute_pct']:.2f}%"):
        assert text in header, text
    assert not list(tmp_path.glob(".r.html.*"))  # written atomically, no temp file left


def test_timeline_points_are_simulator_bytes(chain, tmp_path):
    trace, problem, plan, ppath = chain
    _, data = _page(ppath, tmp_path / "r.html")
    t = data["timeline"]
    sim = simulate(problem, drops_from_plan(problem, plan))
    base = baseline_live_bytes(trace)
    assert t["num_ops"] == problem.num_ops <= TIMELINE_POINTS and t["bucket_ops"] == 1
    p = t["planned"]
    assert p["op"] == list(range(problem.num_ops))  # short traces are not downsampled
    for j, op in enumerate(p["op"]):
        assert sum(p["by_kind"][k][j] for k in t["kinds"]) == p["live"][j] == sim.live_bytes[op]
        assert p["op_name"][j] == problem.op_name[op] and p["module"][j] == problem.op_module[op]
        assert p["phase"][j] == problem.op_phase[op]
    assert t["baseline"]["live"] == base[t["baseline"]["op"]].tolist()
    assert t["budget_bytes"] == plan.budget_bytes
    assert t["planned_peak"]["nbytes"] == plan.predicted["planned_peak_bytes"]
    assert t["baseline_peak"]["nbytes"] == plan.predicted["baseline_peak_bytes"] == max(t["baseline"]["live"])
    assert t["groups"]["count"] == len(sim.groups)
    gcols = t["groups"]["columns"]
    assert [dict(zip(gcols, g))["before_op"] for g in t["groups"]["rows"]] == sorted(sim.groups)
    spans = t["phase_spans"]
    assert spans[0][1] == 0 and spans[-1][2] == problem.num_ops - 1
    assert all(a[2] + 1 == b[1] for a, b in zip(spans, spans[1:]))


def test_self_contained(chain, tmp_path):
    _, _, _, ppath = chain
    page, _ = _page(ppath, tmp_path / "r.html")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert not re.search(r"<link\b|@import|url\(", page, re.I)
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I)
    assert page.count("<script") == 2  # the JSON blob and the inline script
    if shutil.which("node"):  # the inline script at least parses
        script = page.rsplit("<script>", 1)[1].split("</script>", 1)[0]
        js = tmp_path / "page.js"
        js.write_text(script)
        res = subprocess.run(["node", "--check", str(js)], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


def test_markup_in_names_is_escaped(chain, tmp_path):
    """A module name with markup in it cannot end the JSON blob or inject a script."""
    _, _, plan, _ = chain
    evil = "</script><script>alert(1)</script><b>&"
    plan.recompute[0].module = evil
    plan.trace["name"] = evil
    ppath = save_plan(plan, tmp_path / "evil.plan.json")
    page, data = _page(ppath, tmp_path / "evil.html")
    assert "<script>alert" not in page and "<b>&" not in page
    assert data["decisions"]["rows"][0][data["decisions"]["columns"].index("module")] == evil
    assert data["summary"]["trace"]["name"] == evil


def test_cli_html_written_and_refused_without_force(chain, tmp_path):
    trace, _, _, ppath = chain
    out = tmp_path / "report.html"
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", str(ppath), "--html", str(out)])
    assert res.exit_code == 0, res.output
    assert "Recompute decisions" in res.output and f"Wrote {out}" in res.output
    before = out.read_bytes()
    assert read_plan_data(before.decode())["summary"]["plan_path"] == str(ppath)

    res = runner.invoke(main, ["inspect", str(ppath), "--html", str(out)])
    assert res.exit_code == OutputExistsError.exit_code != 0
    assert "--force" in res.output and "Recompute decisions" not in res.output
    assert out.read_bytes() == before

    res = runner.invoke(main, ["inspect", str(ppath), "--html", str(out), "--force", "--json", "--units", "GiB"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["html"] == str(out)
    page = out.read_text()
    assert read_plan_data(page)["report"]["units"] == "GiB" and " GiB" in page.split("<noscript>")[0]

    res = runner.invoke(main, ["inspect", str(ppath), "--html", str(tmp_path / "nodir" / "r.html")])
    assert res.exit_code == 0 and (tmp_path / "nodir" / "r.html").is_file()  # missing directory created

    res = runner.invoke(main, ["inspect", str(trace.path), "--html", str(tmp_path / "t.html")])
    assert res.exit_code == UsageError.exit_code and "not a plan file" in " ".join(res.output.split())
    assert not (tmp_path / "t.html").exists()


def test_missing_trace_still_renders(chain, tmp_path):
    trace, _, plan, ppath = chain
    shutil.rmtree(trace.path)
    out = tmp_path / "r.html"
    res = CliRunner().invoke(main, ["inspect", str(ppath), "--html", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    data = read_plan_data(page)
    assert data["timeline"] is None and data["summary"]["modules"] is None
    assert data["summary"]["trace"]["state"] == "missing"
    assert [r[0] for r in data["decisions"]["rows"]] == [r.tensor for r in plan.recompute]
    assert all(r[-1] is None for r in data["decisions"]["rows"])  # no simulator: rebuilt_before unknown
    assert "No timeline" in page and f"trace not found at {trace.path}" in page


def test_long_trace_downsampled(tmp_path):
    """~9k ops: at most TIMELINE_POINTS points, each the largest of its bucket, so the peaks
    survive; the file stays small."""
    trace, problem, plan, ppath = _solved(tmp_path, chain_trace([64] * 3000), frac=0.7, name="long")
    n = problem.num_ops
    assert n > 4 * TIMELINE_POINTS
    out = tmp_path / "long.html"
    _, data = _page(ppath, out)
    t = data["timeline"]
    size = t["bucket_ops"]
    assert t["downsampled"] and size == -(-n // TIMELINE_POINTS)
    sim = simulate(problem, drops_from_plan(problem, plan))
    live = np.asarray(sim.live_bytes)
    base = baseline_live_bytes(trace)
    for series, values in ((t["planned"], live), (t["baseline"], base)):
        ops = series["op"]
        assert len(ops) <= TIMELINE_POINTS and len(ops) == -(-n // size)
        for j, op in enumerate(ops):  # the bucket's own maximum, at an op inside it
            assert j * size <= op < (j + 1) * size
            assert series["live"][j] == values[op] == values[j * size:(j + 1) * size].max()
        assert max(series["live"]) == values.max()
    p = t["planned"]
    for j in range(0, len(p["op"]), 97):
        assert sum(p["by_kind"][k][j] for k in t["kinds"]) == p["live"][j]
    assert max(t["baseline"]["live"]) == plan.predicted["baseline_peak_bytes"]
    assert len(data["decisions"]["rows"]) == len(plan.recompute)
    assert out.stat().st_size < 1_500_000
    assert load_plan(ppath).predicted == plan.predicted
