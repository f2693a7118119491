"""A plan finds its trace from any working directory: the path is stored relative to the plan
file (absolute as a fallback), checked by content hash, and the caller may name the trace."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import FORMAT_VERSION, load_plan
from taichi_plan.report.plan_text import inspect_plan, locate_trace
from taichi_plan.runtime.calls import plan_and_trace
from taichi_plan.trace.format import read_trace, write_trace


@pytest.fixture
def project(tmp_path, monkeypatch):
    """The default layout: ``traces/chain`` and ``plans/chain.plan.json`` written by the CLI
    from inside ``proj``; the test then runs from another directory."""
    proj = tmp_path / "proj"
    (proj / "traces").mkdir(parents=True)
    monkeypatch.chdir(proj)
    write_trace(chain_trace([1000, 1200, 800, 1000, 1500, 900], temp_bytes=200), "traces/chain")
    r = CliRunner().invoke(main, ["solve", "traces/chain", "--budget", "75%", "-m", "heuristic"])
    assert r.exit_code == 0, r.output
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return proj


def test_plan_format_v2_records_both_paths(project):
    obj = json.loads((project / "plans" / "chain.plan.json").read_text())
    assert obj["format_version"] == FORMAT_VERSION == 14
    assert obj["trace"]["path"] == "../traces/chain"
    assert obj["trace"]["path_absolute"] == str((project / "traces" / "chain").resolve())


def test_replay_and_inspect_from_another_directory(project):
    plan_file = project / "plans" / "chain.plan.json"
    plan, trace = plan_and_trace(plan_file)
    assert trace.path.resolve() == (project / "traces" / "chain").resolve()
    r = CliRunner().invoke(main, ["inspect", str(plan_file)])
    assert r.exit_code == 0 and "content hash matches" in r.output, r.output


def test_plan_and_traces_moved_together(project, tmp_path):
    moved = tmp_path / "moved"
    shutil.move(str(project), moved)
    _, trace = plan_and_trace(moved / "plans" / "chain.plan.json")
    assert trace.path.resolve() == (moved / "traces" / "chain").resolve()
    # A plan already in memory remembers the file it came from.
    _, trace = plan_and_trace(load_plan(moved / "plans" / "chain.plan.json"))
    assert trace.path.resolve() == (moved / "traces" / "chain").resolve()


def test_plan_moved_alone_falls_back_to_the_absolute_path(project, tmp_path):
    alone = tmp_path / "alone.plan.json"
    shutil.copy(project / "plans" / "chain.plan.json", alone)
    _, trace = plan_and_trace(alone)
    assert trace.path.resolve() == (project / "traces" / "chain").resolve()


def test_a_trace_at_the_path_with_another_hash_is_passed_over(project, tmp_path):
    """The relative path now holds another trace; the absolute one is still the right one."""
    moved = tmp_path / "moved"
    shutil.copytree(project, moved)
    write_trace(chain_trace([100, 100, 100]), moved / "traces" / "chain", force=True)
    _, trace = plan_and_trace(moved / "plans" / "chain.plan.json")
    assert trace.path.resolve() == (project / "traces" / "chain").resolve()


def test_trace_override(project, tmp_path):
    plan_file = project / "plans" / "chain.plan.json"
    kept = tmp_path / "kept-trace"
    shutil.move(str(project / "traces" / "chain"), kept)
    with pytest.raises(PlanError) as e:
        plan_and_trace(plan_file)
    msg = str(e.value)
    assert "trace not found at" in msg and "trace=" in msg and "{" not in msg, msg
    plan, trace = plan_and_trace(plan_file, trace=kept)
    assert trace.path == kept
    found, status = locate_trace(plan, plan_file, trace=read_trace(kept))
    assert found is not None and status["state"] == "found"
    # The override is checked too: another trace is refused with a sentence.
    other = write_trace(chain_trace([100, 100, 100]), tmp_path / "other")
    with pytest.raises(PlanError) as e:
        plan_and_trace(plan_file, trace=other)
    msg = str(e.value)
    assert "is not the one the plan was solved for" in msg and "{" not in msg, msg


def test_format_v1_plans_are_still_read(project, monkeypatch):
    """v1: no path_absolute, the path relative to where solve ran."""
    plan_file = project / "plans" / "chain.plan.json"
    obj = json.loads(plan_file.read_text())
    obj["format_version"] = 1
    obj["trace"]["path"] = "traces/chain"
    del obj["trace"]["path_absolute"]
    v1 = project / "plans" / "v1.plan.json"
    v1.write_text(json.dumps(obj))
    monkeypatch.chdir(project)
    plan, trace = plan_and_trace(v1)
    assert plan.format_version == 1 and trace.path.resolve() == (project / "traces" / "chain").resolve()
    assert "content hash matches" in inspect_plan(v1)


def test_resaved_plan_keeps_pointing_at_its_trace(project, tmp_path):
    """A plan loaded and saved elsewhere (after plan and traces moved together) still finds
    the trace; a plan written without a destination records absolute paths."""
    from taichi_plan.plan.format import save_plan

    moved = tmp_path / "moved"
    shutil.move(str(project), moved)
    plan = load_plan(moved / "plans" / "chain.plan.json")
    out = save_plan(plan, tmp_path / "elsewhere" / "again.plan.json")
    obj = json.loads(out.read_text())
    assert obj["trace"]["path_absolute"] == str((moved / "traces" / "chain").resolve())
    assert obj["trace"]["path"] == "../moved/traces/chain"
    _, trace = plan_and_trace(out)
    assert trace.path.resolve() == (moved / "traces" / "chain").resolve()
    assert plan.to_json()["trace"]["path"] == str((moved / "traces" / "chain").resolve())
