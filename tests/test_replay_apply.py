"""Replay's user paths on real recordings: apply() in a plain loop, the input guard, plans
that are broken or whose trace moved, the replay command's report. Recordings and plans are
shared per test process with test_replay.py (tests/replay_cases.py)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from replay_cases import MODELS

import taichi_plan
from taichi_plan.base.errors import MismatchError, PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import Partition, load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload
from taichi_plan.replay.measure import replay
from taichi_plan.runtime.calls import plan_and_trace
from taichi_plan.solve.result import Decisions, make_plan


def test_apply_in_a_plain_loop(replay_cases, tmp_path):
    from examples.train_with_plan import main as train

    root = replay_cases.root
    plan = replay_cases.plan("gpt2", 0.7)[0]
    plan_path = root / "loop.plan.json"
    save_plan(plan, plan_path, force=True)
    losses = train([str(plan_path), "--steps", "3"])
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def _gpt2(seq):
    wl = get_workload(**{**MODELS["gpt2"], "seq": seq})
    torch.manual_seed(0)
    return wl.build(False)


def test_guard_names_the_input_that_differs(replay_cases):
    root = replay_cases.root
    plan = replay_cases.plan("gpt2", 0.7)[0]
    plan_path = root / "guard.plan.json"
    save_plan(plan, plan_path, force=True)
    model, batch, loss_fn, _ = _gpt2(128)  # a longer sequence: stopped before any op runs
    model = taichi_plan.apply(model, plan_path)
    with pytest.raises(MismatchError) as e:
        loss_fn(model(**batch), batch).backward()
    msg = str(e.value)
    assert "input_ids is [4, 128]" in msg and "[4, 64]" in msg
    taichi_plan.finish(model)

    model, batch, loss_fn, _ = _gpt2(128)
    model = taichi_plan.apply(model, plan_path, on_mismatch="warn")
    with pytest.warns(UserWarning, match="runs unplanned"):
        loss_fn(model(**batch), batch).backward()
    assert model._taichi_plan["runtime"].planned_calls == 0
    taichi_plan.finish(model)


def test_bad_plans(replay_cases, tmp_path):
    root = replay_cases.root
    plan = replay_cases.plan("gpt2", 0.7)[0]
    good = root / "bad-base.plan.json"
    save_plan(plan, good, force=True)

    truncated = tmp_path / "t.plan.json"
    truncated.write_text(good.read_text()[:200])
    with pytest.raises(PlanError, match="not valid JSON"):
        plan_and_trace(truncated)

    other = json.loads(good.read_text())
    other["trace"]["path"] = str(replay_cases.trace("mlp")[0])  # a plan pointing at another model's trace
    other["trace"]["path_absolute"] = str(replay_cases.trace("mlp")[0])  # (format v2 keeps both paths)
    p2 = tmp_path / "other.plan.json"
    p2.write_text(json.dumps(other))
    with pytest.raises(PlanError):
        plan_and_trace(p2)

    missing = make_plan(build_problem(replay_cases.trace("gpt2")[1]), None, "manual",
                        Decisions(partitions=[Partition("transformer.h.0.mlp.act", 0, 2)]), 0.0, 0)
    missing.partitions[0].module = "transformer.h.9.mlp.act"
    p3 = tmp_path / "missing.plan.json"
    save_plan(missing, p3)
    with pytest.raises(PlanError, match="h.9"):
        replay(p3, steps=1)

    r = CliRunner().invoke(main, ["replay", str(truncated)])
    assert r.exit_code == PlanError.exit_code and "JSON" in r.output


def test_replay_cli_writes_report(replay_cases):
    root = replay_cases.root
    plan = replay_cases.plan("mlp", 0.7)[0]
    plan_path = root / "cli.plan.json"
    save_plan(plan, plan_path, force=True)
    r = CliRunner().invoke(main, ["replay", str(plan_path), "--steps", "1"])
    assert r.exit_code == 0, r.output
    report = json.loads((root / "cli.replay.json").read_text())
    assert report["measured_peak_bytes"] == load_plan(plan_path).predicted["planned_peak_bytes"]
    assert "gradients          match" in r.output


def test_replay_and_apply_take_the_trace_when_it_moved(replay_cases, tmp_path):
    import shutil

    plan = replay_cases.plan("mlp", 0.7)[0]
    plan_path = tmp_path / "plans" / "moved.plan.json"
    plan_path.parent.mkdir()
    save_plan(plan, plan_path)
    moved = tmp_path / "elsewhere" / "mlp"
    shutil.copytree(replay_cases.trace("mlp")[0], moved)
    # The plan finds its trace where it was solved; point it nowhere, then override.
    data = json.loads(plan_path.read_text())
    data["trace"]["path"] = data["trace"]["path_absolute"] = str(tmp_path / "gone")
    plan_path.write_text(json.dumps(data))
    r = CliRunner().invoke(main, ["replay", str(plan_path), "--steps", "1"])
    assert r.exit_code == PlanError.exit_code and "--trace" in r.output, r.output
    r = CliRunner().invoke(main, ["replay", str(plan_path), "--steps", "1", "--trace", str(moved), "--json"])
    assert r.exit_code == 0, r.output
    wl = get_workload(**MODELS["mlp"])
    model, batch, loss_fn, opt = wl.build(False)
    model = taichi_plan.apply(model, plan_path, optimizer=opt, trace=moved)
    assert model._taichi_plan["plan"].predicted == plan.predicted
    taichi_plan.finish(model)


def test_a_model_whose_steps_differ_says_so_on_mismatch():
    """Layerdrop (wav2vec2's default) changes the op sequence from step to step: the recording
    warns, and a plan applied to such a model stops at the first step that differs. It said
    "The model or its code changed since the trace was recorded: record and solve again",
    which cannot help; it now names the difference the recording saw and the way out."""
    import warnings

    from taichi_plan.record import record_workload
    from taichi_plan.simulate.core import Drop

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = record_workload(get_workload(entry="tiny_models:layerdrop_mlp"), fake=False, calibrate=False, steps=3)
    assert trace.meta["steps_match"] is False
    problem = build_problem(trace)
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in zip(problem.candidates, problem.cand_free_after,
                                                            problem.cand_remat_before, strict=True)]
    plan = make_plan(problem, None, "manual", Decisions(drops=drops[:2]), 0.0, 0)
    model, x, loss_fn, opt = get_workload(entry="tiny_models:layerdrop_mlp").build(False)
    model = taichi_plan.apply(model, plan, trace=trace)
    with pytest.raises(MismatchError, match="recorded steps already differed") as e:
        for _ in range(20):
            opt.zero_grad()
            loss_fn(model(x), x).backward()
            opt.step()
    assert "layerdrop=0" in str(e.value) and "on_mismatch='warn'" in str(e.value)
    taichi_plan.finish(model)
