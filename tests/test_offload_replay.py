"""An offload plan replayed on this CPU (copies host to host): its copies run in the order and
at the points the simulator's schedule says, and training is bitwise the unplanned one's."""

from __future__ import annotations

import pytest
import torch
from live_peak import train_entry

from taichi_plan.problem.core import build_problem
from taichi_plan.problem.offload import OffloadConfig
from taichi_plan.record import get_workload, record_workload
from taichi_plan.runtime.calls import counted_ops
from taichi_plan.solve import solve

ENTRY = "tiny_models:sdpa_blocks"  # two attention blocks with dropout (random ops replayed too)
# The runtime's costs per op as a 7-repetition calibration measured them on an idle 2-core Xeon.
PINNED_OVERHEAD = {"check_op_s": 2.0e-05, "recipe_op_s": 3.8e-05, "rebuild_op_s": 1.7e-05, "checkpoint_call_s": 3.8e-05,
                   "module_call_s": 4.1e-05, "checkpoint_op_s": 0.0, "chunk_op_s": 6.7e-06, "region_s": 3.8e-05,
                   "region_op_s": 1.6e-06, "drop_s": 4.0e-05}


@pytest.fixture(scope="module")
def solved():
    """A real recording of ENTRY and its offload plan at 80% of its peak. 100 MB/s: an 8 KB
    activation's copy takes 82 us, a few of this CPU's ops, so the copies back are issued
    before their tensors' first backward use (prefetch_at < before)."""
    trace = record_workload(get_workload(entry=ENTRY), fake=False)
    # The solver weighs dropping against copying by the recorded op times and the runtime's
    # calibrated costs per op; on a loaded machine both swing (the suite calibrates with one
    # repetition) and the plan with them, down to one without drops. Pinned to this CPU's idle
    # figures, the plan (3 steps of drops beside the copies) is the same on every run.
    trace.ops["duration_s"] = 3e-6
    trace.meta["runtime_overhead"] = {**trace.meta["runtime_overhead"], **PINNED_OVERHEAD}
    problem = build_problem(trace)
    plan = solve(trace, int(problem.baseline_peak[0] * 0.8), "heuristic", problem=problem, optimizer="as-recorded",
                 offload=OffloadConfig(1e8))
    return trace, plan


def test_offload_plan_replays_its_schedule_bitwise(solved):
    trace, plan = solved
    assert plan.offloads and any(o.prefetch_at < o.before for o in plan.offloads)
    base, _base_peaks, _ = train_entry(ENTRY)
    got, peaks, rt = train_entry(ENTRY, plan, trace)
    assert rt.mismatches == 0
    assert plan.recompute and rt.dropped_storages == 3 * len(plan.recompute)  # its drops applied beside the copies
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))  # 3 steps: gradients bitwise
    # The copies, step by step, in the schedule's order: copies out in forward (after the op of
    # each tensor's last forward use, counted as the runtime counts its call's ops), copies back
    # at the prefetch points (triggered, none on demand where the plan issues them early).
    n = len(plan.offloads)
    assert len(rt.copies) == 3 * 2 * n
    sched = [(e[0], (e[2] or e[3])[0]) for e in plan.schedule["events"] if e[0] in ("copy_out", "copy_in")]
    counted = counted_ops(trace)
    start = trace.meta["model_calls"][0]["start"]
    at = {o.tensor: sum(counted[start:o.after]) for o in plan.offloads}
    early = {o.tensor for o in plan.offloads if o.prefetch_at < o.before}
    for k in range(3):
        step = rt.copies[2 * n * k: 2 * n * (k + 1)]
        assert [(kind, tid) for kind, tid, _ in step] == sched
        assert all(where == at[tid] for kind, tid, where in step if kind == "copy_out")
        assert all(where == ("prefetch" if tid in early else "on-demand") for kind, tid, where in step
                   if kind == "copy_in")
    # On a CPU the "device" and the host are one memory: the live-storage counter sees the
    # planned step plus the host copies, never more (the device peak is the simulator's).
    assert peaks[-1] <= plan.predicted["planned_peak_bytes"] + plan.predicted["host_peak_bytes"]


