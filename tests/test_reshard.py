"""FSDP2's ``reshard_after_forward`` per unit, derived from the recorded trace (issue 10).

The view of a trace recorded with every unit resharding, with some units set not to
reshard (:func:`taichi_plan.problem.sharding.no_reshard.reshard_view`), equals a recording made with that
setting, table by table: every tensor row, every access, every op, its ``module`` label in
backward included (before the recorder told equally deep open modules apart by when they
opened, those labels differed between two recordings of one setting: the order of a set of
names, which follows the string hash of each process).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from taichi_plan.base.errors import PlanError
from taichi_plan.plan.format import FORMAT_VERSION as PLAN_VERSION
from taichi_plan.problem.sharding.no_reshard import reshard_view
from taichi_plan.problem.sharding.prefetch import gatherings, setting_of, view_of_prefetch
from taichi_plan.problem.sharding.reshard import view_of_choice
from taichi_plan.problem.sharding.units import regather_ops, reshard_units
from taichi_plan.trace.format import read_trace

# FSDP2's own default leaves the root gathered (fully_shard's reshard_after_forward=None);
# the last block is the usual hand-set choice (backward gathers it again at once).
SETTINGS = {"all": {}, "root+last": {"": False, "transformer.h.3": False},
            "none": {"": False, **{f"transformer.h.{k}": False for k in range(4)}},
            "prefetch": {"transformer.h.3": False}}
# FSDP2's explicit prefetching (taichi_plan/problem/sharding/prefetch.py), recorded with the "prefetch" setting: the
# root and h.1 gather the next block in forward; h.1 and h.2 do not prefetch in backward (FSDP's
# default gathers the block before), so h.0 and h.1 gather their own; h.3 stays gathered.
PREFETCH = {"": {"forward": ["transformer.h.0"]},
            "transformer.h.1": {"forward": ["transformer.h.2"], "backward": []},
            "transformer.h.2": {"backward": []}}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """A tiny GPT-2 recorded with each setting, in this process (a recording leaves no process
    group and no patch: test_fsdp_record.py), written and read back (tests read ``.path``). Its
    gathered parameters weigh against its activations (batch 1): at 75% of its per-rank peak,
    keeping every unit gathered does not pay, keeping none is FSDP's default; so is prefetching
    every all-gather."""
    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import record_fsdp_workload
    from taichi_plan.trace.format import write_trace

    d = tmp_path_factory.mktemp("reshard")
    w = get_workload(model="gpt2", layers=4, hidden=64, heads=4, vocab=500, seq=64, batch=1)
    for name, setting in SETTINGS.items():
        write_trace(record_fsdp_workload(w, 2, reshard_after_forward=setting, check_tracker=False,
                                         prefetch=PREFETCH if name == "prefetch" else None), d / name)
    return {name: read_trace(d / name) for name in SETTINGS}


def _differences(view, rec) -> list:
    out = []
    for name in ("ops", "tensors", "accesses"):
        x, y = getattr(view, name), getattr(rec, name)
        if x.shape != y.shape:
            out.append((name, x.shape, y.shape))
            continue
        for c in x.columns:
            if c == "shape":
                d = np.asarray([list(p) != list(q) for p, q in zip(x[c], y[c], strict=True)], dtype=bool)
            else:
                d = x[c].to_numpy() != y[c].to_numpy()
            if d.any():
                out.append((name, c, int(d.sum()), np.nonzero(d)[0][:5].tolist()))
    for key in ("units", "op_spans", "incarnations"):
        if view.meta["fsdp"][key] != rec.meta["fsdp"][key]:
            out.append(("meta.fsdp", key))
    for key in ("model_calls", "random_ops"):
        if view.meta.get(key) != rec.meta.get(key):
            out.append(("meta", key))
    return out


@pytest.mark.parametrize("name", [pytest.param("root+last", marks=pytest.mark.bench), "none"])
def test_view_equals_a_recording_with_that_setting(recordings, name):
    base = recordings["all"]
    view = view_of_choice(base, SETTINGS[name])
    rec = recordings[name]
    assert _differences(view, rec) == []
    assert len(view.ops) < len(base.ops)  # the backward gatherings are gone
    assert view.meta["fsdp"]["units"] == rec.meta["fsdp"]["units"]
    # the ops removed are FSDP's own (inside its spans), all in backward, with one all-gather per unit
    units = [k for k, u in enumerate(base.meta["fsdp"]["units"]) if u["module"] in SETTINGS[name]]
    gone = regather_ops(base, units)
    assert set(base.ops["phase"][gone]) == {"backward"}
    assert sum(base.ops["op"][gone].str.startswith("c10d._allgather_base_")) == len(units)


def test_prefetch_view_equals_a_recording_with_that_prefetching(recordings):
    """The step with some all-gathers issued early in forward and FSDP's default backward
    prefetch turned off for some units, derived from the default recording (on top of a unit
    not resharding), equals the recording made with those FSDP2 settings, table by table."""
    base, rec = recordings["all"], recordings["prefetch"]
    h = [f"transformer.h.{k}" for k in range(4)]
    choice = {"forward": [h[0], h[2]], "backward": [h[2]]}
    assert setting_of(rec) == {"forward": {1, 3}, "backward": {3}}  # unit indices: the root is 0
    assert setting_of(base) == {"forward": set(), "backward": {1, 2, 3, 4}}  # FSDP's defaults
    view = view_of_prefetch(view_of_choice(base, SETTINGS["prefetch"]), choice)
    assert _differences(view, rec) == []
    assert view.meta["fsdp"]["op_spans"] == rec.meta["fsdp"]["op_spans"]
    # the early forward all-gather holds its buffer from the earlier unit's pre-forward on
    g = next(g for g in gatherings(rec) if g.phase == "forward" and g.unit == 3)
    assert g.early and g.by == 2 and g.start == g.by_hook_end + 1
    # and back: issuing the forward gatherings in their own hooks again gives the default's
    back = view_of_prefetch(rec, {"forward": []})
    assert _differences(back, view_of_prefetch(view_of_choice(base, SETTINGS["prefetch"]),
                                               {"backward": [h[2]]})) == []
    # a backward gathering the recording issues by itself is not turned into an early one
    with pytest.raises(PlanError, match="cannot have its backward all-gather issued early"):
        view_of_prefetch(rec, {"backward": [h[0], h[1], h[2]]})


def test_a_unit_recorded_without_resharding_cannot_be_turned(recordings):
    none = recordings["none"]
    assert reshard_units(none.meta) == []
    with pytest.raises(PlanError, match="recorded not resharding"):
        reshard_view(none, [1])
    with pytest.raises(PlanError, match="does not have"):
        view_of_choice(recordings["all"], {"transformer.h.9": False})


# --- The planner's choice, applied and measured -------------------------------------------------

APPLY = """
import json, sys
from taichi_plan.record import get_workload
from taichi_plan.record.fsdp import fake_process_group, shard_model
from taichi_plan.torch_common.fsdp import live_layout, live_prefetch
from taichi_plan.base.errors import PlanError
from taichi_plan.problem.sharding.prefetch import gatherings, setting_of, view_of_prefetch
import taichi_plan
plan, settings = sys.argv[1], json.loads(sys.argv[2])
w = get_workload(model="gpt2", layers=4, hidden=64, heads=4, vocab=500, seq=64, batch=1)
out = []
with fake_process_group(2) as mesh:
    for setting, own_prefetch in settings:
        model, *_ = w.build(False)
        shard_model(model, mesh, setting, own_prefetch)
        before = live_layout(model)["units"]
        try:
            taichi_plan.apply(model, plan)
        except PlanError as e:
            out.append({"error": str(e)})
            continue
        during, prefetch = live_layout(model)["units"], live_prefetch(model)
        taichi_plan.finish(model)
        out.append({"before": before, "during": during, "after": live_layout(model)["units"], "prefetch": prefetch,
                    "prefetch_after": live_prefetch(model)})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def chosen(recordings, tmp_path_factory):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    d = tmp_path_factory.mktemp("reshard-plan")
    trace = recordings["all"].path
    plans = {}
    for how in ("auto", "as-recorded"):
        out = d / "plans" / f"{how}.plan.json"
        r = CliRunner().invoke(main, ["solve", str(trace), "--budget", "75%", "--method", "heuristic",
                                      "--reshard", how, "--prefetch", how, "-o", str(out)])
        assert r.exit_code == 0, r.output
        plans[how] = out
    return plans


