"""A batch norm in training mode updates its running statistics in place, though its schema
(``aten::native_batch_norm``) marks no argument as written. A rebuild that re-ran it as
recorded updated them a second time: parameters and gradients stayed bitwise equal, the
running mean and variance did not, and `replay` compared only the former. The runtime now
re-runs such an op without its running statistics (``runtime._HIDDEN_WRITES``), and replay
compares floating-point buffers with the parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import taichi_plan
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.record import record
from taichi_plan.runtime.calls import recipe_ops
from taichi_plan.simulate.core import Drop
from taichi_plan.solve.result import Decisions, make_plan


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_batch_norm_computes_the_same_without_its_running_statistics(channels_last, dtype):
    for shape in [(2, 3, 4, 4), (8, 64, 12, 12), (32, 10), (5, 7, 9)]:
        x = torch.randn(*shape).to(dtype)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        c = shape[1]
        w, b = torch.randn(c), torch.randn(c)
        rm, rv = torch.randn(c), torch.rand(c) + 0.5
        with_stats = torch.ops.aten.native_batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5)
        without = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
        assert all(torch.equal(p, q) for p, q in zip(with_stats, without, strict=True))


def cnn(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def loss_fn(out, batch):
    return out.square().mean()


def test_a_plan_that_rebuilds_a_batch_norm_leaves_its_running_statistics_alone(tmp_path):
    batch = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    model, opt = cnn(1)
    trace = record(model, batch, loss_fn, opt)
    p = build_problem(trace)
    # Drop every batch norm's output: each is rebuilt by re-running its native_batch_norm.
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in
             zip(p.candidates, p.cand_free_after, p.cand_remat_before, strict=True)
             if p.op_name[int(p.producer[t])] == "aten.native_batch_norm.default"]
    assert drops
    plan = make_plan(p, None, "manual", Decisions(drops=drops), 0.0, 0)
    names = trace.ops["op"].tolist()
    assert any("native_batch_norm.default" in names[i] for i in recipe_ops(plan, trace, p))
    taichi_plan.write_trace(trace, tmp_path / "trace")
    plan.trace["path"] = str(tmp_path / "trace")
    path = save_plan(plan, tmp_path / "bn.plan.json")

    def train(planned):
        model, opt = cnn(0)
        if planned:
            taichi_plan.apply(model, path, optimizer=opt)
        for s in range(3):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(10 + s))
            loss_fn(model(x), x).backward()
            opt.step()
        if planned:
            assert model._taichi_plan["runtime"].recompute_ops > 0
            taichi_plan.finish(model)
        return model.state_dict()

    base, got = train(False), train(True)
    assert base.keys() == got.keys()
    differ = [k for k in base if not torch.equal(base[k], got[k])]
    assert not differ, f"differ after 3 planned steps: {differ}"


def test_replay_compares_buffers():
    from taichi_plan.replay.measure.compare import compare_training

    model, _ = cnn(0)
    from taichi_plan.replay.measure.run import _state

    a = _state(model)
    model[1].running_mean.add_(1e-3)
    b = _state(model)
    assert len(a["params"]) == len(list(model.parameters())) + 6  # three running means, three variances
    assert not compare_training(a, b, exact=True)["grads_match"]


def test_a_buffer_holding_minus_infinity_compares_equal_to_itself():
    # A causal mask buffer (-inf above the diagonal) is part of what replay compares; -inf - -inf
    # is nan, and "nan <= tolerance" read as "gradients DIFFER" for every plan with a partition.
    from taichi_plan.replay.measure.compare import compare_training

    mask = torch.full((4, 4), float("-inf")).triu(1)
    w = torch.randn(8)
    a = {"params": [w, mask], "grads": [w.clone(), None], "first_grads": [w.clone(), None]}
    b = {"params": [w + 1e-9, mask.clone()], "grads": [w.clone(), None], "first_grads": [w + 1e-9, None]}
    out = compare_training(a, b, exact=False)
    assert out["grads_match"], out["grads_check"]
    assert "nan" not in out["grads_check"] and out["grads_max_abs_diff"] < 1e-6
