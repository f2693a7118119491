"""The LM head + cross-entropy partitioned over tokens (issue 9): the chunked function, the lazy
logits that carry it into any loss code, the planner's span and memory model, and replay.

Tolerances: chunked losses and gradients are compared with ``torch.allclose(rtol=1e-5,
atol=1e-6)`` against the unchunked ones (float32; the sums run in another order); replayed
peaks are compared with the simulator's exactly up to 16 KB (the few per-row vectors and
scalars the model leaves out)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from live_peak import LivePeak

import taichi_plan
from taichi_plan.base.errors import MismatchError, PlanError
from taichi_plan.plan.format import FORMAT_VERSION as PLAN_VERSION
from taichi_plan.plan.format import Partition, load_plan, save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.floor import floor_bytes
from taichi_plan.problem.partition.token_span import token_spans
from taichi_plan.record import get_workload, record, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.runtime.chunked_loss import LazyLogits, chunked_cross_entropy
from taichi_plan.solve import solve
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import write_trace

TOL = dict(rtol=1e-5, atol=1e-6)
TINY = dict(layers=1, hidden=64, heads=2, vocab=512, seq=32, batch=4)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_cross_entropy_equals_unchunked(reduction, smoothing):
    torch.manual_seed(0)
    h = torch.randn(3, 11, 16, requires_grad=True)
    head = torch.nn.Linear(16, 40)
    y = torch.randint(0, 40, (3, 11))
    y[0, :4] = -100  # ignored rows
    ref = F.cross_entropy(head(h).view(-1, 40), y.view(-1), reduction=reduction, label_smoothing=smoothing)
    got = chunked_cross_entropy(h, head, y, chunks=4, reduction=reduction, label_smoothing=smoothing)  # 33 rows: uneven
    assert torch.allclose(got.view(-1), ref.view(-1), **TOL)
    params = [h, head.weight, head.bias]
    for a, b in zip(_grads(got.sum(), params), _grads(ref.sum(), params), strict=True):
        assert torch.allclose(a, b, **TOL)


def test_chunked_cross_entropy_never_holds_the_logits():
    """Counted bytes: the unchunked loss holds the [N, V] logits and their log-softmax (and in
    backward their gradients); the chunked one one [N/k, V] buffer at a time (its softmax is
    made in place), beside the gradients it computes in the same pass."""
    torch.manual_seed(0)
    n, hdim, vocab, k = 256, 32, 1000, 8
    h = torch.randn(n, hdim, requires_grad=True)
    head = torch.nn.Linear(hdim, vocab, bias=False)
    y = torch.randint(0, vocab, (n,))

    def peak(fn):
        with LivePeak([h, head.weight, y]) as lp:
            fn().backward()
        h.grad = head.weight.grad = None
        return lp.peak

    plain = peak(lambda: F.cross_entropy(head(h), y))
    chunked = peak(lambda: chunked_cross_entropy(h, head, y, chunks=k))
    logits = n * vocab * 4
    state = (n * hdim + vocab * hdim) * 4 + n * 8
    grads = (n * hdim + vocab * hdim) * 4
    assert plain >= state + 2 * logits
    per_row = math.ceil(n / k) * (1 + 8 + 4 * 4) + 16  # a chunk's per-row vectors, the count and the total
    assert chunked <= state + grads + math.ceil(n / k) * vocab * 4 + per_row


def test_the_fused_pass_computes_the_gradients_once_and_survives_the_loops_around_it(monkeypatch):
    """The loss and its gradients come from one pass over the chunks in forward (backward
    makes no logits); the incoming gradient scales them (a loss divided for accumulation, a
    second loss added); a second backward through a retained graph makes them again and
    gives the same; under no_grad no gradient is computed."""
    from taichi_plan.runtime import chunked_loss

    torch.manual_seed(0)
    h = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 40)
    y = torch.randint(0, 40, (2, 9))
    params = [h, head.weight, head.bias]
    runs = [0]
    original = chunked_loss._logits

    def counted(*a, **kw):
        runs[0] += 1
        return original(*a, **kw)

    monkeypatch.setattr(chunked_loss, "_logits", counted)
    ref = F.cross_entropy(head(h).view(-1, 40), y.view(-1))
    want = _grads(ref / 4 + h.square().sum(), params)
    loss = chunked_cross_entropy(h, head, y, chunks=3)
    assert runs[0] == 3
    got = torch.autograd.grad(loss / 4 + h.square().sum(), params, retain_graph=True)
    assert runs[0] == 3  # backward made no logits
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, **TOL)
    again = _grads(loss / 4 + h.square().sum(), params)  # the retained graph: made again
    assert runs[0] == 6
    for a, b in zip(again, want, strict=True):
        assert torch.allclose(a, b, **TOL)
    state = [h, head.weight, head.bias, y]
    with torch.no_grad(), LivePeak(state) as lp:
        chunked_cross_entropy(h, head, y, chunks=3)
    held = sum(t.untyped_storage().nbytes() for t in state)
    assert lp.peak - held < (h.numel() + head.weight.numel()) * 4  # no gradient was allocated


class _Owner:
    def __init__(self):
        self.why = []

    def quiet(self):
        import contextlib

        return contextlib.nullcontext()

    def materialized(self, why):
        self.why.append(why)


def test_lazy_logits_stay_lazy_through_position_wise_ops():
    torch.manual_seed(0)
    h = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 30)
    y = torch.randint(0, 30, (2, 9))
    owner = _Owner()
    lazy = LazyLogits(h, head.weight, head.bias, 3, owner)
    assert lazy.shape == (2, 9, 30)
    losses = [
        (F.cross_entropy(lazy.float()[:, :-1].contiguous().view(-1, 30), y[:, 1:].reshape(-1)),
         F.cross_entropy(head(h)[:, :-1].reshape(-1, 30), y[:, 1:].reshape(-1))),
        (F.nll_loss(lazy.log_softmax(-1).flatten(0, 1), y.view(-1), reduction="sum"),
         F.nll_loss(head(h).log_softmax(-1).flatten(0, 1), y.view(-1), reduction="sum")),
        (F.cross_entropy(lazy.to(torch.float32).reshape(-1, 30), y.view(-1), ignore_index=3),
         F.cross_entropy(head(h).reshape(-1, 30), y.view(-1), ignore_index=3)),
    ]
    params = [h, head.weight, head.bias]
    for got, ref in losses:
        assert torch.allclose(got, ref, **TOL)
        for a, b in zip(_grads(got, params), _grads(ref, params), strict=True):
            assert torch.allclose(a, b, **TOL)
    assert owner.why == []
    # Anything else computes the full logits, with autograd, and says so.
    top = lazy.argmax(-1)
    assert torch.equal(top, head(h).argmax(-1)) and owner.why == ["TensorBase.argmax on the logits"]


def _plan(trace, tmp_path, chunks, name="p"):
    problem = build_problem(trace)
    spans = token_spans(problem)
    assert len(spans) == 1, spans
    plan = make_plan(problem, None, "manual",
                     Decisions(partitions=[Partition(spans[0].module, 0, chunks, over="tokens")]), 0.0, 0)
    write_trace(trace, tmp_path / f"{name}-trace")
    plan.trace["path"] = str(tmp_path / f"{name}-trace")
    path = tmp_path / f"{name}.plan.json"
    save_plan(plan, path)
    return plan, path, spans[0]


@pytest.mark.parametrize("model,head", [("llama", "lm_head"),
                                        pytest.param("bert", "cls.predictions.decoder", marks=pytest.mark.bench)])
def test_loss_inside_the_model_replays_as_predicted(tmp_path, model, head):
    """Two HF families whose loss runs in the model's forward (``labels=``): the span is found
    (head matmul to nll_loss_forward and their backward), the replayed peak is the predicted
    one, and the gradients match the unplanned run's."""
    trace = record_workload(get_workload(model=model, **TINY), fake=False)
    plan, path, span = _plan(trace, tmp_path, 4, model)
    assert span.module == head and span.rows == TINY["batch"] * TINY["seq"] and span.vocab == TINY["vocab"]
    names = [trace.ops["op"][i] for i in span.fwd_ops]
    assert names[-1] == "aten.nll_loss_forward.default" and "aten._log_softmax.default" in names
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    r = replay(path, steps=1)
    assert r["measured_peak_bytes"] == plan.predicted["planned_peak_bytes"], r
    assert r["grads_match"] and r["grads_check"].startswith("allclose"), r