def _off(plan: dict) -> list[str]:
    return [u["module"] for u in plan["decisions"]["reshard_after_forward"]["units"] if not u["reshard_after_forward"]]


def test_planner_keeps_some_units_gathered_between_the_extremes(chosen):
    plan = json.loads(chosen["auto"].read_text())
    kept = json.loads(chosen["as-recorded"].read_text())
    assert plan["format_version"] == PLAN_VERSION
    units = plan["decisions"]["reshard_after_forward"]["units"]
    off = _off(plan)
    assert 0 < len(off) < len(units), units  # some units, not every one
    assert _off(kept) == [] and all(u["recorded"] for u in units)
    assert all("saves its backward all-gather" in u["why"] for u in units if not u["reshard_after_forward"])
    for p in (plan, kept):
        assert p["predicted"]["planned_peak_bytes"] <= p["budget_bytes"]
    # the choice's predicted step (compute, collectives and recomputation) is shorter than the default's
    p, k = plan["predicted"], kept["predicted"]
    assert p["step_compute"] + p["extra_compute"] < k["step_compute"] + k["extra_compute"]
    saved = plan["decisions"]["reshard_after_forward"]["step_compute_saved"]
    assert saved == pytest.approx(k["step_compute"] - p["step_compute"]) and saved > 0


