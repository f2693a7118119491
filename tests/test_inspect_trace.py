"""inspect on a trace: the facts it reports agree with the trace library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import SMALL_TRACE_PEAK, SMALL_TRACE_PEAK_BY_KIND, small_trace

from taichi_plan.cli import main
from taichi_plan.report.trace_text import render_trace_summary, trace_summary
from taichi_plan.trace.format import KINDS, baseline_peak, read_trace, write_trace
from taichi_plan.trace.import_graph import import_graph


def _check_summary(summary: dict, trace) -> None:
    peak, op = baseline_peak(trace)
    p = summary["baseline_peak"]
    assert (p["nbytes"], p["op_id"]) == (peak, op)
    assert sum(p["by_kind"].values()) == peak
    assert set(p["by_kind"]) == set(KINDS)
    assert p["op"] == trace.ops["op"].iat[op]
    assert p["phase"] == trace.ops["phase"].iat[op]
    assert sum(summary["ops_per_phase"].values()) == trace.num_ops
    assert summary["num_tensors"] == len(trace.tensors)
    assert sum(v["nbytes"] for v in summary["tensors_by_kind"].values()) == trace.tensors["nbytes"].sum()
    sizes = [t["nbytes"] for t in summary["largest_tensors"]]
    assert sizes == sorted(trace.tensors["nbytes"].tolist(), reverse=True)[: len(sizes)]
    assert len(sizes) == min(10, len(trace.tensors))
    assert summary["cost"]["total"] == pytest.approx(trace.ops["duration_s"].sum())
    assert summary["cost"]["total"] == pytest.approx(sum(summary["cost"]["by_phase"].values()))


def test_small_summary(small):
    s = trace_summary(small)
    _check_summary(s, small)
    assert (s["baseline_peak"]["nbytes"], s["baseline_peak"]["op_id"]) == SMALL_TRACE_PEAK
    assert {k: v for k, v in s["baseline_peak"]["by_kind"].items() if v} == SMALL_TRACE_PEAK_BY_KIND
    assert s["baseline_peak"]["module"] == "net.lin"
    assert s["ops_per_phase"] == {"forward": 3, "backward": 2, "optimizer": 1, "other": 0}
    assert s["tensors_by_kind"]["parameter"] == {"count": 1, "nbytes": 1000, "count_at_start": 1,
                                                 "nbytes_at_start": 1000}
    assert s["tensors_by_kind"]["activation"]["count_at_start"] == 0
    assert s["mode"] == "fake" and s["device_profile"] == "a100-40gb" and s["torch_build"] == "cpu"
    assert s["workload"] == {"name": "mlp", "args": {"batch": 2, "hidden": 25}}
    assert s["regularity"]["steps_match"] is True
    assert s["largest_tensors"][0]["producer_op_name"] is None  # a parameter: producer -1
    assert s["cost"]["unit"] == "s"
    json.dumps(s)  # JSON-ready


def test_render_fits_80_columns(small):
    for units in (None, "GB", "GiB", "MB", "MiB"):
        text = render_trace_summary(trace_summary(small), units)
        assert all(len(line) <= 80 for line in text.splitlines()), text
    text = render_trace_summary(trace_summary(small), None)
    assert "Baseline peak 2.50 KB (2,500 bytes) during op 4" in text
    assert "net.lin" in text and "a100-40gb" in text and "batch=2" in text


def test_mismatch_is_shown(small):
    small.meta["steps_match"] = False
    small.meta["first_mismatch"] = {"step": 1, "op_index": 3, "expected": "aten.mm.default",
                                    "got": "aten.addmm.default"}
    text = render_trace_summary(trace_summary(small))
    assert "steps match: NO" in text
    assert "first mismatch: step 1, op 3" in text
    assert "expected aten.mm.default" in " ".join(text.split())
    assert all(len(line) <= 80 for line in text.splitlines())


def test_cli_small(tmp_path):
    path = write_trace(small_trace(), tmp_path / "small")
    runner = CliRunner()
    r = runner.invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert "Baseline peak 2.50 KB (2,500 bytes) during op 4" in r.output
    r = runner.invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    trace = read_trace(path)
    _check_summary(data, trace)
    assert data["baseline_peak"]["nbytes"] == 2500
    assert isinstance(data["cost"]["total"], float)
    r = runner.invoke(main, ["inspect", str(path), "--units", "MiB"])
    assert r.exit_code == 0 and "MiB" in r.output
    r = runner.invoke(main, ["inspect", str(path), "--units", "furlongs"])
    assert r.exit_code == 2


def test_cli_imported_graph(tmp_path, graphs_dir):
    src = graphs_dir / "ResNet50_256_224x224_train_nx.json"
    if not src.exists():
        src = min(graphs_dir.glob("*.json"), key=lambda p: p.stat().st_size)
    trace = import_graph(src)
    path = write_trace(trace, tmp_path / "g")
    runner = CliRunner()
    r = runner.invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    _check_summary(data, read_trace(path))
    assert data["mode"] == "imported"
    assert data["cost"]["unit"] == "units"
    r = runner.invoke(main, ["inspect", str(path), "--units", "GB"])
    assert r.exit_code == 0, r.output
    assert all(len(line) <= 80 for line in r.output.splitlines()), r.output
    peak, op = baseline_peak(trace)
    assert f"Baseline peak {peak / 1e9:.2f} GB ({peak:,} bytes) during op {op}" in r.output


def test_plan_file_dispatch(tmp_path):
    plan = tmp_path / "x.plan.json"
    plan.write_text("{}")
    r = CliRunner().invoke(main, ["inspect", str(plan)])
    try:
        import taichi_plan.report.plan_text  # noqa: F401
    except ModuleNotFoundError:
        assert r.exit_code == 2
        assert "plan_text" in r.output and "plan" in r.output
    else:
        assert "plan_text" not in r.output


def test_missing_path(tmp_path):
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "nothing")])
    assert r.exit_code == 3 and "does not exist" in " ".join(r.output.split())  # (wrapped at any width)


def test_empty_trace_summary(small):
    small.ops = small.ops.iloc[0:0].reset_index(drop=True)
    small.tensors = small.tensors.iloc[0:0].reset_index(drop=True)
    small.accesses = small.accesses.iloc[0:0].reset_index(drop=True)
    s = trace_summary(small)
    assert s["baseline_peak"]["op_id"] == -1 and s["baseline_peak"]["nbytes"] == 0
    assert "no ops" in render_trace_summary(s)


def test_workload_path_is_dir_not_plan(tmp_path):
    # a trace directory whose name ends in .json is still a trace
    path = write_trace(small_trace(), tmp_path / "weird.json")
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert Path(path).is_dir()