class TinyDecoder(torch.nn.Module):
    """A hand-written decoder: the caller computes the loss from its logits."""

    def __init__(self, vocab=400, hidden=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.body = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.LayerNorm(hidden))
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.out(self.body(self.emb(ids)))


def _shifted_loss(logits, batch):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["ids"][:, 1:].reshape(-1))


def _decoder(seed=0):
    torch.manual_seed(seed)
    model = TinyDecoder()
    batch = {"ids": torch.randint(0, 400, (4, 48))}
    return model, batch, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model, batch, opt, loss_fn=_shifted_loss, forward=None):
    opt.zero_grad(set_to_none=True)
    state = [*model.parameters(), *(v for st in opt.state.values() for v in st.values()), batch["ids"]]
    with LivePeak(state) as lp:
        loss = loss_fn((forward or model)(**batch), batch)
        loss.backward()
        del loss
        opt.step()
    return lp.peak


def test_loss_in_the_callers_code(tmp_path):
    """The loss is computed outside the model from its logits, with a shift (slice + reshape,
    which copies): the planner finds the span across the model call's end, and under the plan
    the training step's counted peak is the predicted one and parameters match."""
    model, batch, opt = _decoder()
    trace = record(model, batch, _shifted_loss, opt)
    plan, path, span = _plan(trace, tmp_path, 4)
    assert span.module == "out" and span.copies_hidden and span.rows == 4 * 47
    calls = trace.meta["model_calls"]
    assert span.fwd_ops[0] <= calls[0]["end"] < span.reduce_op  # head in the call, loss after it

    plain = _decoder()
    planned = _decoder()
    for m, b, o in (plain, planned):
        _train_step(m, b, o)  # warm-up: optimizer state exists, as recorded
    base = _train_step(*plain)
    model = taichi_plan.apply(planned[0], path, optimizer=planned[2])
    peak = _train_step(model, planned[1], planned[2])
    taichi_plan.finish(model)
    assert base == plan.predicted["baseline_peak_bytes"]
    assert peak == plan.predicted["planned_peak_bytes"], (peak, plan.predicted)
    for a, b in zip(plain[0].parameters(), planned[0].parameters(), strict=True):
        assert torch.allclose(a, b, **TOL)


