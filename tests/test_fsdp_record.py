"""Rank 0 of an FSDP2 job, traced on the fake process group, against PyTorch's FSDPMemTracker.

The gate of sharded planning (issue 10): the trace's peak, and its bytes per category at the
peak, agree with ``FSDPMemTracker`` over the same step. Recordings run in this process
through the CLI; a process group is global state, and one test checks that nothing leaks out
of a recording.
"""

from __future__ import annotations

import pytest
from ranks import record_cli

from taichi_plan.trace.devices import get_profile
from taichi_plan.trace.format import FORMAT_VERSION, read_trace
from taichi_plan.trace.layout import incarnations, unit_of_ops
from taichi_plan.trace.roofline import collective_duration_s

TINY_GPT2 = ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "500",
             "--seq", "128", "--batch", "4"]


def _record(tmp_path, args, name="t"):
    out = tmp_path / name
    output = record_cli(*args, "--fake", "-o", str(out))
    return read_trace(out), output


@pytest.fixture(scope="module")
def gpt2_fsdp4(tmp_path_factory):
    return _record(tmp_path_factory.mktemp("fsdp"), [*TINY_GPT2, "--fsdp", "4", "--device-profile", "h100-80gb"])


def _check_against_tracker(trace):
    from taichi_plan.record.fsdp import trace_by_tracker_category

    peak, at, cats = trace_by_tracker_category(trace)
    ref = trace.meta["fsdp"]["mem_tracker"]
    assert abs(peak - ref["peak_bytes"]) <= 0.05 * ref["peak_bytes"], (peak, ref)
    for cat, want in ref["by_category"].items():
        assert abs(cats[cat] - want) <= 0.05 * max(want, 1), (cat, cats[cat], want)
    return cats


def test_fake_rank_trace_agrees_with_fsdp_mem_tracker(gpt2_fsdp4):
    trace, out = gpt2_fsdp4
    cats = _check_against_tracker(trace)
    # The categories that only exist because of sharding are there, not just the total.
    assert cats["Unsharded Param"] > 0 and cats["Sharded Param"] > 0
    assert "FSDPMemTracker's peak for the same step" in out and "(+0.00%)" in out


def test_trace_knows_the_sharded_layout(gpt2_fsdp4):
    trace, _ = gpt2_fsdp4
    f = trace.meta["fsdp"]
    assert trace.meta["format_version"] == FORMAT_VERSION
    assert f["world_size"] == 4 and f["mesh_shape"] == [4]
    assert [u["module"] for u in f["units"]] == ["", "transformer.h.0", "transformer.h.1"]
    kinds = set(trace.tensors["kind"])
    assert {"unsharded_parameter", "unsharded_gradient", "all_gather", "reduce_scatter"} <= kinds
    t = trace.tensors
    for u in f["units"]:  # a shard is a quarter of the unit (padding only rounds it up)
        assert u["unsharded_nbytes"] / 4 <= u["sharded_nbytes"] <= u["unsharded_nbytes"] / 4 * 1.1
    # resize_ seen: every unsharded parameter is freed after forward and gathered again for backward
    rows = incarnations(trace.meta)
    unsharded = t[t["kind"] == "unsharded_parameter"]
    assert len(rows) == len(unsharded) // 2 and all(len(r) == 2 for r in rows)
    by_id = t.set_index("tensor_id")
    for fwd, bwd in rows:
        assert by_id.loc[fwd, "free_op"] < by_id.loc[bwd, "alloc_op"]
        assert trace.ops["phase"][by_id.loc[bwd, "alloc_op"]] == "backward"


