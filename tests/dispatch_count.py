"""Which ops reach the replay runtime's dispatch mode: what a plan pays the checking rate on."""

from __future__ import annotations

from taichi_plan.runtime.mode import PlanRuntime


def count_dispatches(monkeypatch) -> list:
    """Patch :class:`PlanRuntime` (until ``monkeypatch.undo()``) so that every op reaching its
    dispatch mode appends to the returned list the planned region running then (its module
    name; None over a whole call). The ``detach`` its pack hook makes of each tensor it keeps
    is the runtime's own work, in the checking rate, and is left out."""
    seen, packing = [], []
    dispatch, pack = PlanRuntime.__torch_dispatch__, PlanRuntime._pack

    def counted(self, func, types, args=(), kwargs=None):
        if not packing:
            frame = self._frame
            seen.append(frame.region[1] if frame is not None and frame.region else None)
        return dispatch(self, func, types, args, kwargs)

    def packed(self, t):
        packing.append(1)
        try:
            return pack(self, t)
        finally:
            packing.pop()

    monkeypatch.setattr(PlanRuntime, "__torch_dispatch__", counted)
    monkeypatch.setattr(PlanRuntime, "_pack", packed)
    return seen
