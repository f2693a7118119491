"""Plans in the training loops people write (real CPU runs).

Each loop is recorded with its shape (``Loop``), solved at half of its peak, then trained for
a few steps planned and unplanned from the same seed: parameters must be bitwise equal (the
runtime rebuilds with the RNG state each op ran with, so dropout and ``randn_like`` match), or
allclose where the plan splits a module or the head's loss into chunks (``bitwise.py``), and
the planned step's peak, measured by a live-storage counter (``tests/live_peak.py``,
independent of the recorder and the simulator), must stay within the budget.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from bitwise import assert_trains_like
from live_peak import LivePeak

import taichi_plan
from taichi_plan.base.errors import InfeasibleBudgetError, MismatchError
from taichi_plan.problem.core import build_problem
from taichi_plan.record import Loop, get_workload, record
from taichi_plan.runtime.calls import recipe_ops
from taichi_plan.simulate.core import Drop
from taichi_plan.solve import solve
from taichi_plan.solve.result import Decisions, make_plan

GPT2 = dict(model="gpt2", layers=2, hidden=64, heads=2, vocab=512, seq=32, batch=4)


def state_tensors(model, opt, batch):
    out = [p for p in model.parameters()] + [b for b in model.buffers()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return out + [v for v in batch.values() if isinstance(v, torch.Tensor)]


def build(seed=0, freeze=False, **flags):
    torch.manual_seed(seed)
    model, batch, loss_fn, opt = get_workload(**{**GPT2, **flags}).build(False)
    if freeze:  # a frozen part: the embeddings get no gradient and no optimizer state
        for p in model.transformer.wte.parameters():
            p.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, batch, loss_fn, opt


def plan_for(loop: Loop, tmp_path, frac=0.5, **build_flags):
    model, batch, loss_fn, opt = build(seed=1, **build_flags)
    trace = record(model, batch, loss_fn, opt, loop=loop)
    problem = build_problem(trace)
    budget = int(problem.baseline_peak[0] * frac)
    try:  # activation plans in these loops: the recorded optimizer step (the options: test_optimizer_plan.py)
        plan = solve(trace, budget, "heuristic", problem=problem, optimizer="as-recorded")
    except InfeasibleBudgetError as e:
        plan = solve(trace, int(e.min_budget_bytes), "heuristic", problem=problem, optimizer="as-recorded")
    assert plan.recompute, "the plan drops nothing: the test would prove nothing"
    path = tmp_path / "loop.plan.json"
    taichi_plan.write_trace(trace, tmp_path / "trace")
    from taichi_plan.plan.format import save_plan

    plan.trace["path"] = str(tmp_path / "trace")
    save_plan(plan, path)
    return plan, path


def train(loop: Loop, steps: int, plan_path=None, eval_every: int = 0, eval_mode=torch.no_grad,
          **build_flags):
    """Train ``steps`` steps of ``loop`` (written out as a user would); returns the parameters,
    and the peak of the last step as :class:`LivePeak` measures it."""
    model, batch, loss_fn, opt = build(seed=0, **build_flags)
    if plan_path is not None:
        model = taichi_plan.apply(model, plan_path, optimizer=opt)
    device = "cpu"
    peak = None
    for s in range(steps):
        opt.zero_grad(set_to_none=loop.set_to_none)
        tracker = LivePeak(state_tensors(model, opt, batch)) if s == steps - 1 else None
        if tracker is not None:
            tracker.__enter__()
        for _ in range(loop.micro_batches):
            ctx = torch.autocast(device, dtype=torch.bfloat16) if loop.autocast else torch.autocast(device, enabled=False)
            with ctx:
                losses = [loss_fn(model(**batch), batch) for _ in range(loop.forwards)]
                loss = sum(losses[1:], losses[0])
                if loop.forwards > 1:
                    loss = loss / loop.forwards
                if loop.micro_batches > 1:
                    loss = loss / loop.micro_batches
                del losses
            loss.backward()
            del loss
        if loop.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_grad_norm)
        opt.step()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak = tracker.peak
        if eval_every and (s + 1) % eval_every == 0:
            model.eval()
            with eval_mode():
                model(**batch)
            model.train()
    if plan_path is not None:
        taichi_plan.finish(model)
    return [p.detach().clone() for p in model.parameters()], peak


LOOPS = {
    "plain": (Loop(), {}),
    "accumulate-2": (Loop(micro_batches=2), {}),
    "accumulate-4": (Loop(micro_batches=4), {}),
    "autocast-bf16": (Loop(autocast="bf16"), {}),
    "clip-grad-norm": (Loop(clip_grad_norm=1.0), {}),
    "zero-grad-keep": (Loop(set_to_none=False), {}),
    "two-forwards": (Loop(forwards=2), {}),
    "frozen-part": (Loop(), {"freeze": True}),
}


@pytest.fixture(scope="module")
def loop_plan(tmp_path_factory):
    """(plan, path) for a loop of LOOPS, recorded and solved once per test file for the tests
    that read it."""
    made = {}

    def get(name: str):
        if name not in made:
            loop, flags = LOOPS[name]
            made[name] = plan_for(loop, tmp_path_factory.mktemp(name), **flags)
        return made[name]

    return get


@pytest.fixture(scope="module")
def plain_plan(loop_plan):
    return loop_plan("plain")


@pytest.mark.parametrize("name", list(LOOPS))
def test_loop_trains_planned_bitwise_within_budget(name, loop_plan):
    loop, flags = LOOPS[name]
    plan, path = loop_plan(name)
    base, _ = train(loop, 3, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch may be reported
        planned, peak = train(loop, 3, plan_path=path, **flags)
    drops = sorted(f"{r.op_name}@{r.module}" for r in plan.recompute)
    assert_trains_like(base, planned, plan, lambda: train(loop, 3, **flags)[0],
                       f"plan: {len(drops)} drops {drops}, partitions {plan.partitions}", autocast=loop.autocast)
    assert peak <= plan.budget_bytes, (peak, plan.budget_bytes)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_eval_passes_run_unplanned(mode, plain_plan):
    loop = Loop()
    plan, path = plain_plan
    base, _ = train(loop, 4, eval_every=2, eval_mode=mode)
    planned, peak = train(loop, 4, plan_path=path, eval_every=2, eval_mode=mode)
    assert_trains_like(base, planned, plan, lambda: train(loop, 4, eval_every=2, eval_mode=mode)[0])
    assert peak <= plan.budget_bytes


def test_a_plan_for_another_loop_says_so(plain_plan):
    _, path = plain_plan
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model, path, optimizer=opt)
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    with pytest.raises(MismatchError, match="gradients alive"):  # a second micro-batch
        model(**batch)
    with warnings.catch_warnings():  # the call that raised ran nothing: not counted as the step's
        warnings.simplefilter("error")
        opt.step()
    taichi_plan.finish(model)
    model, batch, loss_fn, opt = build()  # warned and run unplanned, it is one of the step's calls
    model = taichi_plan.apply(model, path, optimizer=opt, on_mismatch="warn")
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    with pytest.warns(UserWarning, match="gradients alive"):
        model(**batch)
    with pytest.warns(UserWarning, match="1 micro-batch"):
        opt.step()
    taichi_plan.finish(model)


def test_mismatch_never_poisons_the_process(plain_plan):
    _, path = plain_plan
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model, path, optimizer=opt)
    larger = {k: torch.cat([v, v]) for k, v in batch.items()}  # a smaller one would run the plan
    with pytest.raises(MismatchError, match=r"input_ids is \[8, 32\]"):
        model(**larger)
    assert torch.equal(torch.ones(3) + 1, torch.full((3,), 2.0))  # nothing left installed
    # The next call with the recorded shapes runs planned again.
    rt = model._taichi_plan["runtime"]
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    assert rt.planned_calls == 1 and rt.dropped_storages > 0
    taichi_plan.finish(model)


def test_checkpointing_turned_on_after_recording_says_so(tmp_path):
    """A user who turns transformers' own checkpointing on by habit after recording: its
    saved-tensor hooks, not the plan's, keep what each layer saves, so the plan dropped nothing
    there while holding its recipes (a 2-layer GPT-2 at 70%: 5.5% over the budget, nothing said).
    The first op whose output the plan drops under hooks that are not the runtime's stops the
    plan for that call, by name; with ``on_mismatch="warn"`` the call runs as the model's own
    checkpointing makes it, and once that is off the next call runs planned again. A
    ``torch.utils.checkpoint`` or ``save_on_cpu`` inside the model is the same case."""
    # recorded without the KV cache, which transformers' checkpointing turns off (with it, the
    # causal mask's ops differ: an op mismatch before any drop, test_a_plan_for_another_loop_says_so)
    plan, path = plan_for(Loop(), tmp_path, kv_cache=False)

    def checkpointed(on_mismatch="raise"):
        model, batch, loss_fn, opt = build(kv_cache=False)
        model.gradient_checkpointing_enable()
        opt.zero_grad()  # one step before the plan, as the recording's warm-up step
        loss_fn(model(**batch), batch).backward()
        opt.step()
        return taichi_plan.apply(model, path, optimizer=opt, on_mismatch=on_mismatch), batch, loss_fn, opt

    model, batch, loss_fn, opt = checkpointed()
    opt.zero_grad()
    with pytest.raises(MismatchError, match="saved-tensor hooks of its own.*gradient_checkpointing_disable"):
        model(**batch)
    assert torch.equal(torch.ones(3) + 1, torch.full((3,), 2.0))  # nothing left installed
    taichi_plan.finish(model)
    model, batch, loss_fn, opt = checkpointed("warn")
    rt = model._taichi_plan["runtime"]
    opt.zero_grad()
    with pytest.warns(UserWarning, match="saved-tensor hooks of its own"):
        loss_fn(model(**batch), batch).backward()
    opt.step()
    model.gradient_checkpointing_disable()
    dropped = rt.dropped_storages
    opt.zero_grad(set_to_none=True)
    tracker = LivePeak(state_tensors(model, opt, batch))
    with warnings.catch_warnings(), tracker:
        warnings.simplefilter("error")
        loss_fn(model(**batch), batch).backward()
        opt.step()
    assert rt.dropped_storages > dropped and tracker.peak <= plan.budget_bytes, (tracker.peak, plan.budget_bytes)
    taichi_plan.finish(model)


def test_checkpointing_that_changes_the_ops_names_itself(plain_plan):
    """With the KV cache on in the recording, transformers' checkpointing turned on after it
    turns the cache off, so the op sequence differs before any drop: the mismatch says it is the
    model's own checkpointing (it had said to run warm-up steps)."""
    _, path = plain_plan
    model, batch, loss_fn, opt = build()
    model.gradient_checkpointing_enable()
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    opt.step()
    model = taichi_plan.apply(model, path, optimizer=opt)
    opt.zero_grad()
    with pytest.raises(MismatchError, match="its own activation checkpointing on.*gradient_checkpointing_disable"):
        model(**batch)
    taichi_plan.finish(model)


