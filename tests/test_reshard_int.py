"""FSDP2's ``reshard_after_forward`` as an int (issue 10): after forward a unit keeps its
parameters sharded over a smaller group of K ranks (FSDP's "post-forward" shards), and backward
gathers them within that group.

Recorded on the fake process group (``record --fsdp 4 --reshard-to 2``), the trace agrees with
``FSDPMemTracker`` by category, files the post-forward shards under a kind of their own (no plan
frees FSDP's state), and costs each backward all-gather over its 2-rank group. The same step
derived from a recording that reshards in full (:func:`taichi_plan.problem.sharding.smaller_mesh.smaller_mesh_view`)
equals that recording, table by table; the planner chooses an int where the job spans nodes;
on 4 real gloo ranks a plan of the derived step measures its predicted peak, shards bitwise;
a plan of one setting is refused on a model sharded with another.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from ranks import record_cli, replay_measures_the_prediction

from taichi_plan.cli import main
from taichi_plan.trace.format import read_trace

TINY = ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "500", "--seq", "128",
        "--batch", "4"]


@pytest.fixture(scope="module")
def int_trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard_int")
    out = record_cli(*TINY, "--fake", "--fsdp", "4", "--reshard-to", "2", "--device-profile", "h100-80gb",
                     "-o", str(d / "traces" / "t"))
    return d, read_trace(d / "traces" / "t"), out


@pytest.fixture(scope="module")
def full_trace(int_trace):
    """The same job recorded resharding in full (FSDP's default)."""
    d = int_trace[0]
    record_cli(*TINY, "--fake", "--fsdp", "4", "--device-profile", "h100-80gb", "-o", str(d / "traces" / "full"))
    return read_trace(d / "traces" / "full")


def test_view_equals_a_recording_with_that_setting(int_trace, full_trace):
    from test_reshard import _differences

    from taichi_plan.problem.sharding.reshard import view_of_choice
    from taichi_plan.problem.sharding.smaller_mesh import smaller_mesh_view

    _d, rec, _ = int_trace
    view = smaller_mesh_view(full_trace, {1: 2, 2: 2})
    assert len(view.ops) == len(full_trace.ops) + 4 * 24  # slice, clone, as_strided, detach per parameter
    assert _differences(view, rec) == []
    for key in ("module_args", "python_refs", "backward_nodes", "data_sized", "num_ops", "num_tensors"):
        assert view.meta.get(key) == rec.meta.get(key), key
    # as a plan names it (module -> setting), and the position of each recorded op in the view
    again = view_of_choice(full_trace, {"transformer.h.0": 2, "transformer.h.1": 2})
    assert _differences(again, rec) == []
    assert (view.ops["op"].to_numpy()[view.position] == full_trace.ops["op"].to_numpy()).all()


def test_view_equals_a_recording_under_mixed_precision():
    """Under FSDP2's MixedPrecisionPolicy (bf16 gathered, fp32 reduced) the backward copy-in
    fills a bf16 buffer the size of the shard it gathers from: 1/4 of the parameters at 4 ranks,
    1/2 from the post-forward shards. The view resizes it and re-costs the ops that make and fill
    it; it equals a recording, with one block at 2 ranks."""
    from test_reshard import _differences

    from taichi_plan.problem.sharding.smaller_mesh import smaller_mesh_view
    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import record_fsdp_workload
    from taichi_plan.torch_common.fsdp import mixed_precision

    w = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=64, batch=2)
    mp = mixed_precision("bf16", "fp32")
    full, rec = (record_fsdp_workload(w, 4, reshard_after_forward=setting, check_tracker=False, mixed_precision=mp,
                                      device_profile="h100-80gb") for setting in (True, {"transformer.h.1": 2}))
    view = smaller_mesh_view(full, {2: 2})
    assert _differences(view, rec) == []
    for key in ("module_args", "python_refs", "backward_nodes"):
        assert view.meta.get(key) == rec.meta.get(key), key


def test_settings_that_cannot_be_derived_are_refused(int_trace, full_trace):
    from taichi_plan.base.errors import PlanError
    from taichi_plan.problem.sharding.reshard import view_of_choice
    from taichi_plan.problem.sharding.smaller_mesh import smaller_mesh_view

    with pytest.raises(PlanError, match="one of its factors"):
        smaller_mesh_view(full_trace, {1: 3})
    with pytest.raises(PlanError, match="root FSDP unit"):
        smaller_mesh_view(full_trace, {0: 2})
    with pytest.raises(PlanError, match="not recorded resharding in full"):
        smaller_mesh_view(int_trace[1], {1: 2})  # recorded to 2 ranks: its full gathering was never seen
    with pytest.raises(PlanError, match="only a unit recorded resharding in full"):
        view_of_choice(int_trace[1], {"transformer.h.0": True})


