"""The optimizer step as part of the plan: stepping in backward, modelled and replayed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import taichi_plan
from taichi_plan.base.errors import InfeasibleBudgetError, PlanError, UsageError
from taichi_plan.plan.format import FORMAT_VERSION as PLAN_VERSION
from taichi_plan.plan.format import load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.optimizer.plan import (
    in_backward_refusal,
    optimizer_view,
    parameter_steps,
    view_problem,
)
from taichi_plan.problem.partition.floor import floor_bytes
from taichi_plan.record import Loop, get_workload, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.solve import solve
from taichi_plan.trace.format import baseline_live_bytes, validate, write_trace

# The README's mlp shape, smaller: AdamW over 3 layers; its peak is in the optimizer step.
MLP = dict(model="mlp", hidden=256, layers=3, batch=8)
# Large activations: a plan on the in-backward step drops some of them too.
MLP_WIDE_BATCH = dict(model="mlp", hidden=128, layers=3, batch=128)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    trace = record_workload(get_workload(**MLP), fake=False)
    path = write_trace(trace, tmp_path_factory.mktemp("optim") / "mlp")
    return taichi_plan.read_trace(path)


def test_the_step_splits_per_parameter_and_the_view_frees_each_gradient(mlp):
    steps = parameter_steps(mlp)
    params = mlp.tensors[mlp.tensors["kind"] == "parameter"]
    assert sorted(s.param for s in steps) == sorted(params["tensor_id"].tolist())
    opt_ops = set(np.nonzero(mlp.ops["phase"].to_numpy() == "optimizer")[0].tolist())
    assert set().union(*(s.ops for s in steps)) == opt_ops  # every op of the step belongs to one parameter

    view = optimizer_view(mlp, "in-backward")
    validate(view)
    assert sorted(view.ops["op"]) == sorted(mlp.ops["op"])  # the same ops, reordered
    fwd = mlp.ops["phase"].to_numpy() == "forward"
    assert view.ops["op"][fwd].tolist() == mlp.ops["op"][fwd].tolist()  # forward ops keep their ids
    grads = baseline_live_bytes(mlp, by_kind=True)["gradient"]
    grads_view = baseline_live_bytes(view, by_kind=True)["gradient"]
    total = int(mlp.tensors["nbytes"][mlp.tensors["kind"] == "gradient"].sum())
    assert grads.max() == total  # as recorded, every gradient is live in the optimizer step
    largest = int(mlp.tensors["nbytes"][mlp.tensors["kind"] == "gradient"].max())
    assert grads_view.max() <= 2 * largest < total  # stepped in backward: at most a couple at once
    # Each parameter's ops run right after the last backward op that touches its gradient.
    pos = view.position
    for s in steps:
        assert [int(pos[o]) for o in s.ops] == list(range(int(pos[s.ready_op]) + 1, int(pos[s.ready_op]) + 1 + len(s.ops)))


def test_what_a_parameters_step_makes_dies_when_its_step_returns():
    # AdamW's per-parameter loop frees a parameter's denominator when the next parameter's
    # iteration makes its own. Layers registered in the reverse of their use order make each
    # next parameter's gradient ready later in backward: in the view that iteration runs after
    # backward ops, and the denominator was held through them (a Falcon's in-backward plan was
    # predicted 16 KB above its measured peak). The step call in the hook returns at once.
    from taichi_plan.record import record

    class Reversed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(4))

        def forward(self, x):
            for layer in reversed(self.layers):
                x = torch.relu(layer(x))
            return x

    torch.manual_seed(0)
    model = Reversed()
    x = torch.randn(32, 64)
    trace = record(model, x, lambda out, b: out.square().mean(), torch.optim.AdamW(model.parameters(), lr=1e-3))
    steps = parameter_steps(trace)
    view = optimizer_view(trace, "in-backward")
    pos = view.position
    acc = trace.accesses
    step_of = {o: k for k, s in enumerate(steps) for o in s.ops}
    own = 0
    for t, prod in zip(trace.tensors["tensor_id"].tolist(), trace.tensors["producer_op"].tolist(), strict=True):
        k = step_of.get(prod)
        users = {step_of.get(o, -1) for o in acc["op_id"][acc["tensor_id"] == t].tolist()}
        if k is not None and users == {k} and t != steps[k].grad:
            free = int(view.tensors["free_op"][view.tensors["tensor_id"] == t].iloc[0])
            assert 0 <= free <= int(pos[steps[k].ops[-1]]), (t, free, int(pos[steps[k].ops[-1]]))
            own += 1
    assert own >= len(steps)  # at least one per parameter (its denominator)


def test_loops_that_need_every_gradient_refuse_stepping_in_backward():
    wl = get_workload(model="mlp", hidden=64, layers=2, batch=4)
    for loop, words in ((Loop(micro_batches=2), "micro-batches"), (Loop(clip_grad_norm=1.0), "clips"),
                        (Loop(set_to_none=False), "keeps its gradients")):
        trace = record_workload(wl, fake=False, loop=loop)
        why = in_backward_refusal(trace)
        assert why is not None and words in why, why
        with pytest.raises(UsageError, match="in-backward cannot be used"):
            solve(trace, int(build_problem(trace).baseline_peak[0] * 0.9), optimizer="in-backward")
        # auto never steps such a loop in backward: it falls back to what activations can do
        plan = solve(trace, int(build_problem(trace).baseline_peak[0]), optimizer="auto")
        assert plan.optimizer is None


def test_auto_keeps_the_recorded_step_when_it_fits_and_steps_in_backward_below_its_floor(mlp, tmp_path):
    p = build_problem(mlp)
    floor = int(floor_bytes(p).max())
    kept = solve(mlp, int(p.baseline_peak[0]), problem=p)
    assert kept.optimizer is None
    with pytest.raises(InfeasibleBudgetError):
        solve(mlp, floor - 1, problem=p, optimizer="as-recorded")
    v = view_problem(p, "in-backward")
    plan = solve(mlp, floor - 1, problem=p, time_limit=60, work_limit=5)
    assert plan.optimizer["mode"] == "in-backward" and plan.optimizer["chosen_by"] == "auto"
    assert plan.predicted["planned_peak_bytes"] <= floor - 1
    assert plan.predicted["baseline_peak_bytes"] == p.baseline_peak[0]  # the unplanned run is as recorded
    assert plan.predicted["planned_peak_bytes"] >= int(floor_bytes(v).max())
    path = save_plan(plan, tmp_path / "p.plan.json")
    back = load_plan(path)
    assert back.optimizer == plan.optimizer and back.to_json()["format_version"] == PLAN_VERSION


def test_the_infeasible_message_states_the_floor_parts_and_the_option(mlp):
    p = build_problem(mlp)
    floor = int(floor_bytes(p).max())
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(mlp, floor - 1, "heuristic", problem=p, optimizer="as-recorded")
    msg = " ".join(str(e.value).split())
    for part in ("parameters", "optimizer state", "gradients", "activations"):
        assert part in msg, msg
    saved = floor - int(floor_bytes(view_problem(p, "in-backward")).max())
    assert saved > 0 and "--optimizer in-backward" in msg
    assert taichi_plan.base.units.format_bytes(saved) + " less" in msg, msg
    assert "reduce the batch size" not in msg


def _train(model, batch, loss_fn, optimizer, scheduler, steps):
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(batch), batch).backward()
        optimizer.step()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def _build(flags, foreach, schedule=True):
    torch.manual_seed(0)
    model, batch, loss_fn, _opt = get_workload(**flags).build(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, (lambda s: 1.0 / (1 + s)) if schedule else (lambda s: 1.0))
    return model, batch, loss_fn, opt, sched


@pytest.mark.parametrize("foreach", [False, True])
def test_stepping_in_backward_trains_bitwise_like_the_plain_loop(mlp, foreach):
    """Weight decay and a learning rate that changes every step: a hook that stepped twice,
    missed a step or kept a stale learning rate would not give the same bits."""
    plan = solve(mlp, int(view_problem(build_problem(mlp), "in-backward").baseline_peak[0]),
                 optimizer="in-backward")
    assert plan.optimizer["mode"] == "in-backward"
    plain = _train(*_build(MLP, foreach=False), steps=3)
    model, batch, loss_fn, opt, sched = _build(MLP, foreach=foreach)
    with pytest.raises(PlanError, match="needs the optimizer"):
        taichi_plan.apply(model, plan)
    taichi_plan.apply(model, plan, optimizer=opt)
    planned = _train(model, batch, loss_fn, opt, sched, steps=3)
    assert all(p.grad is None for p in model.parameters())  # freed in backward, each after its update
    taichi_plan.finish(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    # The check can fail: without the schedule the same steps give other bits.
    flat = _train(*_build(MLP, foreach=False, schedule=False), steps=3)
    assert not all(torch.equal(a, b) for a, b in zip(plain, flat, strict=True))


def test_replay_measures_the_predicted_peak_with_drops_and_in_backward(tmp_path):
    trace = record_workload(get_workload(**MLP_WIDE_BATCH), fake=False)
    path = write_trace(trace, tmp_path / "mlp")
    p = build_problem(trace)
    v = view_problem(p, "in-backward")
    budget = int(floor_bytes(v).max()) + 1
    assert budget < int(floor_bytes(p).max())  # below what the recorded step can reach
    plan = solve(taichi_plan.read_trace(path), budget, time_limit=60, work_limit=5)
    assert plan.optimizer["mode"] == "in-backward" and plan.recompute  # activations dropped as well
    plan_path = save_plan(plan, tmp_path / "mlp.plan.json")
    r = replay(plan_path, steps=2)
    assert r["measured_peak_bytes"] == plan.predicted["planned_peak_bytes"]
    assert r["baseline_measured_peak_bytes"] == plan.predicted["baseline_peak_bytes"]
    assert r["grads_match"] and "parameters only" in r["grads_check"]


def _foreach_mlp():
    torch.manual_seed(0)
    model, batch, loss_fn, _opt = get_workload(**MLP).build(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    return model, batch, loss_fn, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def test_a_foreach_step_runs_in_groups_bitwise_and_measured_as_predicted():
    """AdamW(foreach=True): every parameter's temporaries live at once in the recorded step;
    in groups only one group's do. The peak measured by recording the planned step equals the
    predicted one, and the parameters after 3 steps equal the plain run's bitwise."""
    from taichi_plan.problem.optimizer.groups import foreach_step
    from taichi_plan.record.api import record
    from taichi_plan.trace.format import baseline_peak

    model, batch, loss_fn, opt, _sched = _foreach_mlp()
    trace = record(model, batch, loss_fn, opt)
    assert not isinstance(foreach_step(trace), str)
    p = build_problem(trace)
    floor = int(floor_bytes(p).max())
    plan = solve(trace, floor - 1, problem=p)
    assert plan.optimizer["mode"] == "groups" and len(plan.optimizer["groups"]) >= 2
    assert plan.predicted["planned_peak_bytes"] <= floor - 1

    plain = _train(*_foreach_mlp(), steps=3)
    model, batch, loss_fn, opt, sched = _foreach_mlp()
    taichi_plan.apply(model, plan, optimizer=opt, trace=trace)
    planned = _train(model, batch, loss_fn, opt, sched, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    measured = record(model, batch, loss_fn, opt)  # the planned step, recorded: its peak is the measured one
    taichi_plan.finish(model)
    assert baseline_peak(measured)[0] == plan.predicted["planned_peak_bytes"]
    # In groups the step runs inside the user's optimizer.step(), after a GradScaler unscaled
    # every gradient: scaled training is bitwise the unplanned run's too.
    plain = _train_scaled(*_foreach_mlp(), steps=3)
    model, batch, loss_fn, opt, sched = _foreach_mlp()
    taichi_plan.apply(model, plan, optimizer=opt, trace=trace)
    planned = _train_scaled(model, batch, loss_fn, opt, sched, steps=3)
    taichi_plan.finish(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


def _train_scaled(model, batch, loss_fn, optimizer, scheduler, steps):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss_fn(model(batch), batch)).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_foreach_step_can_be_stepped_in_backward_too():
    """On GPU PyTorch steps AdamW with foreach ops by default: stepped in backward, each
    parameter's hook runs those ops over that parameter alone. The simulator splits the
    foreach step per parameter first, then moves each parameter's share into backward."""
    from taichi_plan.record.api import record
    from taichi_plan.trace.format import baseline_peak

    model, batch, loss_fn, opt, _sched = _foreach_mlp()
    trace = record(model, batch, loss_fn, opt)
    assert in_backward_refusal(trace) is None
    p = build_problem(trace)
    v = view_problem(p, "in-backward")
    validate(v.trace)
    assert v.num_ops > p.num_ops  # each foreach op split per parameter
    plan = solve(trace, int(v.baseline_peak[0]), problem=p, optimizer="in-backward")
    assert plan.predicted["planned_peak_bytes"] < p.baseline_peak[0]

    plain = _train(*_foreach_mlp(), steps=3)
    model, batch, loss_fn, opt, sched = _foreach_mlp()
    taichi_plan.apply(model, plan, optimizer=opt, trace=trace)
    planned = _train(model, batch, loss_fn, opt, sched, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))
    measured = record(model, batch, loss_fn, opt)
    taichi_plan.finish(model)
    assert baseline_peak(measured)[0] == plan.predicted["planned_peak_bytes"]