def test_planner_chooses_prefetching_per_unit(chosen):
    """At 75%, the plan issues forward all-gathers early and turns FSDP's default backward
    prefetch off for some units (less memory in backward, where the budget binds), and its
    predicted step (overlapped, plus recomputation) beats FSDP's defaults on the same setting."""
    plan = json.loads(chosen["auto"].read_text())
    kept = json.loads(chosen["as-recorded"].read_text())
    pf = plan["decisions"]["fsdp_prefetch"]
    assert pf["chosen_by"] == "auto" and kept["decisions"]["fsdp_prefetch"]["units"] == []
    assert pf["forward"], pf  # some all-gathers issued early in forward
    units = {u["module"]: u for u in pf["units"]}
    assert any(u["forward_prefetch"] for u in units.values())
    assert any(u["backward_prefetch"] == [] for u in units.values()), units  # and some default turned off
    assert any(u["backward_prefetch"] is None for u in units.values()) or len(pf["backward"]) > 0
    screened = plan["solver"]["stats"]["prefetch_screen"]
    recorded = screened[0]  # FSDP's defaults on the chosen reshard setting, screened first
    chosen = min((t for t in screened if t["fits"]), key=lambda t: t["step_time"])
    assert chosen["step_time"] < recorded["step_time"]
    assert pf["overlap"]["step_time"] + plan["predicted"]["extra_compute"] == pytest.approx(chosen["step_time"],
                                                                                            rel=0.05)


def test_overlap_model_counts_the_all_gathers_prefetching_hides(recordings):
    """Issued early, each forward all-gather of this step hides behind the unit before it:
    the overlapped step is shorter by exactly their cost; with every all-gather issued by its
    own unit, no collective overlaps anything."""
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.sharding.overlap import is_collective, overlapped_step_time
    from taichi_plan.problem.sharding.prefetch import prefetch_problem

    base = build_problem(recordings["all"])
    default = overlapped_step_time(base)
    assert default.compute_time + default.collective_time == pytest.approx(base.step_cost, rel=1e-12)
    early = prefetch_problem(base, {"forward": {1, 2, 3, 4}})
    moved = [g for g in gatherings(base.trace) if g.phase == "forward" and g.unit in (1, 2, 3, 4)]
    hidden = sum(base.op_cost[i] for g in moved for i in range(g.start, g.end + 1) if is_collective(base.op_name[i]))
    assert hidden > 0
    assert default.step_time - overlapped_step_time(early).step_time == pytest.approx(hidden, rel=1e-9)
    lean = prefetch_problem(base, {"forward": set(), "backward": set()})
    o = overlapped_step_time(lean)
    assert o.exposed_time == pytest.approx(o.collective_time, rel=1e-9)
    # memory: FSDP's default backward prefetch holds the next unit's all-gather buffer over a
    # unit's backward; without it the peak is lower
    assert lean.baseline_peak[0] < base.baseline_peak[0]
    assert early.baseline_peak[0] >= base.baseline_peak[0]


