"""inspect on a plan: the summary, the JSON, the timeline data and the PNG agree with the
plan and the simulator; a missing trace or a malformed plan is handled clearly."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import graph_files
from synthetic import chain_trace, random_training_trace

from taichi_plan.base.errors import InfeasibleBudgetError, OutputExistsError, PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.report.plan_text import inspect_plan, plan_summary, render_plan_summary
from taichi_plan.report.timeline import MAX_POINTS, downsample, timeline_data, write_timeline_png
from taichi_plan.simulate.core import simulate
from taichi_plan.solve import solve
from taichi_plan.solve.result import drops_from_plan
from taichi_plan.trace.format import KINDS, baseline_live_bytes, read_trace, write_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fits_80(text: str) -> bool:
    """Every line fits 80 columns, except a field that is one unbreakable path."""
    return all(len(line) <= 80 or len(line.split()) <= 2 for line in text.splitlines())


def _solved(tmp_path, trace, frac: float = 0.7, name: str = "t"):
    """Write ``trace`` under tmp_path, solve it at ``frac`` of its baseline peak (a little
    higher if the solver cannot reach that: the report, not the solver, is under test) and
    save the plan."""
    (tmp_path / "traces").mkdir(exist_ok=True)
    tdir = write_trace(trace, tmp_path / "traces" / name)
    trace = read_trace(tdir)
    problem = build_problem(trace)
    attempts = [(f, m) for f in (frac, frac + 0.1, frac + 0.2) for m in ("heuristic", "auto")]
    for f, method in attempts:
        budget = int(problem.baseline_peak[0] * f)
        try:
            plan = solve(trace, budget, method, time_limit=2, problem=problem)
            break
        except InfeasibleBudgetError:
            continue
    else:
        pytest.fail(f"no plan for {name} at {frac:.0%}..{frac + 0.2:.0%} of its baseline peak")
    ppath = save_plan(plan, tmp_path / f"{name}.plan.json")
    return trace, problem, plan, ppath


@pytest.fixture
def chain(tmp_path):
    trace = chain_trace([1000, 1200, 800, 1000, 1500, 900, 1000, 1100], temp_bytes=200)
    return _solved(tmp_path, trace, name="chain")


def test_timeline_series_sum_to_simulator(chain):
    trace, problem, plan, _ = chain
    assert plan.recompute, "the 70% budget should need some recomputation"
    data = timeline_data(problem, plan)
    sim = simulate(problem, drops_from_plan(problem, plan))
    planned = sum(data["planned_by_kind"][k] for k in KINDS)
    baseline = sum(data["baseline_by_kind"][k] for k in KINDS)
    assert np.array_equal(planned, sim.live_bytes)
    assert np.array_equal(data["planned_live"], sim.live_bytes)
    assert np.array_equal(baseline, baseline_live_bytes(trace))
    assert np.array_equal(data["baseline_live"], baseline_live_bytes(trace))
    assert data["planned_peak"]["nbytes"] == plan.predicted["planned_peak_bytes"] <= plan.budget_bytes
    assert data["baseline_peak"]["nbytes"] == plan.predicted["baseline_peak_bytes"]
    assert len(data["phase"]) == trace.num_ops
    spans = data["phase_spans"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == trace.num_ops - 1
    assert all(a["end"] + 1 == b["start"] for a, b in zip(spans, spans[1:]))
    assert [g["before_op"] for g in data["groups"]] == sorted(sim.groups)
    assert data["extra_compute"] == pytest.approx(plan.predicted["extra_compute"])


def test_summary_totals_match_plan(chain):
    trace, problem, plan, ppath = chain
    s = plan_summary(plan, trace, problem=problem)
    d = s["decisions"]
    assert d["tensors_dropped"] == len(plan.recompute)
    assert d["nbytes_freed"] == sum(r.nbytes for r in plan.recompute)
    top = [r["nbytes"] for r in d["top"]]
    assert top == sorted((r.nbytes for r in plan.recompute), reverse=True)[:10]
    assert all(r["why"] for r in d["top"])
    mods = s["modules"]
    assert sum(m["tensors_dropped"] for m in mods) == len(plan.recompute)
    assert sum(m["nbytes_freed"] for m in mods) == d["nbytes_freed"]
    assert sum(m["extra_compute"] for m in mods) == pytest.approx(plan.predicted["extra_compute"], rel=1e-9)
    assert all(m["module"] for m in mods)  # '' is shown as '(none)'
    assert s["trace"]["found"] and s["resimulated"]["agrees"]
    assert s["schedule_peak_bytes"] is not None
    text = render_plan_summary(s)
    assert _fits_80(text), text
    assert "Per module" in text and "Recompute decisions" in text
    json.dumps(s)


def test_module_extra_random_traces(tmp_path):
    """Per-module extra compute sums to the plan's on traces with skips and temporaries."""
    done = 0
    for seed in range(12):
        trace = random_training_trace(random.Random(seed), layers=7)
        _, problem, plan, _ = _solved(tmp_path, trace, frac=0.75, name=f"r{seed}")
        s = plan_summary(plan, read_trace(tmp_path / "traces" / f"r{seed}"))
        total = sum(m["extra_compute"] for m in s["modules"])
        assert total == pytest.approx(plan.predicted["extra_compute"], rel=1e-9, abs=1e-12)
        assert sum(m["nbytes_freed"] for m in s["modules"]) == s["decisions"]["nbytes_freed"]
        done += bool(plan.recompute)
    assert done >= 3