def test_collectives_are_costed_on_the_interconnect(gpt2_fsdp4):
    trace, _ = gpt2_fsdp4
    ops = trace.ops
    coll = ops[ops["op"].str.startswith("c10d.")]
    assert set(coll["op"]) == {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default"}
    assert not coll["recomputable"].any()
    h100 = get_profile("h100-80gb")
    acc = trace.accesses.merge(trace.tensors[["tensor_id", "nbytes"]], on="tensor_id")
    for i, row in coll.iterrows():
        full = int(acc[acc["op_id"] == i]["nbytes"].max())
        assert row["duration_s"] == pytest.approx(collective_duration_s(h100, row["op"], full, 4))
        assert row["duration_s"] == pytest.approx(0.75 * full / 450e9 + 5e-6)
    # each collective belongs to a unit; compute ops to the unit of their module
    unit = unit_of_ops(trace.meta, ops["module"].tolist())
    assert (unit[coll.index.to_numpy()] >= 0).all()
    h1 = ops.index[ops["module"].str.startswith("transformer.h.1.")].to_numpy()
    assert (unit[h1] == 2).all()


def test_record_in_process_leaves_no_process_group_and_no_patch():
    import torch
    import torch.distributed as dist

    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import record_fsdp_workload, trace_by_tracker_category

    resize = torch.UntypedStorage.resize_
    trace = record_fsdp_workload(get_workload(model="mlp", batch=8, hidden=32, layers=3), 2, check_tracker=True)
    assert not dist.is_initialized()
    assert torch.UntypedStorage.resize_ is resize
    peak, _, cats = trace_by_tracker_category(trace)
    assert peak == trace.meta["fsdp"]["mem_tracker"]["peak_bytes"]


def test_without_resize_the_trace_would_miss_unsharded_parameters(monkeypatch):
    """What the gate guards against: a recorder blind to ``resize_`` never sees FSDP2 free its
    gathered parameters (it takes them for storages live all step), and overstates the peak."""
    import torch.distributed as dist

    from taichi_plan.record import get_workload
    from taichi_plan.record.fsdp import record_fsdp_workload, trace_by_tracker_category
    from taichi_plan.record.recorder import Recorder

    monkeypatch.setattr(Recorder, "_patch_resize", lambda self: None)
    trace = record_fsdp_workload(get_workload(model="mlp", batch=8, hidden=32, layers=3), 2)
    assert not dist.is_initialized()
    peak, _, _ = trace_by_tracker_category(trace)
    ref = trace.meta["fsdp"]["mem_tracker"]["peak_bytes"]
    assert peak > 1.05 * ref
    assert "incarnations" in trace.meta["fsdp"] and not trace.meta["fsdp"]["incarnations"]


def test_fsdp_flags_are_checked(tmp_path):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    r = CliRunner().invoke(main, ["record", *TINY_GPT2, "--fake", "--fsdp", "0", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "at least 1 rank" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["record", *TINY_GPT2, "--fake", "--no-reshard-after-forward",
                                  "-o", str(tmp_path / "y")])
    assert r.exit_code != 0 and "--fsdp" in r.output


def test_rank_plan_rebuilds_only_while_parameters_are_gathered(gpt2_fsdp4, tmp_path):
    """Solve rank 0 at half its peak: rebuilds in backward re-run ops that read unsharded
    parameters, and each such read finds a row of that parameter's storage live (gathered
    again for backward), never the forward row FSDP resharded. Checked on the trace's own
    tables, apart from the problem's ``held``."""
    from taichi_plan.problem.core import build_problem, rebuildable
    from taichi_plan.problem.optimizer.plan import problem_for_plan
    from taichi_plan.solve import solve
    from taichi_plan.trace.format import baseline_peak

    trace, _ = gpt2_fsdp4

    peak, _ = baseline_peak(trace)
    plan = solve(trace, budget_bytes=peak // 2, method="heuristic")
    assert plan.predicted["planned_peak_bytes"] <= peak // 2
    assert plan.trace["layout"]["world_size"] == 4

    # The schedule's ids are those of the step as the plan runs it: its FSDP units that do not
    # reshard keep one row of each gathered parameter from forward to backward (plan v5).
    step = problem_for_plan(plan, trace).trace
    t = step.tensors.set_index("tensor_id")
    rows_of = {tid: rows for rows in incarnations(step.meta) for tid in rows}
    single = t.index[t["kind"] == "unsharded_parameter"]
    rows_of.update({int(tid): [int(tid)] for tid in single if int(tid) not in rows_of})
    reads = step.accesses[step.accesses["role"] == "read"].groupby("op_id")["tensor_id"].apply(list).to_dict()
    param_reads = 0
    pending = []  # recompute events come right before the run event of the op they precede
    for kind, op, _a, _f in plan.schedule["events"]:
        if kind == "recompute":
            pending.append(op)
            continue
        for q in pending:
            for u in reads.get(q, []):
                if t.loc[u, "kind"] != "unsharded_parameter":
                    continue
                param_reads += 1
                live = [v for v in rows_of[u] if t.loc[v, "alloc_op"] <= op - 1 and t.loc[v, "free_op"] >= op]
                assert live, f"a rebuild before op {op} reads parameter row {u} while it is resharded"
        pending = []
    assert param_reads > 0  # the plan does re-run ops that read gathered parameters

    # Without the storage's other rows, those candidates would not exist at all.
    prob = build_problem(trace)
    with_rows = len(prob.candidates)
    prob.same_storage.clear()
    still = sum(rebuildable(prob, int(c), int(b)) for c, b in zip(prob.candidates, prob.cand_remat_before))
    assert still < with_rows


def test_plan_refuses_another_layout(gpt2_fsdp4, tmp_path):
    from taichi_plan.base.errors import PlanError
    from taichi_plan.problem.fit import check_plan_against_trace
    from taichi_plan.solve import solve

    trace, _ = gpt2_fsdp4
    plan = solve(trace, budget_bytes=10**12, method="none")
    check_plan_against_trace(plan, trace)
    plan.trace["layout"] = dict(plan.trace["layout"], world_size=8)
    with pytest.raises(PlanError, match="solved for 8 ranks.*applied to 4 ranks"):
        check_plan_against_trace(plan, trace)


def test_maxbatch_records_rank_zero_of_the_sharded_job():
    """maxbatch --fsdp N searches the batch per rank on rank 0's sharded step: each probe is
    such a trace, whose parameter bytes are a quarter of the unsharded step's at 4 ranks."""
    from click.testing import CliRunner

    from taichi_plan.cli import main
    from taichi_plan.explore.maxbatch import fake_recorder
    from taichi_plan.torch_common.fsdp import mixed_precision

    sizes = dict(layers=2, hidden=64, heads=4, vocab=500, seq=128, dtype="fp32", optimizer="adamw")
    sharded = fake_recorder("gpt2", fsdp=4, **sizes)(2)
    plain = fake_recorder("gpt2", **sizes)(2)
    assert sharded.meta["fsdp"]["world_size"] == 4 and "fsdp" not in plain.meta
    assert sharded.meta["workload"]["args"]["batch"] == 2

    def param_bytes(t):
        return int(t.tensors.loc[t.tensors["kind"] == "parameter", "nbytes"].sum())

    assert param_bytes(plain) / 4 <= param_bytes(sharded) <= param_bytes(plain) / 4 * 1.1
    r = CliRunner().invoke(main, ["maxbatch", "--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4",
                                  "--vocab", "500", "--seq", "128", "--budget", "8MB", "--limit", "1",
                                  "--method", "heuristic", "--time-limit", "2", "--fsdp", "2"])
    assert r.exit_code == 0, r.output
    assert "rank 0 of 2 FSDP2 ranks (batch per rank)" in r.output
    # an HSDP job under mixed precision, as recorded: each probe is such a trace
    hsdp = fake_recorder("gpt2", fsdp=4, replicas=2, mixed_precision=mixed_precision("bf16", "fp32"), **sizes)(2)
    assert hsdp.meta["fsdp"]["mesh_shape"] == [2, 2]
    assert {u["param_dtype"] for u in hsdp.meta["fsdp"]["units"]} == {"bfloat16"}
    r = CliRunner().invoke(main, ["maxbatch", "--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4",
                                  "--vocab", "500", "--seq", "128", "--budget", "8MB", "--hsdp", "2"])
    assert r.exit_code != 0 and "add --fsdp N" in r.output and "Traceback" not in r.output


def test_timeline_stacks_every_kind_of_a_sharded_trace(gpt2_fsdp4):
    """The timeline and the HTML report stack kinds in STACK_ORDER: every kind a trace can hold
    must be there, or the drawn stack of a sharded trace falls short of its total."""
    from taichi_plan.report.timeline import KIND_COLORS, STACK_ORDER
    from taichi_plan.trace.format import KINDS

    assert set(STACK_ORDER) == set(KINDS) <= set(KIND_COLORS)
    trace, _ = gpt2_fsdp4
    assert set(trace.tensors["kind"]) <= set(STACK_ORDER)


def test_mixed_precision_rank_trace_agrees_with_fsdp_mem_tracker(gpt2_fsdp4, tmp_path):
    """FSDP2's MixedPrecisionPolicy, as most sharded jobs run (parameters gathered in bf16,
    gradients reduced in fp32: torchtitan's default): the trace agrees with FSDPMemTracker by
    category, its units gather half the bytes of the fp32 recording's, and its layout says so
    (trace v16), so that a plan of it is refused on a job sharded without it."""
    from taichi_plan.trace.layout import layout

    trace, out = _record(tmp_path, [*TINY_GPT2, "--fsdp", "4", "--device-profile", "h100-80gb",
                                    "--fsdp-param-dtype", "bf16", "--fsdp-reduce-dtype", "fp32"])
    cats = _check_against_tracker(trace)
    assert cats["Unsharded Param"] > 0 and "(+0.00%)" in out
    fp32, _ = gpt2_fsdp4
    units, full = trace.meta["fsdp"]["units"], {u["module"]: u for u in fp32.meta["fsdp"]["units"]}
    for u in units:
        assert (u["param_dtype"], u["reduce_dtype"]) == ("bfloat16", "float32")
        assert u["unsharded_nbytes"] * 2 == full[u["module"]]["unsharded_nbytes"]
        assert u["sharded_nbytes"] == full[u["module"]]["sharded_nbytes"]  # the shards stay fp32
    got = layout(trace.meta)
    assert got["mixed_precision"] == [[u["module"], "bfloat16", "float32"] for u in units]
    assert "mixed_precision" not in layout(fp32.meta)
    gathered = trace.tensors[trace.tensors["kind"] == "unsharded_parameter"]
    assert set(gathered["dtype"]) == {"bfloat16"}


def test_mixed_precision_flags_need_fsdp(tmp_path):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    r = CliRunner().invoke(main, ["record", *TINY_GPT2, "--fake", "--fsdp-param-dtype", "bf16", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "MixedPrecisionPolicy: add --fsdp" in r.output and "Traceback" not in r.output


def test_hsdp_rank_trace_agrees_with_fsdp_mem_tracker(tmp_path):
    """HSDP (``--hsdp 2`` of 16 ranks: FSDP2 on a 2-D mesh of 2 replicas of 8-rank shard groups,
    on h100-80gb's 8 devices a node): the trace agrees with FSDPMemTracker by category, the
    shards are an eighth of each unit, and each collective is costed over the group it runs on:
    all-gathers and reduce-scatters over a shard group of consecutive ranks, within one node;
    the gradients' all-reduce over the two replicas, a node apart."""
    trace, out = _record(tmp_path, [*TINY_GPT2, "--fsdp", "16", "--hsdp", "2", "--device-profile", "h100-80gb"])
    _check_against_tracker(trace)
    assert "(HSDP: 2 replicas of 8-rank shard groups)" in out
    f = trace.meta["fsdp"]
    assert f["world_size"] == 16 and f["mesh_shape"] == [2, 8]
    for u in f["units"]:
        assert u["unsharded_nbytes"] / 8 <= u["sharded_nbytes"] <= u["unsharded_nbytes"] / 8 * 1.1
    h100 = get_profile("h100-80gb")
    ops = trace.ops
    coll = ops[ops["op"].str.startswith("c10d.")]
    assert {"c10d._allgather_base_.default", "c10d._reduce_scatter_base_.default",
            "c10d.allreduce_.default"} <= set(coll["op"])
    acc = trace.accesses.merge(trace.tensors[["tensor_id", "nbytes"]], on="tensor_id")
    for i, row in coll.iterrows():
        full = int(acc[acc["op_id"] == i]["nbytes"].max())
        group, across = (2, True) if row["op"] == "c10d.allreduce_.default" else (8, False)
        link = h100.inter_node_bytes_per_s if across else h100.intra_node_bytes_per_s
        factor = 2 if group == 2 else 1
        assert row["duration_s"] == pytest.approx(factor * (group - 1) / group * full / link + h100.launch_overhead_s)
        assert row["duration_s"] == pytest.approx(collective_duration_s(h100, row["op"], full, group, across))


def test_hsdp_flags_are_checked(tmp_path):
    from click.testing import CliRunner

    from taichi_plan.cli import main

    r = CliRunner().invoke(main, ["record", *TINY_GPT2, "--fake", "--hsdp", "2", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "add --fsdp N" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["record", *TINY_GPT2, "--fake", "--fsdp", "4", "--hsdp", "3", "-o", str(tmp_path / "y")])
    assert r.exit_code != 0 and "divisor of 4" in r.output and "Traceback" not in r.output
