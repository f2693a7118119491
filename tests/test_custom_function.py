"""A custom ``torch.autograd.Function`` whose saved input a plan drops: its backward, Python
code, holds what it unpacked until it returns, so a rebuilt copy lives through the sum that
ends it (``(gy * dydw).sum(0)``). The simulator took that sum for the engine's reduction of a
broadcast gradient, which runs after a node's apply, and predicted the peak 512 B low
(``partition.apply_end``: the engine's ``sum_to`` keeps the dimensions it reduces)."""

from __future__ import annotations

import torch
from live_peak import train_entry

from taichi_plan.problem.core import build_problem
from taichi_plan.record import get_workload, record
from taichi_plan.simulate.core import Drop
from taichi_plan.solve.result import Decisions, make_plan

ENTRY = "tiny_models:swish_mlp"


def test_a_rebuilt_input_of_a_custom_function_lives_through_its_backward():
    p = build_problem(trace := record(*get_workload(entry=ENTRY).build(False)))
    # Drop the first Swish's saved input (l1's output), rebuilt when its backward unpacks it,
    # and l2's output, so that the step's peak is in that backward.
    drops = [Drop(int(t), int(a), int(b)) for t, a, b in
             zip(p.candidates, p.cand_free_after, p.cand_remat_before, strict=True)
             if p.op_module[int(p.producer[t])] in ("l1", "l2") and p.op_name[int(p.producer[t])] == "aten.addmm.default"]
    assert len(drops) == 2
    plan = make_plan(p, None, "manual", Decisions(drops=drops), 0.0, 0)
    base, _, _ = train_entry(ENTRY)
    got, peaks, rt = train_entry(ENTRY, plan, trace)
    assert rt.mismatches == 0
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
    # measured by an independent live-storage counter
    assert peaks[1:] == [plan.predicted["planned_peak_bytes"]] * 2, (peaks, plan.predicted["planned_peak_bytes"])