def test_an_optimizer_with_more_state_than_the_recorded_one_says_so(tmp_path):
    """The optimizer's state is in the plan's peak: a step recorded with SGD (momentum) and
    trained with AdamW holds a second moment more, every step (a 2-layer GPT-2 at 70%: 15.21 MB
    against a 12.71 MB budget, nothing said). ``apply`` given the optimizer compares its state
    with the recorded one: at ``apply`` when a warm-up step made it (raised, or warned with
    ``on_mismatch="warn"``), else after the first step (a warning: the step ran). Less state
    than the recorded one (AdamW recorded, SGD trained) is within the prediction."""
    plan, path = plan_for(Loop(), tmp_path, optimizer="sgd")

    def adamw(warm_up: bool):
        model, batch, loss_fn, _ = build(optimizer="sgd")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if warm_up:
            opt.zero_grad()
            loss_fn(model(**batch), batch).backward()
            opt.step()
        return model, batch, loss_fn, opt

    model, batch, loss_fn, opt = adamw(True)
    with pytest.raises(MismatchError, match=r"\(AdamW\) holds .* of state in \d+ tensors, where the plan's recorded step "
                                            r"held .*--optimizer"):
        taichi_plan.apply(model, path, optimizer=opt)
    assert getattr(model, "_taichi_plan", None) is None  # nothing installed
    with pytest.warns(UserWarning, match="holds .* of state"):
        model = taichi_plan.apply(model, path, optimizer=opt, on_mismatch="warn")
    taichi_plan.finish(model)
    model, batch, loss_fn, opt = adamw(False)
    model = taichi_plan.apply(model, path, optimizer=opt)
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    with pytest.warns(UserWarning, match="holds .* of state"):
        opt.step()
    with warnings.catch_warnings():  # said once
        warnings.simplefilter("error")
        opt.zero_grad()
        loss_fn(model(**batch), batch).backward()
        opt.step()
    taichi_plan.finish(model)
    _, path_adamw = plan_for(Loop(), tmp_path / "adamw")
    model, batch, loss_fn, _ = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = taichi_plan.apply(model, path_adamw, optimizer=opt)
        opt.zero_grad()
        loss_fn(model(**batch), batch).backward()
        opt.step()
    taichi_plan.finish(model)


