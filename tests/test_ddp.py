"""One rank of a DDP job: recorded for real in one process (a 1-rank gloo group), replayed on
2 gloo ranks, applied in a torchrun script.

The recording's DDP buckets are DDP's own buffers (the reducer's, byte for byte); a plan at
50% of the per-rank peak measures exactly its predicted peak on each of 2 real ranks, whose
unplanned peak is the recording's, with gradients bitwise equal to the unplanned DDP run's;
a plan is refused on another layout. Recordings run in this process (each makes and destroys
its own 1-rank group); the ranks are processes the tests start and wait for.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from ranks import replay_measures_the_prediction, torchrun_losses

from taichi_plan.base.errors import PlanError
from taichi_plan.cli import main
from taichi_plan.plan.format import FORMAT_VERSION as PLAN_VERSION
from taichi_plan.record import get_workload, record_workload
from taichi_plan.trace.devices import get_profile
from taichi_plan.trace.format import FORMAT_VERSION, baseline_peak, write_trace
from taichi_plan.trace.roofline import collective_duration_s

GPT2 = {"model": "gpt2", "layers": 2, "hidden": 64, "heads": 4, "vocab": 500, "seq": 128, "batch": 8}
MLP = {"model": "mlp", "batch": 8, "hidden": 64, "layers": 2}
CAP_MB = 0.1  # 5 buckets of the tiny GPT-2's 790.53 KB of gradients


def _record(tmp, name, sizes, world_size, **kw):
    from taichi_plan.record.ddp import record_ddp_workload

    trace = record_ddp_workload(get_workload(**sizes), world_size, steps=1, **kw)
    return write_trace(trace, tmp / "traces" / name)


def _reference_buckets(sizes, **kw) -> list[int]:
    """The bytes of each gradient bucket DDP's reducer holds after its bucket rebuild, for a
    model built and wrapped independently of the recorder."""
    import torch

    from taichi_plan.record.api import make_step_fn
    from taichi_plan.record.ddp import local_process_group, wrap_ddp

    with local_process_group():
        model, batch, loss_fn, opt = get_workload(**sizes).build(False)
        ddp = wrap_ddp(model, **kw)
        step = make_step_fn(ddp, batch, loss_fn, opt)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            step()
        out = [int(b.buffer().numel() * b.buffer().element_size()) for b in ddp.reducer._get_zeros_like_grad_buckets()]
        assert sum(out) == sum(p.numel() * p.element_size() for p in model.parameters())
        del ddp, model
        torch.distributed.barrier()
    return out


@pytest.fixture(scope="module")
def ddp_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    trace_dir = _record(d, "t", GPT2, 2, bucket_cap_mb=CAP_MB)
    plan = d / "plans" / "t.plan.json"
    r = CliRunner().invoke(main, ["solve", str(trace_dir), "--budget", "50%", "--work-limit", "1", "--seed", "0",
                                  "-o", str(plan)])
    assert r.exit_code == 0, r.output
    return plan


def _trace_of(plan):
    from taichi_plan.trace.format import read_trace

    return read_trace(plan.parent.parent / "traces" / "t")


def test_buckets_are_ddp_own_buffers(ddp_plan):
    trace = _trace_of(ddp_plan)
    d = trace.meta["ddp"]
    assert trace.meta["format_version"] == FORMAT_VERSION and d["world_size"] == 2 and not d["gradient_as_bucket_view"]
    want = _reference_buckets(GPT2, bucket_cap_mb=CAP_MB)
    assert len(want) > 2  # the cap splits the gradients
    assert [b["nbytes"] for b in d["buckets"]] == want
    t = trace.tensors
    rows = t[t["kind"] == "ddp_bucket"]
    assert sorted(rows["nbytes"].tolist()) == sorted(want)
    assert (rows["alloc_op"] == -1).all() and (rows["free_op"] == -1).all()  # held all step, by DDP
    # without bucket views the gradients are separate storages, made in backward
    grads = t[t["kind"] == "gradient"]
    assert grads["nbytes"].sum() == sum(want) and (grads["alloc_op"] >= 0).all()


def test_allreduces_are_costed_over_the_ranks(ddp_plan):
    trace = _trace_of(ddp_plan)
    ops, acc, t = trace.ops, trace.accesses, trace.tensors
    ar = ops[ops["op"] == "c10d.allreduce_.default"]
    assert len(ar) == len(trace.meta["ddp"]["buckets"]) and (ar["phase"] == "backward").all()
    assert (ar["cost_source"] == "estimated").all() and (ar["recomputable"] == False).all()  # noqa: E712
    profile = get_profile(trace.meta["ddp"]["collective_profile"])
    for op_id, dur in zip(ar["op_id"], ar["duration_s"], strict=True):
        (tid,) = acc["tensor_id"][acc["op_id"] == op_id].tolist()
        assert t.loc[t["tensor_id"] == tid, "kind"].item() == "ddp_bucket"
        nbytes = int(t.loc[t["tensor_id"] == tid, "nbytes"].item())
        assert dur == collective_duration_s(profile, "c10d.allreduce_.default", nbytes, 2) > profile.launch_overhead_s


def test_replay_two_gloo_ranks_measured_equals_predicted(ddp_plan):
    # each rank measures the predicted peak planned, and the one-process recording's peak unplanned
    report, plan = replay_measures_the_prediction(ddp_plan)
    assert plan["format_version"] == PLAN_VERSION and plan["trace"]["layout"]["ddp"]["gradient_as_bucket_view"] is False
    assert report["parallelism"] == "DDP"
    assert plan["predicted"]["baseline_peak_bytes"] == baseline_peak(_trace_of(ddp_plan))[0]


def test_torchrun_script_applies_the_plan(ddp_plan):
    losses = torchrun_losses("train_ddp_with_plan.py", str(ddp_plan), "--bucket-cap-mb", str(CAP_MB))
    assert set(losses) == {0, 1} and losses[0] == losses[1], losses  # DDP keeps the replicas equal


def test_gradient_as_bucket_view_and_bucket_settings_are_the_layout(tmp_path):
    """With bucket views the buckets are the gradients (no second copy); a plan is refused on
    a DDP wrapper with another bucket cap, on the unwrapped model, and a plan of one process
    on a DDP wrapper."""
    import taichi_plan
    from taichi_plan.record.ddp import local_process_group, wrap_ddp
    from taichi_plan.trace.format import read_trace

    kw = {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}
    trace_dir = _record(tmp_path, "m", MLP, 1, **kw)
    trace = read_trace(trace_dir)
    t = trace.tensors
    assert not (t["kind"] == "ddp_bucket").any()
    grads = t[t["kind"] == "gradient"]
    assert sorted(grads["nbytes"].tolist()) == sorted(_reference_buckets(MLP, **kw))
    assert (grads["alloc_op"] == -1).all()  # the reducer's buckets exist before the step
    plan = tmp_path / "m.plan.json"
    r = CliRunner().invoke(main, ["solve", str(trace_dir), "--budget", "100%", "--method", "heuristic", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    with local_process_group():
        model, _b, _l, opt = get_workload(**MLP).build(False)
        taichi_plan.finish(taichi_plan.apply(wrap_ddp(model, **kw), plan, optimizer=opt))  # the recorded layout
        with pytest.raises(PlanError, match="bucket_bytes_cap=10485.*applied to 1 ranks.*bucket_bytes_cap=20971"):
            taichi_plan.apply(wrap_ddp(model, bucket_cap_mb=0.02, gradient_as_bucket_view=True), plan)
        with pytest.raises(PlanError, match="applied to one process"):
            taichi_plan.apply(model, plan)
        plain = tmp_path / "plain.plan.json"
        plain_trace = tmp_path / "traces" / "plain"
        write_trace(record_workload(get_workload(**MLP), steps=1), plain_trace)
        r = CliRunner().invoke(main, ["solve", str(plain_trace), "--budget", "100%", "--method", "heuristic",
                                      "-o", str(plain)])
        assert r.exit_code == 0, r.output
        with pytest.raises(PlanError, match="solved for one process.*DistributedDataParallel"):
            taichi_plan.apply(wrap_ddp(model), plain)


def test_ddp_usage_errors(ddp_plan):
    r = CliRunner().invoke(main, ["replay", str(ddp_plan), "--nproc", "3"])
    assert r.exit_code != 0 and "--nproc 2" in r.output and "--ddp 3" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["replay", str(ddp_plan)])
    assert r.exit_code != 0 and "2-rank DDP job" in r.output and "--nproc 2" in r.output
    r = CliRunner().invoke(main, ["solve", str(ddp_plan.parent.parent / "traces" / "t"), "--budget", "90%",
                                  "--optimizer", "in-backward", "-o", str(ddp_plan.parent / "ib.plan.json")])
    assert r.exit_code != 0 and "DDP job" in r.output and "Traceback" not in r.output
    for args, says in ((["--ddp", "2", "--fake"], "FakeTensorMode"),
                       (["--bucket-cap-mb", "1"], "add --ddp N"),
                       (["--ddp", "2", "--fsdp", "2"], "give one of them"),
                       (["--ddp", "2", "--bucket-cap-mb", "0"], "positive")):
        r = CliRunner().invoke(main, ["record", "--model", "mlp", "--batch", "2", "--hidden", "16", "--layers", "1",
                                      *args, "-o", str(ddp_plan.parent / "x")])
        assert r.exit_code != 0 and says in r.output and "Traceback" not in r.output, (args, r.output)


def test_partitions_replay_on_two_ranks_as_predicted(ddp_plan, tmp_path):
    """Modules split into chunks under DDP: each rank measures the predicted peak, gradients
    allclose (the chunks' sums round apart). The recording probes when the step's code lets go
    of each storage (as one process does), so the attentions, which append to GPT-2's KV cache,
    and the blocks around them are not offered (a block checkpointed whole measured 1 MiB
    over its prediction on each rank when they were)."""
    from taichi_plan.plan.format import Partition, save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.find import module_spans
    from taichi_plan.solve.result import Decisions, make_plan

    trace = _trace_of(ddp_plan)
    assert "python_refs" in trace.meta
    p = build_problem(trace)
    names = {s.module for s in module_spans(p)}
    assert "transformer.h.0.mlp.c_fc" in names
    assert not any(n.endswith(".attn") or n in ("transformer.h.0", "transformer.h.1") for n in names), names
    parts = [Partition("transformer.h.0.mlp.c_fc", 0, 2), Partition("transformer.h.1.mlp.act", 0, 8)]
    plan = make_plan(p, None, "manual", Decisions(partitions=parts), 0.0, 0)
    path = ddp_plan.parent / "parts.plan.json"
    save_plan(plan, path, force=True)
    r = CliRunner().invoke(main, ["replay", str(path), "--nproc", "2", "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = r.output[r.output.index("{"):r.output.rindex("}") + 1]
    import json

    report = json.loads(report)
    assert report["grads_match"] and report["grads_check"].startswith("allclose"), report
    for rank in report["ranks"]:
        assert rank["measured_peak_bytes"] == plan.predicted["planned_peak_bytes"], rank


def test_modules_whole_with_their_outputs_dropped_replay_on_two_ranks(ddp_plan):
    """Every innermost module with outputs a plan may drop, checkpointed whole and those
    outputs dropped (rebuilt through the module from the input its checkpoint holds) under
    DDP: each rank measures the predicted peak, gradients bitwise (one chunk re-runs the same
    ops on the same values)."""
    import json

    from partition_replay import innermost_with_outputs, whole_output_drops

    from taichi_plan.plan.format import save_plan
    from taichi_plan.problem.core import build_problem
    from taichi_plan.problem.partition.span import as_partition
    from taichi_plan.solve.result import Decisions, make_plan

    p = build_problem(_trace_of(ddp_plan))
    spans = innermost_with_outputs(p)
    drops = whole_output_drops(p, spans, every=False)
    assert spans and drops
    plan = make_plan(p, None, "manual", Decisions(drops=drops, partitions=[as_partition(s, 1) for s in spans]),
                     0.0, 0)
    path = ddp_plan.parent / "whole.plan.json"
    save_plan(plan, path, force=True)
    r = CliRunner().invoke(main, ["replay", str(path), "--nproc", "2", "--steps", "1", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):r.output.rindex("}") + 1])
    assert report["predicted_peak_bytes"] < plan.predicted["baseline_peak_bytes"]
    assert report["grads_check"].startswith("bitwise"), report["grads_check"]
    for rank in report["ranks"]:
        assert rank["measured_peak_bytes"] == report["predicted_peak_bytes"], rank
        assert rank["grads_match"] and rank["params_match"] and rank["dropped_storages"] > 0, rank
