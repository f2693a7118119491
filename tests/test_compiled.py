"""Plans of torch.compile'd steps (aot_eager here; inductor runs in make bench)."""

import copy

import pytest
import torch

import taichi_plan
from taichi_plan.compiled import compiled_peak, record_compiled
from taichi_plan.record import get_workload
from taichi_plan.record.api import make_step_fn
from taichi_plan.solve import solve
from taichi_plan.trace import baseline_peak, write_trace


def _build(state=None):
    torch.manual_seed(0)
    wl = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=64, batch=8)
    model, batch, loss_fn, opt = wl.build(False)
    if state is not None:
        model.load_state_dict(state)
    return model, batch, loss_fn, opt


def _measure(model, batch, loss_fn, opt):
    step = make_step_fn(model, batch, loss_fn, opt)
    opt.zero_grad(set_to_none=True)
    step()  # compiles
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    peak = compiled_peak(step, model, opt, list(batch.values()))["peak_bytes"]
    return peak, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_plan_measures_as_predicted(tmp_path):
    model, batch, loss_fn, opt = _build()
    state = copy.deepcopy(model.state_dict())
    trace = record_compiled(torch.compile(model, backend="aot_eager"), batch, loss_fn, opt)
    assert trace.meta["compiled"]["backend"] == "aot_eager"
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.7), time_limit=10)
    assert plan.recompute and not plan.partitions and plan.optimizer is None
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")

    m, b, lf, o = _build(state)
    base_peak, base_grads = _measure(torch.compile(m, backend="aot_eager"), b, lf, o)
    m, b, lf, o = _build(state)
    planned = taichi_plan.apply(torch.compile(m, backend="aot_eager"), plan)
    peak, grads = _measure(planned, b, lf, o)
    predicted = plan.predicted["planned_peak_bytes"]
    assert abs(peak / predicted - 1) <= 0.03, (peak, predicted)
    # The trace's baseline saves every value the backward reads; compile's own partitioner
    # recomputes some of them, so the unplanned compiled step peaks lower than that.
    assert base_peak <= plan.predicted["baseline_peak_bytes"]
    assert peak < 0.8 * base_peak
    for k in base_grads:  # same ops, same order of their results: bitwise on CPU
        assert torch.equal(base_grads[k], grads[k]), k
    taichi_plan.finish(planned)


def test_compiled_plan_refused_on_eager_model(tmp_path):
    model, batch, loss_fn, opt = _build()
    trace = record_compiled(torch.compile(model, backend="aot_eager"), batch, loss_fn, opt, steps=1)
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.9), time_limit=5)
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")
    with pytest.raises(taichi_plan.TaichiError, match="compiled model only"):
        taichi_plan.apply(_build()[0], plan)


class _Broken(torch.nn.Module):
    """Four residual MLP blocks with a graph break between the second and the third: compile
    runs two graphs (and the eager code of the break between them)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)) for _ in range(4))

    def forward(self, x):
        x = x + torch.tanh(self.blocks[0](x))
        x = x + torch.tanh(self.blocks[1](x))
        torch._dynamo.graph_break()
        x = x + torch.tanh(self.blocks[2](x))
        return x + torch.tanh(self.blocks[3](x))


def _build_broken(state=None):
    torch.manual_seed(0)
    model = _Broken()
    if state is not None:
        model.load_state_dict(state)
    return model, {"x": torch.randn(256, 64)}, (lambda out, batch: out.square().mean()), torch.optim.SGD(model.parameters(), lr=0.1)


def _compile(model, how):
    if how == "method":
        model.compile(backend="aot_eager")
        return model
    return torch.compile(model, backend="aot_eager")


@pytest.mark.parametrize("build,how,graphs", [(_build, "method", 1), (_build_broken, "module", 2)],
                         ids=["gpt2-model.compile", "graph-break"])
def test_compiled_plan_other_forms(tmp_path, build, how, graphs):
    """model.compile() (the module itself runs compiled) and a model with a graph break (two
    graphs, one budget) plan, measure and differentiate as torch.compile(model) does."""
    model, batch, loss_fn, opt = build()
    state = copy.deepcopy(model.state_dict())
    trace = record_compiled(_compile(model, how), batch, loss_fn, opt, backend="aot_eager", steps=1)
    assert len(trace.meta["compiled"]["graphs"]) == graphs
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.8), time_limit=10)
    assert plan.recompute
    drops = {int(r.tensor) for r in plan.recompute}
    assert any(drops.intersection(tids) for _g, _name, _start, _end, tids in trace.meta["compiled"]["nodes"])
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")
    m, b, lf, o = build(state)
    base_peak, base_grads = _measure(_compile(m, how), b, lf, o)
    m, b, lf, o = build(state)
    planned = taichi_plan.apply(_compile(m, how), plan)
    peak, grads = _measure(planned, b, lf, o)
    assert abs(peak / plan.predicted["planned_peak_bytes"] - 1) <= 0.03, (peak, plan.predicted)
    assert peak < base_peak
    for k in base_grads:
        assert torch.equal(base_grads[k], grads[k]), k
    taichi_plan.finish(planned)


@pytest.mark.parametrize("how", ["module", "method"])
def test_compile_after_eager_apply_is_refused(tmp_path, how):
    """An eager plan, then torch.compile / model.compile(): a sentence, not a silently unplanned run."""
    from taichi_plan.record import record

    model, batch, loss_fn, opt = _build_broken()
    trace = record(model, batch, loss_fn, opt, steps=1)
    write_trace(trace, tmp_path / "t")
    plan = solve(trace, int(baseline_peak(trace)[0] * 0.8), time_limit=5)
    plan.trace["path"] = plan.trace["path_absolute"] = str(tmp_path / "t")
    m, b, lf, o = _build_broken()
    planned = _compile(taichi_plan.apply(m, plan), how)
    with pytest.raises(taichi_plan.TaichiError, match="then compiled"):
        make_step_fn(planned, b, lf, o)()
    taichi_plan.finish(m)


def test_compile_cli_refusals(tmp_path):
    """--compile with a fake or sharded recording, and replay of a compiled plan: a sentence each."""
    from click.testing import CliRunner

    from taichi_plan.cli import main
    from taichi_plan.replay.measure import workload_of

    runner = CliRunner()
    for extra in (["--fake"], ["--ddp", "2"]):
        res = runner.invoke(main, ["record", "--model", "mlp", "--compile", "aot_eager", *extra, "-o", str(tmp_path / "t")])
        assert res.exit_code != 0 and "--compile records a real step of one process" in res.output, res.output
        assert not (tmp_path / "t").exists()
    model, batch, loss_fn, opt = _build()
    trace = record_compiled(model, batch, loss_fn, opt, backend="aot_eager", steps=1)
    with pytest.raises(taichi_plan.TaichiError, match="replay does not compile"):
        workload_of(trace)
    write_trace(trace, tmp_path / "c")
    res = runner.invoke(main, ["solve", str(tmp_path / "c"), "--budget", "70%", "--offload", "-o", str(tmp_path / "p")])
    assert res.exit_code != 0 and "without --offload" in res.output, res.output
    assert not (tmp_path / "p").exists()
