"""The simulator's offload model against schedules computed by hand (taichi_plan/problem/offload.py)."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import TraceBuilder

from taichi_plan.base.errors import PlanError
from taichi_plan.plan.format import peak_from_schedule
from taichi_plan.problem.core import build_problem
from taichi_plan.problem.offload import Offload, offload_candidates
from taichi_plan.simulate.core import Drop, build_schedule, simulate


def tiny(big_b: bool = False, backward_s: float = 1.0, a_s: float = 1.0):
    """x (4 B, input) -> op0 A=f(x) 1000 B -> op1 B=g(A) (100 B, or 1000 with ``big_b``) ->
    op2 C=h(B) 100 B -> op3 T=big(C) 2000 B -> op4 L=sum(T) 4 B | backward: op5 G=ones(L)
    100 B -> op6 GB=h'(G, B) 100 B -> op7 GX=f'(GB, A) 4 B. Every op costs 1 s except
    op5 and op6 (``backward_s`` each) and op0 (``a_s``: A's rebuild). A's gap: after op1,
    back before op7; B's: after op2, back before op6."""
    b = TraceBuilder()
    x = b.tensor(4, "input")
    (a,) = b.op("aten.mm.default", [x], [1000], cost=a_s)
    (bb,) = b.op("aten.relu.default", [a], [1000 if big_b else 100])
    (c,) = b.op("aten.gelu.default", [bb], [100])
    (t,) = b.op("aten.exp.default", [c], [2000], kind="temporary")
    (loss,) = b.op("aten.sum.default", [t], [4], kind="temporary")
    (g,) = b.op("aten.ones_like.default", [loss], [100], phase="backward", cost=backward_s, kind="temporary")
    (gb,) = b.op("aten.mul.Tensor", [g, bb], [100], phase="backward", cost=backward_s, kind="temporary")
    b.op("aten.mm.default", [gb, a], [4], phase="backward", kind="temporary")
    return build_problem(b.build("offload-tiny")), a, bb


def test_candidates_are_forward_to_backward_gaps():
    prob, a, bb = tiny()
    got = {o.tensor: (o.after, o.before) for o in offload_candidates(prob)}
    assert got[a] == (1, 7) and got[bb] == (2, 6)


def test_fast_link_frees_during_forward_and_prefetches_latest():
    # 1000 B/s: A's copies take 1 s. Op i runs [i, i+1). Copy-out issued when op1 ends (t=2),
    # runs [2, 3); op2 starts before it ends (2 < 3), op3 does not: A is freed after op2.
    # Prefetch: op7 starts at 7, so the copy-in must start by 6; the latest issue point whose
    # boundary is <= 6 is op6: copy-in [6, 7), no stall. A is live ops 0..2 and 6..7.
    # Unplanned live bytes (x 4 always): op0 1004, op1 1104, op2 1204, op3 3204 (A, B, C, T),
    # op4 3108, op5 1208, op6 1304, op7 1108; peak 3204 at op3. Offloaded: op3 2204, op4
    # 2108, op5 208, op6 1304, op7 1108: peak 2204 at op3. Host: 1000 B from t=2 to t=7.
    prob, a, _ = tiny()
    sim = simulate(prob, [], [Offload(a, 1, 7)], host_link_bytes_per_s=1000.0)
    tm = sim.offload.timings[0]
    assert (tm.copy_out_start_s, tm.copy_out_end_s, tm.freed_after) == (2.0, 3.0, 2)
    assert (tm.prefetch_at, tm.copy_in_start_s, tm.copy_in_end_s, tm.stall_s) == (6, 6.0, 7.0, 0.0)
    assert sim.live_bytes.tolist() == [1004, 1104, 1204, 2204, 2108, 208, 1304, 1108]
    assert (sim.peak_bytes, sim.peak_op) == (2204, 3)
    assert sim.host_peak_bytes == 1000
    assert sim.extra_cost == 0.0 and sim.offload.step_time_s == 8.0
    unplanned = simulate(prob, [])
    assert unplanned.peak_bytes == 3204 and unplanned.live_bytes.tolist()[5] == 1208
    # The schedule says the same, and its peak is the simulator's.
    sched = build_schedule(prob, [], sim.offload)
    kinds = [(e[0], e[1]) for e in sched["events"] if e[0] != "run"]
    assert kinds == [("copy_out", 2), ("copy_in", 6)]
    assert peak_from_schedule(sched)[0] == sim.peak_bytes


def test_slow_link_frees_later():
    # 500 B/s: copies take 2 s. Copy-out [2, 4): op3 starts at 3 < 4, so A is still on the
    # device during op3 (the peak stays 3204) and freed after it. Prefetch: start by
    # 7 - 2 = 5, at or after the copy-out's end (4): op5, copy-in [5, 7), no stall. A is away
    # during op4 only (2108); back from op5 on, as unplanned: op5 1208, op6 1304, op7 1108.
    prob, a, _ = tiny()
    sim = simulate(prob, [], [Offload(a, 1, 7)], host_link_bytes_per_s=500.0)
    tm = sim.offload.timings[0]
    assert (tm.copy_out_end_s, tm.freed_after, tm.prefetch_at, tm.stall_s) == (4.0, 3, 5, 0.0)
    assert sim.live_bytes.tolist() == [1004, 1104, 1204, 3204, 2108, 1208, 1304, 1108]
    assert sim.peak_bytes == 3204


def test_fifo_copies_stall_the_step():
    # B is 1000 B too; 1000 B/s: every copy 1 s. op5 and op6 cost 0.25 s: op0..op4 [i, i+1),
    # op5 [5, 5.25), op6 [5.25, 5.5), op7 [5.5, 6.5). Copy-outs (one stream, FIFO): A [2, 3)
    # (freed after op2), B issued when op2 ends at 3, [3, 4) (op3 starts at 3 < 4: freed
    # after op3). Prefetch, latest deadline first: A by 5.5 -> start by 4.5 -> op4 (boundary 4);
    # B must end by min(5.25, A's start 4.5) -> start by 3.5, but its copy-out ends at 4: no
    # point fits, the first at or after 4 is op4. Issued before op4 in deadline order: B [4, 5),
    # then A (FIFO) [5, 6). op6 starts at 5.25 >= 5: no wait. op7 due at 5.5, A ends at 6: the
    # compute stream stalls 0.5 s; the step takes 6.5 + 0.5 = 7 s. B is allocated again at op4
    # right after it is freed after op3: it never leaves. A is away during op3 only.
    # Unplanned live (B 1000): op3 4+1000+1000+100+2000 = 4104; offloaded op3 3104.
    prob, a, bb = tiny(big_b=True, backward_s=0.25)
    sim = simulate(prob, [], [Offload(a, 1, 7), Offload(bb, 2, 6)], host_link_bytes_per_s=1000.0)
    t = sim.offload.by_tensor()
    assert (t[a].freed_after, t[bb].freed_after) == (2, 3)
    assert (t[a].prefetch_at, t[bb].prefetch_at) == (4, 4)
    assert (t[bb].copy_in_start_s, t[bb].copy_in_end_s) == (4.0, 5.0)
    assert (t[a].copy_in_start_s, t[a].copy_in_end_s) == (5.0, 6.0)
    assert (t[a].stall_s, t[bb].stall_s) == (0.5, 0.0)
    assert sim.stall_cost == 0.5 and sim.extra_cost == 0.5 and sim.offload.step_time_s == 7.0
    assert not t[bb].leaves_device and t[a].leaves_device
    assert sim.live_bytes[3] == 3104 and simulate(prob, []).live_bytes[3] == 4104
    # Host: A from 2 to 6, B from 3 to 5: 2000 B at most.
    assert sim.host_peak_bytes == 2000
    assert np.allclose(sim.offload.op_start_s, [0, 1, 2, 3, 4, 5, 5.25, 6.0])


def test_refusals():
    prob, a, bb = tiny()
    with pytest.raises(PlanError, match="not a forward -> backward gap"):
        simulate(prob, [], [Offload(a, 0, 7)], host_link_bytes_per_s=1000.0)
    with pytest.raises(PlanError, match="both drops and offloads"):
        simulate(prob, [Drop(a, 1, 7)], [Offload(a, 1, 7)], host_link_bytes_per_s=1000.0)
    with pytest.raises(PlanError, match="host link"):
        simulate(prob, [], [Offload(a, 1, 7)])


def test_a_rebuild_that_reads_an_offloaded_tensor_moves_its_deadline():
    # Dropping B rebuilds it (relu, 1 s) in the group before op6, from A, which is on the host
    # until its copy-in: A is needed back before that group, not before op7. 1000 B/s, copies
    # 1 s. Stall-free timeline: op0..op5 [i, i+1), the group [6, 7), op6 [7, 8), op7 [8, 9).
    # Copy-out [2, 3): freed after op2. Deadline: the group's start, 6 -> copy-in starts by 5;
    # the latest issue point at or after the copy-out's end (3) with a boundary <= 5 is op5
    # (alone, A's was op6: test_fast_link_frees_during_forward_and_prefetches_latest). Live:
    # op3 x + C + T = 2104; op4 x + T + L = 2008; op5 x + A (back) + G + L = 1108; the group
    # carries x + A + G = 1104 and makes B: 1204; op6 x + A + B + G + GB = 1304; op7 1108.
    prob, a, bb = tiny()
    sim = simulate(prob, [Drop(bb, 2, 6)], [Offload(a, 1, 7)], host_link_bytes_per_s=1000.0)
    tm = sim.offload.timings[0]
    assert (tm.back_by, tm.by_group, tm.freed_after) == (6, True, 2)
    assert (tm.prefetch_at, tm.copy_in_start_s, tm.copy_in_end_s, tm.stall_s) == (5, 5.0, 6.0, 0.0)
    assert sim.live_bytes.tolist() == [1004, 1104, 1204, 2104, 2008, 1108, 1304, 1108]
    assert sim.groups[6].peak_bytes == 1204
    assert (sim.peak_bytes, sim.peak_op) == (2104, 3)
    assert sim.extra_cost == 1.0 and sim.offload.step_time_s == 9.0
    alone = simulate(prob, [], [Offload(a, 1, 7)], host_link_bytes_per_s=1000.0).offload.timings[0]
    assert (alone.back_by, alone.by_group, alone.prefetch_at) == (7, False, 6)


def test_the_step_waits_before_the_group_that_reads_an_offloaded_tensor():
    # As above at 500 B/s with op5 and op6 at 0.25 s: copies take 2 s. Copy-out [2, 4): op3
    # starts at 3 < 4, A is freed after op3. Deadline: the group before op6, at 5.25 on the
    # stall-free timeline -> start by 3.25; no issue point at or after 4 is that early, so the
    # copy-in goes at the first, op4: [4, 6), and A never leaves (back before op4, freed after
    # op3). The compute stream reaches the group at 5.25 and waits 0.75 s for the copy: the
    # group runs [6, 7), op6 [7, 7.25), op7 [7.25, 8.25). Extra: the rebuild's 1 s + the wait.
    prob, a, bb = tiny(backward_s=0.25)
    sim = simulate(prob, [Drop(bb, 2, 6)], [Offload(a, 1, 7)], host_link_bytes_per_s=500.0)
    tm = sim.offload.timings[0]
    assert (tm.freed_after, tm.prefetch_at, tm.back_by, tm.by_group) == (3, 4, 6, True)
    assert (tm.copy_in_start_s, tm.copy_in_end_s, tm.stall_s) == (4.0, 6.0, 0.75)
    assert not tm.leaves_device
    assert np.allclose(sim.offload.op_start_s, [0, 1, 2, 3, 4, 5, 7.0, 7.25])
    assert sim.extra_cost == 1.75 and sim.offload.step_time_s == 8.25