def test_another_autocast_or_dtype_than_recorded_says_so(loop_plan):
    """A call under an autocast its recorded call did not run (or without the one it ran), or
    a model cast to another dtype since the recording, is named as such before it runs: under
    an unrecorded autocast the first matmul is a cast where the plan expects the matmul, and the
    op mismatch had said to run warm-up steps; cast to bf16, the trainable-parameter check had
    said the parameters were frozen or unfrozen."""
    _, plain = loop_plan("plain")
    _, bf16 = loop_plan("autocast-bf16")
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model, plain, optimizer=opt)
    with pytest.raises(MismatchError, match=r"under torch.autocast\(bf16\), but the plan's trace was recorded "
                                            r"without autocast.*--autocast bf16"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch)
    taichi_plan.finish(model)
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model, bf16, optimizer=opt)
    with pytest.raises(MismatchError, match=r"called without autocast, but the plan's trace was recorded under "
                                            r"torch.autocast\(bf16\)"):
        model(**batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as recorded: planned
        loss_fn(model(**batch), batch).backward()
    assert model._taichi_plan["runtime"].planned_calls == 1
    taichi_plan.finish(model)
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model.to(torch.bfloat16), plain, optimizer=opt)
    with pytest.raises(MismatchError, match=r"parameters hold .* bytes now \(bfloat16\).*dtype changed"):
        model(**batch)
    taichi_plan.finish(model)


