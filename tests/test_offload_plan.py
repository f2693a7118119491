"""Offloads in the plan file (format v14), in ``inspect`` and in the HTML report."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from test_offload_sim import tiny

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import FORMAT_VERSION, load_plan, peak_from_schedule, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.offload import Offload, OffloadConfig, allow_offload
from taichi_plan.report.html import read_plan_data
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import read_trace, write_trace


@pytest.fixture
def saved(tmp_path):
    """The tiny trace of test_offload_sim written out, and a plan offloading A on a 1000 B/s
    link with a host budget of 1500 B (the hand-computed schedule: peak 2204 at op3, host
    1000 B, copy-in issued before op6, no stall)."""
    prob, a, _ = tiny()
    trace = read_trace(write_trace(prob.trace, tmp_path / "traces" / "tiny"))
    prob = allow_offload(build_problem(trace), OffloadConfig(1000.0, 1500))
    plan = make_plan(prob, 2500, "heuristic", Decisions(offloads=[Offload(a, 1, 7)]), 0.0, 0)
    path = save_plan(plan, tmp_path / "plans" / "tiny.plan.json")
    return plan, path, int(prob.tensor_id[a])


def test_round_trip(saved):
    plan, path, tid = saved
    assert plan.solver["status"] == "feasible"
    assert plan.predicted["planned_peak_bytes"] == 2204 and plan.predicted["host_peak_bytes"] == 1000
    assert plan.predicted["stall_s"] == 0.0
    obj = json.loads(path.read_text())
    assert obj["format_version"] == FORMAT_VERSION == 14
    off = obj["decisions"]["offload"]
    assert off["host_link_bytes_per_s"] == 1000.0 and off["host_budget_bytes"] == 1500
    (row,) = off["tensors"]
    assert (row["tensor"], row["after"], row["before"], row["freed_after"], row["prefetch_at"]) == (tid, 1, 7, 2, 6)
    assert row["copy_out_s"] == row["copy_in_s"] == 1.0 and row["why"].startswith("frees 1.00 KB on the device for 3 ops (op 3 to 5)")
    back = load_plan(path)
    assert back.offloads == plan.offloads and back.offload == plan.offload
    assert peak_from_schedule(back.schedule)[0] == 2204
    assert [e[0] for e in back.schedule["events"] if e[0].startswith("copy")] == ["copy_out", "copy_in"]


def test_host_budget_binds(tmp_path):
    prob, a, _ = tiny()
    prob = allow_offload(prob, OffloadConfig(1000.0, 999))
    plan = make_plan(prob, 2500, "heuristic", Decisions(offloads=[Offload(a, 1, 7)]), 0.0, 0)
    assert plan.solver["status"] == "infeasible"  # 1000 B on the host, 999 allowed


def test_old_and_bad_files(saved, tmp_path):
    plan, path, _ = saved
    obj = json.loads(path.read_text())
    bad = tmp_path / "bad.plan.json"
    for change, what in [(lambda o: o.update(format_version=13), "decisions.offload"),
                         (lambda o: o["decisions"]["offload"]["tensors"][0].update(prefetch_at=0), "prefetch_at"),
                         (lambda o: o["decisions"]["offload"].update(host_link_bytes_per_s=0), "host_link"),
                         (lambda o: o["predicted"].pop("host_peak_bytes"), "host_peak_bytes")]:
        o = json.loads(json.dumps(obj))
        change(o)
        bad.write_text(json.dumps(o))
        with pytest.raises(PlanError, match=what):
            load_plan(bad)
    # A v13 file (no offload, no copy events) still loads.
    o = json.loads(json.dumps(obj))
    o["format_version"] = 13
    del o["decisions"]["offload"]
    o["schedule"]["events"] = [e for e in o["schedule"]["events"] if not e[0].startswith("copy")]
    bad.write_text(json.dumps(o))
    assert load_plan(bad).offloads == [] and load_plan(bad).offload is None
    o["schedule"]["events"].append(["copy_in", 6, [], []])
    bad.write_text(json.dumps(o))
    with pytest.raises(PlanError, match="kind"):
        load_plan(bad)


def test_inspect_text_and_html(saved, tmp_path):
    _plan, path, tid = saved
    r = CliRunner().invoke(main, ["inspect", str(path), "--units", "MB"])
    assert r.exit_code == 0, r.output
    assert "Offload decisions: 1 tensors offloaded" in r.output
    assert "0 tensors dropped, 1 offloaded, 0.000 s of it waiting for copies" in " ".join(r.output.split())
    assert "peak 0.00 MB of offloaded copies, host budget 0.00 MB" in " ".join(r.output.split())
    row = next(line for line in r.output.splitlines() if line.strip().startswith(str(tid)) and "1..7" in line)
    assert row.split()[4] == "6"  # the prefetch point (after: tensor, "0.00", "MB", "1..7")
    js = json.loads(CliRunner().invoke(main, ["inspect", str(path), "--json"]).output)
    assert js["offload"]["host_peak_bytes"] == 1000 and js["offload"]["top"][0]["prefetch_at"] == 6
    assert js["resimulated"]["agrees"]
    page = tmp_path / "r.html"
    r = CliRunner().invoke(main, ["inspect", str(path), "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "Offload decisions" in text and "Host memory" in text
    data = read_plan_data(text)
    assert data["offloads"]["rows"][0][0] == tid
