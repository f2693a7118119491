"""What makes sharded recording and planning affordable at 7B/70B sizes, each checked to change
no number: the FSDPMemTracker check that keeps only the step's peak, and (see test_maxbatch)
the batch search."""

from __future__ import annotations

import pytest


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


def test_a_step_drawn_through_two_recordings_is_the_recorded_one():
    """Rank 0 of a fake 4-rank tiny Llama recorded at batch 2, 3 and 5: the step drawn at 5
    through 2 and 3 has the recording's bytes, shapes and FLOPs, storage by storage, hence its
    peak (the durations nearly); the structure check passes between 2 and 3 and fails against batch 1 (a label
    shift that is a view at batch 1 is a copy above)."""
    import numpy as np

    from taichi_plan.explore.batch_line import line_trace, same_structure
    from taichi_plan.explore.maxbatch import fake_recorder
    from taichi_plan.trace.format import baseline_peak

    record = fake_recorder("llama", device_profile="h100-80gb", fsdp=4, layers=2, hidden=64, heads=4, vocab=500,
                           seq=64)
    t = {b: record(b) for b in (1, 2, 3, 5)}
    assert same_structure(t[2], t[3]) is None and same_structure(t[1], t[2]) is not None
    drawn = line_trace(t[2], 2, t[3], 3, 5)
    for col in ("nbytes", "shape"):
        assert [np.asarray(x).tolist() for x in drawn.tensors[col]] == \
            [np.asarray(x).tolist() for x in t[5].tensors[col]], col
    assert drawn.ops["flops"].tolist() == t[5].ops["flops"].tolist()
    # durations: affine only while an op stays compute- or memory-bound (a few small mm change)
    assert drawn.ops["duration_s"].sum() == pytest.approx(t[5].ops["duration_s"].sum(), rel=1e-3)
    assert baseline_peak(drawn) == baseline_peak(t[5])
    assert drawn.meta["workload"]["args"]["batch"] == 5 and drawn.meta["batch_line"]["from_batches"] == [2, 3]
