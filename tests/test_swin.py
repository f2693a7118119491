"""A model no built-in names (``tiny_models.swin``: a tiny Swin from transformers' config), where
PyTorch's ModTracker mislabels the backward: a module whose inputs carry no gradient (the
relative position bias of each block, from a parameter table and an index buffer) is closed
only when the whole backward ends, so every later backward op read as the bias's. A block
checkpointed whole was then predicted 730 KB above its measured peak (its backward found at
the wrong ops). The recorder closes such a module at its parameters' gradients
(``module_tracking.ModuleTracker``). And of equally deep open modules (the query, key and value
projections, open together in backward) it names the one opened last: it named the first
its set of open modules yielded, an order that follows Python's string hash, so two
recordings of one step in two processes offered different modules."""

from __future__ import annotations

import pytest

from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.record import get_workload, record_workload
from taichi_plan.replay.measure import replay
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import write_trace

BLOCK = "swin.encoder.layers.0.blocks.0"


@pytest.fixture(scope="module")
def swin(tmp_path_factory):
    trace = record_workload(get_workload(entry="tiny_models:swin", batch=16), fake=False)
    d = write_trace(trace, tmp_path_factory.mktemp("swin") / "t")
    return d, build_problem(trace)


def test_a_blocks_backward_is_its_own(swin):
    """Each block's backward holds its MLP's and its attention's (before, the first block's
    MLP backward read as the second block's position bias), and the bias's backward is a
    few ops, not the rest of the step's backward."""
    _, p = swin
    spans = {s.module: s for s in module_spans(p)}
    block, mlp = spans[BLOCK], spans[BLOCK + ".mlp"]
    assert block.bwd[0] <= mlp.bwd[0] and mlp.bwd[1] <= block.bwd[1]
    assert p.op_module[block.bwd[0]].startswith(BLOCK + ".mlp")  # its backward begins with its MLP's
    for m in (BLOCK, "swin.encoder.layers.1.blocks.0"):
        bias = spans[m + ".attention.relative_position_bias"]
        assert bias.bwd[1] - bias.bwd[0] < 10, bias.bwd


@pytest.mark.parametrize("module", [BLOCK, BLOCK + ".mlp"])
def test_checkpointed_whole_measures_as_predicted(swin, module, tmp_path):
    """The first block, and its MLP, checkpointed whole: below the unplanned peak, measured ==
    predicted to the byte, gradients bitwise."""
    d, p = swin
    spans = {s.module: s for s in module_spans(p)}
    assert module in spans, sorted(spans)
    plan = make_plan(p, None, "manual", Decisions(partitions=[as_partition(spans[module], 1)]), 0.0, 0)
    assert plan.predicted["planned_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    plan.trace["path"] = str(d)
    save_plan(plan, tmp_path / "swin.plan.json")
    r = replay(tmp_path / "swin.plan.json", steps=1)
    assert r["measured_peak_bytes"] == r["predicted_peak_bytes"] == plan.predicted["planned_peak_bytes"], r
    assert r["grads_check"].startswith("bitwise"), r["grads_check"]


def test_equally_deep_open_modules_are_told_apart_by_when_they_opened():
    import torch

    from taichi_plan.record.recorder import Recorder

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    rec = Recorder(model=model)
    tracker, root = rec._mod_tracker, rec._root
    a, b = f"{root}.0", f"{root}.1"
    for first, last in ((a, b), (b, a)):
        tracker.parents = {"Global", root, first, last}
        tracker.opened = {root: 1, first: 2, last: 3}
        assert rec._module() == last[len(root) + 1:]


def test_recording_leaves_no_hook_on_the_parameters():
    """The hooks that close a module at its parameters' gradients are removed with the
    recorder, also those of the forward-only Python-reference probe, whose backward never
    runs: the user's model trains on without them."""
    import tiny_models

    from taichi_plan.record import record

    model, batch, loss_fn, opt = tiny_models.swin(batch=2)
    record(model, batch, loss_fn, opt, steps=1, warmup=0)
    assert not [n for n, q in model.named_parameters() if q._backward_hooks], "hooks left behind"