def test_explicit_api_in_the_callers_code():
    """``taichi_plan.chunked_cross_entropy`` in a step of the caller's own: same update as the
    unchunked loss, fewer counted bytes."""
    plain, mine = _decoder(), _decoder()
    dec = mine[0]

    def hidden_states(ids):  # the caller's forward, without the head
        return dec.body(dec.emb(ids))

    def loss_chunked(hidden, batch):
        return taichi_plan.chunked_cross_entropy(hidden[:, :-1], dec.out, batch["ids"][:, 1:], chunks=4)

    p1 = _train_step(*plain)
    p2 = _train_step(*mine, loss_fn=loss_chunked, forward=hidden_states)
    assert p2 < p1 - 4 * 47 * 400 * 4  # at least the full logits less
    for a, b in zip(plain[0].parameters(), mine[0].parameters(), strict=True):
        assert torch.allclose(a, b, **TOL)


def test_materializing_under_a_plan_is_a_mismatch(tmp_path):
    model, batch, opt = _decoder()
    trace = record(model, batch, _shifted_loss, opt)
    _, path, _ = _plan(trace, tmp_path, 4)

    def with_accuracy(logits, batch):
        acc = (logits.argmax(-1) == batch["ids"]).float().mean()  # needs every logit
        return _shifted_loss(logits, batch) + 0 * acc

    model, batch, opt = _decoder()
    model = taichi_plan.apply(model, path, optimizer=opt)
    with pytest.raises(MismatchError, match="argmax"):
        with_accuracy(model(**batch), batch)
    taichi_plan.finish(model)
    ref, rbatch, _ = _decoder()
    model, batch, opt = _decoder()
    model = taichi_plan.apply(model, path, optimizer=opt, on_mismatch="warn")
    with pytest.warns(UserWarning, match="full logits were computed"):
        loss = with_accuracy(model(**batch), batch)
    taichi_plan.finish(model)
    assert torch.allclose(loss, with_accuracy(ref(**rbatch), rbatch), **TOL)