def test_two_gloo_ranks_run_the_chosen_setting_measured_equals_predicted(chosen):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    r = CliRunner().invoke(main, ["replay", str(chosen["auto"]), "--nproc", "2", "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    plan = json.loads(chosen["auto"].read_text())
    want = [[u["module"] or "<root>", u["reshard_after_forward"]]
            for u in plan["decisions"]["reshard_after_forward"]["units"]]
    for rank in report["ranks"]:
        assert rank["reshard_after_forward"] == want, rank  # the plan's setting, as the measured step ran
        assert rank["fsdp_prefetch"] == {u["module"]: {"forward": u["forward_prefetch"], "backward": u["backward_prefetch"]}
                                         for u in plan["decisions"]["fsdp_prefetch"]["units"]}, rank
        assert rank["measured_peak_bytes"] == plan["predicted"]["planned_peak_bytes"], rank
        assert rank["grads_match"] and rank["params_match"], rank
    assert report["within_budget"] and report["grads_match"]


def test_apply_sets_the_plan_setting_and_refuses_another_layout(chosen):
    plan = json.loads(chosen["auto"].read_text())
    off = _off(plan)

    other = next(u["module"] for u in plan["decisions"]["reshard_after_forward"]["units"] if u["module"] not in off)
    mine = {"transformer.h.3": {"forward": [], "backward": []}}  # a user's own setting, not the plan's
    settings = [[{}, None], [dict.fromkeys(off, False), None], [{other: False}, None], [{}, mine]]
    r = subprocess.run([sys.executable, "-c", APPLY, str(chosen["auto"]), json.dumps(settings)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    as_recorded, as_planned, refused, own = json.loads(r.stdout.strip().splitlines()[-1])
    assert [m for m, on in as_recorded["during"] if not on] == off
    assert as_recorded["after"] == as_recorded["before"]  # finish() restores the model's own setting
    assert as_recorded["prefetch"] == {u["module"]: {"forward": u["forward_prefetch"], "backward": u["backward_prefetch"]}
                                       for u in plan["decisions"]["fsdp_prefetch"]["units"]} != {}
    assert as_recorded["prefetch_after"] == {}  # and FSDP's default prefetching
    assert own["prefetch"] == as_recorded["prefetch"]  # every unit pinned as the plan says
    assert own["prefetch_after"] == mine  # and the user's own setting back after finish()
    assert "error" not in as_planned  # already set as the plan says: accepted
    assert "solved for 2 ranks" in refused["error"] and "record this layout" in refused["error"]


def test_inspect_shows_the_setting_and_rejects_an_impossible_one(chosen, tmp_path):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    r = CliRunner().invoke(main, ["inspect", str(chosen["auto"])])
    assert r.exit_code == 0, r.output
    assert "FSDP units (reshard_after_forward)" in r.output and "recorded" in r.output
    obj = json.loads(chosen["auto"].read_text())
    obj["decisions"]["reshard_after_forward"]["units"][0]["module"] = "transformer.h.9"
    obj["trace"]["path"] = obj["trace"]["path_absolute"]
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(obj))
    r = CliRunner().invoke(main, ["replay", str(bad), "--nproc", "2"])
    assert r.exit_code != 0 and "transformer.h.9" in r.output and "Traceback" not in r.output


def test_reshard_and_prefetch_chosen_jointly_beat_the_sequential_screens(recordings):
    """At 80% of the tiny GPT-2's per-rank peak, screening reshard settings with FSDP's default
    prefetching and then prefetching on the winner (the sequential choice) keeps the root and the
    last block gathered; planning every pair finds the root alone gathered, with other prefetching,
    a shorter predicted step (overlapped step plus the heuristic's recomputation, each pair planned
    and judged by the simulator). The plan takes the joint pair."""
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.sharding.prefetch import prefetch_problem
    from taichi_plan.problem.sharding.reshard import reshard_problem
    from taichi_plan.solve import solve
    from taichi_plan.solve.fsdp import evaluate, screen, screen_prefetch

    trace = recordings["all"]
    problem = build_problem(trace)
    budget = int(0.8 * problem.baseline_peak[0])
    far = 10**9  # no deadline: every setting screened
    units, _ = screen(problem, budget, 0, far)
    early, _ = screen_prefetch(reshard_problem(problem, units), budget, 0, far)
    sequential = evaluate(prefetch_problem(reshard_problem(problem, units), early), budget, 0, far)

    plan = solve(trace, budget, "heuristic", time_limit=120)
    chosen = [k for k, u in enumerate(plan.reshard["units"]) if not u["reshard_after_forward"]]
    pf = plan.prefetch
    names = [u["module"] for u in trace.meta["fsdp"]["units"]]
    joint_early = {ph: {names.index(m) for m in pf[ph]} for ph in ("forward", "backward")}
    joint = evaluate(prefetch_problem(reshard_problem(problem, chosen), joint_early), budget, 0, far)
    assert sequential["fits"] and joint["fits"] and plan.predicted["planned_peak_bytes"] <= budget
    assert not any(v is not False for v in units.values())  # 2 ranks: no smaller mesh to reshard to
    assert (chosen, joint_early) != (sorted(units), early)
    assert joint["step_time"] < sequential["step_time"] * 0.99, (joint, sequential)
    stats = plan.solver["stats"]["fsdp_joint_screen"]
    assert stats["sequential"]["step_time"] == pytest.approx(sequential["step_time"], rel=1e-12)
    assert stats["joint"]["step_time"] == pytest.approx(joint["step_time"], rel=1e-12)
    # the plan's own numbers are the joint pair's: its overlapped step plus its recomputation
    assert pf["overlap"]["step_time"] + plan.predicted["extra_compute"] == pytest.approx(joint["step_time"], rel=1e-9)
    assert any("chosen jointly" in n for n in plan.solver["notes"])
