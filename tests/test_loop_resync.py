"""Where a live step is in the recorded one, when the loop does not run the step straight
through: a step the loop abandons (an exception it catches, a batch it skips), a model called
again after its own ``optimizer.step()`` (a GAN's discriminator), and a copy of a planned
model (``copy.deepcopy``). Each trains with the plan on, parameters bitwise those of the
unplanned loop, the peak measured by a live-storage counter (``tests/live_peak.py``)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from live_peak import LivePeak

import taichi_plan
from taichi_plan.base.errors import InfeasibleBudgetError, MismatchError
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import Loop, record_step
from taichi_plan.solve import solve

WIDTH, BATCH = 256, 256


def mlp(seed=0, layers=2):
    torch.manual_seed(seed)
    mods = [torch.nn.Linear(32, WIDTH), torch.nn.GELU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(WIDTH, 1))


def batches(n, seed=10):
    return [torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(seed + i)) for i in range(n)]


def save(trace, plan, tmp_path, name="p"):
    taichi_plan.write_trace(trace, tmp_path / f"{name}-trace")
    plan.trace["path"] = str(tmp_path / f"{name}-trace")
    return save_plan(plan, tmp_path / f"{name}.plan.json")


def solved(trace, frac=0.8, **kw):
    problem = build_problem(trace)
    try:
        plan = solve(trace, int(problem.baseline_peak[0] * frac), "heuristic", problem=problem,
                     optimizer="as-recorded", **kw)
    except InfeasibleBudgetError as e:
        plan = solve(trace, int(e.min_budget_bytes), "heuristic", problem=problem, optimizer="as-recorded", **kw)
    assert plan.recompute, "the plan drops nothing: the test would prove nothing"
    return plan


def params(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


def assert_bitwise(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class Skip(Exception):
    pass


def accum_step(model, opt, mbs, abort_after=None, where="loss"):
    """Gradient accumulation over ``mbs``; with ``abort_after=i`` the loop gives up on the step
    at micro-batch ``i`` (its forward raises, or its loss: "skip this batch")."""
    opt.zero_grad()
    for i, x in enumerate(mbs):
        if i == abort_after and where == "forward":
            h = model[0].register_forward_hook(lambda *_: (_ for _ in ()).throw(Skip("in forward")))
            try:
                model(x)
            finally:
                h.remove()
        loss = model(x).square().mean() / len(mbs)
        if i == abort_after:
            raise Skip("loss is NaN: skip this batch")
        loss.backward()
    opt.step()


@pytest.mark.parametrize(("micro", "abort_after", "where"), [(2, 0, "loss"), (2, 1, "loss"), (1, 0, "loss"),
                                                             (3, 1, "forward")])
def test_a_step_the_loop_abandons_does_not_shift_the_next_ones(tmp_path, micro, abort_after, where):
    mbs = batches(micro)
    model, _ = mlp(1), None
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trace = record_step(model, opt, lambda: accum_step(model, opt, mbs), inputs=mbs,
                        loop=Loop(micro_batches=micro), args={"batch": BATCH})
    plan = solved(trace)
    path = save(trace, plan, tmp_path)

    def run(planned):
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if planned:
            taichi_plan.apply(model, path, optimizer=opt)
        peaks = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "called the model N times" after the abandoned step
            for s in range(4):
                try:
                    with LivePeak(params(model) and [*model.parameters(), *mbs]) as lp:
                        accum_step(model, opt, mbs, abort_after=abort_after if s == 1 else None, where=where)
                except Skip:
                    continue
                peaks.append(lp.peak)
        if planned:
            rt = model._taichi_plan["runtime"]
            assert rt.mismatches == 0 and rt.planned_calls >= 3
            taichi_plan.finish(model)
        return params(model), peaks

    base, _ = run(False)
    got, peaks = run(True)
    assert_bitwise(base, got)
    assert max(peaks) <= plan.budget_bytes


def test_a_mismatch_raised_does_not_count_the_call(tmp_path):
    mbs = batches(2)
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    trace = record_step(model, opt, lambda: accum_step(model, opt, mbs), inputs=mbs,
                        loop=Loop(micro_batches=2), args={"batch": BATCH})
    path = save(trace, solved(trace), tmp_path)
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    taichi_plan.apply(model, path, optimizer=opt)
    big = [torch.randn(2 * BATCH, 32)] * 2
    with pytest.raises(MismatchError, match="other inputs"):
        accum_step(model, opt, big)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            accum_step(model, opt, mbs)
    rt = model._taichi_plan["runtime"]
    assert rt.mismatches == 1 and rt.planned_calls >= 2
    taichi_plan.finish(model)


def test_an_unrecorded_second_forward_is_still_reported(tmp_path):
    # Two forwards alive before one backward, where the loop was recorded with one: more
    # memory than the plan's prediction; the graph-liveness check must not read it as a new step.
    x = batches(1)[0]
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(m, o, twice=False):
        o.zero_grad()
        loss = m(x).square().mean()
        if twice:
            loss = loss + m(x * 2).square().mean()
        loss.backward()
        o.step()

    trace = record_step(model, opt, lambda: step(model, opt), inputs=[x], args={"batch": BATCH})
    path = save(trace, solved(trace), tmp_path)
    taichi_plan.apply(model, path, optimizer=opt)
    with pytest.warns(UserWarning, match=r"called the model 2 time\(s\)"):
        step(model, opt, twice=True)
    taichi_plan.finish(model)


def gan():
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, 32))
    d = mlp(0)
    return g, d, torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)


def gan_step(g, d, opt_g, opt_d, z, real):
    opt_g.zero_grad()
    opt_d.zero_grad()
    fake = g(z)
    (F.softplus(d(fake.detach())).mean() + F.softplus(-d(real)).mean()).backward()
    opt_d.step()
    d.requires_grad_(False)
    F.softplus(-d(fake)).mean().backward()  # the discriminator again, after its own step
    opt_g.step()
    d.requires_grad_(True)


def test_a_model_called_again_after_its_optimizer_step(tmp_path):
    z, real = batches(2)
    g, d, opt_g, opt_d = gan()
    trace = record_step(d, opt_d, lambda: gan_step(g, d, opt_g, opt_d, z, real), inputs=[z, real],
                        loop=Loop(forwards=3), args={"batch": BATCH})
    plan = solved(trace, frac=0.75)
    path = save(trace, plan, tmp_path)

    def run(planned):
        g, d, opt_g, opt_d = gan()
        if planned:
            taichi_plan.apply(d, path, optimizer=opt_d)
        for _ in range(3):
            state = [*g.parameters(), *d.parameters(), z, real] + [
                v for o in (opt_g, opt_d) for st in o.state.values() for v in st.values()]
            with LivePeak(state) as lp:
                gan_step(g, d, opt_g, opt_d, z, real)
        if planned:
            assert d._taichi_plan["runtime"].mismatches == 0
            taichi_plan.finish(d)
        return params(g, d), lp.peak

    base, _ = run(False)
    got, peak = run(True)
    assert_bitwise(base, got)
    # Each call runs its own recorded call's plan: the step's peak is the predicted one (the
    # optimizer's post-step hook used to restart the count at call 0, so the call after the
    # step ran call 0's plan, 7% over the budget).
    assert peak == plan.predicted["planned_peak_bytes"] <= plan.budget_bytes


def test_a_copy_of_a_planned_model_is_its_own_unplanned_model(tmp_path):
    x = batches(1)[0]
    model = mlp(1, layers=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    trace = record_step(model, opt, lambda: step(model, opt), inputs=[x], args={"batch": BATCH})
    problem = build_problem(trace)
    # a module checkpointed whole (a partition of one chunk): its forward is replaced while planned
    plan = solve(trace, int(problem.baseline_peak[0] * 0.8), "heuristic", problem=problem,
                 optimizer="as-recorded")
    path = save(trace, plan, tmp_path)

    model = mlp(0, layers=3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    taichi_plan.apply(model, path, optimizer=opt)
    step(model, opt)
    twin = copy.deepcopy(model)
    assert getattr(twin, "_taichi_plan", None) is None
    assert all("forward" not in m.__dict__ or not hasattr(m.forward, "run") for m in twin.modules())
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # the copy computes with its own weights, never the original's
    ref = mlp(0, layers=3)
    ref.load_state_dict(twin.state_dict())
    torch.testing.assert_close(twin(x), ref(x), rtol=0, atol=0)
    opt2 = torch.optim.SGD(twin.parameters(), lr=1e-2)
    rt = model._taichi_plan["runtime"]
    calls = rt.planned_calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            step(twin, opt2)  # trains unplanned, counted on nobody's runtime
        assert rt.planned_calls == calls
        taichi_plan.finish(twin)  # nothing of the original's is removed
        step(model, opt)
    assert rt.planned_calls == calls + 1 and rt.mismatches == 0
    taichi_plan.apply(twin, path, optimizer=opt2)  # and the copy can have a plan of its own
    step(twin, opt2)
    assert twin._taichi_plan["runtime"].planned_calls == 1
    taichi_plan.finish(twin)
    taichi_plan.finish(model)


def test_a_copy_runs_its_own_modules_not_the_originals_planned_forwards():
    # A module split into chunks, and a head split over tokens, have their forward replaced
    # while planned; a copy made then gets its own modules' forwards back.
    from taichi_plan.plan.format import Partition
    from taichi_plan.runtime.partition import install_partitions

    x = batches(1)[0]
    model = mlp(0, layers=3)
    undo = install_partitions(model, [Partition("2", 0, 2), Partition("6", 0, 2, over="tokens")], None)
    assert all(hasattr(model[k].forward, "run") for k in (2, 6))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    ref = mlp(0, layers=3)
    ref.load_state_dict(twin.state_dict())
    torch.testing.assert_close(twin(x), ref(x), rtol=0, atol=0)
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    undo()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_parameters_frozen_or_unfrozen_after_recording_are_a_mismatch(tmp_path):
    # Autograd saves other tensors then (a rebuild found an input nobody held: "has no recipe",
    # mid-backward), and the gradients and AdamW state differ from what the plan counted (14%
    # over budget, silently): said before the forward, by the trace's trainable signature (v12).
    x = batches(1)[0]

    def build(frozen):
        model = mlp(0, layers=3)
        model[0].requires_grad_(not frozen)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    model, opt = build(frozen=True)
    trace = record_step(model, opt, lambda: step(model, opt), inputs=[x], args={"batch": BATCH})
    assert trace.meta["model_calls"][0]["trainable"][0] == 6  # 8 parameters, the first layer's 2 frozen
    path = save(trace, solved(trace), tmp_path)
    model, opt = build(frozen=True)
    taichi_plan.apply(model, path, optimizer=opt)
    step(model, opt)
    model[2].requires_grad_(False)
    with pytest.raises(MismatchError, match="trains 4 parameters .* recorded with 6"):
        step(model, opt)
    model[2].requires_grad_(True)
    model[0].requires_grad_(True)
    with pytest.raises(MismatchError, match="trains 8 parameters .* recorded with 6"):
        step(model, opt)
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(model, opt)  # as recorded again: planned, no warning
    rt = model._taichi_plan["runtime"]
    assert rt.mismatches == 2 and rt.planned_calls == 2
    taichi_plan.finish(model)


def test_a_step_whose_optimizer_step_is_skipped_after_backward(tmp_path):
    # GradScaler skips optimizer.step() on a step whose gradients overflowed: backward ran,
    # then zero_grad, and the next step starts. The loop's `loss` still holds the graph's nodes
    # then (only the saved tensors are freed by backward): backward having reached the call's
    # outputs, and the gradients cleared since, is what says a new step began.
    x = batches(1)[0]
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def loop(m, o, skip_at=None, steps=4):
        loss = None
        for s in range(steps):
            o.zero_grad()
            loss = m(x).square().mean()
            loss.backward()
            if s != skip_at:
                o.step()
        return loss

    trace = record_step(model, opt, lambda: loop(model, opt, steps=1), inputs=[x], args={"batch": BATCH})
    path = save(trace, solved(trace), tmp_path)
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    taichi_plan.apply(model, path, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "called the model 2 times" after the skipped step
        loop(model, opt, skip_at=1)
    assert model._taichi_plan["runtime"].mismatches == 0
    taichi_plan.finish(model)


def test_a_model_that_builds_a_buffer_on_its_first_call(tmp_path):
    # The recorder keeps a step after an unrecorded warm-up one, so a model that makes its mask
    # on its first call runs other ops in the first step with the plan: said as that, not as
    # "the model changed"; with on_mismatch="warn" that step runs unplanned and the next ones
    # planned, bitwise like the unplanned run.
    from live_peak import step_peak

    from taichi_plan.record import get_workload, record

    build = get_workload(entry="tiny_models:lazy_mask_lm").build
    trace = record(*build(False))
    path = save(trace, solved(trace, frac=0.85), tmp_path)
    model, ids, loss_fn, opt = build(False)
    taichi_plan.apply(model, path, optimizer=opt)
    with pytest.raises(MismatchError, match="first step with the plan.*1 unrecorded warm-up step"):
        step_peak(model, opt, ids, loss_fn)
    taichi_plan.finish(model)

    def run(planned):
        model, ids, loss_fn, opt = build(False)
        if planned:
            taichi_plan.apply(model, path, optimizer=opt, on_mismatch="warn")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                step_peak(model, opt, ids, loss_fn)
        if planned:
            said = [str(w.message) for w in seen if "first step with the plan" in str(w.message)]
            assert len(said) == 1 and "on_mismatch='warn'" not in said[0], said  # (already so)
            assert model._taichi_plan["runtime"].mismatches == 1
            taichi_plan.finish(model)
        return params(model)

    assert_bitwise(run(False), run(True))