def test_op_mismatch_mid_forward_warns_and_finishes_unplanned(plain_plan):
    loop = Loop()
    _, path = plain_plan
    base, _ = train(loop, 1)
    model, batch, loss_fn, opt = build()
    model = taichi_plan.apply(model, path, on_mismatch="warn", optimizer=opt)
    block = model.transformer.h[1]
    original = block.forward

    def changed(*a, **k):  # the model's code changed: one more op in the last block
        out = original(*a, **k)
        return out * 1.0 if isinstance(out, torch.Tensor) else (out[0] * 1.0,) + tuple(out[1:])

    block.forward = changed
    opt.zero_grad()
    with pytest.warns(UserWarning, match="differs"):
        loss_fn(model(**batch), batch).backward()
    block.forward = original
    opt.step()
    taichi_plan.finish(model)
    # Dropped tensors were rebuilt at the mismatch, so the step is still exact.
    assert all(torch.equal(a, b) for a, b in zip(base, list(model.parameters()), strict=True))


def test_random_ops_rebuilt_with_their_rng_state(tmp_path):
    """A block computing relu(z + 0.1 * randn_like(z)): randn_like takes no Generator, yet its
    result depends on the RNG; a rebuild must draw the same noise."""

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(64, 256)
            self.b = torch.nn.Linear(256, 64)

        def forward(self, x):
            z = self.a(x)
            z = torch.relu(z + 0.1 * torch.randn_like(z))
            return self.b(torch.nn.functional.dropout(z, 0.2, training=True))

    def parts(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(Noisy(), Noisy())
        return m, torch.randn(64, 64), (lambda out, b: out.square().mean()), torch.optim.SGD(m.parameters(), lr=0.1)

    model, batch, loss_fn, opt = parts(1)
    trace = record(model, batch, loss_fn, opt)
    p = build_problem(trace)
    # Drop every candidate made by the noise ops and what reads them: the rebuilds re-run
    # randn_like, and dropout's bernoulli_, with the RNG state they first ran with.
    noisy = {"aten.randn_like.default", "aten.mul.Tensor", "aten.add.Tensor", "aten.relu.default"}
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in
             zip(p.candidates, p.cand_free_after, p.cand_remat_before, strict=True)
             if p.op_name[int(p.producer[t])] in noisy]
    plan = make_plan(p, None, "manual", Decisions(drops=drops), 0.0, 0)
    assert "aten.relu.default" in {r.op_name for r in plan.recompute}
    rerun = {p.op_name[i] for i in recipe_ops(plan, trace)}  # relu's rebuild re-runs the noise
    assert "aten.randn_like.default" in rerun, rerun
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]

    def run(planned):
        model, batch, loss_fn, opt = parts(0)
        if planned:
            model = taichi_plan.apply(model, plan, optimizer=opt)
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model(batch), batch).backward()
            opt.step()
        return [q.detach().clone() for q in model.parameters()]

    taichi_plan.write_trace(trace, tmp_path / "noisy")
    plan.trace["path"] = str(tmp_path / "noisy")
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True), strict=True))


