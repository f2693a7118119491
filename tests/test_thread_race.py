"""A storage whose last reference dies on another thread (gloo's worker letting go of a
finished collective) is noted by the recorder, and a sharded replay measures another step
when such a storage was live at the measured peak (replay/distributed.py ``_raced``)."""

from __future__ import annotations

import threading

import torch

from taichi_plan.record.recorder import Recorder
from taichi_plan.replay.distributed import _raced
from taichi_plan.trace.format import baseline_peak


def _step(drop_on_thread: bool):
    """Three ops; ``b`` (made by the second) dies after the third, on a helper thread or here."""
    recorder = Recorder(None, None)
    recorder.begin_step([])
    holder: list = []
    with recorder:
        a = torch.ones(1000)
        b = a * 2
        c = b + 1
        holder.append(b)
        del b
        if drop_on_thread:
            t = threading.Thread(target=holder.clear)
            t.start()
            t.join()
        else:
            holder.clear()
        d = c * 3
    rec = recorder.end_step([])
    recorder.close()
    del a, c, d
    return rec, recorder.offthread_freed


def test_a_storage_freed_on_another_thread_is_noted():
    rec, offthread = _step(True)
    assert len(offthread) == 1
    (tid,) = offthread
    assert rec.tensors["nbytes"][tid] == 4000 and rec.tensors["free_op"][tid] == 2  # after `b + 1`
    rec, offthread = _step(False)
    assert offthread == []


def test_a_race_counts_only_where_the_storage_was_live_at_the_peak():
    from taichi_plan.record.api import step_to_trace

    rec, offthread = _step(True)
    (tid,) = offthread
    _peak, peak_op = baseline_peak(step_to_trace(rec, 0, "measured", {}))
    assert _raced(rec, offthread, rec.tensors["alloc_op"][tid]) is True
    assert _raced(rec, offthread, rec.tensors["free_op"][tid] + 1) is False
    assert _raced(rec, [], peak_op) is False