def test_cli_json_equals_plan(chain):
    _, _, plan, ppath = chain
    res = CliRunner().invoke(main, ["inspect", str(ppath), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert s["budget_bytes"] == plan.budget_bytes
    assert s["planned_peak"]["nbytes"] == plan.predicted["planned_peak_bytes"]
    assert s["planned_peak"]["op_id"] == plan.predicted["planned_peak_op"]
    assert s["baseline_peak"]["nbytes"] == plan.predicted["baseline_peak_bytes"]
    assert s["extra_compute"]["cost"] == plan.predicted["extra_compute"]
    assert s["extra_compute"]["pct_of_step"] == plan.predicted["extra_compute_pct"]
    assert s["solver"]["method"] == plan.solver["method"] and s["solver"]["status"] == plan.solver["status"]
    assert s["decisions"]["tensors_dropped"] == len(plan.recompute)
    assert s["trace"]["content_hash"] == plan.trace["content_hash"]


def test_cli_text_units(chain):
    _, _, _, ppath = chain
    for units in ("GB", "GiB", "MB", "MiB"):
        res = CliRunner().invoke(main, ["inspect", str(ppath), "--units", units])
        assert res.exit_code == 0, res.output
        assert _fits_80(res.output), res.output
        assert "content hash matches" in res.output


def test_png_written_and_refused_without_force(chain, tmp_path):
    _, _, _, ppath = chain
    png = tmp_path / "timeline.png"
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", str(ppath), "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert f"Wrote {png}" in res.output
    data = png.read_bytes()
    assert len(data) > 1000 and data.startswith(PNG_MAGIC)
    res = runner.invoke(main, ["inspect", str(ppath), "--png", str(png)])
    assert res.exit_code == OutputExistsError.exit_code != 0
    assert "--force" in res.output
    assert png.read_bytes() == data
    res = runner.invoke(main, ["inspect", str(ppath), "--png", str(png), "--force", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["timeline_png"] == str(png)
    assert not list(tmp_path.glob(".timeline.png.*"))  # no temp file left behind


def test_png_rejected_for_trace_dir(chain):
    trace, _, _, _ = chain
    res = CliRunner().invoke(main, ["inspect", str(trace.path), "--png", "x.png"])
    assert res.exit_code != 0 and "not a plan file" in " ".join(res.output.split())


def test_missing_trace_still_inspects(chain, tmp_path):
    trace, _, plan, ppath = chain
    shutil.rmtree(trace.path)
    res = CliRunner().invoke(main, ["inspect", str(ppath)])
    assert res.exit_code == 0, res.output
    assert f"trace not found at {trace.path}" in " ".join(res.output.split())
    assert "Recompute decisions" in res.output and "Per module: not shown" in res.output
    res = CliRunner().invoke(main, ["inspect", str(ppath), "--json"])
    assert res.exit_code == 0
    s = json.loads(res.output)
    assert s["trace"]["found"] is False and s["trace"]["state"] == "missing"
    assert s["modules"] is None and s["decisions"]["tensors_dropped"] == len(plan.recompute)
    res = CliRunner().invoke(main, ["inspect", str(ppath), "--png", str(tmp_path / "x.png")])
    assert res.exit_code != 0 and "trace not found" in " ".join(res.output.split())
    assert not (tmp_path / "x.png").exists()


def test_changed_trace_is_reported(chain):
    trace, _, _, ppath = chain
    other = chain_trace([100, 100, 100])
    write_trace(other, trace.path, force=True)
    s = json.loads(inspect_plan(ppath, as_json=True))
    assert s["trace"]["state"] == "changed" and not s["trace"]["found"]
    assert "has changed" in s["trace"]["message"]


@pytest.mark.parametrize("content", ["{not json", "[]", '{"format_version": 1}', '{"format_version": 99}'])
def test_malformed_plan(tmp_path, content):
    bad = tmp_path / "bad.plan.json"
    bad.write_text(content)
    res = CliRunner().invoke(main, ["inspect", str(bad)])
    assert res.exit_code == PlanError.exit_code != 0
    assert "Error:" in res.output and "plan" in res.output.lower()
    with pytest.raises(PlanError):
        inspect_plan(bad)


def test_downsample_keeps_peaks():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 1000, size=MAX_POINTS * 3)
    values[12345] = 10**6
    idx = downsample(values)
    assert len(idx) < len(values) and np.all(np.diff(idx) > 0)
    assert 12345 in idx and values[idx].max() == values.max()
    assert np.array_equal(downsample(values[:100]), np.arange(100))


def test_long_trace_png(tmp_path):
    """A trace longer than MAX_POINTS draws (downsampled) without losing the peak."""
    trace = chain_trace([64 + (i % 7) * 8 for i in range(2600)])
    _, problem, plan, ppath = _solved(tmp_path, trace, frac=0.7, name="long")
    assert problem.num_ops > MAX_POINTS
    data = timeline_data(problem, plan)
    out = write_timeline_png(data, tmp_path / "long.png", units="MB")
    assert out.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("path", graph_files()[:2], ids=lambda p: p.stem[:20])
def test_public_graph_plan(tmp_path, path):
    from taichi_plan.trace.import_graph import import_graph

    trace, problem, plan, ppath = _solved(tmp_path, import_graph(path), frac=0.6, name="g")
    s = json.loads(inspect_plan(ppath, as_json=True))
    assert s["trace"]["found"] and s["extra_compute"]["unit"] == "units"
    assert sum(m["extra_compute"] for m in s["modules"]) == pytest.approx(plan.predicted["extra_compute"], rel=1e-9)
    text = inspect_plan(ppath, png=tmp_path / "g.png", units="GB")
    assert "Wrote" in text and (tmp_path / "g.png").read_bytes().startswith(PNG_MAGIC)
    assert load_plan(ppath).predicted == plan.predicted



def test_no_decisions_and_partitions_render(chain, tmp_path):
    """A plan whose budget does not bind renders; partitions are listed from the plan alone,
    and one the trace cannot take is reported as not applying (text still exits 0)."""
    from taichi_plan.plan.format import Partition

    trace, problem, _, _ = chain
    plan = solve(trace, problem.baseline_peak[0], "heuristic", problem=problem)
    ppath = save_plan(plan, tmp_path / "none.plan.json")
    text = inspect_plan(ppath, png=tmp_path / "none.png")
    assert "Recompute decisions: none" in text and (tmp_path / "none.png").exists()
    s = json.loads(inspect_plan(ppath, as_json=True))
    assert s["modules"] == [] and s["trace"]["found"]

    plan.partitions = [Partition("layers.3", 0, 4, why="halves the transients of layers.3")]
    ppath = save_plan(plan, tmp_path / "part.plan.json")
    res = CliRunner().invoke(main, ["inspect", str(ppath)])
    assert res.exit_code == 0, res.output
    assert "Partitions: 1" in res.output and "layers.3" in res.output and _fits_80(res.output)
    s = json.loads(inspect_plan(ppath, as_json=True))
    assert s["partitions"][0]["chunks"] == 4
    if not s["trace"]["found"]:  # the simulator checks partitions: this one does not apply
        assert s["trace"]["state"] == "mismatch" and "do not apply" in s["trace"]["message"]
        res = CliRunner().invoke(main, ["inspect", str(ppath), "--png", str(tmp_path / "p.png")])
        assert res.exit_code != 0 and not (tmp_path / "p.png").exists()