def test_compiled_model_is_refused(plain_plan):
    _, path = plain_plan
    model, *_ = build()
    with pytest.raises(taichi_plan.TaichiError, match="torch.compile"):
        taichi_plan.apply(torch.compile(model), path)


SHAPES = [(4, 32), (3, 32), (4, 24), (2, 9), (4, 32)]  # (batch, seq) per step: the recorded one first


def _train_shapes(plan_path=None):
    """Steps over batches of the shapes in SHAPES (a last, smaller batch of an epoch, shorter
    padded sequences): the parameters after them, each step's peak (LivePeak) and the runtime."""
    model, batch, loss_fn, opt = build(seed=0)
    if plan_path is not None:
        model = taichi_plan.apply(model, plan_path, optimizer=opt)
    peaks = []
    for b, s in SHAPES:
        part = {k: v[:b, :s].contiguous() for k, v in batch.items()}  # as a data loader makes them
        opt.zero_grad()
        with LivePeak(state_tensors(model, opt, part)) as tracker:
            loss_fn(model(**part), part).backward()
            opt.step()
        peaks.append(tracker.peak)
    rt = model._taichi_plan["runtime"] if plan_path is not None else None
    if plan_path is not None:
        taichi_plan.finish(model)
    return [p.detach().clone() for p in model.parameters()], peaks, rt