def test_replay_command_reports_an_offload_plan(solved, tmp_path):
    from taichi_plan.plan.format import save_plan
    from taichi_plan.replay.measure import replay
    from taichi_plan.trace.format import write_trace

    trace, plan = solved
    path = write_trace(trace, tmp_path / "traces" / "blocks")
    plan_path = save_plan(plan, tmp_path / "plans" / "blocks.plan.json")
    r = replay(plan_path, steps=2, trace=path)
    assert r["grads_match"] and r["offload"]["tensors"] == len(plan.offloads)
    assert "computed, not measured" in r["offload"]["note"]
    # measured: the planned step and the host copies in one memory, within budget + host peak
    assert r["within_budget"] and r["measured_peak_bytes"] <= plan.budget_bytes + plan.predicted["host_peak_bytes"]


def test_a_plan_whose_copies_do_not_fit_the_trace_is_refused(solved, tmp_path):
    """Guards: an offload moved off its tensor's forward -> backward gap is refused when the plan
    is applied (the simulator checks every offload against the trace), before any step runs."""
    import dataclasses

    import taichi_plan
    from taichi_plan.base.errors import PlanError

    trace, plan = solved
    bad = dataclasses.replace(plan, offloads=[dataclasses.replace(plan.offloads[0], after=plan.offloads[0].op - 1),
                                              *plan.offloads[1:]])
    model, _x, _loss_fn, opt = get_workload(entry=ENTRY).build(False)
    with pytest.raises(PlanError, match="not a forward -> backward gap"):
        taichi_plan.apply(model, bad, trace=trace, optimizer=opt)


def test_a_rebuild_that_reads_an_offloaded_tensor_replays_bitwise(solved):
    """A drop whose rebuild reads a tensor the plan offloads (a checkpoint on the host): the
    simulator needs it back before that rebuild's group, the runtime copies it back there (on
    demand, where the plan issues it no earlier), and training is bitwise the unplanned one's."""
    from taichi_plan.problem.offload import allow_offload, offload_candidates
    from taichi_plan.simulate.core import Drop
    from taichi_plan.solve.result import Decisions, make_plan

    trace, _plan = solved
    problem = allow_offload(build_problem(trace), OffloadConfig(1e8))
    offs = {o.tensor: o for o in offload_candidates(problem)}
    pairs = []  # (a drop, an offload its rebuild reads while the tensor is away)
    for t, a, b in zip(problem.candidates.tolist(), problem.cand_free_after.tolist(),
                       problem.cand_remat_before.tolist(), strict=True):
        for op in problem.rebuild_ops[t].tolist():
            for u in problem.op_reads[op].tolist():
                o = offs.get(int(u))
                if o is not None and o.tensor != t and o.after < b <= o.before:
                    pairs.append((Drop(int(t), int(a), int(b)), o))
    assert pairs
    drop, off = pairs[0]
    plan = make_plan(problem, int(problem.baseline_peak[0]), "heuristic", Decisions(drops=[drop], offloads=[off]),
                     0.0, 0)
    (o,) = plan.offloads
    assert "a rebuild reads it" in o.why and o.prefetch_at < o.before
    base, _base_peaks, _ = train_entry(ENTRY)
    got, _peaks, rt = train_entry(ENTRY, plan, trace)
    assert rt.mismatches == 0 and rt.dropped_storages == 3
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
    assert [(kind, tid) for kind, tid, _ in rt.copies] == [("copy_out", o.tensor), ("copy_in", o.tensor)] * 3


def test_a_tensor_whose_last_forward_use_is_the_op_that_made_it_is_copied_out(tmp_path):
    """A saved tensor only backward reads (a layer norm's mean and rstd) is last used in forward
    by the op that made it: its copy to host runs right after that op, once the runtime knows
    the storage (before, the copy looked for it first and stopped the plan)."""
    from taichi_plan.problem.offload import allow_offload, offload_candidates
    from taichi_plan.solve.result import Decisions, make_plan

    entry = "tiny_models:encoder_layer"
    trace = record_workload(get_workload(entry=entry), fake=False)
    problem = allow_offload(build_problem(trace), OffloadConfig(1e8))
    own = [o for o in offload_candidates(problem) if o.after == int(problem.producer[o.tensor])]
    assert own
    plan = make_plan(problem, int(problem.baseline_peak[0]), "heuristic", Decisions(offloads=own[:1]), 0.0, 0)
    assert plan.offloads[0].after == plan.offloads[0].op
    from taichi_plan.plan.format import save_plan
    from taichi_plan.replay.measure import replay
    from taichi_plan.trace.format import write_trace

    path = write_trace(trace, tmp_path / "traces" / "layer")
    r = replay(save_plan(plan, tmp_path / "plans" / "layer.plan.json"), steps=2, trace=path)
    assert r["grads_match"] and r["offload"]["tensors"] == 1