def test_int_recording_agrees_with_fsdp_mem_tracker(int_trace):
    from taichi_plan.record.fsdp import trace_by_tracker_category

    _d, trace, out = int_trace
    assert "(+0.00%)" in out
    peak, _at, cats = trace_by_tracker_category(trace)
    ref = trace.meta["fsdp"]["mem_tracker"]
    assert peak == ref["peak_bytes"]
    for cat, want in ref["by_category"].items():
        assert cats[cat] == want, (cat, cats[cat], want)


def test_post_forward_shards_are_fsdp_state_held_from_forward_to_backward(int_trace):
    from taichi_plan.problem.core import FIXED_KINDS

    _d, trace, _ = int_trace
    units = trace.meta["fsdp"]["units"]
    assert [u["reshard_after_forward"] for u in units] == [True, 2, 2]
    assert "post_forward_shard" in FIXED_KINDS
    t, ops = trace.tensors, trace.ops
    shards = t[t["kind"] == "post_forward_shard"]
    phase = ops["phase"].to_numpy()
    assert len(shards) == sum(len(u["params"]) for u in units[1:])
    assert (phase[shards["alloc_op"].to_numpy()] == "forward").all()
    assert (phase[shards["free_op"].to_numpy()] == "backward").all()
    # half of each block's gathered parameters (4 ranks' padded shards, kept on 2)
    assert int(shards["nbytes"].sum()) == sum(2 * u["sharded_nbytes"] for u in units[1:])


def test_backward_all_gathers_run_over_the_smaller_group(int_trace):
    from taichi_plan.trace.devices import get_profile
    from taichi_plan.trace.layout import unit_of_ops
    from taichi_plan.trace.roofline import collective_duration_s

    _d, trace, _ = int_trace
    ops, t, acc = trace.ops, trace.tensors, trace.accesses
    unit = unit_of_ops(trace.meta, ops["module"].tolist())
    profile = get_profile("h100-80gb")
    kind = dict(zip(t["tensor_id"], t["kind"]))
    nbytes = dict(zip(t["tensor_id"], t["nbytes"]))
    seen = []
    for i in ops.index[ops["op"].str.contains("allgather")]:
        size = sum(int(nbytes[x]) for x in set(acc["tensor_id"][acc["op_id"] == i]) if kind[x] == "all_gather")
        ranks = 2 if ops["phase"][i] == "backward" and unit[i] > 0 else 4  # the blocks' (units 1, 2) in backward
        assert ops["duration_s"][i] == pytest.approx(collective_duration_s(profile, ops["op"][i], size, ranks)), i
        seen.append(ranks)
    assert sorted(seen) == [2, 2, 4, 4, 4, 4]  # each unit gathered in forward and again in backward


