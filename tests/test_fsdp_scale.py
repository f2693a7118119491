"""What makes sharded recording and planning affordable at 7B/70B sizes, each checked to change
no number: the FSDPMemTracker check that keeps only the step's peak, and (see test_maxbatch)
the batch search."""

from __future__ import annotations


def test_step_peak_tracker_reports_what_fsdp_mem_tracker_reports():
    """The tracker without per-module peaks gives PyTorch's FSDPMemTracker's step peak and
    categories byte for byte (two steady-state steps of a fake 4-rank tiny GPT-2)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from taichi_plan.record import get_workload
    from taichi_plan.record.api import make_step_fn
    from taichi_plan.record.fsdp import (
        fake_process_group,
        rebuild_optimizer,
        shard_model,
        tracker_peak,
    )

    w = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=64, batch=2)
    with fake_process_group(4) as mesh, FakeTensorMode():
        model, batch, loss_fn, optimizer = w.build(True)
        shard_model(model, mesh)
        optimizer = rebuild_optimizer(optimizer, model)
        step = make_step_fn(model, batch, loss_fn, optimizer)
        optimizer.zero_grad()
        step()  # FSDP's lazy init, the optimizer state
        inputs = [batch]
        full = tracker_peak(model, optimizer, step, inputs, per_module=True)
        fast = tracker_peak(model, optimizer, step, inputs)
    assert full["peak_bytes"] > 0 and full["by_category"]["Unsharded Param"] > 0
    assert fast == full