def test_planner_goes_below_the_old_floor(tmp_path):
    """On a GPT-2 whose peak is the loss, the least budget falls once the head + loss can be
    partitioned over tokens, and solve reaches a budget below the floor without it."""
    trace = record_workload(get_workload(model="gpt2", layers=1, hidden=64, heads=2, vocab=2000, seq=64, batch=4),
                            fake=False)
    problem = build_problem(trace)
    (span,) = token_spans(problem)
    with_tokens = int(floor_bytes(problem).max())
    problem._module_spans = [s for s in problem._module_spans if s.over == "batch"]
    without = int(floor_bytes(problem).max())
    assert with_tokens < without
    budget = (with_tokens + without) // 2
    plan = solve(trace, budget, "auto", time_limit=120, work_limit=2)  # CP-SAT's work, not the clock: 1 finds it
    assert plan.predicted["planned_peak_bytes"] <= budget
    assert [(p.module, p.over) for p in plan.partitions if p.over == "tokens"] == [("lm_head", "tokens")]


def test_plan_format_v4_over(tmp_path):
    model, batch, opt = _decoder()
    trace = record(model, batch, _shifted_loss, opt)
    plan, path, _ = _plan(trace, tmp_path, 4)
    data = json.loads(path.read_text())
    assert data["format_version"] == PLAN_VERSION and data["decisions"]["partitions"][0]["over"] == "tokens"
    assert load_plan(path).partitions[0].over == "tokens"
    from click.testing import CliRunner

    from taichi_plan.cli import main

    out = CliRunner().invoke(main, ["inspect", str(path)])
    assert out.exit_code == 0 and "tokens" in out.output and "logits never exist" in " ".join(out.output.split())
    data["decisions"]["partitions"][0]["over"] = "rows"
    bad = tmp_path / "bad.plan.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="over"):
        load_plan(bad)
    # v3 files have no `over`: their partitions are along the batch.
    del data["decisions"]["partitions"][0]["over"]
    data["format_version"] = 3
    bad.write_text(json.dumps(data))
    assert load_plan(bad).partitions[0].over == "batch"


