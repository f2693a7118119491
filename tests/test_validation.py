"""A plan file is checked whole when it is loaded, and against its trace where the trace is
at hand: every bad field is a PlanError naming the field, through the library and the CLI,
never a KeyError or TypeError from deep inside a report or a replay."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from synthetic import chain_trace

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import load_plan, save_plan
from taichi_plan.report.plan_text import inspect_plan
from taichi_plan.runtime.calls import plan_and_trace
from taichi_plan.solve import solve
from taichi_plan.trace.format import read_trace, write_trace


@pytest.fixture
def solved(tmp_path):
    """(plan file, its JSON): a chain trace solved at 70% of its baseline peak."""
    trace = chain_trace([1000, 1200, 800, 1000, 1500, 900, 1000, 1100], temp_bytes=200)
    (tmp_path / "traces").mkdir()
    tdir = write_trace(trace, tmp_path / "traces" / "chain")
    trace = read_trace(tdir)
    from taichi_plan.problem.core import build_problem

    budget = int(0.7 * build_problem(trace).baseline_peak[0])
    plan = solve(trace, budget, "heuristic", time_limit=2)
    assert plan.recompute and plan.schedule
    (tmp_path / "plans").mkdir()
    path = save_plan(plan, tmp_path / "plans" / "chain.plan.json")
    return path, json.loads(path.read_text())


def _write(tmp_path, obj, name="edited.plan.json"):
    p = tmp_path / "plans" / name
    p.write_text(json.dumps(obj))
    return p


def _cli_fails_with(path, *words):
    """``inspect`` and ``replay`` both refuse the plan: exit 6, one message, no traceback."""
    for cmd in (["inspect", str(path)], ["replay", str(path), "--steps", "1"]):
        r = CliRunner().invoke(main, cmd)
        text = " ".join(r.output.split())
        assert r.exit_code == PlanError.exit_code, (cmd, r.output, r.exception)
        assert text.startswith("Error:") and "Traceback" not in text, text
        for w in words:
            assert w in text, (w, text)


def _first_run_event(obj):
    return next(i for i, e in enumerate(obj["schedule"]["events"]) if e[0] == "run" and e[2])


def test_schedule_naming_a_missing_tensor_is_refused(solved, tmp_path):
    path, obj = solved
    i = _first_run_event(obj)
    obj["schedule"]["events"][i][2].append(987654)
    bad = _write(tmp_path, obj)
    with pytest.raises(PlanError, match=r"schedule.events\[\d+\].*987654.*does not exist"):
        load_plan(bad)
    _cli_fails_with(bad, "schedule.events", "987654", "solve the trace again")


def test_schedule_tensor_the_trace_lacks_is_refused(solved, tmp_path):
    """Listed in the schedule's own sizes (so the file is self-consistent), but not in the
    trace: caught where the trace is at hand."""
    path, obj = solved
    obj["schedule"]["nbytes"]["987654"] = 16
    obj["schedule"]["events"][_first_run_event(obj)][2].append(987654)
    bad = _write(tmp_path, obj)
    load_plan(bad)  # whole and sane on its own
    with pytest.raises(PlanError, match="schedule.nbytes lists tensor 987654, which the trace"):
        plan_and_trace(bad)
    with pytest.raises(PlanError, match="987654"):
        inspect_plan(bad)
    _cli_fails_with(bad, "987654")


@pytest.mark.parametrize(("edit", "field"), [
    (lambda o: o.__setitem__("budget_bytes", "lots"), "`budget_bytes` is 'lots'"),
    (lambda o: o.__setitem__("budget_bytes", -5), "`budget_bytes` is -5"),
    (lambda o: o.__setitem__("budget_bytes", True), "`budget_bytes` is True"),
    (lambda o: o["predicted"].__setitem__("planned_peak_bytes", "big"), "`predicted.planned_peak_bytes`"),
    (lambda o: o["predicted"].__setitem__("extra_compute", None), "`predicted.extra_compute`"),
    (lambda o: o["predicted"].__setitem__("cost_unit", "hours"), "`predicted.cost_unit`"),
    (lambda o: o["solver"].__setitem__("status", "great"), "`solver.status`"),
    (lambda o: o["solver"].__setitem__("notes", "one note"), "`solver.notes`"),
    (lambda o: o["trace"].__setitem__("num_ops", -1), "`trace.num_ops`"),
    (lambda o: o["trace"].__setitem__("content_hash", "abc"), "`trace.content_hash`"),
    (lambda o: o["decisions"]["recompute"][0].__setitem__("nbytes", 1.5), "recompute[0].nbytes"),
    (lambda o: o["decisions"]["recompute"][0].__setitem__("remat_before", 0), "recompute[0].remat_before"),
    (lambda o: o["decisions"]["recompute"][0].__setitem__("op", 10**6), "recompute[0].op"),
    (lambda o: o["decisions"]["recompute"][0].__setitem__("extra", 1), "unknown field `extra`"),
    (lambda o: o["decisions"]["recompute"].append(dict(o["decisions"]["recompute"][0])),
     "no other recompute decision drops"),
    (lambda o: o["decisions"]["partitions"].append({"module": "layers.1", "dim": 0, "chunks": 0}),
     "partitions[0].chunks"),
    (lambda o: o["decisions"].__setitem__("partitions", {"module": "x"}), "`decisions.partitions`"),
    (lambda o: o["schedule"]["events"][0].__setitem__(0, "teleport"), "schedule.events[0] kind"),
    (lambda o: o["schedule"].__setitem__("initial", [123456789]), "`schedule.initial`"),
    (lambda o: o.pop("predicted"), "no `predicted` field"),
])
def test_bad_field_is_named(solved, tmp_path, edit, field):
    _, obj = solved
    edit(obj)
    bad = _write(tmp_path, obj)
    with pytest.raises(PlanError) as e:
        load_plan(bad)
    msg = str(e.value)
    assert field in msg and "solve the trace again" in msg and "\n" not in msg, msg
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == PlanError.exit_code and "Traceback" not in r.output, r.output


def test_budget_word_fails_replay_before_any_work(solved, tmp_path, monkeypatch):
    """`budget_bytes: "lots"` used to crash replay after the whole unplanned run."""
    import taichi_plan.replay.measure as measure

    _, obj = solved
    obj["budget_bytes"] = "lots"
    bad = _write(tmp_path, obj)

    def must_not_run(*a, **k):
        raise AssertionError("replay started work on a broken plan")

    monkeypatch.setattr(measure, "_run", must_not_run, raising=False)
    with pytest.raises(PlanError, match="budget_bytes"):
        measure.replay(bad, steps=1)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda o: o["decisions"]["recompute"][0].__setitem__("tensor", 424242), ["drops tensor 424242"]),
    (lambda o: o["decisions"]["recompute"][0].__setitem__("op_name", "aten.nope.default"), ["aten.nope.default"]),
    (lambda o: o["decisions"]["partitions"].append({"module": "no.such.module", "dim": 0, "chunks": 2, "why": ""}),
     ["no.such.module"]),
    (lambda o: o["decisions"]["partitions"].append({"module": "layers.1", "dim": 0, "chunks": 2, "why": ""}) or
     o["decisions"]["partitions"].append({"module": "layer", "dim": 0, "chunks": 2, "why": ""}),
     ["'layer'"]),  # matched as a module FQN, not as a substring of layers.1
])
def test_plan_cross_checked_against_its_trace(solved, tmp_path, edit, words):
    _, obj = solved
    edit(obj)
    bad = _write(tmp_path, obj)
    load_plan(bad)
    with pytest.raises(PlanError) as e:
        plan_and_trace(bad)
    for w in words:
        assert w in str(e.value)
    r = CliRunner().invoke(main, ["inspect", str(bad)])
    assert r.exit_code == PlanError.exit_code and "Traceback" not in r.output, r.output


def test_missing_plan_file_is_called_a_plan(tmp_path):
    missing = tmp_path / "nowhere.plan.json"
    r = CliRunner().invoke(main, ["inspect", str(missing)])
    text = " ".join(r.output.split())
    assert r.exit_code == PlanError.exit_code, r.output
    assert "Plan" in text and "does not exist" in text and "Trace" not in text, text


def test_good_plan_still_loads_and_inspects(solved):
    path, _ = solved
    plan, trace = plan_and_trace(path)
    assert plan.recompute and trace.num_ops == plan.trace["num_ops"]
    assert "content hash matches" in inspect_plan(path)