def test_smaller_batches_and_sequences_run_the_plan(plain_plan):
    """A call whose inputs are no larger than the recorded ones in any dimension runs the plan
    as it is (the same ops, each storage at most its recorded size, checked op by op): every
    step planned, no mismatch, training as unplanned, and no step's peak above the recorded
    shape's. A larger input is still refused."""
    plan, path = plain_plan
    base, base_peaks, _ = _train_shapes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned, peaks, rt = _train_shapes(path)
    assert rt.planned_calls == len(SHAPES) and rt.mismatches == 0 and rt.dropped_storages > 0
    assert_trains_like(base, planned, plan, lambda: _train_shapes()[0])
    # the last step is the recorded shape with AdamW's state made (the first step makes it)
    assert all(p <= peaks[-1] for p in peaks) and peaks[-1] <= plan.budget_bytes, (peaks, plan.budget_bytes)
    # planned below unplanned where activations set the peak ((2, 9) peaks in the optimizer step)
    assert peaks[1] < base_peaks[1] and peaks[2] < base_peaks[2] and peaks[3] <= base_peaks[3], (peaks, base_peaks)
    model, batch, loss_fn, _ = build(seed=0, batch=5)
    model = taichi_plan.apply(model, path)
    with pytest.raises(MismatchError, match="input_ids is \\[5, 32\\].*or smaller ones"):
        model(**batch)
    taichi_plan.finish(model)


def test_a_batch_of_one_that_takes_another_op_path_says_so(plain_plan):
    """At batch 1 GPT-2's attention skips the clone of ``.contiguous()`` (a transpose with a
    size-1 dimension is contiguous already): another op path, so the plan cannot run as it is.
    The error says why and what to do; with ``on_mismatch="warn"`` that call runs unplanned
    and the next full batch runs the plan again."""
    _, path = plain_plan
    model, batch, loss_fn, opt = build(seed=0)
    one = {k: v[:1].contiguous() for k, v in batch.items()}
    model = taichi_plan.apply(model, path, optimizer=opt)
    with pytest.raises(MismatchError, match="smaller than the recorded ones.*drop_last=True"):
        model(**one)
    taichi_plan.finish(model)
    model = taichi_plan.apply(model, path, optimizer=opt, on_mismatch="warn")
    rt = model._taichi_plan["runtime"]
    with pytest.warns(UserWarning, match="another op path"):
        loss_fn(model(**one), one).backward()
    opt.step()
    opt.zero_grad()
    loss_fn(model(**batch), batch).backward()
    assert rt.mismatches == 1 and rt.planned_calls == 2 and rt.dropped_storages > 0
    taichi_plan.finish(model)


def test_a_last_step_with_fewer_micro_batches_runs_the_plan(loop_plan):
    """Accumulation over 4 micro-batches, the epoch's last step with 2 left: planned, no
    warning, training as unplanned, its peak no higher than a full step's."""
    plan, path = loop_plan("accumulate-4")

    def run(plan_path=None):
        model, batch, loss_fn, opt = build(seed=0)
        if plan_path is not None:
            model = taichi_plan.apply(model, plan_path, optimizer=opt)
        peaks = []
        for micro in (4, 2, 4):
            opt.zero_grad()
            with LivePeak(state_tensors(model, opt, batch)) as tracker:
                for _ in range(micro):
                    (loss_fn(model(**batch), batch) / micro).backward()
                opt.step()
            peaks.append(tracker.peak)
        if plan_path is not None:
            assert model._taichi_plan["runtime"].planned_calls == 10
            taichi_plan.finish(model)
        return [p.detach().clone() for p in model.parameters()], peaks

    base, _ = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned, peaks = run(path)
    assert_trains_like(base, planned, plan, lambda: run()[0])
    assert peaks[1] <= peaks[2] <= plan.budget_bytes, (peaks, plan.budget_bytes)


