"""A container (``ModuleList``, ``ModuleDict``) is never called: it cannot be partitioned.

Replay partitions a module by wrapping its ``forward``; a ``ModuleList`` runs its children's
ops without ever being called, so a wrapper on it never ran and the plan's prediction did not
hold (found on a Trainer's bf16 GPT-2 without dropout: ``transformer.h`` split into 8 chunks,
predicted 3.89 MB, measured 7.84 MB). The recorder now writes which modules were called (trace
v8 ``meta.called_modules``) and the planners offer only those; older traces leave out what
looks like a container; ``apply`` refuses a plan that partitions one, and the runtime says so
when a partitioned module's ops ran without its forward being called.
"""

from __future__ import annotations

import pytest
import tiny_models
import torch

import taichi_plan
from taichi_plan.base.errors import MismatchError, PlanError
from taichi_plan.plan.format import save_plan
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.partition.find import module_spans
from taichi_plan.problem.partition.span import as_partition
from taichi_plan.record import record
from taichi_plan.solve.result import Decisions, make_plan
from taichi_plan.trace.format import read_trace, write_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("containers") / "trace"
    write_trace(record(*tiny_models.stacked_blocks(), steps=1, warmup=0), path)
    return read_trace(path)


def _offered(trace) -> set[str]:
    return {s.module for s in module_spans(build_problem(trace))}


def test_only_called_modules_are_offered(trace):
    called = trace.meta["called_modules"]
    assert {"", "blocks.0", "blocks.1", "blocks.2", "head"} <= set(called) and "blocks" not in called
    offered = _offered(trace)
    assert {"blocks.0", "blocks.1", "blocks.2"} <= offered and "blocks" not in offered, offered
    # a trace from before v8: what looks like a container (no ops of its own, numbered children) is left out
    old = read_trace(trace.path)
    del old.meta["called_modules"]
    assert "blocks" not in _offered(old) and {"blocks.0", "blocks.1"} <= _offered(old)
    # (without either rule the container would be offered: the rule is what keeps it out)
    old.meta["called_modules"] = [*called, "blocks"]
    assert "blocks" in _offered(old)


def _plan_path(trace, tmp_path, module: str, meta_called=None, chunks: int = 2):
    t = read_trace(trace.path)
    if meta_called is not None:  # as a trace that does not know its calls may offer it
        t.meta["called_modules"] = meta_called
        write_trace(t, tmp_path / "trace")
        t = read_trace(tmp_path / "trace")
    p = build_problem(t)
    span = next(s for s in module_spans(p) if s.module == module)
    plan = make_plan(p, None, "manual", Decisions(partitions=[as_partition(span, chunks)]), 0.0, 0)
    path = tmp_path / f"{module}.plan.json"
    save_plan(plan, path)
    return path


def test_apply_refuses_a_plan_that_partitions_a_container(trace, tmp_path):
    # checkpointed whole (one chunk): a wrapper on the container would never run either
    path = _plan_path(trace, tmp_path, "blocks", [*trace.meta["called_modules"], "blocks"], chunks=1)
    model, *_ = tiny_models.stacked_blocks()
    with pytest.raises(PlanError, match="'blocks', a ModuleList that has no forward of its own"):
        taichi_plan.apply(model, path)


def test_a_partitioned_module_run_without_its_forward_is_a_mismatch(trace, tmp_path):
    path = _plan_path(trace, tmp_path, "blocks.1", chunks=1)
    model, x, loss_fn, _ = tiny_models.stacked_blocks()
    model = taichi_plan.apply(model, path)
    loss_fn(model(x), x).backward()  # as planned: no mismatch
    assert model._taichi_plan["runtime"].mismatches == 0

    def forward(x):  # the model's code reaches block 1's ops through its class, not its (wrapped) forward
        for i, b in enumerate(model.blocks):
            x = type(b).forward(b, x) if i == 1 else b(x)
        return model.head(x)

    model.forward = forward
    model.zero_grad(set_to_none=True)
    with pytest.raises(MismatchError, match="partitions module 'blocks.1', but its forward was not called"):
        model(x)
    taichi_plan.finish(model)
    assert torch.ones(3).add(1).sum() == 6  # nothing left installed


def test_a_module_called_twice_in_a_row_is_not_offered(tmp_path):
    """ALBERT calls its one layer group once per layer, back to back: the group's ops form one
    contiguous run per forward, as one call of a larger module would, so it was offered as a
    partition, and replay, which wraps each call, stopped at the second call ("started at op
    167 of the model's call, but the plan expects it at op 17"). The recorder counts each
    module's forward calls (trace v10 ``meta.module_args``, one entry per call); a module called more times
    than it has (forward, backward) spans is not offered, its caller is."""
    from partition_replay import replay_partitions

    from taichi_plan.record import get_workload, record_workload

    trace = record_workload(get_workload(entry="tiny_models:shared_block"), fake=False, calibrate=False)
    write_trace(trace, tmp_path / "trace")
    assert len(trace.meta["module_args"]["1.block"]) == 2 and len(trace.meta["module_args"]["1"]) == 1
    problem = build_problem(read_trace(tmp_path / "trace"))
    offered = {s.module for s in module_spans(problem)}
    assert "1" in offered and "1.block" not in offered, offered
    # without the count the shared block looks like one call, and was offered
    old = read_trace(tmp_path / "trace")
    del old.meta["module_args"]
    assert "1.block" in {s.module for s in module_spans(build_problem(old))}
    # its caller runs as planned (checkpointed whole; split in chunks, the simulator counts
    # the shared weights' per-use gradients longer than autograd's input buffer holds them:
    # predicted above measured, docs/planner.md "Known limits")
    span = next(s for s in module_spans(problem) if s.module == "1")
    _plan, report = replay_partitions(problem, [as_partition(span, 1)], tmp_path)
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"] and report["grads_check"].startswith("bitwise")


def test_a_checkpointed_module_holds_the_arguments_it_never_reads(tmp_path):
    """A decoder layer receives tensors it never reads (position ids); checkpointed, it holds
    them until its backward all the same, while the simulator, from the ops' reads, had them
    freed when the model's forward let go of them: a GPT-NeoX's planned peak measured 512 B
    over the prediction (two micro-batches, bf16 autocast). The recorder now writes each
    module call's tensor arguments (trace v10 ``meta.module_args``), which the simulator holds."""
    from partition_replay import replay_partitions

    from taichi_plan.problem.partition.tensors import module_inputs
    from taichi_plan.record import get_workload, record_workload

    trace = record_workload(get_workload(entry="tiny_models:unused_arg_blocks"), fake=False, calibrate=False)
    write_trace(trace, tmp_path / "trace")
    problem = build_problem(read_trace(tmp_path / "trace"))
    span = next(s for s in module_spans(problem) if s.module == "blocks.0")
    dtypes = problem.trace.tensors["dtype"].to_numpy()
    assert [t for t in module_inputs(problem, span) if dtypes[t] == "int64"]  # the positions, held
    _plan, report = replay_partitions(problem, [as_partition(span, 1)], tmp_path)
    assert report["measured_peak_bytes"] == report["predicted_peak_bytes"], report
    assert report["grads_check"].startswith("bitwise")
