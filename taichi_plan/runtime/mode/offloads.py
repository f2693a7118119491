"""The runtime's offloads (plan v14; :class:`OffloadsMixin`, composed by
:class:`~taichi_plan.runtime.mode.PlanRuntime`): the storages the plan offloads, marked as
their ops run, copied to host after their last forward use and back at their prefetch points or
on demand (the copies themselves: :mod:`taichi_plan.runtime.copies`)."""

from __future__ import annotations

import torch

from ...base.errors import MismatchError
from ..copies import to_device, to_host
from .flatten import flat_tensors
from .frame import Frame


class OffloadsMixin:
    """The offloads of :class:`~taichi_plan.runtime.mode.PlanRuntime`: copies to host and
    back."""

    def _note_offloads(self, frame: Frame, i: int, out) -> None:
        """Mark the outputs of op ``i`` that the plan offloads, and those whose last unpack issues
        copies back (after their recipes, if kept: a storage gets its recipe when its id is new)."""
        call = frame.call
        flat = flat_tensors(out)
        for j, tid in call.offloads.get(i, ()):
            if j < len(flat):
                sid = self._sid(frame, flat[j].untyped_storage())
                frame.offloaded[sid] = tid
                frame.off_sid[tid] = sid
        for j, tids in call.prefetch_triggers.get(i, ()):
            if j < len(flat):
                frame.prefetch_of.setdefault(self._sid(frame, flat[j].untyped_storage()), []).extend(tids)

    def _copy_out_at(self, frame: Frame, i: int) -> None:
        """Op ``i`` ran (and its outputs are noted): copy to host the offloaded storages whose
        last forward use it was; a storage to copy that is gone stops the plan for this call."""
        call = frame.call
        for tid in call.copy_out_at.get(i, ()):
            sid = frame.off_sid.get(tid)
            st = self._alive(frame, sid) if sid is not None else None
            if st is None:
                self._frame_mismatch(frame, (
                    f"The plan copies tensor {tid} to host after op {i} of model call {call.index}, but that storage "
                    "was not made in this call, or is gone by then: the model differs from the recorded one. Record "
                    "and solve again, or apply the plan with on_mismatch='warn'."))
                return
            host, ready = to_host(st)
            frame.host[sid] = (host, ready, st.device)
            self.copies.append(("copy_out", tid, i))

    def _copy_in(self, frame: Frame, sid: int, how: str) -> torch.UntypedStorage:
        """Copy offloaded ``sid`` back (at its prefetch point, or on demand where it is first read:
        its unpack, or a rebuild that reads it)."""
        got = frame.restored.get(sid)
        if got is not None:
            return got[0]
        if sid not in frame.host:
            raise MismatchError(f"Backward needs tensor {frame.offloaded[sid]} back from the host, but it was never "
                                "copied there (its call ended before its last forward use): the plan does not match "
                                "this model. Record and solve again.")
        host, ready, device = frame.host.pop(sid)
        st, done = to_device(host, ready, device)
        frame.restored[sid] = (st, done)
        self.copies.append(("copy_in", frame.offloaded[sid], how))
        return st

    def _prefetch(self, frame: Frame, tids: list[int]) -> None:
        for tid in tids:
            sid = frame.off_sid.get(tid)
            if sid is not None and sid in frame.host and frame.pending.get(sid, 0) > 0:
                self._copy_in(frame, sid, "prefetch")