def test_several_steps_of_a_head_over_tokens_match_on_an_opt_decoder(tmp_path):
    """OPT's head and loss over 32 token chunks, replayed for 3 steps with AdamW: the first
    planned step's gradients are allclose, and the parameters after the last step within
    ComparisonConfig.params_rel_tol relative distance. Element-wise allclose on those parameters does not hold
    (AdamW's g / (sqrt(v) + eps) turns a rounding difference in a near-zero gradient into an
    update difference up to its learning rate): it said "DIFFER" before, on every step count."""
    import torch

    from taichi_plan.replay.measure.compare import compare_training
    from taichi_plan.replay.measure.config import ComparisonConfig

    tol = ComparisonConfig()

    trace = record_workload(get_workload(entry="tiny_models:opt_decoder"), fake=False)
    _plan_, path, span = _plan(trace, tmp_path, 32, "opt")
    assert span.module == "lm_head"
    r = replay(path, steps=3)
    assert r["grads_match"], r
    assert r["grads_check"].startswith("allclose(rtol=1e-4, atol=1e-6) on the first planned step's gradients")
    assert f"parameters after the first planned step within {tol.params_rel_tol:.0e}".replace("e-0", "e-") in r["grads_check"]
    # The check itself: a gradient off by more than its tolerance fails, as do parameters farther apart.
    g = [torch.ones(4)]
    base = {"first_grads": g, "grads": g, "params": [torch.ones(4)]}
    off = dict(base, first_grads=[g[0] + 10 * tol.grad_atol + 10 * tol.grad_rtol])
    assert compare_training(base, base, exact=False)["grads_match"]
    assert not compare_training(base, off, exact=False)["grads_match"]
    far = dict(base, params=[torch.ones(4) * (1 + 10 * tol.params_rel_tol)])
    assert not compare_training(base, far, exact=False)["grads_match"]
    # Judged after the first planned step; the last step's distance is reported beside it.
    first = dict(base, first_params=[torch.ones(4)])
    assert not compare_training(first, dict(first, first_params=far["params"]), exact=False)["grads_match"]
    drift = compare_training(first, dict(first, params=far["params"]), exact=False)
    assert drift["grads_match"] and "after the last step 0.0001)" in drift["grads_check"], drift
    # A gradient element the runs round differently (near zero: here 1e-9 against -1e-9) is
    # noise: what the optimizer made of it is left out of the parameters' distance, and said.
    g2 = [torch.tensor([1.0, 1e-9])]
    noisy = {"first_grads": g2, "grads": g2, "params": [torch.ones(2)], "first_params": [torch.ones(2)]}
    moved = dict(noisy, first_grads=[torch.tensor([1.0, -1e-9])], first_params=[torch.tensor([1.0, 1.01])])
    out = compare_training(noisy, moved, exact=False)
    assert out["grads_match"] and "1 elements whose gradient is rounding noise left out" in out["grads_check"], out
    big = dict(moved, first_params=[torch.tensor([1.01, 1.0])])  # a real element moved: not noise
    assert not compare_training(noisy, big, exact=False)["grads_match"]


def test_a_call_that_only_splits_its_head_runs_without_the_dispatch_mode(tmp_path, monkeypatch):
    """A plan that changes a call only by splitting its head over tokens needs no op of the
    call checked (the lazy logits and the chunked loss run through the head's wrapped forward):
    the call runs without the runtime's dispatch mode, which cost a 4-layer GPT-2 or Llama about
    8 ms a step, and the plan predicts no checking for it; its peak is still the predicted one."""
    from taichi_plan.problem.partition.overhead import runtime_overhead_s
    from taichi_plan.runtime.mode import PlanRuntime

    model, batch, opt = _decoder()
    trace = record(model, batch, _shifted_loss, opt)
    plan, path, _span = _plan(trace, tmp_path, 4)
    problem = build_problem(trace)
    assert runtime_overhead_s(problem, [], plan.partitions, set(), cal={"check_op_s": 1e-5, "recipe_op_s": 2e-5}) == 0.0
    seen = [0]
    original = PlanRuntime.__torch_dispatch__

    def counted(self, *a, **k):
        seen[0] += 1
        return original(self, *a, **k)

    monkeypatch.setattr(PlanRuntime, "__torch_dispatch__", counted)
    planned = _decoder()
    _train_step(*planned)  # warm-up, as recorded
    model = taichi_plan.apply(planned[0], path, optimizer=planned[2])
    peak = _train_step(model, planned[1], planned[2])
    rt = model._taichi_plan["runtime"]
    taichi_plan.finish(model)
    assert rt.planned_calls == 1 and seen[0] == 0
    assert peak == plan.predicted["planned_peak_bytes"], (peak, plan.predicted)