def test_planner_reshards_to_a_node_where_the_job_spans_nodes(tmp_path):
    """16 ranks of 8 per node (h100-80gb): a block's backward all-gather over the job crosses
    InfiniBand, over 8 ranks it stays on NVLink. At 80% of the per-rank peak the planner reshards
    a block to 8 ranks, and that setting beats every setting screened without one."""
    out = tmp_path / "t16"
    record_cli("--model", "gpt2", "--layers", "2", "--hidden", "512", "--heads", "8", "--vocab", "1000", "--seq",
               "128", "--batch", "2", "--fake", "--fsdp", "16", "--device-profile", "h100-80gb", "-o", str(out))
    plan = tmp_path / "t16.plan.json"
    r = CliRunner().invoke(main, ["solve", str(out), "--budget", "80%", "--method", "heuristic", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    assert "to 8 ranks" in r.output and "resharding after forward" in r.output
    obj = json.loads(plan.read_text())
    units = obj["decisions"]["reshard_after_forward"]["units"]
    assert 8 in [u["reshard_after_forward"] for u in units], units
    assert obj["predicted"]["planned_peak_bytes"] <= 0.8 * obj["predicted"]["baseline_peak_bytes"] + 1
    screened = obj["solver"]["stats"]["reshard_screen"]
    joint = obj["solver"]["stats"]["fsdp_joint_screen"]["joint"]
    assert joint["to"] and joint["step_time"] < min(t["step_time"] for t in screened if t["fits"] and not t["to"])
    r = CliRunner().invoke(main, ["inspect", str(plan)])  # the plan checks against its derived step
    assert r.exit_code == 0 and "post-forward shards" in r.output, r.output


def test_derived_plan_replays_on_four_gloo_ranks(int_trace, full_trace):
    """A plan of the step derived with the root kept gathered, both blocks resharding to 2
    ranks and every forward all-gather issued early, run by ``replay --nproc 4``: the ranks shard
    the blocks with ``reshard_after_forward=2`` (FSDP2 takes an int only in ``fully_shard``; the
    root as recorded, which apply then sets), each measures the predicted peak, shards bitwise,
    with the plan's settings as the measured step ran."""
    from taichi_plan.plan.format import reshard_settings, save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.sharding.prefetch import movable, prefetch_problem
    from taichi_plan.problem.sharding.reshard import reshard_problem
    from taichi_plan.solve.heuristic import plan_heuristic
    from taichi_plan.solve.result import make_plan

    d = int_trace[0]
    base = reshard_problem(build_problem(full_trace), {0: False, 1: 2, 2: 2})
    prob = prefetch_problem(base, {"forward": {g.unit for g in movable(base.trace)["forward"]}, "backward": set()})
    budget = int(0.55 * prob.recorded_problem.baseline_peak[0])
    plan = make_plan(prob, budget, "heuristic", plan_heuristic(prob, budget, seed=0, time_limit=60), 0.0, 0)
    path = d / "plans" / "derived.plan.json"
    save_plan(plan, path)
    assert reshard_settings(path) == {"": False, "transformer.h.0": 2, "transformer.h.1": 2}
    report, obj = replay_measures_the_prediction(path, nproc=4, fraction=0.55)
    # the blocks' post-forward ops added, the root's backward gathering gone
    assert obj["decisions"]["reshard_after_forward"]["num_ops"] == len(prob.trace.ops) != len(full_trace.ops)
    for rank in report["ranks"]:
        assert [r for _m, r in rank["reshard_after_forward"]] == [False, 2, 2], rank
        assert rank["fsdp_prefetch"] == {u["module"]: {"forward": u["forward_prefetch"], "backward": u["backward_prefetch"]}
                                         for u in obj["decisions"]["fsdp_prefetch"]["units"]}, rank


def test_usage_errors_name_the_factors(tmp_path):
    for args, words in [(["--fsdp", "4", "--reshard-to", "3"], ["--reshard-to is 3", "(2)"]),
                        (["--reshard-to", "2"], ["add --fsdp N"]),
                        (["--fsdp", "4", "--reshard-to", "2", "--no-reshard-after-forward"], ["give one of them"])]:
        r = CliRunner().invoke(main, ["record", *TINY, "--fake", *args, "-o", str(tmp_path / "x")])
        assert r.exit_code != 0 and "Traceback" not in r.output, r.output
        for w in words:
            assert w in r.output, (w, r.output)
        assert not (tmp_path / "x").exists()


def test_apply_refuses_an_int_the_model_was_not_sharded_with():
    """FSDP2 takes an int only in fully_shard: a plan that reshards a unit to 2 ranks is refused
    on a model sharded with True, by name; a bool set on an int unit is undone to the int."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from taichi_plan.base.errors import PlanError
    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import fake_process_group, shard_model
    from taichi_plan.torch_common.fsdp import param_group, reshard_of, set_reshard

    w = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=16, batch=1)
    with fake_process_group(4) as mesh, FakeTensorMode():
        model = w.build(True)[0]
        shard_model(model, mesh, {"transformer.h.1": 2})
        with pytest.raises(PlanError, match=r"transformer.h.0 to 2 ranks.*reshard_after_forward=2"):
            set_reshard(model, {"transformer.h.0": 2})
        set_reshard(model, {"transformer.h.1": 2})()  # as sharded: accepted
        h1 = param_group(model.transformer.h[1])
        undo = set_reshard(model, {"transformer.h.1": False})
        assert reshard_of(h1) is False
        undo()
        assert reshard_of(h1) == 2


def test_a_model_is_accepted_with_bools_as_recorded_or_planned_and_ints_as_planned():
    """What apply accepts of a live layout before it sets the bools (replay._sharded_as): each
    unit's bool as recorded or as the plan says, an int only as the plan says. A unit left at its
    recorded bool where the plan has an int passes here, and set_reshard then names the int to
    give fully_shard (test_apply_refuses_an_int_the_model_was_not_sharded_with)."""
    from taichi_plan.replay import _sharded_as

    def lay(*units):
        return {"world_size": 4, "mesh_shape": [4], "units": [[m, r] for m, r in zip(("", "a", "b"), units)]}

    recorded, planned = lay(True, True, True), lay(False, 2, True)
    assert _sharded_as(lay(False, 2, True), planned, recorded)
    assert _sharded_as(lay(True, 2, True), planned, recorded)      # the root's bool as recorded
    assert _sharded_as(lay(True, True, True), planned, recorded)  # as recorded: set_reshard names the int
    assert not _sharded_as(lay(True, 2, False), planned, recorded)    # a bool neither recorded nor planned
    assert not _sharded_as(lay(False, 4, True), planned, recorded)    # another int
    assert not _sharded_as({**lay(False, 2, True), "world_size": 8}, planned, recorded)