def test_the_trainer_callback_refuses_a_plan_that_steps_the_optimizer(mlp):
    pytest.importorskip("accelerate")
    from taichi_plan.integrations.hf import PlanCallback

    plan = solve(mlp, int(view_problem(build_problem(mlp), "in-backward").baseline_peak[0]), optimizer="in-backward")
    with pytest.raises(PlanError, match="PlanCallback does not run"):
        PlanCallback(plan, trace=mlp)


def test_accumulating_with_a_plan_that_steps_in_backward_raises_instead_of_stepping_twice(mlp):
    from taichi_plan.base.errors import MismatchError

    plan = solve(mlp, int(view_problem(build_problem(mlp), "in-backward").baseline_peak[0]), optimizer="in-backward")
    model, batch, loss_fn, opt, _sched = _build(MLP, foreach=False)
    taichi_plan.apply(model, plan, optimizer=opt)
    loss_fn(model(batch), batch).backward()
    with pytest.raises(MismatchError, match="second backward"):
        loss_fn(model(batch), batch).backward()
    # The refused backward leaves no partial gradient (its first parameter's) for the next to add to.
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # a step boundary: the next backward updates again
    loss_fn(model(batch), batch).backward()
    taichi_plan.finish(model)
    ref, ref_batch, ref_loss_fn, ref_opt, _ = _build(MLP, foreach=False)  # the same two steps, nothing refused
    taichi_plan.apply(ref, plan, optimizer=ref_opt)
    ref_loss_fn(ref(ref_batch), ref_batch).backward()
    ref_opt.step()
    ref_loss_fn(ref(ref_batch), ref_batch).backward()
    taichi_plan.finish(ref)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def test_a_grad_scaler_or_unrecorded_clipping_with_a_plan_that_steps_in_backward_raises(mlp):
    """A GradScaler must unscale every gradient, and skip the update when one is inf or NaN,
    before any update; clipping needs every gradient too. Stepping in backward, both would
    train otherwise, silently (the scaled gradients applied; nothing left to clip). They raise,
    the scaler before its backward, and go back to PyTorch's own functions at ``finish``."""
    from taichi_plan.base.errors import MismatchError

    scale, norm, value = torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_
    plan = solve(mlp, int(view_problem(build_problem(mlp), "in-backward").baseline_peak[0]), optimizer="in-backward")
    model, batch, loss_fn, opt, _sched = _build(MLP, foreach=False)
    before = [p.detach().clone() for p in model.parameters()]
    taichi_plan.apply(model, plan, optimizer=opt)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(MismatchError, match="GradScaler"):
        scaler.scale(loss_fn(model(batch), batch))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing stepped
    off = torch.amp.GradScaler("cpu", enabled=False)  # a disabled scaler returns the loss as it is
    off.scale(loss_fn(model(batch), batch)).backward()
    opt.step()
    with pytest.raises(MismatchError, match="clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(MismatchError, match="clip_grad_value_"):
        torch.nn.utils.clip_grad.clip_grad_value_(model.parameters(), 1.0)
    other = torch.nn.Linear(2, 2)  # parameters stepped after backward clip as before
    other(torch.ones(1, 2)).sum().backward()
    torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
    taichi_plan.finish(model)
    assert (torch.amp.GradScaler.scale, torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_) == (
        scale, norm, value)
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is norm


def test_the_options_sentence_never_says_a_peak_is_itself_instead():
    """``describe`` printed "peaks at 5.52 MB (op 462) instead of 5.52 MB" where stepping in
    backward lowered the unplanned peak by a few KB (a BART): the difference is given in bytes."""
    from types import SimpleNamespace

    from taichi_plan.problem.optimizer.plan import describe

    def view(before: int, after: int):
        rec = SimpleNamespace(baseline_peak=(before, 7))
        trace = SimpleNamespace(meta={"optimizer_view": {"mode": "in-backward", "parameters": 3}})
        return SimpleNamespace(trace=trace, recorded_problem=rec, baseline_peak=(after, 5), num_ops=9,
                               nbytes=np.array([400, 400]), kind=np.array(["gradient", "activation"]))

    assert "peaks at 5.52 MB (op 5), 4,000 bytes below the recorded step's peak" in describe(view(5_524_000, 5_520_000))["why"]
    assert "peaks at 4.00 MB (op 5) instead of 5.52 MB" in describe(view(5_520_000, 4_000_000))["why"]


def test_a_suggested_budget_names_the_optimizer_option_that_reached_it(mlp):
    # auto gives the recorded step the whole time limit: a budget reached only with the
    # optimizer stepped in backward, asked for without naming that option, timed out again
    # (a packed-sequence LSTM: 366.1KB suggested, then 381.77KB).
    from taichi_plan.solve.messages import timed_out_error

    v = view_problem(build_problem(mlp), "in-backward")
    msg = str(timed_out_error(v, 1000, "auto", 123_456, 5, 20.0, None))
    assert "with the optimizer stepped in backward" in msg and "(--budget 123.46KB --optimizer in-backward)" in msg
    plain = str(timed_out_error(build_problem(mlp), 1000, "auto", 123_456, 5, 20.0, None))
    assert "(--budget 123.46KB)" in plain and "--optimizer" not in plain