@pytest.mark.parametrize("name", ["autocast-bf16", "accumulate-2"])
def test_modules_whole_with_their_outputs_dropped_in_a_loop(name, tmp_path):
    """Every innermost module of a Llama whose outputs a plan may drop, checkpointed whole
    with those outputs dropped (plan v10, ``partition.whole_outputs``), in a loop other than
    the plain one: under autocast (where the norms' float32 outputs are read only by the
    projections' casts, so they are not among them, and the casts' bfloat16 copies are what
    the projections save) and over 2 micro-batches with gradients kept between them. Trained
    planned and unplanned from the same seed: bitwise, and the last step's live peak within
    the predicted one; replayed, measured == predicted to the byte. Under autocast the
    rebuild casts the weights again (``partition._recast_ops``): a module checkpointed whole
    does not keep autocast's cached casts of its weights."""
    from taichi_plan.plan.format import save_plan
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.record import record_workload
    from taichi_plan.replay.measure import replay
    from tests.partition_replay import innermost_with_outputs, whole_output_drops

    loop, flags = LOOPS[name]
    flags = {**flags, "model": "llama"}
    trace = record_workload(get_workload(**{**GPT2, **flags}), fake=False, loop=loop)
    p = build_problem(trace)
    leaf = innermost_with_outputs(p)
    norms = [s.module for s in leaf if s.module.endswith("layernorm")]
    assert len(norms) == (0 if loop.autocast else 4), norms
    drops = whole_output_drops(p, leaf, every=False)
    plan = make_plan(p, None, "manual", Decisions(drops=drops, partitions=[as_partition(s, 1) for s in leaf]), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    taichi_plan.write_trace(trace, tmp_path / "trace")
    plan.trace["path"] = str(tmp_path / "trace")
    save_plan(plan, tmp_path / "leaf.plan.json")
    r = replay(tmp_path / "leaf.plan.json", steps=2)  # the recorded loop, as replay runs it
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"] == plan.predicted["planned_peak_bytes"], r
    assert r["grads_check"].startswith("bitwise"), r
    base, _ = train(loop, 3, **flags)  # and in a loop written out as a user would
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planned, peak = train(loop, 3, plan_path=tmp_path / "leaf.plan.json", **flags)
    assert_trains_like(base, planned, plan, lambda: train(loop, 3, **flags)[0], autocast=loop.autocast)
    assert peak <= plan.predicted["planned_peak_bytes"], (peak, plan.predicted["planned_peak_bytes"])


def test_accelerate_gradient_accumulation_trains_planned(loop_plan):
    """accelerate's own loop (``Accelerator(gradient_accumulation_steps=2)``, ``prepare``,
    ``accumulate``, ``accelerator.backward``), the plan applied to the prepared model and
    optimizer: its ``AcceleratedOptimizer`` steps the torch optimizer only at the end of an
    accumulation, and has no step hooks of its own (apply() raised an AttributeError
    traceback on it). Parameters those of the same loop unplanned (bitwise, or allclose where the
    plan splits a module: ``assert_trains_like``), every micro-batch within the plan's budget."""
    from accelerate import Accelerator

    loop, _flags = LOOPS["accumulate-2"]
    plan, path = loop_plan("accumulate-2")

    def run(planned: bool):
        model, batch, loss_fn, opt = build(seed=0)
        acc = Accelerator(gradient_accumulation_steps=loop.micro_batches, cpu=True)
        model, opt = acc.prepare(model, opt)
        if planned:
            model = taichi_plan.apply(model, path, optimizer=opt)
        peaks = []
        for _ in range(3 * loop.micro_batches):
            with LivePeak(state_tensors(model, opt, batch)) as tracker, acc.accumulate(model):
                acc.backward(loss_fn(model(**batch), batch))
                opt.step()
                opt.zero_grad()
            peaks.append(tracker.peak)
        rt = model._taichi_plan["runtime"] if planned else None
        if planned:
            taichi_plan.finish(model)
        return [p.detach().clone() for p in model.parameters()], peaks, rt

    base, _, _ = run(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no mismatch may be reported
        got, peaks, rt = run(True)
    # bitwise, or allclose where the plan splits a module (its head over tokens) into chunks: the
    # heuristic's choice follows the recorded op times (a clean-clone CI run chose a split once)
    assert_trains_like(base, got, plan, context=f"partitions {[(q.module, q.over, q.chunks) for q in plan.partitions]}")
    assert rt.mismatches == 0 and rt.planned_calls == 3 * loop.micro_batches and rt.steps_seen == 3
    assert max(peaks) <= plan.budget_bytes, (peaks, plan.budget_bytes)


def test_a_second_micro_batch_runs_its_own_plan_when_a_parameter_gets_no_gradient():
    """The runtime tells a new step from the next micro-batch by the gradients: none at all
    means ``zero_grad`` ran. It looked at the first trainable parameter alone, and XLNet's
    (``mask_emb``) is never used without a permutation mask, so it has no gradient in the
    middle of a step either: the second micro-batch was taken for a new step's first and ran
    the first one's plan (an XLNet planned at 50% with 2 micro-batches under autocast:
    1.4% over budget, with no warning). Here only the second micro-batch drops anything."""
    from taichi_plan.record import record_workload
    from taichi_plan.replay.measure.run import run_and_measure

    wl = get_workload(entry="tiny_models:xlnet", batch=4, seq=32)
    trace = record_workload(wl, fake=False, loop=Loop(micro_batches=2), calibrate=False)
    p = build_problem(trace)
    second = [k for k, t in enumerate(p.candidates.tolist()) if p.op_call[int(p.producer[t])] == 1]
    second.sort(key=lambda k: -int(p.nbytes[int(p.candidates[k])]))
    drops = [Drop(int(p.candidates[k]), int(p.cand_free_after[k]), int(p.cand_remat_before[k])) for k in second[:8]]
    plan = make_plan(p, None, "manual", Decisions(drops=drops), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    planned = run_and_measure(wl, plan, trace, 1, 0, "cpu")
    plain = run_and_measure(wl, None, trace, 1, 0, "cpu")
    assert plain["grads"][0] is None  # mask_emb, the first parameter: no gradient after a whole step
    assert planned["peak_bytes"] == plan.predicted["planned_peak_bytes"]
    assert planned["recompute_ops"] == plan.predicted["recompute_ops"] > 0
    assert all(a is b is None or a.equal(b) for a, b in zip(planned["grads"], plain["grads"], strict=True))


def test_a_second_micro_batch_is_refused_when_the_first_parameter_gets_no_gradient():
    """The guard for a loop the plan was not made for reads the gradients as the recorder does
    (any gradient alive when the call starts), not the first parameter's: XLNet's first
    (``mask_emb``) never gets one, and a second micro-batch on a plan of one then ran with the
    first batch's gradients alive beyond its prediction, with nothing said."""
    from taichi_plan.record import record_workload

    wl = get_workload(entry="tiny_models:xlnet", batch=4, seq=32)
    trace = record_workload(wl, fake=False, calibrate=False)
    p = build_problem(trace)
    biggest = sorted(range(len(p.candidates)), key=lambda k: -int(p.nbytes[int(p.candidates[k])]))[:4]
    drops = [Drop(int(p.candidates[k]), int(p.cand_free_after[k]), int(p.cand_remat_before[k])) for k in biggest]
    plan = make_plan(p, None, "manual", Decisions(drops=drops), 0.0, 0)
    model, batch, loss_fn, opt = wl.build(False)
    model = taichi_plan.apply(model, plan, optimizer=opt, trace=trace)
    try:
        opt.zero_grad()
        loss_fn(model(**batch), batch).backward()
        first = next(q for q in model.parameters() if q.requires_grad)
        assert first.grad is None and any(q.grad is not None for q in model.parameters())
        with pytest.raises(MismatchError, match="gradients alive"):
            model(**batch)
    finally:
        taichi_plan.finish(model)
